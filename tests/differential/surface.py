"""The differential test's client surface: operations a RabbitMQ user's code performs, drawn by
hypothesis and run by a real pika client against a real broker.

Each operation may be refused by the broker (a channel error is part of the surface: an
invalid argument, a missing queue, an inequivalent redeclaration); the client then opens a
new channel and goes on. Names come from small pools so that operations meet the same
queues and exchanges; a server-named queue is remembered in its slot.

What is compared afterwards is the broker's own state (`GET /api/state`, exact to the byte,
every AMQP value with its type), before and after a kill -9 and restart.
"""

from __future__ import annotations

import datetime
import decimal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions
from hypothesis import strategies as st

QUEUES = ["q0", "q1", "q2"]
EXCHANGES = ["x0", "x1"]
KEYS = ["", "a", "a.b", "b.#"]
USERS = ["u0", "u1"]
VHOSTS = ["v0", "v1"]  # besides the sequence's own, which it uses for everything else
TTL_MS = 600_000  # long enough that nothing expires between a dump and the kill

# A value of every AMQP field type pika can send (pika sends no floats).
field_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.decimals(places=2, min_value=-1000, max_value=1000, allow_nan=False),
    st.datetimes(
        min_value=datetime.datetime(1971, 1, 1), max_value=datetime.datetime(2100, 1, 1)
    ).map(lambda d: d.replace(microsecond=0, tzinfo=datetime.UTC)),
)
field_table = st.dictionaries(
    st.sampled_from(["x-custom", "k", "tag", "x-tandem-note"]),
    st.one_of(
        field_value,
        st.lists(field_value, max_size=3),
        st.dictionaries(st.text(max_size=4), field_value, max_size=2),
    ),
    max_size=3,
)
queue_args = st.fixed_dictionaries(
    {},
    optional={
        "x-message-ttl": st.sampled_from([0, TTL_MS]),
        "x-expires": st.just(TTL_MS),
        "x-max-length": st.integers(0, 3),
        "x-max-length-bytes": st.integers(0, 64),
        "x-overflow": st.sampled_from(["drop-head", "reject-publish", "reject-publish-dlx"]),
        "x-dead-letter-exchange": st.sampled_from(["", *EXCHANGES]),
        "x-dead-letter-routing-key": st.sampled_from(QUEUES),
        "x-max-priority": st.integers(0, 5),
        "x-single-active-consumer": st.booleans(),
        "x-tandem-replicate": st.sampled_from(["none", "configuration", "all"]),
        "x-custom": field_value,
    },
)
properties = st.builds(
    dict,
    delivery_mode=st.sampled_from([1, 2]),
    priority=st.none() | st.integers(0, 9),
    headers=st.none() | field_table,
    content_type=st.none() | st.sampled_from(["text/plain", "application/json"]),
    message_id=st.none() | st.text(max_size=6),
    correlation_id=st.none() | st.text(max_size=6),
    expiration=st.none() | st.just(str(TTL_MS)),
    timestamp=st.none() | st.integers(0, 2**31),
    type=st.none() | st.text(max_size=4),
    app_id=st.none() | st.text(max_size=4),
)

