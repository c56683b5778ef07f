"""The HTTP observer both controllers use, against members that answer, refuse or hang."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tandem.broker import ha_http
from tandem.broker.ha_http import HttpObserver
from tandem.ha.model import ElectionRecord, Liveness


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


@pytest.mark.asyncio
async def test_a_look_does_not_wait_for_a_member_that_did_not_answer_its_last_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 16: a paused primary held every look for the whole poll timeout, so its silence
    was judged in steps of 0.4 s and a hang took 1.8 s to fail over (1 s delay)."""
    monkeypatch.setattr(ha_http, "STATUS_TIMEOUT", 60.0)  # a hang outlasts the test
    released = asyncio.Event()
    hung: list[str] = []

    async def status(request: web.Request) -> web.Response:
        node = request.match_info["node"]
        if node == "b" and hung:  # b's first poll is refused; later ones hang
            await released.wait()
        if node == "b":
            hung.append(node)
            if len(hung) == 1:
                return web.Response(status=503)
        return web.json_response({"role": "primary" if node == "a" else "backup", "epoch": 1})

    app = web.Application()
    app.router.add_get("/{node}/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    procs = {n: Endpoint(n, f"127.0.0.1:{port}/{n}") for n in ("a", "b")}
    record = ElectionRecord("a", 1, frozenset({"a", "b"}))
    try:
        async with aiohttp.ClientSession() as session:
            observer = HttpObserver(procs, session, "key")
            first = {m.node: m.liveness for m in await observer.observe(record)}
            assert first == {"a": Liveness.UP, "b": Liveness.SILENT}
            second = {m.node: m.liveness for m in await observer.observe(record)}
            assert second == {"a": Liveness.UP, "b": Liveness.SILENT}
            assert not observer.polls["b"].done(), "the look waited for the silent member"
            released.set()
            await observer.polls["b"]
            third = {m.node: m.liveness for m in await observer.observe(record)}
            assert third == {"a": Liveness.UP, "b": Liveness.UP}  # answering, it is waited for
    finally:
        released.set()
        await runner.cleanup()
