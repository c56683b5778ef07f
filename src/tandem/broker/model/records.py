"""Log records: their frame and payloads, pure (bytes in, values out).

One frame serves the disk and the wire: the store writes the frames of durable records as they
are, replication ships every frame, and a backup writes the durable ones it receives verbatim.

    magic "TC" | length u32 | crc32c u32 | type u8 | epoch u32 | offset u64 | payload

The crc covers everything after it: CRC-32C (Castagnoli, as Kafka, RocksDB and ext4 use),
which google-crc32c computes with the CPU's CRC instructions, 4 µs for 64 KiB where zlib's
CRC-32 took 30. Magic "TL" marks a record checksummed with zlib's CRC-32: what versions
before 2026-11-28 wrote, and what a node writes where google-crc32c has no C extension (its
pure-Python fallback takes 18 ms for 64 KiB). Both kinds are read.

Magic "TS" marks a record of a reused segment (the store writes over a consumed segment
rather than delete it and allocate a new one, `Store._roll`): its checksum is the CRC-32C
xor the segment's salt (`salt`, from its number). Such a segment (named so: `.reused.seg`)
is read with its salt, and only "TS" records that check out with it count: the records of
its last life that still lie past its new end never do. Only the store writes "TS"; the wire
never carries it.

The type's high bit says the record is durable (a backup writes it to disk); the next bit
(MORE) that more records of the same group follow: a group (a transaction's publishes and
acks) is applied whole or not at all. A record's identity is (epoch, offset).
"""

from __future__ import annotations

import datetime
import decimal
import json
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

import google_crc32c
from pamqp import decode as amqp_decode
from pamqp import encode as amqp_encode

from tandem.broker.model.message import Message

MAGIC: Final = b"TC"  # a record checksummed with CRC-32C
MAGIC_CRC32: Final = b"TL"  # ... with zlib's CRC-32 (before 2026-11-28, or no C extension)
MAGIC_SALTED: Final = b"TS"  # ... with CRC-32C xor its reused segment's salt
CRC32C_IN_C: Final = google_crc32c.implementation == "c"
WRITTEN: Final = MAGIC if CRC32C_IN_C else MAGIC_CRC32  # the kind of record this node writes
REC_HDR: Final = struct.Struct(">2sII")  # magic, length of the rest, checksum of the rest
REC_META: Final = struct.Struct(">BIQ")  # type, epoch, offset
STR16: Final = struct.Struct(">H")
U32: Final = struct.Struct(">I")
U64: Final = struct.Struct(">Q")
_ID: Final = struct.Struct(">QI")  # a message id in a key: offset, then epoch
MAX_RECORD: Final = 1 << 31
# Sizes and readers held as ints and functions: compiled code then looks nothing up by name.
HDR_SIZE: Final[int] = REC_HDR.size
META_SIZE: Final[int] = REC_META.size
HEADER: Final[int] = HDR_SIZE + META_SIZE
_read_hdr: Final = REC_HDR.unpack_from
_read_meta: Final = REC_META.unpack_from
_read_u16: Final = STR16.unpack_from
_read_u32: Final = U32.unpack_from
_pack_hdr: Final = REC_HDR.pack
_pack_meta: Final = REC_META.pack
_pack_u32: Final = U32.pack
_pack_id: Final = _ID.pack
ID_SIZE: Final[int] = _ID.size
U64_SIZE: Final[int] = U64.size

# Record types. SNAPSHOT is housekeeping: it restates the durable definitions at the start of
# a segment and takes no position of its own (its offset is the position it restates).
DEFINE: Final = 1
ENQUEUE: Final = 2
DEQUEUE: Final = 3
SNAPSHOT: Final = 4
MARK: Final = 5  # a delivery to a consumer: after failover the message is redelivered=true
CHECKPOINT: Final = 6  # an audit marker: each member records its queue depths when it applies it
NOOP: Final = 7  # holds the position of a durable change that is not replicated (a `none` queue's)
# The deliveries of one queue in one turn of the primary's loop: MARKs, as one record.
MARKS: Final = 8
DURABLE: Final = 0x80
MORE: Final = 0x40
TYPE_MASK: Final = 0x3F

