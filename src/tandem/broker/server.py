"""asyncio sockets for AMQP: one protocol object per connection, one write per loop turn."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Final

from tandem.broker.model.broker import Broker
from tandem.broker.protocol import connection as conn_mod

log = logging.getLogger(__name__)

WRITE_HIGH_WATER: Final = 4 * 1024 * 1024
HANDSHAKE_TIMEOUT: Final = 10.0


# The frames all connections together handle in one turn of the event loop, shared evenly
# among the connections fed in the turn before, each getting at least MIN_TURN_FRAMES and at
# most connection.FEED_FRAMES. Each connection taking FEED_FRAMES, ten replicated publishers
# and a consumer made turns of 40 ms and more; an answer to the controller's status poll takes
# three or four turns, and a primary saturated for a minute was failed over although it
# served (then, an answer after 0.4 s counted as none).
TURN_FRAMES: Final = 768
MIN_TURN_FRAMES: Final = 48


class Turn:
    """One turn's frames, shared among the connections of a loop."""

    def __init__(self) -> None:
        self.fed = 0  # connections fed in this turn
        self.busy = 1  # connections fed in the turn before
        self.counting = False

    def share(self, loop: asyncio.AbstractEventLoop) -> int:
        if not self.counting:
            self.counting = True
            loop.call_soon(self._next_turn)  # runs in the next turn, before its feeds
        self.fed += 1
        return max(MIN_TURN_FRAMES, min(conn_mod.FEED_FRAMES, TURN_FRAMES // self.busy))

    def _next_turn(self) -> None:
        self.busy = max(1, self.fed)
        self.fed = 0
        self.counting = False


TURN: Final = Turn()


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class AMQPProtocol(asyncio.BufferedProtocol):
    """Glue between an asyncio transport and a protocol.connection.Connection. Buffered: the
    transport reads into the connection's buffer, not into bytes of its own to be copied."""

    def __init__(
        self,
        broker: Broker,
        hub: conn_mod.Hub,
        limits: conn_mod.Limits,
        registry: set[AMQPProtocol],
        max_connections: int,
    ) -> None:
        self.broker = broker
        self.hub = hub
        self.limits = limits
        self.registry = registry
        self.max_connections = max_connections
        self.transport: asyncio.Transport | None = None
        self.conn: conn_mod.Connection | None = None
        self.flush_scheduled = False
        self.closing = False
        self.loop = asyncio.get_running_loop()
        self.hb_handle: asyncio.TimerHandle | None = None
        self.write_paused = False  # the peer is not reading: neither are we
        self.read_paused = False  # paused at the connection's request (alarms)
        self.backlogged = False  # frames read but not yet handled: they go first
        self.hs_handle: asyncio.TimerHandle | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)  # type: ignore[attr-defined]
        peername = transport.get_extra_info("peername") or ("?", 0)
        host = str(peername[0])
        self.conn = conn_mod.Connection(
            self.broker, self.hub, self, f"{host}:{peername[1]}", is_loopback(host), self.limits
        )
        if len(self.registry) >= self.max_connections:
            log.warning(
                "refusing connection from %s: connection limit %d reached",
                self.conn.peer,
                self.max_connections,
            )
            transport.close()
            return
        self.registry.add(self)
        self.hs_handle = self.loop.call_later(HANDSHAKE_TIMEOUT, self._handshake_timeout)

    def get_buffer(self, sizehint: int) -> memoryview:
        assert self.conn is not None
        return self.conn.read_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        conn = self.conn
        assert conn is not None
        conn.received(nbytes)
        if self.hb_handle is None and conn.state == "running":
            if self.hs_handle is not None:
                self.hs_handle.cancel()
                self.hs_handle = None
            if conn.heartbeat:
                self.hb_handle = self.loop.call_later(conn.heartbeat / 2, self._heartbeat)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.registry.discard(self)
        for handle in (self.hb_handle, self.hs_handle):
            if handle is not None:
                handle.cancel()
        if self.conn is not None:
            self.conn.lost()

    def pause_writing(self) -> None:
        # The peer reads slower than we write: stop delivering to it, and stop reading its
        # requests, so that replies to them cannot pile up either.
        self.write_paused = True
        if self.conn is not None:
            self.conn.set_writable(False)
        self._apply_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.conn is not None:
            self.conn.set_writable(True)
        self._apply_reading()

    # connection.Transport port

    def wake(self) -> None:
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.conn is None or self.transport is None or self.transport.is_closing():
            return
        chunks = self.conn.take_output()
        if len(chunks) == 1:
            self.transport.write(chunks[0])
        elif chunks:
            self.transport.writelines(chunks)

    def close(self) -> None:
        self.flush()
        if self.transport is not None:
            self.transport.close()

    def backlog(self) -> None:
        if not self.backlogged:
            self.backlogged = True
            self._apply_reading()
            self.loop.call_soon(self._handle_backlog)

    def turn_frames(self) -> int:
        return TURN.share(self.loop)

    def _handle_backlog(self) -> None:
        self.backlogged = False
        if self.conn is not None and self.transport is not None:
            self.conn.feed(b"")  # may leave a backlog again
            self._apply_reading()

    def pause_reading(self) -> None:
        self.read_paused = True
        self._apply_reading()

    def resume_reading(self) -> None:
        self.read_paused = False
        self._apply_reading()

    def _apply_reading(self) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if self.read_paused or self.write_paused or self.backlogged:
            if t.is_reading():
                t.pause_reading()
        elif not t.is_reading():
            t.resume_reading()

    # timers

    def _heartbeat(self) -> None:
        conn = self.conn
        if conn is None or self.transport is None:
            return
        if not conn.tick():
            self.transport.abort()
            return
        self.hb_handle = self.loop.call_later(conn.heartbeat / 2, self._heartbeat)

    def _handshake_timeout(self) -> None:
        self.hs_handle = None
        if self.conn is not None and self.conn.state != "running" and self.transport:
            log.warning("closing connection %s: handshake timeout", self.conn.peer)
            self.conn.lost()
            self.transport.abort()


async def serve(
    broker: Broker,
    hub: conn_mod.Hub,
    limits: conn_mod.Limits,
    host: str,
    port: int,
    registry: set[AMQPProtocol],
    max_connections: int,
    ssl: Any = None,
) -> asyncio.Server:
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: AMQPProtocol(broker, hub, limits, registry, max_connections),
        host,
        port,
        ssl=ssl,
        reuse_address=True,
        backlog=1024,
    )


