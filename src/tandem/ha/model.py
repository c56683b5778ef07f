"""Immutable snapshots the failover logic decides on: positions, members, the election record.

Nothing here reads a clock or does I/O. How long a member has been silent is measured by the
observer on the controller's own monotonic clock and handed in as a number (`silent_for`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Liveness(enum.Enum):
    UP = "up"  # answered the controller's last poll
    SILENT = "silent"  # has missed polls for `silent_for` seconds (paused, cut off, overloaded)
    DOWN = "down"  # known dead: its process exited, its pod terminated (or it restarted since)


class Role(enum.Enum):
    PRIMARY = "primary"
    BACKUP = "backup"
    STANDALONE = "standalone"  # a lone `tandem broker`, never part of a decision


@dataclass(frozen=True, slots=True, order=True)
class Position:
    """A place in the replicated log: the term that wrote it, then the offset. Compared as a
    pair, as Kafka compares (leader epoch, offset)."""

    epoch: int = 0
    offset: int = 0

    def __str__(self) -> str:
        return f"{self.epoch}:{self.offset}"


@dataclass(frozen=True, slots=True)
class Member:
    """What the controller last observed of one member."""

    node: str
    liveness: Liveness
    role: Role = Role.BACKUP
    epoch: int = 0  # the highest epoch the member has adopted (fencing raises it)
    position: Position = Position()
    following: str | None = None  # the primary a backup takes records from
    silent_for: float = 0.0  # seconds since its last answer, on the controller's clock
    # From the primary's report, taken at one instant: the member has acked everything the
    # primary has confirmed (`caught_up`), and the primary waits for its acks (`waited`).
    caught_up: bool = False
    waited: bool = False
    # Of what the primary has confirmed, the records this member has not acked; None until
    # it acked over its current connection. `caught_up` when it is 0.
    behind: int | None = None
    # On the primary: the version of the election record whose wait set it applied last.
    applied_version: int = 0
    lag_records: int = 0  # records the primary holds that this member has not acked
    lag_seconds: float = 0.0  # age of the oldest record this member has not acked
    # False while the member's log names records it lost in a restart (messages that were
    # only in memory): it holds less than its position says until it takes a full copy.
    whole: bool = True
    # Set while the member could not apply one of the primary's records (a bug, said once in
    # its log): why its state is not the primary's. It is not whole either, until a copy.
    diverged: str | None = None

    @property
    def answering(self) -> bool:
        return self.liveness is Liveness.UP


@dataclass(frozen=True, slots=True)
class ElectionRecord:
    """One per cluster, written only by the controller, by compare-and-set on `version`."""

    holder: str | None  # the primary, None before the first election
    epoch: int  # the primary's term; only grows
    isr: frozenset[str]  # the in-sync set: members holding every confirmed record
    version: int = 0  # the compare-and-set counter of the store that keeps the record
    # Members on their way into the ISR: the primary waits for their acks too, so that once
    # one has acked all that is confirmed, the ISR may name it (rule 4).
    tracking: frozenset[str] = frozenset()
    # The ISR minimum, as the controller set it: the primary confirms nothing with fewer in
    # sync. It travels here (not only in each broker's config) so that a change of it, or a
    # scale-down, reaches the brokers and the controller together. None in a record written
    # before it was part of the record: the members' configured minimum holds.
    isr_min: int | None = None

    def __post_init__(self) -> None:
        if self.holder is not None and self.holder not in self.isr:
            raise ValueError(f"the primary {self.holder} must be in its own ISR {set(self.isr)}")
        if self.isr & self.tracking:
            raise ValueError(f"{set(self.isr & self.tracking)} both in the ISR and tracked")

    @property
    def waited(self) -> frozenset[str]:
        """The members whose acks the primary must wait for: the ISR and the tracked ones."""
        return self.isr | self.tracking

    @classmethod
    def initial(cls, nodes: list[str] | tuple[str, ...]) -> ElectionRecord:
        """A new cluster: no primary, epoch 0, every member in sync (all stores are empty)."""
        return cls(holder=None, epoch=0, isr=frozenset(nodes))

    def to_dict(self) -> dict[str, object]:
        """The record as JSON-ready values (the file, the /ha commands, a Lease)."""
        return {
            "holder": self.holder,
            "epoch": self.epoch,
            "isr": sorted(self.isr),
            "tracking": sorted(self.tracking),
            "version": self.version,
            **({"isr_min": self.isr_min} if self.isr_min is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: object) -> ElectionRecord:
        """Raises ValueError on anything but a record as `to_dict` writes it."""
        if not isinstance(data, dict):
            raise ValueError("an election record is a JSON object")
        try:
            holder = data.get("holder")
            return cls(
                holder=None if holder is None else str(holder),
                epoch=int(data["epoch"]),
                isr=frozenset(str(n) for n in data["isr"]),
                version=int(data.get("version", 0)),
                tracking=frozenset(str(n) for n in data.get("tracking", ())),
                isr_min=None if data.get("isr_min") is None else int(data["isr_min"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not an election record: {exc!r}") from None

    def describe(self) -> str:
        isr = ",".join(sorted(self.isr)) or "-"
        tracking = f" tracking={','.join(sorted(self.tracking))}" if self.tracking else ""
        least = f" isr_min={self.isr_min}" if self.isr_min is not None else ""
        return f"primary={self.holder or '-'} epoch={self.epoch} isr={isr}{tracking}{least}"


@dataclass(frozen=True, slots=True)
class Settings:
    failover_delay: float = 1.0  # seconds of silence before a primary is replaced
    isr_min: int = 2  # below it the primary stops confirming; never shrink under it
    max_lag_records: int = 100_000  # an ISR member further behind than this is dropped
    max_lag_seconds: float = 10.0  # ... or whose oldest unacked record is this old
    # A member this few confirmed records short of the ISR is tracked: the primary waits for
    # it, and its publishers pause while it takes them (decide, TRACK).
    track_records: int = 25_000


@dataclass(frozen=True, slots=True)
class View:
    """Everything one decision is made on."""

    record: ElectionRecord
    members: tuple[Member, ...]
    switchover_to: str | None = None  # a planned switchover asked for (`cluster switchover`)
    # Maintenance the platform asks for; decide orders it safely. `leaving`: members a
    # scale-down removes (out of the ISR first, never below the minimum). `stopping`: members
    # being stopped (a pod deleted, a node drained); the primary hands over first. `stale`:
    # members on an old revision, restarted one at a time, backups first, the primary last.
    leaving: frozenset[str] = frozenset()
    stopping: frozenset[str] = frozenset()
    stale: frozenset[str] = frozenset()
    by_node: dict[str, Member] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_node", {m.node: m for m in self.members})

    def member(self, node: str | None) -> Member | None:
        return None if node is None else self.by_node.get(node)
