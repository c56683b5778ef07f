"""Restart, kill -9, torn tails, corrupt records, compaction and a full disk."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pika
import pytest
from pamqp import commands

from tests import support
from tests.support import Broker, RawClient


def publish_confirmed(
    broker: Broker,
    queue: str,
    n: int,
    persistent: bool = True,
    size: int = 100,
    durable: bool = True,
) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(queue, durable=durable)
    props = pika.BasicProperties(delivery_mode=2 if persistent else 1)
    for i in range(n):
        ch.basic_publish("", queue, str(i).encode().ljust(size, b"."), props)
    conn.close()


def consume_all(broker: Broker, queue: str) -> list[bytes]:
    return support.drain(pika.BlockingConnection(pika.URLParameters(broker.url())), queue)


def numbers(bodies: list[bytes]) -> list[int]:
    return [int(b.rstrip(b".")) for b in bodies]


def write_until_compacted(broker: Broker, done: Callable[[], bool]) -> None:
    """Publish and consume one small message at a time until `done()`: compaction runs
    after each write, and carries a segment once its live messages have stopped being
    consumed for store.CARRY_PATIENCE."""
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, broker.log()[-2000:]
        publish_confirmed(broker, "flow", 1, size=10)
        consume_all(broker, "flow")


def test_durable_state_survives_restart(broker: Broker) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    ch.exchange_declare("dx", "topic", durable=True)
    ch.queue_declare("dq", durable=True)
    ch.queue_bind("dq", "dx", "a.#")
    ch.queue_declare("transient-q", durable=False)
    ch.confirm_delivery()
    ch.basic_publish("dx", "a.b", b"persistent", pika.BasicProperties(delivery_mode=2))
    ch.basic_publish("dx", "a.b", b"transient", pika.BasicProperties(delivery_mode=1))
    conn.close()
    broker.restart()
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    ch.queue_declare("dq", durable=True, passive=True)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        ch.queue_declare("transient-q", passive=True)
    ch = conn.channel()
    ch.basic_publish("dx", "a.c", b"routed-after-restart", pika.BasicProperties(delivery_mode=2))
    assert consume_all(broker, "dq") == [b"persistent", b"routed-after-restart"]


def test_confirmed_messages_survive_kill_9(broker: Broker) -> None:
    publish_confirmed(broker, "k9", 500)
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    for _ in range(100):  # ack the first hundred
        m, _p, _b = ch.basic_get("k9")
        ch.basic_ack(m.delivery_tag)
    for _ in range(10):  # hold ten unacked when the broker dies
        ch.basic_get("k9")
    ch.queue_declare("k9", durable=True, passive=True)  # round trip: the acks were handled
    broker.kill()
    broker.start()
    got = numbers(consume_all(broker, "k9"))
    # Acks are not confirmed to the client, so an acked message may come back; none is lost.
    assert got == sorted(got)
    assert set(range(100, 500)) <= set(got)


def test_declarations_answered_before_kill_9_survive(broker: Broker) -> None:
    """A declare-ok or bind-ok for durable things is sent once their record is on disk."""
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    for i in range(20):
        ch.exchange_declare(f"kx{i}", "direct", durable=True)
        ch.queue_declare(f"kq{i}", durable=True)
        ch.queue_bind(f"kq{i}", f"kx{i}", "k")
    broker.kill()  # right after the last bind-ok
    broker.start()
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(20):
        ch.basic_publish(f"kx{i}", "k", b"x", mandatory=True)  # unroutable would raise
    assert all(broker.queue(f"kq{i}")["depth"] == 1 for i in range(20))


def test_log_position_is_stable_across_restarts(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory({"segment_bytes": 16 * 1024})  # rolls segments: snapshots too
    publish_confirmed(broker, "pos", 200)
    before = broker.status()["position"]
    for _ in range(2):
        broker.restart()
        assert broker.status()["position"] == before
    publish_confirmed(broker, "pos", 1)
    assert broker.status()["position"] > before


def test_each_life_that_writes_is_a_new_epoch(broker: Broker) -> None:
    # A restarted node starts a new term, so a record it writes can never share
    # (epoch, offset) with one an earlier life wrote and lost.
    epochs = []
    for _ in range(3):
        publish_confirmed(broker, "ep", 1)
        epochs.append(broker.status()["epoch"])
        broker.restart()
    assert epochs[1] == epochs[0] + 1 and epochs[2] == epochs[1] + 1
    lines = (broker.data_dir / "log" / "epochs").read_text().splitlines()
    assert [int(line.split()[0]) for line in lines] == epochs


def test_acked_messages_stay_gone_after_clean_restart(broker: Broker) -> None:
    publish_confirmed(broker, "gone", 20)
    assert len(consume_all(broker, "gone")) == 20
    broker.restart()
    assert consume_all(broker, "gone") == []


def test_torn_tail_is_cut_and_the_rest_recovered(broker: Broker) -> None:
    publish_confirmed(broker, "torn", 50)
    broker.stop()
    seg = sorted((broker.data_dir / "log").glob("*.seg"))[-1]
    size = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(b"TC\x00\x00\x01\x00garbage-of-a-half-written-record")
    broker.start()
    assert numbers(consume_all(broker, "torn")) == list(range(50))
    assert "cutting a torn tail" in broker.log()
    assert seg.stat().st_size >= size


def test_corrupt_record_is_named_and_the_rest_recovered(broker: Broker) -> None:
    publish_confirmed(broker, "corrupt", 30)
    broker.stop()
    seg = sorted((broker.data_dir / "log").glob("*.seg"))[-1]
    data = bytearray(seg.read_bytes())
    # Flip a byte inside the body of the 10th message's record.
    marker = data.find(b"9" + b"." * 20)
    assert marker > 0
    data[marker + 5] ^= 0xFF
    seg.write_bytes(bytes(data))
    broker.start()
    got = numbers(consume_all(broker, "corrupt"))
    assert got == [i for i in range(30) if i != 9]
    log = broker.log()
    assert "corrupt record in the log, skipped" in log
    assert str(seg) in log and "at byte" in log


def test_consumed_messages_are_reclaimed(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory({"segment_bytes": 64 * 1024})
    log_dir = broker.data_dir / "log"
    for _ in range(6):
        publish_confirmed(broker, "churn", 300, size=1000)
        assert len(consume_all(broker, "churn")) == 300
    publish_confirmed(broker, "churn", 1, size=10)  # a write after the acks lets compaction run
    total = sum(p.stat().st_size for p in log_dir.glob("*.seg"))
    assert total < 6 * 300 * 1000 / 4, f"log holds {total} bytes for 1 live message"
    broker.restart()
    assert len(consume_all(broker, "churn")) == 1


def test_segments_written_over_bring_back_nothing_consumed_after_kill_9(broker_factory) -> None:  # type: ignore[no-untyped-def]
    """Large messages: a consumed segment is kept and the log writes over it later, not a
    new file. Killed with a segment half written over, the broker comes back with exactly
    the messages left: the records of that segment's last life, past its end, name messages
    consumed since, in segments deleted since, and stay gone."""
    broker = broker_factory({"segment_bytes": 256 * 1024})
    support.churn_behind(broker.url(), "churn", 100)
    assert broker.status()["store"]["segments_written_over"] >= 4
    broker.kill()
    broker.start()
    assert numbers(consume_all(broker, "churn")) == [97, 98, 99]


def test_deleting_a_queue_frees_its_messages_in_the_log(broker: Broker) -> None:
    publish_confirmed(broker, "doomed", 50)
    publish_confirmed(broker, "kept", 5)
    assert broker.status()["store"]["live_messages"] == 55
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    conn.channel().queue_delete("doomed")
    conn.close()
    assert broker.status()["store"]["live_messages"] == 5
    broker.restart()
    assert broker.status()["store"]["live_messages"] == 5
    assert len(consume_all(broker, "kept")) == 5


def test_compaction_carries_old_live_messages_forward(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory({"segment_bytes": 32 * 1024})
    publish_confirmed(broker, "stuck", 3, size=100)  # stays in the oldest segment
    for _ in range(8):
        publish_confirmed(broker, "flow", 200, size=1000)
        assert len(consume_all(broker, "flow")) == 200
    write_until_compacted(broker, lambda: len(list((broker.data_dir / "log").glob("*.seg"))) <= 17)
    broker.kill()
    broker.start()
    assert numbers(consume_all(broker, "stuck")) == [0, 1, 2]


def test_compaction_carries_a_requeued_messages_redelivered_flag_forward(broker_factory) -> None:  # type: ignore[no-untyped-def]
    """The flag is a record of its own (a durable MARK) beside the message's enqueue; a
    compaction that carried only the enqueue forward once lost it."""
    broker = broker_factory({"segment_bytes": 32 * 1024})
    publish_confirmed(broker, "stuck", 2, size=100)
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    method, _props, _body = ch.basic_get("stuck")
    ch.basic_nack(method.delivery_tag, requeue=True)
    conn.close()
    for _ in range(8):
        publish_confirmed(broker, "flow", 200, size=1000)
        assert len(consume_all(broker, "flow")) == 200
    write_until_compacted(broker, lambda: "compaction: carried 2 live messages" in broker.log())
    broker.kill()
    broker.start()
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    flags = []
    for _ in range(2):
        method, _props, _body = ch.basic_get("stuck", auto_ack=True)
        flags.append(method.redelivered)
    conn.close()
    assert flags == [True, False]


def test_a_segment_larger_than_a_turns_chunk_is_carried_over_several_turns(broker_factory) -> None:  # type: ignore[no-untyped-def]
    """Compaction carries a segment larger than store.CARRY_BYTES (1 MiB) forward a chunk a
    turn: a 64 MiB segment carried at once held every member's loop for two seconds, and the
    controller failed the primary over. Live messages before, after and across a chunk's
    end (one larger than a chunk) come through a kill -9 whole and in order."""
    broker = broker_factory({"segment_bytes": 3 * 1024 * 1024})
    publish_confirmed(broker, "stuck", 2, size=100)
    publish_confirmed(broker, "big", 1, size=1536 * 1024)
    publish_confirmed(broker, "stuck-after", 3, size=300 * 1024)
    # Consumed in the same segment: compaction carries a segment once few of its are live.
    publish_confirmed(broker, "flow", 200, size=1000)
    assert len(consume_all(broker, "flow")) == 200
    for _ in range(20):
        publish_confirmed(broker, "flow", 6, size=512 * 1024)
        assert len(consume_all(broker, "flow")) == 6
    carrying = "compaction: carried 6 live messages out of segment"
    write_until_compacted(broker, lambda: carrying in broker.log())
    carried = r"carried 6 live messages out of segment \d+ \(\d+ bytes, in [2-9] turns\)"
    assert re.search(carried, broker.log())
    broker.kill()
    broker.start()
    assert numbers(consume_all(broker, "stuck")) == [0, 1]
    assert [len(b) for b in consume_all(broker, "big")] == [1536 * 1024]
    assert numbers(consume_all(broker, "stuck-after")) == [0, 1, 2]


@pytest.fixture
def tiny_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_holds_confirms_and_loses_nothing(tiny_disk: Path, tmp_path: Path) -> None:
    filler = tiny_disk / "filler"
    filler.write_bytes(b"\0" * (2 * 1024 * 1024))
    broker = Broker(tiny_disk / "node", {"disk_free_limit": 0}, log_dir=tmp_path)
    broker.start()
    try:
        c = RawClient(broker.amqp_port, timeout=10)
        c.handshake()
        c.open_channel()
        c.send_method(1, commands.Confirm.Select())
        c.expect(commands.Confirm.SelectOk)
        c.send_method(1, commands.Queue.Declare(queue="full", durable=True))
        c.expect(commands.Queue.DeclareOk)
        n = 150
        for i in range(n):  # 150 x 10 KB: more than the 1 MB left
            c.publish(
                1,
                "",
                "full",
                str(i).encode().ljust(10_000, b"."),
                commands.Basic.Properties(delivery_mode=2),
            )
        acked = 0
        c.sock.settimeout(3)
        blocked = False
        try:
            while acked < n:
                _ch, f = c.recv_frame()
                if isinstance(f, commands.Basic.Ack):
                    acked = f.delivery_tag if f.multiple else acked + 1
                elif isinstance(f, commands.Connection.Blocked):
                    blocked = True
        except TimeoutError:
            pass
        assert acked < n, "the broker confirmed messages it could not write"
        assert blocked
        assert "cannot write the log" in broker.log()
        filler.unlink()  # room again: the held records are written and confirmed
        c.sock.settimeout(15)
        unblocked = False
        while acked < n or not unblocked:
            _ch, f = c.recv_frame()
            if isinstance(f, commands.Basic.Ack):
                acked = f.delivery_tag if f.multiple else acked + 1
            elif isinstance(f, commands.Connection.Unblocked):
                unblocked = True
        c.close()
        broker.kill()
        broker.start()
        assert numbers(consume_all(broker, "full")) == list(range(n))
    finally:
        broker.stop()
        os.sync()
