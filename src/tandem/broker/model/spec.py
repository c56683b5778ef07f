"""Typed specs of what users hand the node: users, vhosts and permissions.

Every entry point that takes one (the YAML config, the admin API, `tandem ctl` through it, and
a RabbitMQ definitions import) validates it here, so a bad regular expression or a missing
permission field is refused where it is typed, with a one-line error naming the field, and can
never reach a client as an internal error later.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictStr,
    ValidationError,
    model_validator,
)

Name = Annotated[StrictStr, Field(min_length=1, max_length=255)]


def _regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a valid regular expression: {exc}") from None
    return pattern


Pattern = Annotated[StrictStr, AfterValidator(_regex)]


def _tags(raw: Any) -> Any:
    # RabbitMQ's definitions and HTTP API write tags as one comma-separated string.
    if isinstance(raw, str):
        return [t.strip() for t in raw.split(",") if t.strip()]
    return raw


Tags = Annotated[list[Name], BeforeValidator(_tags)]


def _password_hash(value: str) -> str:
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 36:
        raise ValueError("not a RabbitMQ SHA-256 password hash (base64 of 36 bytes)")
    return value


class UserSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name
    password: StrictStr | None = None
    password_hash: Annotated[StrictStr, AfterValidator(_password_hash)] | None = None
    tags: Tags = []

    @model_validator(mode="after")
    def _secret(self) -> UserSpec:
        if self.password is None and self.password_hash is None:
            raise ValueError(f"user '{self.name}' needs 'password' or 'password_hash'")
        return self


class PermissionSpec(BaseModel):
    """All three patterns are required, as `rabbitmqctl set_permissions` requires them: a
    missing one must not silently grant `.*`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    user: Name
    vhost: Name
    configure: Pattern
    write: Pattern
    read: Pattern


class VhostSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name


# RabbitMQ's definitions exports and HTTP API bodies carry more keys than Tandem uses
# (`limits`, `hashing_algorithm`, `description`); these variants ignore them, as RabbitMQ does.
HASHING = "rabbit_password_hashing_sha256"


class RabbitUser(UserSpec):
    model_config = ConfigDict(extra="ignore", frozen=True)
    hashing_algorithm: StrictStr = HASHING

    @model_validator(mode="before")
    @classmethod
    def _algorithm(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "password_hash" in raw:
            algorithm = raw.get("hashing_algorithm", HASHING)
            if algorithm != HASHING:
                raise ValueError(
                    f"user '{raw.get('name')}' has a {algorithm} hash; Tandem reads {HASHING} "
                    f"hashes only (set a new password for this user)"
                )
        return raw


class RabbitPermission(PermissionSpec):
    model_config = ConfigDict(extra="ignore", frozen=True)


class RabbitVhost(VhostSpec):
    model_config = ConfigDict(extra="ignore", frozen=True)


def describe(exc: ValidationError, source: str = "", at: tuple[int | str, ...] = ()) -> str:
    """One line for a pydantic error: each problem as `where: what (got value)`, `where`
    starting at `at` (the place of the validated item in a larger document)."""
    parts = []
    for err in exc.errors(include_url=False):
        kind = err["type"]
        path = [*at, *err["loc"]]
        if kind in ("missing", "extra_forbidden") and path:
            field = path.pop()
            where = _where(path)
            name = _quoted(field)
            what = f"{name} is required" if kind == "missing" else f"unknown setting {name}"
            parts.append(f"{where}: {what}" if where else what)
            continue
        value = err.get("input")
        if kind == "invalid_key":
            parts.append(f"setting names must be strings (got {value!r})")
            continue
        loc = _where(path)
        msg = str(err["msg"]).removeprefix("Value error, ").replace("Input should be", "must be")
        if kind == "string_type" and isinstance(value, int | float | bool):
            msg += f" (got {value!r}; quote it in YAML: '{value}')"
        elif not isinstance(value, dict | list):
            got = repr(value)
            msg += f" (got {got[:57] + '...' if len(got) > 60 else got})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    # One line, whatever the names in it hold (a user named "\n" is a name like another).
    text = "; ".join(parts).replace("\r", "\\r").replace("\n", "\\n")
    return f"{source}: {text}" if source else text


def _quoted(name: int | str) -> str:
    """A key as the user typed it, on one line (a key may hold any character in YAML)."""
    text = str(name)
    return f"'{text}'" if text.isprintable() else repr(text)


def _where(path: list[int | str]) -> str:
    loc = ""
    for item in path:
        if not isinstance(item, int) and not str(item).isprintable():
            item = repr(str(item))
        loc += f"[{item}]" if isinstance(item, int) else (f".{item}" if loc else str(item))
    return loc
