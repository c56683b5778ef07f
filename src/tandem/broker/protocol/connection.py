"""The per-connection AMQP 0-9-1 state machine.

`Connection.feed(data)` takes whatever the socket read, parses every whole frame in it and acts
on the model; replies accumulate in `Connection.out` and the transport port is woken once per
batch to write them. Publish, deliver and ack never build a pamqp object: they are parsed and
encoded with structs, and a message's content header properties pass through as raw bytes.

This module holds the connection class (handshake, frames, errors, heartbeats, alarms) and
dispatches channel methods to one module per AMQP class: `exchange`, `queue`, `basic`,
`confirm` and `tx`, each a set of functions of (connection, channel, method); channels and
consumers live in `channel`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from pamqp import commands, decode

from tandem import errors
from tandem.broker.model.broker import Broker
from tandem.broker.model.queue import Queue
from tandem.broker.model.vhost import VirtualHost
from tandem.broker.protocol import basic, confirm, exchange, frames, queue, tx
from tandem.broker.protocol.channel import Channel, Consumer
from tandem.broker.protocol.frames import (
    FRAME_END,
    FRAME_HDR,
    METHOD_IDS,
    U64_U8,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Limits:
    frame_max: int = 131072
    channel_max: int = 2047
    heartbeat: int = 60
    max_message_size: int = 128 * 1024 * 1024
    product: str = "Tandem"
    version: str = "0.1.0"
    cluster_name: str = "tandem"


# The frames one `feed` handles before it lets the event loop go round. A read brings up to
# 256 KiB, 2,000 small messages; handled at once, ten busy publishers held the loop for
# 0.4 s a turn, and the node answered its controller's status poll too late. 384 frames is
# 128 small messages (with 16 KiB of small messages a turn, under ten replicated publishers
# a status answer took 0.27 s p99, with 64 KiB 0.6 s, the throughput the same); counted in
# frames, not bytes, so that large messages, whose cost is less than their size says, are
# not cut into a turn each.
FEED_FRAMES: Final = 384

# The read buffer. Reads land in it and frames are handled where they landed: only a body is
# copied out. It starts small, doubles while reads fill it, up to uvloop's own 256 KiB, and a
# connection that received little over half a heartbeat interval gives a large one back
# (without heartbeats, it keeps it). Whatever its size, a read gets room for at least READ_LOW
# bytes and for the rest of a frame begun.
READ_INITIAL: Final = 16 * 1024
READ_MAX: Final = 256 * 1024
READ_LOW: Final = 4096
SMALL_BODY: Final = 1024  # body frames up to this size leave the read buffer by a slice (_frames)

SERVER_CAPABILITIES: Final = {
    "publisher_confirms": True,
    "exchange_exchange_bindings": True,
    "basic.nack": True,
    "consumer_cancel_notify": True,
    "connection.blocked": True,
    "consumer_priorities": False,
    "authentication_failure_close": True,
    "per_consumer_qos": True,
    "direct_reply_to": True,
}


class Transport(Protocol):
    """What the state machine needs of its socket; server.py implements it."""

    def wake(self) -> None:
        """Connection.out has bytes: write them soon (once per loop turn)."""

    def close(self) -> None:
        """Write what is pending, then close."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def backlog(self) -> None:
        """Whole frames are left in the buffer: read nothing more until `feed(b"")`, called
        on a later turn of the loop, has handled them."""

    def turn_frames(self) -> int:
        """The frames this `feed` may handle before the rest waits for a later turn."""


class Hub(Protocol):
    """Node-wide services the connection uses: alarms and the direct reply-to directory."""

    blocked_reason: str | None
    in_flow: bool  # publishers are read no more until it is over (flow control), untold
    reply_to: dict[str, Consumer]
    # Why this node serves no clients (a backup names its primary), or None.
    refusal: str | None