NAMES: Final = {
    DEFINE: "define",
    ENQUEUE: "enqueue",
    DEQUEUE: "dequeue",
    SNAPSHOT: "snapshot",
    MARK: "mark",
    CHECKPOINT: "checkpoint",
    NOOP: "noop",
    MARKS: "marks",
}


# A payload from this size up is copied once when framed; below, two copies cost less.
BIG: Final = 8192

_extend: Callable[[int, bytes], int] = google_crc32c.extend


def crc32c(data: bytes, crc: int = 0) -> int:
    """The CRC-32C of `data`, continuing `crc` (the checksum of what came before it)."""
    return _extend(crc, data)


# A record's checksum is computed over slices of at most this many bytes: the C library takes
# bytes only, and a slice of a 100 MiB record in one piece is 100 MiB of fresh memory,
# faulted in and zeroed by the kernel (most of a follower's time taking such records).
CRC_SLICE: Final = 1 << 20


def _crc32c_within(data: bytes, start: int, end: int) -> int:
    """The CRC-32C of `data[start:end]`, a slice at a time."""
    if end - start <= CRC_SLICE:
        return _extend(0, data[start:end])
    crc = 0
    for at in range(start, end, CRC_SLICE):
        crc = _extend(crc, data[at : min(at + CRC_SLICE, end)])
    return crc


def checksum(data: bytes, crc: int = 0) -> int:
    """The checksum of the records this node writes (`WRITTEN`), continuing `crc`."""
    if CRC32C_IN_C:
        return _extend(crc, data)
    return zlib.crc32(data, crc)


def frame(
    rtype: int,
    epoch: int,
    offset: int,
    payload: bytes,
    durable: bool = True,
    more: bool = False,
) -> bytes:
    """A record's frame; a payload in parts is framed by `frame_parts`."""
    flags = (DURABLE if durable else 0) | (MORE if more else 0)
    meta = _pack_meta(rtype | flags, epoch, offset)
    if len(payload) < BIG:
        rest = meta + payload
        return _pack_hdr(WRITTEN, len(rest), checksum(rest)) + rest
    crc = checksum(payload, checksum(meta))  # over both, without joining them first
    return b"".join((_pack_hdr(WRITTEN, len(meta) + len(payload), crc), meta, payload))


def frame_parts(
    rtype: int,
    epoch: int,
    offset: int,
    payload: list[bytes],
    durable: bool = True,
    more: bool = False,
) -> list[bytes]:
    """A record's frame from a payload's parts (`enqueue_parts`), as parts: each large one
    (a body) as it is, the small ones around it joined with the header. The store writes
    them with one writev, so that a large body is never copied into a frame."""
    flags = (DURABLE if durable else 0) | (MORE if more else 0)
    meta = _pack_meta(rtype | flags, epoch, offset)
    crc, size = checksum(meta), len(meta)
    for part in payload:
        crc, size = checksum(part, crc), size + len(part)
    out: list[bytes] = []
    run = [_pack_hdr(WRITTEN, size, crc), meta]
    for part in payload:
        if len(part) < BIG:
            run.append(part)
        else:
            out.append(b"".join(run))
            out.append(part)
            run = []
    if run:
        out.append(b"".join(run))
    return out


# A record's frame as it is shipped: one buffer, or its parts (`frame_parts`: a large body as
# it came, never joined into a frame on the loop; a transaction of eleven 100 MiB messages
# joined for shipping held a primary's loop past its failover delay).
Framed = bytes | list[bytes]


def framed_size(data: Framed) -> int:
    return len(data) if isinstance(data, bytes) else sum(map(len, data))


