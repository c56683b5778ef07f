"""The replication protocol on the wire, pure: peer messages to bytes and back.

    length u32 | kind u8 | header length u32 | header | record frames

The header holds a message's fields, as JSON, except in the two kinds sent once per batch of
records, which a peer that says it takes them (`TAKES`, in the challenge and its answer) gets
with their few numbers packed: APPEND_B and ACK_B. A JSON header cost a member more CPU per
batch than writing it to disk (docs/performance.md), and a member that does not know them
still gets APPEND and ACK. Entries (and a full copy) are record frames, sent as
they are on disk, one after another (each frame says its own length). A copy larger than
`COPY_MESSAGE` goes as SYNC_PART messages, each with some of its frames, then the SYNC with
the rest: no message need be larger than a receiver takes (`MAX_MESSAGE`), and a receiver
that does not know SYNC_PART refuses it rather than installing part of a copy. An Append
larger than `APPEND_MESSAGE` (a transaction of many large messages is one turn's records) goes
the same way, as APPEND_PART messages then the APPEND_B, to a peer that takes them: its frames
are written as they are, never joined into one buffer on the loop. Before any peer
message, the two ends authenticate: the listener sends a challenge with its protocol
version and cluster, the member that connects answers with an HMAC of the challenge under
the cluster key, and the listener welcomes or refuses it with a reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import struct
from collections.abc import Sequence
from typing import Any, Final

from tandem.broker.model import records
from tandem.broker.replication import core
from tandem.broker.store.log import give_way

VERSION: Final = 1
HEAD: Final = struct.Struct(">IBI")  # total length after this u32, kind, header length
MAX_MESSAGE: Final = 1 << 30
# Not Final, as the other constants are: a test makes them small to see a copy cut up.
PIECE_BYTES = 4 << 20  # frames joined at a time into a piece of a copy (encode_parts)
COPY_MESSAGE = 256 << 20  # frames' bytes in one message of a copy
APPEND_MESSAGE = 256 << 20  # frames' bytes past which an Append goes in parts (encode_append)

HELLO, SYNC, APPEND, ACK, REJOIN, STALE, SYNC_PART = 1, 2, 3, 4, 5, 6, 7
APPEND_B, ACK_B = 8, 9  # APPEND and ACK with packed headers, to a peer that takes them
APPEND_PART: Final = 15  # some of a large Append's frames, before the APPEND_B with the rest
# The kinds past version 1's first ones that this member reads.
TAKES: Final = (APPEND_B, ACK_B, APPEND_PART)
APPEND_HEAD: Final = struct.Struct(">QQH")  # epoch, start, the sender's length; then the sender
ACK_HEAD: Final = struct.Struct(">QQQQH")  # epoch, session, offset, the sender's length; the sender
HEAD_SIZE: Final[int] = HEAD.size  # the sizes as ints, which compiled code reads directly
APPEND_HEAD_SIZE: Final[int] = APPEND_HEAD.size
ACK_HEAD_SIZE: Final[int] = ACK_HEAD.size
CHALLENGE, ANSWER, WELCOME, REFUSE = 10, 11, 12, 13
# Sent only to a follower whose Hello's digest was brief, which only a member that reads it
# sends.
DETAIL: Final = 14

_KINDS: Final[dict[type, int]] = {
    core.Hello: HELLO,
    core.Sync: SYNC,
    core.Append: APPEND,
    core.Ack: ACK,
    core.Rejoin: REJOIN,
    core.Stale: STALE,
    core.Detail: DETAIL,
}


class WireError(Exception):
    """A message that does not parse: the connection is closed."""


def pack(kind: int, header: dict[str, Any], frames: Sequence[records.Framed] = ()) -> bytes:
    body = _joined(frames)
    return _head(kind, json.dumps(header, separators=(",", ":")).encode(), len(body)) + body


def _head(kind: int, head: bytes, body: int) -> bytes:
    """A message's start: its length, kind and header, for a body of `body` bytes after it."""
    return HEAD.pack(1 + 4 + len(head) + body, kind, len(head)) + head


def encode(msg: core.PeerMessage, takes: Sequence[int] = ()) -> bytes:
    """`msg` as bytes for a peer that reads the kinds in `takes` beyond the first ones."""
    if isinstance(msg, core.Append) and APPEND_B in takes:
        sender = msg.sender.encode()
        head = APPEND_HEAD.pack(msg.epoch, msg.start, len(sender)) + sender
        body = _joined(msg.entries)
        return _head(APPEND_B, head, len(body)) + body
    if isinstance(msg, core.Ack) and ACK_B in takes:
        sender = msg.sender.encode()
        a, b = msg.session
        return _head(ACK_B, ACK_HEAD.pack(msg.epoch, a, b, msg.offset, len(sender)) + sender, 0)
    return pack(*_fields(msg))


