"""Which candidate is the most up to date."""

from __future__ import annotations

from collections.abc import Iterable

from tandem.ha.model import Member


def order(member: Member, previous: str | None = None) -> tuple[int, int, bool, str]:
    """Sort key, best first: highest (epoch, offset); on a tie the previous primary (it needs
    no truncation), then the lowest node name, so every controller picks the same member."""
    return (-member.position.epoch, -member.position.offset, member.node != previous, member.node)


def best(candidates: Iterable[Member], previous: str | None = None) -> Member | None:
    return min(candidates, key=lambda m: order(m, previous), default=None)
