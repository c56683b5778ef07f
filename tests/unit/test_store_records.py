"""The log's record frame and scanning (`tandem.broker.model.records`), pure."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import subprocess
import sys
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

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
    loop = asyncio.new_event_loop()
    try:
        seq, broker, _, result = _opened(tmp_path, loop)
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


@pytest.mark.parametrize("extra", [-1, 0, 1, records.CRC_SLICE + 7])
@pytest.mark.parametrize("salt", [0, 0x5A17])
def test_a_record_larger_than_a_checksum_slice_is_checked_whole(extra: int, salt: int) -> None:
    """A record is checked a slice at a time (`CRC_SLICE`): not one 100 MiB copy of fresh
    memory for the C library. Damage in its first, middle or last byte is found."""
    payload = os.urandom(2 * records.CRC_SLICE + extra)
    data = bytearray(b"x" * 5 + records.frame(records.ENQUEUE, 2, 7, payload) + b"next")
    _magic, length, crc = records.REC_HDR.unpack_from(data, 5)
    if salt:  # a reused segment's record: its checksum salted
        records.REC_HDR.pack_into(data, 5, records.MAGIC_SALTED, length, crc ^ salt)
    assert records.problem_at(bytes(data), 5, salt) is None
    end = 5 + records.REC_HDR.size + length
    for at in (5 + records.REC_HDR.size, 5 + records.REC_HDR.size + records.CRC_SLICE, end - 1):
        damaged = bytearray(data)
        damaged[at] ^= 0x01
        assert records.problem_at(bytes(damaged), 5, salt) == "checksum mismatch"


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
        seq, broker, store, result = _opened(tmp_path, asyncio.get_running_loop())
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
        seq, broker, store, _ = _opened(tmp_path, asyncio.get_running_loop(), segment_bytes=200_000)
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


def test_a_reused_segment_reads_only_the_records_of_its_life() -> None:
    """A segment written over a spare holds its last life's records past its new end: plain
    ones, and ones salted with the number it had then. Read with its own salt, only the
    records salted with it count, and what follows them is its end; read as a plain
    segment, its salted records are not records at all."""
    now, before = records.salt(7), records.salt(5)
    assert now != before and records.salt(0) != 0

    def plain(i: int) -> bytes:
        return records.frame(records.DEFINE, 1, i, records.define("/", "q", {"i": i}))

    def salted(i: int, salt: int) -> bytes:
        return b"".join(records.salted(plain(i), salt))

    life = salted(10, now) + salted(11, now)
    stale = salted(3, before) + plain(1) + plain(2) + salted(4, before)
    found, end, corrupt, torn = records.scan(life + stale, salt=now)
    assert [r[2] for r in found] == [10, 11] and end == len(life) and torn and not corrupt
    assert records.scan(life, salt=now)[3] is False  # its end, nothing after it
    found, end, _corrupt, _torn = records.scan(life + stale)
    assert [r[2] for r in found] == [1, 2]  # as a plain segment: the plain records only
    # A body of a new life carries whole old records (a log shipped as a message): a plain
    # record inside it does not count in a reused segment, even past a torn record.
    inner = records.frame(records.ENQUEUE, 1, 12, plain(99) * 3)
    torn_new = b"".join(records.salted(inner, now))[: records.HEADER + 40]
    assert [r[2] for r in records.scan(life + torn_new + plain(99), salt=now)[0]] == [10, 11]


def test_a_frame_with_zlibs_checksum_is_salted_with_crc32c() -> None:
    """A primary without the C extension ships frames checked with zlib's CRC-32; a backup
    writing one into a reused segment salts its CRC-32C, which it computes."""
    payload = records.define("/", "q", {"x": 1}) * 1000  # large: the rest stays a view
    rest = records.REC_META.pack(records.DEFINE | records.DURABLE, 1, 5) + payload
    old = records.REC_HDR.pack(records.MAGIC_CRC32, len(rest), zlib.crc32(rest)) + rest
    parts = records.salted(old, records.salt(2))
    assert isinstance(parts[1], memoryview) and len(parts) == 2
    found = records.scan(b"".join(parts), salt=records.salt(2))[0]
    assert found == [(records.DEFINE, 1, 5, payload)]


def _big(i: int) -> bytes:
    return bytes([i % 251]) * (16 * 1024) + str(i).encode()


async def _churn(
    tmp_path: Path,
    count: int,
    at_end: Callable[[Store], Awaitable[None] | None],
    before: Callable[[Store, int], None] = lambda store, i: None,
    **config: Any,
) -> None:
    """Publish `count` 16 KiB messages into 100 KB segments, each consumed three behind
    the publisher, each step on disk before the next; `before(store, i)` before the i-th,
    `at_end(store)` (awaited, if it is a coroutine) before the close."""
    seq, broker, store, _ = _opened(
        tmp_path, asyncio.get_running_loop(), **{"segment_bytes": 100_000, **config}
    )
    store.retry_seconds = 0.01
    try:
        q = broker.add_vhost("/").declare_queue("q", durable=True)[0]
        for i in range(count):
            before(store, i)
            _put(broker, "q", i)
            if i >= 3:
                got = q.get(no_ack=True)
                assert got is not None
                q.settle_unacked_get(got)
            await _on_disk(seq)
        ending = at_end(store)
        if ending is not None:
            await ending
    finally:
        store.close()
        apply.done(broker)


def _opened(
    where: Path, loop: asyncio.AbstractEventLoop, stop_at_corrupt: bool = False, **config: Any
) -> tuple[Sequencer, Broker, Store, log_mod.Recovered]:
    """A broker on the store in `where`, opened as a node's start opens it (without fsync
    unless `config` says)."""
    seq = Sequencer()
    broker = Broker(seq)
    store = Store(where, **{"fsync": False, **config})
    seq.disk = store
    told = store.predict()
    checkpoint = (store.dir / "checkpoint").exists()
    recovered = store.open(broker, seq, loop, stop_at_corrupt=stop_at_corrupt)
    # What a restarted member tells its primary before it loads (`Store.predict`): its start
    # recovers exactly that, unless its checkpoint turned out unusable (it then says Hello
    # again), or it is not told.
    if told is not None and not (checkpoint and recovered.from_checkpoint is None):
        assert told == (seq.offset, seq.boundaries)
    return seq, broker, store, recovered


async def _on_disk(seq: Sequencer) -> None:
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    seq.when_done(lambda: done.set_result(None))
    await done


def _put(broker: Broker, queue: str, i: int) -> None:
    """A persistent 16 KiB message into durable queue `queue`, declared if need be."""
    q = broker.vhost("/").declare_queue(queue, durable=True)[0]
    route = len(queue).to_bytes(2, "big") + queue.encode()
    msg = Message("", queue, route, b"\x10\x00\x02", _big(i), len(_big(i)))
    message.scan(msg)  # persistent: its properties say so
    q.enqueue(msg)


def _reopened(
    where: Path, queues: tuple[str, ...] = ("q",), checkpoint: bool = False, **config: Any
) -> list[bytes]:
    """The bodies of `queues`, in order, taken from a store opened on `where` (a page read
    back as it is taken); no spare is left after its start, which used a `checkpoint`."""

    async def run() -> list[bytes]:
        _, broker, store, recovered = _opened(
            where, asyncio.get_running_loop(), **{"segment_bytes": 100_000, **config}
        )
        try:
            assert not list((where / "log").glob(f"*{log_mod.SPARE_SUFFIX}"))
            assert (recovered.from_checkpoint is not None) == checkpoint
            out = []
            for name in queues:
                q = broker.vhost("/").queues[name]
                while (msg := q.get(no_ack=True)) is not None:
                    out.append(msg.body_bytes())
            return out
        finally:
            store.close()
            apply.done(broker)

    return asyncio.run(run())


def test_consumed_segments_are_written_over_and_a_crash_brings_back_none_of_their_records(
    tmp_path: Path,
) -> None:
    """Large messages, small segments: consumed segments become spares, later segments are
    written over them, and a start after a crash (the log copied as it was, the last
    segment's old records still past its end, a spare beside it) holds exactly the messages
    left."""
    crashed = tmp_path / "crashed"

    def crash(store: Store) -> None:
        # The last segment is written over a spare, and that spare's records lie past its
        # end: the records a start must not take for its own.
        last = store._path(store.active).read_bytes()
        assert store._path(store.active).name.endswith(log_mod.REUSED_SUFFIX)
        assert records.MAGIC_SALTED in last[store.sizes[store.active] :]
        shutil.copytree(tmp_path / "log", crashed / "log")  # as kill -9 leaves it
        # A spare holding whole plain records, as one written into and not yet renamed
        # would hold its own: a start reads nothing of it.
        first = min(p for p in (crashed / "log").glob("*.seg"))
        shutil.copy(first, crashed / "log" / f"{999:020d}{log_mod.SPARE_SUFFIX}")

    asyncio.run(_churn(tmp_path, 60, crash))
    left = [_big(i) for i in range(57, 60)]
    assert _reopened(crashed) == left
    assert _reopened(tmp_path) == left


def test_a_spare_whose_rename_failed_becomes_its_segment_at_the_next_try(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spare written into becomes its segment by a rename once its records are on disk;
    a rename that fails fails the batch, which is written and renamed again. (Each spare's
    first rename fails, the last segment's among them.)"""
    real = os.rename
    failed: list[tuple[str, str]] = []

    def rename(src: str | Path, dst: str | Path) -> None:
        if str(src).endswith(log_mod.SPARE_SUFFIX) and (str(src), str(dst)) not in failed:
            failed.append((str(src), str(dst)))
            raise OSError(errno.EIO, "Input/output error")
        real(src, dst)

    def whole(store: Store) -> None:  # every segment is its file; every spare file a spare
        assert all(store._path(seg).exists() for seg in store.segments)
        spares = {int(p.stem) for p in store.dir.glob(f"*{log_mod.SPARE_SUFFIX}")}
        assert spares == set(store.spares)

    monkeypatch.setattr(os, "rename", rename)
    asyncio.run(_churn(tmp_path, 60, whole))
    assert len(failed) >= 4
    assert _reopened(tmp_path) == [_big(i) for i in range(57, 60)]


def _whole(store: Store) -> None:
    """Every segment is its file, holding each of its records once, up to where the store
    says it ends; every spare file is a spare the store knows."""
    for seg in store.segments:
        if seg not in store.sizes:
            continue  # nothing written to it yet
        data = store._path(seg).read_bytes()[: store.sizes[seg]]
        found, end, corrupt, _torn = records.scan(data, salt=store.salts.get(seg, 0))
        offsets = [r[2] for r in found if r[0] != records.SNAPSHOT]
        assert end == len(data) and not corrupt and len(offsets) == len(set(offsets))
    if store.inflight is None:  # no batch is being written: its deletes are done
        spares = {int(p.name[:20]) for p in store.dir.glob(f"*{log_mod.SPARE_SUFFIX}")}
        assert spares == set(store.spares)


def test_a_directory_fsync_that_fails_around_a_spare_writes_nothing_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory is fsynced after a spare becomes its segment (the batch fails until
    it is, and is written again from where it began) and after a consumed segment becomes
    a spare (its records are on disk: the spare is dropped, nothing written again)."""
    real = os.fsync
    failed: list[str] = []

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            names = sorted(p.name for p in (tmp_path / "log").iterdir())
            for kind in (log_mod.REUSED_SUFFIX, log_mod.SPARE_SUFFIX):
                new = [n for n in names if n.endswith(kind) and n not in failed]
                if new and not any(f.endswith(kind) for f in failed[-1:]):
                    failed.extend(new)
                    raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    asyncio.run(_churn(tmp_path, 60, _whole, lambda store, i: _whole(store), fsync=True))
    assert any(f.endswith(log_mod.REUSED_SUFFIX) for f in failed)
    assert any(f.endswith(log_mod.SPARE_SUFFIX) for f in failed)
    assert _reopened(tmp_path) == [_big(i) for i in range(57, 60)]


def test_a_flipped_bit_in_a_segments_first_record_loses_that_record_only(
    tmp_path: Path,
) -> None:
    """Whether a segment was written over is in its name, not in bytes that can rot: a
    plain segment whose first record's magic reads as a salted one's ("TC" and "TS" are a
    bit apart) loses that record, and the rest of the segment is read as before."""
    asyncio.run(_churn(tmp_path, 6, lambda store: None, segment_bytes=40_000))
    second = sorted((tmp_path / "log").glob("*.seg"))[1]
    data = bytearray(second.read_bytes())
    assert data[:2] == records.MAGIC
    data[1] ^= ord("C") ^ ord("S")
    second.write_bytes(bytes(data))
    assert _reopened(tmp_path) == [_big(i) for i in range(3, 6)]


def test_pages_checkpoints_and_carried_records_are_read_with_their_segments_salt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every reader of a segment written over uses its salt: compaction carrying a stuck
    message forward out of one, a checkpoint naming records in them (its resume point
    among them), and a queue paged out and read back from them."""
    now = [0.0]

    def tick() -> float:  # compaction's patience with a stuck message is over at once
        now[0] += 100.0
        return now[0]

    async def end(store: Store) -> None:
        assert store.broker is not None and store.sequencer is not None
        while len(deep) < 4 or store.active not in store.salts:  # the resume point in one
            assert len(deep) < 40, "no segment was written over"
            deep.append(1000 + len(deep))
            _put(store.broker, "deep", deep[-1])
            await _on_disk(store.sequencer)
        assert store.loop is not None
        written: asyncio.Future[float] = store.loop.create_future()
        store.checkpoint_seconds = written.set_result
        store.checkpoint()
        await written
        _whole(store)

    deep: list[int] = []

    def stuck(store: Store, i: int) -> None:  # into a segment written over
        if i == 30:
            assert store.broker is not None and store.active in store.salts
            _put(store.broker, "stuck", 500)

    with caplog.at_level("INFO", logger="tandem.broker.store.log"):
        asyncio.run(
            _churn(
                tmp_path / "log-of",
                90,
                end,
                stuck,
                checkpoint_records=10,
                max_segments=3,
                clock=tick,
                segment_bytes=150_000,  # nine a segment: carried once eight are consumed
            )
        )
    assert "compaction: carried 1 live messages" in caplog.text
    want = [_big(500), *(_big(i) for i in deep), *(_big(i) for i in range(87, 90))]
    # A restarted member tells its primary its end before it loads, from the checkpoint's
    # resume point on, in a segment written over as well (`Store.predict`).
    told = Store(tmp_path / "log-of", checkpoint_records=10, segment_bytes=150_000).predict()
    assert told is not None and told[0] > 0
    for page_bytes in (0, 1):  # held in memory; paged, and read back as they are taken
        copy = tmp_path / f"paged-{page_bytes}"
        shutil.copytree(tmp_path / "log-of", copy)
        queues = ("stuck", "deep", "q")
        got = _reopened(copy, queues, True, page_bytes=page_bytes, checkpoint_records=10)
        assert got == want


def test_segments_set_aside_leave_no_salt_to_the_numbers_written_again(tmp_path: Path) -> None:
    """A cluster member that stops at a corrupt record sets the later segments aside and
    goes on from the cut one: the numbers of those set aside are written again, as plain
    segments (a start has no spares), and read again as such, whole."""

    def hold(store: Store, i: int) -> None:  # a message never consumed keeps the segments
        if i == 40 and store.broker is not None:
            _put(store.broker, "held", 1000)

    asyncio.run(_churn(tmp_path, 60, lambda store: None, hold))
    paths = sorted((tmp_path / "log").glob("*.seg"))
    reused = [k for k in range(1, len(paths)) if paths[k].name.endswith(log_mod.REUSED_SUFFIX)]
    assert reused, [p.name for p in paths]
    data = bytearray(paths[reused[0] - 1].read_bytes())
    data[len(data) // 2] ^= 0xFF  # a body in the middle of the segment before one reused
    paths[reused[0] - 1].write_bytes(bytes(data))

    async def go_on() -> list[str]:
        seq, broker, store, recovered = _opened(
            tmp_path, asyncio.get_running_loop(), stop_at_corrupt=True, segment_bytes=100_000
        )
        try:
            for i in range(100, 120):  # past the number set aside, and the next
                _put(broker, "q", i)
                await _on_disk(seq)
            return recovered.set_aside
        finally:
            store.close()
            apply.done(broker)

    set_aside = asyncio.run(go_on())
    assert any(p.endswith(log_mod.REUSED_SUFFIX + ".bad") for p in set_aside)
    assert _reopened(tmp_path)[-20:] == [_big(i) for i in range(100, 120)]
