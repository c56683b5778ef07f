"""The HTTP observer both controllers use, against members that answer, refuse or hang."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from tandem.broker import ha_http
from tandem.broker.ha_http import HttpObserver
from tandem.ha import decide
from tandem.ha.model import ElectionRecord, Liveness, Role, Settings, View

RECORD = ElectionRecord("a", 1, frozenset({"a", "b"}))
SLOW = 0.6  # longer than a look waits (LOOK_SECONDS), shorter than the failover delay
LATE = 0.1  # shorter than a look waits


@dataclass
class Endpoint:
    node: str
    admin_address: str
    started: float = 0.0
    last_answer: float = 0.0
    status: dict[str, Any] = field(default_factory=dict)
    alive: bool = True
    replication_address: str = ""
    amqp_address: str = ""


class Members:
    """An admin endpoint per member; each answers its polls as `script[node]` says, in
    turn ("ok", "refuse", "hang", "slow": answer after SLOW seconds, or "late": after
    LATE), the last word repeating."""

    def __init__(self) -> None:
        self.script: dict[str, list[str]] = {}
        self.released = asyncio.Event()

    async def status(self, request: web.Request) -> web.Response:
        node = request.match_info["node"]
        turns = self.script[node]
        word = turns.pop(0) if len(turns) > 1 else turns[0]
        if word == "hang":
            await self.released.wait()
        if word == "slow":
            await asyncio.sleep(SLOW)
        if word == "late":
            await asyncio.sleep(LATE)
        if word == "refuse":
            return web.Response(status=503)
        role = "primary" if node == "a" else "backup"
        return web.json_response({"role": role, "epoch": 1, "position": 7, "last_epoch": 1})


@pytest_asyncio.fixture
async def members(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Members, HttpObserver]]:
    monkeypatch.setattr(ha_http, "ANSWER_SECONDS", 60.0)  # a hang outlasts the test
    served = Members()
    app = web.Application()
    app.router.add_get("/{node}/status", served.status)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    procs = {n: Endpoint(n, f"127.0.0.1:{port}/{n}") for n in ("a", "b")}
    try:
        async with aiohttp.ClientSession() as session:
            yield served, HttpObserver(procs, session, "key")
    finally:
        served.released.set()
        await runner.cleanup()


@pytest.mark.asyncio
async def test_a_look_does_not_wait_for_a_member_that_did_not_answer_its_last_poll(
    members: tuple[Members, HttpObserver],
) -> None:
    """Issue 16: a paused primary held every look for the whole poll timeout, so its silence
    was judged in steps of 0.4 s and a hang took 1.8 s to fail over (1 s delay)."""
    served, observer = members
    served.script = {"a": ["ok"], "b": ["refuse", "hang", "ok"]}
    first = {m.node: m.liveness for m in await observer.observe(RECORD)}
    assert first == {"a": Liveness.UP, "b": Liveness.SILENT}
    second = {m.node: m.liveness for m in await observer.observe(RECORD)}
    assert second == {"a": Liveness.UP, "b": Liveness.SILENT}
    assert not observer.polls["b"].done(), "the look waited for the silent member"
    served.released.set()
    await observer.polls["b"]
    third = {m.node: m.liveness for m in await observer.observe(RECORD)}
    assert third == {"a": Liveness.UP, "b": Liveness.UP}  # answering, it is waited for


@pytest.mark.asyncio
async def test_a_look_waits_for_a_member_restarted_since_its_poll_went_unanswered(
    members: tuple[Members, HttpObserver],
) -> None:
    """A member killed did not answer its last poll, nor the polls while its next life
    started; restarted, recovered and listening (`listening`), it wakes the controller,
    whose next look then takes its first answer. Not waited for, it answered after the look,
    and was told whom to follow a poll later (0.1 s of a rejoin)."""
    served, observer = members
    served.script = {"a": ["ok"], "b": ["refuse", "refuse", "late"]}
    first = {m.node: m.liveness for m in await observer.observe(RECORD)}
    assert first == {"a": Liveness.UP, "b": Liveness.SILENT}
    observer.procs["b"].started += 1.0  # its next life, starting
    starting = {m.node: m.liveness for m in await observer.observe(RECORD)}
    assert starting == {"a": Liveness.UP, "b": Liveness.SILENT}
    observer.listening("b")
    second = {m.node: m.liveness for m in await observer.observe(RECORD)}
    assert second == {"a": Liveness.UP, "b": Liveness.UP}


@pytest.mark.asyncio
async def test_a_member_restarted_before_a_look_saw_it_gone_is_down_until_it_answers(
    members: tuple[Members, HttpObserver],
) -> None:
    """Issue 16: a backup killed and restarted between two looks was taken for silent in
    its new life, so it stayed in the ISR for the failover delay (1.07 s) and its rejoin
    waited for that. Its last life ended: it is down until the new one answers."""
    served, observer = members
    served.script = {"a": ["ok"], "b": ["ok", "refuse", "ok"]}
    first = {m.node: m.liveness for m in await observer.observe(RECORD)}
    assert first == {"a": Liveness.UP, "b": Liveness.UP}
    observer.procs["b"].started = time.monotonic()  # its next life (the observer's clock)
    starting = {m.node: m for m in await observer.observe(RECORD)}
    assert starting["b"].liveness is Liveness.DOWN
    view = View(RECORD, (starting["a"], starting["b"]))
    decision = decide.decide(view, Settings(isr_min=1))
    assert decision.action is decide.Action.SHRINK_ISR, decision
    observer.listening("b")  # as the local cluster says once it is back: the look waits for it
    answered = {m.node: m.liveness for m in await observer.observe(RECORD)}
    assert answered == {"a": Liveness.UP, "b": Liveness.UP}


@pytest.mark.asyncio
async def test_a_silent_primary_is_what_it_last_answered_and_keeps_its_clients(
    members: tuple[Members, HttpObserver],
) -> None:
    """Issue 16: a primary busy under ten publishers answered a poll late; the observer took
    it, silent, for a backup of epoch 0, so `route` named nobody and the front port ended
    every client's connection (write EPIPE), though no failover followed."""
    served, observer = members
    served.script = {"a": ["ok", "refuse"], "b": ["ok"]}
    await observer.observe(RECORD)
    (a, b) = await observer.observe(RECORD)
    assert a.liveness is Liveness.SILENT and b.liveness is Liveness.UP
    assert (a.role, a.epoch, a.position.offset) == (Role.PRIMARY, 1, 7)
    assert decide.route(View(RECORD, (a, b))) == "a"


