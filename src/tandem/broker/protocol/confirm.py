"""confirm.select: publisher confirms on a channel."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pamqp import commands

from tandem import errors
from tandem.broker.protocol.channel import Channel

if TYPE_CHECKING:
    from tandem.broker.protocol.connection import Connection


def select(conn: Connection, ch: Channel, m: commands.Confirm.Select) -> None:
    if ch.tx:
        raise errors.PreconditionFailed("cannot switch from tx to confirm mode", 85, 10)
    ch.confirm = True
    if not m.nowait:
        conn.reply(ch, commands.Confirm.SelectOk())
