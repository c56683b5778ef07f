"""The model's root: vhosts, users and the journal they share."""

from __future__ import annotations

from tandem import errors
from tandem.broker.model.auth import Permission, Users
from tandem.broker.model.journal import Journal, MemoryJournal
from tandem.broker.model.vhost import Clock, VirtualHost, monotonic_ms


class Broker:
    def __init__(self, journal: Journal | None = None, clock: Clock = monotonic_ms) -> None:
        self.journal: Journal = journal or MemoryJournal()
        self.clock = clock
        self.vhosts: dict[str, VirtualHost] = {}
        self.users = Users()

    def add_vhost(self, name: str) -> VirtualHost:
        vh = self.vhosts.get(name)
        if vh is None:
            vh = VirtualHost(name, self.journal, self.clock)
            self.vhosts[name] = vh
        return vh

    def delete_vhost(self, name: str) -> bool:
        vh = self.vhosts.pop(name, None)
        if vh is None:
            return False
        for q in list(vh.queues.values()):
            vh.delete_queue(q)
        return True

    def vhost(self, name: str) -> VirtualHost:
        vh = self.vhosts.get(name)
        if vh is None:
            raise errors.NotFound(f"no vhost '{name}'")
        return vh

    def grant(self, user: str, vhost: str, perm: Permission | None = None) -> None:
        self.users.set_permission(user, vhost, perm or Permission())

    def sweep(self) -> None:
        for vh in list(self.vhosts.values()):
            vh.sweep()