def buffers(frames: Iterable[Framed]) -> list[bytes]:
    """The buffers of `frames`, in order: each frame, or each of its parts."""
    out: list[bytes] = []
    for data in frames:
        if isinstance(data, bytes):
            out.append(data)
        else:
            out += data
    return out


def salt(segment: int) -> int:
    """The salt of a reused segment's records: never 0, and different for each number below
    2**32 (an odd multiplier is a bijection modulo 2**32)."""
    return ((segment + 1) * 0x9E3779B1) & 0xFFFFFFFF or 1


def salted(data: bytes | list[bytes], with_salt: int) -> list[bytes | memoryview]:
    """A frame this node framed or received (whole, or in parts with the header in the
    first), as a reused segment holds it: magic "TS", its CRC-32C xor `with_salt`, the rest
    as it is. A large frame's rest is not copied; a frame with zlib's CRC-32 (a primary
    without the C extension) is checked again with CRC-32C."""
    parts = [data] if isinstance(data, bytes) else data
    first = parts[0]
    magic: bytes
    length: int
    crc: int
    magic, length, crc = _read_hdr(first, 0)
    if magic != MAGIC:
        crc = crc32c(first[HDR_SIZE:])
        for part in parts[1:]:
            crc = crc32c(part, crc)
    head = _pack_hdr(MAGIC_SALTED, length, crc ^ with_salt)
    out: list[bytes | memoryview] = (
        [head + first[HDR_SIZE:]] if len(first) < BIG else [head, memoryview(first)[HDR_SIZE:]]
    )
    out.extend(parts[1:])
    return out


def head(data: bytes | memoryview) -> tuple[int, int, int, bool]:
    """(type, epoch, offset, durable) of a frame known to be whole and checked."""
    rtype: int
    epoch: int
    offset: int
    rtype, epoch, offset = _read_meta(data, HDR_SIZE)
    return rtype & TYPE_MASK, epoch, offset, bool(rtype & DURABLE)


def continues(data: bytes | memoryview) -> bool:
    """True when more records of this one's group follow it."""
    return bool(data[HDR_SIZE] & MORE)


def payload(data: bytes) -> bytes:
    return data[HEADER:]


@dataclass(slots=True)
class Corruption:
    where: str
    offset: int
    reason: str

    def __str__(self) -> str:
        return f"{self.where} at byte {self.offset}: {self.reason}"


Scanned = tuple[int, int, int, bytes]  # type (with its MORE bit), epoch, offset, payload


def scan(
    data: bytes,
    where: str = "log",
    stop_at_corrupt: bool = False,
    positions: list[int] | None = None,
    salt: int = 0,
) -> tuple[list[Scanned], int, list[Corruption], bool]:
    """Read the frames in `data`, in order: of a reused segment, those salted with its
    `salt` (`salted`), else those of a plain one.

    Returns the records, the end of the last one, the corrupt spots, and whether the data
    ends in a torn tail (a record cut short that no valid record follows). A corrupt spot
    followed by a valid record is skipped and named, unless `stop_at_corrupt`, when reading
    stops there. Zeros to the end are the end, not a tail: a segment's space allocated ahead
    of its records (`Store._fd`). `positions` gets each record's first byte.
    """
    records: list[Scanned] = []
    corrupt: list[Corruption] = []
    pos = 0
    n = len(data)
    good_end = 0
    length: int
    rtype: int
    epoch: int
    offset: int
    while pos < n:
        problem = problem_at(data, pos, salt)
        if problem is None:
            _m, length, _crc = _read_hdr(data, pos)
            end = pos + HDR_SIZE + length
            rtype, epoch, offset = _read_meta(data, pos + HDR_SIZE)
            records.append((rtype & (TYPE_MASK | MORE), epoch, offset, data[pos + HEADER : end]))
            if positions is not None:
                positions.append(pos)
            pos = good_end = end
            continue
        if data.count(0, pos) == n - pos:  # never written (a zero is no frame's first byte)
            return records, good_end, corrupt, False
        nxt = _next_valid(data, pos + 1, salt)
        if nxt is None:
            return records, good_end, corrupt, True
        corrupt.append(Corruption(where, pos, problem))
        if stop_at_corrupt:
            return records, good_end, corrupt, False
        pos = nxt
    return records, good_end, corrupt, False


