"""RPC over RabbitMQ's direct reply-to (`amq.rabbitmq.reply-to`): no reply queue to declare.

python3 examples/rpc.py server --url amqp://guest:guest@127.0.0.1:5672/%2F
python3 examples/rpc.py client --url amqp://guest:guest@127.0.0.1:5672/%2F 10
"""

from __future__ import annotations

import argparse
import os
import uuid

import pika

REPLY_TO = "amq.rabbitmq.reply-to"


def fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def serve(url: str, queue: str, limit: int) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.queue_declare(queue)
    served = 0

    def on_request(ch, method, props, body):  # type: ignore[no-untyped-def]
        nonlocal served
        ch.basic_publish(
            "",
            props.reply_to,
            str(fib(int(body))).encode(),
            pika.BasicProperties(correlation_id=props.correlation_id),
        )
        ch.basic_ack(method.delivery_tag)
        served += 1
        if limit and served >= limit:
            ch.stop_consuming()

    ch.basic_consume(queue, on_request)
    print("rpc server ready", flush=True)
    ch.start_consuming()
    conn.close()


def call(url: str, queue: str, n: int, timeout: float = 10.0) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    corr = str(uuid.uuid4())
    result: list[int] = []

    def on_reply(ch, method, props, body):  # type: ignore[no-untyped-def]
        if props.correlation_id == corr:
            result.append(int(body))

    ch.basic_consume(REPLY_TO, on_reply, auto_ack=True)
    ch.basic_publish(
        "", queue, str(n).encode(), pika.BasicProperties(reply_to=REPLY_TO, correlation_id=corr)
    )
    conn.process_data_events(time_limit=0)
    waited = 0.0
    while not result and waited < timeout:
        conn.process_data_events(time_limit=0.1)
        waited += 0.1
    conn.close()
    if not result:
        raise TimeoutError("no reply")
    return result[0]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("role", choices=["server", "client"])
    ap.add_argument("n", nargs="?", type=int, default=10)
    ap.add_argument(
        "--url",
        default=os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"),
        help="the broker (default: $AMQP_URL, else guest on 127.0.0.1:5672)",
    )
    ap.add_argument("--queue", default="rpc_queue")
    ap.add_argument("--limit", type=int, default=0, help="server: stop after this many calls")
    args = ap.parse_intermixed_args()
    if args.role == "server":
        serve(args.url, args.queue, args.limit)
    else:
        print(f"fib({args.n}) = {call(args.url, args.queue, args.n)}", flush=True)


if __name__ == "__main__":
    main()
