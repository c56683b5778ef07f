"""The failover decision function: docs/failover.md's decision table is the test table, and
hypothesis checks the safety properties on arbitrary views."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.ha import decide, fencing, ranking
from tandem.ha.decide import Action
from tandem.ha.model import ElectionRecord, Liveness, Member, Position, Role, Settings, View

DOC = Path(__file__).resolve().parents[2] / "docs" / "failover.md"
SETTINGS = Settings(failover_delay=1.0, isr_min=2, max_lag_records=100_000)
ROLES = {"primary": Role.PRIMARY, "backup": Role.BACKUP}


def parse_record(text: str) -> ElectionRecord:
    holder, epoch, isr, *rest = text.split()
    extra = dict(word.split("=") for word in rest)
    return ElectionRecord(
        holder=None if holder == "-" else holder,
        epoch=int(epoch.removeprefix("e")),
        isr=frozenset(isr.removeprefix("isr=").split(",")),
        tracking=frozenset(extra["track"].split(",")) if "track" in extra else frozenset(),
        version=int(extra.get("v", 0)),
        # The settings' minimum (2) unless the row says: min=- for a record without one.
        isr_min=None if extra.get("min") == "-" else int(extra.get("min", SETTINGS.isr_min)),
    )


MAINTENANCE = ("leaving", "stopping", "stale")


def parse_member(text: str, holder: str | None) -> Member:
    name_role, epoch, pos, *rest = (w for w in text.split() if w not in MAINTENANCE)
    name, role = name_role.split("=")
    e, o = pos.removeprefix("@").split(":")
    fields: dict[str, object] = {"following": holder}
    liveness = Liveness.UP
    for word in rest:
        if word in ("up", "down"):
            liveness = Liveness(word)
        elif word.startswith("silent="):
            liveness, fields["silent_for"] = Liveness.SILENT, float(word.split("=")[1])
        elif word == "caught-up":
            fields["caught_up"] = True
        elif word == "waited":
            fields["waited"] = True
        elif word == "partial":
            fields["whole"] = False
        elif word == "diverged":
            fields["whole"] = False
            fields["diverged"] = "record 3:7 not applied: define queue.declare 'q'"
        elif word.startswith("applied="):
            fields["applied_version"] = int(word.split("=")[1])
        elif word.startswith("lag="):
            fields["lag_records"] = int(word.split("=")[1])
        elif word.startswith("age="):
            fields["lag_seconds"] = float(word.split("=")[1])
        elif word.startswith("behind="):
            fields["behind"] = int(word.split("=")[1])
        elif word.startswith("follows="):
            target = word.split("=")[1]
            fields["following"] = None if target == "-" else target
        else:
            raise ValueError(f"unknown word {word!r} in {text!r}")
    return Member(
        name,
        liveness,
        ROLES[role],
        int(epoch.removeprefix("e")),
        Position(int(e), int(o)),
        **fields,  # type: ignore[arg-type]
    )


def table(prefix: str = "") -> list[tuple[str, View, str]]:
    """The rows numbered `prefix` and digits: the decisions (no prefix) or the routes (r)."""
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith(prefix):
            continue
        if not cells[0].removeprefix(prefix).isdigit():
            continue
        number, situation, record_text, members_text, expected = cells
        record = parse_record(record_text)
        switchover = None
        members = []
        asked: dict[str, set[str]] = {word: set() for word in MAINTENANCE}
        for part in members_text.split(";"):
            part = part.strip()
            if part.startswith("switchover="):
                switchover = part.split("=")[1]
            else:
                members.append(parse_member(part, record.holder))
                for word in set(part.split()) & set(MAINTENANCE):
                    asked[word].add(members[-1].node)
        view = View(
            record,
            tuple(members),
            switchover,
            leaving=frozenset(asked["leaving"]),
            stopping=frozenset(asked["stopping"]),
            stale=frozenset(asked["stale"]),
        )
        rows.append((f"{number}: {situation}", view, expected))
    return rows


ROWS = table()
ROUTES = table("r")


def test_the_doc_has_the_tables() -> None:
    assert len(ROWS) >= 61 and len(ROUTES) >= 7


@pytest.mark.parametrize(("case", "view", "expected"), ROUTES, ids=[r[0][:60] for r in ROUTES])
def test_route_table(case: str, view: View, expected: str) -> None:
    assert (decide.route(view) or "-") == expected


def render(d: decide.Decision) -> str:
    """A decision in the table's notation."""
    nodes = ",".join(sorted(d.nodes))
    isr = ",".join(sorted(d.isr))
    match d.action:
        case Action.FENCE:
            return f"fence {nodes} @{d.epoch}"
        case Action.PROMOTE:
            return f"promote {d.target} @{d.epoch} isr={isr}"
        case Action.FOLLOW:
            return f"follow {nodes} → {d.target}"
        case Action.RESTART:
            return f"restart {d.target}"
        case Action.SET_MIN:
            return "set_min"
        case Action.SHRINK_ISR | Action.GROW_ISR:
            return f"{d.action.value.split('_')[0]} → {isr}"
        case Action.TRACK | Action.UNTRACK:
            return f"{d.action.value} → {','.join(sorted(d.tracking)) or '-'}"
        case _:
            return d.action.value


