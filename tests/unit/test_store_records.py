"""The log's record frame and scanning (`tandem.broker.model.records`), pure."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.broker.model import apply, message, records
from tandem.broker.model.broker import Broker
from tandem.broker.model.journal import Sequencer
from tandem.broker.model.message import Message
from tandem.broker.store import log as log_mod
from tandem.broker.store.log import Store


def test_records_round_trip() -> None:
    data = records.frame(records.DEFINE, 3, 10, b"a") + records.frame(
        records.ENQUEUE, 3, 11, b"bb", durable=False
    )
    found, end, corrupt, torn = records.scan(data)
    assert found == [(records.DEFINE, 3, 10, b"a"), (records.ENQUEUE, 3, 11, b"bb")]
    assert (end, corrupt, torn) == (len(data), [], False)
    assert records.head(data) == (records.DEFINE, 3, 10, True)


@pytest.mark.parametrize("body", [b"", b"small body", [b"a body ", b"in ", b"chunks"]])
def test_an_enqueue_payload_is_the_same_joined_at_once_or_from_its_parts(
    body: bytes | list[bytes],
) -> None:
    """enqueue_at writes a small message's payload itself (one tuple, not enqueue_parts'
    list): both lay out the same fields, and read back as the message."""
    size = len(body) if isinstance(body, bytes) else sum(map(len, body))
    msg = Message("ex", "rk", message.encode_route("ex", "rk"), b"\x10\x00\x02", body, size)
    msg.mid = records.mid(7, 12345)
    where = records.place("/", "q")
    joined = records.enqueue_at(where, msg)
    assert joined == b"".join(records.enqueue_parts(where, msg))
    whole = body if isinstance(body, bytes) else b"".join(body)
    assert records.read_enqueue(joined) == ("/", "q", msg.mid, msg.route, msg.props, whole)


def test_a_large_body_is_framed_around_its_own_buffer_not_copied_into_the_frame() -> None:
    """frame_parts lays out the bytes frame does, the body left as the object it came as
    (the store writes the parts with one writev) and the small fields joined around it."""
    body = bytes(range(256)) * 256  # 64 KiB
    msg = Message("ex", "rk", message.encode_route("ex", "rk"), b"\x10\x00\x02", body, len(body))
    msg.mid = records.mid(3, 77)
    payload = records.enqueue_parts(records.place("/", "q"), msg)
    parts = records.frame_parts(records.ENQUEUE, 3, 77, payload, True, True)
    assert b"".join(parts) == records.frame(records.ENQUEUE, 3, 77, b"".join(payload), True, True)
    assert len(parts) == 3 and parts[1] is body
    assert records.continues(parts[0])
    found, end, corrupt, torn = records.scan(b"".join(parts))
    assert [(t & records.TYPE_MASK, e, o) for t, e, o, _ in found] == [(records.ENQUEUE, 3, 77)]
    assert records.read_enqueue(found[0][3])[5] == body
    assert (end, corrupt, torn) == (len(b"".join(parts)), [], False)


@given(
    vhost=st.text(max_size=20),
    queue=st.text(max_size=300),
    epoch=st.integers(0, (1 << 32) - 1),
    offset=st.integers(0, (1 << 48) - 1),
)
def test_a_frames_id_offset_read_in_place_is_the_one_its_key_names(
    vhost: str, queue: str, epoch: int, offset: int
) -> None:
    """A copy for a restarted follower reads the offset of each DEQUEUE's and ENQUEUE's id in
    place (`id_offset`), and decodes a key only for the ids the follower may hold: the two
    read the same offset, from a key with its epoch, one written before epochs were part
    of ids, and an enqueue."""
    mid = records.mid(epoch, offset)
    where = records.place(vhost, queue)
    msg = Message("ex", "rk", message.encode_route("ex", "rk"), b"", b"body", 4)
    msg.mid = mid
    for rtype, payload in (
        (records.DEQUEUE, records.key(vhost, queue, mid)),
        (records.MARK, where + records.U64.pack(offset)),
        (records.ENQUEUE, records.enqueue_at(where, msg)),
    ):
        frame = records.frame(rtype, 1, 2, payload)
        assert records.id_offset(frame) == records.mid_offset(records.read_key(payload)[2])
        assert records.id_offset(frame) == offset


def test_torn_tail_is_reported() -> None:
    good = records.frame(records.DEFINE, 1, 1, b"ok")
    found, end, corrupt, torn = records.scan(
        good + records.frame(records.DEFINE, 1, 2, b"cut short")[:-3]
    )
    assert [r[2] for r in found] == [1]
    assert torn and end == len(good) and corrupt == []


def test_zeros_after_the_records_are_their_end_not_a_tail() -> None:
    """A segment's space allocated ahead and never written reads as zeros: the end of the
    log, not a torn tail. A record cut short before them is still one."""
    good = records.frame(records.DEFINE, 1, 1, b"ok")
    found, end, corrupt, torn = records.scan(good + bytes(4096))
    assert [r[2] for r in found] == [1]
    assert (end, corrupt, torn) == (len(good), [], False)
    cut = records.frame(records.DEFINE, 1, 2, b"cut short")[:-3]
    found, end, corrupt, torn = records.scan(good + cut + bytes(4096))
    assert [r[2] for r in found] == [1] and torn and end == len(good)


def test_corruption_in_the_middle_is_skipped_and_named() -> None:
    a = records.frame(records.DEFINE, 1, 1, b"first")
    b = bytearray(records.frame(records.DEFINE, 1, 2, b"second"))
    b[-1] ^= 0xFF
    c = records.frame(records.DEFINE, 1, 3, b"third")
    found, _end, corrupt, torn = records.scan(a + bytes(b) + c, "seg-1")
    assert [r[2] for r in found] == [1, 3]
    assert len(corrupt) == 1 and corrupt[0].offset == len(a)
    assert "checksum mismatch" in str(corrupt[0]) and "seg-1" in str(corrupt[0])
    assert not torn


def test_a_cluster_member_stops_at_the_first_corrupt_record() -> None:
    a = records.frame(records.DEFINE, 1, 1, b"first")
    b = bytearray(records.frame(records.DEFINE, 1, 2, b"second"))
    b[-1] ^= 0xFF
    c = records.frame(records.DEFINE, 1, 3, b"third")
    found, end, corrupt, torn = records.scan(a + bytes(b) + c, stop_at_corrupt=True)
    assert [r[2] for r in found] == [1]
    assert end == len(a) and len(corrupt) == 1 and not torn


@pytest.mark.parametrize("damage", ["payload", "magic", "length", "cut"])
def test_a_replicated_frame_that_does_not_check_out_ends_the_link(damage: str) -> None:
    """A backup takes the primary's frames only whole and checked: one damaged byte (in the
    payload, the magic or the length) or a cut frame is a WireError, never a record."""
    from tandem.broker.replication import core, wire

    a = records.frame(records.DEFINE, 1, 1, b"first")
    b = bytearray(records.frame(records.ENQUEUE, 1, 2, b"second" * 10))
    good = wire.decode(wire.encode(core.Append("p", 1, 1, (a, bytes(b)))))
    assert isinstance(good, core.Append) and list(good.entries) == [a, bytes(b)]
    if damage == "payload":
        b[-1] ^= 0x01
    elif damage == "magic":
        b[0] ^= 0x01
    elif damage == "length":
        b[5] += 1
    else:
        del b[-1]
    with pytest.raises(wire.WireError, match="record frame"):
        wire.decode(wire.encode(core.Append("p", 1, 1, (a, bytes(b)))))


@pytest.mark.parametrize("count", [0, 1, 5, 6, 7, 40])
def test_a_copy_goes_in_messages_a_receiver_takes_and_reads_as_one_sync(count: int) -> None:
    """A copy is joined a piece at a time (`PIECE_BYTES`) and sent as SYNC_PART messages of
    at most `COPY_MESSAGE` bytes of frames, then the SYNC (both small here): a follower
    reads the Sync whole; a member that does not know SYNC_PART refuses it, never taking
    part of a copy for all of it; parts of an abandoned copy are not taken into another."""
    from unittest import mock

    from tandem.broker.replication import core, wire

    frames = [records.frame(records.DEFINE, 1, n, b"copy %03d" % n) for n in range(1, count + 1)]
    size = len(frames[0]) if frames else 0
    sync = core.Sync("p", 2, (7, 1), 0, (), frames, ((1, 1), (2, 4)), count)
    with (
        mock.patch.object(wire, "PIECE_BYTES", 2 * size),
        mock.patch.object(wire, "COPY_MESSAGE", 4 * size),
    ):
        data = b"".join(wire.encode_parts(sync))
    messages = []
    while data:
        split = wire.split(data)
        assert split is not None
        messages.append(data[: split[1]])
        data = data[split[1] :]
    assert len(messages) == max(1, -(-count // 4))  # pieces of 2 frames, 2 pieces a message
    upstream = wire.Upstream()
    assert [upstream.take(m) for m in messages] == [None] * (len(messages) - 1) + [sync]
    if len(messages) > 1:
        with pytest.raises(wire.WireError, match="unknown message kind"):
            wire.decode(messages[0])
        other = core.Sync("p", 2, (7, 2), 0, (), frames[:1], ((1, 1),), 1)
        assert upstream.take(messages[0]) is None  # the first part of a copy given up
        assert upstream.take(wire.encode(other)) == other
    else:
        assert wire.decode(messages[0]) == sync


def test_recovery_drops_a_transaction_a_crash_cut_short(tmp_path: Path) -> None:
    """A group whose last record never reached the disk did not happen: recovery applies
    none of it and cuts it off, so that later records cannot complete it."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    define = records.define(
        "/", "queue.declare", {"name": "q", "durable": True, "auto_delete": False, "arguments": {}}
    )

    def enq(offset: int, more: bool) -> bytes:
        from tandem.broker.model.message import Message

        m = Message("", "q", b"\x00\x01q", b"\x10\x00\x02", b"x", 1)
        m.mid = offset
        return records.frame(records.ENQUEUE, 1, offset, records.enqueue("/", "q", m), True, more)

    whole = enq(2, True) + enq(3, False)
    cut = enq(4, True) + enq(5, True)
    seg = log_dir / f"{1:020d}.seg"
    seg.write_bytes(records.frame(records.DEFINE, 1, 1, define) + whole + cut)
    seq = Sequencer()
    broker = Broker(seq)
    loop = asyncio.new_event_loop()
    try:
        store = Store(tmp_path, fsync=False)
        seq.disk = store
        result = store.open(broker, seq, loop)
    finally:
        loop.close()
    q = broker.vhost("/").queues["q"]
    assert sorted(m.mid for m in q.messages) == [2, 3]
    assert seq.offset == 3 and result.truncated
    assert seg.stat().st_size == len(records.frame(records.DEFINE, 1, 1, define)) + len(whole)
    apply.done(broker)


