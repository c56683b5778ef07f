"""The per-connection AMQP 0-9-1 state machine.

`Connection.feed(data)` takes whatever the socket read, parses every whole frame in it and acts
on the model; replies accumulate in `Connection.out` and the transport port is woken once per
batch to write them. Publish, deliver and ack never build a pamqp object: they are parsed and
encoded with structs, and a message's content header properties pass through as raw bytes.
"""

from __future__ import annotations

import collections
import functools
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pamqp import commands, decode

from tandem import errors
from tandem.broker.model import message as message_mod
from tandem.broker.model.broker import Broker
from tandem.broker.model.exchange import Exchange
from tandem.broker.model.message import Message
from tandem.broker.model.queue import Queue
from tandem.broker.model.vhost import VirtualHost
from tandem.broker.protocol import frames
from tandem.broker.protocol.frames import (
    CONTENT_HDR,
    FRAME_END,
    FRAME_END_BYTE,
    FRAME_HDR,
    HEADER_PAYLOAD,
    METHOD_HDR,
    METHOD_IDS,
    U64_U8,
)

log = logging.getLogger(__name__)

REPLY_TO = "amq.rabbitmq.reply-to"
REPLY_TO_BYTES = REPLY_TO.encode()


@dataclass(frozen=True, slots=True)
class Limits:
    frame_max: int = 131072
    channel_max: int = 2047
    heartbeat: int = 60
    max_message_size: int = 128 * 1024 * 1024
    product: str = "Tandem"
    version: str = "0.1.0"
    cluster_name: str = "tandem"


