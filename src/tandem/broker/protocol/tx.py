"""tx.*: transactions on a channel: publishes and settlements held until commit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pamqp import commands

from tandem import errors
from tandem.broker.protocol import basic, frames
from tandem.broker.protocol.channel import Channel

if TYPE_CHECKING:
    from tandem.broker.protocol.connection import Connection


def select(conn: Connection, ch: Channel, m: Any) -> None:
    if ch.confirm:
        raise errors.PreconditionFailed("cannot switch from confirm to tx mode", 90, 10)
    ch.tx = True
    conn.reply(ch, commands.Tx.SelectOk())


def commit(conn: Connection, ch: Channel, m: Any) -> None:
    if not ch.tx:
        raise errors.PreconditionFailed("channel is not transactional", 90, 20)
    publishes, ch.tx_publishes = ch.tx_publishes, []
    settles, ch.tx_settles = ch.tx_settles, []
    stored = False
    journal = conn.broker.journal
    journal.begin_group()  # one group in the log: a backup or a recovery applies all or none
    try:
        for ex, msg, mandatory in publishes:
            stored = basic.route(conn, ch, ex, msg, mandatory) or stored
        for how, tag, multiple, requeue in settles:
            basic.settle(conn, ch, tag, multiple, how, requeue)
    finally:
        journal.end_group()
    commit_ok = frames.method_bytes(ch.number, commands.Tx.CommitOk())
    if stored:
        ch.hold_until_synced(commit_ok)
    else:
        conn.reply_bytes(ch, commit_ok)


def rollback(conn: Connection, ch: Channel, m: Any) -> None:
    if not ch.tx:
        raise errors.PreconditionFailed("channel is not transactional", 90, 30)
    ch.tx_publishes = []
    ch.tx_settles = []
    conn.reply(ch, commands.Tx.RollbackOk())
