"""basic.*: publish (the hot path, parsed with structs), consume, get, ack, reject, nack,
recover and qos, on behalf of a connection."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from pamqp import commands

from tandem import errors
from tandem.broker.model import message as message_mod
from tandem.broker.model.exchange import Exchange
from tandem.broker.model.message import Message
from tandem.broker.protocol import frames
from tandem.broker.protocol.channel import REPLY_TO, REPLY_TO_BYTES, Channel, Consumer
from tandem.broker.protocol.frames import (
    FRAME_END_BYTE,
    FRAME_HDR,
    U64_U8,
)
from tandem.broker.protocol.queue import queue_name

if TYPE_CHECKING:
    from tandem.broker.protocol.connection import Connection


def qos(conn: Connection, ch: Channel, m: commands.Basic.Qos) -> None:
    if m.prefetch_size:
        raise errors.NotImplemented_(f"prefetch_size!=0 ({m.prefetch_size})", 60, 10)
    if m.global_:
        ch.global_prefetch = m.prefetch_count
    else:
        ch.prefetch = m.prefetch_count
    conn.reply(ch, commands.Basic.QosOk())
    for c in ch.consumers.values():
        if c.queue is not None:
            conn.dirty_queues[id(c.queue)] = c.queue


def consume(conn: Connection, ch: Channel, m: commands.Basic.Consume) -> None:
    tag = m.consumer_tag or "amq.ctag-" + secrets.token_urlsafe(16)
    if tag in ch.consumers:
        raise errors.NotAllowed(f"attempt to reuse consumer tag '{tag}'", 60, 20)
    qname = queue_name(ch, m.queue)
    if qname == REPLY_TO:
        if not m.no_ack:
            raise errors.PreconditionFailed(
                "reply consumer cannot acknowledge (no_ack must be true)"
            )
        c = Consumer(ch, None, tag, True, False, 0)
        token = secrets.token_urlsafe(18)
        conn.hub.reply_to[token] = c
        c.tag_enc = message_mod.encode_shortstr(tag)
        ch.consumers[tag] = c
        ch.reply_token = token
        if not m.nowait:
            conn.reply(ch, commands.Basic.ConsumeOk(tag))
        return
    conn.check("read", qname)
    q = conn.find_queue(ch, qname)
    c = Consumer(ch, q, tag, m.no_ack, m.exclusive, ch.prefetch)
    q.add_consumer(c)
    ch.consumers[tag] = c
    if not m.nowait:
        conn.reply(ch, commands.Basic.ConsumeOk(tag))
    conn.dirty_queues[id(q)] = q


def cancel(conn: Connection, ch: Channel, m: commands.Basic.Cancel) -> None:
    c = ch.consumers.pop(m.consumer_tag or "", None)
    if c is not None:
        if c.queue is not None:
            c.queue.remove_consumer(c)
        else:
            conn.hub.reply_to.pop(ch.reply_token or "", None)
    if not m.nowait:
        conn.reply(ch, commands.Basic.CancelOk(m.consumer_tag))


def get(conn: Connection, ch: Channel, m: commands.Basic.Get) -> None:
    qname = queue_name(ch, m.queue)
    conn.check("read", qname)
    q = conn.find_queue(ch, qname)
    q.touch()  # a get is a use, for x-expires
    msg = q.get(m.no_ack)
    if msg is None:
        conn.reply(ch, commands.Basic.GetEmpty())
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
        + q.ready.to_bytes(4, "big")
    )
    parts: list[bytes | memoryview] = [FRAME_HDR.pack(1, ch.number, len(payload)), payload]
    parts.append(FRAME_END_BYTE)
    parts += frames.content_frames(ch.number, msg.props, msg.body, msg.body_size, conn.frame_max)
    conn.reply_bytes(ch, b"".join(parts))


def ack(conn: Connection, ch: Channel, tag: int, multiple: bool) -> None:
    if ch.tx:
        ch.tx_settles.append(("ack", tag, multiple, False))
        return
    settle(conn, ch, tag, multiple, "ack", False)


def settle(
    conn: Connection, ch: Channel, tag: int, multiple: bool, how: str, requeue: bool
) -> None:
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
    dirty = conn.dirty_queues
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


def reject(conn: Connection, ch: Channel, m: commands.Basic.Reject) -> None:
    if ch.tx:
        ch.tx_settles.append(("reject", m.delivery_tag or 0, False, m.requeue))
        return
    settle(conn, ch, m.delivery_tag or 0, False, "reject", m.requeue)


def nack(conn: Connection, ch: Channel, m: commands.Basic.Nack) -> None:
    if ch.tx:
        ch.tx_settles.append(("reject", m.delivery_tag, m.multiple, m.requeue))
        return
    settle(conn, ch, m.delivery_tag, m.multiple, "reject", m.requeue)


def ack_method(conn: Connection, ch: Channel, m: commands.Basic.Ack) -> None:
    ack(conn, ch, m.delivery_tag, m.multiple)


def recover(conn: Connection, ch: Channel, m: Any) -> None:
    if not m.requeue:
        raise errors.NotImplemented_("requeue=false", 60, 110)
    settle(conn, ch, 0, True, "reject", True)
    if m.name == "Basic.Recover":
        conn.reply(ch, commands.Basic.RecoverOk())


# -- publishing (hot path) --


def publish(conn: Connection, ch: Channel, buf: bytes | bytearray, pos: int, end: int) -> None:
    elen = buf[pos + 2]
    rpos = pos + 3 + elen
    rlen = buf[rpos]
    bits_pos = rpos + 1 + rlen
    if bits_pos >= end:
        raise errors.SyntaxError_("truncated basic.publish", 60, 40)
    route = bytes(buf[pos + 2 : bits_pos])
    cache = conn.name_cache
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
        raise errors.NotFound(f"no exchange '{exchange}' in vhost '{conn.vhost_name}'")
    if exchange not in ch.write_ok:
        conn.check("write", exchange, "exchange")
        if ex.internal:
            raise errors.AccessRefused(
                f"cannot publish to internal exchange '{exchange}' in vhost '{conn.vhost_name}'"
            )
        ch.write_ok.add(exchange)
    ch.pub_exchange = ex
    ch.pub_rk = rk
    ch.pub_route = route
    ch.pub_mandatory = bool(bits & 1)
    ch.pub_props = None
    conn.published = True


def content_header(
    conn: Connection, number: int, buf: bytes | bytearray, start: int, end: int
) -> None:
    ch = conn.channels.get(number)
    if ch is None or ch.pub_exchange is None or ch.pub_props is not None:
        if number in conn.closing_channels:
            return
        raise errors.UnexpectedFrame(f"unexpected content header frame on channel {number}")
    class_id: int
    size: int
    class_id, _weight, size = frames.read_header_payload(buf, start)
    if class_id != 60:
        raise errors.FrameError(f"content header for class {class_id}, expected 60")
    if size > conn.limits.max_message_size:
        ch.pub_exchange = None
        conn.error(
            number,
            errors.PreconditionFailed(
                f"message size {size} is larger than configured max size "
                f"{conn.limits.max_message_size}",
                60,
                40,
            ),
        )
        conn.closing_channels.add(number)
        return
    props = bytes(buf[start + 12 : end])
    if len(props) <= 32:
        # Small property blobs repeat (often just the flags); keep one copy of each.
        cache = conn.props_cache
        props = cache.setdefault(props, props)
        if len(cache) > 1000:
            cache.clear()
    ch.pub_props = props
    ch.pub_size = size
    ch.pub_received = 0
    if size == 0:
        publish_complete(conn, ch, b"")


def content_body(conn: Connection, number: int, chunk: bytes) -> None:
    ch = conn.channels.get(number)
    if ch is None or ch.pub_props is None:
        if number in conn.closing_channels:
            return
        raise errors.UnexpectedFrame(f"unexpected content body frame on channel {number}")
    received = ch.pub_received + len(chunk)
    if received > ch.pub_size:
        raise errors.FrameError(
            f"content body is longer than the {ch.pub_size} bytes its header announced"
        )
    if received == ch.pub_size and not ch.pub_body:
        publish_complete(conn, ch, chunk)
        return
    ch.pub_body.append(chunk)
    ch.pub_received = received
    if received == ch.pub_size:
        body = ch.pub_body
        ch.pub_body = []
        publish_complete(conn, ch, body)


def publish_complete(conn: Connection, ch: Channel, body: bytes | list[bytes]) -> None:
    ex = ch.pub_exchange
    assert ex is not None and ch.pub_props is not None
    ch.pub_exchange = None
    msg = Message(ex.name, ch.pub_rk, ch.pub_route, ch.pub_props, body, ch.pub_size)
    ch.pub_props = None
    try:
        flags = message_mod.scan(msg)
    except ValueError as exc:
        conn.error(
            ch.number, errors.PreconditionFailed(f"invalid content properties: {exc}", 60, 40)
        )
        return
    if flags & message_mod.F_USER_ID:
        try:
            user_id = message_mod.decode_properties(msg.props).user_id
        except ValueError as exc:
            conn.error(ch.number, errors.PreconditionFailed(str(exc), 60, 40))
            return
        if user_id != conn.user:
            conn.error(
                ch.number,
                errors.PreconditionFailed(
                    f"user_id property set to '{user_id}' but authenticated user was '{conn.user}'",
                    60,
                    40,
                ),
            )
            return
    msg.ts = ch.vhost.clock()
    if ch.confirm:
        ch.publish_seq += 1
    # Only a message with a reply-to property is searched for one (find, not `in`: `bytes in
    # bytes` first tries the needle as an int, and raises and clears a TypeError each time).
    if (flags & message_mod.F_REPLY_TO and msg.props.find(REPLY_TO_BYTES) != -1) or (
        ex.name == "" and msg.routing_key.startswith(REPLY_TO)
    ):
        try:
            if direct_reply(conn, ch, msg, ch.pub_mandatory):
                return
        except errors.AMQPError as err:
            conn.error(ch.number, err)
            return
    if ch.tx:
        ch.tx_publishes.append((ex, msg, ch.pub_mandatory))
        return
    route(conn, ch, ex, msg, ch.pub_mandatory)


def route(conn: Connection, ch: Channel, ex: Exchange, msg: Message, mandatory: bool) -> bool:
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
        return_message(conn, ch, msg, 312, "NO_ROUTE")
    if ch.confirm:
        seq = ch.publish_seq if not ch.tx else 0
        if seq:
            if refused:
                ch.confirm_now(seq, ack=False)
            elif stored:
                ch.confirm_later(seq)
                conn.sync_channels.add(ch)
            else:
                ch.confirm_now(seq)
    return stored


def return_message(conn: Connection, ch: Channel, msg: Message, code: int, text: str) -> None:
    payload = (
        frames.METHOD_IDS.pack(60, 50)
        + code.to_bytes(2, "big")
        + message_mod.encode_shortstr(text)
        + msg.route
    )
    parts: list[bytes | memoryview] = [FRAME_HDR.pack(1, ch.number, len(payload)), payload]
    parts.append(FRAME_END_BYTE)
    parts += frames.content_frames(ch.number, msg.props, msg.body, msg.body_size, conn.frame_max)
    conn.write(b"".join(parts))


def direct_reply(conn: Connection, ch: Channel, msg: Message, mandatory: bool) -> bool:
    """RabbitMQ's direct reply-to. True when the message was handled here."""
    if msg.exchange == "" and msg.routing_key.startswith(REPLY_TO + "."):
        token = msg.routing_key[len(REPLY_TO) + 1 :]
        consumer = conn.hub.reply_to.get(token)
        if consumer is None:
            if mandatory:
                return_message(conn, ch, msg, 312, "NO_ROUTE")
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
        if reply_token is None or reply_token not in conn.hub.reply_to:
            raise errors.PreconditionFailed("fast reply consumer does not exist", 60, 40)
        props.reply_to = f"{REPLY_TO}.{reply_token}"
        msg.props = message_mod.encode_properties(props)
    return False


# -- confirm and tx --