def enqueue_sizes(data: bytes, pos: int) -> tuple[int, int] | None:
    """(frame length, body length) of the ENQUEUE frame at `pos`, read from its header and
    fields without checking its checksum (that is for when it is read whole); None when the
    header or the fields do not hold together."""
    length: int
    field: int
    try:
        magic, length, _crc = _read_hdr(data, pos)
        end = pos + HDR_SIZE + length
        if (magic != MAGIC and magic != MAGIC_CRC32 and magic != MAGIC_SALTED) or end > len(data):
            return None
        at = pos + HEADER
        (field,) = _read_u16(data, at)
        at += 2 + field  # vhost
        (field,) = _read_u16(data, at)
        at += 2 + field + U64_SIZE  # queue, offset
        (field,) = _read_u32(data, at)
        at += 4 + field  # route
        (field,) = _read_u32(data, at)
        at += 4 + field  # properties
        body: int = _read_u32(data, at)[0]
    except struct.error:
        return None
    if at + 4 + body > end:
        return None
    return end - pos, body


def read_at(data: bytes, pos: int) -> Scanned:
    """The record whose frame begins at `pos`, known to be whole and valid (`problem_at`)."""
    length: int
    rtype: int
    epoch: int
    offset: int
    _m, length, _crc = _read_hdr(data, pos)
    rtype, epoch, offset = _read_meta(data, pos + HDR_SIZE)
    return (
        rtype & (TYPE_MASK | MORE),
        epoch,
        offset,
        data[pos + HEADER : pos + HDR_SIZE + length],
    )


def problem_at(data: bytes, pos: int, salt: int = 0) -> str | None:
    """What is wrong with the frame at `pos` (of a reused segment with `salt`), or None."""
    n = len(data)
    if n - pos < HDR_SIZE:
        return "truncated record header"
    length: int
    crc: int
    magic, length, crc = _read_hdr(data, pos)
    end = pos + HDR_SIZE + length
    if salt:
        if magic != MAGIC_SALTED:
            return "not a record of this life of a reused segment"
    elif magic != MAGIC and magic != MAGIC_CRC32:
        return "bad record magic"
    if length < META_SIZE or length > MAX_RECORD:
        return f"bad record length {length}"
    if end > n:
        return "record runs past the end of the file"
    if magic == MAGIC_CRC32:
        with memoryview(data) as view:
            found = zlib.crc32(view[pos + HDR_SIZE : end])
    else:
        found = _crc32c_within(data, pos + HDR_SIZE, end) ^ salt
    if found != crc:
        return "checksum mismatch"
    return None


def _next_valid(data: bytes, start: int, salt: int = 0) -> int | None:
    """Where the next valid record begins at or after `start`: of a reused segment (`salt`),
    salted with it; else of either kind. Each kind's magic is searched for onwards from its
    last find only, so that a stretch with many false magics of one kind is not searched
    through again for the other at each."""
    if salt:
        pos = data.find(MAGIC_SALTED, start)
        while pos != -1:
            if problem_at(data, pos, salt) is None:
                return pos
            pos = data.find(MAGIC_SALTED, pos + 1)
        return None
    new, old = data.find(MAGIC, start), data.find(MAGIC_CRC32, start)
    while new != -1 or old != -1:
        pos = old if new == -1 else new if old == -1 else min(new, old)
        if problem_at(data, pos) is None:
            return pos
        if pos == new:
            new = data.find(MAGIC, pos + 1)
        else:
            old = data.find(MAGIC_CRC32, pos + 1)
    return None


