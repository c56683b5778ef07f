"""A restarted cluster member closes its early admin API while its store loads and opens it
again after (node.py). The port stays its own meanwhile (`_hold_port`): a socket without
SO_REUSEADDR cannot bind it, a connection is refused at once rather than left waiting, and
the API listens on the very socket held, under uvloop as the broker runs. Before, the port
was bound anew after the load, and a member of a cluster started again found it taken and
could not start."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest
import uvloop

from tandem.broker import admin
from tandem.broker.config import Config
from tandem.broker.node import Node, _hold_port


def test_the_port_held_while_the_store_loads_is_the_one_the_api_listens_on() -> None:
    held = _hold_port("127.0.0.1", 0)
    assert held is not None
    port = held.getsockname()[1]
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


def test_a_server_that_listened_first_on_the_held_port_is_an_error_to_listen() -> None:
    """Only a server binding that very port with SO_REUSEADDR can share it while it is held,
    and listening first, it has it: the API's start then raises OSError (which the node
    reports as the option to change), not a failure to read the port it listens on."""
    held = _hold_port("127.0.0.1", 0)
    assert held is not None
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(held.getsockname())
        other.listen()

        async def start() -> None:
            await admin.start(Node(Config()), "127.0.0.1", 0, 1.0, held)

        with pytest.raises(OSError) as failed:
            uvloop.run(start())
        assert failed.value.errno == 98  # EADDRINUSE
    held.close()
