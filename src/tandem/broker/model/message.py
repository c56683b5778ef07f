"""Messages, and the few content properties the broker must read.

A message keeps its content header properties as the raw bytes the publisher sent (flags and
values) and passes them to consumers untouched; only the fields routing and queueing need are
read, by a scan that skips what it does not need. Re-encoding happens only when the broker must
change a property (dead-lettering adds x-death, direct reply-to rewrites reply-to).
"""

from __future__ import annotations

import struct
from typing import Any, Final

from pamqp import commands

_U16: Final = struct.Struct(">H")
_U32: Final = struct.Struct(">I")

# Basic property flag bits, in wire order.
F_CONTENT_TYPE: Final = 1 << 15
F_CONTENT_ENCODING: Final = 1 << 14
F_HEADERS: Final = 1 << 13
F_DELIVERY_MODE: Final = 1 << 12
F_PRIORITY: Final = 1 << 11
F_CORRELATION_ID: Final = 1 << 10
F_REPLY_TO: Final = 1 << 9
F_EXPIRATION: Final = 1 << 8
F_USER_ID: Final = 1 << 4


class Message:
    """One published message. Shared by every queue it was routed to; `refs` counts them."""

    __slots__ = (
        "body",
        "body_size",
        "exchange",
        "expiration",
        "mid",
        "persistent",
        "priority",
        "props",
        "redelivered",
        "refs",
        "route",
        "routing_key",
        "ts",
    )

    def __init__(
        self,
        exchange: str,
        routing_key: str,
        route: bytes,
        props: bytes,
        body: bytes | list[bytes],
        body_size: int,
    ) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        # The exchange and routing key as encoded short strings, reused verbatim in deliveries.
        self.route = route
        self.props = props
        self.body = body
        self.body_size = body_size
        self.persistent = False
        self.priority = 0
        self.expiration: int | None = None  # per-message TTL in ms, from the expiration property
        self.mid = 0  # (epoch, offset) of its first enqueue record (records.mid); 0 until then
        self.redelivered = False
        self.refs = 0
        self.ts = 0  # publish time (clock ms), set when some TTL applies

    def copy(self) -> Message:
        m = Message(
            self.exchange, self.routing_key, self.route, self.props, self.body, self.body_size
        )
        m.persistent = self.persistent
        m.priority = self.priority
        m.expiration = self.expiration
        m.mid = self.mid
        m.redelivered = self.redelivered
        m.ts = self.ts
        return m

    def body_bytes(self) -> bytes:
        body = self.body
        return body if isinstance(body, bytes) else b"".join(body)


def encode_shortstr(value: str) -> bytes:
    raw = value.encode()
    if len(raw) > 255:
        raise ValueError("short string longer than 255 bytes")
    return bytes((len(raw),)) + raw


def encode_route(exchange: str, routing_key: str) -> bytes:
    return encode_shortstr(exchange) + encode_shortstr(routing_key)


def scan(msg: Message) -> int:
    """Read delivery-mode, priority and expiration from the raw properties into `msg`, and
    return the property flag word (callers test other flags without reading it again).

    Raises ValueError on a truncated or malformed property list.
    """
    try:
        return _scan(msg)
    except (IndexError, struct.error):
        raise ValueError("truncated content properties") from None


def _scan(msg: Message) -> int:
    props = msg.props
    if len(props) < 2:
        raise ValueError("content header without property flags")
    flags: int = _U16.unpack_from(props, 0)[0]
    if not flags & (F_DELIVERY_MODE | F_PRIORITY | F_EXPIRATION):
        return flags
    pos = 2
    if flags & 1:  # a continuation flag word: no basic property uses one
        raise ValueError("unexpected property flag continuation")
    if flags & F_CONTENT_TYPE:
        pos += 1 + props[pos]
    if flags & F_CONTENT_ENCODING:
        pos += 1 + props[pos]
    if flags & F_HEADERS:
        table: int = _U32.unpack_from(props, pos)[0]
        pos += 4 + table
    if flags & F_DELIVERY_MODE:
        msg.persistent = props[pos] == 2
        pos += 1
    if flags & F_PRIORITY:
        msg.priority = props[pos]
        pos += 1
    if flags & F_EXPIRATION:
        if flags & F_CORRELATION_ID:
            pos += 1 + props[pos]
        if flags & F_REPLY_TO:
            pos += 1 + props[pos]
        n = props[pos]
        text = bytes(props[pos + 1 : pos + 1 + n])
        if len(text) != n:
            raise ValueError("truncated expiration property")
        try:
            ttl = int(text)
        except ValueError:
            raise ValueError(f"invalid expiration {text!r}") from None
        if ttl < 0:
            raise ValueError(f"invalid expiration {text!r}")
        msg.expiration = ttl
    if pos > len(props):
        raise ValueError("truncated content properties")
    return flags


def decode_properties(props: bytes) -> commands.Basic.Properties:
    """Decode the raw properties fully (the slow path). ValueError if they are malformed:
    the hot path reads only a few fields, so a publisher's garbage can surface here."""
    try:
        flags = _U16.unpack_from(props, 0)[0]
        p = commands.Basic.Properties()
        p.unmarshal(flags, props[2:])
    except Exception as exc:  # pamqp raises ValueError, struct.error, IndexError, ...
        raise ValueError(f"malformed content properties: {exc}") from exc
    return p


def encode_properties(p: commands.Basic.Properties) -> bytes:
    return p.marshal()


def headers_of(msg: Message) -> dict[str, Any]:
    if len(msg.props) < 2 or not _U16.unpack_from(msg.props, 0)[0] & F_HEADERS:
        return {}
    try:
        return decode_properties(msg.props).headers or {}
    except ValueError:
        return {}  # unreadable headers match no binding