@pytest.mark.parametrize(("case", "view", "expected"), ROWS, ids=[r[0][:60] for r in ROWS])
def test_decision_table(case: str, view: View, expected: str) -> None:
    d = decide.decide(view, SETTINGS)
    assert render(d) == expected, d.reason
    assert d.reason and "\n" not in d.reason


def test_reasons_name_the_members_and_epochs() -> None:
    _, view, _ = ROWS[1]  # the primary's process exited
    d = decide.decide(view, SETTINGS)
    assert re.search(r"primary a is down; fencing b, c at epoch 4", d.reason)


def test_a_diverged_member_is_dropped_with_the_record_it_could_not_apply() -> None:
    view = next(v for case, v, _ in ROWS if case.startswith("43:"))
    d = decide.decide(view, SETTINGS)
    assert "b diverged (record 3:7 not applied: define queue.declare 'q')" in d.reason
    refused = next(v for case, v, _ in ROWS if case.startswith("44:"))
    assert "b is diverged (record 3:7" in decide.decide(refused, SETTINGS).reason


# -- properties over arbitrary views --

names = st.sampled_from(["a", "b", "c", "d"])


@st.composite
def views(draw: st.DrawFn) -> View:
    nodes = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    epoch = draw(st.integers(0, 5))
    holder = draw(st.none() | st.sampled_from(nodes))
    isr = frozenset(draw(st.lists(st.sampled_from(nodes), max_size=4, unique=True)))
    isr |= {holder} if holder else set()  # the primary is always in its own ISR
    tracking = frozenset(draw(st.lists(st.sampled_from(nodes), max_size=2, unique=True))) - isr
    version = draw(st.integers(0, 3))
    record = ElectionRecord(holder, epoch, isr, version, tracking)
    # Half the views are settled (every member follows the record's primary at its epoch),
    # so that the ISR rules are reached as often as the failover ones.
    settled = draw(st.booleans())
    members = []
    for node in nodes:
        liveness = draw(st.sampled_from(list(Liveness)))
        if settled:
            role = Role.PRIMARY if node == holder else Role.BACKUP
            member_epoch, following = epoch, holder
        else:
            role = draw(st.sampled_from([Role.PRIMARY, Role.BACKUP]))
            member_epoch = draw(st.integers(max(0, epoch - 2), epoch + 1))
            following = draw(st.none() | st.sampled_from(nodes))
        members.append(
            Member(
                node,
                liveness,
                role,
                member_epoch,
                Position(draw(st.integers(0, epoch + 1)), draw(st.integers(0, 20))),
                following=following,
                silent_for=draw(st.floats(0, 3)) if liveness is Liveness.SILENT else 0.0,
                caught_up=draw(st.booleans()),
                waited=draw(st.booleans()),
                applied_version=draw(st.integers(max(0, version - 1), version)),
                lag_records=draw(st.sampled_from([0, 10, 200_000])),
                lag_seconds=draw(st.sampled_from([0.0, 12.0])),
                behind=draw(st.sampled_from([None, 0, 10, 30_000])),
            )
        )
    switchover = None if settled else draw(st.none() | st.sampled_from(nodes))
    some = st.frozensets(st.sampled_from(nodes), max_size=2)
    # A third of the views carry maintenance: a scale-down, stopping pods, a rolling upgrade.
    leaving, stopping, stale = (
        draw(some) if draw(st.integers(0, 2)) == 0 else frozenset() for _ in range(3)
    )
    return View(record, tuple(members), switchover, leaving, stopping, stale)


