"""The log's record format and segment scanning, on files in a temp dir."""

from __future__ import annotations

from pathlib import Path

from tandem.broker.store import log


def write(path: Path, *records: bytes) -> None:
    path.write_bytes(b"".join(records))


def test_records_round_trip(tmp_path: Path) -> None:
    seg = tmp_path / "1.seg"
    write(
        seg,
        log.encode_record(log.DEFINE, 3, 10, b"a"),
        log.encode_record(log.ENQUEUE, 3, 11, b"bb"),
    )
    records, end, corrupt, torn = log.scan_segment(seg, last=True)
    assert records == [(log.DEFINE, 3, 10, b"a"), (log.ENQUEUE, 3, 11, b"bb")]
    assert (end, corrupt, torn) == (seg.stat().st_size, [], None)


def test_torn_tail_is_reported_on_the_last_segment(tmp_path: Path) -> None:
    seg = tmp_path / "1.seg"
    good = log.encode_record(log.DEFINE, 1, 1, b"ok")
    write(seg, good, log.encode_record(log.DEFINE, 1, 2, b"cut short")[:-3])
    records, _end, corrupt, torn = log.scan_segment(seg, last=True)
    assert [r[2] for r in records] == [1]
    assert torn == len(good) and corrupt == []


def test_corruption_in_the_middle_is_skipped_and_named(tmp_path: Path) -> None:
    seg = tmp_path / "1.seg"
    a = log.encode_record(log.DEFINE, 1, 1, b"first")
    b = bytearray(log.encode_record(log.DEFINE, 1, 2, b"second"))
    b[-1] ^= 0xFF
    c = log.encode_record(log.DEFINE, 1, 3, b"third")
    write(seg, a, bytes(b), c)
    records, _end, corrupt, torn = log.scan_segment(seg, last=True)
    assert [r[2] for r in records] == [1, 3]
    assert len(corrupt) == 1 and corrupt[0].offset == len(a)
    assert "checksum mismatch" in str(corrupt[0]) and str(seg) in str(corrupt[0])
    assert torn is None
