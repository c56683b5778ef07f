"""A deterministic simulation of replication and failover: members, network, disks and clock
simulated, everything else the real code.

Each member is a real `tandem.broker.replication.core.Replica`; the controller is the real
`tandem.ha.loop.Controller` (its `decide`, its order of record writes and commands) on ports
that touch only this world. From a seed, a schedule interleaves client writes, message
deliveries (lost, duplicated, reordered, delayed for as long as the schedule likes), timer
ticks, controller turns, crashes, restarts, pauses and resumes, and the passing of time. After
every step the DESIGN's rules are checked; at the end the faults stop and the cluster must
recover: one primary, every member back in sync, a new write confirmed.

With `messages=True` each member's log is a `MessageLog`, which models the broker's own
(`replication/log.py`): it is never cut back, and a member whose log diverged (an old
primary that took writes while it was paused) catches up by difference, comparing the
message ids each holds. The check then also asks that every confirmed message is held, by
its content, by every in-sync member: a stale message that passes for a confirmed one under
the same id is a lost confirmed message.

Run one seed with its trace: `python -m tests.simulation --seed N --trace`.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.broker.replication import core
from tandem.ha.loop import Controller
from tandem.ha.model import ElectionRecord, Liveness, Member, Role, Settings


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first index where two logs differ, or the shorter one's length."""
    differ = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(differ, min(len(a), len(b)))


class Violation(AssertionError):
    """A DESIGN rule broken; the message names it."""


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine whose awaits all complete at once (the ports here never block)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the coroutine waited on something this world does not provide")


@dataclass
class Message:
    dest: str
    body: core.PeerMessage | core.ControlMessage


def message_id(epoch: int, offset: int) -> Any:
    """A message's identity, as the broker's records.mid makes it: the (epoch, offset) of the
    record that enqueued it. (The mutation check makes it the offset alone.)"""
    return (epoch, offset)


class EpochLog(list[int]):
    """The epoch of each offset (offset o at index o - 1): a log that holds everything, the
    protocol's own view of one (`core.Log`)."""

    lost: bool = False

    @property
    def end(self) -> int:
        return len(self)

    @property
    def last_epoch(self) -> int:
        return self[-1] if self else 0

    @property
    def whole(self) -> bool:
        return not self.lost

    @property
    def truncates(self) -> bool:
        return True

    def boundaries(self) -> core.Boundaries:
        return core.boundaries(self)

    def since(self, offset: int) -> Sequence[int] | None:
        return tuple(self[offset:])

    def digest(self, brief: bool = False) -> Any:
        return None

    def snapshot(self, theirs: Any = None, agree: int = 0) -> Any:
        return tuple(self)

    def truncate(self, offset: int) -> None:
        del self[offset:]

    def install(self, boundaries: core.Boundaries, end: int, snapshot: Any) -> None:
        self[:] = snapshot
        self.lost = False


def persistent(content: tuple[int, int]) -> bool:
    """Whether the message with this content (epoch, offset) survives a restart: about
    half do, fixed by the message as the broker's delivery mode is."""
    return hash(content) % 2 == 0


