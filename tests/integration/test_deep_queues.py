"""Queues deeper than memory: a lone node keeps a queue's head in memory and leaves the
persistent messages after it in the log, read back as the head runs out."""

from __future__ import annotations

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
