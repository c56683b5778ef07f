"""Connection negotiation, limits, heartbeats and bad input, over a raw socket and pika."""

from __future__ import annotations

import contextlib
import socket
import struct

import pika
import pika.exceptions
import pytest
from pamqp import commands, frame

from tests.support import Broker, RawClient


def assert_other_connections_work(broker: Broker) -> None:
    c = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = c.channel()
    ch.queue_declare("still-alive")
    ch.basic_publish("", "still-alive", b"ok")
    assert ch.basic_get("still-alive", auto_ack=True)[2] == b"ok"
    c.close()


def connection_close(client: RawClient) -> commands.Connection.Close:
    close = client.expect(commands.Connection.Close)
    client.send_method(0, commands.Connection.CloseOk())
    return close


def test_wrong_protocol_header_gets_the_supported_one_then_close(broker: Broker) -> None:
    c = RawClient(broker.amqp_port)
    c.send(b"AMQP\x01\x01\x00\x0a")
    assert c.recv_raw(8) == b"AMQP\x00\x00\x09\x01"
    assert c.closed()
    c = RawClient(broker.amqp_port)
    c.send(b"GET / HTTP/1.1\r\n\r\n")
    assert c.recv_raw(8) == b"AMQP\x00\x00\x09\x01"
    assert c.closed()
    assert_other_connections_work(broker)


def test_failed_login_is_403_connection_close(broker: Broker) -> None:
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as err:
        pika.BlockingConnection(pika.URLParameters(broker.url(password="wrong")))
    assert "ACCESS_REFUSED" in str(err.value)
    c = RawClient(broker.amqp_port)
    c.send(b"AMQP\x00\x00\x09\x01")
    c.expect(commands.Connection.Start)
    c.send_method(
        0,
        commands.Connection.StartOk(
            mechanism="PLAIN", response="\x00guest\x00nope", locale="en_US"
        ),
    )
    close = connection_close(c)
    assert close.reply_code == 403
    assert "guest" not in close.reply_text or "nope" not in close.reply_text
    assert "nope" not in broker.log()  # the password never reaches the log
    assert_other_connections_work(broker)


def test_amqplain_login(broker: Broker) -> None:
    from pamqp import encode

    c = RawClient(broker.amqp_port)
    c.send(b"AMQP\x00\x00\x09\x01")
    c.expect(commands.Connection.Start)
    table = encode.field_table({"LOGIN": "guest", "PASSWORD": "guest"})[4:]
    c.send_method(
        0,
        commands.Connection.StartOk(
            mechanism="AMQPLAIN", response=table.decode("latin-1"), locale="en_US"
        ),
    )
    tune = c.expect(commands.Connection.Tune)
    assert tune.frame_max == 131072


def test_unknown_vhost_is_refused(broker: Broker) -> None:
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as err:
        pika.BlockingConnection(pika.URLParameters(broker.url(vhost="nowhere")))
    assert "530" in str(err.value) and "vhost nowhere not found" in str(err.value)


def test_frame_max_negotiation_and_oversized_frame(broker: Broker) -> None:
    c = RawClient(broker.amqp_port)
    c.handshake(frame_max=4096)
    c.open_channel()
    c.send(struct.pack(">BHI", 1, 1, 5000) + b"\x00" * 5000 + b"\xce")
    close = connection_close(c)
    assert close.reply_code == 501
    assert c.closed()
    assert_other_connections_work(broker)


def test_a_framing_error_closes_the_socket_and_what_follows_is_dropped(broker: Broker) -> None:
    """Nothing after a framing error can be read as frames: the broker says why and closes
    the socket, however much the client goes on sending, and holds none of it."""
    c = RawClient(broker.amqp_port)
    c.handshake(frame_max=4096)
    c.send(struct.pack(">BHI", 1, 0, 5000))  # a frame larger than frame_max, then junk
    with contextlib.suppress(OSError):  # the broker may close before all of it is sent
        for _ in range(64):
            c.send(b"\x00" * 65536)
    assert c.expect(commands.Connection.Close).reply_code == 501
    assert c.closed()
    assert_other_connections_work(broker)


def test_frame_max_too_small_is_refused(broker: Broker) -> None:
    c = RawClient(broker.amqp_port)
    c.send(b"AMQP\x00\x00\x09\x01")
    c.expect(commands.Connection.Start)
    c.send_method(0, commands.Connection.StartOk(mechanism="PLAIN", response="\x00guest\x00guest"))
    c.expect(commands.Connection.Tune)
    c.send_method(0, commands.Connection.TuneOk(0, 1024, 0))
    assert connection_close(c).reply_code == 530


