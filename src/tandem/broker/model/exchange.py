"""Exchanges and their routing: direct, fanout, topic, headers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, TypeAlias

from tandem.broker.model import message as message_mod
from tandem.broker.model.message import Message

if TYPE_CHECKING:
    from tandem.broker.model.queue import Queue

    Destination: TypeAlias = "Queue | Exchange"


def _args_key(args: dict[str, Any]) -> str:
    return repr(sorted(args.items()))


class Binding:
    __slots__ = ("arguments", "destination", "routing_key", "source")

    def __init__(
        self,
        source: Exchange,
        destination: Destination,
        routing_key: str,
        arguments: dict[str, Any],
    ) -> None:
        self.source = source
        self.destination = destination
        self.routing_key = routing_key
        self.arguments = arguments

    @property
    def key(self) -> tuple[int, str, str]:
        return (id(self.destination), self.routing_key, _args_key(self.arguments))


class Exchange:
    """An exchange; subclasses index their bindings for their own kind of matching."""

    kind = ""

    def __init__(
        self,
        name: str,
        *,
        durable: bool = False,
        auto_delete: bool = False,
        internal: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.durable = durable
        self.auto_delete = auto_delete
        self.internal = internal
        self.arguments = dict(arguments or {})
        ae = self.arguments.get("alternate-exchange")
        self.alternate: str | None = None if ae is None else str(ae)
        self.bindings: dict[tuple[int, str, str], Binding] = {}
        self.deleted = False
        self._new_index()

    def _new_index(self) -> None:
        """Make the kind's own index of bindings (none here)."""

    def bind(self, b: Binding) -> bool:
        if b.key in self.bindings:
            return False
        self.bindings[b.key] = b
        self._index_add(b)
        return True

    def unbind(self, b: Binding) -> Binding | None:
        existing = self.bindings.pop(b.key, None)
        if existing is not None:
            self._index_remove(existing)
        return existing

    def _index_add(self, b: Binding) -> None:
        pass

    def _index_remove(self, b: Binding) -> None:
        pass

    def route(self, msg: Message) -> list[Destination]:
        raise NotImplementedError


class DirectExchange(Exchange):
    kind = "direct"

    def _new_index(self) -> None:
        self.table: dict[str, list[Destination]] = {}

    def _index_add(self, b: Binding) -> None:
        dests = self.table.setdefault(b.routing_key, [])
        if b.destination not in dests:
            dests.append(b.destination)

    def _index_remove(self, b: Binding) -> None:
        if any(
            o.destination is b.destination and o.routing_key == b.routing_key
            for o in self.bindings.values()
        ):
            return
        dests = self.table.get(b.routing_key, [])
        if b.destination in dests:
            dests.remove(b.destination)
        if not dests:
            self.table.pop(b.routing_key, None)

    def route(self, msg: Message) -> list[Destination]:
        return self.table.get(msg.routing_key, [])


class FanoutExchange(Exchange):
    kind = "fanout"

    def route(self, msg: Message) -> list[Destination]:
        seen: dict[int, Destination] = {}
        for b in self.bindings.values():
            seen.setdefault(id(b.destination), b.destination)
        return list(seen.values())


def topic_match(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    """AMQP topic matching: `*` is exactly one word, `#` is zero or more."""
    memo: dict[tuple[int, int], bool] = {}

    def match(i: int, j: int) -> bool:
        key = (i, j)
        if key in memo:
            return memo[key]
        if i == len(pattern):
            result = j == len(words)
        elif pattern[i] == "#":
            result = match(i + 1, j) or (j < len(words) and match(i, j + 1))
        elif j < len(words) and (pattern[i] == "*" or pattern[i] == words[j]):
            result = match(i + 1, j + 1)
        else:
            result = False
        memo[key] = result
        return result

    return match(0, 0)


class TopicExchange(Exchange):
    kind = "topic"
    CACHE_SIZE = 4096

    def _new_index(self) -> None:
        self.cache: dict[str, list[Destination]] = {}

    def _index_add(self, b: Binding) -> None:
        self.cache.clear()

    def _index_remove(self, b: Binding) -> None:
        self.cache.clear()

    def route(self, msg: Message) -> list[Destination]:
        rk = msg.routing_key
        hit = self.cache.get(rk)
        if hit is not None:
            return hit
        words = tuple(rk.split(".")) if rk else ()
        seen: dict[int, Destination] = {}
        for b in self.bindings.values():
            if id(b.destination) in seen:
                continue
            pattern = tuple(b.routing_key.split(".")) if b.routing_key else ()
            if topic_match(pattern, words):
                seen[id(b.destination)] = b.destination
        result = list(seen.values())
        if len(self.cache) >= self.CACHE_SIZE:
            self.cache.clear()
        self.cache[rk] = result
        return result


class HeadersExchange(Exchange):
    kind = "headers"

    @staticmethod
    def matches(binding_args: dict[str, Any], headers: dict[str, Any]) -> bool:
        mode = str(binding_args.get("x-match", "all"))
        with_x = mode.endswith("-with-x")
        wanted = {
            k: v
            for k, v in binding_args.items()
            if k != "x-match" and (with_x or not k.startswith("x-"))
        }
        if not wanted:
            return mode.startswith("all")

        def ok(k: str, v: Any) -> bool:
            return k in headers and headers[k] == v

        if mode.startswith("any"):
            return any(ok(k, v) for k, v in wanted.items())
        return all(ok(k, v) for k, v in wanted.items())

    def route(self, msg: Message) -> list[Destination]:
        headers = message_mod.headers_of(msg)
        seen: dict[int, Destination] = {}
        for b in self.bindings.values():
            if id(b.destination) not in seen and self.matches(b.arguments, headers):
                seen[id(b.destination)] = b.destination
        return list(seen.values())


EXCHANGE_TYPES: Final[dict[str, type[Exchange]]] = {
    "direct": DirectExchange,
    "fanout": FanoutExchange,
    "topic": TopicExchange,
    "headers": HeadersExchange,
}
