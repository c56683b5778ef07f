"""The model's whole state as plain JSON, exact to the byte: for comparing two members, or a
node before and after a restart (the differential test, `GET /api/state`).

Every AMQP value keeps its type: each is given as [type, value] (["bytes", "31"] and
["str", "1"] differ, as they do on the wire). The rendering is this module's own, not the
records' encoding, so that a fault in the one cannot hide in the other. Messages are listed
in the order a consumer would get them (ready ones first, then the unacked ones by id), each
with its id, body, raw properties and redelivered flag.
"""

from __future__ import annotations

import datetime
import decimal
from typing import Any

from tandem.broker.model import records
from tandem.broker.model import vhost as vhost_mod
from tandem.broker.model.broker import Broker
from tandem.broker.model.message import Message
from tandem.broker.model.queue import Queue


def _typed(value: Any) -> Any:
    if isinstance(value, dict):
        return ["table", {str(k): _typed(v) for k, v in value.items()}]
    if isinstance(value, list | tuple):
        return ["array", [_typed(v) for v in value]]
    if isinstance(value, bytes | bytearray | memoryview):
        return ["bytes", bytes(value).hex()]
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", value]
    if isinstance(value, float):
        return ["float", repr(value)]
    if isinstance(value, decimal.Decimal):
        return ["decimal", str(value)]
    if isinstance(value, datetime.datetime):
        return ["timestamp", value.isoformat()]
    if value is None:
        return ["void", None]
    return [type(value).__name__, str(value)]


def _message(m: Message) -> dict[str, Any]:
    return {
        "id": records.show_mid(m.mid),
        "body": m.body_bytes().hex(),
        "properties": bytes(m.props).hex(),
        "persistent": m.persistent,
        "redelivered": m.redelivered,
    }


def _queue(q: Queue, durable_only: bool, replicated_only: bool = False) -> dict[str, Any]:
    messages = [*q.all_ready(), *sorted(q.outstanding.values(), key=lambda m: m.mid)]
    if durable_only:
        messages = [m for m in messages if m.persistent]
    if replicated_only and q.replicate != "all":
        messages = []  # `configuration`: the backups hold the queue, not its messages
    return {
        "durable": q.durable,
        "auto_delete": q.auto_delete,
        "exclusive": q.exclusive_owner is not None,
        "arguments": _typed(q.arguments),
        "messages": [_message(m) for m in messages],
    }


def dump(
    broker: Broker, durable_only: bool = False, replicated_only: bool = False
) -> dict[str, Any]:
    """Vhosts with their exchanges, queues (with messages) and bindings; users and
    permissions. `durable_only`: what a restart must keep (durable exchanges, queues and
    bindings, persistent messages), without exclusive queues (they die with their
    connection). `replicated_only`: what every backup holds too (no queue replicated
    `none`, no message of one replicated `configuration`, no binding to either kind)."""
    vhosts: dict[str, Any] = {}
    for vh in sorted(broker.vhosts.values(), key=lambda v: v.name):
        exchanges = {
            e.name: {
                "type": e.kind,
                "durable": e.durable,
                "auto_delete": e.auto_delete,
                "internal": e.internal,
                "arguments": _typed(e.arguments),
            }
            for e in vh.exchanges.values()
            if e.durable or not durable_only
        }
        queues = {
            q.name: _queue(q, durable_only, replicated_only)
            for q in vh.queues.values()
            if (not durable_only or (q.durable and q.exclusive_owner is None))
            and (not replicated_only or q.replicate != "none")
        }
        bindings = sorted(
            (
                b.source.name,
                "queue" if isinstance(b.destination, Queue) else "exchange",
                b.destination.name,
                b.routing_key,
                _typed(b.arguments),
            )
            for b in vh.bindings()
            if (not replicated_only or vhost_mod.replicated(b))
            and (
                not durable_only
                or (
                    b.source.durable
                    and b.destination.durable
                    and (
                        not isinstance(b.destination, Queue)
                        or b.destination.exclusive_owner is None
                    )
                )
            )
        )
        vhosts[vh.name] = {"exchanges": exchanges, "queues": queues, "bindings": bindings}
    users = broker.users
    return {
        "vhosts": vhosts,
        "users": sorted((u.name, u.password_hash, sorted(u.tags)) for u in users.users.values()),
        "permissions": sorted(
            (user, vhost, p.configure, p.write, p.read)
            for (user, vhost), p in users.permissions.items()
        ),
    }
