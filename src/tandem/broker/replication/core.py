"""The replication protocol of one member, pure: messages in, messages out, no I/O and no clock.

The deterministic simulation runs these state machines against a simulated network and the
real controller's decisions; the broker's replication listener drives the same class over
sockets. The protocol needs nothing of a record but its epoch, and (epoch, offset) names one
record only, so a member's log is seen through the `Log` port: its end, its epoch boundaries,
the entries after an offset while it still holds them, and a full copy. The simulation's log
holds the epoch of each offset in a list (`tests/simulation/world.py`); the broker's log
ships record frames and copies its state.

The rules, each from `tandem.ha.fencing` so that the simulation checks the code that runs:
- rule 1: a message from a lower epoch is refused (`Stale` back); a primary that meets a
  higher epoch steps down;
- rule 2: an ack counts only in the epoch it was sent in;
- rule 3: the primary confirms an offset once every member it waits for (the record's ISR and
  tracked members) has acked it, and never while the ISR is below its minimum.

A follower joins a primary with `Hello` (its epoch boundaries); the primary answers with `Sync`:
the offset up to which the two logs agree (by epoch boundaries, as Kafka's leader epochs) and
its entries after that. The follower truncates to that offset and appends. When the primary
no longer holds those entries, when the follower's log cannot be truncated, or when the
follower lost records it had (a restart loses what was only in memory), the Sync carries a
copy instead: the difference from what the follower's Hello says it holds (its `digest`), or
everything. A follower that only restarted says so in brief (its log's end); a primary that
cannot make the difference from that (the logs part, or it no longer holds what came since)
answers `Detail`, and the follower says Hello again with its whole digest. After that, each new
entry is shipped as an `Append` starting where the follower's log ends; a gap (a lost message)
makes the follower say `Hello` again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from tandem.ha import fencing
from tandem.ha.model import ElectionRecord, Position, Role

# (epoch, first offset) of each epoch in a log, in order.
Boundaries = tuple[tuple[int, int], ...]


# A follower's join attempt: (its incarnation, a counter). A Sync answers one Hello and an Ack
# is counted for one Sync, so that a late message of an earlier attempt (or of a life before
# a restart) can neither truncate a log nor claim records the follower no longer holds.
Session = tuple[int, int]


class Log(Protocol):
    """A member's log as the protocol sees it. Entries are opaque here (epochs in the
    simulation, record frames in the broker)."""

    @property
    def end(self) -> int:
        """The offset of the last record held (0 for none)."""

    @property
    def last_epoch(self) -> int:
        """The epoch of the last record held (0 for none)."""

    @property
    def whole(self) -> bool:
        """False when the log names records it no longer holds (lost in a restart)."""

    @property
    def truncates(self) -> bool:
        """True when the log can be cut back to an earlier offset."""

    def boundaries(self) -> Boundaries: ...

    def since(self, offset: int) -> Sequence[Any] | None:
        """The entries after `offset`, or None when they are no longer held."""

    def digest(self, brief: bool = False) -> Any:
        """What a follower holds, so that a copy can be the difference rather than
        everything (None: send everything); `brief`: said in a few words where the log can
        (a restart that lost only what was in memory), which a primary may not be able to
        use (`snapshot`)."""

    def snapshot(self, theirs: Any = None, agree: int = 0) -> Any:
        """A copy for a follower: everything, or, given its `digest`, what differs. None
        when `theirs` is brief and says too little for a copy: the logs agree only up to
        `agree`, or this log no longer holds what came since."""

    def truncate(self, offset: int) -> None: ...

    def extend(self, entries: Sequence[Any]) -> None: ...

    def install(self, boundaries: Boundaries, end: int, snapshot: Any) -> None:
        """Replace everything with a full copy of another member's log."""


@dataclass(frozen=True, slots=True)
class Hello:
    sender: str
    epoch: int
    session: Session
    boundaries: Boundaries
    end: int
    whole: bool = True
    digest: Any = None  # what the follower holds, should it need a copy


@dataclass(frozen=True, slots=True)
class Sync:
    sender: str
    epoch: int
    session: Session
    agree: int  # truncate to this offset ...
    entries: Sequence[Any]  # ... then append these, from agree + 1
    full: Any = None  # or, when not None, install this copy of the primary's log
    boundaries: Boundaries = ()  # the primary's, with a full copy
    end: int = 0


@dataclass(frozen=True, slots=True)
class Append:
    sender: str
    epoch: int
    start: int
    entries: Sequence[Any]


@dataclass(frozen=True, slots=True)
class Ack:
    sender: str
    epoch: int
    session: Session
    offset: int