operation = st.one_of(
    st.tuples(
        st.just("declare_queue"),
        st.sampled_from(QUEUES),
        st.booleans(),  # durable
        st.booleans(),  # exclusive
        st.booleans(),  # auto_delete
        queue_args,
    ),
    st.tuples(st.just("declare_server_named"), st.sampled_from(QUEUES), st.booleans()),
    st.tuples(
        st.just("declare_exchange"),
        st.sampled_from(EXCHANGES),
        st.sampled_from(["direct", "fanout", "topic", "headers"]),
        st.booleans(),
        st.fixed_dictionaries({}, optional={"alternate-exchange": st.sampled_from(EXCHANGES)}),
    ),
    st.tuples(st.just("delete_exchange"), st.sampled_from(EXCHANGES), st.booleans()),
    st.tuples(
        st.just("bind"),
        st.sampled_from(QUEUES),
        st.sampled_from(EXCHANGES),
        st.sampled_from(KEYS),
        field_table.map(lambda t: {**t, "x-match": "any"}),
    ),
    st.tuples(
        st.just("unbind"),
        st.sampled_from(QUEUES),
        st.sampled_from(EXCHANGES),
        st.sampled_from(KEYS),
    ),
    st.tuples(
        st.just("bind_exchange"),
        st.sampled_from(EXCHANGES),
        st.sampled_from(EXCHANGES),
        st.sampled_from(KEYS),
    ),
    st.tuples(
        st.just("publish"),
        st.sampled_from(["", *EXCHANGES]),
        st.sampled_from(QUEUES + KEYS),
        st.binary(max_size=16),
        properties,
        st.booleans(),  # mandatory
    ),
    st.tuples(
        st.just("get"),
        st.sampled_from(QUEUES),
        st.sampled_from(["auto", "ack", "requeue", "reject", "keep"]),
    ),
    st.tuples(st.just("recover"), st.just(True)),
    st.tuples(st.just("purge"), st.sampled_from(QUEUES)),
    st.tuples(st.just("delete_queue"), st.sampled_from(QUEUES), st.booleans(), st.booleans()),
    st.tuples(st.just("tx"), st.sampled_from(QUEUES), st.binary(max_size=8), st.booleans()),
    st.tuples(st.just("close_channel"), st.just(True)),
    # The admin API: users, vhosts and permissions (RabbitMQ's management API paths).
    st.tuples(
        st.just("admin_user"),
        st.sampled_from(USERS),
        st.text(max_size=6),
        st.sampled_from(["", "administrator", "monitoring,management"]),
    ),
    st.tuples(st.just("admin_delete_user"), st.sampled_from(USERS)),
    st.tuples(st.just("admin_vhost"), st.sampled_from(VHOSTS), st.booleans()),  # or delete
    st.tuples(
        st.just("admin_permission"),
        st.sampled_from(USERS),
        st.sampled_from(["", *VHOSTS]),  # "": the sequence's own vhost
        st.sampled_from(["", ".*", "^q", "^amq\\.gen"]),
        st.booleans(),  # or delete
    ),
)
sequences = st.lists(operation, min_size=1, max_size=25)