def _joined(frames: Sequence[Any]) -> bytes:
    """Frames (`records.Framed`: a large record shipped as its parts) joined as one body."""
    try:
        return b"".join(frames)
    except TypeError:  # a record's parts among them
        return b"".join(records.buffers(frames))


def encode_append(msg: core.Append, takes: Sequence[int] = ()) -> list[bytes]:
    """`msg` as bytes to write one after another. Small records (the common case): one
    message, joined. With a large record's parts among them (`records.Framed`), to a peer
    that takes APPEND_B: its frames written as they are, small ones joined in runs, never
    the large body copied into one buffer on the loop. Over `APPEND_MESSAGE` bytes of
    frames, to a peer that takes APPEND_PART: APPEND_PART messages of at most that many
    (or one larger frame), then the APPEND_B, each with the Append's own header. One
    turn's commit of a transaction of eleven 100 MiB messages was one message past the
    1 GiB a receiver takes, and its joins held the primary's loop for seconds."""
    if APPEND_B not in takes:
        return [encode(msg, takes)]
    entries: Sequence[records.Framed] = msg.entries
    sender = msg.sender.encode()
    head = APPEND_HEAD.pack(msg.epoch, msg.start, len(sender)) + sender
    try:
        body: bytes | None = b"".join(entries)  # type: ignore[arg-type]
    except TypeError:  # a record's parts among them
        body = None
    limit = APPEND_MESSAGE if APPEND_PART in takes else 1 << 62  # else one message, as before
    if body is not None and len(body) <= limit:
        return [_head(APPEND_B, head, len(body)) + body]
    messages: list[tuple[list[records.Framed], int]] = []
    group: list[records.Framed] = []
    size = 0
    for data in entries:
        n = len(data) if isinstance(data, bytes) else records.framed_size(data)
        if group and size + n > limit:
            messages.append((group, size))
            group, size = [], 0
        group.append(data)
        size += n
    messages.append((group, size))
    out: list[bytes] = []
    for i, (group, size) in enumerate(messages, 1):
        out.append(_head(APPEND_B if i == len(messages) else APPEND_PART, head, size))
        out += _runs(records.buffers(group))
    return out


def _runs(buffers: list[bytes]) -> list[bytes]:
    """`buffers` to write: runs of small ones joined, large ones (bodies) as they are."""
    out: list[bytes] = []
    small: list[bytes] = []
    for data in buffers:
        if len(data) < records.BIG:
            small.append(data)
            continue
        if small:
            out.append(b"".join(small))
            small = []
        out.append(data)
    if small:
        out.append(b"".join(small))
    return out


def takes(said: dict[str, Any]) -> tuple[int, ...]:
    """The kinds a peer said it takes, in its challenge or its answer, that this one sends."""
    theirs = said.get("takes")
    if not isinstance(theirs, list):
        return ()
    return tuple(k for k in TAKES if k in theirs)


def encode_parts(msg: core.Sync) -> list[bytes]:
    """A Sync, with a copy made on another thread, as bytes to write one after another: one
    or more messages (SYNC_PART ..., SYNC), their frames joined a piece at a time. The
    thread lets the loop run only between bytecodes, and one join of 160 MB held it a fifth
    of a second."""
    kind, header, frames = _fields(msg)
    pieces: list[bytes] = []
    piece: list[bytes] = []
    size = 0
    for frame in frames:
        piece.append(frame)
        size += len(frame)
        if size >= PIECE_BYTES:
            pieces.append(b"".join(piece))
            piece, size = [], 0
            give_way()  # compiled code never gives the loop the GIL by itself
    if piece:
        pieces.append(b"".join(piece))
    messages: list[list[bytes]] = [[]]
    size = 0
    for piece_bytes in pieces:
        if messages[-1] and size + len(piece_bytes) > COPY_MESSAGE:
            messages.append([])
            size = 0
        messages[-1].append(piece_bytes)
        size += len(piece_bytes)
    out: list[bytes] = []
    part = {"sender": msg.sender, "epoch": msg.epoch, "session": list(msg.session)}
    for n, body in enumerate(messages, 1):
        last = n == len(messages)
        head = json.dumps(header if last else part, separators=(",", ":")).encode()
        out.append(_head(kind if last else SYNC_PART, head, sum(map(len, body))))
        out += body
    return out


