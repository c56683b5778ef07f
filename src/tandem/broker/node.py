"""One broker node: wires the model, the store, the AMQP listeners and the admin API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import shutil
import signal
import socket
import ssl
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiohttp import web

from tandem import _compiled, errors
from tandem.broker import admin, server
from tandem.broker.config import Config
from tandem.broker.model import apply, definitions, records
from tandem.broker.model.broker import Broker
from tandem.broker.model.journal import Sequencer
from tandem.broker.model.spec import UserSpec
from tandem.broker.protocol import channel as channel_mod
from tandem.broker.protocol import connection as conn_mod
from tandem.broker.replication import member as member_mod
from tandem.broker.replication.core import Boundaries
from tandem.broker.status import NodeStatus, QueueStatus
from tandem.broker.store.files import replace_file
from tandem.broker.store.lock import DataDirLock
from tandem.broker.store.log import Store

log = logging.getLogger(__name__)
T = TypeVar("T")

SWEEP_SECONDS = 1.0
ALARM_SECONDS = 1.0
QUEUE_MEMORY_FLOOR = 32 * 1024 * 1024
# Messages queued under which a full garbage collection may walk everything (a thaw,
# broker/collector.py): 200,000 take about 0.1 s to walk.
QUIET_MESSAGES = 200_000
# How long a restarted member waits, before it loads its store, for the controller to have it
# follow its primary and its Hello to go out (`Node._hello_first`): at most the first, and no
# longer than the second after the controller's first look at it (`/status?brief=1`), which it
# answers with a follow at once where there is a primary; a decision that comes first (every
# 0.1 s in a local cluster, 0.4 s by default on Kubernetes) puts it off by a look.
HELLO_WAIT_SECONDS = 1.0
HELLO_WAIT_AFTER_LOOK = 0.5


def _machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


async def _joined(task: asyncio.Task[None]) -> None:
    """Wait for a task started before the task group that waits for it."""
    await task


def _raise_fd_limit(wanted: int) -> int:
    """Let the node hold as many sockets as it accepts connections (soft limit up to hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard == resource.RLIM_INFINITY else min(hard, max(soft, wanted))
    if target > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
    return soft


async def _listen(what: str, option: str, host: str, port: int, start: Awaitable[T]) -> T:
    """Await a listener's start; a port that cannot be bound is an error naming its option."""
    try:
        return await start
    except OSError as exc:
        hint = f"choose another with {option}, or 0 for a free one"
        raise errors.StartError(
            f"cannot listen for {what} on {host}:{port}: {exc.strerror or exc}; {hint}"
        ) from None


def _hold_port(host: str, port: int) -> socket.socket | None:
    """A socket bound to `host`:`port`, not listening, for the admin API to listen on again
    after a restarted member's load: meanwhile a connection to it is refused at once, and
    neither a connection's socket nor a bind to port 0 nor one without SO_REUSEADDR can take
    the port (binding it anew after the load, a member of a cluster started again found it
    taken, and could not start; only a server that binds that very port with SO_REUSEADDR
    and listens first can). None where `host` names several addresses, or the port was
    taken already: the API binds it anew, as before."""
    try:
        [(family, kind, proto, _name, address)] = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM
        )
    except (OSError, ValueError):
        return None
    sock = socket.socket(family, kind, proto)
    try:
        # As the API's own: the early API's connections may wait in TIME_WAIT on the port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio's
        sock.bind(address)
    except OSError as exc:
        sock.close()
        log.info("the admin API's port %d not held while the store loads: %s", port, exc)
        return None
    return sock


def _cluster_key(cfg: Config) -> bytes:
    """The secret every member of a cluster shares: from `cluster_key_file` or the
    TANDEM_CLUSTER_KEY environment variable."""
    if cfg.cluster_key_file is not None:
        try:
            key = cfg.cluster_key_file.read_text().strip()
        except OSError as exc:
            raise errors.ConfigError(
                f"cluster_key_file: cannot read {cfg.cluster_key_file}: {exc.strerror or exc}"
            ) from None
    else:
        key = os.environ.get("TANDEM_CLUSTER_KEY", "").strip()
    if len(key) < 16:
        raise errors.ConfigError(
            "a cluster member (replication_port set) needs a cluster key of at least 16 "
            "characters: set cluster_key_file or TANDEM_CLUSTER_KEY"
        )
    return key.encode()


