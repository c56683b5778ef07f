"""The log's record frame and scanning (`tandem.broker.model.records`), pure."""

from __future__ import annotations

from tandem.broker.model import records


def test_records_round_trip() -> None:
    data = records.frame(records.DEFINE, 3, 10, b"a") + records.frame(
        records.ENQUEUE, 3, 11, b"bb", durable=False
    )
    found, end, corrupt, torn = records.scan(data)
    assert found == [(records.DEFINE, 3, 10, b"a"), (records.ENQUEUE, 3, 11, b"bb")]
    assert (end, corrupt, torn) == (len(data), [], False)
    assert records.head(data) == (records.DEFINE, 3, 10, True)


def test_torn_tail_is_reported() -> None:
    good = records.frame(records.DEFINE, 1, 1, b"ok")
    found, end, corrupt, torn = records.scan(
        good + records.frame(records.DEFINE, 1, 2, b"cut short")[:-3]
    )
    assert [r[2] for r in found] == [1]
    assert torn and end == len(good) and corrupt == []


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
