"""exchange.*: declare, delete, bind and unbind, on behalf of a connection."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pamqp import commands

from tandem.broker.protocol.channel import Channel

if TYPE_CHECKING:
    from tandem.broker.protocol.connection import Connection


def declare(conn: Connection, ch: Channel, m: commands.Exchange.Declare) -> None:
    if not m.passive:
        conn.check("configure", m.exchange, "exchange")
    ch.vhost.declare_exchange(
        m.exchange,
        m.exchange_type,
        passive=m.passive,
        durable=m.durable,
        auto_delete=m.auto_delete,
        internal=m.internal,
        arguments=m.arguments,
    )
    if not m.nowait:
        conn.reply(ch, commands.Exchange.DeclareOk())


def delete(conn: Connection, ch: Channel, m: commands.Exchange.Delete) -> None:
    conn.check("configure", m.exchange, "exchange")
    ch.vhost.delete_exchange(m.exchange, m.if_unused)
    if not m.nowait:
        conn.reply(ch, commands.Exchange.DeleteOk())


def bind(conn: Connection, ch: Channel, m: Any, unbind: bool = False) -> None:
    conn.check("write", m.destination, "exchange")
    conn.check("read", m.source, "exchange")
    dest = ch.vhost.exchange(m.destination)
    if unbind:
        ch.vhost.unbind(m.source, dest, m.routing_key, m.arguments)
    else:
        ch.vhost.bind(m.source, dest, m.routing_key, m.arguments)
    if not m.nowait:
        conn.reply(ch, commands.Exchange.UnbindOk() if unbind else commands.Exchange.BindOk())


def unbind(conn: Connection, ch: Channel, m: Any) -> None:
    bind(conn, ch, m, unbind=True)


# -- queue class --