def test_bad_frame_end_is_501(broker: Broker) -> None:
    c = RawClient(broker.amqp_port)
    c.handshake()
    c.send(frame.marshal(commands.Channel.Open(), 1)[:-1] + b"\x00")
    assert connection_close(c).reply_code == 501
    assert c.closed()


def test_unknown_frame_type_is_501(broker: Broker) -> None:
    c = RawClient(broker.amqp_port)
    c.handshake()
    c.send(struct.pack(">BHI", 9, 0, 0) + b"\xce")
    assert connection_close(c).reply_code == 501


def test_unknown_method_is_540(broker: Broker) -> None:
    c = RawClient(broker.amqp_port)
    c.handshake()
    c.open_channel()
    payload = struct.pack(">HH", 60, 999)
    c.send(struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce")
    assert connection_close(c).reply_code == 540
    assert_other_connections_work(broker)


def test_malformed_method_arguments_are_502(broker: Broker) -> None:
    c = RawClient(broker.amqp_port)
    c.handshake()
    c.open_channel()
    payload = struct.pack(">HH", 50, 10) + b"\x00\x00\xff"  # queue.declare, name cut short
    c.send(struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce")
    assert connection_close(c).reply_code == 502


def test_method_on_unopened_channel_is_504(broker: Broker) -> None:
    c = RawClient(broker.amqp_port)
    c.handshake()
    c.send_method(7, commands.Queue.Declare(queue="x"))
    assert connection_close(c).reply_code == 504


def test_channel_max_counts_open_channels_as_rabbitmq_does(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory({"channel_max": 4})
    c = RawClient(broker.amqp_port)
    c.handshake()
    for number in (65535, 5, 2, 9):  # any number, as long as at most 4 are open
        c.open_channel(number)
    c.send_method(65535, commands.Channel.Close(200, "bye", 0, 0))
    c.expect(commands.Channel.CloseOk)
    c.open_channel(3)  # a closed channel frees its place
    c.send_method(4, commands.Channel.Open())
    close = connection_close(c)
    assert close.reply_code == 530
    assert "number of channels opened (4) has reached the negotiated channel_max (4)" in (
        close.reply_text
    )


def test_content_header_without_publish_is_505(broker: Broker) -> None:
    from pamqp import header

    c = RawClient(broker.amqp_port)
    c.handshake()
    c.open_channel()
    c.send(frame.marshal(header.ContentHeader(0, 3, commands.Basic.Properties()), 1))
    assert connection_close(c).reply_code == 505


def test_body_without_header_is_505(broker: Broker) -> None:
    from pamqp import body

    c = RawClient(broker.amqp_port)
    c.handshake()
    c.open_channel()
    c.send(frame.marshal(body.ContentBody(b"abc"), 1))
    assert connection_close(c).reply_code == 505


def test_method_where_content_expected_is_505(broker: Broker) -> None:
    c = RawClient(broker.amqp_port)
    c.handshake()
    c.open_channel()
    c.send_method(1, commands.Basic.Publish(exchange="", routing_key="x"))
    c.send_method(1, commands.Queue.Declare(queue="x"))
    assert connection_close(c).reply_code == 505


def test_channel_method_on_channel_zero_is_503(broker: Broker) -> None:
    c = RawClient(broker.amqp_port)
    c.handshake()
    c.send_method(0, commands.Queue.Declare(queue="x"))
    assert connection_close(c).reply_code == 503


def test_frames_after_channel_error_are_ignored_until_close_ok(broker: Broker) -> None:
    c = RawClient(broker.amqp_port)
    c.handshake()
    c.open_channel()
    c.send_method(1, commands.Queue.Declare(queue="missing", passive=True))
    close = c.expect(commands.Channel.Close)
    assert close.reply_code == 404
    c.send_method(1, commands.Queue.Declare(queue="ignored"))  # ignored: channel is closing
    c.send_method(1, commands.Channel.CloseOk())
    c.open_channel(1)
    c.send_method(1, commands.Queue.Declare(queue="fresh"))
    assert c.expect(commands.Queue.DeclareOk).queue == "fresh"


def test_message_over_the_size_limit_is_refused(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory({"max_message_size": 1000})
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    ch.queue_declare("small")
    ch.basic_publish("", "small", b"x" * 2000)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("small", passive=True)
    assert err.value.reply_code == 406
    ch = conn.channel()
    ch.basic_publish("", "small", b"x" * 999)
    assert ch.queue_declare("small", passive=True).method.message_count == 1


def test_silent_peer_is_closed_after_missed_heartbeats(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory({"heartbeat": 1})
    c = RawClient(broker.amqp_port, timeout=10)
    c.handshake(heartbeat=1)
    # Say nothing: the broker sends heartbeats, then gives up after two intervals.
    kinds = []
    try:
        while True:
            _ch, value = c.recv_frame()
            kinds.append(type(value).__name__)
    except ConnectionError:
        pass
    assert "Heartbeat" in kinds
    assert "missed heartbeats" in broker.log()


def test_client_heartbeats_keep_the_connection(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory({"heartbeat": 1})
    conn = pika.BlockingConnection(pika.URLParameters(broker.url() + "?heartbeat=1"))
    conn.sleep(3.5)  # pika answers heartbeats while it sleeps; this is the time under test
    assert conn.is_open
    conn.channel().queue_declare("hb")
    conn.close()


def test_connection_limit(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory({"max_connections": 2})
    a = pika.BlockingConnection(pika.URLParameters(broker.url()))
    b = pika.BlockingConnection(pika.URLParameters(broker.url()))
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(pika.URLParameters(broker.url()))
    a.close()
    b.close()
    assert "connection limit 2 reached" in broker.log()


def test_client_that_stops_reading_does_not_hurt_others(broker: Broker) -> None:
    """A consumer that never reads: the broker stops writing to it and holds the messages."""
    slow = RawClient(broker.amqp_port)
    slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.handshake()
    slow.open_channel()
    slow.send_method(1, commands.Queue.Declare(queue="firehose"))
    slow.expect(commands.Queue.DeclareOk)
    slow.send_method(1, commands.Basic.Consume(queue="firehose", no_ack=True))
    slow.expect(commands.Basic.ConsumeOk)
    pub = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = pub.channel()
    body = b"z" * 65536
    for _ in range(400):  # 25 MiB, far more than the socket buffers hold
        ch.basic_publish("", "firehose", body)
    ch.queue_declare("firehose", passive=True)  # a round trip: all publishes were handled
    q = broker.queue("firehose")
    assert q["ready"] > 0, "the broker wrote everything to a client that reads nothing"
    assert_other_connections_work(broker)
    pub.close()
    slow.close()


def test_client_close_handshake(broker: Broker) -> None:
    c = RawClient(broker.amqp_port)
    c.handshake()
    c.send_method(0, commands.Connection.Close(200, "bye", 0, 0))
    c.expect(commands.Connection.CloseOk)
    assert c.closed()


def test_client_that_sends_but_never_reads_is_backpressured(broker: Broker) -> None:
    """Pipelined requests whose replies are never read: the broker stops reading them once
    its write buffer for that client is full, so its memory stays bounded."""
    c = RawClient(broker.amqp_port)
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.handshake()
    c.open_channel()
    request = frame.marshal(commands.Queue.Declare(queue="q" * 250, auto_delete=False), 1)
    batch = request * 1000
    c.sock.settimeout(2)
    sent = 0
    limit = 256 * 1024 * 1024  # far more than the broker's write buffer and socket buffers
    with pytest.raises(TimeoutError):
        while sent < limit:
            c.sock.sendall(batch)
            sent += len(batch)
    assert sent < 64 * 1024 * 1024, f"the broker kept reading: {sent} bytes accepted"
    assert_other_connections_work(broker)
    c.close()


def test_malformed_content_properties_are_406(broker: Broker) -> None:
    c = RawClient(broker.amqp_port)
    c.handshake()
    c.open_channel()
    c.send_method(1, commands.Queue.Declare(queue="props"))
    c.expect(commands.Queue.DeclareOk)
    c.send_method(1, commands.Basic.Publish(exchange="", routing_key="props"))
    # Headers and user-id flagged (fields the fast scan skips); the table inside is garbage.
    props = struct.pack(">H", 0x2010) + b"\x00\x00\x00\x0f\x01aA\x00\x00\x00\x08b\x01S\x00\x00\x00"
    payload = struct.pack(">HHQ", 60, 0, 0) + props
    c.send(struct.pack(">BHI", 2, 1, len(payload)) + payload + b"\xce")
    close = c.expect(commands.Channel.Close)
    assert close.reply_code == 406
    assert "malformed content properties" in close.reply_text
    assert_other_connections_work(broker)
