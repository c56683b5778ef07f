r"""A pika consumer: prefetch, manual acks, and duplicate-dropping by message id.

    python3 examples/consumer.py --url amqp://guest:guest@127.0.0.1:5672/%2F --queue orders \
        --expect 1000
"""

from __future__ import annotations

import argparse
import os

import pika


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
    ap.add_argument("--expect", type=int, default=0, help="stop after this many distinct ids")
    ap.add_argument("--idle", type=float, default=5.0, help="stop after this many idle seconds")
    args = ap.parse_args()
    conn = pika.BlockingConnection(pika.URLParameters(args.url))
    ch = conn.channel()
    ch.queue_declare(args.queue, durable=True)
    ch.basic_qos(prefetch_count=100)
    seen: set[str] = set()
    duplicates = 0
    for method, props, _body in ch.consume(args.queue, inactivity_timeout=args.idle):
        if method is None:
            break
        if props.message_id in seen:
            duplicates += 1
        seen.add(props.message_id)
        ch.basic_ack(method.delivery_tag)
        if args.expect and len(seen) >= args.expect:
            break
    ch.cancel()
    conn.close()
    print(f"received {len(seen)} distinct messages, {duplicates} duplicates dropped", flush=True)


if __name__ == "__main__":
    main()
