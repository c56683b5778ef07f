"""Channels and consumers: per-channel state, deliveries, confirms and held replies."""

from __future__ import annotations

import collections
import functools
from typing import TYPE_CHECKING, Any, Final

from pamqp import commands

from tandem.broker.model import message as message_mod
from tandem.broker.model.exchange import Exchange
from tandem.broker.model.message import Message
from tandem.broker.model.queue import Queue
from tandem.broker.model.vhost import VirtualHost
from tandem.broker.protocol import frames
from tandem.broker.protocol.frames import (
    FRAME_END_BYTE,
)

if TYPE_CHECKING:
    from tandem.broker.protocol.connection import Connection


REPLY_TO: Final = "amq.rabbitmq.reply-to"
REPLY_TO_BYTES: Final = REPLY_TO.encode()


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
        parts: list[bytes | memoryview] = [
            frames.pack_method_hdr(1, ch, msize, 60, 60),
            ctag,
            frames.pack_u64_u8(tag, msg.redelivered),
            route,
            FRAME_END_BYTE,
        ]
        if isinstance(body, bytes) and len(body) <= conn.frame_max - 8:
            # One header frame and at most one body frame: the common case, inline.
            parts += (
                frames.pack_content_hdr(2, ch, 12 + len(props), 60, 0, msg.body_size),
                props,
                FRAME_END_BYTE,
            )
            if body:
                parts += (frames.pack_frame_hdr(3, ch, len(body)), body, FRAME_END_BYTE)
        else:
            parts += frames.content_frames(ch, props, body, msg.body_size, conn.frame_max)
        if self.held:
            self.held.append([True, b"".join(parts)])
            return
        out = conn.out
        if not out:
            conn.transport.wake()
        out += parts  # joined once with the rest of this turn's output, by take_output
        if msg.body_size >= frames.BIG_PART:
            conn.big_output = True

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
