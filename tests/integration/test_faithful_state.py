"""Every change a real client makes survives a kill -9 exactly as it was made (issue 14): the
primary decides, the log records the decision, recovery makes it so without deciding again.
Each test is a case a client library does as a matter of course, which once broke the state."""

from __future__ import annotations

import datetime
import decimal

import pika
import pika.exceptions
import pytest

from tests import support
from tests.support import BUG_PHRASE, Broker

# Every AMQP field type a RabbitMQ user can put in an argument table.
TYPED_ARGS = {
    "x-bytes": b"\x00\xffraw",
    "x-decimal": decimal.Decimal("3.14"),
    "x-timestamp": datetime.datetime(2026, 11, 26, 12, 0, tzinfo=datetime.UTC),
    "x-table": {"nested": {"deeper": [1, "two", b"three", None, True]}},
    "x-array": [decimal.Decimal("1.5"), -7, "s"],  # pika sends no floats
    "x-bool": False,
    "x-void": None,
    "x-long": 2**40,
}


def channel(broker: Broker) -> tuple[pika.BlockingConnection, pika.adapters.blocking_connection]:
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    ch.confirm_delivery()
    return conn, ch


def test_a_durable_server_named_queue_survives_kill_9(broker: Broker) -> None:
    """The broker names it amq.gen-…, a name clients may not choose; recovery once refused
    it and the node never started again on that data dir."""
    conn, ch = channel(broker)
    name = ch.queue_declare("", durable=True).method.queue
    assert name.startswith("amq.gen-")
    ch.basic_publish("", name, b"kept", pika.BasicProperties(delivery_mode=2))
    conn.close()
    broker.kill()
    broker.start()
    conn, ch = channel(broker)
    assert ch.queue_declare(name, durable=True, passive=True).method.message_count == 1
    assert support.drain(conn, name) == [b"kept"]
    assert BUG_PHRASE not in broker.log()


def test_arguments_of_every_field_type_are_taken_and_survive_kill_9(broker: Broker) -> None:
    """Binary, decimal, timestamp and nested values once closed the connection with 541
    and left a queue in memory that no record described, its confirmed messages lost at
    the next restart."""
    conn, ch = channel(broker)
    ch.queue_declare("typed", durable=True, arguments={**TYPED_ARGS, "x-max-length": 10})
    ch.exchange_declare("typed-x", "headers", durable=True, arguments={"x-bytes": b"\x01"})
    ch.queue_bind("typed", "typed-x", arguments={"x-match": "all", "k": b"\x02"})
    headers = {"k": b"\x02", "when": TYPED_ARGS["x-timestamp"], "d": decimal.Decimal("1.5")}
    props = pika.BasicProperties(delivery_mode=2, headers=headers)
    ch.basic_publish("typed-x", "", b"routed by a binary header", props)
    conn.close()
    broker.kill()
    broker.start()
    conn, ch = channel(broker)
    # The same declaration is equivalent (nothing lost or changed type); another limit is not.
    ch.queue_declare("typed", durable=True, arguments={**TYPED_ARGS, "x-max-length": 10})
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        ch.queue_declare("typed", durable=True, arguments={**TYPED_ARGS, "x-max-length": 11})
    assert refused.value.reply_code == 406
    ch = conn.channel()
    _method, got, body = ch.basic_get("typed", auto_ack=True)
    assert body == b"routed by a binary header"
    assert got.headers == headers
    # The binding's binary argument still routes after recovery.
    ch.confirm_delivery()
    ch.basic_publish("typed-x", "", b"again", pika.BasicProperties(headers={"k": b"\x02"}))
    assert ch.basic_get("typed", auto_ack=True)[2] == b"again"
    conn.close()
    assert BUG_PHRASE not in broker.log()


def test_an_argument_no_amqp_field_holds_is_refused_and_changes_nothing(broker: Broker) -> None:
    """An invalid argument is refused at the edge with RabbitMQ's code, before any state
    changes: the queue does not exist afterwards, on this node or after a restart."""
    conn, ch = channel(broker)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        ch.queue_declare("bad", durable=True, arguments={"x-max-length": "ten"})
    assert refused.value.reply_code == 406
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        ch.queue_declare("bad", passive=True)
    conn.close()


def test_an_exclusive_durable_queue_is_gone_after_a_crash(broker: Broker) -> None:
    """Its owner's connection died with the process, so it is deleted, as RabbitMQ does;
    it once came back as an ordinary queue anyone could use."""
    conn, ch = channel(broker)
    ch.queue_declare("mine", durable=True, exclusive=True)
    ch.basic_publish("", "mine", b"x", pika.BasicProperties(delivery_mode=2))
    broker.kill()
    broker.start()
    conn, ch = channel(broker)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as gone:
        ch.queue_declare("mine", passive=True)
    assert gone.value.reply_code == 404
    ch = conn.channel()
    ch.queue_declare("mine", durable=True, exclusive=True)  # free to declare again
    conn.close()


def test_a_deleted_vhost_stays_deleted_after_a_crash(broker: Broker) -> None:
    assert broker.http("PUT", "/api/vhosts/staging")[0] in (200, 201, 204)
    assert broker.http(
        "PUT", "/api/permissions/staging/guest", {"configure": ".*", "write": ".*", "read": ".*"}
    )[0] in (200, 201, 204)
    conn = pika.BlockingConnection(pika.URLParameters(broker.url(vhost="staging")))
    ch = conn.channel()
    ch.exchange_declare("sx", "fanout", durable=True)
    ch.queue_declare("sq", durable=True)
    conn.close()
    assert broker.http("DELETE", "/api/vhosts/staging")[0] in (200, 204)
    broker.kill()
    broker.start()
    code, vhosts = broker.http("GET", "/api/vhosts")
    assert code == 200 and "staging" not in [v["name"] for v in vhosts]
    assert all(q["vhost"] != "staging" for q in broker.status()["queues"])


def test_a_vhost_deleted_and_made_again_is_there_after_a_crash(broker: Broker) -> None:
    """Found by the differential test: users, vhosts and permissions were kept only in
    auth.json, outside the log, so a restart replayed the older deletion over the newer
    creation and the vhost (with its permissions) was gone."""
    perm = {"configure": ".*", "write": ".*", "read": ".*"}
    for step in ("PUT", "DELETE", "PUT"):
        assert broker.http(step, "/api/vhosts/again")[0] in (200, 201, 204)
    assert broker.http("PUT", "/api/users/again-user", {"password": "p", "tags": ""})[0] == 201
    assert broker.http("PUT", "/api/permissions/again/again-user", perm)[0] == 201
    broker.kill()
    broker.start()
    assert "again" in [v["name"] for v in broker.http("GET", "/api/vhosts")[1]]
    conn = pika.BlockingConnection(pika.URLParameters(broker.url("again-user", "p", vhost="again")))
    assert conn.channel().queue_declare("", exclusive=True).method.queue
    conn.close()
