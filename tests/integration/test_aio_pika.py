"""The same broker through aio-pika (over aiormq) and pika's select adapter."""

from __future__ import annotations

import asyncio

import aio_pika
import pika
import pytest

from tests.support import Broker


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_aio_pika_confirms_consume_and_ack(broker: Broker) -> None:
    async def main() -> list[bytes]:
        conn = await aio_pika.connect_robust(broker.url())
        async with conn:
            ch = await conn.channel(publisher_confirms=True)
            q = await ch.declare_queue("aio", durable=True)
            for i in range(20):
                await ch.default_exchange.publish(
                    aio_pika.Message(
                        str(i).encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT
                    ),
                    routing_key="aio",
                )
            got = []
            async with q.iterator() as it:
                async for msg in it:
                    async with msg.process():
                        got.append(msg.body)
                    if len(got) == 20:
                        break
            return got

    assert run(main()) == [str(i).encode() for i in range(20)]


def test_aio_pika_topic_exchange_and_reject_to_dlx(broker: Broker) -> None:
    async def main() -> tuple[bytes, str]:
        conn = await aio_pika.connect(broker.url())
        async with conn:
            ch = await conn.channel()
            dlx = await ch.declare_exchange("aio-dlx", aio_pika.ExchangeType.FANOUT)
            dead = await ch.declare_queue("aio-dead")
            await dead.bind(dlx)
            ex = await ch.declare_exchange("aio-topic", aio_pika.ExchangeType.TOPIC)
            q = await ch.declare_queue("aio-t", arguments={"x-dead-letter-exchange": "aio-dlx"})
            await q.bind(ex, "orders.*")
            await ex.publish(aio_pika.Message(b"order-1"), routing_key="orders.new")
            msg = await q.get(timeout=5)
            await msg.reject(requeue=False)
            dmsg = await dead.get(timeout=5)
            await dmsg.ack()
            return dmsg.body, dmsg.headers["x-death"][0]["reason"]  # type: ignore[index]

    assert run(main()) == (b"order-1", "rejected")


def test_aio_pika_rpc_over_direct_reply_to(broker: Broker) -> None:
    async def main() -> bytes:
        conn = await aio_pika.connect(broker.url())
        async with conn:
            ch = await conn.channel()
            requests = await ch.declare_queue("aio-rpc")

            async def serve(msg: aio_pika.abc.AbstractIncomingMessage) -> None:
                async with msg.process():
                    await ch.default_exchange.publish(
                        aio_pika.Message(msg.body[::-1], correlation_id=msg.correlation_id),
                        routing_key=msg.reply_to or "",
                    )

            await requests.consume(serve)
            reply_q = await ch.get_queue("amq.rabbitmq.reply-to", ensure=False)
            fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

            async def on_reply(msg: aio_pika.abc.AbstractIncomingMessage) -> None:
                fut.set_result(msg.body)

            await reply_q.consume(on_reply, no_ack=True)
            await ch.default_exchange.publish(
                aio_pika.Message(b"olleh", reply_to="amq.rabbitmq.reply-to", correlation_id="1"),
                routing_key="aio-rpc",
            )
            return await asyncio.wait_for(fut, 10)

    assert run(main()) == b"hello"


def test_aio_pika_transactions(broker: Broker) -> None:
    async def main() -> int:
        conn = await aio_pika.connect(broker.url())
        async with conn:
            ch = await conn.channel(publisher_confirms=False)
            q = await ch.declare_queue("aio-tx", durable=True)
            async with ch.transaction():
                for i in range(3):
                    await ch.default_exchange.publish(aio_pika.Message(bytes([i])), "aio-tx")
            q = await ch.declare_queue("aio-tx", durable=True, passive=True)
            return q.declaration_result.message_count  # type: ignore[union-attr]

    assert run(main()) == 3


def test_pika_select_connection(broker: Broker) -> None:
    """pika's asynchronous adapter: publish with confirms, consume, ack, close."""
    received: list[bytes] = []
    confirms: list[int] = []
    state: dict[str, pika.channel.Channel] = {}

    def on_open(conn: pika.SelectConnection) -> None:
        conn.channel(on_open_callback=on_channel)

    def on_channel(ch: pika.channel.Channel) -> None:
        state["ch"] = ch
        ch.confirm_delivery(lambda frame: confirms.append(frame.method.delivery_tag))
        ch.queue_declare("sel", callback=on_declared)

    def on_declared(_frame: object) -> None:
        ch = state["ch"]
        ch.basic_consume("sel", on_message)
        for i in range(10):
            ch.basic_publish("", "sel", str(i).encode())

    def on_message(ch, method, _props, body):  # type: ignore[no-untyped-def]
        received.append(body)
        ch.basic_ack(method.delivery_tag)
        if len(received) == 10:
            ch.connection.close()

    conn = pika.SelectConnection(pika.URLParameters(broker.url()), on_open_callback=on_open)
    conn.ioloop.call_later(20, conn.ioloop.stop)
    conn.add_on_close_callback(lambda *a: conn.ioloop.stop())
    conn.ioloop.start()
    assert received == [str(i).encode() for i in range(10)]
    assert confirms and max(confirms) == 10


@pytest.mark.parametrize("n", [1, 3])
def test_pika_many_channels_interleaved(broker: Broker, n: int) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    chans = [conn.channel() for _ in range(n)]
    for i, ch in enumerate(chans):
        ch.queue_declare(f"il-{i}")
        ch.basic_publish("", f"il-{i}", f"c{i}".encode())
    for i, ch in enumerate(chans):
        assert ch.basic_get(f"il-{i}", auto_ack=True)[2] == f"c{i}".encode()
    conn.close()