@dataclass(frozen=True, slots=True)
class Rejoin:
    """The primary does not know the follower's session (it lost or never got the Hello):
    join again."""

    sender: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Detail:
    """The primary cannot make a copy from what the follower's Hello said in brief: say
    Hello again with the whole digest."""

    sender: str
    epoch: int
    session: Session


@dataclass(frozen=True, slots=True)
class Stale:
    """The answer to a message from a lower epoch: here is the higher one."""

    sender: str
    epoch: int


# From the controller.
@dataclass(frozen=True, slots=True)
class Fence:
    epoch: int


@dataclass(frozen=True, slots=True)
class Promote:
    record: ElectionRecord


@dataclass(frozen=True, slots=True)
class Follow:
    primary: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Inform:
    """set_isr and lease renewals: the record's ISR and tracked set for the primary."""

    record: ElectionRecord


PeerMessage = Hello | Sync | Append | Ack | Rejoin | Stale | Detail
ControlMessage = Fence | Promote | Follow | Inform
Out = tuple[str, PeerMessage]


def boundaries(log: Sequence[int]) -> Boundaries:
    out: list[tuple[int, int]] = []
    for offset, epoch in enumerate(log, 1):
        if not out or out[-1][0] != epoch:
            out.append((epoch, offset))
    return tuple(out)


def agreement(mine: Boundaries, mine_end: int, theirs: Boundaries, theirs_end: int) -> int:
    """The last offset up to which two logs hold the same records. Two logs that hold the
    same (epoch, offset) hold the same records up to it, so comparing where each epoch
    starts and ends is enough."""
    agree = 0
    for i, ((e1, s1), (e2, s2)) in enumerate(zip(mine, theirs, strict=False)):
        if e1 != e2 or s1 != s2:
            break
        end1 = mine[i + 1][1] - 1 if i + 1 < len(mine) else mine_end
        end2 = theirs[i + 1][1] - 1 if i + 1 < len(theirs) else theirs_end
        agree = min(end1, end2)
        if end1 != end2:
            break
    return agree


MAX_QUIET_TICKS: Final = 120  # a member whose copies keep failing asks again at least this often


