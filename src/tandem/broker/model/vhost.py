"""A virtual host: its exchanges, queues and bindings, routing and dead-lettering."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any, Final

from pamqp import commands

from tandem import errors
from tandem.broker.model import message as message_mod
from tandem.broker.model import queue as queue_mod
from tandem.broker.model.exchange import EXCHANGE_TYPES, Binding, Exchange
from tandem.broker.model.journal import Sequencer
from tandem.broker.model.message import Message
from tandem.broker.model.queue import Queue

Clock = Callable[[], int]  # monotonic milliseconds

STANDARD_EXCHANGES: Final = (
    ("amq.direct", "direct"),
    ("amq.fanout", "fanout"),
    ("amq.topic", "topic"),
    ("amq.headers", "headers"),
    ("amq.match", "headers"),
)


def replicated(b: Binding) -> bool:
    """A binding replicates unless its destination is a queue that does not."""
    dest = b.destination
    return not isinstance(dest, Queue) or dest.replicate != "none"


def monotonic_ms() -> int:
    return int(time.monotonic() * 1000)


class VirtualHost:
    def __init__(self, name: str, journal: Sequencer, clock: Clock = monotonic_ms) -> None:
        self.name = name
        self.journal = journal
        self.clock = clock
        self.default_replicate = "all"  # x-tandem-replicate of a queue that does not say
        self.exchanges: dict[str, Exchange] = {}
        self.queues: dict[str, Queue] = {}
        self.exchanges[""] = EXCHANGE_TYPES["direct"]("", durable=True)
        for ex_name, kind in STANDARD_EXCHANGES:
            self.exchanges[ex_name] = EXCHANGE_TYPES[kind](ex_name, durable=True)

    # -- exchanges ---------------------------------------------------------------------

    def exchange(self, name: str) -> Exchange:
        ex = self.exchanges.get(name)
        if ex is None:
            raise errors.NotFound(f"no exchange '{name}' in vhost '{self.name}'")
        return ex

    def declare_exchange(
        self,
        name: str,
        kind: str,
        *,
        passive: bool = False,
        durable: bool = False,
        auto_delete: bool = False,
        internal: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> Exchange:
        existing = self.exchanges.get(name)
        if passive:
            if existing is None:
                raise errors.NotFound(f"no exchange '{name}' in vhost '{self.name}'")
            return existing
        if name == "" or (name.startswith("amq.") and existing is None):
            raise errors.AccessRefused(f"exchange name '{name}' contains reserved prefix 'amq.*'")
        if kind not in EXCHANGE_TYPES:
            raise errors.CommandInvalid(f"invalid exchange type '{kind}'")
        if existing is not None:
            if (
                existing.kind != kind
                or existing.durable != durable
                or existing.auto_delete != auto_delete
                or existing.internal != internal
            ):
                raise errors.PreconditionFailed(
                    f"inequivalent arg 'type' or flags for exchange '{name}' in vhost "
                    f"'{self.name}': received '{kind}' but current is '{existing.kind}'"
                )
            return existing
        return self.create_exchange(
            name,
            kind,
            durable=durable,
            auto_delete=auto_delete,
            internal=internal,
            arguments=arguments,
        )

    def create_exchange(
        self,
        name: str,
        kind: str,
        *,
        durable: bool,
        auto_delete: bool = False,
        internal: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> Exchange:
        """Make the exchange so, as decided: no check a client can fail runs here (apply's
        path; `declare_exchange` checks first). One of the same name but other properties
        (a stale copy of a deleted and re-declared exchange) is replaced."""
        args = dict(arguments or {})
        existing = self.exchanges.get(name)
        if existing is not None:
            same = (existing.kind, existing.durable, existing.auto_delete, existing.internal)
            if same == (kind, durable, auto_delete, internal) and existing.arguments == args:
                return existing
            self.remove_exchange(existing)
        ex = EXCHANGE_TYPES[kind](
            name, durable=durable, auto_delete=auto_delete, internal=internal, arguments=args
        )
        self.exchanges[name] = ex
        self.journal.define(self.name, "exchange.declare", self.exchange_body(ex), durable)
        return ex

    @staticmethod
    def exchange_body(ex: Exchange) -> dict[str, Any]:
        return {
            "name": ex.name,
            "type": ex.kind,
            "durable": ex.durable,
            "auto_delete": ex.auto_delete,
            "internal": ex.internal,
            "arguments": ex.arguments,
        }

    def delete_exchange(self, name: str, if_unused: bool = False) -> None:
        ex = self.exchanges.get(name)
        if ex is None:
            return  # RabbitMQ: deleting a missing exchange succeeds
        if name == "" or name.startswith("amq."):
            raise errors.AccessRefused(f"cannot delete reserved exchange '{name}'")
        if if_unused and ex.bindings:
            raise errors.PreconditionFailed(f"exchange '{name}' in vhost '{self.name}' in use")
        self.remove_exchange(ex)

    def remove_exchange(self, ex: Exchange) -> None:
        for b in list(ex.bindings.values()):
            ex.unbind(b)
        # bindings where this exchange is the destination
        for other in list(self.exchanges.values()):
            for b in list(other.bindings.values()):
                if b.destination is ex:
                    self._unbind(b)
        ex.deleted = True
        self.exchanges.pop(ex.name, None)
        self.journal.define(self.name, "exchange.delete", {"name": ex.name}, ex.durable)

    # -- queues ------------------------------------------------------------------------

    def queue(self, name: str) -> Queue:
        q = self.queues.get(name)
        if q is None:
            raise errors.NotFound(f"no queue '{name}' in vhost '{self.name}'")
        return q

    def declare_queue(
        self,
        name: str,
        *,
        passive: bool = False,
        durable: bool = False,
        exclusive_owner: object | None = None,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> tuple[Queue, bool]:
        """Declare (or find) a queue; returns it and whether it was created."""
        if passive:
            q = self.queue(name)
            return q, False
        if not name:
            name = "amq.gen-" + secrets.token_urlsafe(16)
        elif name.startswith("amq."):
            existing = self.queues.get(name)
            if existing is None:
                raise errors.AccessRefused(f"queue name '{name}' contains reserved prefix 'amq.*'")
        args = dict(arguments or {})
        existing = self.queues.get(name)
        if existing is not None:
            why = existing.same_properties(durable, exclusive_owner is not None, auto_delete, args)
            if why is not None:
                raise errors.PreconditionFailed(why)
            return existing, False
        queue_mod.check_arguments(args)
        q = self.create_queue(
            name,
            durable=durable,
            exclusive_owner=exclusive_owner,
            auto_delete=auto_delete,
            arguments=args,
        )
        return q, True

    def create_queue(
        self,
        name: str,
        *,
        durable: bool,
        exclusive_owner: object | None = None,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> Queue:
        """Make the queue so, as decided: no check a client can fail runs here (apply's path;
        `declare_queue` checks first). One of the same name but other properties (a stale copy
        of a deleted and re-declared queue) is replaced, its messages with it."""
        args = dict(arguments or {})
        existing = self.queues.get(name)
        if existing is not None:
            exclusive = exclusive_owner is not None
            if existing.same_properties(durable, exclusive, auto_delete, args) is None and (
                existing.arguments == args
            ):
                return existing
            self.delete_queue(existing)
        q = Queue(
            self,
            name,
            durable=durable,
            exclusive_owner=exclusive_owner,
            auto_delete=auto_delete,
            arguments=args,
        )
        self.queues[name] = q
        if q.replicate != "none" or durable:
            self.journal.define(
                self.name, "queue.declare", self.queue_body(q), durable, q.replicate != "none"
            )
        # Every queue is bound to the default exchange by its name (implicitly, by lookup).
        return q

    @staticmethod
    def queue_body(q: Queue) -> dict[str, Any]:
        return {
            "name": q.name,
            "durable": q.durable,
            "auto_delete": q.auto_delete,
            "exclusive": q.exclusive_owner is not None,
            "arguments": q.arguments,
        }

    def delete_queue(self, q: Queue, if_unused: bool = False, if_empty: bool = False) -> int:
        if q.deleted:
            return 0
        if if_unused and q.consumers:
            raise errors.PreconditionFailed(f"queue '{q.name}' in vhost '{self.name}' in use")
        if if_empty and q.ready:
            raise errors.PreconditionFailed(f"queue '{q.name}' in vhost '{self.name}' is not empty")
        count = q.ready
        for ex in list(self.exchanges.values()):
            for b in list(ex.bindings.values()):
                if b.destination is q:
                    self._unbind(b)
        self.queues.pop(q.name, None)
        q.on_deleted()
        self.journal.define(
            self.name, "queue.delete", {"name": q.name}, q.durable, q.replicate != "none"
        )
        return count

    # -- bindings ----------------------------------------------------------------------

    def bind(
        self,
        source: str,
        destination: Queue | Exchange,
        routing_key: str,
        arguments: dict[str, Any] | None = None,
    ) -> None:
        b = self._binding(source, destination, routing_key, arguments)
        ex = b.source
        if ex.bind(b):
            durable = ex.durable and destination.durable
            self.journal.define(self.name, "bind", self.binding_body(b), durable, replicated(b))

    def _binding(
        self,
        source: str,
        destination: Queue | Exchange,
        routing_key: str,
        arguments: dict[str, Any] | None,
    ) -> Binding:
        if source == "":
            raise errors.AccessRefused(
                f"operation not permitted on the default exchange in vhost '{self.name}'"
            )
        return Binding(self.exchange(source), destination, routing_key, dict(arguments or {}))

    @staticmethod
    def binding_body(b: Binding) -> dict[str, Any]:
        dest = b.destination
        return {
            "source": b.source.name,
            "destination": dest.name,
            "destination_type": "queue" if isinstance(dest, Queue) else "exchange",
            "routing_key": b.routing_key,
            "arguments": b.arguments,
        }

    def unbind(
        self,
        source: str,
        destination: Queue | Exchange,
        routing_key: str,
        arguments: dict[str, Any] | None = None,
    ) -> None:
        b = self._binding(source, destination, routing_key, arguments)
        existing = b.source.bindings.get(b.key)
        if existing is not None:
            self._unbind(existing)

    def _unbind(self, b: Binding) -> None:
        ex = b.source
        if ex.unbind(b) is None:
            return
        self.journal.define(
            self.name,
            "unbind",
            self.binding_body(b),
            ex.durable and b.destination.durable,
            replicated(b),
        )
        if ex.auto_delete and not ex.bindings and not ex.deleted:
            self.remove_exchange(ex)

    def bindings(self) -> list[Binding]:
        return [b for ex in self.exchanges.values() for b in ex.bindings.values()]

    # -- routing -----------------------------------------------------------------------

    def route(self, ex: Exchange, msg: Message) -> list[Queue]:
        """The queues a message published to `ex` reaches (each once)."""
        if ex.name == "":
            q = self.queues.get(msg.routing_key)
            return [q] if q is not None else []
        dests = ex.route(msg)
        if not dests and ex.alternate is None:
            return []
        result: dict[int, Queue] = {}
        seen_ex: set[int] = {id(ex)}
        stack: list[tuple[Exchange, list[Queue | Exchange]]] = [(ex, dests)]
        while stack:
            source, targets = stack.pop()
            if not targets and source.alternate is not None:
                ae = self.exchanges.get(source.alternate)
                if ae is not None and id(ae) not in seen_ex:
                    seen_ex.add(id(ae))
                    stack.append((ae, ae.route(msg)))
                continue
            for d in targets:
                if isinstance(d, Queue):
                    result.setdefault(id(d), d)
                elif id(d) not in seen_ex:
                    seen_ex.add(id(d))
                    stack.append((d, d.route(msg)))
        return list(result.values())

    def dead_letter(self, queue: Queue, msg: Message, reason: str) -> None:
        """Republish a message that left `queue` (reason: rejected, expired, maxlen)."""
        if queue.dlx is None:
            return
        ex = self.exchanges.get(queue.dlx)
        if ex is None:
            return
        try:
            props = message_mod.decode_properties(msg.props)
        except ValueError:
            # Unreadable properties: dead-letter the body with fresh ones (and x-death).
            props = commands.Basic.Properties(delivery_mode=2 if msg.persistent else None)
        headers: dict[str, Any] = dict(props.headers or {})
        deaths: list[dict[str, Any]] = [
            dict(d) for d in headers.get("x-death") or [] if isinstance(d, dict)
        ]
        routing_keys = [msg.routing_key]
        for i, death in enumerate(deaths):
            if death.get("queue") == queue.name and death.get("reason") == reason:
                death["count"] = int(death.get("count", 1)) + 1
                deaths.pop(i)
                deaths.insert(0, death)
                break
        else:
            deaths.insert(
                0,
                {
                    "count": 1,
                    "reason": reason,
                    "queue": queue.name,
                    "time": int(time.time()),
                    "exchange": msg.exchange,
                    "routing-keys": routing_keys,
                },
            )
        if "x-first-death-queue" not in headers:
            headers["x-first-death-queue"] = queue.name
            headers["x-first-death-reason"] = reason
            headers["x-first-death-exchange"] = msg.exchange
        headers["x-last-death-queue"] = queue.name
        headers["x-last-death-reason"] = reason
        headers["x-last-death-exchange"] = msg.exchange
        headers["x-death"] = deaths
        props.headers = headers
        props.expiration = None
        rk = queue.dlrk if queue.dlrk is not None else msg.routing_key
        new = Message(
            ex.name,
            rk,
            message_mod.encode_route(ex.name, rk),
            message_mod.encode_properties(props),
            msg.body,
            msg.body_size,
        )
        new.persistent = msg.persistent
        new.priority = msg.priority
        new.ts = self.clock()
        for q in self.route(ex, new):
            # A cycle with no rejection in it would loop forever: drop it, as RabbitMQ does.
            if (
                any(d.get("queue") == q.name for d in deaths)
                and all(d.get("reason") != "rejected" for d in deaths)
                and q is queue
            ):
                continue
            q.enqueue(new)

    # -- housekeeping ------------------------------------------------------------------

    def sweep(self) -> None:
        """Expire messages at queue heads and delete idle queues (x-expires)."""
        now = self.clock()
        for q in list(self.queues.values()):
            if q.timed:
                q.expire_head()
                q.dispatch()
            if q.idle_expired(now):
                self.delete_queue(q)
