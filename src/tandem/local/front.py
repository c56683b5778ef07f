"""The local cluster's stable address: one port whose connections go to the primary.

The front accepts each client connection and passes the socket itself to the primary over
a Unix socket (SCM_RIGHTS), so client bytes never go through this process: no proxy hop on
the data path. While there is no primary (a failover in progress) it holds new connections
and hands them over once one is promoted, instead of refusing them; a connection held longer
than `HOLD_SECONDS` is closed.

It keeps its own descriptor of each socket it handed over. When the primary changes, it shuts
those sockets down: a client of a primary that hangs (SIGSTOP, a stalled disk) sees its
connection end at once and reconnects to the new primary, rather than waiting for its own
heartbeat timeout (pika's is the heartbeat plus 5 s). The descriptors of connections that
ended on their own are closed every second.

With TLS, a second port takes AMQPS clients the same way: the socket is handed over with the
marker `t` instead of `c`, and the primary does the TLS handshake with its certificate.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import time
from pathlib import Path

log = logging.getLogger(__name__)

HOLD_SECONDS = 30.0
TCP_ESTABLISHED = 1  # tcpi_state in struct tcp_info
PLAIN, TLS = b"c", b"t"  # what the primary is told a handed socket speaks


class Front:
    def __init__(self, host: str, port: int, tls_port: int | None = None) -> None:
        self.host, self.port, self.tls_port = host, port, tls_port
        self.listener: socket.socket | None = None
        self.tls_listener: socket.socket | None = None
        self.target: Path | None = None  # the primary's front socket
        self.link: socket.socket | None = None
        self.held: collections.deque[tuple[socket.socket, float, bytes]] = collections.deque()
        self.changed = asyncio.Event()
        self.handed = 0
        self.clients: list[socket.socket] = []  # our descriptors of the target's clients

    def bind(self) -> int:
        self.listener = self._listen(self.port)
        self.port = self.listener.getsockname()[1]
        return self.port

    def bind_tls(self) -> int:
        assert self.tls_port is not None
        self.tls_listener = self._listen(self.tls_port)
        self.tls_port = self.tls_listener.getsockname()[1]
        return self.tls_port

    def _listen(self, port: int) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, port))
        s.listen(1024)
        s.setblocking(False)
        return s

    def point(self, target: Path | None) -> None:
        """Hand new connections to the primary listening on `target` (None: hold them)."""
        if target == self.target:
            return
        self.target = target
        if self.link is not None:
            self.link.close()
            self.link = None
        self._cut_clients()
        self.changed.set()

    def _cut_clients(self) -> None:
        """End the connections of the primary we no longer point at."""
        clients, self.clients = self.clients, []
        for client in clients:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
            client.close()

    def _prune(self) -> None:
        """Close our descriptors of connections that ended."""
        alive = []
        for client in self.clients:
            try:
                state = client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
            except OSError:
                state = 0
            if state == TCP_ESTABLISHED:
                alive.append(client)
            else:
                client.close()
        self.clients = alive

    async def run(self, stop: asyncio.Event) -> None:
        assert self.listener is not None
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._release_held(stop))
            accepts = [tg.create_task(self._accept(self.listener, PLAIN, stop))]
            if self.tls_listener is not None:
                accepts.append(tg.create_task(self._accept(self.tls_listener, TLS, stop)))
            await stop.wait()
            for accept in accepts:
                accept.cancel()
            self.changed.set()
        for sock, _t, _kind in self.held:
            sock.close()
        for client in self.clients:
            client.close()
        if self.link is not None:
            self.link.close()
        self.listener.close()
        if self.tls_listener is not None:
            self.tls_listener.close()

    async def _accept(self, listener: socket.socket, kind: bytes, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            try:
                client, _addr = await loop.sock_accept(listener)
            except OSError as exc:
                log.warning("front port: accept failed: %s", exc)
                continue
            if self.held or not await self._hand(client, kind):
                self.held.append((client, time.monotonic(), kind))

    async def _release_held(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), 1.0)
            self.changed.clear()
            self._prune()
            now = time.monotonic()
            while self.held:
                client, since, kind = self.held[0]
                if now - since > HOLD_SECONDS:
                    self.held.popleft()
                    client.close()
                    continue
                if not await self._hand(client, kind):
                    break
                self.held.popleft()

    async def _hand(self, client: socket.socket, kind: bytes) -> bool:
        """Pass `client` (PLAIN or TLS) to the primary; False when none can take it now."""
        if self.target is None:
            return False
        try:
            if self.link is None:
                link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                link.settimeout(1.0)
                link.connect(str(self.target))
                self.link = link
            socket.send_fds(self.link, [kind], [client.fileno()])
        except OSError as exc:
            log.info("front port: cannot reach the primary at %s: %s", self.target, exc)
            if self.link is not None:
                self.link.close()
                self.link = None
            return False
        self.clients.append(client)  # the primary serves it; we keep a descriptor to end it
        self.handed += 1
        return True