@settings(max_examples=1500, deadline=None)
@given(view=views(), isr_min=st.integers(1, 3))
def test_safety_properties(view: View, isr_min: int) -> None:
    s = Settings(failover_delay=1.0, isr_min=isr_min, max_lag_records=100_000)
    record = view.record
    primary_member = view.member(record.holder)
    d = decide.decide(view, s)
    assert d.reason
    # A member the ISR names with an epoch below the record's has lost its store.
    answering_isr = [
        m for m in view.members if m.node in record.isr and m.answering and m.epoch >= record.epoch
    ]
    if d.action is Action.PROMOTE:
        target = view.member(d.target)
        assert target is not None and target.node in record.isr and target.answering
        assert d.epoch == record.epoch + 1
        # Positions are compared only once every answering candidate is fenced ...
        assert all(m.epoch >= d.epoch for m in answering_isr)
        # ... and the most up-to-date one wins unless a switchover named another, or the
        # better ones are about to go (leaving, stopping, on an old revision).
        going = view.leaving | view.stopping | view.stale
        if view.switchover_to is None:
            rivals = [m for m in answering_isr if m.node not in going or target.node in going]
            assert all(target.position >= m.position for m in rivals)
        assert d.isr == frozenset(m.node for m in answering_isr)
        assert d.target in d.isr
    if d.action is Action.FENCE:
        assert d.epoch == record.epoch + 1
        assert d.nodes and d.nodes <= record.isr
    if d.action is Action.SHRINK_ISR:
        dropped = record.isr - d.isr
        if len(dropped) > 1 or d.tracking != record.tracking:
            # a scale-down: only leaving members go, never below the minimum
            assert dropped | (record.tracking - d.tracking) <= view.leaving
            assert len(d.isr) >= isr_min
        else:
            gone = view.member(next(iter(dropped)))
            lost_store = gone is not None and gone.answering and gone.epoch < record.epoch
            lost_store |= dropped <= view.leaving  # or a leaving one, as above
            assert len(d.isr) >= isr_min or lost_store  # only a member without its store goes
        assert record.holder in d.isr and d.tracking <= record.tracking
    if d.action is Action.GROW_ISR:
        # Rule 4: only a tracked member the primary (having applied this very record) waits
        # for, and that holds all that is confirmed.
        (added,) = d.isr - record.isr
        joined = view.member(added)
        assert added in record.tracking and d.tracking == record.tracking - {added}
        assert joined is not None and joined.caught_up and joined.waited
        assert primary_member is not None
        assert primary_member.applied_version == record.version
    if d.action in (Action.TRACK, Action.UNTRACK):
        assert d.isr == record.isr and d.tracking ^ record.tracking
        assert not d.tracking & d.isr
    if d.action is Action.TRACK:
        assert not (d.tracking - record.tracking) & view.leaving
        # Only a member that answers and has acked over its connection all that is
        # confirmed, or all but a few of it (rule 4 still waits for all before the ISR).
        (tracked,) = d.tracking - record.tracking
        m = view.member(tracked)
        assert m is not None and m.answering
        assert m.caught_up or (m.behind is not None and m.behind <= s.track_records)
        assert decide._out_of_sync(m, s) is None  # never one UNTRACK drops at once
    if d.action is Action.RESTART:
        # one stale backup, only while every member serves in sync and none is stopping
        assert d.target in view.stale and d.target != record.holder
        assert all(m.answering for m in view.members) and not view.stopping
        assert record.isr == frozenset(m.node for m in view.members)
    primary = view.member(record.holder)
    serving = (
        primary is not None
        and primary.answering
        and primary.role is Role.PRIMARY
        and primary.epoch == record.epoch
    )
    no_failover_started = all(m.epoch <= record.epoch for m in view.members)
    staying = record.holder not in view.leaving | view.stopping | view.stale
    asked = view.switchover_to in (None, record.holder)
    if serving and no_failover_started and asked and staying:
        assert d.action not in (Action.FENCE, Action.PROMOTE)  # a healthy primary stays
    if decide.route(view) is not None:
        # clients go only to the record's holder, never while a failover is under way
        assert decide.route(view) == record.holder and no_failover_started
        assert primary is not None and primary.liveness is not Liveness.DOWN


