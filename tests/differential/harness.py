"""Runs sequences of the client surface against a real broker and compares its state before
and after a kill -9 and restart (see surface.py)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import seed as hypothesis_seed

from tests.differential import surface
from tests.support import BUG_PHRASE, Broker, LocalCluster, http


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


def _prepare(http: Any, vhost: str) -> None:
    assert http("PUT", f"/api/vhosts/{vhost}", None)[0] in (200, 201, 204)
    perm = {"configure": ".*", "write": ".*", "read": ".*"}
    assert http("PUT", f"/api/permissions/{vhost}/guest", perm)[0] in (200, 201, 204)


def check(broker: Broker, vhost: str, ops: list[tuple[Any, ...]]) -> list[str]:
    """Run `ops` in a fresh vhost, then kill -9 and restart; returns the refusals met."""
    _prepare(broker.http, vhost)
    client = surface.Client(broker.url(vhost=vhost), vhost, broker.http)
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
    _done(broker.http, vhost)
    return client.refused


def _done(http: Any, vhost: str) -> None:
    """The sequence's vhost goes once compared, so that the state (and each comparison)
    stays as small as one sequence's, however many run; the next comparison checks that
    the deletion held."""
    assert http("DELETE", f"/api/vhosts/{vhost}", None)[0] in (200, 204)


# What every backup holds too: not the queues replicated `none` (only the primary has them) nor
# the messages of those replicated `configuration`.
REPLICATED = "/api/state?replicated=true"


def _positions(ports: dict[str, int]) -> dict[str, Any]:
    return {n: http(port, "GET", "/status")[1].get("position") for n, port in ports.items()}


def member_states(cluster: LocalCluster, timeout: float = 30.0) -> tuple[str, dict[str, Any]]:
    """Every member's state at one position: waits until each is in the ISR at the primary's
    position, dumps them all, and takes the dumps only if no position moved meanwhile. Returns
    the primary's name and the dumps by member."""
    deadline = time.monotonic() + timeout
    while True:
        c = cluster.cluster()
        ports = {m["node"]: m["admin_port"] for m in c["members"]}
        positions = {
            n: http(port, "GET", "/status")[1].get("position") for n, port in ports.items()
        }
        level = len(set(positions.values())) == 1 and len(c["isr"]) == len(ports)
        if level:
            dumps = {n: http(port, "GET", REPLICATED)[1] for n, port in ports.items()}
            again = {
                n: http(port, "GET", "/status")[1].get("position") for n, port in ports.items()
            }
            if again == positions and cluster.cluster()["primary"] == c["primary"]:
                return c["primary"], dumps
        if time.monotonic() > deadline:
            raise TimeoutError(f"the members did not reach one position: {positions} {c}")
        time.sleep(0.02)  # polling the observed state


def check_cluster(
    cluster: LocalCluster, vhost: str, ops: list[tuple[Any, ...]], kill: bool
) -> list[str]:
    """Run `ops` through the front port; then every backup must equal the primary at the same
    position, and (with `kill`) after a kill -9 of the primary the new one must equal it."""
    _prepare(cluster.http, vhost)
    client = surface.Client(cluster.url(vhost), vhost, cluster.http)
    for op in ops:
        client.run(op)
    client.close()
    primary, dumps = member_states(cluster)
    for node, dump in dumps.items():
        diff = surface.difference(dumps[primary], dump)
        if diff:
            raise Differential(f"backup {node} differs from primary {primary}: {diff[:8]}")
    if kill:
        pid = cluster.member(primary)["pid"]
        os.kill(pid, signal.SIGKILL)
        c = cluster.wait_for(lambda c: c["serving"] and c["primary"] != primary, "a new primary")
        code, after = cluster.http("GET", REPLICATED)
        assert code == 200, after
        diff = surface.difference(dumps[primary], after)
        if diff:
            raise Differential(f"new primary {c['primary']} differs from the old: {diff[:8]}")

        def back(c: dict[str, Any]) -> bool:
            m = next(m for m in c["members"] if m["node"] == primary)
            return m["pid"] not in (None, pid) and m["in_isr"] and len(c["isr"]) == len(dumps)

        cluster.wait_for(back, "the killed member back in the ISR", timeout=60)
    _done(cluster.http, vhost)
    return client.refused


# Sequences every run tries first (hypothesis's explicit examples): a durable queue and a
# binding whose tables hold every field type pika sends.
EXAMPLES: list[list[tuple[Any, ...]]] = [
    [
        ("declare_queue", "q0", True, False, False, {"x-custom": b"\x00bytes"}),
        ("declare_exchange", "x0", "headers", True, {}),
        ("bind", "q0", "x0", "", {"x-match": "any", "k": b"\x01", "d": surface.DECIMAL("2.5")}),
        ("publish", "x0", "", b"m", {"delivery_mode": 2, "headers": {"k": b"\x01"}}, False),
    ],
    [  # a durable server-named queue with a persistent message (issue 14, problem 1)
        ("declare_server_named", "q1", True),
        ("publish", "", "q1", b"kept", {"delivery_mode": 2}, False),
    ],
]


def run(
    root: Path,
    count: int,
    seed: int | None = None,
    shrink: bool = True,
    cluster: bool = False,
    kill_every: int = 10,
    config: dict[str, Any] | None = None,
) -> dict[str, int]:
    """`count` sequences against one lone broker (or, with `cluster`, one 3-member local
    cluster whose primary is killed after every `kill_every`-th sequence); raises the
    shortest failing sequence's error (the first one found, without `shrink`); `config`: the
    broker's (or each member's) settings. Returns
    figures: sequences, operations, refusals, failovers."""
    target: Broker | LocalCluster
    if cluster:
        (root / "cluster").mkdir(parents=True, exist_ok=True)
        args: list[str] = []
        if config:
            path = root / "cluster" / "tandem.yaml"
            path.write_text(json.dumps(config))  # JSON is YAML
            args = ["--config", str(path)]
        target = LocalCluster(root / "cluster" / "data", 3, *args).start()
    else:
        target = Broker(root / "node", config).start()
    figures = {"sequences": 0, "operations": 0, "refused": 0, "failovers": 0}
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
        n = next(numbers)
        try:
            if isinstance(target, LocalCluster):
                kill = n % kill_every == kill_every - 1
                refused = check_cluster(target, f"d{n}", ops, kill)
                figures["failovers"] += kill
            else:
                refused = check(target, f"d{n}", ops)
        except BaseException:
            # A failing sequence's vhost goes too, so that the sequences hypothesis tries
            # while shrinking meet none of its state.
            with contextlib.suppress(Exception):
                target.http("DELETE", f"/api/vhosts/d{n}")
            raise
        figures["sequences"] += 1
        figures["operations"] += len(ops)
        figures["refused"] += len(refused)

    for ops in EXAMPLES:
        one = example(ops)(one)
    test = hypothesis_seed(seed)(one) if seed is not None else one
    try:
        test()
    finally:
        target.stop()
    logs = target.logs() if isinstance(target, LocalCluster) else target.log()
    assert BUG_PHRASE not in logs, logs[-3000:]
    return figures