@pytest.mark.asyncio
async def test_a_member_that_answers_late_is_slow_not_silent(
    members: tuple[Members, HttpObserver], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 16: backups busy under a saturating load answered polls in 0.3-1.2 s; a poll
    not answered within 0.4 s counted as no answer, so a member answering every poll in
    0.6 s was silent for over a second and dropped from the ISR. An answer that comes after
    the look counts in the next one."""
    monkeypatch.setattr(ha_http, "ANSWER_SECONDS", 3 * SLOW)  # no hang in this one
    served, observer = members
    served.script = {"a": ["ok"], "b": ["ok", "slow"]}
    await observer.observe(RECORD)
    settings = Settings()
    loop = asyncio.get_running_loop()
    looks, answered, started = 0, 0, loop.time()
    while loop.time() - started < 4 * SLOW:
        members_now = {m.node: m for m in await observer.observe(RECORD)}
        b = members_now["b"]
        looks += 1
        answered += b.liveness is Liveness.UP
        assert b.silent_for < settings.failover_delay, f"look {looks}: {b}"
        await asyncio.sleep(0.1)  # the controller's poll interval
    assert answered >= 2, f"{answered} of {looks} looks saw b's answers"


@pytest.mark.asyncio
async def test_an_answer_within_a_longer_failover_delay_is_taken(
    members: tuple[Members, HttpObserver], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll's answer was taken for 2 s whatever the failover delay: with a delay of 5 s, a
    member answering every poll in 3 s was silent for the delay and failed over. The answer
    window follows the delay (here scaled down: answers taken for half of SLOW at least, a
    member answering in SLOW, a delay of three times that)."""
    monkeypatch.setattr(ha_http, "ANSWER_SECONDS", SLOW / 2)
    served, observer = members
    settings = Settings(failover_delay=3 * SLOW)
    observer.failover_delay = settings.failover_delay
    served.script = {"a": ["ok"], "b": ["ok", "slow"]}
    await observer.observe(RECORD)
    loop = asyncio.get_running_loop()
    looks, started = 0, loop.time()
    while loop.time() - started < 5 * SLOW:
        b = {m.node: m for m in await observer.observe(RECORD)}["b"]
        looks += 1
        assert b.silent_for < settings.failover_delay, f"look {looks}: {b}"
        await asyncio.sleep(0.1)  # the controller's poll interval