def frame_before_crc32c(rtype: int, epoch: int, offset: int, payload: bytes) -> bytes:
    """A record as versions before 2026-11-28 framed it: magic "TL", zlib's CRC-32."""
    rest = records.REC_META.pack(rtype | records.DURABLE, epoch, offset) + payload
    return records.REC_HDR.pack(b"TL", len(rest), zlib.crc32(rest)) + rest


def test_records_are_checksummed_with_crc32c() -> None:
    assert records.crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert records.crc32c(b"6789", records.crc32c(b"12345")) == 0xE3069283
    big = os.urandom(70_000)
    for data in (
        records.frame(records.ENQUEUE, 2, 7, b"small"),
        records.frame(records.ENQUEUE, 2, 7, big),  # checksummed without joining first
        b"".join(records.frame_parts(records.ENQUEUE, 2, 7, [b"par", b"ts", big])),
    ):
        magic, length, crc = records.REC_HDR.unpack_from(data)
        assert magic == records.WRITTEN == b"TC" and length == len(data) - records.REC_HDR.size
        assert crc == records.crc32c(data[records.REC_HDR.size :])


def test_records_written_before_crc32c_are_read_and_checked() -> None:
    """A log (or a copy) an earlier version wrote is read as it was; a damaged old record
    is still found, and reading goes on at the next record of either kind."""
    old = frame_before_crc32c(records.DEFINE, 1, 1, b"old")
    new = records.frame(records.DEFINE, 2, 2, b"new")
    found, end, corrupt, torn = records.scan(old + new)
    assert found == [(records.DEFINE, 1, 1, b"old"), (records.DEFINE, 2, 2, b"new")]
    assert (end, corrupt, torn) == (len(old) + len(new), [], False)
    damaged = bytearray(old)
    damaged[-1] ^= 0xFF
    after = frame_before_crc32c(records.DEFINE, 1, 3, b"old again")
    found, _end, corrupt, _torn = records.scan(bytes(damaged) + after + new)
    assert [r[2] for r in found] == [3, 2]
    assert [c.reason for c in corrupt] == ["checksum mismatch"]
    # The same bytes under the other magic do not check out: the magic names the checksum.
    assert records.problem_at(b"TC" + old[2:], 0) == "checksum mismatch"


