"""A restarted cluster member closes its early admin API while its store loads and opens it
again after (node.py). The port stays its own meanwhile (`_hold_port`): no other socket can
bind it, a connection is refused at once rather than left waiting, and the API listens on
the very socket held, under uvloop as the broker runs. Before, the port was bound anew after
the load, and a member of a cluster started again found it taken and could not start."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest
import uvloop

from tandem.broker import admin
from tandem.broker.config import Config
from tandem.broker.node import Node, _hold_port


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_port_held_while_the_store_loads_is_the_one_the_api_listens_on() -> None:
    port = _free_port()
    held = _hold_port("127.0.0.1", port)
    assert held is not None
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", port))
    assert taken.value.errno == 98  # EADDRINUSE
    with socket.socket() as client, pytest.raises(ConnectionRefusedError):
        client.settimeout(5)
        client.connect(("127.0.0.1", port))

    async def serve() -> tuple[int, int]:
        runner, listening = await admin.start(Node(Config()), "127.0.0.1", port, 1.0, held)
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            status = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).status)
        finally:
            await runner.cleanup()
        return listening, status

    assert uvloop.run(serve()) == (port, 200)


def test_a_port_taken_already_is_not_held() -> None:
    """Then the API binds it anew after the load, and says so if it cannot."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert _hold_port("127.0.0.1", listener.getsockname()[1]) is None
