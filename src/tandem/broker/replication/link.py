"""One replication connection, at either end: an asyncio protocol that cuts its bytes into
whole peer messages (wire.py's framing) and hands each to the member as it arrives.

The two ends' handshake (challenge, answer, welcome) is awaited a message at a time with
`read`. After it, `serve` hands every message to a callback inside the read that brought it,
with no stream, future or task step between the socket and the member: at a confirm window
of one, each message was a wakeup of its own, and asyncio's streams cost the primary about a
tenth of its CPU (docs/performance.md). A read whose messages take longer than
SLICE_SECONDS to hand on is finished in later turns of the loop, reading paused meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from tandem.broker.replication import wire

# The most a message may hold before `serve`: a peer that has not proved the cluster key is
# owed no more memory than a challenge or an answer takes.
HANDSHAKE_BYTES: Final = 1 << 16
# The most one turn of the loop spends on a link's messages before the loop's other work
# (the controller's polls, the store's callbacks) has its turn. A backup that lags applies
# what it reads for as long as it lags: a read of 256 KiB took it 60-75 ms on a busy machine,
# an answer to a poll took several turns, and the controller found it silent (issue 16).
SLICE_SECONDS: Final = 0.01


class Link(asyncio.Protocol):
    """The write side is what the member needs of a connection: `write`, `is_closing`,
    `close`, and `transport` for its write buffer's size and `abort`."""

    def __init__(self, on_open: Callable[[Link], None] | None = None) -> None:
        self.on_open = on_open  # told once the connection is made (a listener's)
        self.transport: Any = None  # uvloop's transports are no asyncio.Transport
        self.buf = bytearray()
        self.messages: collections.deque[bytes] = collections.deque()  # read, not yet asked for
        self.waiter: asyncio.Future[None] | None = None  # a `read` waiting for a message
        self.handler: Callable[[bytes], None] | None = None  # once `serve` began
        self.done: asyncio.Future[None] | None = None  # ends `serve`
        self.error: BaseException | None = None  # why it ended, once it did
        self.takes: tuple[int, ...] = ()  # the newer kinds the peer said it reads (wire.TAKES)
        self.resting = False  # reading paused until the next turn: a slice was used up
        self.written = 0  # bytes written in all (`largest_unsent`)
        # The writes still (partly) in the write buffer that are, or may become, the largest
        # of them: (bytes written in all up to its end, its size), each smaller than the one
        # before: the first is the largest, and goes once it has been sent.
        self.unsent_writes: collections.deque[tuple[int, int]] = collections.deque()

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self.on_open is not None:
            self.on_open(self)

    def data_received(self, data: bytes) -> None:
        if self.error is not None:
            return  # ended by a bad message or a callback's error: the rest is not read
        self.buf += data
        self._take()

    def _take(self, slice_seconds: float = SLICE_SECONDS) -> None:
        """Hand on the whole messages in the buffer, for up to `slice_seconds`; what is left
        waits for the next turn, with reading paused meanwhile."""
        buf = self.buf
        start, n = 0, len(buf)
        until = time.monotonic() + slice_seconds
        try:
            while n - start >= 4:
                end = start + wire.size(buf, start)
                if self.handler is None and end - start > HANDSHAKE_BYTES:
                    raise wire.WireError(f"a handshake message of {end - start} bytes")
                if end > n:
                    break
                with memoryview(buf) as view:
                    message = bytes(view[start:end])
                start = end
                if self.handler is not None:
                    self.handler(message)
                    if self.error is not None:
                        return
                    if n - start >= 4 and time.monotonic() > until:
                        self._rest()
                        break
                else:
                    self.messages.append(message)
                    self._wake()
        except Exception as exc:
            self._end(exc)
            self.transport.abort()
            return
        finally:
            if start:
                del buf[:start]

    def _rest(self) -> None:
        if not self.resting and not self.transport.is_closing():
            self.resting = True
            self.transport.pause_reading()
            asyncio.get_running_loop().call_soon(self._go_on)

    def _go_on(self) -> None:
        self.resting = False
        if self.error is not None or self.transport.is_closing():
            return
        self._take()
        if not self.resting and self.error is None and not self.transport.is_closing():
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.resting and self.error is None and self.handler is not None:
            # Ended while it rested (TLS reads the peer's close though reading is paused):
            # what is whole in the buffer was received, and goes on before the end is said.
            self._take(slice_seconds=float("inf"))
        self._end(exc if exc is not None else ConnectionResetError("the peer closed it"))

    # -- reading --

    async def read(self) -> bytes:
        """The next whole message, for the handshake; raises once the connection ended."""
        while not self.messages:
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.messages.popleft()

    async def serve(self, handler: Callable[[bytes], None]) -> None:
        """Hand every message from now on to `handler`, as it arrives, until the
        connection ends; then raise why it ended (the handler's error, a bad message, or
        a ConnectionError)."""
        self.done = asyncio.get_running_loop().create_future()
        try:
            while self.messages:  # read before this, even if the connection ended since
                handler(self.messages.popleft())
        except Exception as exc:
            self.error = None  # the handler's error is why, not the end that followed
            self._end(exc)
            self.transport.abort()
        self.handler = handler
        try:
            if self.error is None:
                await self.done
        finally:
            self.handler = None  # ended, or cancelled: nothing more is handed on
        assert self.error is not None
        raise self.error

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _end(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._wake()
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    # -- writing --

    def write(self, data: bytes) -> None:
        self.transport.write(data)
        self._wrote(len(data))

    def write_parts(self, parts: Sequence[bytes]) -> None:
        """Write `parts` (a copy's messages, or an Append's buffers), counted as one write
        (`largest_unsent`)."""
        for data in parts:
            self.transport.write(data)
        self._wrote(sum(len(data) for data in parts))

    def largest_unsent(self) -> int:
        """The most bytes of one write (or copy) still in the write buffer. However large,
        one write says nothing of how fast the peer reads: what waits with it does
        (`Member._write`)."""
        sent = self._drop_sent()
        writes = self.unsent_writes
        if not writes:
            return 0
        end, size = writes[0]  # the largest; those after it are wholly unsent
        first = min(size, end - sent)
        return max(first, writes[1][1]) if len(writes) > 1 else first

    def unsent(self) -> int:
        """The bytes in the write buffer."""
        return int(self.transport.get_write_buffer_size())

    def _drop_sent(self) -> int:
        """Forget the writes wholly sent; the bytes sent in all."""
        sent = self.written - self.unsent()
        writes = self.unsent_writes
        while writes and writes[0][0] <= sent:
            writes.popleft()
        return sent

    def _wrote(self, size: int) -> None:
        self.written += size
        sent = self._drop_sent()
        writes = self.unsent_writes
        while writes and writes[-1][1] <= size:
            writes.pop()  # sent before this one, and no larger: never the largest again
        if self.written > sent:
            writes.append((self.written, size))

    def is_closing(self) -> bool:
        return bool(self.transport.is_closing())

    def close(self) -> None:
        """Close; what the transport still reads is not handed on."""
        self._end(ConnectionAbortedError("closed by this member"))
        self.transport.close()
