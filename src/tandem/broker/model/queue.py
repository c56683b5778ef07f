"""Queues: ordered messages, consumers served round-robin, TTL, length limits, priorities.

A queue deeper than its memory budget (`Journal.page_budget`, the node's
`queue_memory_bytes`) keeps only its head in memory: the persistent messages after it stay
in the log as pages (`journal.Page`), each read back when the head runs out, as RabbitMQ's
lazy and quorum queues keep bodies on disk. The order is the queue's: `messages` (the head),
then `tail` (pages, and messages kept in memory in their place: ones that cannot be paged,
transient or with an expiration, and new ones while the budget allows), then `filling` (the
next page, not yet made).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final, Protocol

from tandem import errors
from tandem.broker.model.journal import Page
from tandem.broker.model.message import Message
from tandem.broker.model.shards import Shards

if TYPE_CHECKING:
    from tandem.broker.model.vhost import VirtualHost


class Consumer(Protocol):
    """What a queue needs of a consumer; the protocol layer's consumer implements it."""

    tag: str
    no_ack: bool
    exclusive: bool

    def ready(self) -> bool:
        """True when it may take one more message now (prefetch, flow, writable socket)."""

    def deliver(self, queue: Queue, msg: Message) -> None:
        """Send msg; unless no_ack, the consumer now holds it until settled."""

    def cancelled_by_broker(self, queue: Queue) -> None:
        """The queue went away: tell the client (basic.cancel) and forget the consumer."""


class PriorityBuffer:
    """A deque per priority level, served highest first; the interface of a deque."""

    __slots__ = ("levels", "n")

    def __init__(self, max_priority: int) -> None:
        self.levels = [collections.deque[Message]() for _ in range(max_priority + 1)]
        self.n = len(self.levels) - 1

    def _level(self, msg: Message) -> collections.deque[Message]:
        return self.levels[min(msg.priority, self.n)]

    def append(self, msg: Message) -> None:
        self._level(msg).append(msg)

    def appendleft(self, msg: Message) -> None:
        self._level(msg).appendleft(msg)

    def popleft(self) -> Message:
        for level in reversed(self.levels):
            if level:
                return level.popleft()
        raise IndexError("pop from an empty queue")

    def __getitem__(self, index: int) -> Message:
        if index != 0:
            raise IndexError(index)
        for level in reversed(self.levels):
            if level:
                return level[0]
        raise IndexError("empty")

    def __len__(self) -> int:
        return sum(len(level) for level in self.levels)

    def __bool__(self) -> bool:
        return any(self.levels)

    def __iter__(self) -> Iterator[Message]:
        for level in reversed(self.levels):
            yield from level

    def clear(self) -> None:
        for level in self.levels:
            level.clear()

    def insert_by_mid(self, msg: Message) -> None:
        insert_by_mid(self._level(msg), msg)

    def remove(self, msg: Message) -> None:
        self._level(msg).remove(msg)


def insert_by_mid(messages: collections.deque[Message], msg: Message) -> None:
    """Insert in message-id order (appending, in the common case)."""
    i = len(messages)
    while i and messages[i - 1].mid > msg.mid:
        i -= 1
    messages.insert(i, msg)


# The owner of an exclusive queue whose connection is not on this node: a backup's copy of
# one, or one recovered after a restart. Nobody here may use it (405, as while its owner is
# connected elsewhere); a node that starts serving deletes it (apply.drop_exclusive).
OWNED_ELSEWHERE: Final = object()

PAGE_BYTES: Final = 256 * 1024  # body bytes of one page (a quarter of the budget, if less)
# What a message in memory costs beyond its body (its objects, properties and indexes): a
# queue's head is budgeted in body bytes plus this for each message.
OVERHEAD: Final = 256

OVERFLOW_MODES: Final = ("drop-head", "reject-publish", "reject-publish-dlx")
# Arguments whose values must match on redeclare; RabbitMQ ignores the ones it does not know.
EQUIVALENCE_ARGS: Final = (
    "x-message-ttl",
    "x-expires",
    "x-max-length",
    "x-max-length-bytes",
    "x-overflow",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-priority",
    "x-queue-type",
    "x-tandem-replicate",
    "x-single-active-consumer",
)
REPLICATE_MODES: Final = ("none", "configuration", "all")


