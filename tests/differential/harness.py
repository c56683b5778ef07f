"""Runs sequences of the client surface against a real broker and compares its state before
and after a kill -9 and restart (see surface.py)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import seed as hypothesis_seed

from tests.differential import surface
from tests.support import BUG_PHRASE, Broker


class Differential(AssertionError):
    """The state a restart brought back differs from the state before it."""


def synced(broker: Broker, timeout: float = 10.0) -> None:
    """Wait until every record the node wrote is on disk: what the kill may then take away
    is nothing (acks are journaled asynchronously, and a kill right after one may undo it)."""
    deadline = time.monotonic() + timeout
    while True:
        store = broker.status()["store"]
        if store["synced"] >= store["position"]:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the log did not sync: {store}")
        time.sleep(0.01)  # polling the observed state


def state(broker: Broker) -> Any:
    code, body = broker.http("GET", "/api/state?durable=true")
    assert code == 200, body
    return body


def check(broker: Broker, vhost: str, ops: list[tuple[Any, ...]]) -> list[str]:
    """Run `ops` in a fresh vhost, then kill -9 and restart; returns the refusals met."""
    assert broker.http("PUT", f"/api/vhosts/{vhost}")[0] in (200, 201, 204)
    perm = {"configure": ".*", "write": ".*", "read": ".*"}
    assert broker.http("PUT", f"/api/permissions/{vhost}/guest", perm)[0] in (200, 201, 204)
    client = surface.Client(broker.url(vhost=vhost))
    for op in ops:
        client.run(op)
    client.close()  # unacked messages go back, flagged redelivered
    synced(broker)
    before = state(broker)
    broker.kill()
    broker.start()
    after = state(broker)
    diff = surface.difference(before, after)
    if diff:
        raise Differential(f"{len(diff)} difference(s) after kill -9: {diff[:8]}")
    return client.refused


# Sequences every run tries first (hypothesis's explicit examples): a durable queue and a
# binding whose tables hold every field type pika sends.
EXAMPLES: list[list[tuple[Any, ...]]] = [
    [
        ("declare_queue", "q0", True, False, False, {"x-custom": b"\x00bytes"}),
        ("declare_exchange", "x0", "headers", True, {}),
        ("bind", "q0", "x0", "", {"x-match": "any", "k": b"\x01", "d": surface.DECIMAL("2.5")}),
        ("publish", "x0", "", b"m", {"delivery_mode": 2, "headers": {"k": b"\x01"}}, False),
    ]
]


def run(root: Path, count: int, seed: int | None = None, shrink: bool = True) -> dict[str, int]:
    """`count` sequences against one broker; raises the shortest failing sequence's error
    (the first one found, without `shrink`). Returns figures: sequences, operations,
    refusals."""
    broker = Broker(root / "node").start()
    figures = {"sequences": 0, "operations": 0, "refused": 0}
    numbers = itertools.count()

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=list(Phase) if shrink else [Phase.explicit, Phase.generate],
    )
    @given(surface.sequences)
    def one(ops: list[tuple[Any, ...]]) -> None:
        refused = check(broker, f"d{next(numbers)}", ops)
        figures["sequences"] += 1
        figures["operations"] += len(ops)
        figures["refused"] += len(refused)

    for ops in EXAMPLES:
        one = example(ops)(one)
    test = hypothesis_seed(seed)(one) if seed is not None else one
    try:
        test()
    finally:
        if broker.proc is not None:
            broker.stop()
    assert BUG_PHRASE not in broker.log(), broker.log()[-3000:]
    return figures
