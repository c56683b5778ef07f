"""The controller's one decision function: a view in, one decision with its reason out.

Pure: no clock, no I/O. The loop calls it again after acting, so a failover is a sequence of
decisions (fence, then promote, then follow), each safe on its own if the controller dies right
after it. docs/failover.md has the table these rules implement; the unit tests read that table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tandem.ha import ranking
from tandem.ha.model import ElectionRecord, Liveness, Member, Role, Settings, View


class Action(enum.Enum):
    HOLD = "hold"  # the primary serves; renew the record
    WAIT = "wait"  # nothing safe to do yet; look again
    FENCE = "fence"  # failover, phase 1: the candidates adopt epoch E+1
    PROMOTE = "promote"  # failover, phase 2: the best fenced in-sync member becomes primary
    FOLLOW = "follow"  # members that do not follow the primary at its epoch are told to
    SHRINK_ISR = "shrink_isr"  # drop a member that is down or lagging (before the primary may)
    TRACK = "track"  # have the primary wait for a member that has caught up
    UNTRACK = "untrack"  # stop waiting for a tracked member that fell behind again
    GROW_ISR = "grow_isr"  # name a tracked member in the ISR once the primary waits for it
    SET_MIN = "set_min"  # record the ISR minimum the settings give (changed, or not yet there)
    REFUSE = "refuse"  # an asked-for switchover that would be unsafe


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str
    epoch: int = 0  # FENCE, PROMOTE: the new epoch; FOLLOW, SHRINK, GROW: the current one
    nodes: frozenset[str] = frozenset()  # FENCE, FOLLOW: the members it applies to
    target: str | None = None  # PROMOTE: the new primary; FOLLOW: the primary to follow
    # PROMOTE and the record changes (SHRINK_ISR, TRACK, UNTRACK, GROW_ISR): what to record.
    isr: frozenset[str] = frozenset()
    tracking: frozenset[str] = frozenset()


def decide(view: View, settings: Settings) -> Decision:
    record = view.record
    primary = view.member(record.holder)
    in_flight = sorted(m.node for m in view.members if m.epoch > record.epoch)
    if view.switchover_to is not None and view.switchover_to != record.holder:
        return _failover(view, view.switchover_to)
    if in_flight:
        # A member adopted a higher epoch: a failover began (perhaps by a controller that
        # died). The old primary cannot confirm any more, so the failover must complete.
        return _failover(view, None, f"{', '.join(in_flight)} already fenced at a higher epoch")
    if primary is not None and _serves(primary, record.epoch):
        return _maintain(view, settings, primary)
    if (
        primary is not None
        and primary.liveness is Liveness.SILENT
        and primary.silent_for < settings.failover_delay
    ):
        return Decision(
            Action.WAIT,
            f"primary {primary.node} silent for {primary.silent_for:.2f}s; failover after "
            f"{settings.failover_delay:g}s",
        )
    return _failover(view, None, _why_no_primary(view))


def _serves(m: Member, epoch: int) -> bool:
    return m.answering and m.role is Role.PRIMARY and m.epoch == epoch


def _why_no_primary(view: View) -> str:
    holder = view.record.holder
    m = view.member(holder)
    if holder is None:
        return "no primary yet"
    if m is None or m.liveness is Liveness.DOWN:
        return f"primary {holder} is down"
    if m.liveness is Liveness.SILENT:
        return f"primary {holder} silent for {m.silent_for:.2f}s"
    return f"{holder} answers as {m.role.value} at epoch {m.epoch}, not as primary"


def _failover(view: View, target: str | None, why: str = "") -> Decision:
    record = view.record
    epoch = record.epoch + 1
    isr = ",".join(sorted(record.isr)) or "-"
    if target is not None:
        why = f"switchover to {target} asked for"
        t = view.member(target)
        if target not in record.isr:
            return Decision(Action.REFUSE, f"{why}, but {target} is not in sync (ISR {isr})")
        if t is None or not t.answering:
            return Decision(Action.REFUSE, f"{why}, but {target} does not answer")
        if _lost_store(t, record.epoch):
            lost = f"is diverged ({t.diverged})" if t.diverged else "has lost its store"
            return Decision(Action.REFUSE, f"{why}, but {target} {lost}")
    # Every ISR member holds every confirmed record (rule 3), so any of them is safe; the
    # answering ones are fenced first so that their positions are final when compared. One
    # whose epoch is below the record's has lost its store, one that is `partial` what it held
    # only in memory (see `_lost_store`).
    in_sync = [
        m for m in view.members if m.node in record.isr and m.answering and m.epoch >= record.epoch
    ]
    candidates = [m for m in in_sync if m.whole]
    if not candidates and in_sync and _none_whole_left(view):
        # Every in-sync member restarted (a full-cluster restart, rule 8): what they held
        # only in memory is gone from all of them, so the best of them is as good as any.
        candidates = in_sync
        why += "; every in-sync member restarted, so messages held only in memory are gone"
    if not candidates:
        return Decision(
            Action.WAIT,
            f"{why}; no in-sync member answers: waiting for one of {isr}, the only members "
            f"that hold every confirmed message",
        )
    unfenced = frozenset(m.node for m in candidates if m.epoch < epoch)
    if unfenced:
        return Decision(
            Action.FENCE,
            f"{why}; fencing {', '.join(sorted(unfenced))} at epoch {epoch} so that the old "
            f"primary can confirm nothing more",
            epoch=epoch,
            nodes=unfenced,
        )
    choice = view.member(target) if target is not None else None
    choice = choice or ranking.best(candidates, record.holder)
    assert choice is not None
    return Decision(
        Action.PROMOTE,
        f"{why}; {choice.node} is the fenced in-sync member with position {choice.position}"
        + (" (asked for)" if target is not None else ", the highest"),
        epoch=epoch,
        target=choice.node,
        isr=frozenset(m.node for m in candidates),
    )


def _lost_store(m: Member, epoch: int) -> bool:
    """Every member the record names in its ISR adopted the record's epoch before it was
    named (fenced before a promotion, or told to follow before it grew back), and the epoch is
    on disk. A member named there with a lower epoch has come back without its store: it is
    not in sync, whatever it says. So is one that says it lost records kept only in memory
    (`whole` false) until it has taken a full copy."""
    return m.answering and (m.epoch < epoch or not m.whole)


def _none_whole_left(view: View) -> bool:
    """No ISR member can still hold what was only in memory: each is down (a process that
    ended lost its memory) or answers as partial; none is merely silent."""
    for node in view.record.isr:
        m = view.member(node)
        if m is None or m.liveness is Liveness.DOWN:
            continue
        if m.liveness is Liveness.SILENT or m.whole:
            return False
    return True


def _maintain(view: View, settings: Settings, primary: Member) -> Decision:
    record = view.record
    for node in sorted(record.isr - {primary.node}):
        m = view.member(node)
        if m is not None and _lost_store(m, record.epoch):
            # Dropped even below the ISR minimum: the primary then confirms nothing until
            # the member has caught up again and grown back.
            if m.epoch < record.epoch:
                lost = (
                    f"came back at epoch {m.epoch} below the record's {record.epoch}: it has "
                    "lost its store"
                )
            elif m.diverged:
                lost = f"diverged ({m.diverged}); it takes a copy from the primary"
            else:
                lost = "restarted and lost what it held only in memory"
            return Decision(
                Action.SHRINK_ISR,
                f"{node} {lost}; dropping it from the ISR before it rejoins",
                epoch=record.epoch,
                isr=record.isr - {node},
                tracking=record.tracking,
            )
    strays = frozenset(
        m.node
        for m in view.members
        if m.node != primary.node
        and m.answering
        and (m.role is not Role.BACKUP or m.following != primary.node or m.epoch != record.epoch)
    )
    if strays:
        return Decision(
            Action.FOLLOW,
            f"{', '.join(sorted(strays))} not following primary {primary.node} at epoch "
            f"{record.epoch}",
            epoch=record.epoch,
            nodes=strays,
            target=primary.node,
        )
    for node in sorted(record.isr - {primary.node}):
        problem = _out_of_sync(view.member(node), settings)
        if problem is None:
            continue
        smaller = record.isr - {node}
        if len(smaller) < settings.isr_min:
            return Decision(
                Action.HOLD,
                f"{node} {problem}, but the ISR is at its minimum of {settings.isr_min}: the "
                f"primary keeps waiting for it rather than confirm without it",
                epoch=record.epoch,
            )
        return Decision(
            Action.SHRINK_ISR,
            f"{node} {problem}; dropping it from the ISR before the primary stops waiting for it",
            epoch=record.epoch,
            isr=smaller,
            tracking=record.tracking,
        )
    for node in sorted(record.tracking):
        problem = _out_of_sync(view.member(node), settings)
        if problem is not None:
            return Decision(
                Action.UNTRACK,
                f"{node} {problem}; the primary stops waiting for it (it is not in the ISR)",
                epoch=record.epoch,
                isr=record.isr,
                tracking=record.tracking - {node},
            )
    if primary.applied_version < record.version:
        # A lost or late message: the renewal carries the record, and nothing is grown
        # until the primary is known to wait for what the record says.
        return Decision(
            Action.HOLD,
            f"primary {primary.node} has applied record version {primary.applied_version}, "
            f"not {record.version}; renewing with it",
            epoch=record.epoch,
        )
    for node in sorted(record.tracking):
        m = view.member(node)
        if m is not None and m.waited and m.caught_up:
            return Decision(
                Action.GROW_ISR,
                f"{node} holds all that is confirmed and the primary waits for its acks; "
                f"naming it in the ISR",
                epoch=record.epoch,
                isr=record.isr | {node},
                tracking=record.tracking - {node},
            )
    for m in view.members:
        if m.node not in record.waited and m.answering and m.caught_up:
            return Decision(
                Action.TRACK,
                f"{m.node} has acked all that is confirmed; the primary is to wait for it",
                epoch=record.epoch,
                isr=record.isr,
                tracking=record.tracking | {m.node},
            )
    target = _isr_min(record, settings)
    if target != record.isr_min:
        was = "none" if record.isr_min is None else str(record.isr_min)
        on_the_way = (
            f", on the way to {settings.isr_min} as members come in sync"
            if target < settings.isr_min
            else ""
        )
        return Decision(
            Action.SET_MIN,
            f"the ISR minimum is {target} (the record says {was}){on_the_way}",
            epoch=record.epoch,
            isr=record.isr,
            tracking=record.tracking,
        )
    return Decision(Action.HOLD, f"primary {primary.node} serves; {record.describe()}")


def _isr_min(record: ElectionRecord, settings: Settings) -> int:
    """The minimum the record should hold. A lower setting applies at once (a scale-down, an
    edit). A higher one rises only as far as the ISR already reaches, so that adding members
    or raising the setting never blocks publishers while the new members catch up; it never
    falls below what the record holds, so it never weakens a promise already made."""
    wanted, now = settings.isr_min, record.isr_min
    if now is None or wanted <= now:
        return wanted
    return max(now, min(wanted, len(record.isr)))


def _out_of_sync(m: Member | None, settings: Settings) -> str | None:
    if m is None or m.liveness is Liveness.DOWN:
        return "is down"
    if m.liveness is Liveness.SILENT and m.silent_for >= settings.failover_delay:
        return f"has been silent for {m.silent_for:.2f}s"
    if m.lag_records > settings.max_lag_records:
        return f"lags {m.lag_records} records"
    if m.lag_seconds > settings.max_lag_seconds:
        return f"lags {m.lag_seconds:.1f}s"
    return None