def test_without_the_c_extension_records_are_written_with_zlibs_crc32() -> None:
    """google-crc32c's pure-Python fallback takes 18 ms for 64 KiB: a node without its C
    extension writes records of the earlier kind, and still reads both."""
    probe = """
import google_crc32c
google_crc32c.implementation = "python"  # as where no wheel or compiler gave the extension
from tandem.broker.model import records
assert not records.CRC32C_IN_C and records.WRITTEN == b"TL"
old = records.frame(records.DEFINE, 1, 1, b"x" * 9000) + b"".join(
    records.frame_parts(records.DEFINE, 1, 2, [b"y"])
)
found, end, corrupt, torn = records.scan(old + b"TC" + old[2:20])
assert [r[2] for r in found] == [1, 2] and not corrupt and torn, (found, corrupt)
print("ok")
"""
    env = {**os.environ, "TANDEM_PURE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "ok", out.stderr


def test_a_store_written_before_crc32c_recovers_and_goes_on(tmp_path: Path) -> None:
    """A data dir an earlier version wrote opens with its messages; what this version adds
    to the same segment is read back beside them."""
    from tandem.broker.model.message import Message

    log_dir = tmp_path / "log"
    log_dir.mkdir()
    define = records.define(
        "/", "queue.declare", {"name": "q", "durable": True, "auto_delete": False, "arguments": {}}
    )
    m = Message("", "q", b"\x00\x01q", b"\x10\x00\x02", b"old body", 8)
    m.mid = 2
    seg = log_dir / f"{1:020d}.seg"
    seg.write_bytes(
        frame_before_crc32c(records.DEFINE, 1, 1, define)
        + frame_before_crc32c(records.ENQUEUE, 1, 2, records.enqueue("/", "q", m))
    )
    seen: list[tuple[list[str], list[bytes]]] = []

    async def run(declare: str | None) -> None:
        seq = Sequencer()
        broker = Broker(seq)
        store = Store(tmp_path, fsync=False)
        seq.disk = store
        result = store.open(broker, seq, asyncio.get_running_loop())
        try:
            assert not result.corrupt and not result.truncated
            vhost = broker.vhost("/")
            seen.append(
                (sorted(vhost.queues), [x.body_bytes() for x in vhost.queues["q"].messages])
            )
            if declare is not None:
                vhost.declare_queue(declare, durable=True)
                done = asyncio.get_running_loop().create_future()
                seq.when_done(lambda: done.set_result(None))
                await done
        finally:
            store.close()
            apply.done(broker)

    asyncio.run(run("new"))
    asyncio.run(run(None))
    assert seen == [(["q"], [b"old body"]), (["new", "q"], [b"old body"])]
    assert seg.read_bytes().count(b"TC") >= 1  # the new queue's record, in the same segment


def test_a_batch_written_by_writev_survives_short_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch goes to the kernel from the records' own buffers (no join); a writev that
    takes only part (a full disk's last bytes, a signal) is continued where it stopped."""
    from tandem.broker.store import log as log_mod

    real = os.writev
    calls = []

    def short(fd: int, buffers: list[memoryview]) -> int:
        calls.append(len(buffers))
        first = bytes(buffers[0])[:7] if buffers[0] else b""
        return real(fd, [first]) if first else 0

    monkeypatch.setattr(log_mod.os, "writev", short)
    parts = [b"a" * 20, b"", b"bc", bytes(range(256)) * 3]
    path = tmp_path / "segment"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        log_mod._write_all(fd, parts)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(parts)
    assert len(calls) > len(parts)  # it was continued, not given up


def test_large_bodies_written_as_parts_roll_segments_and_come_back_whole(
    tmp_path: Path,
) -> None:
    """64 KiB messages go to the log as parts (`records.frame_parts`): each segment still
    ends between records, the index names where each record begins, and a start reads every
    body back, byte for byte, in order."""
    from tandem.broker.model.message import Message

    bodies = [bytes([i]) * (64 * 1024) + str(i).encode() for i in range(12)]

    async def run(publish: bool) -> list[bytes]:
        seq = Sequencer()
        broker = Broker(seq)
        store = Store(tmp_path, fsync=False, segment_bytes=200_000)
        seq.disk = store
        store.open(broker, seq, asyncio.get_running_loop())
        try:
            vhost = broker.add_vhost("/") if publish else broker.vhost("/")
            if publish:
                q = vhost.declare_queue("q", durable=True)[0]
                for body in bodies:
                    msg = Message("", "q", b"\x00\x01q", b"\x10\x00\x02", body, len(body))
                    message.scan(msg)  # persistent: its properties say so
                    q.enqueue(msg)
                assert len(store.where.of("/", "q")) == len(bodies)
                done = asyncio.get_running_loop().create_future()
                seq.when_done(lambda: done.set_result(None))
                await done
                for mid, at in store.where.of("/", "q").items():
                    seg, pos = at >> log_mod.AT_BITS, at & log_mod.AT_MASK
                    data = store._path(seg).read_bytes()
                    assert records.problem_at(data, pos) is None
                    assert records.read_at(data, pos)[2] == records.mid_offset(mid)
            return [m.body_bytes() for m in vhost.queues["q"].messages]
        finally:
            store.close()
            apply.done(broker)

    assert asyncio.run(run(True)) == bodies
    assert len(list((tmp_path / "log").glob("*.seg"))) >= 3  # rolled, between records
    assert asyncio.run(run(False)) == bodies
