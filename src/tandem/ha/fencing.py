"""The rules a broker applies to itself, so that safety never depends on the controller's
timing: epochs only grow (rule 1), acks count only in the epoch they were sent in (rule 2), and
a confirm needs the whole in-sync set, never fewer than its minimum (rule 3)."""

from __future__ import annotations

import enum
from collections.abc import Set

from tandem.ha.model import Role


class Verdict(enum.Enum):
    ACCEPT = "accept"  # take it (adopting the sender's epoch if it is higher)
    REFUSE = "refuse"  # the sender is from an older epoch: ignore it and tell it ours
    STEP_DOWN = "step_down"  # a primary saw a higher epoch: close clients with 320, rejoin


def on_epoch(my_epoch: int, my_role: Role, their_epoch: int) -> Verdict:
    """A record, ack or command from a peer at `their_epoch` (rule 1)."""
    if their_epoch < my_epoch:
        return Verdict.REFUSE
    if their_epoch > my_epoch and my_role is Role.PRIMARY:
        return Verdict.STEP_DOWN
    return Verdict.ACCEPT


def fence(my_epoch: int, requested: int) -> int | None:
    """/ha/fence: adopt the requested epoch if it is higher; None refuses a stale request."""
    return requested if requested > my_epoch else (my_epoch if requested == my_epoch else None)


def ack_counts(ack_epoch: int, my_epoch: int) -> bool:
    """Rule 2: an ack is for the epoch it was sent in; a primary that has been replaced
    (its epoch is now lower than the backups') never completes a round with them."""
    return ack_epoch == my_epoch


def may_confirm(
    isr: Set[str], acked: Set[str], isr_min: int, tracking: Set[str] = frozenset()
) -> bool:
    """Rule 3: every ISR member (and every tracked member, on its way into the ISR) has the
    record, and the ISR is not below its minimum."""
    return len(isr) >= isr_min and isr <= acked and tracking <= acked


def lease_lapsed(since_renewal: float, lease: float) -> bool:
    """A primary that has not heard from the controller for the lease closes its clients
    (liveness only: safety comes from the epochs)."""
    return since_renewal >= lease