class Grouper:
    """Collects records into their groups: `add` returns the records to apply together (one
    record alone, or a whole group once its last record came), or nothing while a group is
    still open. What remains in `pending` at the end is a group that was never finished."""

    def __init__(self) -> None:
        self.pending: list[Scanned] = []

    def add(self, record: Scanned) -> list[Scanned]:
        rtype, epoch, offset, data = record
        self.pending.append((rtype & TYPE_MASK, epoch, offset, data))
        if rtype & MORE:
            return []
        done, self.pending = self.pending, []
        return done


# -- payloads --


def _str(value: str) -> bytes:
    raw = value.encode()
    return STR16.pack(len(raw)) + raw


def _bytes(value: bytes) -> bytes:
    return U32.pack(len(value)) + value


# A structured payload (definitions, snapshots, checkpoints, users) is an AMQP field table
# behind this format byte, so arguments keep their AMQP types: bytes stay bytes, a decimal
# stays a decimal, a timestamp a timestamp, nested tables and arrays as they were. Payloads
# written before it are JSON objects (they begin with "{") and are still read.
TABLE: Final = b"\x01"
# A test-only fault (the differential test's mutation check): write byte strings as text,
# as a codec that dropped the byte-array type would. Set by TANDEM_TEST_FAULT_BYTES_AS_TEXT;
# never in use.
BYTES_AS_TEXT = False


def encode_body(value: dict[str, Any]) -> bytes:
    """A structured payload; raises ValueError for a value no AMQP field can hold."""
    return TABLE + _table(value)


def decode_body(data: bytes) -> dict[str, Any]:
    """A structured payload, as `encode_body` or an older version (JSON) wrote it."""
    head = data[:1]
    if head == TABLE:
        try:
            _n, value = amqp_decode.field_table(bytes(data[1:]))
        except (ValueError, TypeError, KeyError, IndexError, struct.error) as exc:
            raise ValueError(f"undecodable field table: {exc!r}") from None
        return value
    if head == b"{":
        value = json.loads(data)
        if isinstance(value, dict):
            return value
    raise ValueError("record payload is not a table")


def _table(value: dict[str, Any]) -> bytes:
    parts = []
    for key, item in value.items():
        raw = str(key).encode()
        if len(raw) > 255:
            raise ValueError(f"field name longer than 255 bytes: {key[:40]!r}...")
        parts.append(bytes((len(raw),)) + raw + _value(item))
    body = b"".join(parts)
    return U32.pack(len(body)) + body