def test_a_record_keeps_its_primary_in_the_isr() -> None:
    with pytest.raises(ValueError, match="must be in its own ISR"):
        ElectionRecord("a", 3, frozenset("bc"))


def test_ranking_prefers_position_then_previous_primary_then_name() -> None:
    def m(node: str, e: int, o: int) -> Member:
        return Member(node, Liveness.UP, position=Position(e, o))

    assert ranking.best([m("a", 3, 5), m("b", 4, 1)]) == m("b", 4, 1)
    assert ranking.best([m("b", 3, 5), m("a", 3, 5)]) == m("a", 3, 5)
    assert ranking.best([m("a", 3, 5), m("b", 3, 5)], previous="b") == m("b", 3, 5)
    assert ranking.best([]) is None


# -- the rules a broker applies to itself --


@pytest.mark.parametrize(
    ("mine", "role", "theirs", "verdict"),
    [
        (3, Role.BACKUP, 2, fencing.Verdict.REFUSE),
        (3, Role.PRIMARY, 2, fencing.Verdict.REFUSE),
        (3, Role.BACKUP, 3, fencing.Verdict.ACCEPT),
        (3, Role.BACKUP, 4, fencing.Verdict.ACCEPT),
        (3, Role.PRIMARY, 3, fencing.Verdict.ACCEPT),
        (3, Role.PRIMARY, 4, fencing.Verdict.STEP_DOWN),
    ],
)
def test_epochs_only_grow(mine: int, role: Role, theirs: int, verdict: fencing.Verdict) -> None:
    assert fencing.on_epoch(mine, role, theirs) is verdict


def test_fence_adopts_higher_epochs_only() -> None:
    assert fencing.fence(3, 4) == 4
    assert fencing.fence(4, 4) == 4  # a repeated fence is harmless
    assert fencing.fence(4, 3) is None


def test_acks_and_confirms() -> None:
    assert fencing.ack_counts(4, 4)
    assert not fencing.ack_counts(3, 4)  # an ack from an older round
    assert not fencing.ack_counts(4, 3)  # a stale primary never completes a round
    assert fencing.may_confirm({"a", "b"}, {"a", "b", "c"}, 2)
    assert not fencing.may_confirm({"a", "b"}, {"a"}, 2)
    assert not fencing.may_confirm({"a"}, {"a"}, 2)  # never confirm alone below the minimum
    assert fencing.may_confirm({"a"}, {"a"}, 1)  # a one-member cluster
    assert fencing.lease_lapsed(5.0, 5.0) and not fencing.lease_lapsed(4.9, 5.0)