class MessageLog(EpochLog):
    """A log like the broker's: each record enqueues one message, whose content is the
    (epoch, offset) that wrote it; `held` is the queue, by message id. It is never cut back:
    a member that went past the point where it agrees with the primary takes the
    difference (what it lacks, and which of its messages are gone), not a truncation."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[Any, tuple[int, int]] = {}
        # Restarted without its transient messages, and nothing since: it holds exactly the
        # persistent messages its own records say, which its brief digest says.
        self.restarted = False

    @property
    def truncates(self) -> bool:
        return False

    def truncate(self, offset: int) -> None:
        if offset != len(self):
            raise Violation(f"a message log was cut back from {len(self)} to {offset}")

    def extend(self, entries: Any) -> None:
        for epoch in entries:
            self.append(epoch)
            self.held[message_id(epoch, len(self))] = (epoch, len(self))

    def digest(self, brief: bool = False) -> Any:
        if brief and self.restarted:
            return ("restarted", len(self))
        return frozenset(self.held)

    def snapshot(self, theirs: Any = None, agree: int = 0) -> Any:
        if theirs is None:
            return ("full", tuple(self), dict(self.held), frozenset())
        if isinstance(theirs, tuple):  # brief: it holds our persistent messages up to its end
            end = theirs[1]
            if agree != end:
                return None  # its log went past ours: ask for the whole digest
            missing = {i: c for i, c in self.held.items() if not (persistent(c) and c[1] <= end)}
            return ("difference", tuple(self), missing, frozenset())
        missing = {i: c for i, c in self.held.items() if i not in theirs}
        return ("difference", tuple(self), missing, frozenset(theirs) - set(self.held))

    def install(self, boundaries: core.Boundaries, end: int, snapshot: Any) -> None:
        kind, entries, sent, gone = snapshot
        if kind == "full":
            self.held = dict(sent)
        else:
            self.held.update(sent)
            for i in gone:
                self.held.pop(i, None)
        self[:] = entries  # the log starts over from what the primary holds
        self.lost = self.restarted = False


@dataclass
class World:
    seed: int
    nodes: int = 3
    isr_min: int = 2
    steps: int = 300
    faults: bool = True
    messages: bool = False  # each log a MessageLog, caught up by difference
    # Scale-downs and scale-ups among the faults: the controller is told which members leave
    # (as the operator tells it), and they go once the record names none of them.
    scale: bool = False
    trace: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.names = [chr(ord("a") + i) for i in range(self.nodes)]
        self.replicas = {n: self.new_replica(n) for n in self.names}
        self.state = dict.fromkeys(self.names, "up")  # up | crashed | paused
        self.paused_since: dict[str, float] = {}
        self.now = 0.0
        self.net: list[Message] = []
        self.record = ElectionRecord.initial(self.names)
        self.holders: dict[int, str] = {}  # epoch -> the one member promoted in it
        self.confirmed: list[int] = []  # the epoch of every confirmed record, by offset - 1
        self.epochs = dict.fromkeys(self.names, 0)
        self.incarnations = 0
        # Members whose disk was lost, until the record has dropped them and named them again.
        # At most isr_min - 1 at once: the promise covers no more.
        self.wiped: dict[str, bool] = {}  # node -> has left the record's ISR since
        self.all_names = list(self.names)
        self.scaled = {"down": 0, "up": 0}
        self.parked: dict[str, core.Replica] = {}  # members scaled down, with their volumes
        self.controller = Controller(
            "sim",
            self,
            self,
            self,
            self,
            # A member is tracked a few records short of the ISR, as a real one is (decide._near).
            Settings(failover_delay=1.0, isr_min=self.isr_min, max_lag_records=20, track_records=5),
        )

    def new_replica(self, n: str) -> core.Replica:
        if self.messages:
            return core.Replica(n, isr_min=self.isr_min, log=MessageLog())
        return core.Replica(n, isr_min=self.isr_min, log=EpochLog())

    # -- ElectionStore --

    async def read(self) -> ElectionRecord:
        return self.record

    async def compare_and_set(
        self, expected: ElectionRecord, new: ElectionRecord
    ) -> ElectionRecord | None:
        if expected.version != self.record.version:
            return None
        if new.epoch != self.record.epoch:
            if new.epoch in self.holders or new.epoch < self.record.epoch:
                raise Violation(f"epoch {new.epoch} given twice or going back ({self.record})")
            assert new.holder is not None
            self.holders[new.epoch] = new.holder
            # Rule 4: a member that lost what it held only in memory becomes primary only
            # when no in-sync member that kept it is up or paused (it might come back).
            if not self.replicas[new.holder].log.whole:
                kept = [
                    n
                    for n in self.record.isr
                    if self.state[n] != "crashed"
                    and self.replicas[n].log.whole
                    and self.replicas[n].epoch >= self.record.epoch
                ]
                if kept:
                    raise Violation(
                        f"rule 4: {new.holder} lost records it held only in memory and was "
                        f"made primary while {', '.join(kept)} still held them"
                    )
        self.record = replace(new, version=expected.version + 1)
        self.log(f"record: {self.record.describe()} v{self.record.version}")
        return self.record

    # -- Observer --

    async def observe(self, record: ElectionRecord) -> tuple[Member, ...]:
        primary = self.replicas.get(record.holder or "")
        reporting = (
            primary is not None
            and self.state[primary.node] == "up"
            and primary.role is Role.PRIMARY
        )
        members = []
        for n, r in self.replicas.items():
            if self.state[n] == "crashed":
                members.append(Member(n, Liveness.DOWN))
                continue
            caught_up, waited, lag, behind = (
                primary.report(n) if reporting and primary is not None else (False, False, 0, None)
            )
            paused = self.state[n] == "paused"
            members.append(
                Member(
                    n,
                    Liveness.SILENT if paused else Liveness.UP,
                    r.role,
                    r.epoch,
                    r.position,
                    following=r.following,
                    silent_for=self.now - self.paused_since[n] if paused else 0.0,
                    caught_up=caught_up,
                    waited=waited,
                    applied_version=r.applied_version,
                    whole=r.log.whole,
                    lag_records=lag,
                    behind=behind,
                )
            )
        return tuple(members)

    # -- Actuator: commands travel the same unreliable network --

    async def fence(self, node: str, epoch: int) -> None:
        self.send(node, core.Fence(epoch))

    async def promote(self, node: str, record: ElectionRecord) -> None:
        self.send(node, core.Promote(record))

    async def follow(self, node: str, primary: str, epoch: int) -> None:
        self.send(node, core.Follow(primary, epoch))

    async def set_isr(self, primary: str, record: ElectionRecord, why: str = "") -> None:
        self.send(primary, core.Inform(record))

    async def renew(self, primary: str, record: ElectionRecord) -> None:
        self.send(primary, core.Inform(record))

    # -- Clock --

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds

    # -- the world --

    def log(self, line: str) -> None:
        self.trace.append(f"{self.now:7.2f} {line}")

    def send(self, dest: str, body: core.PeerMessage | core.ControlMessage) -> None:
        self.net.append(Message(dest, body))

    def sends(self, outs: list[core.Out]) -> None:
        for dest, body in outs:
            self.send(dest, body)

    def up(self) -> list[str]:
        return [n for n in self.names if self.state[n] == "up"]

    def deliver(self, lossy: bool) -> None:
        ready = [i for i, m in enumerate(self.net) if self.state.get(m.dest) != "paused"]
        if not ready:
            return
        # Under faults any message in flight may come next (reordering, delay); once the
        # faults stop the network delivers in order, as TCP does on a healthy link.
        i = self.rng.choice(ready) if lossy else ready[0]
        msg = self.net[i]
        roll = self.rng.random()
        if lossy and roll < 0.1:
            del self.net[i]
            self.log(f"lost {msg.body} to {msg.dest}")
            return
        if not (lossy and roll < 0.15):  # else: delivered and kept, so it comes twice
            del self.net[i]
        if self.state.get(msg.dest, "crashed") == "crashed":
            return  # crashed, or gone in a scale-down
        r = self.replicas[msg.dest]
        self.log(f"{msg.dest} <- {msg.body}")
        if isinstance(msg.body, core.Fence | core.Promote | core.Follow | core.Inform):
            self.sends(r.control(msg.body))
        else:
            self.sends(r.peer(msg.body))

    def publish(self) -> None:
        for n in self.up():
            r = self.replicas[n]
            if r.accepting:
                self.sends(r.append())
                self.log(f"{n} appends {r.position}")
                return

    def tick(self) -> None:
        up = self.up()
        if up:
            self.sends(self.replicas[self.rng.choice(up)].tick())

    def fault(self) -> None:
        if self.scale and not self.controller.leaving and self.rng.random() < 0.15:
            size = self.rng.randint(1, len(self.all_names))
            if size != len(self.names):
                self.scale_to(size)
            return
        n = self.rng.choice(self.names)
        kind = self.rng.choice(["crash", "pause", "heal", "heal", "wipe"])
        if kind == "wipe" and self.state[n] != "paused" and self.may_lose(n):
            self.crash(n)
            self.replicas[n] = self.new_replica(n)
            self.epochs[n] = 0
            self.wiped[n] = False
            self.log(f"{n} crashes and loses its disk")
        elif kind == "crash" and self.state[n] == "up":
            self.crash(n)
            self.log(f"{n} crashes")
        elif kind == "pause" and self.state[n] == "up":
            self.state[n], self.paused_since[n] = "paused", self.now
            self.log(f"{n} pauses")
        elif kind == "heal":
            self.heal(n)

    # -- scaling, as the operator does it --

    def least(self, members: int) -> int:
        """The ISR minimum for a size, as the BrokerCluster spec gives it."""
        return min(self.isr_min, members)

    def scale_to(self, size: int) -> None:
        leaving = frozenset(self.names[size:])
        if leaving:
            self.controller.leaving = leaving
            self.log(f"scale down to {size}: {', '.join(sorted(leaving))} to leave")
        else:
            self.controller.leaving = frozenset()  # a pending scale-down is superseded
            for n in self.all_names[len(self.names) : size]:
                self.names.append(n)
                self.state[n] = "up"
                if n in self.parked:  # back on its kept volume, as after a restart
                    self.incarnations += 1
                    self.replicas[n] = self.parked.pop(n)
                    self.replicas[n].restart(self.incarnations)
                else:
                    self.replicas[n] = self.new_replica(n)
            self.scaled["up"] += 1
            self.log(f"scale up to {size}")
        self.controller.settings = replace(self.controller.settings, isr_min=self.least(size))

    def scaling(self) -> None:
        """The leaving members go once the record names none of them (the operator then
        applies the smaller StatefulSet)."""
        leaving = self.controller.leaving
        if not leaving or self.record.holder in leaving or self.record.waited & leaving:
            return
        for n in sorted(leaving):
            self.crash(n)
            # Its volume is kept (a StatefulSet keeps its claims): a scale-up brings it back.
            self.parked[n] = self.replicas.pop(n)
            del self.state[n]
            self.paused_since.pop(n, None)
            self.names.remove(n)
        self.controller.leaving = frozenset()
        self.scaled["down"] += 1
        self.log(f"{', '.join(sorted(leaving))} left; the record: {self.record.describe()}")

    def may_lose(self, n: str) -> bool:
        """A lost disk is a failure the promise covers only while another ISR member holds
        everything: at most isr_min - 1 at once, and never the last one the record names."""
        others = self.record.isr - set(self.wiped) - {n}
        return len(self.wiped) < self.floor() - 1 and bool(others)

    def crash(self, n: str) -> None:
        """Its process dies: messages on their way to it are lost, and its peers see their
        connections to it close."""
        self.state[n] = "crashed"
        self.net = [m for m in self.net if m.dest != n]
        for other in self.replicas.values():
            if other.node != n:
                other.disconnected(n)

    def heal(self, n: str) -> None:
        if self.state[n] == "crashed":
            self.incarnations += 1
            r = self.replicas[n]
            r.restart(self.incarnations)
            # Some restarts lose what was only in memory (reliable transient messages), a
            # failure the promise covers as it covers a lost disk: such a member holds less
            # than its position says until it takes a full copy.
            lose = self.rng.random() < 0.5 and self.may_lose(n)
            if lose and isinstance(r.log, EpochLog):
                r.log.lost = True
                self.wiped[n] = False
                if isinstance(r.log, MessageLog):  # its transient messages are gone
                    held = r.log.held.items()
                    r.log.held = {i: c for i, c in held if persistent(c)}
                    # Said in brief, or (as after a lost page) not: both ways are tried.
                    r.log.restarted = self.rng.random() < 0.5
            self.log(f"{n} restarts" + (" without its volatile records" if lose else ""))
        elif self.state[n] == "paused":
            self.log(f"{n} resumes")
        self.state[n] = "up"

    def step(self, faults: bool) -> None:
        roll = self.rng.random()
        if roll < 0.5:
            for _ in range(self.rng.randint(1, 4)):  # the network outpaces the writers
                self.deliver(lossy=faults)
        elif roll < 0.6:
            # Once the faults stop, writers feel the network's backpressure (as over TCP), so
            # that followers can catch up with a primary that confirms alone.
            if faults or len(self.net) < 4 * len(self.names):
                self.publish()
        elif roll < 0.7:
            self.tick()
        elif roll < 0.82:
            run_sync(self.controller.turn())
        elif roll < 0.9:
            self.now += self.rng.choice([0.1, 0.3, 1.2])
        elif faults:
            self.fault()
        self.scaling()
        self.check()

    # -- the rules --

    def floor(self) -> int:
        """The promise in force: the record's ISR minimum. A scale-down lowers it (the user
        asked for fewer copies); it rises after a scale-up only as members come in sync. It
        is never below what the settings ask for the members that stay."""
        least = self.record.isr_min
        return self.isr_min if least is None else least

    def check(self) -> None:
        """Every rule, after every step. The logs are compared as lists (in C): this runs
        some 300 times a schedule, over every confirmed record."""
        for n, r in self.replicas.items():
            if r.epoch < self.epochs[n]:
                raise Violation(f"rule 1: {n}'s epoch went from {self.epochs[n]} to {r.epoch}")
            self.epochs[n] = r.epoch
        confirmed = self.confirmed
        primaries = [r for r in self.replicas.values() if r.role is Role.PRIMARY]
        for r in primaries:
            if self.holders.get(r.epoch) != r.node:
                raise Violation(f"{r.node} acts as primary in epoch {r.epoch} it was not given")
            if r.confirmed > len(r.log):
                raise Violation(f"{r.node} confirms {r.confirmed} records; it has {len(r.log)}")
            known = min(r.confirmed, len(confirmed))
            if r.log[:known] != confirmed[:known]:
                o = _first_difference(r.log, confirmed) + 1
                raise Violation(
                    f"confirmed record lost: offset {o} was confirmed in epoch "
                    f"{confirmed[o - 1]}, now {r.node} confirms epoch {r.log[o - 1]} there"
                )
            confirmed += r.log[len(confirmed) : r.confirmed]
        # Rule 3's minimum: a confirmed record is on at least isr_min disks, less only by the
        # disks lost since (each of them is back in the count once it has caught up and been
        # named in the ISR again).
        whole = [r.log for r in [*self.replicas.values(), *self.parked.values()] if r.log.whole]
        every = sum(1 for log in whole if log[: len(confirmed)] == confirmed)  # the usual case
        copies = [every] * len(confirmed)
        for log in whole:
            if log[: len(confirmed)] != confirmed:
                copies[: len(log)] = map(operator.add, copies, map(operator.eq, log, confirmed))
        if copies and min(copies) + len(self.wiped) < self.floor():
            o = copies.index(min(copies)) + 1
            raise Violation(
                f"rule 3: confirmed record {confirmed[o - 1]}:{o} is on {copies[o - 1]} "
                f"disk(s), fewer than the ISR minimum {self.floor()}"
            )
        for n, left in list(self.wiped.items()):
            if n not in self.record.isr:
                self.wiped[n] = True
            elif left:
                del self.wiped[n]  # named again after catching up: in sync once more
        for n in self.record.isr:
            if n in self.wiped:
                continue
            log = self.replicas[n].log
            if log[: len(confirmed)] != confirmed:
                o = _first_difference(log, confirmed) + 1
                raise Violation(
                    f"rule 3/4: ISR member {n} lacks confirmed record {confirmed[o - 1]}:{o} "
                    f"({self.record.describe()})"
                )
        self.check_messages()
        logs = [r.log for r in self.replicas.values()]
        for i, a in enumerate(logs):
            for b in logs[i + 1 :]:
                # Once two logs differ, they agree on no later record.
                n = min(len(a), len(b))
                if a[:n] != b[:n]:
                    d = _first_difference(a, b)
                    if any(map(operator.eq, a[d:n], b[d:n])):
                        raise Violation("log matching: two logs agree on a record, not before it")

    def check_messages(self) -> None:
        """Every confirmed message, by its content, on every whole in-sync member (as rule
        3/4 asks of their logs): not merely some message under the same id."""
        if not self.messages:
            return
        for n in sorted(self.record.isr - set(self.wiped)):
            log = self.replicas[n].log
            if not isinstance(log, MessageLog) or not log.whole:
                continue
            contents = set(log.held.values())
            for o, epoch in enumerate(self.confirmed, 1):
                if (epoch, o) not in contents and len(log) >= o:
                    raise Violation(
                        f"confirmed message lost: {n} holds {log.held.get(message_id(epoch, o))}"
                        f" where confirmed message {epoch}:{o} should be"
                    )

    def run(self) -> None:
        for _ in range(self.steps):
            self.step(self.faults)
        self.recover()

    def recover(self) -> None:
        """The faults stop: within bounded steps the cluster serves with every member in
        sync, and a new write is confirmed."""
        for n in self.names:
            self.heal(n)
        self.log("faults stop")
        if self.scale and len(self.names) < len(self.all_names):
            self.scale_to(len(self.all_names))  # back to full size, to end as it began
        target = None
        for _ in range(4000):
            self.step(faults=False)
            primary = self.replicas.get(self.record.holder or "")
            settled = (
                not self.controller.leaving
                and self.record.isr_min in (None, self.least(len(self.names)))
                and primary is not None
                and primary.role is Role.PRIMARY
                and self.record.isr == frozenset(self.names)
                and primary.applied_version == self.record.version
            )
            if settled and primary is not None and target is None:
                self.sends(primary.append())
                target = (primary.epoch, len(primary.log))
            if target and primary is not None and primary.epoch == target[0]:
                if primary.confirmed >= target[1]:
                    return
            elif target:
                target = None  # another failover; write again once it settles
        raise Violation(f"no recovery after the faults stopped: {self.record.describe()}")
