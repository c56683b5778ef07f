"""Queues deeper than memory: a lone node keeps a queue's head in memory and leaves the
persistent messages after it in the log, read back as the head runs out."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pika

from tests.integration.test_durability import consume_all, numbers, publish_confirmed
from tests.support import Broker

# A small budget and small segments: pages, segment rolls and compaction in a few thousand
# messages of 1 KiB.
SMALL = {"queue_memory_bytes": 64 * 1024, "segment_bytes": 256 * 1024}


def queue_status(broker: Broker, name: str) -> dict[str, int]:
    (q,) = [q for q in broker.status()["queues"] if q["name"] == name]
    return q


def segments(broker: Broker) -> list[Path]:
    return sorted((broker.data_dir / "log").glob("*.seg"))


def test_a_deep_queue_pages_and_is_consumed_in_order(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(SMALL)
    # 5 MiB: more segments than compaction keeps (16), so it carries the head's messages
    # forward, and leaves the segments the pages read from where they are.
    publish_confirmed(broker, "deep", 5000, size=1024)
    q = queue_status(broker, "deep")
    assert q["ready"] == 5000
    # About 50 messages fit the budget; nearly all the rest stays in the log.
    assert q["paged"] > 4500
    assert len(segments(broker)) > 16
    got = numbers(consume_all(broker, "deep"))
    assert got == list(range(5000))
    assert queue_status(broker, "deep")["paged"] == 0
    # Consumed, the log's segments go: one write after the acks lets compaction run.
    publish_confirmed(broker, "other", 1, size=10)
    assert len(segments(broker)) <= 2


def test_a_deep_queue_survives_kill_9_mid_consumption(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(SMALL)
    publish_confirmed(broker, "deep", 2000, size=1024)
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    for _ in range(700):  # through the head and into the pages
        m, _p, _b = ch.basic_get("deep")
        ch.basic_ack(m.delivery_tag)
    ch.queue_declare("deep", durable=True, passive=True)  # the acks were handled
    broker.kill()
    broker.start()
    q = queue_status(broker, "deep")
    assert q["ready"] == 1300
    assert q["paged"] > 1000  # recovery pages too: it does not take the whole queue in
    publish_confirmed(broker, "deep", 100, size=1024)  # after the recovered ones
    got = numbers(consume_all(broker, "deep"))
    assert got == list(range(700, 2000)) + list(range(100))


def test_a_deep_queue_with_consumers_keeps_order_across_pages(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(SMALL)
    publish_confirmed(broker, "deep", 1500, size=1024)
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=50)
    got: list[int] = []

    def on_message(ch, method, _props, body) -> None:  # type: ignore[no-untyped-def]
        got.append(int(body.rstrip(b".")))
        ch.basic_ack(method.delivery_tag)
        if len(got) == 1500:
            ch.stop_consuming()

    ch.basic_consume("deep", on_message)
    ch.start_consuming()
    conn.close()
    assert got == list(range(1500))


def test_a_deep_queue_is_purged_and_deleted_and_frees_its_log(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(SMALL)
    publish_confirmed(broker, "purged", 1500, size=1024)
    publish_confirmed(broker, "deleted", 1500, size=1024)
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    assert ch.queue_purge("purged").method.message_count == 1500
    assert ch.queue_delete("deleted").method.message_count == 1500
    conn.close()
    publish_confirmed(broker, "other", 1, size=10)
    assert len(segments(broker)) <= 2
    broker.restart()
    assert queue_status(broker, "purged")["ready"] == 0
    assert "deleted" not in [q["name"] for q in broker.status()["queues"]]


def test_transient_messages_in_a_deep_queue_stay_in_memory_in_their_place(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(SMALL)
    publish_confirmed(broker, "mixed", 500, size=1024)
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(500, 1000):
        mode = 1 if i % 3 == 0 else 2
        body = str(i).encode().ljust(1024, b".")
        ch.basic_publish("", "mixed", body, pika.BasicProperties(delivery_mode=mode))
    conn.close()
    assert numbers(consume_all(broker, "mixed")) == list(range(1000))


# Checkpoints every 500 durable records: restarts below load one and replay what follows it.
CHECKPOINTS = {**SMALL, "checkpoint_records": 500}


def recovered(broker: Broker) -> tuple[int, int]:
    """(messages the last start's checkpoint named, records it replayed), from its log."""
    line = [ln for ln in broker.log().splitlines() if "recovered" in ln][-1]
    named = re.search(r"a checkpoint naming (\d+)", line)
    replayed = re.search(r"then (\d+) records", line)
    assert replayed is not None, line
    return (int(named.group(1)) if named else -1), int(replayed.group(1))


def checkpoints_written(broker: Broker) -> int:
    """`tandem_checkpoint_seconds_count`, once it is above 0 (a checkpoint's file is written
    on the writer's thread, after the records it names), or 0 after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        code, text = broker.http("GET", "/metrics")
        assert code == 200
        line = next(x for x in text.splitlines() if x.startswith("tandem_checkpoint_seconds_count"))
        if float(line.split()[-1]) > 0 or time.monotonic() > deadline:
            return int(float(line.split()[-1]))
        time.sleep(0.05)  # polling /metrics


def test_a_restart_loads_a_checkpoint_and_replays_only_the_log_after_it(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(CHECKPOINTS)
    publish_confirmed(broker, "deep", 3000, size=1024)
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    for _ in range(1000):
        m, _p, _b = ch.basic_get("deep")
        ch.basic_ack(m.delivery_tag)
    m, _p, _b = ch.basic_get("deep")
    ch.basic_nack(m.delivery_tag, requeue=True)  # 1000 comes back redelivered
    ch.queue_declare("deep", durable=True, passive=True)
    conn.close()
    publish_confirmed(broker, "deep", 20, size=1024)
    assert checkpoints_written(broker) >= 1  # what an operator sees of them (/metrics)
    broker.kill()
    broker.start()
    named, replayed = recovered(broker)
    assert named > 0
    assert replayed < 4100  # the whole log is 3000 + 1000 + 1 + 20 records and more
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    m, _p, body = ch.basic_get("deep", auto_ack=True)
    assert (int(body.rstrip(b".")), m.redelivered) == (1000, True)
    conn.close()
    got = numbers(consume_all(broker, "deep"))
    assert got == list(range(1001, 3000)) + list(range(20))


def test_a_queue_left_alone_between_checkpoints_is_whole_after_kill_9(broker_factory) -> None:  # type: ignore[no-untyped-def]
    """While "busy" is published to and consumed, "deep" stays as it was: the checkpoints
    after the first name it by their part of that one (`Store.sections`), and "busy" anew
    each time. A start after kill -9 brings back both as they were."""
    broker = broker_factory(CHECKPOINTS)
    publish_confirmed(broker, "deep", 1200, size=1024)
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("busy", durable=True)
    persistent = pika.BasicProperties(delivery_mode=2)
    for i in range(1500):  # 3,000 records: checkpoints every 500
        ch.basic_publish("", "busy", str(i).encode(), persistent)
        if i % 3:  # one in three stays
            m, _p, _b = ch.basic_get("busy")
            ch.basic_ack(m.delivery_tag)
    ch.queue_declare("busy", durable=True, passive=True)  # answered once the acks are on disk
    conn.close()
    assert checkpoints_written(broker) >= 1
    broker.kill()
    broker.start()
    named, replayed = recovered(broker)
    assert named > 1200 and replayed < 3000
    assert numbers(consume_all(broker, "deep")) == list(range(1200))
    assert numbers(consume_all(broker, "busy")) == list(range(1000, 1500))


def test_a_clean_stop_checkpoints_and_the_next_start_replays_nothing(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(CHECKPOINTS)
    publish_confirmed(broker, "deep", 1200, size=1024)
    broker.restart()
    assert recovered(broker) == (1200, 0)
    assert numbers(consume_all(broker, "deep")) == list(range(1200))


def test_a_damaged_checkpoint_is_named_and_the_whole_log_replayed(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(CHECKPOINTS)
    publish_confirmed(broker, "deep", 1200, size=1024)
    broker.stop()
    checkpoint = broker.data_dir / "log" / "checkpoint"
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0xFF
    checkpoint.write_bytes(bytes(data))
    broker.start()
    assert "checkpoint" in broker.log() and "not used" in broker.log()
    assert recovered(broker)[0] == -1  # none used: the log replayed from its start
    assert numbers(consume_all(broker, "deep")) == list(range(1200))


def test_a_head_left_in_the_log_at_a_start_brings_back_none_consumed(broker_factory) -> None:  # type: ignore[no-untyped-def]
    """The head a checkpoint names is left in the log at the next start, read when the queue
    gets to it; its runs of the log also hold records of messages acked out of order, which
    must stay gone."""
    broker = broker_factory(CHECKPOINTS)
    publish_confirmed(broker, "deep", 1200, size=1024)
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    tags = [ch.basic_get("deep")[0].delivery_tag for _ in range(40)]
    for i, tag in enumerate(tags):
        if i % 2 == 0:
            ch.basic_ack(tag)
        else:
            ch.basic_nack(tag, requeue=True)
    ch.queue_declare("deep", durable=True, passive=True)
    conn.close()
    broker.restart()
    assert recovered(broker) == (1180, 0)
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    first = []
    for _ in range(20):
        m, _p, body = ch.basic_get("deep", auto_ack=True)
        first.append((int(body.rstrip(b".")), m.redelivered))
    conn.close()
    assert first == [(i, True) for i in range(1, 40, 2)]
    assert numbers(consume_all(broker, "deep")) == list(range(40, 1200))
