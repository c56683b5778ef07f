"""A cluster member's replication: an asyncio shell around `core.Replica`.

It owns the replication listener, the link a backup keeps to its primary, the controller's
commands (fence, promote, follow, and the election record's ISR), and the Sequencer's
`Shipper` port on a primary. Every decision is the core's; this module moves its messages:

- a backup connects to the primary, proves it holds the cluster key (an HMAC of the
  primary's challenge), says Hello and applies what it is sent; it acks only once the
  durable records among them are on its disk (rule 3's "on disk");
- a primary ships each batch of frames to every follower on the loop turn it was made when
  a confirm or a reply waits for it; what nothing waits for yet (a consumer's acks, delivery
  marks) goes with the next batch that something does, or after `LAZY_SECONDS`, so that it
  costs the members no write, fsync and ack of its own;
- a primary whose followers have not acked enough of its records to confirm them (more than
  `FLOW_RECORDS` or `FLOW_BYTES`) stops reading its publishers until they have caught up to
  half of that (the node's flow control): a publisher that does not wait for confirms would
  otherwise run ahead of the members until the controller drops them from the ISR;
- a follower whose unsent bytes pass `SLOW_BYTES` beyond the largest write among them (one
  message, however large, or a copy) is disconnected: the primary's memory stays bounded,
  the controller drops the member from the ISR (rule 4), and it catches up later;
- the epoch and the cluster id live in `<data_dir>/cluster.json`, written before an answer
  leaves, so a restart never forgets an epoch it adopted (rule 1), and a member whose store
  belongs to another cluster refuses to join and says why.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import os
import secrets
import ssl
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, Protocol, cast

from tandem.broker.model import apply, records
from tandem.broker.model.broker import Broker
from tandem.broker.model.journal import Sequencer
from tandem.broker.replication import core, wire
from tandem.broker.replication.link import Link
from tandem.broker.replication.log import BrokerLog, Copy
from tandem.broker.status import MemberReport, ReplicationStatus
from tandem.broker.store.files import replace_file
from tandem.broker.store.log import Store
from tandem.ha import fencing
from tandem.ha.model import ElectionRecord, Role

log = logging.getLogger(__name__)

# SLOW_BYTES, FLOW_RECORDS and HANDSHAKE_SECONDS are not Final, as this module's other
# constants are: tests set them small.
SLOW_BYTES = 64 << 20  # unsent bytes to one follower before it is cut off
# Records or bytes a primary holds that are not yet confirmed, before its publishers are read
# no more; they are read again at half of these. The bytes are half of what gets a follower
# cut off (SLOW_BYTES). The records bound how far the ISR runs behind a publisher that does
# not wait for confirms, and so what a member killed meanwhile has to take back when it
# restarts: at 50,000 (half of ha.model.Settings's max_lag_records) a backup killed under
# such a load restarted up to 65,000 records short, and took up to 5 s to be back in the
# ISR; at 10,000, 1.4 s at most in 35 kills (docs/performance.md, issue 16).
FLOW_RECORDS = 10_000
FLOW_BYTES: Final = SLOW_BYTES // 2
CHECKPOINT_EVERY: Final = 10_000  # records between the primary's audit checkpoints
CHECKPOINTS_KEPT: Final = 100
RETRY_SECONDS: Final = 0.2  # between attempts to reach the primary
TICK_SECONDS: Final = 0.5  # a backup repeats its ack (or its Hello) this often
LAZY_SECONDS: Final = 0.01  # records no confirm waits for (acks, delivery marks) ship within this
# a primary the controller has not renewed for this long closes its clients
LEASE_SECONDS: Final = 10.0
HANDSHAKE_SECONDS = 10.0  # each step of a link's handshake: a peer silent longer is closed


class Hooks(Protocol):
    """What the member needs of its node."""

    def promoted(self, epoch: int) -> None:
        """This node is primary of `epoch`: serve clients."""

    def demoted(self, epoch: int) -> None:
        """A higher epoch was seen: close clients (320) and stop serving."""

    def isr_blocked(self, reason: str | None) -> None:
        """Below the ISR minimum, publishers are blocked (connection.blocked)."""

    def flow(self, on: bool) -> None:
        """Too much is not confirmed yet: read publishers no more (on), or again (off)."""

    def following(self, primary: str, amqp: str | None) -> None:
        """This backup replicates from `primary`, whose clients connect to `amqp`."""

    def lease(self, lapsed: bool) -> None:
        """The controller stopped renewing this primary (close clients, refuse new ones), or
        renewed it again."""


class RefusedError(Exception):
    """The other end will not replicate with this one, for the reason given; `final` when
    trying again cannot help (the store belongs to another cluster)."""

    def __init__(self, reason: str, final: bool = False) -> None:
        super().__init__(reason)
        self.final = final


class State:
    """`<data_dir>/cluster.json`: the highest epoch adopted and the cluster this store is in."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.epoch = 0
        self.cluster = ""
        if path is not None and path.exists():
            data = json.loads(path.read_text())
            self.epoch, self.cluster = int(data.get("epoch", 0)), str(data.get("cluster", ""))

    def save(self, epoch: int, cluster: str) -> None:
        if (epoch, cluster) == (self.epoch, self.cluster):
            return
        self.epoch, self.cluster = epoch, cluster
        if self.path is None:
            return
        replace_file(self.path, json.dumps({"epoch": epoch, "cluster": cluster}), durable=True)


