"""What the HA loop needs from the world, as Protocols. The local cluster implements them on
a file and child processes; the operator on a Lease, pods and a Service."""

from __future__ import annotations

from typing import Protocol

from tandem.ha.model import ElectionRecord, Member


class Unavailable(Exception):
    """A port could not reach what it stands for (an API server, a file system) this turn;
    the loop says so and tries again next turn, rather than report a bug."""


class ElectionStore(Protocol):
    async def read(self) -> ElectionRecord: ...

    async def compare_and_set(
        self, expected: ElectionRecord, new: ElectionRecord
    ) -> ElectionRecord | None:
        """Write `new` if the stored record is still `expected` (same version); return the
        stored record with its new version, or None when another writer got there first."""
        ...


class Observer(Protocol):
    async def observe(self, record: ElectionRecord) -> tuple[Member, ...]:
        """Every member as last seen, liveness timed on the controller's own clock."""
        ...


class Actuator(Protocol):
    async def fence(self, node: str, epoch: int) -> None: ...

    async def promote(self, node: str, record: ElectionRecord) -> None:
        """Make `node` primary of `record` (its holder), waiting for `record.waited`."""
        ...

    async def follow(self, node: str, primary: str, epoch: int) -> None: ...

    async def set_isr(self, primary: str, record: ElectionRecord, why: str = "") -> None:
        """Tell the primary the record's ISR and tracked set; it applies only a version
        newer than the last it applied, so a late message cannot undo a newer one. `why`:
        the decision's reason, which the primary gives its publishers if they must wait."""
        ...

    async def renew(self, primary: str, record: ElectionRecord) -> None:
        """The controller's lease renewal; it carries the record, repairing a lost set_isr."""
        ...


class Restarter(Protocol):
    async def restart(self, node: str, why: str) -> None:
        """Restart `node` on the platform's new revision (a rolling upgrade's step)."""
        ...


class Clock(Protocol):
    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...
