"""Frame layout, the hot-path encoders and the pamqp-backed slow path.

Publish, deliver and ack are encoded and parsed here by hand with precompiled structs; every
other method goes through pamqp (`method_bytes`, `decode_method`).
"""

from __future__ import annotations

import struct
from typing import Any, Final

from pamqp import commands, frame

from tandem import errors

PROTOCOL_HEADER: Final = b"AMQP\x00\x00\x09\x01"
FRAME_METHOD: Final = 1
FRAME_HEADER: Final = 2
FRAME_BODY: Final = 3
FRAME_HEARTBEAT: Final = 8
FRAME_END: Final = 0xCE
FRAME_END_BYTE: Final = b"\xce"
FRAME_MIN_SIZE: Final = 4096

FRAME_HDR: Final = struct.Struct(">BHI")
METHOD_IDS: Final = struct.Struct(">HH")
METHOD_HDR: Final = struct.Struct(">BHIHH")
CONTENT_HDR: Final = struct.Struct(">BHIHHQ")
HEADER_PAYLOAD: Final = struct.Struct(">HHQ")
U64_U8: Final = struct.Struct(">QB")
U32_U32: Final = struct.Struct(">II")
# The hot path's packers and readers, bound once: compiled code calls a bound method
# directly, where FRAME_HDR.pack(...) looks `pack` up on each call.
pack_frame_hdr: Final = FRAME_HDR.pack
pack_method_hdr: Final = METHOD_HDR.pack
pack_content_hdr: Final = CONTENT_HDR.pack
pack_u64_u8: Final = U64_U8.pack
read_method_ids: Final = METHOD_IDS.unpack_from
read_header_payload: Final = HEADER_PAYLOAD.unpack_from

HEARTBEAT_FRAME: Final = b"\x08\x00\x00\x00\x00\x00\x00\xce"

# (class_id, method_id) of the hot-path methods
BASIC: Final = 60
BASIC_PUBLISH: Final = 40
BASIC_ACK: Final = 80


# A part of the output this long (a delivery's body) is handed to the socket as it is, beside
# the joined rest, and written with writev: joining would copy it once more. Shorter parts
# cost less to copy than to pass as one more buffer.
BIG_PART: Final = 8192


def method_bytes(channel: int, method: Any) -> bytes:
    """Encode a pamqp method as one frame."""
    return frame.marshal(method, channel)


def decode_method(class_id: int, method_id: int, payload: bytes) -> Any:
    """Decode a method's arguments (the bytes after class and method ids) with pamqp."""
    cls = commands.INDEX_MAPPING.get((class_id << 16) | method_id)
    if cls is None:
        raise errors.NotImplemented_(
            f"unknown method class {class_id} method {method_id}", class_id, method_id
        )
    method = cls()
    try:
        method.unmarshal(payload)
    except Exception as exc:
        raise errors.SyntaxError_(
            f"malformed {method.name} arguments: {exc}", class_id, method_id
        ) from exc
    return method


def content_frames(
    channel: int, props: bytes, body: bytes | list[bytes], body_size: int, frame_max: int
) -> list[bytes | memoryview]:
    """The header and body frames for a message (used outside the single-chunk fast path);
    a body longer than a frame is cut as views of it, copied once when the frames are joined."""
    out: list[bytes | memoryview] = [
        pack_content_hdr(FRAME_HEADER, channel, 12 + len(props), BASIC, 0, body_size),
        props,
        FRAME_END_BYTE,
    ]
    limit = frame_max - 8
    chunks = [body] if isinstance(body, bytes) else body
    for chunk in chunks:
        if len(chunk) <= limit:
            if chunk:
                out += (pack_frame_hdr(FRAME_BODY, channel, len(chunk)), chunk, FRAME_END_BYTE)
            continue
        view = memoryview(chunk)
        for start in range(0, len(chunk), limit):
            piece = view[start : start + limit]
            out += (pack_frame_hdr(FRAME_BODY, channel, len(piece)), piece, FRAME_END_BYTE)
    return out


def queue_declare_ok(channel: int, queue: str, messages: int, consumers: int) -> bytes:
    """By hand: pamqp refuses to encode names outside the spec's character set, which
    RabbitMQ (and so Tandem) accepts."""
    name = queue.encode()
    payload = (
        METHOD_IDS.pack(50, 11) + bytes((len(name),)) + name + U32_U32.pack(messages, consumers)
    )
    return pack_frame_hdr(FRAME_METHOD, channel, len(payload)) + payload + FRAME_END_BYTE


def basic_ack_frame(channel: int, tag: int, multiple: bool) -> bytes:
    return (
        pack_method_hdr(FRAME_METHOD, channel, 13, BASIC, BASIC_ACK)
        + pack_u64_u8(tag, 1 if multiple else 0)
        + FRAME_END_BYTE
    )


def basic_nack_frame(channel: int, tag: int, multiple: bool) -> bytes:
    return (
        pack_method_hdr(FRAME_METHOD, channel, 13, BASIC, 120)
        + pack_u64_u8(tag, 1 if multiple else 0)
        + FRAME_END_BYTE
    )
