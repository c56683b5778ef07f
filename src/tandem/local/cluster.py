"""`tandem cluster up`: N brokers on this machine behind one front port, kept by the HA loop.

Layout of the data dir D:

    D/cluster.key        the shared cluster key (created on first start, mode 0600)
    D/election.json      the election record (compare-and-set under D/election.lock)
    D/cluster.json       the front and admin ports, for `tandem cluster status`
    D/tandem-N/          each member's data dir, config (member.yaml) and log (broker.log)

The controller is `tandem.ha.loop` with the ports of `tandem.local.members`; the front port
follows the member that the record names and that serves as primary in the record's epoch.
The admin port answers `GET /cluster` and `POST /cluster/switchover`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tandem.broker.admin import bearer
from tandem.broker.ha_http import Endpoint, HttpActuator, HttpObserver, WakeableClock
from tandem.broker.status import (
    ClusterMember,
    ClusterStatus,
    FrontAddress,
    MemberReport,
    ReplicationStatus,
)
from tandem.broker.store.files import replace_file
from tandem.broker.store.lock import DataDirLock
from tandem.errors import DataDirGone, StartError
from tandem.ha import decide
from tandem.ha import loop as ha_loop
from tandem.ha.model import ElectionRecord, Member, Settings, View
from tandem.local.election import FileElectionStore
from tandem.local.front import Front
from tandem.local.members import Proc, Supervisor

log = logging.getLogger(__name__)

WATCH_SECONDS = 1.0  # how often the cluster checks that its data directory is still there

# Settings the cluster gives each member itself; a --config file's values for them are ignored.
MEMBER_SETTINGS = frozenset(
    {
        "node_id",
        "data_dir",
        "amqp_port",
        "admin_port",
        "replication_port",
        "cluster_key_file",
        "front_socket",
        "isr_min",
        "tls_port",  # the front's AMQPS port; each member takes one of its own
    }
)


def cluster_key(data_dir: Path) -> Path:
    path = data_dir / "cluster.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


class FollowingObserver:
    """The HTTP observer, pointing the front port at the serving primary after each look."""

    def __init__(self, inner: HttpObserver, front: Front, procs: dict[str, Proc]) -> None:
        self.inner, self.front, self.procs = inner, front, procs
        self.record: ElectionRecord | None = None

    async def observe(self, record: ElectionRecord) -> tuple[Member, ...]:
        members = await self.inner.observe(record)
        self.record = record
        serving = self.procs.get(decide.route(View(record, members)) or "")
        self.front.point(serving.front_socket if serving is not None else None)
        return members


class LocalCluster:
    def __init__(
        self,
        data_dir: Path,
        replicas: int,
        *,
        host: str = "127.0.0.1",
        amqp_port: int = 5672,
        admin_port: int = 15672,
        isr_min: int | None = None,
        failover_delay: float = 1.0,
        base_config: dict[str, Any] | None = None,
        link_address: Callable[[Endpoint], str] | None = None,
        tls_port: int | None = None,
        admin_token: str | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.link_address = link_address
        self.nodes = [f"tandem-{i}" for i in range(1, replicas + 1)]
        self.procs = {n: Proc(n, data_dir / n) for n in self.nodes}
        self.isr_min = isr_min if isr_min is not None else min(2, replicas)
        self.settings = Settings(failover_delay=failover_delay, isr_min=self.isr_min)
        self.front = Front(host, amqp_port, tls_port)
        self.admin_token = admin_token
        self.admin_host, self.admin_port = host, admin_port
        self.base_config = {**(base_config or {}), "isr_min": self.isr_min}
        self.store = FileElectionStore(data_dir, self.nodes)
        self.clock = WakeableClock()
        self.controller: ha_loop.Controller | None = None
        self.observer: FollowingObserver | None = None
        self.session: aiohttp.ClientSession | None = None
        self.gone: str | None = None  # why the cluster stopped on its own (_watch)
        self.data_dir_id: tuple[int, int] | None = None  # the data dir it started with

    async def run(self, stop: asyncio.Event) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lock = DataDirLock(self.data_dir)
        lock.acquire("cluster")  # a second `cluster up` on this data dir is refused
        self.data_dir_id = _identity(self.data_dir)
        try:
            await self._run(stop)
        finally:
            lock.release()
        if self.gone is not None:
            raise DataDirGone(self.gone)

    async def _run(self, stop: asyncio.Event) -> None:
        key_file = cluster_key(self.data_dir)
        key = key_file.read_text().strip()
        try:
            self.front.bind()
        except OSError as exc:
            raise _port_error(
                "clients (the front port)", "--amqp-port", self.front.port, exc
            ) from None
        if self.front.tls_port is not None:
            try:
                self.front.bind_tls()
            except OSError as exc:
                raise _port_error(
                    "AMQPS clients (the front port)", "--tls-port", self.front.tls_port, exc
                ) from None
        supervisor = Supervisor(
            self.procs,
            key_file,
            self.base_config,
            self._exited,
            settled=self._settled,
            looked=self.clock.looked,
            on_back=self._back,
        )
        async with aiohttp.ClientSession() as session:
            self.session = session
            polls = HttpObserver(self.procs, session, key)
            polls.failover_delay = self.settings.failover_delay
            observer = FollowingObserver(polls, self.front, self.procs)
            self.observer = observer
            self.controller = ha_loop.Controller(
                "local",
                self.store,
                observer,
                HttpActuator(self.procs, session, key, self.link_address),
                self.clock,
                self.settings,
            )
            try:
                await asyncio.gather(*(supervisor.start(p) for p in self.procs.values()))
                runner = web.AppRunner(self._app(), access_log=None)
                await runner.setup()
                site = web.TCPSite(runner, self.admin_host, self.admin_port)
                try:
                    await site.start()
                except OSError as exc:
                    raise _port_error(
                        "the admin API", "--admin-port", self.admin_port, exc
                    ) from None
                self.admin_port = _bound_port(site, self.admin_port)
                self._announce()
                async with asyncio.TaskGroup() as tg:
                    for p in self.procs.values():
                        tg.create_task(supervisor.keep(p))
                    tg.create_task(self.front.run(stop))
                    tg.create_task(self.controller.run(stop))
                    tg.create_task(self._watch(stop))
                    await stop.wait()
                    self.clock.wake.set()
                    await supervisor.stop()
                await runner.cleanup()
            finally:
                await supervisor.stop()

    async def _watch(self, stop: asyncio.Event) -> None:
        """Stop the cluster if its data directory is deleted under it: the members' logs and
        the election record went with it, so nothing confirmed from then on would survive a
        restart, and the front port (its socket was in there) can reach no member."""
        while not stop.is_set():
            if _identity(self.data_dir) != self.data_dir_id:  # gone, or made again since
                self.gone = (
                    f"the cluster's data directory {self.data_dir} was deleted while the "
                    "cluster ran; its members' logs went with it: stopped"
                )
                log.error("%s", self.gone)
                stop.set()
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), WATCH_SECONDS)

    def _exited(self, proc: Proc) -> None:
        """A member's process ended: the controller looks again at once."""
        if self.front.target == proc.front_socket:
            self.front.point(None)  # hold new connections until a primary is promoted
        self.clock.wake.set()

    def _back(self, proc: Proc) -> None:
        """A member restarted, its store recovered: the controller looks again at once, and
        waits for its answer, to tell it whom to follow (it waited for the next poll, up to
        0.1 s of a rejoin)."""
        if self.observer is not None:
            self.observer.inner.listening(proc.node)
        self.clock.wake.set()

    def _announce(self) -> None:
        info = {
            "amqp": self.front.port,
            "amqps": self.front.tls_port,
            "admin": self.admin_port,
            "pid": os.getpid(),
            "members": {m.node: m.publish() for m in self.describe().members},
        }
        replace_file(self.data_dir / "cluster.json", json.dumps(info))
        print(
            f"tandem cluster of {len(self.nodes)} ready: amqp://guest:guest@{self.front.host}:"
            f"{self.front.port}/ (front port)"
            + (
                f", amqps://{self.front.host}:{self.front.tls_port}/"
                if self.front.tls_port is not None
                else ""
            )
            + f", admin http://{self.admin_host}:{self.admin_port}/cluster",
            flush=True,
        )

    def _member(self, p: Proc, record: ElectionRecord | None, lag: MemberReport) -> ClusterMember:
        alive = p.alive
        s = ReplicationStatus.model_validate(p.status) if alive and p.status else None
        return ClusterMember(
            node=p.node,
            pid=p.process.pid if alive and p.process is not None else None,
            amqp_port=p.amqp_port,
            admin_port=p.admin_port,
            replication_port=p.replication_port,
            tls_port=p.tls_port,
            role=s.role if s is not None else "down",
            epoch=s.epoch if s is not None else None,
            position=s.position if s is not None else None,
            whole=s.whole if s is not None else None,
            diverged=s.diverged if s is not None else None,
            following=s.following if s is not None else None,
            restarts=p.restarts,
            lag_records=lag.lag_records,
            lag_seconds=lag.lag_seconds,
            in_isr=record is not None and p.node in record.isr,
        )

    def _settled(self) -> bool:
        """Every member that runs is in the ISR: none is starting or catching up."""
        record = self.observer.record if self.observer is not None else None
        return record is not None and all(
            p.node in record.isr for p in self.procs.values() if p.alive
        )

    def describe(self) -> ClusterStatus:
        record = self.observer.record if self.observer is not None else None
        lags: dict[str, MemberReport] = {}
        if record is not None and record.holder in self.procs:
            lags = ReplicationStatus.model_validate(self.procs[record.holder].status).members
        controller = self.controller
        return ClusterStatus(
            epoch=record.epoch if record is not None else 0,
            primary=record.holder if record is not None else None,
            isr=sorted(record.isr) if record is not None else [],
            serving=self.front.target is not None,
            front=FrontAddress(
                host=self.front.host, port=self.front.port, tls_port=self.front.tls_port
            ),
            held_connections=len(self.front.held),
            last_decision=(
                controller.last.reason if controller is not None and controller.last else None
            ),
            last_change=(
                controller.last_change.reason
                if controller is not None and controller.last_change
                else None
            ),
            members=[
                self._member(p, record, lags.get(n) or MemberReport())
                for n, p in self.procs.items()
            ],
        )

    def _app(self) -> web.Application:
        async def cluster(request: web.Request) -> web.Response:
            return web.json_response(self.describe().publish())

        async def switchover(request: web.Request) -> web.Response:
            body: dict[str, Any] = {}
            if await request.read():
                try:
                    body = await request.json()
                except ValueError:
                    return web.json_response({"error": "the body must be JSON"}, status=400)
            record = await self.store.read()
            target = body.get("to") if isinstance(body, dict) else None
            if target is None:
                others = sorted(record.isr - {record.holder})
                if not others:
                    return web.json_response(
                        {"error": "no other in-sync member to switch over to"}, status=409
                    )
                target = others[0]
            if target not in self.procs:
                return web.json_response({"error": f"no member '{target}'"}, status=404)
            assert self.controller is not None
            self.controller.switchover_to = str(target)
            self.clock.wake.set()
            return web.json_response({"switchover_to": target})

        async def forward(request: web.Request) -> web.StreamResponse:
            """Everything else goes to the primary's admin API (/status, /metrics, /api/*),
            so `tandem ctl` and curl work against the cluster's one address."""
            record = self.observer.record if self.observer is not None else None
            primary = self.procs.get(record.holder or "") if record is not None else None
            if primary is None or not primary.alive or self.front.target is None:
                return web.json_response(
                    {"error": "no primary serves right now (a failover is in progress)"},
                    status=503,
                )
            url = f"http://127.0.0.1:{primary.admin_port}{request.rel_url}"
            passed = ("Authorization", "Content-Type", "If-Match", "If-None-Match")
            headers = {k: v for k, v in request.headers.items() if k in passed}
            assert self.session is not None
            try:
                async with self.session.request(
                    request.method,
                    url,
                    data=await request.read(),
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=30),
                ) as resp:
                    body = await resp.read()
                    ctype = resp.headers.get("Content-Type", "application/json")
                    return web.Response(
                        status=resp.status, body=body, headers={"Content-Type": ctype}
                    )
            except (aiohttp.ClientError, TimeoutError) as exc:
                return web.json_response(
                    {"error": f"the primary {primary.node} did not answer: {exc!r}"}, status=503
                )

        @web.middleware
        async def auth(
            request: web.Request,
            handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
        ) -> web.StreamResponse:
            """The admin token guards the cluster's own endpoints as the members' guard
            theirs; everything forwarded carries the client's Authorization to the primary,
            which checks it."""
            token = self.admin_token
            if token and request.path.startswith("/cluster") and not bearer(request, token):
                return web.json_response(
                    {
                        "error": "a valid bearer token is required: send 'Authorization: "
                        "Bearer <token>' (tandem cluster status: --token or "
                        "TANDEM_ADMIN_TOKEN)"
                    },
                    status=401,
                )
            return await handler(request)

        app = web.Application(middlewares=[auth])
        app.add_routes(
            [
                web.get("/cluster", cluster),
                web.post("/cluster/switchover", switchover),
                web.route("*", "/{tail:.*}", forward),
            ]
        )
        return app


def _port_error(what: str, option: str, port: int, exc: OSError) -> StartError:
    return StartError(
        f"cannot listen for {what} on port {port}: {exc.strerror or exc}; choose another "
        f"with {option}, or 0 for a free one"
    )


def _bound_port(site: web.TCPSite, default: int) -> int:
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    return int(sockets[0].getsockname()[1]) if sockets else default


def _identity(path: Path) -> tuple[int, int] | None:
    """The directory's device and inode: a directory made again under the same name is not
    the one the cluster started with."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


async def up(cluster: LocalCluster) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await cluster.run(stop)
