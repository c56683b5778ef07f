"""Node configuration: one typed model of every setting, read from YAML and the command line.

The model checks each field's type and range and every cross-field rule (TLS needs a
certificate and its key), and its errors name the field. Paths written in a config file are
relative to that file; paths given on the command line are relative to the working directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from tandem.broker.model import spec
from tandem.broker.model.spec import Name, PermissionSpec, UserSpec
from tandem.errors import ConfigError

Port = Annotated[StrictInt, Field(ge=0, le=65535)]
Bytes = Annotated[StrictInt, Field(ge=0)]
LogLevel = Annotated[
    Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
    BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v),
]
# A path is written as a string; pydantic's lax mode would also take other things.
PathSetting = Annotated[Path, BeforeValidator(lambda v: _path(v))]

TLS_PORT = 5671
PATH_SETTINGS = (
    "data_dir",
    "definitions",
    "tls_certfile",
    "tls_keyfile",
    "tls_cafile",
    "cluster_key_file",
    "front_socket",
)


def _path(value: Any) -> Any:
    if isinstance(value, Path):
        return value
    if not isinstance(value, str) or not value:
        raise ValueError("must be a path (a non-empty string)")
    return Path(value)


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node_id: Name = "tandem-1"
    host: Name = "127.0.0.1"
    amqp_port: Port = 5672
    admin_host: Name = "127.0.0.1"
    admin_port: Port = 15672
    admin_token: Annotated[StrictStr, Field(min_length=1)] | None = None
    data_dir: PathSetting | None = None
    tls_port: Port | None = None
    tls_certfile: PathSetting | None = None
    tls_keyfile: PathSetting | None = None
    tls_cafile: PathSetting | None = None
    tls_verify_peer: StrictBool = False
    frame_max: Annotated[StrictInt, Field(ge=4096, le=2**31 - 1)] = 131072
    channel_max: Annotated[StrictInt, Field(ge=1, le=65535)] = 2047
    heartbeat: Annotated[StrictInt, Field(ge=0, le=65535)] = 60
    max_message_size: Annotated[StrictInt, Field(ge=1, le=512 * 1024 * 1024)] = 128 * 1024 * 1024
    max_connections: Annotated[StrictInt, Field(ge=1)] = 10000
    memory_high_watermark: Bytes = 0  # bytes of RSS; 0 = 40% of the machine's memory
    disk_free_limit: Bytes = 50 * 1024 * 1024
    fsync: StrictBool = True
    segment_bytes: Annotated[StrictInt, Field(ge=4096)] = 64 * 1024 * 1024
    # Bytes of a queue's ready messages kept in memory (bodies, plus 256 for each message);
    # the persistent messages after them stay in the log (a lone node and a cluster
    # member alike). 0 = all in memory;
    # unset: a 32nd of the memory high watermark, at least 32 MiB.
    queue_memory_bytes: Bytes | None = None
    # A lone node checkpoints its log every this many durable records: a restart loads the
    # checkpoint and replays at most about this many, however long the log. 0 = never.
    checkpoint_records: Annotated[StrictInt, Field(ge=0)] = 50_000
    guest_remote: StrictBool = False  # let guest log in from other hosts than loopback
    users: list[UserSpec] = []
    vhosts: list[Name] = ["/"]
    permissions: list[PermissionSpec] = []
    log_level: LogLevel = "INFO"
    definitions: PathSetting | None = None  # a RabbitMQ definitions export to load at start
    # A cluster member listens for replication; the controller decides its role.
    replication_port: Port | None = None
    replication_host: Name = "127.0.0.1"
    cluster_key_file: PathSetting | None = None  # or the TANDEM_CLUSTER_KEY environment variable
    replication_tls: StrictBool = False  # replication over TLS with the node's certificate
    isr_min: Annotated[StrictInt, Field(ge=1)] = 2
    # A primary the controller has not renewed for this long closes its clients (liveness).
    lease_seconds: Annotated[float, Field(gt=0)] = 10.0
    default_replicate: Literal["none", "configuration", "all"] = "all"
    # A Unix socket on which the local cluster's front port hands this node accepted client
    # sockets (SCM_RIGHTS): clients reach the primary with no proxy hop.
    front_socket: PathSetting | None = None

    @model_validator(mode="after")
    def _tls(self) -> Config:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            given, missing = (
                ("tls_certfile", "tls_keyfile")
                if self.tls_keyfile is None
                else ("tls_keyfile", "tls_certfile")
            )
            raise ValueError(f"'{given}' is set but '{missing}' is not: TLS needs both")
        if self.tls_certfile is None:
            for name in ("tls_port", "tls_cafile"):
                if getattr(self, name) is not None:
                    raise ValueError(f"'{name}' needs 'tls_certfile' and 'tls_keyfile'")
            if self.tls_verify_peer:
                raise ValueError("'tls_verify_peer' needs 'tls_certfile' and 'tls_keyfile'")
            if self.replication_tls:
                raise ValueError("'replication_tls' needs 'tls_certfile' and 'tls_keyfile'")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_certfile is not None

    @property
    def amqps_port(self) -> int:
        return TLS_PORT if self.tls_port is None else self.tls_port


def parse(raw: Any, source: str = "config", overrides: dict[str, Any] | None = None) -> Config:
    """Validate a mapping (the parsed YAML) with command-line overrides on top."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of settings")
    data = {**raw, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(spec.describe(exc, source)) from None


def load(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Read a YAML config file (or none) and apply command-line overrides."""
    if path is None:
        return parse({}, "command line", overrides)
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        where = " ".join(str(exc).split())
        raise ConfigError(f"config file {p} is not valid YAML: {where}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {p} is not UTF-8 text") from None
    if isinstance(raw, dict):
        raw = relative_to(raw, p)
    return parse(raw, str(p), overrides)


def read(path: str | Path) -> dict[str, Any]:
    """A config file's settings as written, checked (`load`), paths made absolute: what the
    local cluster hands every member."""
    load(path)  # refused here, with the field named, if invalid
    return relative_to(yaml.safe_load(Path(path).read_text()) or {}, Path(path))


def relative_to(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """`raw` with its relative paths taken from the config file's folder, not the cwd."""
    base = path.resolve().parent
    out = dict(raw)
    for key in PATH_SETTINGS:
        value = out.get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            out[key] = str(base / value)
    return out