def _fields(msg: core.PeerMessage) -> tuple[int, dict[str, Any], Sequence[bytes]]:
    kind = _KINDS[type(msg)]
    h: dict[str, Any] = {"sender": msg.sender, "epoch": msg.epoch}
    frames: Sequence[bytes] = ()
    if isinstance(msg, core.Hello):
        h.update(
            session=list(msg.session),
            boundaries=[list(b) for b in msg.boundaries],
            end=msg.end,
            whole=msg.whole,
            digest=msg.digest,
        )
    elif isinstance(msg, core.Sync):
        h.update(session=list(msg.session), agree=msg.agree, end=msg.end)
        h["boundaries"] = [list(b) for b in msg.boundaries]
        if msg.full is not None:
            h["full"] = True
            frames = msg.full
        else:
            frames = msg.entries
    elif isinstance(msg, core.Append):
        h["start"] = msg.start
        frames = msg.entries
    elif isinstance(msg, core.Ack):
        h.update(session=list(msg.session), offset=msg.offset)
    elif isinstance(msg, core.Detail):
        h["session"] = list(msg.session)
    return kind, h, frames


def size(data: bytes | bytearray, at: int = 0) -> int:
    """The size of the message that starts at `at` (its length's 4 bytes and what they
    count), from those 4 bytes; a length no message has ends the connection."""
    length = int.from_bytes(data[at : at + 4], "big")
    if length > MAX_MESSAGE or length < 5:
        raise WireError(f"bad message length {length}")
    return 4 + length


def split(data: bytes) -> tuple[int, int] | None:
    """(kind, total size) of the first whole message in `data`, or None for more bytes."""
    if len(data) < HEAD_SIZE:
        return None
    n = size(data)
    return None if len(data) < n else (data[4], n)


def header(data: bytes) -> tuple[int, dict[str, Any], bytes]:
    """(kind, header, the frames' bytes) of one whole message."""
    kind, h, start, stop = _header(data)
    return kind, h, data[start:stop]


def _header(data: bytes) -> tuple[int, dict[str, Any], int, int]:
    """(kind, header, where its frames start and stop) of one whole message."""
    length: int
    kind: int
    hlen: int
    length, kind, hlen = HEAD.unpack_from(data, 0)
    start = HEAD_SIZE
    try:
        h = json.loads(data[start : start + hlen])
    except ValueError as exc:
        raise WireError(f"bad message header: {exc}") from None
    if not isinstance(h, dict):
        raise WireError("bad message header: not an object")
    return kind, h, start + hlen, 4 + length


def frames(data: bytes, start: int = 0, stop: int = -1) -> list[bytes]:
    """Split checked record frames, of `data[start:stop]` (to its end by default): each is
    sliced once from the message, its bytes not copied out first. A frame that does not
    check out ends the connection."""
    out: list[bytes] = []
    pos, n = start, len(data) if stop < 0 else stop
    length: int
    while pos < n:
        problem = records.problem_at(data, pos)
        if problem is not None:
            raise WireError(f"a record frame does not check out: {problem}")
        _magic, length, _crc = records.REC_HDR.unpack_from(data, pos)
        end = pos + records.HDR_SIZE + length
        if end > n:
            raise WireError("a record frame runs past its message")
        out.append(data[pos:end])
        pos = end
    return out