class Connection:
    """One client connection; the server feeds it bytes and writes `out`."""

    def __init__(
        self,
        broker: Broker,
        hub: Hub,
        transport: Transport,
        peer: str,
        loopback: bool,
        limits: Limits | None = None,
    ) -> None:
        self.broker = broker
        self.hub = hub
        self.transport = transport
        self.peer = peer
        self.loopback = loopback
        self.limits = limits or Limits()
        # Reads land in rbuf, at rend; the frames from rstart on are not handled yet.
        self.rbuf = bytearray(READ_INITIAL)
        self.rstart = 0
        self.rend = 0
        self.rwant = READ_INITIAL  # the size the buffer grows to when next it moves
        self.received_bytes = 0  # since the last heartbeat tick
        self.out: list[bytes | memoryview] = []
        # Set when `out` may hold a part of frames.BIG_PART bytes or more (a delivery's body).
        self.big_output = False
        self.state = "header"
        self.frame_max = frames.FRAME_MIN_SIZE
        self.channel_max = self.limits.channel_max
        self.heartbeat = 0
        self.user = ""
        self.vhost_name = ""
        self.vhost_obj: VirtualHost = None  # type: ignore[assignment]
        self.capabilities: dict[str, Any] = {}
        self.client_properties: dict[str, Any] = {}
        self.channels: dict[int, Channel] = {}
        self.closing_channels: set[int] = set()
        self.writable = True
        self.sent_since_tick = False
        self.missed_ticks = 0
        self.dirty_queues: dict[int, Queue] = {}
        self.confirm_channels: set[Channel] = set()
        self.sync_channels: set[Channel] = set()
        self.exclusive_queues: list[Queue] = []
        self.published = False
        self.blocked_sent = False
        self.paused_for_alarm = False
        self.paused_for_flow = False
        self.close_reason = ""
        self.name_cache: dict[bytes, tuple[str, str, bytes]] = {}
        self.props_cache: dict[bytes, bytes] = {}

    # -- output --

    def write(self, data: bytes) -> None:
        out = self.out
        if not out:
            self.transport.wake()
        out.append(data)

    def send_method(self, channel: int, method: Any) -> None:
        self.write(frames.method_bytes(channel, method))

    def reply(self, ch: Channel, method: Any) -> None:
        """A channel's synchronous reply. Replies to exchange and queue methods wait until
        what those methods journaled is on disk, so a declare-ok means the declaration
        survives a crash; later replies and deliveries on the channel queue behind them."""
        self.reply_data(ch, frames.method_bytes(ch.number, method), method.index >> 16 in (40, 50))

    def reply_data(self, ch: Channel, data: bytes, durable: bool) -> None:
        if durable and self.broker.journal.dirty():
            ch.hold_until_synced(data)
        else:
            self.reply_bytes(ch, data)

    def reply_bytes(self, ch: Channel, data: bytes) -> None:
        if ch.held:
            ch.held.append([True, data])
        else:
            self.write(data)

    def take_output(self) -> list[bytes | memoryview]:
        """What to send, for the socket's `writelines`: the output joined into one chunk,
        except large bodies (`frames.BIG_PART`), which go as they are, between the joined
        runs around them, so that they are not copied once more on their way out."""
        out = self.out
        if not out:
            return []
        self.sent_since_tick = True
        if not self.big_output:
            chunks: list[bytes | memoryview] = [b"".join(out)]
        else:
            self.big_output = False
            chunks = []
            start = 0
            for i, part in enumerate(out):
                if len(part) >= frames.BIG_PART:
                    if i > start:
                        chunks.append(b"".join(out[start:i]))
                    chunks.append(part)
                    start = i + 1
            if start < len(out):
                chunks.append(b"".join(out[start:]))
        out.clear()
        return chunks

    # -- input --

    def feed(self, data: bytes) -> None:
        """Handle bytes read from the socket (copied into the read buffer first), or with
        b"", the frames left in the buffer by a backlog."""
        if self.state == "closed":
            return
        if data:
            self._make_room(len(data))
            end = self.rend + len(data)
            self.rbuf[self.rend : end] = data
            self.rend = end
            self.received_bytes += len(data)
        self._handle_input()

    def read_buffer(self) -> memoryview:
        """Where the next read lands (asyncio.BufferedProtocol.get_buffer): after what is left
        of the last one, with room for at least the rest of a frame begun."""
        start, end = self.rstart, self.rend
        need = READ_LOW
        if end - start >= 7 and self.state != "header":
            size = FRAME_HDR.unpack_from(self.rbuf, start)[2] + 8
            need = max(need, min(size, self.frame_max) - (end - start))
        if len(self.rbuf) - end < need:
            self._make_room(need)
        return memoryview(self.rbuf)[self.rend :]

    def received(self, nbytes: int) -> None:
        """`nbytes` were read into `read_buffer()` (asyncio.BufferedProtocol.buffer_updated)."""
        if self.state == "closed":
            return  # nothing more is read: the bytes are dropped
        self.rend += nbytes
        self.received_bytes += nbytes
        if self.rend == len(self.rbuf) and len(self.rbuf) < READ_MAX:
            self.rwant = min(2 * len(self.rbuf), READ_MAX)  # more was waiting: read more
        self._handle_input()

    def _make_room(self, need: int) -> None:
        """At least `need` bytes free after the buffered data: moved to the front of the
        buffer (what is left over is at most a few frames), or into a larger one."""
        rbuf, start, end = self.rbuf, self.rstart, self.rend
        kept = end - start
        size = max(len(rbuf), self.rwant)
        if kept + need > size:
            size = max(kept + need, 2 * size)
        if size > len(rbuf):
            # A new buffer: the old one may be lent to the read in progress, and cannot grow.
            self.rbuf = bytearray(size)
            self.rbuf[:kept] = memoryview(rbuf)[start:end]
        elif start:
            rbuf[:kept] = rbuf[start:end]  # a copy first: the two may overlap
        self.rstart, self.rend = 0, kept

    def _shrink_idle_buffer(self, received: int) -> None:
        """A connection that `received` less than a quarter of its large read buffer since
        the last tick (half the heartbeat interval) gives the buffer back."""
        light = received < len(self.rbuf) // 4
        if light and len(self.rbuf) > READ_INITIAL and self.rstart == self.rend:
            self.rbuf = bytearray(READ_INITIAL)
            self.rstart = self.rend = 0
            self.rwant = READ_INITIAL

    def _handle_input(self) -> None:
        try:
            if self.state == "header":
                head = bytes(self.rbuf[self.rstart : min(self.rend, self.rstart + 8)])
                if len(head) < 8:
                    if not frames.PROTOCOL_HEADER.startswith(head):
                        self._bad_header(head)
                    return
                if head != frames.PROTOCOL_HEADER:
                    self._bad_header(head)
                    return
                self.rstart += 8
                self._send_start()
            self._frames(self.rbuf, self.rstart, self.rend)
        except errors.FrameError as framing:
            # Nothing after a framing error can be read as frames: say why, drop the rest,
            # and close the socket without waiting for close-ok (AMQP 0-9-1, 4.2.3).
            self.error(0, framing)
            self.rstart = self.rend = 0
            self.state = "closed"
            self.transport.close()
        except errors.AMQPError as err:
            self.error(0, err)
        except Exception as exc:
            log.exception("unexpected error, please report it as a bug: connection %s", self._who())
            self.error(0, errors.InternalError(f"internal error: {exc.__class__.__name__}"))
        self._after_batch()

    def _frames(self, buf: bytearray, pos: int, n: int) -> None:
        """Handle the whole frames in `buf[pos:n]` (the read buffer), where they are; what
        is left of a frame, or frames left for a later turn, stay in the buffer."""
        frame_max = self.frame_max
        unpack_hdr = FRAME_HDR.unpack_from
        left = self.transport.turn_frames()
        # Typed, as what struct returns is not: compiled code then does its sums as ints.
        ftype: int
        ch: int
        size: int
        try:
            while n - pos >= 7:
                ftype, ch, size = unpack_hdr(buf, pos)
                if size + 8 > frame_max:
                    raise errors.FrameError(
                        f"frame size {size + 8} exceeds the negotiated frame_max {frame_max}"
                    )
                end = pos + 7 + size
                if end >= n:
                    break
                if buf[end] != FRAME_END:
                    raise errors.FrameError(f"frame end byte is {buf[end]:#x}, expected 0xce")
                start = pos + 7
                pos = end + 1
                if self.state == "closing" or self.state == "closed":
                    if ftype == 1 and ch == 0 and size >= 4:
                        self._closing_method(buf, start, end)
                    continue
                if ftype == 1:
                    if size < 4:
                        raise errors.FrameError(f"method frame of {size} bytes is too short")
                    if ch and ch in self.closing_channels:
                        self._closing_channel_method(ch, buf, start, end)
                        continue
                    self._method(ch, buf, start, end)
                elif ftype == 2:
                    if size < 14:
                        raise errors.FrameError(f"content header of {size} bytes is too short")
                    basic.content_header(self, ch, buf, start, end)
                elif ftype == 3:
                    # The one copy of a body out of the read buffer; a small one by way of a
                    # slice (two copies of a few bytes cost less than a memoryview's setup).
                    basic.content_body(
                        self,
                        ch,
                        bytes(buf[start:end])
                        if size <= SMALL_BODY
                        else bytes(memoryview(buf)[start:end]),
                    )
                elif ftype == 8:
                    if ch != 0:
                        raise errors.FrameError("heartbeat frame on a non-zero channel")
                else:
                    raise errors.FrameError(f"unknown frame type {ftype}")
                left -= 1
                if not left and n - pos >= 7 and self.state != "closed":
                    self.transport.backlog()  # the rest on a later turn
                    break
        finally:
            if pos >= n:
                self.rstart = self.rend = 0  # all handled: the next read starts at the front
            else:
                self.rstart = pos

    def _dispatch_dirty(self) -> None:
        """Deliver what acks, rejects, consumes and qos changes have made deliverable."""
        queues = list(self.dirty_queues.values())
        self.dirty_queues.clear()
        for q in queues:
            q.dispatch()

    def _after_batch(self) -> None:
        for ch in self.confirm_channels:
            ch.flush_confirms()
        self.confirm_channels.clear()
        if self.sync_channels:
            journal = self.broker.journal
            for ch in self.sync_channels:
                seqs = ch.awaiting_sync
                ch.awaiting_sync = []
                journal.when_done(functools.partial(ch.synced, seqs))
            self.sync_channels.clear()
        if self.dirty_queues:
            self._dispatch_dirty()
        if self.published:
            if self.hub.blocked_reason is not None:
                self.block(self.hub.blocked_reason)
            elif self.hub.in_flow and not self.paused_for_flow:
                self.paused_for_flow = True
                self.transport.pause_reading()

    # -- errors --

    def _bad_header(self, head: bytes) -> None:
        log.info("connection from %s sent a wrong protocol header %r", self.peer, head)
        self.write(frames.PROTOCOL_HEADER)
        self._teardown("wrong protocol header")
        self.transport.close()

    def error(self, channel: int, err: errors.AMQPError) -> None:
        if self.state in ("closing", "closed"):
            return
        if not err.hard and channel and channel in self.channels:
            log.info("channel error on %s channel %d: %s", self._who(), channel, err.reply_text())
            ch = self.channels.pop(channel)
            ch.release()
            self.closing_channels.add(channel)
            self.send_method(
                channel,
                commands.Channel.Close(err.code, err.reply_text(), err.class_id, err.method_id),
            )
            return
        code = err.code if err.hard else 541
        log.warning("closing connection %s: %s %s", self._who(), code, err.reply_text())
        self.close_reason = err.reply_text()
        self.send_method(
            0, commands.Connection.Close(code, err.reply_text(), err.class_id, err.method_id)
        )
        self.state = "closing"
        self._teardown(err.reply_text())

    def force_close(self, code: int, text: str) -> None:
        """The node closes this connection (shutdown, lost primacy, management)."""
        if self.state in ("closing", "closed"):
            return
        if self.state in ("header", "start", "secure", "tune"):
            self._teardown(text)
            self.transport.close()
            return
        self.send_method(0, commands.Connection.Close(code, text[:255], 0, 0))
        self.state = "closing"
        self._teardown(text)

    def _who(self) -> str:
        name = self.client_properties.get("connection_name")
        named = f" '{name}'" if isinstance(name, str) and name else ""
        return f"{self.peer}{named} (user '{self.user}', vhost '{self.vhost_name}')"

    def _teardown(self, reason: str) -> None:
        """Release everything this connection holds; idempotent."""
        channels = list(self.channels.values())
        self.channels.clear()
        for ch in channels:
            ch.release()
        for q in self.exclusive_queues:
            if not q.deleted:
                q.vhost.delete_queue(q)
        self.exclusive_queues.clear()
        if self.state != "closing":
            self.state = "closed"

    def lost(self) -> None:
        """The socket closed."""
        if self.state != "closed":
            if self.state not in ("header", "closing"):
                log.info("connection %s closed by the peer", self._who())
            self._teardown("connection lost")
            self.state = "closed"

    # -- heartbeats --

    def tick(self) -> bool:
        """Called every heartbeat/2 seconds; returns False when the peer has gone silent."""
        if self.state in ("closed",):
            return False
        if not self.sent_since_tick:
            self.write(frames.HEARTBEAT_FRAME)
        self.sent_since_tick = False
        received, self.received_bytes = self.received_bytes, 0
        if received or self.paused_for_alarm or self.paused_for_flow:
            # Not read while paused, the client's heartbeats wait in the socket: as RabbitMQ,
            # a connection the broker stopped reading is not closed for their absence.
            self.missed_ticks = 0
        else:
            self.missed_ticks += 1
        self._shrink_idle_buffer(received)
        if self.missed_ticks >= 4:  # two heartbeat intervals
            log.warning(
                "closing connection %s: missed heartbeats from client, timeout: %ds",
                self._who(),
                self.heartbeat,
            )
            self._teardown("missed heartbeats")
            return False
        return True

    # -- alarms --

    def block(self, reason: str) -> None:
        if not self.blocked_sent and self.capabilities.get("connection.blocked"):
            self.blocked_sent = True
            self.send_method(0, commands.Connection.Blocked(shortstr(reason)))
        if not self.paused_for_alarm:
            self.paused_for_alarm = True
            self.transport.pause_reading()

    def unblock(self) -> None:
        if self.blocked_sent:
            self.blocked_sent = False
            self.send_method(0, commands.Connection.Unblocked())
        if self.paused_for_alarm:
            self.paused_for_alarm = False
            self._read_again()

    def flow_over(self) -> None:
        if self.paused_for_flow:
            self.paused_for_flow = False
            self._read_again()

    def _read_again(self) -> None:
        """Resume reading once neither an alarm nor flow control holds it."""
        if not (self.paused_for_alarm or self.paused_for_flow):
            self.transport.resume_reading()

    def notify_blocked(self, reason: str) -> None:
        """An alarm went off: tell clients; publishers stop being read at their next publish."""
        if (
            self.state == "running"
            and self.capabilities.get("connection.blocked")
            and not self.blocked_sent
        ):
            self.blocked_sent = True
            self.send_method(0, commands.Connection.Blocked(shortstr(reason)))

    def set_writable(self, writable: bool) -> None:
        self.writable = writable
        if writable:
            for ch in list(self.channels.values()):
                for c in list(ch.consumers.values()):
                    if c.queue is not None:
                        c.queue.dispatch()

    # -- connection class --

    def _send_start(self) -> None:
        props: dict[str, Any] = {
            "product": self.limits.product,
            "version": self.limits.version,
            "platform": "Python",
            "cluster_name": self.limits.cluster_name,
            "copyright": "Tandem authors",
            "information": "Licensed under the Apache License 2.0",
            "capabilities": SERVER_CAPABILITIES,
        }
        self.send_method(0, commands.Connection.Start(0, 9, props, "PLAIN AMQPLAIN", "en_US"))
        self.state = "start"

    def _closing_method(self, buf: bytes | bytearray, start: int, end: int) -> None:
        class_id, method_id = METHOD_IDS.unpack_from(buf, start)
        if (class_id, method_id) == (10, 51):  # close-ok
            self.state = "closed"
            self.transport.close()
        elif (class_id, method_id) == (10, 50):  # both sides closing
            self.send_method(0, commands.Connection.CloseOk())
            self.state = "closed"
            self.transport.close()

    def _closing_channel_method(
        self, ch: int, buf: bytes | bytearray, start: int, end: int
    ) -> None:
        class_id, method_id = METHOD_IDS.unpack_from(buf, start)
        if (class_id, method_id) == (20, 41):  # close-ok
            self.closing_channels.discard(ch)
        elif (class_id, method_id) == (20, 40):
            self.closing_channels.discard(ch)
            self.send_method(ch, commands.Channel.CloseOk())

    def _method(self, ch: int, buf: bytes | bytearray, start: int, end: int) -> None:
        class_id: int
        method_id: int
        class_id, method_id = frames.read_method_ids(buf, start)
        if ch:
            channel = self.channels.get(ch)
            if channel is not None and class_id == 60:
                try:
                    if method_id == 40:
                        basic.publish(self, channel, buf, start + 4, end)
                        return
                    if method_id == 80:
                        if end - start < 13:
                            raise errors.SyntaxError_("truncated basic.ack", 60, 80)
                        tag: int
                        bits: int
                        tag, bits = U64_U8.unpack_from(buf, start + 4)
                        basic.ack(self, channel, tag, bool(bits & 1))
                        return
                except errors.AMQPError as err:
                    if not err.class_id:
                        err.class_id, err.method_id = class_id, method_id
                    self.error(ch, err)
                    return
                except IndexError:
                    raise errors.SyntaxError_(
                        "truncated method frame", class_id, method_id
                    ) from None
            if self.dirty_queues:
                # Deliveries made possible by earlier frames go out before any later reply.
                self._dispatch_dirty()
            method = frames.decode_method(class_id, method_id, bytes(buf[start + 4 : end]))
            if channel is None:
                if (class_id, method_id) == (20, 10):
                    self._channel_open(ch)
                    return
                raise errors.ChannelError(
                    f"expected 'channel.open' on channel {ch}", class_id, method_id
                )
            if channel.pub_exchange is not None:
                raise errors.UnexpectedFrame(
                    f"expected content header for class 60, got non content header frame "
                    f"instead on channel {ch}",
                    class_id,
                    method_id,
                )
            try:
                self._channel_method(channel, class_id, method_id, method)
            except errors.AMQPError as err:
                if not err.class_id:
                    err.class_id, err.method_id = class_id, method_id
                self.error(ch, err)
            return
        method = frames.decode_method(class_id, method_id, bytes(buf[start + 4 : end]))
        self._connection_method(class_id, method_id, method)

    def _connection_method(self, class_id: int, method_id: int, method: Any) -> None:
        state = self.state
        if class_id != 10:
            raise errors.CommandInvalid(
                f"method {method.name} is not allowed on channel 0", class_id, method_id
            )
        if state == "start" and method_id == 11:
            self._start_ok(method)
        elif state == "tune" and method_id == 31:
            self._tune_ok(method)
        elif state == "open" and method_id == 40:
            self._open(method)
        elif method_id == 50:  # close
            log.info("connection %s closed by the client", self._who())
            self.send_method(0, commands.Connection.CloseOk())
            self._teardown("closed by client")
            self.state = "closed"
            self.transport.close()
        elif method_id == 51:  # close-ok without a close
            self.state = "closed"
            self.transport.close()
        elif state == "running" and method_id in (60, 61):  # blocked/unblocked from client
            pass
        else:
            raise errors.CommandInvalid(
                f"unexpected method {method.name} in connection state '{state}'",
                class_id,
                method_id,
            )

    def _start_ok(self, method: commands.Connection.StartOk) -> None:
        self.client_properties = dict(method.client_properties or {})
        caps = self.client_properties.get("capabilities")
        self.capabilities = dict(caps) if isinstance(caps, dict) else {}
        mechanism = method.mechanism
        response = method.response or ""
        raw = response.encode("latin-1") if isinstance(response, str) else bytes(response)
        username = password = None
        if mechanism == "PLAIN":
            parts = raw.split(b"\x00")
            if len(parts) == 3:
                username, password = (
                    parts[1].decode(errors="replace"),
                    parts[2].decode(errors="replace"),
                )
        elif mechanism == "AMQPLAIN":
            try:
                table = decode.field_table(len(raw).to_bytes(4, "big") + raw)[1]
                username, password = str(table.get("LOGIN", "")), str(table.get("PASSWORD", ""))
            except Exception:
                username = password = None
        else:
            raise errors.connection_access_refused(
                f"unsupported authentication mechanism '{mechanism}'"
            )
        if username is None or password is None:
            raise errors.SyntaxError_(f"malformed {mechanism} response", 10, 11)
        user = self.broker.users.authenticate(username, password, self.loopback)
        if user is None:
            log.warning(
                "login failed from %s for user '%s' (mechanism %s)", self.peer, username, mechanism
            )
            raise errors.connection_access_refused(
                f"Login was refused using authentication mechanism {mechanism}. For details "
                "see the broker logfile."
            )
        self.user = username
        self.send_method(
            0,
            commands.Connection.Tune(
                self.limits.channel_max, self.limits.frame_max, self.limits.heartbeat
            ),
        )
        self.state = "tune"

    def _tune_ok(self, method: commands.Connection.TuneOk) -> None:
        frame_max = method.frame_max or self.limits.frame_max
        if frame_max < frames.FRAME_MIN_SIZE or frame_max > self.limits.frame_max:
            raise errors.NotAllowed(
                f"negotiated frame_max = {frame_max} is outside [{frames.FRAME_MIN_SIZE}, "
                f"{self.limits.frame_max}]",
                10,
                31,
            )
        channel_max = method.channel_max or self.limits.channel_max
        if channel_max > self.limits.channel_max:
            raise errors.NotAllowed(
                f"negotiated channel_max = {channel_max} is higher than the maximum allowed "
                f"value ({self.limits.channel_max})",
                10,
                31,
            )
        self.frame_max = frame_max
        self.channel_max = channel_max
        self.heartbeat = method.heartbeat
        self.state = "open"

    def _open(self, method: commands.Connection.Open) -> None:
        if self.hub.refusal is not None:
            raise errors.NotAllowed(self.hub.refusal, 10, 40)
        name = method.virtual_host or "/"
        vhost = self.broker.vhosts.get(name)
        if vhost is None:
            raise errors.NotAllowed(f"vhost {name} not found", 10, 40)
        if self.broker.users.permission(self.user, name) is None:
            log.warning("user '%s' from %s may not open vhost '%s'", self.user, self.peer, name)
            raise errors.NotAllowed(
                f"access to vhost '{name}' refused for user '{self.user}'", 10, 40
            )
        self.vhost_name = name
        self.vhost_obj = vhost
        self.send_method(0, commands.Connection.OpenOk())
        self.state = "running"
        log.info("connection %s opened", self._who())
        if self.hub.blocked_reason is not None:
            self.notify_blocked(self.hub.blocked_reason)

    # -- channel class --

    def _channel_open(self, number: int) -> None:
        if self.state != "running":
            raise errors.ChannelError("channel.open before the connection is open", 20, 10)
        # As RabbitMQ: channel_max bounds how many channels are open, not their numbers
        # (some clients open channel 65535 on a fresh connection).
        if len(self.channels) >= self.channel_max:
            raise errors.NotAllowed(
                f"number of channels opened ({len(self.channels)}) has reached the negotiated "
                f"channel_max ({self.channel_max})",
                20,
                10,
            )
        self.channels[number] = Channel(self, number)
        self.send_method(number, commands.Channel.OpenOk())

    def _channel_method(self, ch: Channel, class_id: int, method_id: int, m: Any) -> None:
        handler = _HANDLERS.get(class_id << 16 | method_id)
        if handler is None:
            if (class_id, method_id) == (20, 10):
                raise errors.ChannelError(f"channel {ch.number} is already open", 20, 10)
            raise errors.CommandInvalid(
                f"method {m.name} is not allowed from a client", class_id, method_id
            )
        handler(self, ch, m)

    def _channel_close(self, ch: Channel, m: commands.Channel.Close) -> None:
        self.channels.pop(ch.number, None)
        ch.release()
        self.send_method(ch.number, commands.Channel.CloseOk())

    def _channel_close_ok(self, ch: Channel, m: Any) -> None:
        pass

    def _channel_flow(self, ch: Channel, m: commands.Channel.Flow) -> None:
        ch.flow_active = bool(m.active)
        self.reply(ch, commands.Channel.FlowOk(ch.flow_active))
        if ch.flow_active:
            for c in ch.consumers.values():
                if c.queue is not None:
                    self.dirty_queues[id(c.queue)] = c.queue

    # -- permissions --

    def check(self, what: str, name: str, kind: str = "queue") -> None:
        if kind == "exchange" and not name:
            name = "amq.default"  # RabbitMQ checks and names the default exchange so
        perm = self.broker.users.permission(self.user, self.vhost_name)
        if perm is None or not perm.allows(what, name):
            raise errors.AccessRefused(
                f"access to {kind} '{name}' in vhost '{self.vhost_name}' refused for user "
                f"'{self.user}'"
            )

    def own(self, q: Queue) -> Queue:
        if q.exclusive_owner is not None and q.exclusive_owner is not self:
            raise errors.ResourceLocked(
                f"cannot obtain exclusive access to locked queue '{q.name}' in vhost "
                f"'{self.vhost_name}'. It could be originally declared on another connection "
                "or the exclusive property value does not match that of the original "
                "declaration."
            )
        return q

    def find_queue(self, ch: Channel, name: str) -> Queue:
        if name == "":
            raise errors.NotFound("no queue name given and no queue declared on this channel")
        return self.own(ch.vhost.queue(name))


