r"""A pika publisher that survives broker restarts and failovers without losing a message.

It publishes with publisher confirms, keeps every message until the broker confirms it, and
when the connection drops it reconnects (with backoff) and publishes the unconfirmed ones again.
Delivery is at-least-once: a message whose confirm was lost in the drop is sent twice, so give
messages an id (here `message_id`) and let consumers drop duplicates.

    python3 examples/reliable_publisher.py --url amqp://guest:guest@127.0.0.1:5672/%2F \
        --queue orders --count 1000
"""

from __future__ import annotations

import argparse
import os
import time

import pika
import pika.exceptions


def publish_all(url: str, queue: str, messages: dict[int, bytes], max_wait: float) -> int:
    """Publish every message until each is confirmed; returns how many reconnects it took."""
    pending = dict(messages)
    reconnects = 0
    delay = 0.1
    deadline = time.monotonic() + max_wait
    while pending:
        try:
            conn = pika.BlockingConnection(pika.URLParameters(url))
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare(queue, durable=True)
            delay = 0.1
            for msg_id in sorted(pending):
                ch.basic_publish(
                    "",
                    queue,
                    pending[msg_id],
                    pika.BasicProperties(
                        delivery_mode=pika.DeliveryMode.Persistent, message_id=str(msg_id)
                    ),
                )
                del pending[msg_id]  # basic_publish returned: the broker confirmed it
            conn.close()
        except (
            pika.exceptions.AMQPConnectionError,
            pika.exceptions.AMQPChannelError,
            pika.exceptions.StreamLostError,
        ) as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} messages still unconfirmed") from exc
            reconnects += 1
            print(
                f"connection lost ({exc.__class__.__name__}); {len(pending)} unconfirmed, "
                f"retrying in {delay:.1f}s",
                flush=True,
            )
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
    return reconnects


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--url",
        default=os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"),
        help="the broker (default: $AMQP_URL, else guest on 127.0.0.1:5672)",
    )
    ap.add_argument("--queue", default="orders")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--max-wait", type=float, default=120.0)
    args = ap.parse_args()
    messages = {i: f"order {i}".encode() for i in range(args.count)}
    reconnects = publish_all(args.url, args.queue, messages, args.max_wait)
    print(f"published {args.count} messages, all confirmed ({reconnects} reconnects)", flush=True)


if __name__ == "__main__":
    main()
