"""The controller's loop: observe, decide, act, through the ports.

One decision per turn. After an action the loop looks again at once; after HOLD or WAIT it
sleeps for the poll interval. Every record change is a compare-and-set on the version read in
the same turn, so two controllers (or a controller and its restarted self) cannot both win.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Protocol

from tandem.ha import decide as decide_mod
from tandem.ha.decide import Action, Decision
from tandem.ha.model import ElectionRecord, Settings, View
from tandem.ha.ports import Actuator, Clock, ElectionStore, Observer, Restarter, Unavailable

log = logging.getLogger(__name__)


class Stopped(Protocol):
    """The part of asyncio.Event the loop reads."""

    def is_set(self) -> bool: ...


BUG = "unexpected error, please report it as a bug"
REPEAT_SECONDS = 30.0  # a port unavailable for the same reason is logged this often


@dataclass(slots=True)
class Controller:
    cluster: str
    store: ElectionStore
    observer: Observer
    actuator: Actuator
    clock: Clock
    settings: Settings
    poll_interval: float = 0.1
    switchover_to: str | None = None  # set by `cluster switchover`; cleared once done
    # Paused (maintenance): decisions are made and logged, the record is renewed and the ISR
    # kept, but no member is fenced, promoted or repointed.
    paused: bool = False
    # Maintenance asked for by the platform (View's fields of the same names): set by the
    # operator from its pods and StatefulSet; decide orders it.
    leaving: frozenset[str] = frozenset()
    stopping: frozenset[str] = frozenset()
    stale: frozenset[str] = frozenset()
    restarter: Restarter | None = None  # where RESTART is carried out (the operator's pods)
    last: Decision | None = None
    # The last decision that changed the record or a member (not HOLD or WAIT): why the
    # ISR and the primary are what they are, for `cluster status`.
    last_change: Decision | None = None
    # What the loop last said it could not do (`Unavailable`), when, and the turns since: the
    # same reason is said again only every REPEAT_SECONDS, not every turn.
    unavailable: tuple[str, float, int] = ("", 0.0, 0)

    async def turn(self) -> Decision:
        """Observe once, decide once, act once."""
        record = await self.store.read()
        members = await self.observer.observe(record)
        view = View(record, members, self.switchover_to, self.leaving, self.stopping, self.stale)
        decision = decide_mod.decide(view, self.settings)
        if decision != self.last or decision.action not in (Action.HOLD, Action.WAIT):
            level = logging.DEBUG if decision.action is Action.HOLD else logging.INFO
            log.log(
                level,
                "cluster=%s epoch=%d %s: %s",
                self.cluster,
                record.epoch,
                decision.action.value,
                decision.reason,
            )
        held = self.paused and decision.action in (
            Action.FENCE,
            Action.PROMOTE,
            Action.FOLLOW,
            Action.RESTART,
        )
        if held and decision != self.last:
            log.warning("cluster=%s is paused: not acting on it", self.cluster)
        self.last = decision
        if decision.action not in (Action.HOLD, Action.WAIT):
            self.last_change = decision
        if not held:
            await self._act(record, decision, view)
        return decision

    async def _act(self, record: ElectionRecord, d: Decision, view: View) -> None:
        a = self.actuator
        if d.action is Action.HOLD and record.holder is not None:
            await a.renew(record.holder, record)
        elif d.action is Action.FENCE:
            for node in sorted(d.nodes):
                await a.fence(node, d.epoch)
        elif d.action is Action.PROMOTE:
            assert d.target is not None
            new = replace(record, holder=d.target, epoch=d.epoch, isr=d.isr, tracking=frozenset())
            stored = await self._write(record, new, d)
            if stored is not None:
                await a.promote(d.target, stored)
                for m in view.members:
                    if m.node != d.target and m.answering:
                        await a.follow(m.node, d.target, d.epoch)
                if self.switchover_to == d.target:
                    self.switchover_to = None
        elif d.action is Action.FOLLOW:
            assert d.target is not None
            for node in sorted(d.nodes):
                await a.follow(node, d.target, d.epoch)
        elif d.action in (
            Action.SHRINK_ISR,
            Action.TRACK,
            Action.UNTRACK,
            Action.GROW_ISR,
            Action.SET_MIN,
        ):
            # The record first, then the primary (rule 4): on shrink and untrack the primary
            # may stop waiting for a member only once the record no longer names it; a member
            # is named in the ISR only once the primary reported that it waits for it.
            assert record.holder is not None
            stored = await self._write(record, replace(record, isr=d.isr, tracking=d.tracking), d)
            if stored is not None:
                await a.set_isr(record.holder, stored, d.reason)
        elif d.action is Action.REFUSE:
            self.switchover_to = None
        elif d.action is Action.RESTART and self.restarter is not None:
            assert d.target is not None
            await self.restarter.restart(d.target, d.reason)

    async def _write(
        self, old: ElectionRecord, new: ElectionRecord, d: Decision
    ) -> ElectionRecord | None:
        """Compare-and-set; every record written carries the ISR minimum the settings give,
        as far as its ISR reaches (`decide.isr_min`)."""
        new = replace(new, isr_min=decide_mod.isr_min(new, self.settings))
        stored = await self.store.compare_and_set(old, new)
        if stored is None:
            log.warning(
                "cluster=%s epoch=%d %s lost a compare-and-set race; looking again",
                self.cluster,
                old.epoch,
                d.action.value,
            )
        return stored

    def _unavailable(self, reason: str) -> None:
        said, at, turns = self.unavailable
        now = self.clock.monotonic()
        if reason == said and now - at < REPEAT_SECONDS:
            self.unavailable = (said, at, turns + 1)
            return
        again = f" (still, {turns + 1} turns since it was last said)" if reason == said else ""
        log.warning("cluster=%s cannot look or act this turn: %s%s", self.cluster, reason, again)
        self.unavailable = (reason, now, 0)

    async def run(self, stopped: Stopped) -> None:
        while not stopped.is_set():
            try:
                d = await self.turn()
                self.unavailable = ("", 0.0, 0)  # a reason that comes back is said again
            except Unavailable as exc:
                self._unavailable(str(exc))
                d = None
            except Exception:
                log.exception("cluster=%s %s", self.cluster, BUG)
                d = None
            if d is None or d.action in (Action.HOLD, Action.WAIT, Action.REFUSE, Action.RESTART):
                await self.clock.sleep(self.poll_interval)