Handler = Callable[[Connection, Channel, Any], None]

# channel-level methods by pamqp's identity (class id << 16 | method id); publish and ack
# never get here (the hot path parses them in place, see `Connection._method`).
_HANDLERS: Final[dict[int, Handler]] = {
    commands.Channel.Flow.index: Connection._channel_flow,
    commands.Channel.Close.index: Connection._channel_close,
    commands.Channel.CloseOk.index: Connection._channel_close_ok,
    commands.Exchange.Declare.index: exchange.declare,
    commands.Exchange.Delete.index: exchange.delete,
    commands.Exchange.Bind.index: exchange.bind,
    commands.Exchange.Unbind.index: exchange.unbind,
    commands.Queue.Declare.index: queue.declare,
    commands.Queue.Bind.index: queue.bind,
    commands.Queue.Purge.index: queue.purge,
    commands.Queue.Delete.index: queue.delete,
    commands.Queue.Unbind.index: queue.unbind,
    commands.Basic.Qos.index: basic.qos,
    commands.Basic.Consume.index: basic.consume,
    commands.Basic.Cancel.index: basic.cancel,
    commands.Basic.Get.index: basic.get,
    commands.Basic.Ack.index: basic.ack_method,
    commands.Basic.Reject.index: basic.reject,
    commands.Basic.RecoverAsync.index: basic.recover,
    commands.Basic.Recover.index: basic.recover,
    commands.Basic.Nack.index: basic.nack,
    commands.Confirm.Select.index: confirm.select,
    commands.Tx.Select.index: tx.select,
    commands.Tx.Commit.index: tx.commit,
    commands.Tx.Rollback.index: tx.rollback,
}


def shortstr(text: str) -> str:
    """`text` cut to what an AMQP short string holds (255 bytes of UTF-8), whole characters."""
    raw = text.encode()
    return text if len(raw) <= 255 else raw[:252].decode(errors="ignore") + "..."
