"""Applying log records to the model: the one path for recovery and for backups.

A record states what the primary decided (a message entered or left a queue, a queue was
declared); applying it never decides again: no routing, no length limit, no expiry, no
dead-lettering, and no check a client can fail (names, reserved prefixes, arguments,
equivalence): those ran once, at the primary's protocol edge, before the record existed.
Apply makes the decided fact so, through the model's `create_*` methods, which check nothing.
A declaration of a queue or exchange that exists with other properties replaces it (a copy
restating a queue that was deleted and declared again).

So a well-formed record always applies. One that does not (a bug, or a frame whose checksum
passed but whose payload is not Tandem's) raises `NotApplied`, which names the record; the
caller reports it once with its position and sets it aside, and never retries it.

The caller holds the model's journal in `applying` mode, so nothing applied is recorded a
second time, and calls `done` when it stops applying (the queues drop the index by message
id that applying keeps).

Applying is idempotent per message: an enqueue of a message the queue holds already is
skipped, so a record carried forward by compaction (and still present in an older segment
after a crash) counts once, and a message lands in the order of its id.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Final

from tandem.broker.model import definitions, records
from tandem.broker.model import message as message_mod
from tandem.broker.model import queue as queue_mod
from tandem.broker.model.broker import Broker
from tandem.broker.model.message import Message
from tandem.broker.model.queue import Queue
from tandem.broker.model.vhost import VirtualHost

log = logging.getLogger(__name__)


# A test-only fault (the divergence test): a declaration record of this name does not apply,
# as if apply had a bug. Set by TANDEM_TEST_FAULT_NOT_APPLIED=name; never in use.
UNAPPLIABLE: str | None = None
# A test-only fault (the differential test's second mutation check): apply runs a client's
# check again, the reserved-prefix one that once kept a node from starting. Set by
# TANDEM_TEST_FAULT_APPLY_CHECKS; never in use.
CHECK_AGAIN = False


class NotApplied(ValueError):
    """A record apply could not make so; says which (type, and vhost and queue or name)."""


def apply(broker: Broker, rtype: int, payload: bytes) -> None:
    """Apply one record; raises NotApplied when it cannot (see the module's docstring)."""
    try:
        _apply(broker, rtype, payload)
    except Exception as exc:  # whatever failed, it is reported as this record's failure
        raise failed(rtype, payload, exc) from exc


def failed(rtype: int, payload: bytes, exc: Exception) -> NotApplied:
    """What `apply` raises when a record fails: its description and why. Those that read a
    message record themselves and apply what they read (a backup, a replay) say it so too."""
    return NotApplied(f"{describe(rtype, payload)}: {exc!r}")


def describe(rtype: int, payload: bytes) -> str:
    """A record as a log line names it: its type and what it is about."""
    name = records.NAMES.get(rtype, f"type {rtype}")
    try:
        if rtype in (records.ENQUEUE, records.DEQUEUE, records.MARK):
            vhost, queue, message_id = records.read_key(payload)
            where = f"queue '{queue}' in vhost '{vhost}'"
            return f"{name} of message {records.show_mid(message_id)} on {where}"
        if rtype == records.MARKS:
            vhost, queue, mids = records.read_marks(payload)
            return f"{name} of {len(mids)} messages on queue '{queue}' in vhost '{vhost}'"
        if rtype == records.DEFINE:
            rec = records.decode_body(payload)
            what = (rec.get("body") or {}).get("name") or (rec.get("body") or {}).get("source")
            return f"{name} {rec.get('op')} '{what}' in vhost '{rec.get('vhost')}'"
    except Exception:  # an unreadable record is named by its type alone
        return name
    return name


def _apply(broker: Broker, rtype: int, payload: bytes) -> None:
    if rtype == records.ENQUEUE:
        vhost, queue, mid, route, props, body = records.read_enqueue(payload)
        enqueue(broker, vhost, queue, mid, route, props, body)  # not *: a generic call compiled
    elif rtype in (records.DEQUEUE, records.MARK):
        vhost, queue, mid = records.read_key(payload)
        (dequeue if rtype == records.DEQUEUE else mark)(broker, vhost, queue, mid)
    elif rtype == records.MARKS:
        vhost, queue, mids = records.read_marks(payload)
        q = _queue(broker, vhost, queue)
        if q is not None:
            for mid in mids:
                q.mark(mid)
    elif rtype == records.DEFINE:
        rec = records.decode_body(payload)
        if UNAPPLIABLE is not None and (rec.get("body") or {}).get("name") == UNAPPLIABLE:
            raise RuntimeError("test fault: TANDEM_TEST_FAULT_NOT_APPLIED")
        if rec["op"] == "auth":  # users, vhosts and permissions, all at once
            definitions.replace_auth(broker, rec["body"], broker.guest_remote)
        elif rec["op"] == "vhost.delete":
            broker.delete_vhost(rec["vhost"])
        else:
            define(broker.add_vhost(rec["vhost"]), rec["op"], rec["body"])
    elif rtype == records.SNAPSHOT:
        snapshot(broker, records.decode_body(payload))
    elif rtype in (records.CHECKPOINT, records.NOOP):
        pass
    else:
        log.error("unknown record type %d in the log, skipped", rtype)


# The three message records, read already (records.read_enqueue, records.read_key): a backup
# reads each once, for its store and for these.


def enqueue(
    broker: Broker, vhost: str, queue: str, mid: int, route: bytes, props: bytes, body: bytes
) -> None:
    q = _queue(broker, vhost, queue)
    if q is not None:
        q.restore(message(q, mid, route, props, body))


def dequeue(broker: Broker, vhost: str, queue: str, mid: int) -> None:
    q = _queue(broker, vhost, queue)
    if q is not None:
        q.remove(mid)


def mark(broker: Broker, vhost: str, queue: str, mid: int) -> None:
    q = _queue(broker, vhost, queue)
    if q is not None:
        q.mark(mid)


def done(broker: Broker) -> None:
    """Applying is over: the node serves clients from this state."""
    for vh in broker.vhosts.values():
        for q in vh.queues.values():
            q.end_apply()


def drop_exclusive(broker: Broker) -> list[str]:
    """Delete the exclusive queues whose owning connection is not here (recovered after a
    restart, or copied from a primary that is gone): their owner's connection is closed, so
    they are gone, as RabbitMQ's are. Returns their names."""
    dropped = []
    for vh in broker.vhosts.values():
        for q in list(vh.queues.values()):
            if q.exclusive_owner is queue_mod.OWNED_ELSEWHERE:
                vh.delete_queue(q)
                dropped.append(f"{vh.name}/{q.name}")
    return dropped


def dequeue_many(broker: Broker, gone: Mapping[tuple[str, str], Iterable[int]]) -> None:
    """DEQUEUE records, applied a queue at a time: `gone` maps (vhost, queue) to message
    ids. A copy from the primary drops whole runs of messages at once (Queue.remove_many);
    one `apply` each would search the queue for each."""
    for (vhost, queue), mids in gone.items():
        q = _queue(broker, vhost, queue)
        if q is not None:
            q.remove_many(mids)


def _queue(broker: Broker, vhost: str, queue: str) -> Queue | None:
    vh = broker.vhosts.get(vhost)
    return vh.queues.get(queue) if vh is not None else None


# A route's names, and the one route object every message with it shares (as a connection's
# cache does on the primary). Bounded: cleared when it holds this many.
_ROUTES: Final[dict[bytes, tuple[str, str, bytes]]] = {}
ROUTES_KEPT: Final = 10000


def message(q: Queue, mid: int, route: bytes, props: bytes, body: bytes) -> Message:
    names = _ROUTES.get(route)
    if names is None:
        elen = route[0]
        names = (route[1 : 1 + elen].decode(), route[2 + elen :].decode(), route)
        if len(_ROUTES) >= ROUTES_KEPT:
            _ROUTES.clear()
        _ROUTES[route] = names
    exchange, rk, route = names
    msg = Message(exchange, rk, route, props, body, len(body))
    try:
        message_mod.scan(msg)
    except ValueError:
        log.error("message %d on queue '%s' has invalid properties; kept as it is", mid, q.name)
    msg.mid = mid
    msg.ts = q.vhost.clock()
    return msg


def define(vh: VirtualHost, op: str, body: dict[str, Any]) -> None:
    if op == "exchange.declare":
        vh.create_exchange(
            body["name"],
            body["type"],
            durable=body.get("durable", True),
            auto_delete=body["auto_delete"],
            internal=body["internal"],
            arguments=body["arguments"],
        )
    elif op == "exchange.delete":
        ex = vh.exchanges.get(body["name"])
        if ex is not None:
            vh.remove_exchange(ex)
    elif op == "queue.declare":
        if CHECK_AGAIN and body["name"].startswith("amq.") and body["name"] not in vh.queues:
            raise ValueError(f"queue name '{body['name']}' contains reserved prefix 'amq.*'")
        vh.create_queue(
            body["name"],
            durable=body.get("durable", True),
            exclusive_owner=queue_mod.OWNED_ELSEWHERE if body.get("exclusive") else None,
            auto_delete=body["auto_delete"],
            arguments=body["arguments"],
        )
    elif op == "queue.delete":
        q = vh.queues.get(body["name"])
        if q is not None:
            vh.delete_queue(q)
    elif op in ("bind", "unbind"):
        dest = (vh.queues if body["destination_type"] == "queue" else vh.exchanges).get(
            body["destination"]
        )
        if dest is None or body["source"] not in vh.exchanges:
            return
        if op == "bind":
            vh.bind(body["source"], dest, body["routing_key"], body["arguments"])
        else:
            vh.unbind(body["source"], dest, body["routing_key"], body["arguments"])
    else:
        log.error("unknown definition '%s' in the log, skipped", op)


def snapshot(broker: Broker, snap: dict[str, Any]) -> None:
    """A snapshot of the durable definitions is authoritative: what it does not list was
    deleted."""
    for vname, defs in snap.get("vhosts", {}).items():
        vh = broker.add_vhost(vname)
        names = {q["name"] for q in defs["queues"]}
        for gone in [q for q in vh.queues.values() if q.durable and q.name not in names]:
            vh.delete_queue(gone)
        exnames = {e["name"] for e in defs["exchanges"]}
        for ex in [
            e
            for e in vh.exchanges.values()
            if e.durable and e.name and not e.name.startswith("amq.") and e.name not in exnames
        ]:
            vh.remove_exchange(ex)
        for e in defs["exchanges"]:
            define(vh, "exchange.declare", e)
        for body in defs["queues"]:
            define(vh, "queue.declare", body)
        for b in defs["bindings"]:
            define(vh, "bind", b)


def durable_definitions(broker: Broker) -> dict[str, Any]:
    """What a SNAPSHOT record restates: every durable exchange, queue and binding."""
    out: dict[str, Any] = {"vhosts": {}}
    for vh in broker.vhosts.values():
        out["vhosts"][vh.name] = {
            "exchanges": [
                vh.exchange_body(e)
                for e in vh.exchanges.values()
                if e.durable and e.name and not e.name.startswith("amq.")
            ],
            "queues": [vh.queue_body(q) for q in vh.queues.values() if q.durable],
            "bindings": [
                vh.binding_body(b)
                for b in vh.bindings()
                if b.source.durable and b.destination.durable
            ],
        }
    return out
