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
    TRACK = "track"  # have the primary wait for a member that (nearly) caught up
    UNTRACK = "untrack"  # stop waiting for a tracked member that fell behind again
    GROW_ISR = "grow_isr"  # name a tracked member in the ISR once the primary waits for it
    SET_MIN = "set_min"  # record the ISR minimum the settings give (changed, or not yet there)
    REFUSE = "refuse"  # an asked-for switchover that would be unsafe
    RESTART = "restart"  # a rolling upgrade's next step: restart `target` on the new revision


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str
    epoch: int = 0  # FENCE, PROMOTE: the new epoch; FOLLOW, SHRINK, GROW: the current one
    nodes: frozenset[str] = frozenset()  # FENCE, FOLLOW: the members it applies to
    # PROMOTE: the new primary; FOLLOW: the primary to follow; RESTART: the member to restart
    target: str | None = None
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


def route(view: View) -> str | None:
    """The member that receives clients: the record's holder while it is primary in the
    record's epoch and no member has adopted a later one. Briefly silent, it keeps them (they
    wait, as they would for any slow broker) until the controller fences it. None while there
    is no such member (a failover under way): new clients are held, not sent to wait."""
    record = view.record
    holder = view.member(record.holder)
    if holder is None or holder.liveness is Liveness.DOWN:
        return None
    if holder.role is not Role.PRIMARY or holder.epoch != record.epoch:
        return None
    if any(m.epoch > record.epoch for m in view.members):
        return None  # fenced members refuse the holder's records: it confirms nothing more
    return holder.node


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
        why = why or f"switchover to {target} asked for"
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
    # Any candidate holds every confirmed record; one that is not about to go (leaving,
    # stopping, on an old revision) is preferred, so that a hand-over completes the same way
    # whichever turn, or whichever controller, takes its second step.
    going = _going(view)
    staying = [m for m in candidates if m.node not in going] or candidates
    choice = choice or ranking.best(staying, record.holder)
    assert choice is not None
    if target is not None:
        which = " (asked for)"
    elif len(staying) < len(candidates):
        which = f", the highest of those staying ({', '.join(sorted(going))} about to go)"
    else:
        which = ", the highest"
    return Decision(
        Action.PROMOTE,
        f"{why}; {choice.node} is the fenced in-sync member with position {choice.position}"
        + which,
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
    if primary.node in view.leaving | view.stopping:
        # The primary is leaving (a scale-down) or stopping (a pod deleted, a node drained):
        # it hands over to a member in sync before it goes. (On an old revision only, it is
        # the rolling upgrade's last step: see `_roll`.)
        how = "leaving (a scale-down)" if primary.node in view.leaving else "stopping"
        handing = _hand_over(view, primary, how)
        if handing is not None:
            return handing
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
    leaving = (record.isr | record.tracking) & (view.leaving - {primary.node})
    waiting = ""  # why a scale-down waits: the members that stay must come in sync first
    if leaving:
        names = ", ".join(sorted(leaving))
        staying = record.isr - leaving
        if len(staying) < settings.isr_min:
            waiting = (
                f"scaling down: {names} would leave the ISR {_names(record.isr)} below its "
                f"minimum of {settings.isr_min}; waiting for the members that stay to be in sync"
            )
    if leaving and not waiting:
        return Decision(
            Action.SHRINK_ISR,
            f"scaling down: {names} leaving the ISR before they go",
            epoch=record.epoch,
            isr=staying,
            tracking=record.tracking - leaving,
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
        if m.node not in record.waited | view.leaving and m.answering and _near(m, settings):
            short = "has acked all" if m.caught_up else f"is {m.behind} records short of all"
            return Decision(
                Action.TRACK,
                f"{m.node} {short} that is confirmed; the primary is to wait for it",
                epoch=record.epoch,
                isr=record.isr,
                tracking=record.tracking | {m.node},
            )
    target = isr_min(record, settings)
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
    if waiting:
        return Decision(Action.HOLD, waiting, epoch=record.epoch)
    if view.stale:
        return _roll(view, primary)
    return Decision(Action.HOLD, f"primary {primary.node} serves; {record.describe()}")


def _going(view: View) -> frozenset[str]:
    return view.leaving | view.stopping | view.stale


def _names(nodes: frozenset[str]) -> str:
    return ",".join(sorted(nodes)) or "-"


def _hand_over(view: View, primary: Member, how: str) -> Decision | None:
    """A switchover away from a primary that is about to go, to the in-sync member that stays
    with the highest position; None when no such member answers (it goes without one)."""
    record = view.record
    going = _going(view)
    ready = [
        m
        for m in view.members
        if m.node in record.isr - going and m.answering and not _lost_store(m, record.epoch)
    ]
    choice = ranking.best(ready)
    if choice is None:
        return None
    return _failover(
        view,
        choice.node,
        f"primary {primary.node} is {how}: switching over to {choice.node}, in sync and staying",
    )


def _roll(view: View, primary: Member) -> Decision:
    """A rolling upgrade, one member at a time, only while the whole cluster serves in sync:
    the backups first (lowest name first), then a switchover away from the primary, which is
    then a backup to restart."""
    record = view.record
    stale = ", ".join(sorted(view.stale))
    everyone = frozenset(m.node for m in view.members)
    busy = sorted(m.node for m in view.members if not m.answering) + sorted(view.stopping)
    if busy:
        why = f"{', '.join(busy)} not running yet"
    elif record.isr != everyone:
        why = f"not every member is in sync (ISR {_names(record.isr)})"
    else:
        backups = sorted(view.stale - {primary.node})
        if backups:
            return Decision(
                Action.RESTART,
                f"rolling upgrade: restarting backup {backups[0]} on the new revision "
                f"(old: {stale})",
                epoch=record.epoch,
                target=backups[0],
            )
        handing = _hand_over(view, primary, "the last member on the old revision")
        if handing is not None:
            return handing
        why = "no member on the new revision to hand over to"
    return Decision(
        Action.HOLD,
        f"rolling upgrade waits: {why} (old revision: {stale}); {record.describe()}",
        epoch=record.epoch,
    )


def isr_min(record: ElectionRecord, settings: Settings) -> int:
    """The minimum the record should hold. A lower setting applies at once (a scale-down, an
    edit). A higher one rises only as far as the ISR already reaches, so that adding members
    or raising the setting never blocks publishers while the new members catch up; it never
    falls below what the record holds, so it never weakens a promise already made."""
    wanted, now = settings.isr_min, record.isr_min
    if now is None or wanted <= now:
        return wanted
    return max(now, min(wanted, len(record.isr)))


def _near(m: Member, settings: Settings) -> bool:
    """Whether the primary should start waiting for `m`: it has acked all that is confirmed,
    or is at most `track_records` short of it with room to lag that much more before it
    would be dropped; never one that UNTRACK would drop at once (a member shrunk for an
    unacked record 10 s old, on a slow load, is a few records short). Under a load that
    does not wait for confirms, a member catching up after a restart stayed tens of
    thousands of records behind for seconds, its CPU shared with the load it chased (issue
    16). Tracked, it holds back the confirms, and the primary's flow control pauses the
    publishers while it takes the rest; it joins the ISR only once it holds all that is
    confirmed (GROW_ISR)."""
    if _out_of_sync(m, settings) is not None:
        return False
    if m.caught_up:
        return True
    return (
        m.behind is not None
        and m.behind <= settings.track_records
        and m.lag_records + settings.track_records <= settings.max_lag_records
    )


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