INT_ARGS: Final = {  # name: (smallest value, largest value or None)
    "x-message-ttl": (0, None),
    "x-expires": (1, None),
    "x-max-length": (0, None),
    "x-max-length-bytes": (0, None),
    "x-max-priority": (0, 255),
}


def _int_arg(args: dict[str, Any], name: str) -> int | None:
    """The argument's value, or None when it is absent or not a valid one (INT_ARGS)."""
    value = args.get(name)
    smallest, largest = INT_ARGS[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < smallest:
        return None
    return value if largest is None or value <= largest else None


def check_arguments(args: dict[str, Any]) -> None:
    """The checks a declaring client can fail, with RabbitMQ's words. Only the protocol edge
    runs them (through `VirtualHost.declare_queue`); a queue built from a record takes its
    arguments as they were decided."""
    for name in INT_ARGS:
        value = args.get(name)
        if value is not None and _int_arg(args, name) is None:
            raise errors.PreconditionFailed(f"invalid arg '{name}' for queue: {value!r}")
    overflow = args.get("x-overflow")
    if overflow is not None and str(overflow) not in OVERFLOW_MODES:
        raise errors.PreconditionFailed(f"invalid arg 'x-overflow': {overflow!r}")
    replicate = args.get("x-tandem-replicate")
    if replicate is not None and str(replicate) not in REPLICATE_MODES:
        raise errors.PreconditionFailed(f"invalid arg 'x-tandem-replicate': {replicate!r}")


class Queue:
    """A queue in a vhost. Depth is ready plus unacked."""

    def __init__(
        self,
        vhost: VirtualHost,
        name: str,
        *,
        durable: bool = False,
        exclusive_owner: object | None = None,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> None:
        args = dict(arguments or {})
        self.vhost = vhost
        self.name = name
        self.durable = durable
        self.exclusive_owner = exclusive_owner
        self.auto_delete = auto_delete
        self.arguments = args
        self.ttl = _int_arg(args, "x-message-ttl")
        self.expires = _int_arg(args, "x-expires")
        self.max_length = _int_arg(args, "x-max-length")
        self.max_bytes = _int_arg(args, "x-max-length-bytes")
        self.max_priority = max_priority = _int_arg(args, "x-max-priority")
        self.overflow = str(args.get("x-overflow", "drop-head"))
        if self.overflow not in OVERFLOW_MODES:
            self.overflow = "drop-head"
        dlx = args.get("x-dead-letter-exchange")
        self.dlx: str | None = None if dlx is None else str(dlx)
        dlrk = args.get("x-dead-letter-routing-key")
        self.dlrk: str | None = None if dlrk is None else str(dlrk)
        default_replicate = "none" if exclusive_owner is not None else vhost.default_replicate
        self.replicate = str(args.get("x-tandem-replicate", default_replicate))
        if self.replicate not in REPLICATE_MODES:
            self.replicate = default_replicate
        self.messages: collections.deque[Message] | PriorityBuffer = (
            PriorityBuffer(max_priority) if max_priority else collections.deque()
        )
        self.bytes = 0  # body bytes of ready messages (head and tail)
        # Paging (see the module's docstring): the tail, its size, and the next page.
        self.tail: collections.deque[Message | Page] = collections.deque()
        self.tail_count = 0
        self.tail_bytes = 0
        self.tail_held = 0  # what the tail's messages in memory cost, as the budget counts
        self.filling: list[Message] = []
        self.filling_bytes = 0
        # Only a plain durable queue pages: one with priorities, a TTL or a length limit
        # works on all its messages, and an exclusive one dies with its connection.
        self.pageable = (
            durable
            and not max_priority
            and self.ttl is None
            and self.max_length is None
            and self.max_bytes is None
            and exclusive_owner is None
        )
        self.unacked = 0
        # Its vhost and name as every message record of it begins (records.place), encoded
        # once by the journal rather than at every record.
        self.place = b""
        self.consumers: list[Consumer] = []
        self.rr = 0
        self.exclusive_consumer: Consumer | None = None
        self.had_consumer = False
        self.last_used = vhost.clock()
        self.deleted = False
        self.timed = self.ttl is not None
        # RabbitMQ's single active consumer: only the longest-standing consumer is served.
        self.single_active = bool(args.get("x-single-active-consumer", False))
        # While records are applied (recovery, a backup): the messages by id.
        self.index: Shards[int, Message] | None = None
        # On a cluster member, the delivered messages awaiting their ack, by id: a full copy
        # for a backup holds them too.
        self.outstanding: dict[int, Message] = {}
        # Counters for metrics.
        self.published = 0
        self.delivered = 0
        self.acked = 0

    # -- state -------------------------------------------------------------------------

    @property
    def depth(self) -> int:
        return len(self.messages) + self.tail_count + self.unacked

    @property
    def ready(self) -> int:
        return len(self.messages) + self.tail_count

    @property
    def paged(self) -> int:
        """Ready messages that are in the log only, not in memory."""
        return sum(p.count for p in self.tail if isinstance(p, Page))

    def in_memory(self) -> list[Message]:
        """Its ready messages held in memory (the head, the tail's, the page being filled),
        in the queue's order but for a priority queue's levels."""
        out = list(self.messages)  # a copy captures a million this way, on the loop: one list
        if self.tail:
            out += [item for item in self.tail if not isinstance(item, Page)]
        out += self.filling
        return out

    def pages(self) -> list[Page]:
        """Its pages, in order: ready messages that are in the log only."""
        return [item for item in self.tail if isinstance(item, Page)]

    def all_ready(self) -> list[Message]:
        """Every ready message in order, pages read without taking them in (state dumps,
        copies); costly for a deep queue."""
        out = list(self.messages)
        for item in self.tail:
            if isinstance(item, Page):
                count = item.count
                out += self.vhost.journal.page_in(item, self, keep=True)
                self.tail_count -= count - item.count  # read back short: lost here
            else:
                out.append(item)
        return out + self.filling

    def same_properties(
        self, durable: bool, exclusive: bool, auto_delete: bool, arguments: dict[str, Any]
    ) -> str | None:
        """Why a redeclare with these properties does not match, or None."""
        if durable != self.durable:
            return (
                f"inequivalent arg 'durable' for queue '{self.name}' in vhost "
                f"'{self.vhost.name}': received '{str(durable).lower()}' but current is "
                f"'{str(self.durable).lower()}'"
            )
        if exclusive != (self.exclusive_owner is not None):
            return f"inequivalent arg 'exclusive' for queue '{self.name}'"
        if auto_delete != self.auto_delete:
            return (
                f"inequivalent arg 'auto_delete' for queue '{self.name}' in vhost "
                f"'{self.vhost.name}': received '{str(auto_delete).lower()}' but current is "
                f"'{str(self.auto_delete).lower()}'"
            )
        for key in EQUIVALENCE_ARGS:
            if arguments.get(key) != self.arguments.get(key):
                return (
                    f"inequivalent arg '{key}' for queue '{self.name}' in vhost "
                    f"'{self.vhost.name}': received {arguments.get(key)!r} but current is "
                    f"{self.arguments.get(key)!r}"
                )
        return None

    # -- publishing --------------------------------------------------------------------

    def enqueue(self, msg: Message) -> bool:
        """Take a routed message. False when the queue refuses it (reject-publish overflow)."""
        limited = self.max_length is not None or self.max_bytes is not None
        if limited and not self._make_room(msg):
            return False
        self.published += 1
        msg.refs += 1
        if msg.expiration is not None or self.ttl is not None:
            ttl = self._ttl_of(msg)
            if ttl == 0 and not self._has_ready_consumer():
                self._drop(msg, "expired")
                return True
            self.timed = True
        journal = self.vhost.journal
        if (msg.persistent and self.durable) or journal.shipping:
            journal.enqueue(self, msg)
        messages = self.messages
        if self.tail_count or (self.pageable and msg.persistent and self._over_budget()):
            self._to_tail(msg)
            return True
        if self.consumers and not messages:
            consumers = self.consumers
            n = 1 if self.single_active else len(consumers)
            for _ in range(n):
                c = consumers[self.rr % n]
                self.rr += 1
                if c.ready():
                    self._hand(c, msg)
                    return True
        messages.append(msg)
        self.bytes += msg.body_size
        return True

    def persists(self, msg: Message) -> bool:
        return msg.persistent and self.durable

    # -- paging --------------------------------------------------------------------------

    def _over_budget(self) -> bool:
        """True when the messages held in memory, the head's and the tail's, have used
        the queue's memory budget."""
        budget = self.vhost.journal.page_budget
        held = self.bytes - self.tail_bytes + OVERHEAD * len(self.messages) + self.tail_held
        return bool(budget) and held >= budget

    def _to_tail(self, msg: Message) -> None:
        """Put a message at the end of the tail: into the next page if it can stay in the
        log (persistent, no expiration) and the queue's memory is used up, else kept in
        memory as it is. A queue with a tail takes every new message there, to keep its
        order: one restarted with its messages as pages had every message paged out and
        read back until its tail ran out, even with its memory unused (a backup rejoining
        under load read back its busy queue's messages to mark them)."""
        size = msg.body_size
        self.tail_count += 1
        self.tail_bytes += size
        self.bytes += size
        if self.index is not None:
            self.index[msg.mid] = msg
        if (
            msg.persistent
            and msg.expiration is None
            and self.pageable
            and (self.filling or self._over_budget())
        ):
            self.filling.append(msg)  # a page begun is filled: no page of one message
            self.filling_bytes += size
            if self.filling_bytes >= min(PAGE_BYTES, self.vhost.journal.page_budget // 4):
                self._seal()
        else:
            self._seal()
            self.tail.append(msg)
            self.tail_held += size + OVERHEAD

    def _seal(self) -> None:
        """Make the next page of the filling messages; the store holds them until their
        records are written, then only their place in the log stays."""
        msgs = self.filling
        if not msgs:
            return
        self.filling = []
        self.filling_bytes = 0
        page = self.vhost.journal.page_out(self, msgs)
        if page is None:  # their records are not all in the log yet: they stay in memory
            self.tail.extend(msgs)
            self.tail_held += sum(m.body_size for m in msgs) + OVERHEAD * len(msgs)
            return
        self.tail.append(page)
        index = self.index
        for m in msgs:
            m.refs -= 1
            if index is not None:
                index.pop(m.mid, None)

    def _promote(self) -> bool:
        """Move the tail's first items (a page read back, or a message) to the head's end,
        until one brings a message; False when none is left."""
        while self.tail_count:
            if self._promote_one():
                return True
        return False

    def _promote_one(self) -> bool:
        tail = self.tail
        if tail:
            item = tail[0]
            if isinstance(item, Page):
                # Taken off the tail once read: a read that raises leaves it in its place.
                count, size = item.count, item.body_bytes
                msgs = self.vhost.journal.page_in(item, self)
                # A page read back short (a record corrupt on disk) counts what came back.
                self.bytes += sum(m.body_size for m in msgs) - size
                for m in msgs:
                    m.refs += 1
            else:
                msgs, count, size = [item], 1, item.body_size
                self.tail_held -= size + OVERHEAD
            tail.popleft()
        elif self.filling:
            msgs, count, size = self.filling, len(self.filling), self.filling_bytes
            self.filling = []
            self.filling_bytes = 0
        else:
            return False
        self.tail_count -= count
        self.tail_bytes -= size
        messages = self.messages
        assert isinstance(messages, collections.deque)  # a queue with priorities never pages
        messages.extend(msgs)
        if not self.timed and any(m.expiration is not None for m in msgs):
            self.timed = True
        index = self.index
        if index is not None:
            for m in msgs:
                index[m.mid] = m
        return bool(msgs)

    def _tail_first_mid(self) -> int:
        if self.tail:
            item = self.tail[0]
            return item.first_mid if isinstance(item, Page) else item.mid
        return self.filling[0].mid

    def _tail_last_mid(self) -> int:
        if self.filling:
            return self.filling[-1].mid
        item = self.tail[-1]
        return item.last_mid if isinstance(item, Page) else item.mid

    def _promote_through(self, mid: int) -> None:
        """Bring into memory every page that may hold message `mid` or one before it (a
        record names a message that stays in the log)."""
        while self.tail_count and self._tail_first_mid() <= mid:
            self._promote()

    def _ttl_of(self, msg: Message) -> int:
        ttl = self.ttl
        if msg.expiration is not None and (ttl is None or msg.expiration < ttl):
            ttl = msg.expiration
        assert ttl is not None
        return ttl

    def _has_ready_consumer(self) -> bool:
        return any(c.ready() for c in self.consumers)

    def _make_room(self, msg: Message) -> bool:
        over_len = self.max_length is not None and len(self.messages) + 1 > self.max_length
        over_bytes = self.max_bytes is not None and self.bytes + msg.body_size > self.max_bytes
        if not (over_len or over_bytes):
            return True
        if self.overflow == "reject-publish":
            return False
        if self.overflow == "reject-publish-dlx":
            self.vhost.dead_letter(self, msg, "maxlen")
            return False
        # drop-head: drop the oldest until the new one fits
        while self.messages and (
            (self.max_length is not None and len(self.messages) + 1 > self.max_length)
            or (self.max_bytes is not None and self.bytes + msg.body_size > self.max_bytes)
        ):
            old = self.messages.popleft()
            self.bytes -= old.body_size
            self._drop(old, "maxlen")
        if self.max_length == 0 or (self.max_bytes is not None and msg.body_size > self.max_bytes):
            self.vhost.dead_letter(self, msg, "maxlen")
            return False
        return True

    # -- delivering --------------------------------------------------------------------

    def dispatch(self) -> None:
        """Hand ready messages to consumers that can take them."""
        messages = self.messages
        consumers = self.consumers
        if not (messages or self.tail_count) or not consumers:
            return
        if self.timed:
            self.expire_head()
        n = 1 if self.single_active else len(consumers)
        idle = 0
        while idle < n and (messages or (self.tail_count and self._promote())):
            c = consumers[self.rr % n]
            self.rr += 1
            if not c.ready():
                idle += 1
                continue
            idle = 0
            msg = messages.popleft()
            self.bytes -= msg.body_size
            self._hand(c, msg)
            n = min(len(consumers), 1) if self.single_active else len(consumers)
            if not n:
                break

    def _hand(self, c: Consumer, msg: Message) -> None:
        """Deliver to a ready consumer; a no-ack delivery is settled at once."""
        self.delivered += 1
        if not c.no_ack:
            self.unacked += 1
            if self.replicate == "all" and self.vhost.journal.shipping:
                self.vhost.journal.mark(self, msg)
                self.outstanding[msg.mid] = msg
        c.deliver(self, msg)
        if c.no_ack:
            self._forget(msg)

    def get(self, no_ack: bool = False) -> Message | None:
        """basic.get: the next ready message; with no_ack it is gone at once (the caller
        settles it), otherwise it awaits its ack and is marked delivered in the log."""
        if self.timed:
            self.expire_head()
        if not self.messages and not (self.tail_count and self._promote()):
            return None
        msg = self.messages.popleft()
        self.bytes -= msg.body_size
        self.delivered += 1
        if not no_ack and self.replicate == "all" and self.vhost.journal.shipping:
            self.vhost.journal.mark(self, msg)
            self.outstanding[msg.mid] = msg
        return msg

    def settle(self, msg: Message) -> None:
        """An unacked message was acked: forget it for good."""
        self.unacked -= 1
        self.acked += 1
        self._forget(msg)

    def settle_unacked_get(self, msg: Message) -> None:
        """A message fetched with no_ack by basic.get: gone at once."""
        self._forget(msg)

    def reject(self, msg: Message, requeue: bool) -> None:
        self.unacked -= 1
        if requeue and not self.deleted:
            self.requeue(msg)
        else:
            self._drop(msg, "rejected")

    def requeue(self, msg: Message) -> None:
        """Put an unacked message back at the head, flagged redelivered."""
        if self.outstanding:
            self.outstanding.pop(msg.mid, None)
        if msg.refs > 1 and not msg.redelivered:
            # Shared with other queues: this queue's copy alone is redelivered.
            msg.refs -= 1
            msg = msg.copy()
            msg.refs = 1
        msg.redelivered = True
        self.vhost.journal.requeued(self, msg)
        self.messages.appendleft(msg)
        self.bytes += msg.body_size

    def release(self, msg: Message) -> None:
        """An unacked message whose channel closed: requeue it (counts it out of unacked)."""
        self.unacked -= 1
        if self.deleted:
            self._forget(msg)
        else:
            self.requeue(msg)

    def _forget(self, msg: Message) -> None:
        if self.outstanding:
            self.outstanding.pop(msg.mid, None)
        journal = self.vhost.journal
        if (msg.persistent and self.durable) or journal.shipping:
            journal.dequeue(self, msg)
        msg.refs -= 1

    def _drop(self, msg: Message, reason: str) -> None:
        """Remove a message for good, dead-lettering it when the queue says so."""
        if self.dlx is not None:
            self.vhost.dead_letter(self, msg, reason)
        self._forget(msg)

    def expire_head(self) -> int:
        """Drop (and dead-letter) expired messages at the head, as RabbitMQ does."""
        messages = self.messages
        now = self.vhost.clock()
        count = 0
        while messages or (self.tail_count and self._promote()):
            msg = messages[0]
            if msg.expiration is None and self.ttl is None:
                break
            if msg.ts + self._ttl_of(msg) > now:
                break
            messages.popleft()
            self.bytes -= msg.body_size
            self._drop(msg, "expired")
            count += 1
        if not messages and not self.tail_count:
            self.timed = self.ttl is not None
        return count

    def purge(self) -> int:
        """Drop every ready message; a deep queue's pages are read back one at a time."""
        count = self.ready
        while True:
            for msg in self.messages:
                self._forget(msg)
            self.messages.clear()
            if not self._promote():
                break
        self.bytes = 0
        return count

    # -- applying records (model/apply.py) ----------------------------------------------

    def _index(self) -> Shards[int, Message]:
        if self.index is None:
            self.index = Shards((m.mid, m) for m in self.messages)
        return self.index

    def restore(self, msg: Message) -> None:
        """A message the log says entered this queue, placed by its id; once only."""
        index = self._index()
        mid = msg.mid
        if self.tail_count and mid <= self._tail_last_mid():
            # It belongs among or before the tail (a record carried forward by compaction
            # comes after later ones): what may come before it is brought into memory.
            self._promote_through(mid)
        if mid in index:
            return
        if msg.expiration is not None or self.ttl is not None:
            self.timed = True
        messages = self.messages
        if (self.tail_count and mid > self._tail_last_mid()) or (
            not self.tail_count
            and self.pageable
            and msg.persistent
            and (not messages or messages[-1].mid < mid)
            and self._over_budget()
        ):
            msg.refs += 1
            self._to_tail(msg)
            return
        index[mid] = msg
        msg.refs += 1
        if isinstance(messages, PriorityBuffer):
            messages.insert_by_mid(msg)
        else:
            insert_by_mid(messages, msg)
        self.bytes += msg.body_size

    def page_in_all(self) -> None:
        """Bring every page into memory (the log they are read from starts over)."""
        while self._promote():
            pass

    def restore_page(self, page: Page) -> None:
        """A page a checkpoint names, after every message restored before it."""
        self._seal()
        self.tail.append(page)
        self.tail_count += page.count
        self.tail_bytes += page.body_bytes
        self.bytes += page.body_bytes

    def remove(self, mid: int) -> None:
        """A message the log says left this queue."""
        if self.tail_count:
            if self._forget_paged(mid):
                return
            self._promote_through(mid)
        msg = self._index().pop(mid, None)
        if msg is None:
            return
        messages = self.messages
        if messages[0] is msg:
            messages.popleft()
        else:
            messages.remove(msg)
        self.bytes -= msg.body_size
        msg.refs -= 1

    def remove_many(self, mids: Iterable[int]) -> None:
        """Messages the log says left this queue, all at once: one pass over the queue,
        where `remove` of each would search it from the head, one at a time (a copy that
        drops a diverged suffix of 50,000 messages took minutes). Pages are read back up to
        the last of them, not beyond: a member that rejoins takes the difference from the
        primary, which names what its consumers took from the head of a deep queue."""
        mids = list(mids)
        if self.tail_count and mids:
            mids = self._forget_many(mids)
            if mids:
                self._promote_through(max(mids))
        index = self._index()
        gone = {id(m): m for m in (index.pop(mid, None) for mid in mids) if m is not None}
        if not gone:
            return
        messages = self.messages
        levels = messages.levels if isinstance(messages, PriorityBuffer) else [messages]
        for level in levels:
            kept = [msg for msg in level if id(msg) not in gone]
            level.clear()
            level.extend(kept)
        for msg in gone.values():
            self.bytes -= msg.body_size
            msg.refs -= 1

    def holds(self, mid: int) -> bool:
        """True when the queue holds message `mid` in memory (a paged one is the store's)."""
        return mid in self._index()

    def mark(self, mid: int) -> None:
        """A message the log says was delivered: after failover it goes out redelivered."""
        if self.tail_count:
            at = self._paged(mid)
            if at is not None and at[1].mark(mid):
                return
            self._promote_through(mid)
        msg = self._index().get(mid)
        if msg is not None:
            msg.redelivered = True

    def _paged(self, mid: int) -> tuple[int, Page] | None:
        """The place in the tail of the page whose run of ids (they do not overlap) takes in
        message `mid`; None when none does. Whether the page knows it holds it is the page's
        to say (`Page.forget`, `Page.mark`). It looks only at the items up to it (a record
        names a message at or near the queue's head: a delivery a consumer's prefetch
        ahead), which a read back through it would read."""
        for i, item in enumerate(self.tail):
            if isinstance(item, Page):
                if item.first_mid > mid:
                    return None
                if mid <= item.last_mid:
                    return i, item
            elif item.mid >= mid:
                return None
        return None

    def _forget_paged(self, mid: int) -> bool:
        """A message the log says left this queue, in a page that knows it holds it: the
        page forgets it unread, and goes once it holds nothing. False when the message is
        not in such a page (it is in memory, or its page must be read back)."""
        at = self._paged(mid)
        if at is None:
            return False
        i, page = at
        if not self.vhost.journal.page_forget(page, mid):
            return False
        self.tail_count -= 1
        if not page.count:
            del self.tail[i]
            self._forgotten(page)
        return True

    def _forgotten(self, page: Page) -> None:
        """Every message of a page taken off the tail was forgotten: its bytes go with it."""
        self.tail_bytes -= page.body_bytes
        self.bytes -= page.body_bytes
        self.vhost.journal.page_drop(page)

    def _forget_many(self, mids: list[int]) -> list[int]:
        """`_forget_paged` for each of `mids`, in one pass over the tail (a copy's dequeues
        may name thousands of messages deep in it: a walk from its front for each took
        seconds); those no page forgot."""
        pages = [item for item in self.tail if isinstance(item, Page)]
        if not pages:
            return mids
        firsts = [page.first_mid for page in pages]  # runs of ids that do not overlap
        journal = self.vhost.journal
        left: list[int] = []
        emptied = False
        for mid in mids:
            i = bisect.bisect_right(firsts, mid) - 1
            if i >= 0 and journal.page_forget(pages[i], mid):
                self.tail_count -= 1
                emptied = emptied or not pages[i].count
            else:
                left.append(mid)
        if emptied:
            kept = [item for item in self.tail if not isinstance(item, Page) or item.count]
            for page in pages:
                if not page.count:
                    self._forgotten(page)
            self.tail.clear()
            self.tail.extend(kept)
        return left

    def end_apply(self) -> None:
        self.index = None

    # -- consumers ---------------------------------------------------------------------

    def add_consumer(self, consumer: Consumer) -> None:
        if self.exclusive_consumer is not None:
            raise errors.AccessRefused(
                f"queue '{self.name}' in vhost '{self.vhost.name}' in exclusive use"
            )
        if consumer.exclusive and self.consumers:
            raise errors.AccessRefused(
                f"queue '{self.name}' in vhost '{self.vhost.name}' in use, cannot consume "
                "exclusively"
            )
        if consumer.exclusive:
            self.exclusive_consumer = consumer
        self.consumers.append(consumer)
        self.had_consumer = True

    def remove_consumer(self, consumer: Consumer) -> None:
        if consumer in self.consumers:
            self.consumers.remove(consumer)
        if self.exclusive_consumer is consumer:
            self.exclusive_consumer = None
        self.last_used = self.vhost.clock()
        if self.auto_delete and self.had_consumer and not self.consumers:
            self.vhost.delete_queue(self)

    def touch(self) -> None:
        self.last_used = self.vhost.clock()

    def idle_expired(self, now: int) -> bool:
        return (
            self.expires is not None and not self.consumers and now - self.last_used >= self.expires
        )

    def on_deleted(self) -> None:
        self.deleted = True
        self.outstanding.clear()
        for c in list(self.consumers):
            c.cancelled_by_broker(self)
        self.consumers.clear()
        for msg in self.messages:
            msg.refs -= 1
        self.messages.clear()
        journal = self.vhost.journal
        for item in self.tail:
            if isinstance(item, Page):
                journal.page_drop(item)
            else:
                item.refs -= 1
        for msg in self.filling:
            msg.refs -= 1
        self.tail.clear()
        self.filling.clear()
        self.tail_count = self.tail_bytes = self.tail_held = self.filling_bytes = 0
        self.bytes = 0