def _value(v: Any) -> bytes:
    """One field value with its type tag. Unlike pamqp's encoder (which writes floats as
    32-bit and has no tag for bytes), every value comes back exactly as pamqp decodes it."""
    if isinstance(v, bool):
        return b"t" + (b"\x01" if v else b"\x00")
    if isinstance(v, int):
        if not -(1 << 63) <= v < (1 << 63):
            raise ValueError(f"integer out of range for an AMQP field: {v}")
        return b"l" + amqp_encode.long_long_int(v)
    if isinstance(v, float):
        return b"d" + amqp_encode.double(v)
    if isinstance(v, decimal.Decimal):
        return b"D" + amqp_encode.decimal(v)
    if isinstance(v, str):
        return b"S" + amqp_encode.long_string(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        if BYTES_AS_TEXT:
            return b"S" + amqp_encode.long_string(bytes(v).decode("utf-8", "replace"))
        return b"x" + U32.pack(len(v)) + bytes(v)
    if isinstance(v, datetime.datetime):
        return b"T" + amqp_encode.timestamp(v)
    if isinstance(v, dict):
        return b"F" + _table(v)
    if isinstance(v, (list, tuple)):
        items = b"".join(_value(i) for i in v)
        return b"A" + U32.pack(len(items)) + items
    if v is None:
        return b"V"
    raise ValueError(f"no AMQP field type holds {type(v).__name__} {v!r}")


def define(vhost: str, op: str, body: dict[str, Any]) -> bytes:
    return encode_body({"vhost": vhost, "op": op, "body": body})


# A message's identity (its `mid`) is the (epoch, offset) of the record that first enqueued
# it, as one integer: epoch << 64 | offset. Ids order as the log does, and two records of
# different epochs at the same offset (a diverged suffix and the history that replaced it)
# never name the same message. In a payload the offset sits where it always did and the epoch
# follows at the end; a payload written before epochs were part of the id has no epoch there
# and reads as epoch 0, so a data dir's older records keep naming their own messages.
OFFSET_BITS: Final = 64
OFFSET_MASK: Final = (1 << OFFSET_BITS) - 1


def mid(epoch: int, offset: int) -> int:
    return (epoch << OFFSET_BITS) | offset


def mid_epoch(message_id: int) -> int:
    return message_id >> OFFSET_BITS


def mid_offset(message_id: int) -> int:
    return message_id & OFFSET_MASK


def show_mid(message_id: int) -> str:
    """An id as people read positions: epoch:offset."""
    return f"{mid_epoch(message_id)}:{mid_offset(message_id)}"


def place(vhost: str, queue: str) -> bytes:
    """The leading fields of every message record of one queue: its vhost and name."""
    return _str(vhost) + _str(queue)


def enqueue(vhost: str, queue: str, msg: Message) -> bytes:
    return enqueue_at(place(vhost, queue), msg)


def enqueue_at(where: bytes, msg: Message) -> bytes:
    """An ENQUEUE payload of the queue at `where` (see `place`), joined."""
    body = msg.body
    if not isinstance(body, bytes):
        return b"".join(enqueue_parts(where, msg))
    # The parts of enqueue_parts, as one tuple: a list built with a splat costs more than the
    # joined bytes of a small message.
    route, props, message_id = msg.route, msg.props, msg.mid
    return b"".join(
        (
            where,
            _pack_enq(message_id & OFFSET_MASK, len(route)),
            route,
            _pack_u32(len(props)),
            props,
            _pack_u32(msg.body_size),
            body,
            _pack_u32(message_id >> OFFSET_BITS),
        )
    )


def enqueue_size(where: bytes, msg: Message) -> int:
    """The length of the frame of `enqueue_parts(where, msg)`."""
    fixed = HEADER + len(where) + U64.size + 4 * U32.size
    return fixed + len(msg.route) + len(msg.props) + msg.body_size


def enqueue_parts(where: bytes, msg: Message) -> list[bytes]:
    """An ENQUEUE payload as its parts, the body spliced in as the chunks it came in; `frame`
    checksums and joins them at once, so that a large body is copied once."""
    route, props, body, message_id = msg.route, msg.props, msg.body, msg.mid
    chunks = [body] if isinstance(body, bytes) else body
    return [
        where,
        _pack_enq(message_id & OFFSET_MASK, len(route)),
        route,
        _pack_u32(len(props)),
        props,
        _pack_u32(msg.body_size),
        *chunks,
        _pack_u32(message_id >> OFFSET_BITS),
    ]


def key(vhost: str, queue: str, message_id: int) -> bytes:
    """The payload of DEQUEUE and MARK: which message of which queue."""
    return key_at(place(vhost, queue), message_id)


def key_at(where: bytes, message_id: int) -> bytes:
    return where + _pack_id(message_id & OFFSET_MASK, message_id >> OFFSET_BITS)


# A place's names, by its bytes: every record of a queue begins with the same place, and a
# backup or a replay reads one per record. Bounded: cleared when it holds this many.
_PLACES: Final[dict[bytes, tuple[str, str]]] = {}
PLACES_KEPT: Final = 4096


def read_place(data: bytes) -> tuple[str, str, int]:
    """(vhost, queue, where the place ends) of a message record's leading fields."""
    vlen: int
    qlen: int
    (vlen,) = _read_u16(data, 0)
    (qlen,) = _read_u16(data, 2 + vlen)
    end = 4 + vlen + qlen
    raw = data[:end]
    names = _PLACES.get(raw)
    if names is None:
        if end > len(data):
            raise ValueError("truncated field")
        names = (raw[2 : 2 + vlen].decode(), raw[4 + vlen :].decode())
        if len(_PLACES) >= PLACES_KEPT:
            _PLACES.clear()
        _PLACES[raw] = names
    return names[0], names[1], end


def marks_at(where: bytes, message_ids: list[int]) -> bytes:
    """The payload of MARKS: a queue's place, then the ids of its messages delivered."""
    pack = _ID.pack
    return where + b"".join([pack(m & OFFSET_MASK, m >> OFFSET_BITS) for m in message_ids])


def read_marks(data: bytes) -> tuple[str, str, list[int]]:
    """(vhost, queue, mids) of a MARKS."""
    vhost, queue, at = read_place(data)
    if (len(data) - at) % _ID.size:
        raise ValueError("truncated message id")
    return vhost, queue, [(e << OFFSET_BITS) | o for o, e in _ID.iter_unpack(data[at:])]


def id_offset(frame: bytes) -> int:
    """The offset part of the message id a whole DEQUEUE, MARK or ENQUEUE frame names, read
    in place: its names are not decoded nor its payload copied (`Restarted`, on a copy's
    thread, passes over every such record since a follower's end)."""
    vlen: int
    qlen: int
    offset: int
    (vlen,) = _read_u16(frame, HEADER)
    (qlen,) = _read_u16(frame, HEADER + 2 + vlen)
    (offset,) = U64.unpack_from(frame, HEADER + 4 + vlen + qlen)
    return offset


def read_key(data: bytes) -> tuple[str, str, int]:
    """(vhost, queue, mid) of a DEQUEUE or MARK, or of an ENQUEUE (its leading fields)."""
    vhost, queue, at = read_place(data)
    n = len(data)
    offset: int
    epoch: int
    field: int
    if n == at + ID_SIZE:  # a key with its epoch
        offset, epoch = _ID.unpack_from(data, at)
        return vhost, queue, (epoch << OFFSET_BITS) | offset
    (offset,) = U64.unpack_from(data, at)
    if n == at + U64_SIZE:  # a key written before epochs were part of the id
        return vhost, queue, offset
    at += U64_SIZE
    for _field in range(3):  # an enqueue: its epoch follows route, properties and body
        (field,) = _read_u32(data, at)
        at += 4 + field
    if at > n:
        raise ValueError("truncated field")
    if at == n:
        return vhost, queue, offset
    (epoch,) = _read_u32(data, at)
    return vhost, queue, mid(epoch, offset)


_ENQ: Final = struct.Struct(">QI")  # an enqueue's offset and route length, after its place
_read_enq: Final = _ENQ.unpack_from
_pack_enq: Final = _ENQ.pack
_ENQ_SIZE: Final[int] = _ENQ.size


def read_enqueue(data: bytes) -> tuple[str, str, int, bytes, bytes, bytes]:
    """(vhost, queue, mid, route, props, body)."""
    vhost, queue, at = read_place(data)
    offset: int
    n: int
    epoch: int
    offset, n = _read_enq(data, at)
    at += _ENQ_SIZE
    route = data[at : at + n]
    at += n
    (n,) = _read_u32(data, at)
    props = data[at + 4 : at + 4 + n]
    at += 4 + n
    (n,) = _read_u32(data, at)
    body = data[at + 4 : at + 4 + n]
    at += 4 + n
    if at > len(data):
        raise ValueError("truncated field")
    epoch = _read_u32(data, at)[0] if at < len(data) else 0
    return vhost, queue, (epoch << OFFSET_BITS) | offset, route, props, body
