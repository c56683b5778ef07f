"""RabbitMQ definitions (the JSON of `rabbitmqctl export_definitions`): load and export.

A RabbitMQ user moves to Tandem by pointing `definitions:` at an export: users keep their
password hashes (RabbitMQ's SHA-256 format is Tandem's), and vhosts, permissions, exchanges,
queues and bindings are declared at start, where they do not exist yet. Policies, parameters
and topic permissions are RabbitMQ features Tandem does not have; they are reported, not
applied.
"""

from __future__ import annotations

import datetime
import decimal
from typing import Any

from pydantic import BaseModel, ValidationError

from tandem.broker.model import spec
from tandem.broker.model.broker import Broker
from tandem.broker.model.queue import Queue
from tandem.errors import ConfigError

HASHING = spec.HASHING
UNSUPPORTED = ("policies", "parameters", "global_parameters", "topic_permissions")


def validate(data: Any, source: str) -> dict[str, Any]:
    """Check a definitions document; errors name the source and the entry. Users and
    permissions go through the same specs as every other entry point."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: definitions must be a JSON object")
    for key in ("users", "vhosts", "permissions", "exchanges", "queues", "bindings"):
        items = data.get(key, [])
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise ConfigError(f"{source}: '{key}' must be a list of objects")
    models: dict[str, type[BaseModel]] = {
        "users": spec.RabbitUser,
        "vhosts": spec.RabbitVhost,
        "permissions": spec.RabbitPermission,
    }
    for key, model in models.items():
        for i, item in enumerate(data.get(key, [])):
            try:
                model.model_validate(item)
            except ValidationError as exc:
                raise ConfigError(spec.describe(exc, source, (key, i))) from None
    for key, needed in (
        ("exchanges", ("name", "vhost")),
        ("queues", ("name", "vhost")),
        ("bindings", ("source", "vhost", "destination")),
    ):
        for i, item in enumerate(data.get(key, [])):
            missing = [n for n in needed if not isinstance(item.get(n), str)]
            if missing:
                raise ConfigError(f"{source}: {key}[{i}] lacks {', '.join(missing)}")
    return data


def apply_auth(broker: Broker, data: dict[str, Any], guest_remote: bool = False) -> None:
    """Users, vhosts and permissions of a document `validate` accepted. `guest` stays
    loopback-only unless guest_remote."""
    for v in data.get("vhosts", []):
        broker.add_vhost(v["name"])
    for raw in data.get("users", []):
        broker.add_user(spec.RabbitUser.model_validate(raw), guest_remote)
    for raw in data.get("permissions", []):
        broker.set_permission(spec.RabbitPermission.model_validate(raw))


def replace_auth(broker: Broker, data: dict[str, Any], guest_remote: bool = False) -> None:
    """Users and permissions become those of `data` (runtime changes, or the primary's)."""
    broker.users.users.clear()
    broker.users.permissions.clear()
    apply_auth(broker, data, guest_remote)


def apply_entities(broker: Broker, data: dict[str, Any], source: str) -> None:
    """Exchanges, queues and bindings that do not exist yet (an existing one is kept)."""
    for e in data.get("exchanges", []):
        vh = broker.add_vhost(str(e["vhost"]))
        if e["name"] not in vh.exchanges:
            vh.declare_exchange(
                str(e["name"]),
                str(e.get("type", "direct")),
                durable=bool(e.get("durable")),
                auto_delete=bool(e.get("auto_delete")),
                internal=bool(e.get("internal")),
                arguments=dict(e.get("arguments") or {}),
            )
    for q in data.get("queues", []):
        vh = broker.add_vhost(str(q["vhost"]))
        if q["name"] not in vh.queues:
            vh.declare_queue(
                str(q["name"]),
                durable=bool(q.get("durable")),
                auto_delete=bool(q.get("auto_delete")),
                arguments=dict(q.get("arguments") or {}),
            )
    for b in data.get("bindings", []):
        vh = broker.add_vhost(str(b["vhost"]))
        kind = b.get("destination_type", "queue")
        dest = (vh.queues if kind == "queue" else vh.exchanges).get(str(b["destination"]))
        if dest is None or b["source"] not in vh.exchanges:
            raise ConfigError(
                f"{source}: binding {b['source']} -> {b['destination']} in "
                f"vhost '{b['vhost']}' names something that does not exist"
            )
        vh.bind(
            str(b["source"]), dest, str(b.get("routing_key", "")), dict(b.get("arguments") or {})
        )


def export_auth(broker: Broker) -> dict[str, Any]:
    """Users, vhosts and permissions in RabbitMQ's format."""
    users = broker.users
    return {
        "users": [
            {
                "name": u.name,
                "password_hash": u.password_hash,
                "hashing_algorithm": HASHING,
                "tags": u.tags,
            }
            for u in users.users.values()
        ],
        "vhosts": [{"name": name} for name in sorted(broker.vhosts)],
        "permissions": [
            {
                "user": user,
                "vhost": vhost,
                "configure": p.configure,
                "write": p.write,
                "read": p.read,
            }
            for (user, vhost), p in users.permissions.items()
        ],
    }


def json_safe(value: Any) -> Any:
    """AMQP field values as JSON can show them, as RabbitMQ's export does: byte strings as
    text, decimals as numbers in a string, timestamps in ISO 8601."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "backslashreplace")
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    return value


def export(broker: Broker) -> dict[str, Any]:
    """Tandem's users and durable definitions in RabbitMQ's format."""
    out: dict[str, Any] = {
        "product": "Tandem",
        **export_auth(broker),
        "exchanges": [],
        "queues": [],
        "bindings": [],
    }
    for vh in broker.vhosts.values():
        for ex in vh.exchanges.values():
            if ex.durable and ex.name and not ex.name.startswith("amq."):
                out["exchanges"].append({"vhost": vh.name, **vh.exchange_body(ex)})
        for q in vh.queues.values():
            if q.durable and q.exclusive_owner is None:  # RabbitMQ exports no exclusive ones
                body = vh.queue_body(q)
                del body["exclusive"]
                out["queues"].append({"vhost": vh.name, **body})
        for b in vh.bindings():
            dest = b.destination
            if (
                b.source.durable
                and dest.durable
                and not (isinstance(dest, Queue) and dest.exclusive_owner)
            ):
                out["bindings"].append({"vhost": vh.name, **vh.binding_body(b)})
    return out