SERVER_CAPABILITIES = {
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


class Hub(Protocol):
    """Node-wide services the connection uses: alarms and the direct reply-to directory."""

    blocked_reason: str | None
    reply_to: dict[str, Consumer]
    # Why this node serves no clients (a backup names its primary), or None.
    refusal: str | None


# -- consumers -------------------------------------------------------------------------


class Consumer:
    """A basic.consume on a channel; implements the model's Consumer port."""

    __slots__ = ("channel", "exclusive", "no_ack", "prefetch", "queue", "tag", "tag_enc", "unacked")

    def __init__(
        self,
        channel: Channel,
        queue: Queue | None,
        tag: str,
        no_ack: bool,
        exclusive: bool,
        prefetch: int,
    ) -> None:
        self.channel = channel
        self.queue = queue
        self.tag = tag
        self.tag_enc = message_mod.encode_shortstr(tag)
        self.no_ack = no_ack
        self.exclusive = exclusive
        self.prefetch = prefetch
        self.unacked = 0

    def ready(self) -> bool:
        ch = self.channel
        if not ch.flow_active or not ch.conn.writable:
            return False
        if self.no_ack:
            return True
        if self.prefetch and self.unacked >= self.prefetch:
            return False
        return not ch.global_prefetch or len(ch.unacked) < ch.global_prefetch

    def deliver(self, queue: Queue, msg: Message) -> None:
        self.channel.deliver(self, queue, msg)

    def cancelled_by_broker(self, queue: Queue) -> None:
        self.channel.broker_cancel(self)


# -- channels --------------------------------------------------------------------------


class Channel:
    def __init__(self, conn: Connection, number: int) -> None:
        self.conn = conn
        self.number = number
        self.vhost: VirtualHost = conn.vhost_obj
        self.consumers: dict[str, Consumer] = {}
        self.unacked: dict[int, tuple[Queue | None, Message, Consumer | None]] = {}
        self.delivery_tag = 0
        self.prefetch = 0  # per-consumer default for new consumers (basic.qos global=false)
        self.global_prefetch = 0
        self.flow_active = True
        self.closing = False
        # publishing state: the method, then the header, then the body frames
        self.pub_exchange: Exchange | None = None
        self.pub_route = b""
        self.pub_rk = ""
        self.pub_mandatory = False
        self.pub_props: bytes | None = None
        self.pub_size = 0
        self.pub_body: list[bytes] = []
        self.pub_received = 0
        # confirms
        self.confirm = False
        self.publish_seq = 0
        self.ack_upto = 0
        self.acked_sent = 0
        self.unconfirmed: collections.deque[int] = collections.deque()
        self.confirmed_early: set[int] = set()
        self.awaiting_sync: list[int] = []
        # transactions
        self.tx = False
        self.tx_publishes: list[tuple[Exchange, Message, bool]] = []
        self.tx_settles: list[tuple[str, int, bool, bool]] = []
        self.write_ok: set[str] = set()  # exchanges this channel may publish to (cache)
        self.last_queue = ""  # the queue last declared on this channel, for empty names
        self.reply_token: str | None = None  # direct reply-to consumer on this channel
        # Replies held behind a durable declaration's reply until its record is on disk:
        # [ready, frame bytes] in the order they must go out.
        self.held: collections.deque[list[Any]] = collections.deque()

    # -- delivery (hot path) --

    def deliver(self, consumer: Consumer, queue: Queue | None, msg: Message) -> None:
        self.delivery_tag = tag = self.delivery_tag + 1
        if not consumer.no_ack:
            self.unacked[tag] = (queue, msg, consumer)
            consumer.unacked += 1
        conn = self.conn
        ch = self.number
        body = msg.body
        props = msg.props
        route = msg.route
        ctag = consumer.tag_enc
        msize = 13 + len(ctag) + len(route)
        parts = [
            METHOD_HDR.pack(1, ch, msize, 60, 60),
            ctag,
            U64_U8.pack(tag, msg.redelivered),
            route,
            FRAME_END_BYTE,
        ]
        if isinstance(body, bytes) and len(body) <= conn.frame_max - 8:
            # One header frame and at most one body frame: the common case, inline.
            parts += (
                CONTENT_HDR.pack(2, ch, 12 + len(props), 60, 0, msg.body_size),
                props,
                FRAME_END_BYTE,
            )
            if body:
                parts += (FRAME_HDR.pack(3, ch, len(body)), body, FRAME_END_BYTE)
        else:
            parts += frames.content_frames(ch, props, body, msg.body_size, conn.frame_max)
        if self.held:
            self.held.append([True, b"".join(parts)])
            return
        out = conn.out
        if not out:
            conn.transport.wake()
        out.append(b"".join(parts))

    def hold_until_synced(self, data: bytes) -> None:
        """Queue a reply that may go out only once the journal has synced."""
        entry: list[Any] = [False, data]
        self.held.append(entry)
        self.conn.broker.journal.when_done(functools.partial(self._held_ready, entry))

    def _held_ready(self, entry: list[Any]) -> None:
        entry[0] = True
        if self.closing:
            return
        held = self.held
        while held and held[0][0]:
            self.conn.write(held.popleft()[1])

    def broker_cancel(self, consumer: Consumer) -> None:
        """The queue was deleted: tell the client, as RabbitMQ's consumer_cancel_notify."""
        if self.consumers.pop(consumer.tag, None) is None:
            return
        if self.conn.capabilities.get("consumer_cancel_notify"):
            self.conn.send_method(self.number, commands.Basic.Cancel(consumer.tag, nowait=True))

    # -- confirms --

    def confirm_now(self, seq: int, ack: bool = True) -> None:
        if not ack:
            self.conn.write(frames.basic_nack_frame(self.number, seq, False))
            if not self.unconfirmed:
                return
        if not self.unconfirmed:
            self.ack_upto = seq
            self.conn.confirm_channels.add(self)
            return
        self.unconfirmed.append(seq)
        self.confirmed_early.add(seq)

    def confirm_later(self, seq: int) -> None:
        self.unconfirmed.append(seq)
        self.awaiting_sync.append(seq)

    def synced(self, seqs: list[int]) -> None:
        if self.closing:
            return
        done = self.confirmed_early
        done.update(seqs)
        last = 0
        unconfirmed = self.unconfirmed
        while unconfirmed and unconfirmed[0] in done:
            last = unconfirmed.popleft()
            done.discard(last)
        if last:
            self.ack_upto = last
            self.flush_confirms()

    def flush_confirms(self) -> None:
        if self.ack_upto > self.acked_sent:
            self.acked_sent = self.ack_upto
            self.conn.write(frames.basic_ack_frame(self.number, self.ack_upto, True))

    # -- teardown --

    def release(self) -> None:
        """Channel closed: cancel consumers, requeue what was unacked (in order)."""
        self.closing = True
        self.held.clear()
        for c in list(self.consumers.values()):
            if c.queue is not None:
                c.queue.remove_consumer(c)
            else:
                self.conn.hub.reply_to.pop(self.reply_token or "", None)
        self.consumers.clear()
        touched: dict[int, Queue] = {}
        for _tag, (queue, msg, _c) in sorted(self.unacked.items(), reverse=True):
            if queue is not None:
                queue.release(msg)
                touched[id(queue)] = queue
        self.unacked.clear()
        for q in touched.values():
            q.dispatch()


# -- connection ------------------------------------------------------------------------


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
        self.buf = bytearray()
        self.out: list[bytes] = []
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
        self.received_since_tick = False
        self.sent_since_tick = False
        self.missed_ticks = 0
        self.dirty_queues: dict[int, Queue] = {}
        self.confirm_channels: set[Channel] = set()
        self.sync_channels: set[Channel] = set()
        self.exclusive_queues: list[Queue] = []
        self.published = False
        self.blocked_sent = False
        self.paused_for_alarm = False
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

    def _reply(self, ch: Channel, method: Any) -> None:
        """A channel's synchronous reply. Replies to exchange and queue methods wait until
        what those methods journaled is on disk, so a declare-ok means the declaration
        survives a crash; later replies and deliveries on the channel queue behind them."""
        self._reply_data(ch, frames.method_bytes(ch.number, method), method.index >> 16 in (40, 50))

    def _reply_data(self, ch: Channel, data: bytes, durable: bool) -> None:
        if durable and self.broker.journal.dirty():
            ch.hold_until_synced(data)
        else:
            self._reply_bytes(ch, data)

    def _reply_bytes(self, ch: Channel, data: bytes) -> None:
        if ch.held:
            ch.held.append([True, data])
        else:
            self.write(data)

    def take_output(self) -> bytes:
        data = b"".join(self.out)
        self.out.clear()
        if data:
            self.sent_since_tick = True
        return data

    # -- input --

    def feed(self, data: bytes) -> None:
        """Handle bytes read from the socket."""
        if self.state == "closed":
            return
        self.received_since_tick = True
        buf = self.buf
        buf += data
        try:
            if self.state == "header":
                if len(buf) < 8:
                    if not frames.PROTOCOL_HEADER.startswith(bytes(buf[:8])):
                        self._bad_header()
                    return
                if bytes(buf[:8]) != frames.PROTOCOL_HEADER:
                    self._bad_header()
                    return
                del buf[:8]
                self._send_start()
            self._frames()
        except errors.AMQPError as err:
            self._error(0, err)
        except Exception as exc:
            log.exception("unexpected error, please report it as a bug: connection %s", self._who())
            self._error(0, errors.InternalError(f"internal error: {exc.__class__.__name__}"))
        self._after_batch()

    def _frames(self) -> None:
        buf = self.buf
        n = len(buf)
        pos = 0
        frame_max = self.frame_max
        unpack_hdr = FRAME_HDR.unpack_from
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
                    self._content_header(ch, buf, start, end)
                elif ftype == 3:
                    self._content_body(ch, bytes(buf[start:end]))
                elif ftype == 8:
                    if ch != 0:
                        raise errors.FrameError("heartbeat frame on a non-zero channel")
                else:
                    raise errors.FrameError(f"unknown frame type {ftype}")
        finally:
            if pos >= n:
                buf.clear()
            elif pos:
                del buf[:pos]

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
        if self.published and self.hub.blocked_reason is not None:
            self.block(self.hub.blocked_reason)

    # -- errors --

    def _bad_header(self) -> None:
        log.info(
            "connection from %s sent a wrong protocol header %r", self.peer, bytes(self.buf[:8])
        )
        self.write(frames.PROTOCOL_HEADER)
        self._teardown("wrong protocol header")
        self.transport.close()

    def _error(self, channel: int, err: errors.AMQPError) -> None:
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
        if self.received_since_tick:
            self.missed_ticks = 0
        else:
            self.missed_ticks += 1
        self.received_since_tick = False
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
            self.send_method(0, commands.Connection.Blocked(reason))
        if not self.paused_for_alarm:
            self.paused_for_alarm = True
            self.transport.pause_reading()

    def unblock(self) -> None:
        if self.blocked_sent:
            self.blocked_sent = False
            self.send_method(0, commands.Connection.Unblocked())
        if self.paused_for_alarm:
            self.paused_for_alarm = False
            self.transport.resume_reading()

    def notify_blocked(self, reason: str) -> None:
        """An alarm went off: tell clients; publishers stop being read at their next publish."""
        if (
            self.state == "running"
            and self.capabilities.get("connection.blocked")
            and not self.blocked_sent
        ):
            self.blocked_sent = True
            self.send_method(0, commands.Connection.Blocked(reason))

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

    def _closing_method(self, buf: bytearray, start: int, end: int) -> None:
        class_id, method_id = METHOD_IDS.unpack_from(buf, start)
        if (class_id, method_id) == (10, 51):  # close-ok
            self.state = "closed"
            self.transport.close()
        elif (class_id, method_id) == (10, 50):  # both sides closing
            self.send_method(0, commands.Connection.CloseOk())
            self.state = "closed"
            self.transport.close()

    def _closing_channel_method(self, ch: int, buf: bytearray, start: int, end: int) -> None:
        class_id, method_id = METHOD_IDS.unpack_from(buf, start)
        if (class_id, method_id) == (20, 41):  # close-ok
            self.closing_channels.discard(ch)
        elif (class_id, method_id) == (20, 40):
            self.closing_channels.discard(ch)
            self.send_method(ch, commands.Channel.CloseOk())

    def _method(self, ch: int, buf: bytearray, start: int, end: int) -> None:
        class_id, method_id = METHOD_IDS.unpack_from(buf, start)
        if ch:
            channel = self.channels.get(ch)
            if channel is not None and class_id == 60:
                try:
                    if method_id == 40:
                        self._publish(channel, buf, start + 4, end)
                        return
                    if method_id == 80:
                        if end - start < 13:
                            raise errors.SyntaxError_("truncated basic.ack", 60, 80)
                        tag, bits = U64_U8.unpack_from(buf, start + 4)
                        self._ack(channel, tag, bool(bits & 1))
                        return
                except errors.AMQPError as err:
                    if not err.class_id:
                        err.class_id, err.method_id = class_id, method_id
                    self._error(ch, err)
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
                self._error(ch, err)
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
        handler = _HANDLERS.get((class_id, method_id))
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
        self._reply(ch, commands.Channel.FlowOk(ch.flow_active))
        if ch.flow_active:
            for c in ch.consumers.values():
                if c.queue is not None:
                    self.dirty_queues[id(c.queue)] = c.queue

    # -- permissions --

    def _check(self, what: str, name: str, kind: str = "queue") -> None:
        if kind == "exchange" and not name:
            name = "amq.default"  # RabbitMQ checks and names the default exchange so
        perm = self.broker.users.permission(self.user, self.vhost_name)
        if perm is None or not perm.allows(what, name):
            raise errors.AccessRefused(
                f"access to {kind} '{name}' in vhost '{self.vhost_name}' refused for user "
                f"'{self.user}'"
            )

    def _own(self, q: Queue) -> Queue:
        if q.exclusive_owner is not None and q.exclusive_owner is not self:
            raise errors.ResourceLocked(
                f"cannot obtain exclusive access to locked queue '{q.name}' in vhost "
                f"'{self.vhost_name}'. It could be originally declared on another connection "
                "or the exclusive property value does not match that of the original "
                "declaration."
            )
        return q

    def _queue(self, ch: Channel, name: str) -> Queue:
        if name == "":
            raise errors.NotFound("no queue name given and no queue declared on this channel")
        return self._own(ch.vhost.queue(name))

    # -- exchange class --

    def _exchange_declare(self, ch: Channel, m: commands.Exchange.Declare) -> None:
        if not m.passive:
            self._check("configure", m.exchange, "exchange")
        ch.vhost.declare_exchange(
            m.exchange,
            m.exchange_type,
            passive=m.passive,
            durable=m.durable,
            auto_delete=m.auto_delete,
            internal=m.internal,
            arguments=m.arguments,
        )
        if not m.nowait:
            self._reply(ch, commands.Exchange.DeclareOk())

    def _exchange_delete(self, ch: Channel, m: commands.Exchange.Delete) -> None:
        self._check("configure", m.exchange, "exchange")
        ch.vhost.delete_exchange(m.exchange, m.if_unused)
        if not m.nowait:
            self._reply(ch, commands.Exchange.DeleteOk())

    def _exchange_bind(self, ch: Channel, m: Any, unbind: bool = False) -> None:
        self._check("write", m.destination, "exchange")
        self._check("read", m.source, "exchange")
        dest = ch.vhost.exchange(m.destination)
        if unbind:
            ch.vhost.unbind(m.source, dest, m.routing_key, m.arguments)
        else:
            ch.vhost.bind(m.source, dest, m.routing_key, m.arguments)
        if not m.nowait:
            self._reply(ch, commands.Exchange.UnbindOk() if unbind else commands.Exchange.BindOk())

    def _exchange_unbind(self, ch: Channel, m: Any) -> None:
        self._exchange_bind(ch, m, unbind=True)

    # -- queue class --

    def _queue_declare(self, ch: Channel, m: commands.Queue.Declare) -> None:
        name = m.queue
        vhost = ch.vhost
        if m.passive:
            q = self._own(vhost.queue(name))
        else:
            if name:
                self._check("configure", name)
            existing = vhost.queues.get(name) if name else None
            if existing is not None:
                self._own(existing)
            q, created = vhost.declare_queue(
                name,
                durable=m.durable,
                exclusive_owner=self if m.exclusive else None,
                auto_delete=m.auto_delete,
                arguments=m.arguments,
            )
            if created and m.exclusive:
                self.exclusive_queues.append(q)
        q.touch()
        ch.last_queue = q.name
        if not m.nowait:
            ok = frames.queue_declare_ok(ch.number, q.name, len(q.messages), len(q.consumers))
            self._reply_data(ch, ok, durable=True)

    @staticmethod
    def _queue_name(ch: Channel, name: str) -> str:
        return name or ch.last_queue

    def _queue_bind(self, ch: Channel, m: Any, unbind: bool = False) -> None:
        qname = self._queue_name(ch, m.queue)
        self._check("write", qname)
        self._check("read", m.exchange, "exchange")
        q = self._queue(ch, qname)
        if unbind:
            ch.vhost.unbind(m.exchange, q, m.routing_key, m.arguments)
            self._reply(ch, commands.Queue.UnbindOk())
            return
        ch.vhost.bind(m.exchange, q, m.routing_key, m.arguments)
        if not m.nowait:
            self._reply(ch, commands.Queue.BindOk())

    def _queue_unbind(self, ch: Channel, m: Any) -> None:
        self._queue_bind(ch, m, unbind=True)

    def _queue_purge(self, ch: Channel, m: commands.Queue.Purge) -> None:
        qname = self._queue_name(ch, m.queue)
        self._check("read", qname)
        count = self._queue(ch, qname).purge()
        if not m.nowait:
            self._reply(ch, commands.Queue.PurgeOk(count))

    def _queue_delete(self, ch: Channel, m: commands.Queue.Delete) -> None:
        qname = self._queue_name(ch, m.queue)
        self._check("configure", qname)
        q = ch.vhost.queues.get(qname)
        count = 0
        if q is not None:
            self._own(q)
            count = ch.vhost.delete_queue(q, if_unused=m.if_unused, if_empty=m.if_empty)
            if q in self.exclusive_queues:
                self.exclusive_queues.remove(q)
        if not m.nowait:
            self._reply(ch, commands.Queue.DeleteOk(count))

    # -- basic class --

    def _basic_qos(self, ch: Channel, m: commands.Basic.Qos) -> None:
        if m.prefetch_size:
            raise errors.NotImplemented_(f"prefetch_size!=0 ({m.prefetch_size})", 60, 10)
        if m.global_:
            ch.global_prefetch = m.prefetch_count
        else:
            ch.prefetch = m.prefetch_count
        self._reply(ch, commands.Basic.QosOk())
        for c in ch.consumers.values():
            if c.queue is not None:
                self.dirty_queues[id(c.queue)] = c.queue

    def _basic_consume(self, ch: Channel, m: commands.Basic.Consume) -> None:
        tag = m.consumer_tag or "amq.ctag-" + secrets.token_urlsafe(16)
        if tag in ch.consumers:
            raise errors.NotAllowed(f"attempt to reuse consumer tag '{tag}'", 60, 20)
        qname = self._queue_name(ch, m.queue)
        if qname == REPLY_TO:
            if not m.no_ack:
                raise errors.PreconditionFailed(
                    "reply consumer cannot acknowledge (no_ack must be true)"
                )
            c = Consumer(ch, None, tag, True, False, 0)
            token = secrets.token_urlsafe(18)
            self.hub.reply_to[token] = c
            c.tag_enc = message_mod.encode_shortstr(tag)
            ch.consumers[tag] = c
            ch.reply_token = token
            if not m.nowait:
                self._reply(ch, commands.Basic.ConsumeOk(tag))
            return
        self._check("read", qname)
        q = self._queue(ch, qname)
        c = Consumer(ch, q, tag, m.no_ack, m.exclusive, ch.prefetch)
        q.add_consumer(c)
        ch.consumers[tag] = c
        if not m.nowait:
            self._reply(ch, commands.Basic.ConsumeOk(tag))
        self.dirty_queues[id(q)] = q

    def _basic_cancel(self, ch: Channel, m: commands.Basic.Cancel) -> None:
        c = ch.consumers.pop(m.consumer_tag or "", None)
        if c is not None:
            if c.queue is not None:
                c.queue.remove_consumer(c)
            else:
                self.hub.reply_to.pop(ch.reply_token or "", None)
        if not m.nowait:
            self._reply(ch, commands.Basic.CancelOk(m.consumer_tag))

    def _basic_get(self, ch: Channel, m: commands.Basic.Get) -> None:
        qname = self._queue_name(ch, m.queue)
        self._check("read", qname)
        q = self._queue(ch, qname)
        q.touch()  # a get is a use, for x-expires
        msg = q.get()
        if msg is None:
            self._reply(ch, commands.Basic.GetEmpty())
            return
        ch.delivery_tag = tag = ch.delivery_tag + 1
        if m.no_ack:
            q.settle_unacked_get(msg)
        else:
            q.unacked += 1
            ch.unacked[tag] = (q, msg, None)
        payload = (
            frames.METHOD_IDS.pack(60, 71)
            + U64_U8.pack(tag, msg.redelivered)
            + msg.route
            + len(q.messages).to_bytes(4, "big")
        )
        parts = [FRAME_HDR.pack(1, ch.number, len(payload)), payload, FRAME_END_BYTE]
        parts += frames.content_frames(
            ch.number, msg.props, msg.body, msg.body_size, self.frame_max
        )
        self._reply_bytes(ch, b"".join(parts))

    def _ack(self, ch: Channel, tag: int, multiple: bool) -> None:
        if ch.tx:
            ch.tx_settles.append(("ack", tag, multiple, False))
            return
        self._settle(ch, tag, multiple, "ack", False)

    def _settle(self, ch: Channel, tag: int, multiple: bool, how: str, requeue: bool) -> None:
        unacked = ch.unacked
        if multiple:
            if tag == 0:
                tags = list(unacked)
            else:
                tags = []
                for t in unacked:
                    if t > tag:
                        break
                    tags.append(t)
                if tag not in unacked and (not tags or tags[-1] != tag) and tag > ch.delivery_tag:
                    raise errors.PreconditionFailed(f"unknown delivery tag {tag}", 60, 80)
            entries = [(t, unacked.pop(t)) for t in tags]
        else:
            entry = unacked.pop(tag, None)
            if entry is None:
                raise errors.PreconditionFailed(f"unknown delivery tag {tag}", 60, 80)
            entries = [(tag, entry)]
        if how != "ack":
            entries.reverse()  # requeue highest first so the lowest ends at the head
        dirty = self.dirty_queues
        for _t, (queue, msg, consumer) in entries:
            if consumer is not None:
                consumer.unacked -= 1
            if queue is None:
                continue
            if how == "ack":
                queue.settle(msg)
            else:
                queue.reject(msg, requeue)
            dirty[id(queue)] = queue

    def _basic_reject(self, ch: Channel, m: commands.Basic.Reject) -> None:
        if ch.tx:
            ch.tx_settles.append(("reject", m.delivery_tag or 0, False, m.requeue))
            return
        self._settle(ch, m.delivery_tag or 0, False, "reject", m.requeue)

    def _basic_nack(self, ch: Channel, m: commands.Basic.Nack) -> None:
        if ch.tx:
            ch.tx_settles.append(("reject", m.delivery_tag, m.multiple, m.requeue))
            return
        self._settle(ch, m.delivery_tag, m.multiple, "reject", m.requeue)

    def _basic_ack_slow(self, ch: Channel, m: commands.Basic.Ack) -> None:
        self._ack(ch, m.delivery_tag, m.multiple)

    def _basic_recover(self, ch: Channel, m: Any) -> None:
        if not m.requeue:
            raise errors.NotImplemented_("requeue=false", 60, 110)
        self._settle(ch, 0, True, "reject", True)
        if m.name == "Basic.Recover":
            self._reply(ch, commands.Basic.RecoverOk())

    # -- publishing (hot path) --

    def _publish(self, ch: Channel, buf: bytearray, pos: int, end: int) -> None:
        elen = buf[pos + 2]
        rpos = pos + 3 + elen
        rlen = buf[rpos]
        bits_pos = rpos + 1 + rlen
        if bits_pos >= end:
            raise errors.SyntaxError_("truncated basic.publish", 60, 40)
        route = bytes(buf[pos + 2 : bits_pos])
        cache = self.name_cache
        names = cache.get(route)
        if names is None:
            if len(cache) > 10000:
                cache.clear()
            names = (
                route[1 : 1 + elen].decode(errors="replace"),
                route[2 + elen :].decode(errors="replace"),
                route,
            )
            cache[route] = names
        exchange, rk, route = names  # the cached route object: one copy for every message
        bits = buf[bits_pos]
        if bits & 2:
            raise errors.NotImplemented_("immediate=true", 60, 40)
        ex = ch.vhost.exchanges.get(exchange)
        if ex is None:
            raise errors.NotFound(f"no exchange '{exchange}' in vhost '{self.vhost_name}'")
        if exchange not in ch.write_ok:
            self._check("write", exchange, "exchange")
            if ex.internal:
                raise errors.AccessRefused(
                    f"cannot publish to internal exchange '{exchange}' in vhost '{self.vhost_name}'"
                )
            ch.write_ok.add(exchange)
        ch.pub_exchange = ex
        ch.pub_rk = rk
        ch.pub_route = route
        ch.pub_mandatory = bool(bits & 1)
        ch.pub_props = None
        self.published = True

    def _content_header(self, number: int, buf: bytearray, start: int, end: int) -> None:
        ch = self.channels.get(number)
        if ch is None or ch.pub_exchange is None or ch.pub_props is not None:
            if number in self.closing_channels:
                return
            raise errors.UnexpectedFrame(f"unexpected content header frame on channel {number}")
        class_id, _weight, size = HEADER_PAYLOAD.unpack_from(buf, start)
        if class_id != 60:
            raise errors.FrameError(f"content header for class {class_id}, expected 60")
        if size > self.limits.max_message_size:
            ch.pub_exchange = None
            self._error(
                number,
                errors.PreconditionFailed(
                    f"message size {size} is larger than configured max size "
                    f"{self.limits.max_message_size}",
                    60,
                    40,
                ),
            )
            self.closing_channels.add(number)
            return
        props = bytes(buf[start + 12 : end])
        if len(props) <= 32:
            # Small property blobs repeat (often just the flags); keep one copy of each.
            cache = self.props_cache
            props = cache.setdefault(props, props)
            if len(cache) > 1000:
                cache.clear()
        ch.pub_props = props
        ch.pub_size = size
        ch.pub_received = 0
        if size == 0:
            self._publish_complete(ch, b"")

    def _content_body(self, number: int, chunk: bytes) -> None:
        ch = self.channels.get(number)
        if ch is None or ch.pub_props is None:
            if number in self.closing_channels:
                return
            raise errors.UnexpectedFrame(f"unexpected content body frame on channel {number}")
        received = ch.pub_received + len(chunk)
        if received > ch.pub_size:
            raise errors.FrameError(
                f"content body is longer than the {ch.pub_size} bytes its header announced"
            )
        if received == ch.pub_size and not ch.pub_body:
            self._publish_complete(ch, chunk)
            return
        ch.pub_body.append(chunk)
        ch.pub_received = received
        if received == ch.pub_size:
            body = ch.pub_body
            ch.pub_body = []
            self._publish_complete(ch, body)

    def _publish_complete(self, ch: Channel, body: bytes | list[bytes]) -> None:
        ex = ch.pub_exchange
        assert ex is not None and ch.pub_props is not None
        ch.pub_exchange = None
        msg = Message(ex.name, ch.pub_rk, ch.pub_route, ch.pub_props, body, ch.pub_size)
        ch.pub_props = None
        try:
            flags = message_mod.scan(msg)
        except ValueError as exc:
            self._error(
                ch.number, errors.PreconditionFailed(f"invalid content properties: {exc}", 60, 40)
            )
            return
        if flags & message_mod.F_USER_ID:
            try:
                user_id = message_mod.decode_properties(msg.props).user_id
            except ValueError as exc:
                self._error(ch.number, errors.PreconditionFailed(str(exc), 60, 40))
                return
            if user_id != self.user:
                self._error(
                    ch.number,
                    errors.PreconditionFailed(
                        f"user_id property set to '{user_id}' but authenticated user was "
                        f"'{self.user}'",
                        60,
                        40,
                    ),
                )
                return
        msg.ts = ch.vhost.clock()
        if ch.confirm:
            ch.publish_seq += 1
        if REPLY_TO_BYTES in msg.props or (ex.name == "" and msg.routing_key.startswith(REPLY_TO)):
            try:
                if self._direct_reply(ch, msg, ch.pub_mandatory):
                    return
            except errors.AMQPError as err:
                self._error(ch.number, err)
                return
        if ch.tx:
            ch.tx_publishes.append((ex, msg, ch.pub_mandatory))
            return
        self._route(ch, ex, msg, ch.pub_mandatory)

    def _route(self, ch: Channel, ex: Exchange, msg: Message, mandatory: bool) -> bool:
        """Enqueue a complete message; confirm it or say it must wait for the disk."""
        queues = ch.vhost.route(ex, msg)
        stored = False
        refused = False
        if queues:
            journal = ch.vhost.journal
            for q in queues:
                if not q.enqueue(msg):
                    refused = True
                elif journal.must_wait(q, msg):
                    stored = True
        elif mandatory:
            self._return(ch, msg, 312, "NO_ROUTE")
        if ch.confirm:
            seq = ch.publish_seq if not ch.tx else 0
            if seq:
                if refused:
                    ch.confirm_now(seq, ack=False)
                elif stored:
                    ch.confirm_later(seq)
                    self.sync_channels.add(ch)
                else:
                    ch.confirm_now(seq)
        return stored

    def _return(self, ch: Channel, msg: Message, code: int, text: str) -> None:
        payload = (
            frames.METHOD_IDS.pack(60, 50)
            + code.to_bytes(2, "big")
            + message_mod.encode_shortstr(text)
            + msg.route
        )
        parts = [FRAME_HDR.pack(1, ch.number, len(payload)), payload, FRAME_END_BYTE]
        parts += frames.content_frames(
            ch.number, msg.props, msg.body, msg.body_size, self.frame_max
        )
        self.write(b"".join(parts))

    def _direct_reply(self, ch: Channel, msg: Message, mandatory: bool) -> bool:
        """RabbitMQ's direct reply-to. True when the message was handled here."""
        if msg.exchange == "" and msg.routing_key.startswith(REPLY_TO + "."):
            token = msg.routing_key[len(REPLY_TO) + 1 :]
            consumer = self.hub.reply_to.get(token)
            if consumer is None:
                if mandatory:
                    self._return(ch, msg, 312, "NO_ROUTE")
            else:
                consumer.channel.deliver(consumer, None, msg)
            if ch.confirm:
                ch.confirm_now(ch.publish_seq)
            return True
        try:
            props = message_mod.decode_properties(msg.props)
        except ValueError as exc:
            raise errors.PreconditionFailed(str(exc), 60, 40) from exc
        if props.reply_to == REPLY_TO:
            reply_token = ch.reply_token
            if reply_token is None or reply_token not in self.hub.reply_to:
                raise errors.PreconditionFailed("fast reply consumer does not exist", 60, 40)
            props.reply_to = f"{REPLY_TO}.{reply_token}"
            msg.props = message_mod.encode_properties(props)
        return False

    # -- confirm and tx --

    def _confirm_select(self, ch: Channel, m: commands.Confirm.Select) -> None:
        if ch.tx:
            raise errors.PreconditionFailed("cannot switch from tx to confirm mode", 85, 10)
        ch.confirm = True
        if not m.nowait:
            self._reply(ch, commands.Confirm.SelectOk())

    def _tx_select(self, ch: Channel, m: Any) -> None:
        if ch.confirm:
            raise errors.PreconditionFailed("cannot switch from confirm to tx mode", 90, 10)
        ch.tx = True
        self._reply(ch, commands.Tx.SelectOk())

    def _tx_commit(self, ch: Channel, m: Any) -> None:
        if not ch.tx:
            raise errors.PreconditionFailed("channel is not transactional", 90, 20)
        publishes, ch.tx_publishes = ch.tx_publishes, []
        settles, ch.tx_settles = ch.tx_settles, []
        stored = False
        for ex, msg, mandatory in publishes:
            stored = self._route(ch, ex, msg, mandatory) or stored
        for how, tag, multiple, requeue in settles:
            self._settle(ch, tag, multiple, how, requeue)
        commit_ok = frames.method_bytes(ch.number, commands.Tx.CommitOk())
        if stored:
            ch.hold_until_synced(commit_ok)
        else:
            self._reply_bytes(ch, commit_ok)

    def _tx_rollback(self, ch: Channel, m: Any) -> None:
        if not ch.tx:
            raise errors.PreconditionFailed("channel is not transactional", 90, 30)
        ch.tx_publishes = []
        ch.tx_settles = []
        self._reply(ch, commands.Tx.RollbackOk())


Handler = Callable[[Connection, Channel, Any], None]

_HANDLERS: dict[tuple[int, int], Handler] = {
    (20, 20): Connection._channel_flow,
    (20, 40): Connection._channel_close,
    (20, 41): Connection._channel_close_ok,
    (40, 10): Connection._exchange_declare,
    (40, 20): Connection._exchange_delete,
    (40, 30): Connection._exchange_bind,
    (40, 40): Connection._exchange_unbind,
    (50, 10): Connection._queue_declare,
    (50, 20): Connection._queue_bind,
    (50, 30): Connection._queue_purge,
    (50, 40): Connection._queue_delete,
    (50, 50): Connection._queue_unbind,
    (60, 10): Connection._basic_qos,
    (60, 20): Connection._basic_consume,
    (60, 30): Connection._basic_cancel,
    (60, 70): Connection._basic_get,
    (60, 80): Connection._basic_ack_slow,
    (60, 90): Connection._basic_reject,
    (60, 100): Connection._basic_recover,  # recover-async
    (60, 110): Connection._basic_recover,
    (60, 120): Connection._basic_nack,
    (85, 10): Connection._confirm_select,
    (90, 10): Connection._tx_select,
    (90, 20): Connection._tx_commit,
    (90, 30): Connection._tx_rollback,
}