class _Making:
    """A copy being made for a follower: what else was to go to it meanwhile."""

    __slots__ = ("held", "largest", "made", "size", "started")

    def __init__(self, made: asyncio.Future[list[bytes]]) -> None:
        self.made = made  # the copy's bytes, once made
        self.held: list[bytes] = []
        self.size = 0
        self.largest = 0  # the largest write of `held` (one message, or an Append in parts)
        self.started = time.monotonic()


class _Ack:
    """An ack waiting for the disk: it goes once the write that `point` names is done."""

    __slots__ = ("dest", "msg", "point")

    def __init__(self, dest: str, msg: core.Ack, point: int) -> None:
        self.dest, self.msg, self.point = dest, msg, point


class Member:
    """Implements the Sequencer's Shipper port on a primary."""

    def __init__(
        self,
        node: str,
        broker: Broker,
        sequencer: Sequencer,
        store: Store | None,
        hooks: Hooks,
        *,
        key: bytes,
        data_dir: Path | None,
        isr_min: int,
        lease: float = LEASE_SECONDS,
        host: str = "127.0.0.1",
        port: int = 0,
        server_ssl: ssl.SSLContext | None = None,
        client_ssl: ssl.SSLContext | None = None,
        predicted: tuple[int, core.Boundaries] | None = None,
    ) -> None:
        self.node = node
        self.broker = broker
        self.sequencer = sequencer
        self.store = store
        self.hooks = hooks
        self.key = key
        self.host, self.port = host, port
        self.server_ssl, self.client_ssl = server_ssl, client_ssl
        self.state = State(data_dir / "cluster.json" if data_dir is not None else None)
        self.log = BrokerLog(broker, sequencer, store, predicted=predicted)
        # Until the store is loaded (`loaded`), with the end its start is to recover
        # (`predicted`, `loading`): a restarted member says Hello to its primary with it,
        # which makes the copy while the member loads, and the primary's answers wait here.
        self.deferred: list[core.PeerMessage] = []
        self.said_hello = asyncio.Event()  # a Hello went out while loading
        fault = os.environ.get("TANDEM_TEST_FAULT_DROP_ENQUEUES", "")
        if fault.partition(":")[0] in (node, "*"):
            self.log.drop_enqueues(fault.partition(":")[2])
        self.replica = core.Replica(node, isr_min=isr_min, epoch=self.state.epoch, log=self.log)
        self.replica.restart(time.time_ns())
        self.peers: dict[str, Link] = {}  # followers, by node
        self.upstream: Link | None = None  # the link to our primary
        self.accepted: set[asyncio.Task[None]] = set()  # each follower connection's task
        self.primary_address: tuple[str, int] | None = None
        self.link: asyncio.Task[None] | None = None
        self.tg: asyncio.TaskGroup | None = None
        self.pending: list[records.Framed] = []
        self.pending_start = 0
        self.shipped = 0  # offset of the last record sent to the followers
        self.flush_scheduled = False
        self.lazy: asyncio.TimerHandle | None = None
        # The newest ack waiting for the disk (`_ack_on_disk`).
        self.ack: _Ack | None = None
        # Followers whose copy is being made on another thread: what else goes to them
        # meanwhile is held and sent after it, in the order the core meant.
        self.copying: dict[str, _Making] = {}
        # The session each follower's last Sync (a copy, or the records it lacks) answered,
        # over its current connection: a Hello it repeats while that Sync is made or travels
        # gets no second one. A second Sync of a 100 MiB message, on top of the first, got
        # the follower cut off (`_write`), and again at every connection.
        self.copied: dict[str, core.Session] = {}
        self.refused: str | None = None  # why this member cannot join its primary
        self.blocked: str | None = None  # why publishers wait, as the node was last told
        self.flowing = False  # publishers are not read until the followers catch up
        self.term_start = 0  # the log's end when this member last became primary
        self.flow_episodes = 0  # times they were not read, since the start
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: asyncio.Server | None = None
        self.failovers = 0
        self.isr_why = ""  # the controller's reason for the last change of the ISR
        self.caught_up_bytes = 0
        self.rtt = 0.0  # seconds from shipping a record to the ack that covers it (smoothed)
        self.checkpoints: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=CHECKPOINTS_KEPT
        )
        self.last_checkpoint = 0
        self.renewed = time.monotonic()
        self.lapsed = False
        self.lease = lease
        self.checkpoint_scheduled = False
        self.log.on_checkpoint = self._record_checkpoint
        sequencer.applying = True  # a member serves nothing until it is promoted

    # -- the Shipper port --

    @property
    def held(self) -> int:
        return self.replica.confirmed if self.replica.role is Role.PRIMARY else 0

    def ship(self, data: records.Framed, offset: int) -> None:
        self.log.keep(offset, data)
        if offset - self.last_checkpoint >= CHECKPOINT_EVERY and not self.checkpoint_scheduled:
            self.checkpoint_scheduled = True
            assert self.loop is not None
            self.loop.call_soon(self.checkpoint)
        if not self.pending:
            self.pending_start = offset
        self.pending.append(data)
        if not self.flush_scheduled and self.loop is not None:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def soon(self) -> None:
        if not self.flush_scheduled and self.loop is not None:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self, due: bool = False) -> None:
        """Ship this turn's records. Those no confirm waits for yet (a consumer's acks,
        delivery marks) wait for the next that one does, or LAZY_SECONDS: with a publisher
        that waits for each confirm, a consumer's ack rides with the next publish instead of
        costing every member a write, an fsync and an ack of its own."""
        if due:
            self.lazy = None
        if self.replica.role is Role.PRIMARY:
            self.sequencer.emit_marks()  # their records join this turn's (no flush scheduled)
        else:
            self.sequencer.marks.clear()
        self.flush_scheduled = False
        if not self.pending or self.replica.role is not Role.PRIMARY:
            self.pending = []
            return
        waiters = self.sequencer.waiters
        if not due and not (waiters and waiters[-1][1] > self.shipped):
            if self.lazy is None:
                assert self.loop is not None
                self.lazy = self.loop.call_later(LAZY_SECONDS, self._flush, True)
            return
        self._hold_no_more()
        frames, self.pending = self.pending, []
        self.shipped = self.pending_start + len(frames) - 1  # offsets follow one another
        self._send(self.replica.appended(self.pending_start, frames))
        self.sequencer.progress()
        self._pace()

    def _hold_no_more(self) -> None:
        if self.lazy is not None:
            self.lazy.cancel()
            self.lazy = None

    # -- audit checkpoints --

    def checkpoint(self) -> dict[str, Any] | None:
        """On the primary: put a checkpoint marker into the stream and record the depths at
        it; every backup records its own when it applies the marker."""
        self.checkpoint_scheduled = False
        if self.replica.role is not Role.PRIMARY:
            return None
        body = {"time": time.time()}
        offset = self.sequencer.checkpoint(body)
        self.last_checkpoint = offset
        return self._record_checkpoint(self.sequencer.epoch, offset, body)

    def _record_checkpoint(self, epoch: int, offset: int, body: dict[str, Any]) -> dict[str, Any]:
        depths = [
            {"vhost": vh.name, "queue": q.name, "depth": q.depth, "replicate": q.replicate}
            for vh in self.broker.vhosts.values()
            for q in vh.queues.values()
        ]
        cp = {
            "epoch": epoch,
            "position": offset,
            "time": body.get("time"),
            "node": self.node,
            "recorded_at": time.time(),
            "depths": depths,
        }
        self.checkpoints.append(cp)
        return cp

    # -- the controller's commands --

    def fence(self, epoch: int) -> ReplicationStatus:
        return self._control(core.Fence(epoch))

    def promote(self, record: ElectionRecord) -> ReplicationStatus:
        return self._control(core.Promote(record))

    def inform(self, record: ElectionRecord, why: str = "") -> ReplicationStatus:
        """The record's ISR and tracked set; `why` is the controller's reason for the
        change, which the publishers hear if the ISR is now below its minimum."""
        if why and record.version > self.replica.applied_version:
            self.isr_why = why
        return self._control(core.Inform(record))

    def follow(
        self, primary: str, epoch: int, address: tuple[str, int], amqp: str | None = None
    ) -> ReplicationStatus:
        before = self.replica.following
        answer = self._control(core.Follow(primary, epoch))
        if self.replica.following == primary:
            self.hooks.following(primary, amqp)
            if before != primary or self.primary_address != address or self.link is None:
                self.primary_address = address
                self._start_link(primary, address)
        return answer

    def _control(self, msg: core.ControlMessage) -> ReplicationStatus:
        if isinstance(msg, core.Promote | core.Inform):
            self.renewed = time.monotonic()
            if self.lapsed:
                self.lapsed = False
                self.hooks.lease(False)
        before = (self.replica.role, self.replica.epoch)
        outs = self.replica.control(msg)
        self._after(before)
        self._send(outs)
        return self.status()

    # -- after every step of the core --

    def _after(self, before: tuple[Role, int]) -> None:
        r = self.replica
        role, epoch = before
        if self.link is not None and r.following is None:
            self._stop_link()  # fenced: it takes nothing more from the old primary
        if r.epoch != epoch:
            cluster = self.state.cluster
            if r.role is Role.PRIMARY and not cluster:
                cluster = uuid.uuid4().hex  # the first primary names the cluster
            self.state.save(r.epoch, cluster)
        if role is Role.PRIMARY and r.role is not Role.PRIMARY:
            log.warning("node %s: epoch %d is higher than ours; stepping down", self.node, r.epoch)
            self.sequencer.shipper = None
            self.pending = []
            self.shipped = 0
            self._hold_no_more()
            for peer in list(self.copied):  # every copy being made is one of them
                self._forget(peer)
            self.hooks.demoted(r.epoch)
            self.sequencer.applying = True
            self.log.lost = True  # what it did alone since is not the cluster's history
            self._blocked(None)
        elif r.role is Role.PRIMARY and role is not Role.PRIMARY:
            if not self.state.cluster:
                self.state.save(r.epoch, uuid.uuid4().hex)
            self._stop_link()
            self.failovers += 1
            apply.done(self.broker)  # the queues drop the index applying kept
            self.sequencer.applying = False
            self.sequencer.begin_term(r.epoch)
            self.term_start = self.log.end
            self.sequencer.shipper = self
            self.log.lost = False
            self.hooks.promoted(r.epoch)
        if r.role is Role.PRIMARY:
            self._blocked(
                None
                if r.accepting
                else f"the in-sync set {sorted(r.isr)} is below its minimum of {r.isr_min}"
                f"{f' ({self.isr_why})' if self.isr_why else ''}; publishes wait until a "
                "member catches up"
            )
            self.sequencer.progress()
        self._pace()  # on a step down too: publishers are read again

    def _blocked(self, reason: str | None) -> None:
        """Tell the node why publishers wait, when that changed (this runs after every
        message a member takes)."""
        if reason != self.blocked:
            self.hooks.isr_blocked(reason)
            self.blocked = reason  # once told: a hook that failed is called again

    def _pace(self) -> None:
        """Flow control, as RabbitMQ's credit flow has it: publishers are not read while
        more than FLOW_RECORDS or FLOW_BYTES wait for the ISR to confirm them. Under a
        publisher that does not wait for confirms, the primary took 100,000 records more
        than its backups had applied within seconds, and the controller dropped them from
        the ISR (issue 16)."""
        r = self.replica
        if r.role is not Role.PRIMARY:
            on = False
        else:
            # What came before this term is for the followers to catch up with, not for
            # this term's publishers to wait on: none waits for it to be confirmed again.
            confirmed = max(r.confirmed, self.term_start)
            records = self.log.end - confirmed
            data = self.log.bytes_after(confirmed)
            if self.flowing:
                on = records > FLOW_RECORDS // 2 or data > FLOW_BYTES // 2
            else:
                on = records > FLOW_RECORDS or data > FLOW_BYTES
        if on != self.flowing:
            self.hooks.flow(on)
            self.flowing = on  # once told: a hook that failed is called again
            if on:
                self.flow_episodes += 1

    def _send(self, outs: Sequence[core.Out]) -> None:
        made: tuple[core.Append, tuple[int, ...], list[bytes]] | None = None  # the last Append
        for dest, msg in outs:
            if self.loading and isinstance(msg, core.Hello):
                if msg.digest is None:
                    continue  # its digest needs the state loaded: said once loaded
                if self._link(dest) is not None:  # else said once linked (`_linked`)
                    self.said_hello.set()
            if isinstance(msg, core.Ack) and self.store is not None:
                self._ack_on_disk(self.store, dest, msg)
                continue
            if isinstance(msg, core.Sync) and isinstance(msg.full, Copy):
                self._send_copy(dest, msg)
                continue
            if isinstance(msg, core.Sync):
                self.copied[dest] = msg.session
            if isinstance(msg, core.Append):
                # The same records go to every follower: encoded once for those that read
                # the same kinds.
                takes = self._takes(dest)
                if made is None or made[1] != takes or not _same(made[0], msg):
                    made = (msg, takes, wire.encode_append(msg, takes))
                self._write_parts(dest, made[2])
                continue
            self._write(dest, wire.encode(msg, self._takes(dest)))

    def _takes(self, dest: str) -> tuple[int, ...]:
        """The newer kinds `dest` reads, as it said over its current connection."""
        link = self._link(dest)
        return link.takes if link is not None else ()

    def _link(self, dest: str) -> Link | None:
        return self.upstream if dest == self.replica.following else self.peers.get(dest)

    def _send_copy(self, dest: str, sync: core.Sync) -> None:
        """Make a copy's frames and its message on another thread: with millions of
        messages queued that takes seconds, and the loop goes on serving meanwhile."""
        assert self.loop is not None
        if self.copied.get(dest) == sync.session:
            if isinstance(sync.full, Copy):
                sync.full.release()  # not made: its pages need not stay pinned
            return  # the follower repeated its Hello while its copy is made or on its way
        self.copied[dest] = sync.session
        making = _Making(self.loop.run_in_executor(None, wire.encode_parts, sync))
        self.copying[dest] = making  # one for an earlier Hello is dropped when made
        making.made.add_done_callback(functools.partial(self._copied, dest, sync, making))

    def _copied(
        self, dest: str, sync: core.Sync, making: _Making, made: asyncio.Future[list[bytes]]
    ) -> None:
        if self.copying.get(dest) is not making:
            return  # the follower went, or said Hello again: a later copy answers it
        del self.copying[dest]
        if made.cancelled():
            return
        if made.exception() is not None:
            log.error("node %s: the copy for %s failed", self.node, dest, exc_info=made.exception())
            return  # as if lost: the follower says Hello again
        if self.replica.role is not Role.PRIMARY or self.replica.epoch != sync.epoch:
            return  # no longer this primary's to send
        writer = self.peers.get(dest)
        if writer is None or writer.is_closing():
            return
        parts = made.result()
        log.info(
            "node %s: the copy for %s made in %.2f s, %d bytes",
            self.node,
            dest,
            time.monotonic() - making.started,
            sum(len(data) for data in parts),
        )
        # As one write, what waited for the copy with it: no sign of a slow reader
        # (`_write`), and the held bytes were bounded while they waited.
        writer.write_parts([*parts, *making.held])

    def _ack_on_disk(self, store: Store, dest: str, msg: core.Ack) -> None:
        """Send `msg` once the records it acks are on disk (rule 3): when the write that
        holds the last of them is done. A newer ack whose records go in the same write
        replaces it. Each write done sends the newest ack it covers: an ack that waited for
        the newest records instead was put off at every write while a primary's records
        kept coming, and under load a backup acked nothing for a second or more (issue
        16)."""
        point = store.sync_point()
        if point is None:
            self._write(dest, wire.encode(msg, self._takes(dest)))
            return
        ack = self.ack
        if ack is not None and ack.point == point:
            ack.dest, ack.msg = dest, msg
            return
        self.ack = ack = _Ack(dest, msg, point)
        store.when_synced(functools.partial(self._send_ack, ack))

    def _send_ack(self, ack: _Ack) -> None:
        if self.ack is ack:
            self.ack = None
        self._write(ack.dest, wire.encode(ack.msg, self._takes(ack.dest)))

    def _write(self, dest: str, data: bytes) -> None:
        self._write_parts(dest, (data,))

    def _write_parts(self, dest: str, parts: Sequence[bytes]) -> None:
        """Write `parts` (one message, or a large Append's messages) to `dest`, as one
        write: after the copy being made for it, if one is."""
        making = self.copying.get(dest)
        if making is not None:
            size = sum(map(len, parts))
            making.held += parts  # after the copy being made
            making.size += size
            making.largest = max(making.largest, size)
            if making.size > SLOW_BYTES + making.largest:
                log.warning(
                    "node %s: more than %d bytes beside its largest message for member %s "
                    "waited for its copy; disconnecting it (it asks again when it returns)",
                    self.node,
                    SLOW_BYTES,
                    dest,
                )
                self._cut_off(dest)
            return
        writer = self._link(dest)
        if writer is None or writer.is_closing():
            return  # as if lost: the core's retries and rejoins cover it
        if len(parts) == 1:
            writer.write(parts[0])
        else:
            writer.write_parts(parts)
        # One write, however large (a message up to max_message_size, a copy), is no sign
        # of a slow reader, only what waits behind it: a follower sent a message of 100 MiB
        # was cut off at every connection, for ever, and the message never confirmed.
        unsent = writer.unsent()
        if (
            unsent > SLOW_BYTES  # else no need to look at the writes it holds
            and unsent > SLOW_BYTES + writer.largest_unsent()
            and dest in self.peers
        ):
            log.warning(
                "node %s: member %s is %d bytes behind on the wire; disconnecting it (it "
                "catches up when it returns)",
                self.node,
                dest,
                unsent,
            )
            writer.transport.abort()

    @property
    def loading(self) -> bool:
        """Whether the store is still to be loaded (`loaded`): the log answers with what
        its start is to recover (`BrokerLog.predicted`)."""
        return self.log.predicted is not None

    def loaded(self) -> None:
        """The store is loaded: the primary's answers to the Hello said meanwhile are taken,
        in order, if the start recovered what it was to (`Store.predict`); otherwise they
        answer a Hello that said what this member does not hold, and it says Hello again."""
        if not self.loading:
            return
        log_ = self.log
        predicted, log_.predicted = log_.predicted, None
        self.sequencer.applying = True  # a member serves nothing until it is promoted
        deferred, self.deferred = self.deferred, []
        held = (log_.end, log_.boundaries())
        if held == predicted and log_.restarted:
            if self.said_hello.is_set():
                log.info(
                    "node %s: loaded up to offset %d, as told to the primary before loading",
                    self.node,
                    held[0],
                )
            for msg in deferred:
                try:
                    self.on_peer(msg)
                except Exception:  # as the link's reader would have
                    log.exception("unexpected error, please report it as a bug: replication")
            return
        r = self.replica
        if self.said_hello.is_set():
            log.info(
                "node %s: loaded up to offset %d%s, not as told to the primary; saying Hello again",
                self.node,
                held[0],
                "" if log_.restarted else " with less than its log names",
            )
        if r.following is not None and self.upstream is not None:
            self._control(core.Follow(r.following, r.epoch))  # a fresh Hello

    def on_peer(self, msg: core.PeerMessage) -> None:
        if self.loading:
            self.deferred.append(msg)  # taken once loaded (`loaded`)
            return
        if isinstance(msg, core.Hello) and self.copied.get(msg.sender) == msg.session:
            # Repeated by the follower's tick while its Sync is made or travels: the core
            # would capture the queues again (50 ms for three million messages), or send
            # the records again, for nothing.
            return
        before = (self.replica.role, self.replica.epoch)
        if isinstance(msg, core.Sync) and msg.full is not None:
            self.caught_up_bytes += sum(len(f) for f in msg.full)
        elif isinstance(msg, core.Sync):
            self.caught_up_bytes += sum(len(f) for f in msg.entries)
        if (
            isinstance(msg, core.Ack)
            and self.replica.role is Role.PRIMARY
            and msg.offset > self.replica.acked.get(msg.sender, msg.offset)
        ):
            age = self.log.age(msg.offset - 1)  # since the newest record it acks was shipped
            self.rtt = age if not self.rtt else 0.9 * self.rtt + 0.1 * age
        outs = self.replica.peer(msg)
        self._after(before)
        self._send(outs)

    # -- the listener --

    async def start(self) -> int:
        loop = self.loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: Link(self._opened), self.host, self.port, ssl=self.server_ssl
        )
        # A list under uvloop, not the tuple typeshed says, and compiled code checks the type
        # of what it reads: read as Any.
        self.port = cast(Any, self.server).sockets[0].getsockname()[1]
        return self.port

    async def run(self, stop: asyncio.Event) -> None:
        async with asyncio.TaskGroup() as tg:
            self.tg = tg
            tg.create_task(self._ticker(stop))
            await stop.wait()
            for task in list(self.accepted):
                task.cancel()  # followers' connections, in their handshake or serving
            self._stop_link()
            if self.server is not None:
                self.server.close()
            for w in list(self.peers.values()):
                w.close()
        self.tg = None

    async def _ticker(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), TICK_SECONDS)
            try:
                if self.replica.role is not Role.PRIMARY and self.upstream is not None:
                    self._send(self.replica.tick())
                since = time.monotonic() - self.renewed
                if (
                    self.replica.role is Role.PRIMARY
                    and not self.lapsed
                    and fencing.lease_lapsed(since, self.lease)
                ):
                    log.warning(
                        "node %s epoch %d: no word from the controller for %.1f s; closing "
                        "clients until it renews this primary",
                        self.node,
                        self.replica.epoch,
                        since,
                    )
                    self.lapsed = True
                    self.hooks.lease(True)
            except Exception:
                log.exception("unexpected error, please report it as a bug: replication tick")

    def _opened(self, link: Link) -> None:
        assert self.loop is not None
        task = self.loop.create_task(self._accept(link))
        self.accepted.add(task)  # the loop holds its tasks weakly
        task.add_done_callback(self.accepted.discard)

    async def _accept(self, writer: Link) -> None:
        peer = "?"
        try:
            nonce = secrets.token_hex(16)
            hello: dict[str, Any] = {"version": wire.VERSION, "node": self.node, "nonce": nonce}
            hello["cluster"] = self.state.cluster
            hello["takes"] = list(wire.TAKES)
            writer.write(wire.pack(wire.CHALLENGE, hello))
            kind, answer, _ = wire.header(await _step(writer))
            peer = str(answer.get("node", "?"))
            why = self._check_answer(kind, answer, nonce)
            if why is not None:
                log.warning("node %s: refused replication from %s: %s", self.node, peer, why)
                writer.write(wire.pack(wire.REFUSE, {"reason": why}))
                return  # closing sends what is written first
            writer.write(wire.pack(wire.WELCOME, {"node": self.node}))
            old = self.peers.get(peer)
            if old is not None:
                # Its task's end finds another connection in its place and leaves the core
                # be: what the member acked over it says nothing of what it holds now (it
                # may have restarted), and the controller would go on reading it as caught
                # up, or a few records short, until its Hello.
                old.close()
                self._gone(peer)
            else:
                self._forget(peer)
            writer.takes = wire.takes(answer)
            self.peers[peer] = writer
            log.info("node %s: member %s connected for replication", self.node, peer)
            await writer.serve(lambda data: self.on_peer(wire.decode(data)))
        except (ConnectionError, ssl.SSLError):
            pass
        except TimeoutError:
            log.warning(
                "node %s: a replication connection sent no answer to the challenge within "
                "%.0f s; closing it",
                self.node,
                HANDSHAKE_SECONDS,
            )
        except wire.WireError as exc:
            log.warning("node %s: replication from %s: %s; disconnecting", self.node, peer, exc)
        except Exception:
            log.exception("unexpected error, please report it as a bug: replication from %s", peer)
        finally:
            if self.peers.get(peer) is writer:
                del self.peers[peer]
                self._gone(peer)
            writer.close()

    def _gone(self, peer: str) -> None:
        """A follower's connection ended, or another took its place: what it acked over it
        no longer counts, and a copy being made for it is not sent."""
        self._forget(peer)
        before = (self.replica.role, self.replica.epoch)
        self.replica.disconnected(peer)
        self._after(before)

    def _forget(self, peer: str) -> None:
        """A follower's connection ended, or this member stopped being the primary: a copy
        being made for it is not sent, and a Hello over the next connection gets its own."""
        self.copying.pop(peer, None)
        self.copied.pop(peer, None)

    def _cut_off(self, peer: str) -> None:
        self._forget(peer)
        writer = self.peers.get(peer)
        if writer is not None:
            writer.transport.abort()

    def _check_answer(self, kind: int, answer: dict[str, Any], nonce: str) -> str | None:
        if kind != wire.ANSWER:
            return "expected an answer to the challenge"
        if answer.get("version") != wire.VERSION:
            return (
                f"it speaks replication protocol version {answer.get('version')}, this node "
                f"speaks {wire.VERSION}"
            )
        node = str(answer.get("node", ""))
        if not wire.check_proof(self.key, nonce, node, str(answer.get("proof", ""))):
            return "wrong cluster key"
        theirs, mine = str(answer.get("cluster", "")), self.state.cluster
        if theirs and mine and theirs != mine:
            return (
                f"its store belongs to cluster {theirs}, this is cluster {mine}; give it an "
                "empty data dir to join"
            )
        return None

    # -- the link to our primary --

    def _start_link(self, primary: str, address: tuple[str, int]) -> None:
        self._stop_link()
        if self.tg is None:
            return
        self.refused = None
        self.link = self.tg.create_task(self._keep_link(primary, address))

    def _stop_link(self) -> None:
        if self.link is not None:
            self.link.cancel()
            self.link = None
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None

    async def _keep_link(self, primary: str, address: tuple[str, int]) -> None:
        while self.replica.following == primary:
            try:
                await self._linked(primary, address)
            except RefusedError as refused:  # not `exc`: compiled code gives a name one type
                self.refused = str(refused)
                log.error("node %s cannot replicate from %s: %s", self.node, primary, refused)
                if refused.final:
                    return
            except (OSError, ssl.SSLError, wire.WireError) as exc:
                log.info("node %s: link to primary %s: %r", self.node, primary, exc)
            except Exception:
                log.exception("unexpected error, please report it as a bug: replication link")
            finally:
                if self.upstream is not None:
                    self.upstream.close()
                    self.upstream = None
            await asyncio.sleep(RETRY_SECONDS)  # then try the primary again

    async def _linked(self, primary: str, address: tuple[str, int]) -> None:
        host, port = address
        assert self.loop is not None
        _, writer = await self.loop.create_connection(
            Link, host, port, ssl=self.client_ssl, server_hostname=host if self.client_ssl else None
        )
        try:
            kind, challenge, _ = wire.header(await _step(writer))
            if kind != wire.CHALLENGE:
                raise RefusedError("the primary did not send a challenge")
            if challenge.get("version") != wire.VERSION:
                raise RefusedError(
                    f"the primary speaks replication protocol version "
                    f"{challenge.get('version')}, this node speaks {wire.VERSION}"
                )
            theirs, mine = str(challenge.get("cluster", "")), self.state.cluster
            if theirs and mine and theirs != mine:
                raise RefusedError(
                    f"this node's store belongs to cluster {mine}, the primary {primary} is in "
                    f"cluster {theirs}; give this node an empty data dir to join",
                    final=True,
                )
            nonce = str(challenge.get("nonce", ""))
            answer = {
                "version": wire.VERSION,
                "node": self.node,
                "cluster": mine,
                "proof": wire.proof(self.key, nonce, self.node),
                "takes": list(wire.TAKES),
            }
            writer.write(wire.pack(wire.ANSWER, answer))
            kind, reply, _ = wire.header(await _step(writer))
            if kind == wire.REFUSE:
                raise RefusedError(str(reply.get("reason", "refused")))
            if kind != wire.WELCOME:
                raise RefusedError("the primary did not welcome this node")
            if theirs and not mine:
                self.state.save(self.replica.epoch, theirs)
            writer.takes = wire.takes(challenge)
            self.upstream = writer
            self.refused = None
            log.info("node %s: replicating from %s at %s:%d", self.node, primary, host, port)
            self._control(core.Follow(primary, self.replica.epoch))  # a fresh Hello
            upstream = wire.Upstream()

            def take(data: bytes) -> None:
                msg = upstream.take(data)
                if msg is not None:
                    self.on_peer(msg)

            await writer.serve(take)
        finally:
            writer.close()

    # -- what /status shows --

    def status(self) -> ReplicationStatus:
        r = self.replica
        out = ReplicationStatus(
            role=r.role.value,
            epoch=r.epoch,
            position=self.log.end,
            last_epoch=self.log.last_epoch,
            whole=self.log.whole,
            diverged=self.log.diverged,
            following=r.following,
            synced=r.synced,
            cluster=self.state.cluster,
            replication_port=self.port,
            refused=self.refused,
            failovers=self.failovers,
            catch_up_bytes=self.caught_up_bytes,
            replication_rtt_seconds=round(self.rtt, 6),
            lease_lapsed=self.lapsed,
        )
        if r.role is Role.PRIMARY:
            members = {}
            for n in sorted(set(r.peers) | r.isr | r.tracking):
                if n == self.node:
                    continue
                caught_up, waited, lag, behind = r.report(n)
                acked = r.acked.get(n)
                members[n] = MemberReport(
                    connected=n in self.peers,
                    caught_up=caught_up,
                    waited=waited,
                    lag_records=lag,
                    lag_seconds=round(self.log.age(acked or 0), 3) if lag else 0.0,
                    behind=behind,
                )
            out.isr, out.tracking = sorted(r.isr), sorted(r.tracking)
            out.applied_version, out.confirmed = r.applied_version, r.confirmed
            out.accepting, out.members = r.accepting, members
            out.flow, out.flow_episodes = self.flowing, self.flow_episodes
        return out


def _same(a: core.Append, b: core.Append) -> bool:
    """The same records from the same place (`Replica.appended` gives every follower its own
    Append of one list)."""
    return a.entries is b.entries and a.start == b.start and a.epoch == b.epoch


async def _step(link: Link) -> bytes:
    """The peer's next handshake message. A silent one raises TimeoutError (an OSError: the
    follower tries again), rather than holding a connection and a task for good."""
    return await asyncio.wait_for(link.read(), HANDSHAKE_SECONDS)
