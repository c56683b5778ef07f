"""The protocol surface through pika's blocking adapter against a real broker process."""

from __future__ import annotations

from collections.abc import Iterator

import pika
import pika.exceptions
import pytest

from tests.support import Broker


@pytest.fixture
def conn(broker: Broker) -> Iterator[pika.BlockingConnection]:
    c = pika.BlockingConnection(pika.URLParameters(broker.url()))
    yield c
    if c.is_open:
        c.close()


def barrier(conn: pika.BlockingConnection, ch, queue: str) -> None:  # type: ignore[no-untyped-def]
    """A round trip on the channel: every frame the broker sent before its reply has
    arrived, and pika has dispatched it."""
    ch.queue_declare(queue, passive=True)
    conn.process_data_events(time_limit=0)


def drain(ch, queue: str, n: int, ack: bool = True) -> list[bytes]:  # type: ignore[no-untyped-def]
    got = []
    for method, _props, body in ch.consume(queue, inactivity_timeout=5):
        assert method is not None, f"only {len(got)} of {n} arrived"
        got.append(body)
        if ack:
            ch.basic_ack(method.delivery_tag)
        if len(got) == n:
            break
    ch.cancel()
    return got


def test_server_properties_advertise_rabbitmq_capabilities(conn: pika.BlockingConnection) -> None:
    caps = conn._impl.server_capabilities
    for cap in (
        "publisher_confirms",
        "basic.nack",
        "consumer_cancel_notify",
        "exchange_exchange_bindings",
        "connection.blocked",
        "authentication_failure_close",
        "per_consumer_qos",
    ):
        assert caps.get(cap) is True, cap


def test_default_exchange_publish_and_consume(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("work")
    for i in range(10):
        ch.basic_publish("", "work", f"m{i}".encode())
    assert drain(ch, "work", 10) == [f"m{i}".encode() for i in range(10)]


@pytest.mark.parametrize(
    ("kind", "binding", "key", "routed"),
    [
        ("direct", "k1", "k1", True),
        ("direct", "k1", "k2", False),
        ("fanout", "", "anything", True),
        ("topic", "a.*.c", "a.b.c", True),
        ("topic", "a.*.c", "a.b.b.c", False),
        ("topic", "a.#", "a", True),
        ("topic", "#.c", "a.b.c", True),
        ("topic", "*", "", False),
    ],
)
def test_exchange_routing(
    conn: pika.BlockingConnection, kind: str, binding: str, key: str, routed: bool
) -> None:
    ch = conn.channel()
    ch.exchange_declare("ex", kind)
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, "ex", binding)
    ch.basic_publish("ex", key, b"x")
    method, _p, _b = ch.basic_get(q, auto_ack=True)
    assert (method is not None) is routed


@pytest.mark.parametrize(
    ("match", "headers", "routed"),
    [
        ("all", {"a": 1, "b": "x"}, True),
        ("all", {"a": 1}, False),
        ("any", {"a": 1}, True),
        ("any", {"c": 1}, False),
    ],
)
def test_headers_exchange(
    conn: pika.BlockingConnection, match: str, headers: dict, routed: bool
) -> None:
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, "amq.headers", arguments={"x-match": match, "a": 1, "b": "x"})
    ch.basic_publish("amq.headers", "", b"h", pika.BasicProperties(headers=headers))
    assert (ch.basic_get(q, auto_ack=True)[0] is not None) is routed


def test_exchange_to_exchange_binding_and_unbind(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.exchange_declare("up", "fanout")
    ch.exchange_declare("down", "direct")
    ch.exchange_bind("down", "up")
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, "down", "k")
    ch.basic_publish("up", "k", b"via-e2e")
    assert ch.basic_get(q, auto_ack=True)[2] == b"via-e2e"
    ch.exchange_unbind("down", "up")
    ch.basic_publish("up", "k", b"gone")
    assert ch.basic_get(q, auto_ack=True)[0] is None


def test_alternate_exchange(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.exchange_declare("ae", "fanout")
    ch.exchange_declare("main", "direct", arguments={"alternate-exchange": "ae"})
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, "ae")
    ch.basic_publish("main", "unrouted", b"to-ae")
    assert ch.basic_get(q, auto_ack=True)[2] == b"to-ae"


