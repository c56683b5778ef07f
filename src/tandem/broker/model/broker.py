"""The model's root: vhosts, users and the journal they share."""

from __future__ import annotations

from tandem import errors
from tandem.broker.model.auth import Permission, User, Users
from tandem.broker.model.journal import Sequencer
from tandem.broker.model.spec import PermissionSpec, UserSpec
from tandem.broker.model.vhost import Clock, VirtualHost, monotonic_ms


class Broker:
    def __init__(self, journal: Sequencer | None = None, clock: Clock = monotonic_ms) -> None:
        self.journal = journal or Sequencer()
        self.clock = clock
        self.vhosts: dict[str, VirtualHost] = {}
        self.users = Users()
        self.default_replicate = "all"
        self.guest_remote = False  # guest may log in from other hosts (RabbitMQ's loopback_users)

    def add_vhost(self, name: str) -> VirtualHost:
        vh = self.vhosts.get(name)
        if vh is None:
            vh = VirtualHost(name, self.journal, self.clock)
            vh.default_replicate = self.default_replicate
            self.vhosts[name] = vh
        return vh

    def delete_vhost(self, name: str) -> bool:
        """Delete a vhost and everything in it; recorded, so that backups and a restart
        delete it too (its exchanges and bindings go with it, unrecorded one by one)."""
        vh = self.vhosts.pop(name, None)
        if vh is None:
            return False
        for q in list(vh.queues.values()):
            vh.delete_queue(q)
        self.journal.define(name, "vhost.delete", {"name": name}, True)
        return True

    def vhost(self, name: str) -> VirtualHost:
        vh = self.vhosts.get(name)
        if vh is None:
            raise errors.NotFound(f"no vhost '{name}'")
        return vh

    def grant(self, user: str, vhost: str, perm: Permission | None = None) -> None:
        self.users.set_permission(user, vhost, perm or Permission())

    def add_user(self, u: UserSpec, guest_remote: bool = False) -> User:
        """Add or replace a user; `guest` stays loopback-only unless guest_remote (RabbitMQ's
        `loopback_users`)."""
        return self.users.add(
            u.name,
            password=u.password,
            password_hash=u.password_hash,
            tags=u.tags,
            loopback_only=u.name == "guest" and not guest_remote,
        )

    def set_permission(self, p: PermissionSpec) -> None:
        """Set a validated permission, creating its vhost; the user must exist."""
        if p.user not in self.users.users:
            raise errors.ConfigError(f"permissions for user '{p.user}', who does not exist")
        self.add_vhost(p.vhost)
        self.users.set_permission(p.user, p.vhost, Permission(p.configure, p.write, p.read))

    def sweep(self) -> None:
        for vh in list(self.vhosts.values()):
            vh.sweep()