@dataclass(slots=True)
class Replica:
    node: str
    log: Log  # durable, as the epoch is
    isr_min: int = 2
    incarnation: int = 0  # differs after each restart (the broker uses its start time)
    # Durable: what survives a crash.
    epoch: int = 0
    # Volatile.
    role: Role = Role.BACKUP
    following: str | None = None
    synced: bool = False
    isr: frozenset[str] = frozenset()
    tracking: frozenset[str] = frozenset()
    applied_version: int = 0
    session: Session = (0, 0)  # a follower's current join attempt
    acked: dict[str, int] = field(default_factory=dict)
    peers: dict[str, Session] = field(default_factory=dict)  # followers and their sessions
    confirmed: int = 0
    # Copies in a row that did not apply (a bug, reported by the log): the next Hello waits
    # 2, 4, 8, ... ticks (at most MAX_QUIET_TICKS), so a copy that cannot work is not asked
    # for, sent and reported again at every tick.
    failed_copies: int = 0
    quiet_ticks: int = 0
    detailed: bool = False  # the primary asked for the whole digest (`Detail`)

    # -- what the controller observes --

    @property
    def position(self) -> Position:
        log = self.log
        return Position(log.last_epoch, log.end) if log.end else Position()

    def report(self, node: str) -> tuple[bool, bool, int, int | None]:
        """The primary's view of a follower at one instant: (caught_up, waited, lag,
        behind). `behind` counts the confirmed records it has not acked; None until it
        acked over its current connection."""
        if self.role is not Role.PRIMARY:
            return False, False, self.log.end, None
        acked = self.acked.get(node)
        caught_up = acked is not None and acked >= self.confirmed
        waited = node in self.isr or node in self.tracking
        behind = None if acked is None else max(0, self.confirmed - acked)
        return caught_up, waited, self.log.end - (acked or 0), behind

    def restart(self, incarnation: int | None = None) -> None:
        """A crash: everything volatile is gone; the epoch and the log were on disk."""
        if incarnation is not None:
            self.incarnation, self.session = incarnation, (incarnation, 0)
        self.role, self.following, self.synced = Role.BACKUP, None, False
        self.detailed = False
        self.isr = self.tracking = frozenset()
        self.applied_version, self.confirmed = 0, 0
        self.acked, self.peers = {}, {}

    def disconnected(self, peer: str) -> None:
        """The replication connection to `peer` closed: what it acked over it no longer
        says anything about what it holds (it may come back without its store)."""
        self.peers.pop(peer, None)
        self.acked.pop(peer, None)

    # -- the primary's own writes --

    @property
    def accepting(self) -> bool:
        """A primary takes writes only while it can confirm them: below the ISR minimum it
        blocks its publishers (connection.blocked) rather than confirm alone."""
        return self.role is Role.PRIMARY and len(self.isr) >= self.isr_min

    def append(self) -> list[Out]:
        """A client's record on a primary whose log is an EpochLog (the simulation)."""
        assert self.role is Role.PRIMARY
        self.log.extend((self.epoch,))
        return self.appended(self.log.end, (self.epoch,))

    def appended(self, start: int, entries: Sequence[Any]) -> list[Out]:
        """The primary's log grew by `entries` from `start`: ship them to every follower."""
        assert self.role is Role.PRIMARY
        self._advance()
        return [(p, Append(self.node, self.epoch, start, entries)) for p in sorted(self.peers)]

    def tick(self) -> list[Out]:
        """A timer: retransmit what a lost message may have left undone. A follower that
        is not synced says Hello again; a synced one repeats its ack; the primary resends
        each follower what it has not acked."""
        if self.role is Role.PRIMARY:
            out: list[Out] = []
            end = self.log.end
            for p in sorted(self.peers):
                acked = self.acked.get(p)
                if acked is None or acked >= end:
                    continue
                entries = self.log.since(acked)
                if entries is None:  # no longer held: the follower needs a full copy
                    out.append((p, Rejoin(self.node, self.epoch)))
                else:
                    out.append((p, Append(self.node, self.epoch, acked + 1, entries)))
            return out
        if self.following is None:
            return []
        if not self.synced:
            if self.quiet_ticks > 0:
                self.quiet_ticks -= 1
                return []
            return [self._hello(again=True)]
        return [self._ack()]

    # -- messages --

    def control(self, msg: ControlMessage) -> list[Out]:
        if isinstance(msg, Fence):
            adopted = fencing.fence(self.epoch, msg.epoch)
            if adopted is not None and adopted > self.epoch:
                self._adopt(adopted)
            return []
        if isinstance(msg, Promote):
            rec = msg.record
            if rec.holder != self.node or rec.epoch < self.epoch:
                return []
            if self.role is Role.PRIMARY and rec.epoch == self.epoch:
                self._inform(rec)  # a repeated promotion changes nothing else
                return []
            self._adopt(rec.epoch)
            self.role, self.following, self.synced = Role.PRIMARY, None, True
            self.acked, self.peers, self.confirmed = {}, {}, 0
            self.applied_version = -1
            self._inform(rec)
            return []
        if isinstance(msg, Follow):
            stale = msg.epoch < self.epoch or (
                msg.epoch == self.epoch and self.role is Role.PRIMARY
            )
            if stale or msg.primary == self.node:
                return []
            self._adopt(msg.epoch)
            self.role, self.following, self.synced = Role.BACKUP, msg.primary, False
            self.detailed = False  # a new primary may make do with the brief digest
            return [self._hello()]
        if isinstance(msg, Inform):
            rec = msg.record
            if rec.epoch > self.epoch and self.role is Role.PRIMARY:
                self._adopt(rec.epoch)  # replaced: step down
            elif rec.holder == self.node and rec.epoch == self.epoch:
                self._inform(rec)
            return []
        raise TypeError(msg)

    def peer(self, msg: PeerMessage) -> list[Out]:
        if isinstance(msg, Ack) and msg.epoch <= self.epoch:
            return self._on_ack(msg)  # rule 2 judges acks (a higher epoch is rule 1's)
        verdict = fencing.on_epoch(self.epoch, self.role, msg.epoch)
        if verdict is fencing.Verdict.REFUSE:
            return [] if isinstance(msg, Stale) else [(msg.sender, Stale(self.node, self.epoch))]
        if verdict is fencing.Verdict.STEP_DOWN:
            self._adopt(msg.epoch)
            return []  # the controller tells this member whom to follow
        if msg.epoch > self.epoch:
            # A backup takes epochs from the controller only (fence, follow, promote): an
            # epoch is what tells the controller that a member kept its store.
            return []
        if isinstance(msg, Hello):
            return self._on_hello(msg)
        if isinstance(msg, Rejoin):
            if self.role is Role.BACKUP and msg.sender == self.following and self.synced:
                self.synced = False
                return [self._hello()]
            return []
        if isinstance(msg, Detail):
            if (
                self.role is Role.BACKUP
                and msg.sender == self.following
                and not self.synced
                and msg.session == self.session
            ):
                self.detailed = True
                return [self._hello()]
            return []  # the answer to an earlier Hello
        if isinstance(msg, Sync | Append):
            if self.role is not Role.BACKUP or msg.sender != self.following:
                return []
            return self._on_sync(msg) if isinstance(msg, Sync) else self._on_append(msg)
        return []  # a Stale at our own epoch says nothing new

    # -- internals --

    def _adopt(self, epoch: int) -> None:
        """Take a higher epoch: a primary stops serving (its clients are closed with 320)."""
        self.epoch = epoch
        if self.role is Role.PRIMARY:
            self.restart()
        self.following, self.synced = None, False

    def _inform(self, rec: ElectionRecord) -> None:
        if rec.version > self.applied_version:
            self.isr, self.tracking, self.applied_version = rec.isr, rec.tracking, rec.version
            if rec.isr_min is not None:
                self.isr_min = rec.isr_min  # the controller's, over the configured one
            self._advance()

    def _hello(self, again: bool = False) -> Out:
        """Join the primary; `again` repeats the current attempt (a lost Hello or Sync)
        rather than starting one, which would void the Sync already on its way."""
        assert self.following is not None
        if not again:
            self.session = (self.incarnation, self.session[1] + 1)
        log = self.log
        digest = log.digest(brief=not self.detailed)
        hello = Hello(
            self.node, self.epoch, self.session, log.boundaries(), log.end, log.whole, digest
        )
        return self.following, hello

    def _ack(self) -> Out:
        assert self.following is not None
        return self.following, Ack(self.node, self.epoch, self.session, self.log.end)

    def _on_hello(self, msg: Hello) -> list[Out]:
        known = self.peers.get(msg.sender)
        if self.role is not Role.PRIMARY or (known is not None and msg.session < known):
            return []  # a late Hello of an attempt the follower has given up
        log = self.log
        mine = log.boundaries()
        agree = agreement(mine, log.end, msg.boundaries, msg.end)
        self.peers[msg.sender] = msg.session
        self.acked.pop(msg.sender, None)  # until it acks the synced log
        entries = log.since(agree) if msg.whole and (agree == msg.end or log.truncates) else None
        if entries is None:
            # With the follower's digest, a copy is just the difference from what it holds.
            copy = log.snapshot(msg.digest, agree)
            if copy is None:  # a brief digest that says too little here
                return [(msg.sender, Detail(self.node, self.epoch, msg.session))]
            full = Sync(self.node, self.epoch, msg.session, 0, (), copy, mine, log.end)
            return [(msg.sender, full)]
        return [(msg.sender, Sync(self.node, self.epoch, msg.session, agree, entries))]

    def _on_ack(self, msg: Ack) -> list[Out]:
        if self.role is not Role.PRIMARY or not fencing.ack_counts(msg.epoch, self.epoch):
            return []
        known = self.peers.get(msg.sender)
        if known is None or known < msg.session:
            return [(msg.sender, Rejoin(self.node, self.epoch))]
        if known == msg.session:
            self.acked[msg.sender] = max(self.acked.get(msg.sender, 0), msg.offset)
            self._advance()
        return []

    def _on_sync(self, msg: Sync) -> list[Out]:
        if self.synced or msg.session != self.session:
            return []  # the answer to an earlier Hello
        if msg.full is not None:
            self.log.install(msg.boundaries, msg.end, msg.full)
        else:
            self.log.truncate(msg.agree)
            self.log.extend(msg.entries)
        if not self.log.whole:
            # A record did not apply: no ack. A later tick asks for a copy again, later each
            # time while copies keep failing.
            self.failed_copies += 1
            self.quiet_ticks = min(2**self.failed_copies, MAX_QUIET_TICKS)
            # A new attempt: a member answers a session with one copy, however often its
            # Hello is repeated while the copy is made and travels.
            self.session = (self.incarnation, self.session[1] + 1)
            return []
        self.synced, self.failed_copies, self.detailed = True, 0, False
        return [self._ack()]

    def _on_append(self, msg: Append) -> list[Out]:
        if not self.synced:
            return []
        end = self.log.end
        if msg.start > end + 1:
            self.synced = False  # a gap: a message was lost; start over from agreement
            return [self._hello()]
        skip = end + 1 - msg.start  # a repeated message overlaps what we hold
        self.log.extend(msg.entries[skip:])
        if not self.log.whole:  # a record did not apply: this state needs a copy
            self.synced = False
            return [self._hello()]
        return [self._ack()]

    def _advance(self) -> None:
        """Move the confirmed offset to the highest one rule 3 allows."""
        if self.role is not Role.PRIMARY:
            return
        others = (self.isr | self.tracking) - {self.node}
        end = self.log.end
        for offset in sorted({end, *(self.acked.get(n, 0) for n in others)}, reverse=True):
            if offset <= self.confirmed or offset > end:
                continue
            acked = {self.node} | {n for n in others if self.acked.get(n, 0) >= offset}
            if fencing.may_confirm(self.isr, acked, self.isr_min, self.tracking):
                self.confirmed = offset
                return