def test_exchange_declare_passive_delete_if_unused_and_internal(
    conn: pika.BlockingConnection,
) -> None:
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.exchange_declare("missing", passive=True)
    assert err.value.reply_code == 404
    ch = conn.channel()
    ch.exchange_declare("used", "fanout")
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, "used")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.exchange_delete("used", if_unused=True)
    assert err.value.reply_code == 406
    ch = conn.channel()
    ch.exchange_declare("inner", "fanout", internal=True)
    ch.basic_publish("inner", "", b"x")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("after-internal")
    assert err.value.reply_code == 403
    ch = conn.channel()
    ch.exchange_delete("used")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        ch.exchange_declare("used", passive=True)


def test_reserved_names_are_refused(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.exchange_declare("amq.mine", "direct")
    assert err.value.reply_code == 403
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("amq.q")
    assert err.value.reply_code == 403


def test_redeclare_with_other_properties_is_406_and_connection_survives(
    conn: pika.BlockingConnection,
) -> None:
    ch = conn.channel()
    ch.queue_declare("stable", durable=True)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("stable", durable=False)
    assert err.value.reply_code == 406
    ch = conn.channel()
    ch.exchange_declare("ex1", "direct")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.exchange_declare("ex1", "fanout")
    assert err.value.reply_code == 406
    ch = conn.channel()
    ch.queue_declare("stable", durable=True, arguments={"x-unknown-thing": 1})
    assert conn.is_open


def test_server_named_exclusive_queue_is_locked_to_its_connection(broker: Broker) -> None:
    a = pika.BlockingConnection(pika.URLParameters(broker.url()))
    b = pika.BlockingConnection(pika.URLParameters(broker.url()))
    q = a.channel().queue_declare("", exclusive=True).method.queue
    assert q.startswith("amq.gen-")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        b.channel().basic_consume(q, lambda *a: None)
    assert err.value.reply_code == 405
    a.close()
    ch = b.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare(q, passive=True)
    assert err.value.reply_code == 404  # deleted with its connection
    b.close()


def test_queue_purge_and_delete_conditions(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("p")
    for _ in range(3):
        ch.basic_publish("", "p", b"x")
    assert ch.queue_purge("p").method.message_count == 3
    ch.basic_publish("", "p", b"x")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_delete("p", if_empty=True)
    assert err.value.reply_code == 406
    ch = conn.channel()
    ch.basic_consume("p", lambda *a: None)
    ch2 = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch2.queue_delete("p", if_unused=True)
    assert err.value.reply_code == 406
    ch2 = conn.channel()
    assert ch2.queue_delete("p").method.message_count == 0  # the one message went to ch


def test_auto_delete_queue_goes_with_its_last_consumer(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("ad", auto_delete=True)
    tag = ch.basic_consume("ad", lambda *a: None)
    ch.basic_cancel(tag)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        ch.queue_declare("ad", passive=True)


def test_ack_nack_reject_requeue_and_redelivered_flag(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("r")
    for i in range(4):
        ch.basic_publish("", "r", str(i).encode())
    tags = []
    for _ in range(4):
        m, _p, _b = ch.basic_get("r")
        assert not m.redelivered
        tags.append(m.delivery_tag)
    ch.basic_reject(tags[0], requeue=True)
    ch.basic_ack(tags[1])
    ch.basic_nack(tags[3], multiple=True, requeue=True)  # the third and the fourth
    got = []
    while True:
        m, _p, body = ch.basic_get("r")
        if m is None:
            break
        assert m.redelivered
        got.append(body)
        ch.basic_ack(m.delivery_tag)
    assert sorted(got) == [b"0", b"2", b"3"]


def test_nack_without_requeue_drops(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("drop")
    ch.basic_publish("", "drop", b"x")
    m, _p, _b = ch.basic_get("drop")
    ch.basic_nack(m.delivery_tag, requeue=False)
    assert ch.queue_declare("drop", passive=True).method.message_count == 0


def test_unknown_delivery_tag_is_406_channel_error(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.basic_ack(999)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("after")
    assert err.value.reply_code == 406
    assert conn.channel().queue_declare("after").method.queue == "after"


def test_closing_a_channel_requeues_unacked_in_order(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("rq")
    for i in range(5):
        ch.basic_publish("", "rq", str(i).encode())
    for _ in range(5):
        ch.basic_get("rq")
    ch.close()
    ch = conn.channel()
    got = [ch.basic_get("rq", auto_ack=True)[2] for _ in range(5)]
    assert got == [b"0", b"1", b"2", b"3", b"4"]


def test_basic_recover_requeues(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("rec")
    ch.basic_publish("", "rec", b"x")
    ch.basic_get("rec")
    ch.basic_recover(requeue=True)
    m, _p, _b = ch.basic_get("rec", auto_ack=True)
    assert m.redelivered


def test_prefetch_per_consumer_limits_unacked(
    conn: pika.BlockingConnection, broker: Broker
) -> None:
    ch = conn.channel()
    ch.queue_declare("pf")
    for _ in range(10):
        ch.basic_publish("", "pf", b"x")
    ch.basic_qos(prefetch_count=3)
    seen = []
    ch.basic_consume("pf", lambda c, m, p, b: seen.append(m.delivery_tag))
    barrier(conn, ch, "pf")
    assert len(seen) == 3
    q = broker.queue("pf")
    assert (q["ready"], q["unacked"]) == (7, 3)
    ch.basic_ack(seen[-1], multiple=True)
    barrier(conn, ch, "pf")
    assert len(seen) == 6


def test_global_prefetch_and_prefetch_size_refused(broker: Broker) -> None:
    c = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = c.channel()
    ch.basic_qos(prefetch_count=2, global_qos=True)
    ch.queue_declare("g1")
    ch.queue_declare("g2")
    for q in ("g1", "g2"):
        for _ in range(3):
            ch.basic_publish("", q, b"x")
    seen = []
    ch.basic_consume("g1", lambda *a: seen.append(1))
    ch.basic_consume("g2", lambda *a: seen.append(2))
    barrier(c, ch, "g1")
    assert len(seen) == 2
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as err:
        ch.basic_qos(prefetch_size=10)
    assert err.value.reply_code == 540


def test_consumer_tags_exclusive_consume_and_cancel(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("ex-c")
    tag = ch.basic_consume("ex-c", lambda *a: None, exclusive=True, consumer_tag="mine")
    assert tag == "mine"
    ch2 = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch2.basic_consume("ex-c", lambda *a: None)
    assert err.value.reply_code == 403
    ch.basic_cancel("mine")
    ch3 = conn.channel()
    ch3.basic_consume("ex-c", lambda *a: None)


def test_consumer_cancel_notification_when_queue_deleted(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("doomed")
    cancelled = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    tag = ch.basic_consume("doomed", lambda *a: None)
    other = conn.channel()
    other.queue_delete("doomed")  # the cancel was sent before delete-ok
    conn.process_data_events(time_limit=0)
    assert cancelled == [tag]


def test_mandatory_unroutable_is_returned_with_312(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError) as err:
        ch.basic_publish("amq.direct", "nobody", b"x", mandatory=True)
    returned = err.value.messages[0]
    assert returned.method.reply_code == 312
    assert returned.body == b"x"


def test_basic_get_empty(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("empty")
    assert ch.basic_get("empty") == (None, None, None)


def test_publisher_confirms(conn: pika.BlockingConnection, broker: Broker) -> None:
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("dur", durable=True)
    for i in range(50):
        ch.basic_publish("", "dur", str(i).encode(), pika.BasicProperties(delivery_mode=2))
    ch.basic_publish("", "no-such-queue", b"unroutable-but-confirmed")
    assert broker.queue("dur")["depth"] == 50


def test_reject_publish_overflow_nacks(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("full", arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    ch.basic_publish("", "full", b"1")
    ch.basic_publish("", "full", b"2")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", "full", b"3")


def test_max_length_drop_head_and_bytes(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("ml", arguments={"x-max-length": 2})
    for i in range(5):
        ch.basic_publish("", "ml", str(i).encode())
    assert [ch.basic_get("ml", auto_ack=True)[2] for _ in range(2)] == [b"3", b"4"]
    ch.queue_declare("mlb", arguments={"x-max-length-bytes": 10})
    for i in range(4):
        ch.basic_publish("", "mlb", b"abcd" + str(i).encode())  # 5 bytes each
    assert [ch.basic_get("mlb", auto_ack=True)[2] for _ in range(2)] == [b"abcd2", b"abcd3"]


def test_dead_lettering_on_reject_with_x_death(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.exchange_declare("dlx", "fanout")
    ch.queue_declare("dead")
    ch.queue_bind("dead", "dlx")
    ch.queue_declare(
        "live", arguments={"x-dead-letter-exchange": "dlx", "x-dead-letter-routing-key": "rk2"}
    )
    ch.basic_publish("", "live", b"bye", pika.BasicProperties(headers={"keep": "me"}))
    m, _p, _b = ch.basic_get("live")
    ch.basic_reject(m.delivery_tag, requeue=False)
    m, props, body = ch.basic_get("dead", auto_ack=True)
    assert body == b"bye"
    assert m.routing_key == "rk2"
    death = props.headers["x-death"][0]
    assert death["reason"] == "rejected"
    assert death["queue"] == "live"
    assert death["count"] == 1
    assert props.headers["keep"] == "me"


def test_message_ttl_expires_to_dead_letter(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("expired")
    ch.queue_declare(
        "ttl",
        arguments={
            "x-message-ttl": 50,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "expired",
        },
    )
    ch.basic_publish("", "ttl", b"short")
    ch.basic_publish("", "ttl", b"per-message", pika.BasicProperties(expiration="20"))
    got = drain(ch, "expired", 2)
    assert sorted(got) == [b"per-message", b"short"]
    assert ch.queue_declare("ttl", passive=True).method.message_count == 0


def test_per_message_expiration_zero_and_invalid(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("exp0")
    ch.basic_publish("", "exp0", b"x", pika.BasicProperties(expiration="0"))
    assert ch.queue_declare("exp0", passive=True).method.message_count == 0
    ch.basic_publish("", "exp0", b"x", pika.BasicProperties(expiration="soon"))
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("exp0", passive=True)
    assert err.value.reply_code == 406


def test_queue_expires_when_unused(conn: pika.BlockingConnection, broker: Broker) -> None:
    ch = conn.channel()
    ch.queue_declare("idle", arguments={"x-expires": 100})
    ch.queue_declare("kept")
    # Poll the admin API (declaring would count as use); the sweep runs every second.
    for _ in range(60):
        names = {q["name"] for q in broker.status()["queues"]}
        assert "kept" in names
        if "idle" not in names:
            return
        conn.process_data_events(time_limit=0.1)
    pytest.fail("queue with x-expires was never deleted")


def test_priority_queue_serves_highest_first(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("prio", arguments={"x-max-priority": 5})
    for p in (1, 5, 0, 3, 9):
        ch.basic_publish("", "prio", str(p).encode(), pika.BasicProperties(priority=p))
    got = [ch.basic_get("prio", auto_ack=True)[2] for _ in range(5)]
    assert got == [b"5", b"9", b"3", b"1", b"0"]  # 9 is capped at the max level, 5, FIFO


def test_invalid_queue_arguments_are_406(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("bad", arguments={"x-max-length": -1})
    assert err.value.reply_code == 406
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("bad", arguments={"x-overflow": "explode"})
    assert err.value.reply_code == 406


def test_transactions_commit_and_rollback(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("txq", durable=True)
    ch.tx_select()
    ch.basic_publish("", "txq", b"rolled-back", pika.BasicProperties(delivery_mode=2))
    ch.tx_rollback()
    ch.basic_publish("", "txq", b"committed", pika.BasicProperties(delivery_mode=2))
    other = conn.channel()
    assert other.queue_declare("txq", passive=True).method.message_count == 0
    ch.tx_commit()
    assert other.basic_get("txq", auto_ack=True)[2] == b"committed"
    assert other.basic_get("txq")[0] is None


def test_tx_acks_apply_on_commit(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("txa")
    ch.basic_publish("", "txa", b"x")
    ch.tx_select()
    m, _p, _b = ch.basic_get("txa")
    ch.basic_ack(m.delivery_tag)
    ch.tx_rollback()
    ch.close()
    ch = conn.channel()
    m, _p, _b = ch.basic_get("txa")  # rolled-back ack: the message is back
    assert m is not None
    ch.tx_select()
    ch.basic_ack(m.delivery_tag)
    ch.tx_commit()
    ch.close()
    assert conn.channel().queue_declare("txa", passive=True).method.message_count == 0


def test_confirm_and_tx_do_not_mix(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.tx_select()
    assert err.value.reply_code == 406


def test_direct_reply_to_rpc(conn: pika.BlockingConnection) -> None:
    server = conn.channel()
    server.queue_declare("rpc")

    def on_request(ch, method, props, body):  # type: ignore[no-untyped-def]
        ch.basic_publish(
            "",
            props.reply_to,
            body.upper(),
            pika.BasicProperties(correlation_id=props.correlation_id),
        )
        ch.basic_ack(method.delivery_tag)

    server.basic_consume("rpc", on_request)
    client = conn.channel()
    replies = []
    client.basic_consume(
        "amq.rabbitmq.reply-to",
        lambda c, m, p, b: replies.append((p.correlation_id, b)),
        auto_ack=True,
    )
    client.basic_publish(
        "",
        "rpc",
        b"hello",
        pika.BasicProperties(reply_to="amq.rabbitmq.reply-to", correlation_id="c1"),
    )
    for _ in range(50):
        if replies:
            break
        conn.process_data_events(time_limit=0.1)
    assert replies == [("c1", b"HELLO")]


def test_direct_reply_to_needs_a_reply_consumer(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("rpc2")
    ch.basic_publish("", "rpc2", b"x", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to"))
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("rpc2", passive=True)
    assert err.value.reply_code == 406


def test_channel_flow_pauses_deliveries(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("flow")
    ch._impl.flow(False, lambda active: None)
    seen = []
    ch.basic_consume("flow", lambda *a: seen.append(1), auto_ack=True)
    ch.basic_publish("", "flow", b"x")
    barrier(conn, ch, "flow")
    assert seen == []
    ch._impl.flow(True, lambda active: None)
    barrier(conn, ch, "flow")
    assert seen == [1]


def test_large_message_streams_through_in_frames(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("big")
    body = bytes(range(256)) * (40 * 1024 * 1024 // 256)  # 40 MiB
    ch.basic_publish("", "big", body)
    _m, _p, got = ch.basic_get("big", auto_ack=True)
    assert got == body


def test_large_and_small_deliveries_keep_their_bytes_and_order(
    conn: pika.BlockingConnection,
) -> None:
    """Large bodies go to the socket beside the joined small frames around them (writev):
    a consumer still sees every body whole and in order, across the size where that
    starts, and over the frame size."""
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    sizes = [0, 10, 8191, 8192, 8193, 65536, 10, 300_000, 1, 131_064, 131_065, 7]
    bodies = [bytes([i]) * size for i, size in enumerate(sizes)]
    for body in bodies:
        ch.basic_publish("", q, body)
    got = []
    for _method, _props, body in ch.consume(q, auto_ack=True, inactivity_timeout=5):
        assert body is not None, f"got {len(got)} of {len(bodies)} deliveries"
        got.append(body)
        if len(got) == len(bodies):
            break
    ch.cancel()
    assert [len(b) for b in got] == sizes
    assert got == bodies


def test_queue_unbind(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, "amq.direct", "k")
    ch.queue_unbind(q, "amq.direct", "k")
    ch.basic_publish("amq.direct", "k", b"x")
    assert ch.basic_get(q, auto_ack=True)[0] is None


def test_auto_delete_exchange_goes_with_its_last_binding(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.exchange_declare("ad-ex", "fanout", auto_delete=True)
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, "ad-ex")
    ch.queue_unbind(q, "ad-ex")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.exchange_declare("ad-ex", passive=True)
    assert err.value.reply_code == 404


def test_declare_ok_counts_messages_and_consumers(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("counts")
    for _ in range(3):
        ch.basic_publish("", "counts", b"x")
    other = conn.channel()
    other.basic_qos(prefetch_count=1)
    other.basic_consume("counts", lambda *a: None)
    barrier(conn, other, "counts")
    ok = ch.queue_declare("counts", passive=True).method
    assert (ok.message_count, ok.consumer_count) == (2, 1)


@pytest.mark.filterwarnings("ignore:This command is deprecated:DeprecationWarning")
def test_recover_async_requeues(broker: Broker) -> None:
    from pamqp import commands

    from tests.support import RawClient

    c = RawClient(broker.amqp_port)
    c.handshake()
    c.open_channel()
    c.send_method(1, commands.Queue.Declare(queue="ra"))
    c.expect(commands.Queue.DeclareOk)
    c.publish(1, "", "ra", b"x")
    c.send_method(1, commands.Basic.Get(queue="ra"))
    assert not c.expect(commands.Basic.GetOk).redelivered
    c.send_method(1, commands.Basic.RecoverAsync(requeue=True))
    c.send_method(1, commands.Basic.Get(queue="ra"))
    assert c.expect(commands.Basic.GetOk).redelivered


def test_user_id_must_be_the_authenticated_user(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("uid")
    ch.basic_publish("", "uid", b"ok", pika.BasicProperties(user_id="guest"))
    assert ch.basic_get("uid", auto_ack=True)[1].user_id == "guest"
    ch.basic_publish("", "uid", b"forged", pika.BasicProperties(user_id="admin"))
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("uid", passive=True)
    assert err.value.reply_code == 406


def test_unknown_exchange_type_is_503(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as err:
        ch.exchange_declare("plugin", "x-delayed-message")
    assert err.value.reply_code == 503


def test_immediate_publish_is_540(broker: Broker) -> None:
    from pamqp import commands

    from tests.support import RawClient

    c = RawClient(broker.amqp_port)
    c.handshake()
    c.open_channel()
    c.send_method(1, commands.Basic.Publish(exchange="", routing_key="x", immediate=True))
    close = c.expect(commands.Connection.Close)
    assert close.reply_code == 540


def test_queue_names_outside_the_spec_charset_work_as_in_rabbitmq(
    conn: pika.BlockingConnection,
) -> None:
    ch = conn.channel()
    name = "заказы/état ✓"
    assert ch.queue_declare(name).method.queue == name
    ch.basic_publish("", name, b"utf-8")
    assert ch.basic_get(name, auto_ack=True)[2] == b"utf-8"


def test_reject_publish_dlx_nacks_and_dead_letters(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("overflowed")
    ch.queue_declare(
        "bounded",
        arguments={
            "x-max-length": 1,
            "x-overflow": "reject-publish-dlx",
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "overflowed",
        },
    )
    ch.basic_publish("", "bounded", b"fits")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", "bounded", b"refused")
    _m, props, body = ch.basic_get("overflowed", auto_ack=True)
    assert body == b"refused"
    assert props.headers["x-death"][0]["reason"] == "maxlen"


def test_single_active_consumer(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.queue_declare("sac", arguments={"x-single-active-consumer": True})
    got: dict[str, list[bytes]] = {"a": [], "b": []}
    ch.basic_consume("sac", lambda c, m, p, b: got["a"].append(b), auto_ack=True, consumer_tag="a")
    ch.basic_consume("sac", lambda c, m, p, b: got["b"].append(b), auto_ack=True, consumer_tag="b")
    for i in range(6):
        ch.basic_publish("", "sac", str(i).encode())
    barrier(conn, ch, "sac")
    assert (len(got["a"]), got["b"]) == (6, [])
    ch.basic_cancel("a")
    for i in range(6, 9):
        ch.basic_publish("", "sac", str(i).encode())
    barrier(conn, ch, "sac")
    assert got["b"] == [b"6", b"7", b"8"]