class Upstream:
    """What a follower reads from its primary, a message at a time: peer messages, a copy's
    SYNC_PART messages put back together with the SYNC that ends them, and a large Append's
    APPEND_PART messages with the APPEND_B that ends them."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []  # the frames of a copy so far
        self.session: core.Session | None = None
        self.append_parts: list[bytes] = []  # the frames of an Append so far
        self.append_head: bytes = b""  # its header, which each of its messages repeats (or
        # b"": none begun)

    def take(self, data: bytes) -> core.PeerMessage | None:
        kind = data[4]
        if kind == APPEND_PART:
            head, start, stop = _append_part(data)
            if self.append_head and head != self.append_head:
                raise WireError("the parts of an Append were not followed by its end")
            self.append_head = head
            self.append_parts += frames(data, start, stop)
            return None
        if self.append_head:
            parts, self.append_parts = self.append_parts, []
            head, self.append_head = self.append_head, b""
            if kind != APPEND_B or _append_part(data)[0] != head:
                raise WireError("the parts of an Append were not followed by its end")
            msg = decode(data)
            assert isinstance(msg, core.Append)
            # Taken as one Append: held until its end came, it is applied in one turn of
            # the follower's loop (seconds, for a gigabyte), as one message's would be.
            return dataclasses.replace(msg, entries=[*parts, *msg.entries])
        if kind == SYNC_PART:
            _kind, h, start, stop = _header(data)
            try:
                session = _session(h["session"])
            except (KeyError, TypeError, ValueError) as exc:
                raise WireError(f"bad message of kind {kind}: {exc!r}") from None
            if session != self.session:
                self.parts, self.session = [], session
            self.parts += frames(data, start, stop)
            return None
        msg = decode(data)
        if isinstance(msg, core.Sync) and msg.full is not None and self.parts:
            if msg.session == self.session:
                msg = dataclasses.replace(msg, full=[*self.parts, *msg.full])
            self.parts, self.session = [], None
        return msg


def decode(data: bytes) -> core.PeerMessage:
    if data[4] == APPEND_B or data[4] == ACK_B:
        return _packed(data)
    return _decode(data, *_header(data))


def _append_part(data: bytes) -> tuple[bytes, int, int]:
    """(header, where its frames start and stop) of an APPEND_PART or APPEND_B message."""
    length: int
    hlen: int
    length, _kind, hlen = HEAD.unpack_from(data, 0)
    if HEAD_SIZE + hlen > 4 + length:
        raise WireError("an Append's header runs past its message")
    return data[HEAD_SIZE : HEAD_SIZE + hlen], HEAD_SIZE + hlen, 4 + length


def _packed(data: bytes) -> core.PeerMessage:
    """An APPEND_B or ACK_B message."""
    length: int
    kind: int
    hlen: int
    epoch: int
    n: int
    length, kind, hlen = HEAD.unpack_from(data, 0)
    at = HEAD_SIZE
    try:
        if kind == APPEND_B:
            epoch, start, n = APPEND_HEAD.unpack_from(data, at)
            if APPEND_HEAD_SIZE + n != hlen or at + hlen > 4 + length:
                raise ValueError("its header's length does not add up")
            sender = data[at + APPEND_HEAD_SIZE : at + hlen].decode()
            return core.Append(sender, epoch, start, frames(data, at + hlen, 4 + length))
        epoch, a, b, offset, n = ACK_HEAD.unpack_from(data, at)
        if ACK_HEAD_SIZE + n != hlen or 4 + length != at + hlen:
            raise ValueError("its header's length does not add up")
        sender = data[at + ACK_HEAD_SIZE : at + hlen].decode()
        return core.Ack(sender, epoch, (a, b), offset)
    except (struct.error, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise WireError(f"bad message of kind {kind}: {exc!r}") from None


def _decode(data: bytes, kind: int, h: dict[str, Any], start: int, stop: int) -> core.PeerMessage:
    """A message with a JSON header: its frames are `data[start:stop]`."""
    try:
        sender, epoch = str(h["sender"]), int(h["epoch"])
        if kind == HELLO:
            return core.Hello(
                sender,
                epoch,
                _session(h["session"]),
                _boundaries(h["boundaries"]),
                int(h["end"]),
                bool(h["whole"]),
                h.get("digest"),
            )
        if kind == SYNC:
            entries = frames(data, start, stop)
            session = _session(h["session"])
            bounds = _boundaries(h["boundaries"])
            if h.get("full"):
                return core.Sync(sender, epoch, session, 0, (), entries, bounds, int(h["end"]))
            return core.Sync(sender, epoch, session, int(h["agree"]), entries)
        if kind == APPEND:
            return core.Append(sender, epoch, int(h["start"]), frames(data, start, stop))
        if kind == ACK:
            return core.Ack(sender, epoch, _session(h["session"]), int(h["offset"]))
        if kind == REJOIN:
            return core.Rejoin(sender, epoch)
        if kind == STALE:
            return core.Stale(sender, epoch)
        if kind == DETAIL:
            return core.Detail(sender, epoch, _session(h["session"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"bad message of kind {kind}: {exc!r}") from None
    raise WireError(f"unknown message kind {kind}")


def _session(value: Any) -> core.Session:
    a, b = value
    return int(a), int(b)


def _boundaries(value: Any) -> core.Boundaries:
    return tuple((int(e), int(o)) for e, o in value)


# -- authentication --


def proof(key: bytes, nonce: str, node: str) -> str:
    return hmac.new(key, f"tandem-replication:{nonce}:{node}".encode(), hashlib.sha256).hexdigest()


def check_proof(key: bytes, nonce: str, node: str, given: str) -> bool:
    return hmac.compare_digest(proof(key, nonce, node), given)