async def adopt(
    sock: socket.socket,
    broker: Broker,
    hub: conn_mod.Hub,
    limits: conn_mod.Limits,
    registry: set[AMQPProtocol],
    max_connections: int,
    tls: ssl.SSLContext | None = None,
) -> None:
    """Serve a client socket accepted elsewhere (the local cluster's front port); with
    `tls`, the handshake is done here."""
    loop = asyncio.get_running_loop()
    await loop.connect_accepted_socket(
        lambda: AMQPProtocol(broker, hub, limits, registry, max_connections),
        sock,
        ssl=tls,
        ssl_handshake_timeout=10.0 if tls is not None else None,
    )


async def receive_sockets(
    path: str,
    adopt_one: Callable[[socket.socket, bool], Awaitable[None]],
    stop: asyncio.Event,
) -> None:
    """Listen on a Unix socket for client sockets passed with SCM_RIGHTS and adopt each
    (with whether it speaks TLS: the front's marker `t`, else `c`)."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(8)
    listener.setblocking(False)
    tasks: set[asyncio.Task[None]] = set()

    async def accept() -> None:
        while True:
            conn, _ = await loop.sock_accept(listener)
            tasks.add(tg.create_task(_handoffs(conn, adopt_one)))

    try:
        async with asyncio.TaskGroup() as tg:
            tasks.add(tg.create_task(accept()))
            await stop.wait()
            for task in tasks:
                task.cancel()
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _wake(ready: asyncio.Future[None]) -> None:
    """The front's socket is readable. At stop the wait may be cancelled with this call
    already on its way; it used to log InvalidStateError as an error in a callback."""
    if not ready.done():
        ready.set_result(None)


async def _handoffs(
    conn: socket.socket, adopt_one: Callable[[socket.socket, bool], Awaitable[None]]
) -> None:
    loop = asyncio.get_running_loop()
    conn.setblocking(False)
    try:
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(conn, 64, 64)
            except BlockingIOError:
                ready = loop.create_future()
                loop.add_reader(conn.fileno(), _wake, ready)
                try:
                    await ready
                finally:
                    loop.remove_reader(conn.fileno())
                continue
            if not msg and not fds:
                return  # the front closed its end
            kinds = msg if len(msg) == len(fds) else b"c" * len(fds)
            for fd, kind in zip(fds, kinds, strict=True):
                client = socket.socket(fileno=fd)
                try:
                    await adopt_one(client, kind == ord("t"))
                except Exception:
                    log.exception("unexpected error, please report it as a bug: adopting a client")
                    client.close()
    except OSError as exc:
        log.warning("front socket: %s", exc)
    finally:
        conn.close()