class Node:
    """Implements the protocol layer's Hub port."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.store: Store | None = None
        self.lock: DataDirLock | None = None
        self.memory_limit = cfg.memory_high_watermark or int(_machine_memory() * 0.4)
        if cfg.data_dir is not None:
            self.lock = DataDirLock(cfg.data_dir)
            self.lock.acquire(cfg.node_id)
            self.store = Store(
                cfg.data_dir,
                fsync=cfg.fsync,
                segment_bytes=cfg.segment_bytes,
                # Deep queues page; a cluster member's pages know their messages' ids (its
                # digest and the primary's copies are made of them).
                page_bytes=self._queue_memory(),
                keep_ids=cfg.replication_port is not None,
                checkpoint_records=cfg.checkpoint_records,
            )
        self.sequencer = Sequencer(self.store)
        self.broker = Broker(self.sequencer)
        self.broker.default_replicate = cfg.default_replicate
        self.broker.guest_remote = cfg.guest_remote
        # A cluster member (replication_port set) serves clients only once the controller
        # makes it primary; until then it refuses them, naming the primary when it knows it.
        self.member: member_mod.Member | None = None
        self.cluster_key = _cluster_key(cfg) if cfg.replication_port is not None else None
        self.role = "standalone" if self.cluster_key is None else "backup"
        self.refusal: str | None = (
            None if self.cluster_key is None else "this node is a cluster backup; no primary yet"
        )
        self.primary_amqp: str | None = None
        self.limits = conn_mod.Limits(
            frame_max=cfg.frame_max,
            channel_max=cfg.channel_max,
            heartbeat=cfg.heartbeat,
            max_message_size=cfg.max_message_size,
            cluster_name=cfg.node_id,
        )
        self.blocked_reason: str | None = None
        self.alarms: dict[str, str] = {}
        self.in_flow = False  # publishers are not read: the ISR is behind (flow control)
        self.not_applied: list[str] = []  # records recovery could not apply (a bug)
        self.reply_to: dict[str, channel_mod.Consumer] = {}
        self.connections: set[server.AMQPProtocol] = set()
        self.ready = False
        # The store is loaded: a member started before it was (`Member.loaded`) answers its
        # controller meanwhile, and promotes itself only once it is.
        self.loaded = asyncio.Event()
        self.looked = asyncio.Event()  # `/status?brief=1` answered: the controller looked
        self.prepared = False  # `prepare` ran: `told` is what the start tells the primary
        self.told: tuple[int, Boundaries] | None = None
        self.amqp_port = 0
        self.tls_port: int | None = None
        self.amqps_context: ssl.SSLContext | None = None
        self.admin_port = 0
        self._auth_file = cfg.data_dir / "auth.json" if cfg.data_dir else None
        self.definitions = self._read_definitions()
        self._setup_auth()

    def _queue_memory(self) -> int:
        """A queue's memory budget (docs/configuration.md, `queue_memory_bytes`)."""
        if self.cfg.queue_memory_bytes is not None:
            return self.cfg.queue_memory_bytes
        return max(QUEUE_MEMORY_FLOOR, self.memory_limit // 32)

    # -- users and vhosts --

    def _setup_auth(self) -> None:
        cfg = self.cfg
        for name in cfg.vhosts:
            self.broker.add_vhost(name)
        if not cfg.users:
            guest = UserSpec(name="guest", password="guest", tags=["administrator"])
            self.broker.add_user(guest, cfg.guest_remote)
            for name in cfg.vhosts:
                self.broker.grant("guest", name)
        for u in cfg.users:
            self.broker.add_user(u, cfg.guest_remote)
        for p in cfg.permissions:
            self.broker.set_permission(p)
        if self.definitions is not None:
            definitions.apply_auth(self.broker, self.definitions, cfg.guest_remote)
        if self._auth_file is not None and self._auth_file.exists():
            try:
                data = json.loads(self._auth_file.read_text())
            except (OSError, ValueError) as exc:
                raise errors.ConfigError(f"cannot read {self._auth_file}: {exc}") from None
            self._load_auth(definitions.validate(data, str(self._auth_file)))

    def _read_definitions(self) -> dict[str, Any] | None:
        path = self.cfg.definitions
        if not path:
            return None
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise errors.ConfigError(f"cannot read definitions {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise errors.ConfigError(f"definitions {path} are not valid JSON: {exc}") from None
        data = definitions.validate(data, str(path))
        for key in definitions.UNSUPPORTED:
            if data.get(key):
                log.warning(
                    "%s: '%s' are RabbitMQ features Tandem does not have; skipped", path, key
                )
        return data

    def _load_auth(self, data: dict[str, Any]) -> None:
        """Runtime-managed users, vhosts and permissions replace the configured ones."""
        definitions.replace_auth(self.broker, data, self.cfg.guest_remote)

    def save_auth(self) -> None:
        """Persist users, vhosts and permissions changed at runtime, in RabbitMQ's
        definitions format (password hashes only). A lone node or a primary records them in
        its log, as one record (a backup takes it and saves it too), so that a restart
        replays them in their place among the other changes: a vhost deleted and made again
        is there after the restart, not deleted by the older record. auth.json is what a
        start begins from when compaction has dropped the records."""
        auth = definitions.export_auth(self.broker)
        if self.role != "backup":
            self.sequencer.define("", "auth", auth, True)
        if self._auth_file is None:
            return
        replace_file(self._auth_file, json.dumps(auth, indent=1))

    def delete_vhost(self, name: str) -> bool:
        for proto in list(self.connections):
            if proto.conn is not None and proto.conn.vhost_name == name:
                proto.conn.force_close(320, f"vhost '{name}' is deleted")
        ok = self.broker.delete_vhost(name)
        for key in [k for k in self.broker.users.permissions if k[1] == name]:
            del self.broker.users.permissions[key]
        return ok

    # -- alarms --

    def set_alarm(self, name: str, reason: str | None) -> None:
        if reason is None:
            if self.alarms.pop(name, None) is not None:
                log.warning("%s alarm cleared", name)
        elif name not in self.alarms:
            log.warning("%s alarm set: %s; publishers are blocked", name, reason)
            self.alarms[name] = reason
        was = self.blocked_reason
        self.blocked_reason = "; ".join(self.alarms.values()) or None
        if was is None and self.blocked_reason is not None:
            for proto in list(self.connections):
                if proto.conn is not None:
                    proto.conn.notify_blocked(self.blocked_reason)
        elif was is not None and self.blocked_reason is None:
            for proto in list(self.connections):
                if proto.conn is not None:
                    proto.conn.unblock()

    def check_alarms(self) -> None:
        rss = _rss()
        self.set_alarm(
            "memory",
            f"memory in use {rss} above the high watermark {self.memory_limit}"
            if rss > self.memory_limit
            else None,
        )
        if self.cfg.data_dir is not None:
            free = shutil.disk_usage(self.cfg.data_dir).free
            self.set_alarm(
                "disk",
                f"free disk space {free} below the limit {self.cfg.disk_free_limit}"
                if free < self.cfg.disk_free_limit
                else None,
            )

    # -- the member's hooks: role changes --

    def promoted(self, epoch: int) -> None:
        log.warning("node %s is primary of epoch %d", self.cfg.node_id, epoch)
        self.role, self.refusal = "primary", None
        # Exclusive queues copied from the old primary: their owners' connections were there.
        dropped = apply.drop_exclusive(self.broker)
        if dropped:
            log.info("exclusive queues gone with the old primary: %s", ", ".join(dropped))

    def demoted(self, epoch: int) -> None:
        self.role = "backup"
        self.refusal = "this node is a cluster backup; it lost the primary role"
        self._close_clients(f"this node is no longer the primary (epoch {epoch})")

    def following(self, primary: str, amqp: str | None) -> None:
        if self.role == "backup":
            where = f" at {amqp}" if amqp else ""
            self.refusal = f"this node is a cluster backup; the primary is {primary}{where}"

    def lease(self, lapsed: bool) -> None:
        if not lapsed:
            if self.role == "primary":
                self.refusal = None
            return
        self.refusal = "this primary's lease lapsed: the cluster's controller is not reachable"
        self._close_clients(self.refusal)

    def _close_clients(self, why: str) -> None:
        for proto in list(self.connections):
            if proto.conn is not None:
                proto.conn.force_close(320, f"CONNECTION_FORCED - {why}")
                proto.flush()

    def isr_blocked(self, reason: str | None) -> None:
        self.set_alarm("replication", reason)

    def flow(self, on: bool) -> None:
        """Flow control (replication/member.py's `_pace`): unlike an alarm, clients are not
        told; a connection that publishes is read no more after its next batch, as RabbitMQ
        does under credit flow."""
        self.in_flow = on
        if not on:
            for proto in list(self.connections):
                if proto.conn is not None:
                    proto.conn.flow_over()

    # -- status --

    def quiet(self) -> bool:
        """Few messages queued: a full garbage collection may walk everything
        (broker/collector.py)."""
        queued = sum(q.depth for vh in self.broker.vhosts.values() for q in vh.queues.values())
        return queued < QUIET_MESSAGES

    def status(self, brief: bool = False) -> NodeStatus:
        if brief:
            self.looked.set()  # by the controller (`ha_http`)
        journal = self.broker.journal
        queues = (
            []
            if brief
            else [
                QueueStatus(
                    vhost=vh.name,
                    name=q.name,
                    depth=q.depth,
                    ready=q.ready,
                    unacked=q.unacked,
                    paged=q.paged,
                    consumers=len(q.consumers),
                    durable=q.durable,
                    replicate=q.replicate,
                )
                for vh in self.broker.vhosts.values()
                for q in vh.queues.values()
            ]
        )
        member = self.member.status().publish() if self.member is not None else {}
        return NodeStatus.model_validate(
            {
                **member,
                "node": self.cfg.node_id,
                "role": self.role,
                "epoch": member.get("epoch", journal.epoch),
                "position": member.get("position", journal.offset),
                "primary": (
                    self.cfg.node_id
                    if self.role != "backup"
                    else self.member.replica.following
                    if self.member is not None
                    else None
                ),
                "amqp_port": self.amqp_port,
                "admin_port": self.admin_port,
                "connections": len(self.connections),
                "alarms": dict(self.alarms),
                "store": self.store.stats() if self.store is not None else None,
                "queues": queues,
                "not_applied": self.not_applied
                + [
                    f"{e}:{o} {what}"
                    for e, o, what in (
                        self.member.log.not_applied if self.member is not None else []
                    )
                ],
            }
        )

    # -- running --

    def _tls_context(self) -> ssl.SSLContext | None:
        cfg = self.cfg
        if cfg.tls_certfile is None or cfg.tls_keyfile is None:
            return None
        for name in ("tls_certfile", "tls_keyfile", "tls_cafile"):
            path = getattr(cfg, name)
            if path is not None and not os.access(path, os.R_OK):
                raise errors.ConfigError(f"{name}: cannot read {path}")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(cfg.tls_certfile, cfg.tls_keyfile)
            if cfg.tls_cafile:
                ctx.load_verify_locations(cfg.tls_cafile)
        except (OSError, ssl.SSLError) as exc:
            raise errors.ConfigError(
                f"cannot load the TLS certificate {cfg.tls_certfile} with key "
                f"{cfg.tls_keyfile}: {exc}"
            ) from None
        if cfg.tls_verify_peer:
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    async def run(self, stop: asyncio.Event | None = None) -> None:
        cfg = self.cfg
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        if os.environ.get("TANDEM_TEST_FAULT_BYTES_AS_TEXT"):
            log.warning("TEST FAULT: records write byte strings as text")
            records.BYTES_AS_TEXT = True
        if os.environ.get("TANDEM_TEST_FAULT_APPLY_CHECKS"):
            apply.CHECK_AGAIN = True
            log.warning("TEST FAULT: apply checks reserved queue names again")
        if os.environ.get("TANDEM_TEST_FAULT_NOT_APPLIED"):
            apply.UNAPPLIABLE = os.environ["TANDEM_TEST_FAULT_NOT_APPLIED"]
            log.warning("TEST FAULT: records declaring %s do not apply", apply.UNAPPLIABLE)
        member_run: asyncio.Task[None] | None = None
        admin_held: socket.socket | None = None  # the admin API's port, while the store loads
        lost = False  # recovery left out something the log names
        if not self.prepared:
            self.prepare()
        told = self.told
        if told is not None:
            # A member restarted with records: the controller may have it follow its primary
            # before its store is loaded. It tells the primary the end its start is to
            # recover, and the primary makes its copy while it loads (`Member.loaded`): the
            # loop is held by the load, not by the wait for the copy after it.
            self.member = await self._start_member(told)
            member_run = asyncio.create_task(self.member.run(stop))
            if self.member.log.restarted:  # else its Hello needs the state loaded
                early, self.admin_port = await self._start_admin(cfg.admin_port, 1.0)
                try:
                    await self._hello_first(self.member)
                finally:
                    # Closed while the load holds the loop: a look at it would wait for an
                    # answer, and the controller's decisions with it, where a refusal is
                    # at once (`ha_http`).
                    await early.cleanup()
                admin_held = _hold_port(cfg.admin_host, self.admin_port)
        if self.store is not None:
            result = self.store.open(
                self.broker, self.sequencer, loop, stop_at_corrupt=self.cluster_key is not None
            )
            self.store.on_write_error = lambda err: self.set_alarm(
                "log", None if err is None else f"cannot write the log: {err}"
            )
            admin.bind_store_metrics(self.store)
            log.info(
                "recovered %d messages from %s: %s, then %d records of the log replayed (in "
                "%.2f s: the checkpoint %.2f s, the replay %.2f s)",
                result.messages,
                self.cfg.data_dir,
                "no checkpoint"
                if result.from_checkpoint is None
                else f"a checkpoint naming {result.from_checkpoint}",
                result.records,
                result.seconds,
                result.checkpoint_seconds,
                result.replay_seconds,
            )
            self.not_applied = list(result.not_applied)
            if result.exclusive_dropped:
                log.info(
                    "exclusive queues gone with their connections: %s",
                    ", ".join(result.exclusive_dropped),
                )
            if self.cluster_key is not None and (result.corrupt or result.not_applied):
                # Its state is not all its records say (a message a checkpoint named was
                # left out): the primary needs its digest, not its log's end (`digest`).
                lost = True
        if self.cluster_key is not None:
            if self.member is None:
                self.member = await self._start_member(None)
            if lost:
                self.member.log.lost = True
            self.member.loaded()
        else:
            # A lone node that (re)starts serving is a new primary term: nothing it records
            # now can share a position with a record of an earlier life that did not reach
            # the disk. A cluster member's terms come from the controller.
            self.sequencer.begin_term(self.sequencer.epoch + 1)
        if self.definitions is not None:
            definitions.apply_entities(self.broker, self.definitions, str(self.cfg.definitions))
        self.loaded.set()
        fds = _raise_fd_limit(cfg.max_connections + 256)
        if fds < cfg.max_connections + 64:
            log.warning(
                "open-file limit %d is below max_connections %d; raise it (ulimit -n)",
                fds,
                cfg.max_connections,
            )
        tls = self.amqps_context = self._tls_context()
        amqp = await _listen(
            "AMQP",
            "--amqp-port (or amqp_port)",
            cfg.host,
            cfg.amqp_port,
            server.serve(
                self.broker,
                self,
                self.limits,
                cfg.host,
                cfg.amqp_port,
                self.connections,
                cfg.max_connections,
            ),
        )
        self.amqp_port = amqp.sockets[0].getsockname()[1]
        servers = [amqp]
        if tls is not None:
            amqps = await _listen(
                "AMQPS",
                "tls_port",
                cfg.host,
                cfg.amqps_port,
                server.serve(
                    self.broker,
                    self,
                    self.limits,
                    cfg.host,
                    cfg.amqps_port,
                    self.connections,
                    cfg.max_connections,
                    ssl=tls,
                ),
            )
            self.tls_port = amqps.sockets[0].getsockname()[1]
            servers.append(amqps)
        runner, self.admin_port = await self._start_admin(
            self.admin_port or cfg.admin_port, sock=admin_held
        )
        self._announce()
        self.ready = True
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._every(SWEEP_SECONDS, self._sweep, stop))
                if member_run is not None:
                    tg.create_task(_joined(member_run))
                elif self.member is not None:
                    tg.create_task(self.member.run(stop))
                if cfg.front_socket is not None:
                    tg.create_task(server.receive_sockets(str(cfg.front_socket), self._adopt, stop))
                tg.create_task(self._every(ALARM_SECONDS, self.check_alarms, stop))
                await stop.wait()
        finally:
            self.ready = False
            log.info("node %s stopping", cfg.node_id)
            for srv in servers:
                srv.close()
            for proto in list(self.connections):
                if proto.conn is not None:
                    proto.conn.force_close(320, "CONNECTION_FORCED - broker shutdown")
                    proto.flush()
            await self._drain_store()
            await runner.cleanup()
            if self.store is not None:
                self.store.close()
            if self.lock is not None:
                self.lock.release()

    async def _start_member(self, predicted: tuple[int, Boundaries] | None) -> member_mod.Member:
        """This cluster member's replication, listening; with the end and boundaries its
        store is to recover (`Store.predict`) while it is not loaded yet."""
        cfg = self.cfg
        member = member_mod.Member(
            cfg.node_id,
            self.broker,
            self.sequencer,
            self.store,
            self,
            key=self.cluster_key or b"",
            data_dir=cfg.data_dir,
            isr_min=cfg.isr_min,
            lease=cfg.lease_seconds,
            host=cfg.replication_host,
            port=cfg.replication_port or 0,
            server_ssl=self._tls_context() if cfg.replication_tls else None,
            client_ssl=self._client_tls() if cfg.replication_tls else None,
            predicted=predicted,
        )
        member.log.on_auth = self.save_auth
        await _listen(
            "replication",
            "--replication-port (or replication_port)",
            cfg.replication_host,
            cfg.replication_port or 0,
            member.start(),
        )
        return member

    async def _hello_first(self, member: member_mod.Member) -> None:
        """Before a restarted member loads its store: wait for its Hello to go out to the
        primary the controller has it follow, at most HELLO_WAIT_SECONDS, and at most
        HELLO_WAIT_AFTER_LOOK after the controller first looked at it (no primary to follow:
        a cluster starting)."""
        said = asyncio.ensure_future(member.said_hello.wait())
        looked = asyncio.ensure_future(self.looked.wait())
        try:
            loop = asyncio.get_running_loop()
            until = loop.time() + HELLO_WAIT_SECONDS
            await asyncio.wait(
                {said, looked}, timeout=HELLO_WAIT_SECONDS, return_when=asyncio.FIRST_COMPLETED
            )
            if looked.done() and not said.done():
                left = min(HELLO_WAIT_AFTER_LOOK, until - loop.time())
                await asyncio.wait({said}, timeout=max(left, 0.0))
        finally:
            said.cancel()
            looked.cancel()

    async def _start_admin(
        self, port: int, shutdown_timeout: float = 60.0, sock: socket.socket | None = None
    ) -> tuple[web.AppRunner, int]:
        cfg = self.cfg
        return await _listen(
            "the admin API",
            "--admin-port (or admin_port)",
            cfg.admin_host,
            port,
            admin.start(self, cfg.admin_host, port, shutdown_timeout, sock),
        )

    def prepare(self, early: bool = False) -> None:
        """Read what `run` tells the primary before it loads (`_predict`). A spare told
        to become a member that exited does it `early`, while its cluster waits to start it
        (`cli._broker`); `run` does it otherwise."""
        self.told = self._predict()
        self.prepared = True
        if early:
            log.info(
                "node %s: the end of its log read while its cluster waited to start it: %s",
                self.cfg.node_id,
                "nothing to tell" if self.told is None else f"offset {self.told[0]}",
            )

    def _predict(self) -> tuple[int, Boundaries] | None:
        """The end and boundaries a cluster member's store is to recover, told before it
        loads (`Store.predict`); None for a lone node, an empty log, or nothing to tell."""
        if self.cluster_key is None or self.store is None:
            return None
        try:
            told = self.store.predict()
        except Exception as exc:  # only a head start: the load reads the same files
            log.warning("the log's end not told before loading it: %r", exc)
            return None
        if told is None or told[0] == 0:
            return None
        if os.environ.get("TANDEM_TEST_FAULT_PREDICT_SHORT"):
            log.warning("TEST FAULT: the end told before loading is one record short")
            return told[0] - 1, tuple(told[1])
        return told[0], tuple(told[1])

    async def _adopt(self, sock: socket.socket, tls: bool) -> None:
        """A client the front port accepted (on its AMQPS port with `tls`): served here
        while this node is primary."""
        if self.role == "backup":
            sock.close()  # the client reconnects through the front port to the new primary
            return
        if tls and self.amqps_context is None:
            log.warning("front port: an AMQPS client, but this node has no TLS; closed")
            sock.close()
            return
        await server.adopt(
            sock,
            self.broker,
            self,
            self.limits,
            self.connections,
            self.cfg.max_connections,
            self.amqps_context if tls else None,
        )

    def _sweep(self) -> None:
        """Expiry and idle queues are the primary's decisions; a backup applies them."""
        if self.role != "backup":
            self.broker.sweep()

    def _client_tls(self) -> ssl.SSLContext:
        cfg = self.cfg
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.tls_cafile)
        if cfg.tls_certfile is not None and cfg.tls_keyfile is not None:
            ctx.load_cert_chain(cfg.tls_certfile, cfg.tls_keyfile)
        ctx.check_hostname = False  # members are named by the cluster key and the CA
        return ctx

    async def _drain_store(self) -> None:
        if self.store is None:
            return
        done = asyncio.Event()
        self.store.when_synced(done.set)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 10)

    async def _every(self, seconds: float, fn: Any, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                fn()
            except Exception:
                log.exception("unexpected error, please report it as a bug: %s", fn.__name__)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), seconds)

    def _announce(self) -> None:
        ports = {
            "amqp": self.amqp_port,
            "admin": self.admin_port,
            "amqps": self.tls_port,
            "replication": self.member.port if self.member is not None else None,
            "pid": os.getpid(),
            "node": self.cfg.node_id,
        }
        line = (
            f"tandem node {self.cfg.node_id} ready: amqp={self.amqp_port} "
            f"admin={self.admin_port}"
            + (f" amqps={self.tls_port}" if self.tls_port else "")
            + (f" replication={self.member.port}" if self.member is not None else "")
        )
        print(line, flush=True)
        log.info("%s", line)
        if _compiled.WHY_NOT is None:
            log.info("running compiled: %d modules (mypyc)", len(_compiled.MODULES))
        else:
            log.info("running as pure Python: %s", _compiled.WHY_NOT)
        if not records.CRC32C_IN_C:
            log.warning(
                "google-crc32c has no C extension here: new log records are checksummed "
                "with zlib's CRC-32 (magic TL), 7 times slower for large messages than "
                "CRC-32C with it; records of another member's CRC-32C are checked in Python"
            )
        if self.cfg.data_dir is not None:
            replace_file(self.cfg.data_dir / "ports.json", json.dumps(ports))
