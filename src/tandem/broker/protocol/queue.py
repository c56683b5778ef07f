"""queue.*: declare, bind, unbind, purge and delete, on behalf of a connection."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pamqp import commands

from tandem.broker.protocol import frames
from tandem.broker.protocol.channel import Channel

if TYPE_CHECKING:
    from tandem.broker.protocol.connection import Connection


def declare(conn: Connection, ch: Channel, m: commands.Queue.Declare) -> None:
    name = m.queue
    vhost = ch.vhost
    if m.passive:
        q = conn.own(vhost.queue(name))
    else:
        if name:
            conn.check("configure", name)
        existing = vhost.queues.get(name) if name else None
        if existing is not None:
            conn.own(existing)
        q, created = vhost.declare_queue(
            name,
            durable=m.durable,
            exclusive_owner=conn if m.exclusive else None,
            auto_delete=m.auto_delete,
            arguments=m.arguments,
        )
        if created and m.exclusive:
            conn.exclusive_queues.append(q)
    q.touch()
    ch.last_queue = q.name
    if not m.nowait:
        ok = frames.queue_declare_ok(ch.number, q.name, q.ready, len(q.consumers))
        conn.reply_data(ch, ok, durable=True)


def queue_name(ch: Channel, name: str) -> str:
    return name or ch.last_queue


def bind(conn: Connection, ch: Channel, m: Any, unbind: bool = False) -> None:
    qname = queue_name(ch, m.queue)
    conn.check("write", qname)
    conn.check("read", m.exchange, "exchange")
    q = conn.find_queue(ch, qname)
    if unbind:
        ch.vhost.unbind(m.exchange, q, m.routing_key, m.arguments)
        conn.reply(ch, commands.Queue.UnbindOk())
        return
    ch.vhost.bind(m.exchange, q, m.routing_key, m.arguments)
    if not m.nowait:
        conn.reply(ch, commands.Queue.BindOk())


def unbind(conn: Connection, ch: Channel, m: Any) -> None:
    bind(conn, ch, m, unbind=True)


def purge(conn: Connection, ch: Channel, m: commands.Queue.Purge) -> None:
    qname = queue_name(ch, m.queue)
    conn.check("read", qname)
    count = conn.find_queue(ch, qname).purge()
    if not m.nowait:
        conn.reply(ch, commands.Queue.PurgeOk(count))


def delete(conn: Connection, ch: Channel, m: commands.Queue.Delete) -> None:
    qname = queue_name(ch, m.queue)
    conn.check("configure", qname)
    q = ch.vhost.queues.get(qname)
    count = 0
    if q is not None:
        conn.own(q)
        count = ch.vhost.delete_queue(q, if_unused=m.if_unused, if_empty=m.if_empty)
        if q in conn.exclusive_queues:
            conn.exclusive_queues.remove(q)
    if not m.nowait:
        conn.reply(ch, commands.Queue.DeleteOk(count))


# -- basic class --
