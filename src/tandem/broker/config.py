"""Node configuration: defaults, the YAML file, and command-line overrides."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tandem.errors import ConfigError


@dataclass(slots=True)
class UserSpec:
    name: str
    password: str | None = None
    password_hash: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass(slots=True)
class PermissionSpec:
    user: str
    vhost: str = "/"
    configure: str = ".*"
    write: str = ".*"
    read: str = ".*"


@dataclass(slots=True)
class Config:
    node_id: str = "tandem-1"
    host: str = "127.0.0.1"
    amqp_port: int = 5672
    admin_host: str = "127.0.0.1"
    admin_port: int = 15672
    admin_token: str | None = None
    data_dir: Path | None = None
    tls_port: int | None = None
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    tls_cafile: str | None = None
    tls_verify_peer: bool = False
    frame_max: int = 131072
    channel_max: int = 2047
    heartbeat: int = 60
    max_message_size: int = 128 * 1024 * 1024
    max_connections: int = 10000
    memory_high_watermark: int = 0  # bytes of RSS; 0 = 40% of the machine's memory
    disk_free_limit: int = 50 * 1024 * 1024
    fsync: bool = True
    segment_bytes: int = 64 * 1024 * 1024
    guest_remote: bool = False  # let guest log in from other hosts than loopback
    users: list[UserSpec] = field(default_factory=list)
    vhosts: list[str] = field(default_factory=lambda: ["/"])
    permissions: list[PermissionSpec] = field(default_factory=list)
    log_level: str = "INFO"
    definitions: str | None = None  # a RabbitMQ definitions export to load at start


_SCALARS = {
    "node_id": str,
    "host": str,
    "amqp_port": int,
    "admin_host": str,
    "admin_port": int,
    "admin_token": str,
    "tls_port": int,
    "tls_certfile": str,
    "tls_keyfile": str,
    "tls_cafile": str,
    "tls_verify_peer": bool,
    "frame_max": int,
    "channel_max": int,
    "heartbeat": int,
    "max_message_size": int,
    "max_connections": int,
    "memory_high_watermark": int,
    "disk_free_limit": int,
    "fsync": bool,
    "segment_bytes": int,
    "guest_remote": bool,
    "log_level": str,
    "definitions": str,
}


def parse(raw: dict[str, Any], source: str = "config") -> Config:
    """Build a Config from a mapping (the parsed YAML), with errors that say where."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    cfg = Config()
    for key, value in raw.items():
        if key in _SCALARS:
            kind = _SCALARS[key]
            if (value is not None and not isinstance(value, kind)) or (
                kind is int and isinstance(value, bool)
            ):
                raise ConfigError(f"{source}: '{key}' must be {kind.__name__}, got {value!r}")
            setattr(cfg, key, value)
        elif key == "data_dir":
            cfg.data_dir = Path(value) if value else None
        elif key == "vhosts":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{source}: 'vhosts' must be a list of names")
            cfg.vhosts = list(value)
        elif key == "users":
            cfg.users = [_user(u, f"{source}: users[{i}]") for i, u in enumerate(value or [])]
        elif key == "permissions":
            cfg.permissions = [
                _perm(p, f"{source}: permissions[{i}]") for i, p in enumerate(value or [])
            ]
        else:
            raise ConfigError(f"{source}: unknown setting '{key}'")
    return cfg


def _user(raw: Any, where: str) -> UserSpec:
    if not isinstance(raw, dict) or "name" not in raw:
        raise ConfigError(f"{where}: a user needs a 'name'")
    if "password" not in raw and "password_hash" not in raw:
        raise ConfigError(f"{where}: user '{raw['name']}' needs 'password' or 'password_hash'")
    unknown = set(raw) - {"name", "password", "password_hash", "tags"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    return UserSpec(
        str(raw["name"]), raw.get("password"), raw.get("password_hash"), list(raw.get("tags") or [])
    )


def _perm(raw: Any, where: str) -> PermissionSpec:
    if not isinstance(raw, dict) or "user" not in raw:
        raise ConfigError(f"{where}: a permission needs a 'user'")
    unknown = set(raw) - {"user", "vhost", "configure", "write", "read"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    return PermissionSpec(**{k: str(v) for k, v in raw.items()})


def load(path: str | Path) -> Config:
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {exc}") from exc
    return parse(raw, str(p))