@dataclass
class Client:
    """One pika connection to a vhost; a fresh channel after each refusal."""

    url: str
    vhost: str
    admin: Callable[[str, str, Any], tuple[int, Any]]  # (method, path, body) -> (code, body)
    conn: pika.BlockingConnection = field(init=False)
    ch: Any = field(init=False)
    names: dict[str, str] = field(default_factory=dict)  # slot -> the server-chosen name
    refused: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.conn = pika.BlockingConnection(pika.URLParameters(self.url))
        self._channel()

    def _channel(self) -> None:
        self.ch = self.conn.channel()
        self.ch.confirm_delivery()

    def q(self, slot: str) -> str:
        return self.names.get(slot, slot)

    def run(self, op: tuple[Any, ...]) -> None:
        try:
            getattr(self, op[0])(*op[1:])
        except (pika.exceptions.ChannelClosed, pika.exceptions.UnroutableError) as exc:
            self.refused.append(f"{op[0]}: {exc}")
            if self.ch.is_closed:
                self._channel()
        except pika.exceptions.NackError:
            self.refused.append(f"{op[0]}: nacked")

    def close(self) -> None:
        self.conn.close()

    # -- the operations --

    def declare_queue(
        self, slot: str, durable: bool, exclusive: bool, auto_delete: bool, args: dict[str, Any]
    ) -> None:
        self.ch.queue_declare(
            self.q(slot),
            durable=durable,
            exclusive=exclusive,
            auto_delete=auto_delete,
            arguments=args,
        )

    def declare_server_named(self, slot: str, durable: bool) -> None:
        self.names[slot] = self.ch.queue_declare("", durable=durable).method.queue

    def declare_exchange(self, name: str, kind: str, durable: bool, args: dict[str, Any]) -> None:
        self.ch.exchange_declare(name, kind, durable=durable, arguments=args)

    def delete_exchange(self, name: str, if_unused: bool) -> None:
        self.ch.exchange_delete(name, if_unused=if_unused)

    def bind(self, slot: str, exchange: str, key: str, args: dict[str, Any]) -> None:
        self.ch.queue_bind(self.q(slot), exchange, key, arguments=args)

    def unbind(self, slot: str, exchange: str, key: str) -> None:
        self.ch.queue_unbind(self.q(slot), exchange, key)

    def bind_exchange(self, destination: str, source: str, key: str) -> None:
        self.ch.exchange_bind(destination, source, key)

    def publish(
        self, exchange: str, key: str, body: bytes, props: dict[str, Any], mandatory: bool
    ) -> None:
        if exchange == "":
            key = self.q(key)
        headers = props.get("headers")
        basic = pika.BasicProperties(**{**props, "headers": headers})
        self.ch.basic_publish(exchange, key, body, basic, mandatory=mandatory)

    def get(self, slot: str, mode: str) -> None:
        method, _props, _body = self.ch.basic_get(self.q(slot), auto_ack=mode == "auto")
        if method is None or mode in ("auto", "keep"):
            return
        if mode == "ack":
            self.ch.basic_ack(method.delivery_tag)
        elif mode == "requeue":
            self.ch.basic_nack(method.delivery_tag, requeue=True)
        else:
            self.ch.basic_reject(method.delivery_tag, requeue=False)

    def recover(self, _requeue: bool) -> None:
        self.ch.basic_recover(requeue=True)

    def purge(self, slot: str) -> None:
        self.ch.queue_purge(self.q(slot))

    def delete_queue(self, slot: str, if_unused: bool, if_empty: bool) -> None:
        self.ch.queue_delete(self.q(slot), if_unused=if_unused, if_empty=if_empty)

    def tx(self, slot: str, body: bytes, commit: bool) -> None:
        ch = self.conn.channel()
        ch.tx_select()
        ch.basic_publish("", self.q(slot), body, pika.BasicProperties(delivery_mode=2))
        if commit:
            ch.tx_commit()
        else:
            ch.tx_rollback()
        ch.close()

    def close_channel(self, _unused: bool) -> None:
        self.ch.close()  # its unacked messages go back to their queues
        self._channel()

    def _admin(self, method: str, path: str, body: Any = None) -> None:
        code, answer = self.admin(method, path, body)
        if code >= 400:
            self.refused.append(f"{method} {path}: {code} {answer}")

    def admin_user(self, name: str, password: str, tags: str) -> None:
        self._admin("PUT", f"/api/users/{name}", {"password": password, "tags": tags})

    def admin_delete_user(self, name: str) -> None:
        self._admin("DELETE", f"/api/users/{name}")

    def admin_vhost(self, name: str, create: bool) -> None:
        self._admin("PUT" if create else "DELETE", f"/api/vhosts/{name}")

    def admin_permission(self, user: str, vhost: str, pattern: str, grant: bool) -> None:
        path = f"/api/permissions/{vhost or self.vhost}/{user}"
        body = {"configure": pattern, "write": pattern, "read": pattern}
        self._admin("PUT" if grant else "DELETE", path, body if grant else None)


def difference(before: Any, after: Any, path: str = "") -> list[str]:
    """Where two state dumps differ, as paths (the first few)."""
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for key in sorted(set(before) | set(after), key=str):
            if key not in after:
                out.append(f"{path}/{key}: gone")
            elif key not in before:
                out.append(f"{path}/{key}: appeared")
            else:
                out += difference(before[key], after[key], f"{path}/{key}")
        return out
    if before != after:
        return [f"{path}: {before!r} became {after!r}"]
    return []


DECIMAL = decimal.Decimal  # re-exported for the command line's replay printing
