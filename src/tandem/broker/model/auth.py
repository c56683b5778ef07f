"""Users, password hashes and permissions, as RabbitMQ has them.

Password hashes use RabbitMQ's `rabbit_password_hashing_sha256` format (base64 of a 4-byte salt
followed by SHA-256(salt + password)), so hashes exported from RabbitMQ definitions load as they
are.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field


def hash_password(password: str, salt: bytes | None = None) -> str:
    salt = secrets.token_bytes(4) if salt is None else salt
    digest = hashlib.sha256(salt + password.encode()).digest()
    return base64.b64encode(salt + digest).decode()


def check_password(password: str, password_hash: str) -> bool:
    try:
        raw = base64.b64decode(password_hash, validate=True)
    except ValueError:
        return False
    if len(raw) != 36:
        return False
    expected = hash_password(password, raw[:4])
    return hmac.compare_digest(expected, password_hash)


@dataclass(frozen=True, slots=True)
class Permission:
    configure: str = ".*"
    write: str = ".*"
    read: str = ".*"

    def allows(self, what: str, name: str) -> bool:
        pattern: str = getattr(self, what)
        if pattern == "":
            return False
        # RabbitMQ matches permission patterns unanchored: "^app\\." allows "app.jobs".
        return pattern == ".*" or re.search(pattern, name) is not None


@dataclass(slots=True)
class User:
    name: str
    password_hash: str
    tags: list[str] = field(default_factory=list)
    loopback_only: bool = False


class Users:
    """Users and their per-vhost permissions."""

    def __init__(self) -> None:
        self.users: dict[str, User] = {}
        self.permissions: dict[tuple[str, str], Permission] = {}

    def add(
        self,
        name: str,
        *,
        password: str | None = None,
        password_hash: str | None = None,
        tags: list[str] | None = None,
        loopback_only: bool = False,
    ) -> User:
        if password_hash is None:
            if password is None:
                raise ValueError(f"user {name!r} needs a password or a password_hash")
            password_hash = hash_password(password)
        user = User(name, password_hash, list(tags or []), loopback_only)
        self.users[name] = user
        return user

    def delete(self, name: str) -> bool:
        for key in [k for k in self.permissions if k[0] == name]:
            del self.permissions[key]
        return self.users.pop(name, None) is not None

    def authenticate(self, name: str, password: str, loopback: bool) -> User | None:
        user = self.users.get(name)
        if user is None or not check_password(password, user.password_hash):
            return None
        if user.loopback_only and not loopback:
            return None
        return user

    def set_permission(self, user: str, vhost: str, perm: Permission) -> None:
        if user not in self.users:
            raise KeyError(user)
        self.permissions[(user, vhost)] = perm

    def clear_permission(self, user: str, vhost: str) -> bool:
        return self.permissions.pop((user, vhost), None) is not None

    def permission(self, user: str, vhost: str) -> Permission | None:
        return self.permissions.get((user, vhost))
