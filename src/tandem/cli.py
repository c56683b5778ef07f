"""Tandem, an AMQP 0-9-1 broker with hot-standby replication: run one broker, a local HA
cluster behind one address, the Kubernetes operator, or the Spark audit; manage a running
node with `ctl`. Docs: README.md and docs/ in the source tree."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pydantic

from tandem import errors
from tandem.broker.status import ClusterStatus, NodeStatus


def _broker(args: argparse.Namespace) -> int:
    from tandem.broker import collector
    from tandem.broker import config as config_mod
    from tandem.broker.node import Node

    told = _become_member(args) if args.spare else None
    if args.spare and told is None:
        return 0
    overrides = {
        "amqp_port": args.amqp_port,
        "admin_port": args.admin_port,
        "data_dir": args.data_dir,
        "node_id": args.node_id,
        "host": args.host,
        "replication_port": args.replication_port,
        "cluster_key_file": args.cluster_key_file,
    }
    try:
        cfg = config_mod.load(args.config, overrides)
    except errors.ConfigError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
    if cfg.data_dir is not None:
        try:
            cfg.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"tandem: cannot create data dir {cfg.data_dir}: {exc.strerror}", file=sys.stderr)
            return 1
    logging.basicConfig(
        level=cfg.log_level,
        format=f"%(asctime)s %(levelname)s [{cfg.node_id}] %(name)s: %(message)s",
    )
    policy = collector.install()  # full collections walk only what is new (broker/collector.py)
    try:
        node = Node(cfg)
        if told is not None and told.get("hold"):
            # Told while the cluster waits to start it (its controller is to see it gone
            # first): its log's end is read meanwhile, not after (`Supervisor.keep`). A
            # Ctrl-C at the cluster's terminal ends its input instead.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            node.prepare(early=True)
            if not _spare_line():
                return 0  # the cluster stopped meanwhile
        policy.quiet = node.quiet
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            asyncio.run(node.run())
        else:
            uvloop.run(node.run())
    except errors.ConfigError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
    except (errors.TandemError, OSError) as exc:
        print(f"tandem: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


def _become_member(args: argparse.Namespace) -> dict[str, Any] | None:
    """A spare (`local/members.py`): imported, wait for the member to run as, one JSON line
    on stdin with its config file and output file (and `hold`: wait for a second line before
    it listens); None at the end of the input (the cluster stopped)."""
    with contextlib.suppress(ImportError):  # a dependency on Linux
        import uvloop  # noqa: F401 - imported now, not once told
    line = _spare_line()
    if not line:
        return None
    told: dict[str, Any] = json.loads(line)
    args.config = told["config"]
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    out = os.open(told["output"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    return told


def _spare_line() -> str:
    """A line of a spare's input; empty at its end. A Ctrl-C at the cluster's terminal
    reaches the spare too: the cluster ends its input."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = sys.stdin.readline()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return line


def _cluster_up(args: argparse.Namespace) -> int:
    from tandem.broker import config as config_mod
    from tandem.local import cluster as cluster_mod

    base: dict[str, Any] = {}
    if args.isr_min is not None and not 1 <= args.isr_min <= args.replicas:
        print(
            f"tandem: --isr-min {args.isr_min} with --replicas {args.replicas}: the ISR minimum "
            f"must be between 1 and the number of members, or no publish could ever be "
            "confirmed",
            file=sys.stderr,
        )
        return 2
    loaded: dict[str, Any] = {}
    if args.config:
        try:
            loaded = config_mod.read(args.config)
        except (errors.ConfigError, OSError) as exc:
            print(f"tandem: {exc}", file=sys.stderr)
            return 2
        base = {k: v for k, v in loaded.items() if k not in cluster_mod.MEMBER_SETTINGS}
    tls_port = None
    if loaded.get("tls_certfile"):  # AMQPS on the front port too, at the configured port
        tls_port = args.tls_port if args.tls_port is not None else loaded.get("tls_port", 5671)
    elif args.tls_port is not None:
        print("tandem: --tls-port needs tls_certfile and tls_keyfile in --config", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s [cluster] %(name)s: %(message)s",
    )
    cluster = cluster_mod.LocalCluster(
        Path(args.data_dir).resolve(),
        args.replicas,
        amqp_port=args.amqp_port,
        admin_port=args.admin_port,
        isr_min=args.isr_min,
        failover_delay=args.failover_delay,
        base_config=base,
        tls_port=tls_port,
        admin_token=loaded.get("admin_token"),
    )
    try:
        asyncio.run(cluster_mod.up(cluster))
    except errors.DataDirGone as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 1
    except (errors.TandemError, OSError, RuntimeError) as exc:
        print(f"tandem: cannot start the cluster: {exc}", file=sys.stderr)
        return 1
    return 0


def _cluster_get(
    url: str, path: str, body: dict[str, Any] | None = None, token: str | None = None
) -> Any:
    headers = {"Content-Type": "application/json"}
    token = token or os.environ.get("TANDEM_ADMIN_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(
        url.rstrip("/") + path,
        method="GET" if body is None else "POST",
        data=None if body is None else json.dumps(body).encode(),
        headers=headers,
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


CLUSTER_COLUMNS = ("node", "role", "epoch", "position", "lag_records", "in_isr", "pid")


def _cluster_status(args: argparse.Namespace) -> int:
    try:
        answer = _cluster_get(args.url, "/cluster", token=args.token)
    except urllib.error.HTTPError as exc:
        print(f"tandem: {_http_error(exc, 'cluster status', {})}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"tandem: cannot reach the cluster at {args.url}: {exc}", file=sys.stderr)
        return 1
    try:
        cluster = ClusterStatus.model_validate(answer)
    except pydantic.ValidationError as exc:
        print(f"tandem: {args.url}/cluster is not a Tandem cluster: {exc}", file=sys.stderr)
        return 1
    if args.primary_pid:
        pid = next((m.pid for m in cluster.members if m.node == cluster.primary and m.pid), None)
        if pid is None:
            print("tandem: no primary serves right now", file=sys.stderr)
            return 1
        print(pid)
        return 0
    if args.format == "json":
        print(json.dumps(answer, indent=2))
        return 0
    print(
        f"primary: {cluster.primary}  epoch: {cluster.epoch}  isr: {','.join(cluster.isr)}  "
        f"front: {cluster.front.host}:{cluster.front.port}"
    )
    print(_table([m.model_dump(mode="json") for m in cluster.members], CLUSTER_COLUMNS))
    if cluster.last_change:
        print(f"last change: {cluster.last_change}")
    if cluster.last_decision:
        print(f"last decision: {cluster.last_decision}")
    for m in cluster.members:
        if m.diverged:
            print(f"{m.node} diverged: {m.diverged}")
    return 0


def _cluster_switchover(args: argparse.Namespace) -> int:
    try:
        answer = _cluster_get(
            args.url, "/cluster/switchover", {"to": args.to} if args.to else {}, args.token
        )
    except urllib.error.HTTPError as exc:
        print(f"tandem: {_http_error(exc, 'switchover', {})}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"tandem: cannot reach the cluster at {args.url}: {exc}", file=sys.stderr)
        return 1
    print(f"switching over to {answer['switchover_to']}")
    return 0


def _handover(args: argparse.Namespace) -> int:
    """A pod's preStop: wait until this member is no longer the primary (the operator tells
    the failover logic the pod is stopping, and it hands over to a member in sync), then let the pod
    stop. Never fails the hook: at the timeout the pod stops anyway, and the operator fails
    over as for any lost primary."""
    headers = {}
    key_file = Path(args.key_file)
    if key_file.exists():
        headers["Authorization"] = f"Bearer {key_file.read_text().strip()}"
    url = f"http://127.0.0.1:{args.admin_port}/status?brief=1"
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, headers=headers), timeout=2
            ) as r:
                role = NodeStatus.model_validate(json.loads(r.read())).role
        except (urllib.error.URLError, OSError, ValueError) as exc:
            print(f"tandem handover: the node does not answer ({exc}); stopping", flush=True)
            return 0
        if role != "primary":
            print(f"tandem handover: this node is {role}; stopping", flush=True)
            return 0
        time.sleep(0.2)  # polling a local endpoint; the operator moves the role meanwhile
    print(f"tandem handover: still primary after {args.timeout} s; stopping", flush=True)
    return 0


def _operator_run(args: argparse.Namespace) -> int:
    try:
        import kopf

        import tandem.operator.handlers  # noqa: F401 - importing it registers the handlers
        from tandem.operator import kube
    except ImportError as exc:
        print(
            f"tandem: the operator needs {exc.name}: "
            "python3 -m pip install -c constraints.txt -e '.[operator]'",
            file=sys.stderr,
        )
        return 1
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        kube.load_config()
    except Exception as exc:  # the client raises several kinds for a missing or bad config
        print(f"tandem: no Kubernetes API to talk to: {exc}", file=sys.stderr)
        return 1
    kopf.run(
        standalone=True,  # one operator replica; the Deployment runs exactly one
        clusterwide=args.all_namespaces,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness,
    )
    return 0


def _audit(args: argparse.Namespace) -> int:
    try:
        from tandem.audit import job
    except ImportError as exc:
        print(
            f"tandem audit needs {exc.name}, which is not installed: "
            "python3 -m pip install -c constraints.txt -e '.[audit]' (Java 17 or later too)",
            file=sys.stderr,
        )
        return 2
    return job.main(args)


def _operator_crd(args: argparse.Namespace) -> int:
    from tandem.operator import crd

    sys.stdout.write(crd.render())
    return 0


@dataclass(frozen=True, slots=True)
class Verb:
    """A `tandem ctl` verb: its admin API call, its arguments, and how its answer prints."""

    method: str
    path: str
    args: tuple[str, ...] = ()
    done: str = ""  # what a successful change prints
    columns: tuple[str, ...] = ()  # a listing prints these fields as a table
    headers: tuple[tuple[str, str], ...] = ()


CTL_VERBS: dict[str, Verb] = {
    # rabbitmqctl's verbs, on the admin API.
    "status": Verb("GET", "/status"),
    "list_users": Verb("GET", "/api/users", columns=("name", "tags")),
    "add_user": Verb(
        "PUT",
        "/api/users/{name}",
        ("name", "password"),
        "added user {name}",
        headers=(("If-None-Match", "*"),),
    ),
    "change_password": Verb(
        "PUT",
        "/api/users/{name}",
        ("name", "password"),
        "changed the password of user {name}",
        headers=(("If-Match", "*"),),
    ),
    "delete_user": Verb("DELETE", "/api/users/{name}", ("name",), "deleted user {name}"),
    "list_vhosts": Verb("GET", "/api/vhosts", columns=("name",)),
    "add_vhost": Verb("PUT", "/api/vhosts/{name}", ("name",), "added vhost {name}"),
    "delete_vhost": Verb("DELETE", "/api/vhosts/{name}", ("name",), "deleted vhost {name}"),
    "list_permissions": Verb(
        "GET", "/api/permissions", columns=("user", "vhost", "configure", "write", "read")
    ),
    "set_permissions": Verb(
        "PUT",
        "/api/permissions/{vhost}/{user}",
        ("user", "configure", "write", "read"),
        "set permissions of user {user} in vhost {vhost}",
    ),
    "clear_permissions": Verb(
        "DELETE",
        "/api/permissions/{vhost}/{user}",
        ("user",),
        "cleared permissions of user {user} in vhost {vhost}",
    ),
    "list_queues": Verb(
        "GET", "/api/queues", columns=("vhost", "name", "depth", "consumers", "replicate")
    ),
    "export_definitions": Verb("GET", "/api/definitions"),
}
STATUS_FIELDS = ("node", "role", "epoch", "position", "primary", "connections", "alarms")


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    """Tab-separated like rabbitmqctl's listings: a header line, then one line a row."""

    def cell(value: Any) -> str:
        return ",".join(map(str, value)) if isinstance(value, list) else str(value)

    lines = ["\t".join(columns)]
    lines += ["\t".join(cell(row.get(c, "")) for c in columns) for row in rows]
    return "\n".join(lines)


def _ctl(args: argparse.Namespace) -> int:
    verb = CTL_VERBS[args.verb]
    if len(args.args) != len(verb.args):
        usage = " ".join(n.upper() for n in verb.args) or "nothing"
        print(f"tandem ctl {args.verb} takes: {usage}", file=sys.stderr)
        return 2
    values = dict(zip(verb.args, args.args, strict=True))
    values["vhost"] = args.vhost
    path = verb.path.format(**{k: urllib.parse.quote(v, safe="") for k, v in values.items()})
    body: dict[str, Any] | None = None
    if args.verb == "add_user":
        body = {"password": values["password"], "tags": args.tags.split(",") if args.tags else []}
    elif args.verb == "change_password":
        body = {"password": values["password"]}
    elif args.verb == "set_permissions":
        body = {k: values[k] for k in ("configure", "write", "read")}
    req = urllib.request.Request(
        args.url.rstrip("/") + path,
        method=verb.method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json", **dict(verb.headers)},
    )
    token = args.token or os.environ.get("TANDEM_ADMIN_TOKEN")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            answer = json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        print(f"tandem ctl: {_http_error(exc, args.verb, values)}", file=sys.stderr)
        return 1
    except urllib.error.URLError as exc:
        print(f"tandem ctl: cannot reach {args.url}: {exc.reason}", file=sys.stderr)
        return 1
    if args.format == "json" or args.verb == "export_definitions":
        print(json.dumps(answer, indent=2))
    elif verb.columns:
        print(_table(answer, verb.columns))
    elif args.verb == "status":
        print("\n".join(f"{k}: {answer.get(k)}" for k in STATUS_FIELDS))
        print(_table(answer.get("queues", []), CTL_VERBS["list_queues"].columns))
    else:
        print(verb.done.format(**values))
    return 0


def _http_error(exc: urllib.error.HTTPError, verb: str, values: dict[str, str]) -> str:
    raw = exc.read().decode(errors="replace")
    try:
        text = str(json.loads(raw)["error"])
    except (ValueError, KeyError, TypeError):
        text = raw.strip() or exc.reason
    if exc.code == 401 and not os.environ.get("TANDEM_ADMIN_TOKEN"):
        text += " (give it with --token or TANDEM_ADMIN_TOKEN)"
    if exc.code == 409 and verb == "add_user":
        text += "; `tandem ctl change_password` sets a new password"
    return f"{exc.code}: {text}"


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0 to 65535; 0 picks a free one)")
    return value


def _members(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of members") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: a cluster needs at least one member")
    return value


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_LEVELS_HELP = "one of " + ", ".join(LOG_LEVELS)


def _log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"'{text}' is not a log level ({LOG_LEVELS_HELP})")
    return text.lower()


def _version() -> str:
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__)
    p.add_argument("--version", action="version", version=f"tandem {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "broker",
        help="run one broker node in the foreground",
        description="Run one broker node in the foreground. Options override the config file.",
    )
    b.add_argument("--amqp-port", type=_port, help="AMQP port (default 5672; 0 picks a free one)")
    b.add_argument(
        "--admin-port", type=_port, help="admin HTTP port (default 15672; 0 picks a free one)"
    )
    b.add_argument(
        "--data-dir", help="where the log and definitions live (default: none, memory only)"
    )
    b.add_argument("--node-id", help="this node's name (default tandem-1)")
    b.add_argument("--host", help="address the AMQP listeners bind (default 127.0.0.1)")
    b.add_argument("--config", help="YAML configuration file (docs/configuration.md)")
    b.add_argument(
        "--replication-port",
        type=_port,
        help="make this node a cluster member listening for replication here (0: a free port); "
        "it serves clients once the cluster's controller makes it primary",
    )
    b.add_argument(
        "--cluster-key-file", help="file holding the cluster's shared key (or TANDEM_CLUSTER_KEY)"
    )
    # Started by `cluster up` ahead of a restart: told on stdin which member to be.
    b.add_argument("--spare", action="store_true", help=argparse.SUPPRESS)
    b.set_defaults(func=_broker)
    cl = sub.add_parser(
        "cluster",
        help="the local HA cluster: N brokers behind one address",
        description="The local HA cluster (docs/failover.md).",
    )
    csub = cl.add_subparsers(dest="cluster_command", required=True)
    up = csub.add_parser(
        "up",
        help="run N brokers, the election and one front port in the foreground",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    up.add_argument("--replicas", type=_members, default=3, help="members")
    up.add_argument("--amqp-port", type=_port, default=5672, help="the front port for clients")
    up.add_argument("--admin-port", type=_port, default=15672, help="GET /cluster")
    up.add_argument("--data-dir", default="tandem-data", help="the cluster's data")
    up.add_argument(
        "--config",
        help="YAML settings every member takes (users, limits, TLS); relative paths in it are "
        "taken from its folder",
    )
    up.add_argument(
        "--tls-port",
        type=_port,
        help="the front port for AMQPS (default: the config's tls_port, else 5671; needs TLS "
        "in --config)",
    )
    up.add_argument("--isr-min", type=int, help="ISR minimum (default 2, or 1 for one member)")
    up.add_argument(
        "--failover-delay", type=float, default=1.0, help="seconds a silent primary has"
    )
    up.add_argument("--log-level", type=_log_level, default="info", help=LOG_LEVELS_HELP)
    up.set_defaults(func=_cluster_up)
    for name, fn, helptext in (
        ("status", _cluster_status, "a table of the members"),
        ("switchover", _cluster_switchover, "hand the primary role over"),
    ):
        cp = csub.add_parser(name, help=helptext)
        cp.add_argument(
            "--url",
            default=os.environ.get("TANDEM_CLUSTER_URL", "http://127.0.0.1:15672"),
            help="the cluster's admin address (or TANDEM_CLUSTER_URL)",
        )
        cp.add_argument(
            "--token", help="the admin token, if the config sets one (or TANDEM_ADMIN_TOKEN)"
        )
        cp.set_defaults(func=fn)
        if name == "status":
            cp.add_argument("--format", choices=("table", "json"), default="table")
            cp.add_argument(
                "--primary-pid", action="store_true", help="print only the primary's pid"
            )
        else:
            cp.add_argument("--to", help="the member to promote (default: one in sync)")

    op = sub.add_parser(
        "operator", help="the Kubernetes operator: run it, or print its CRD (docs/kubernetes.md)"
    )
    osub = op.add_subparsers(dest="operator_command", required=True)
    run = osub.add_parser("run", help="run the operator (in a cluster, or on a kubeconfig)")
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    where.add_argument("--namespace", action="append", help="watch this namespace (repeatable)")
    run.add_argument(
        "--liveness", help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz"
    )
    run.add_argument("--log-level", type=_log_level, default="info", help=LOG_LEVELS_HELP)
    run.set_defaults(func=_operator_run)
    crd_cmd = osub.add_parser("crd", help="print the BrokerCluster CRD (crds/brokercluster.yaml)")
    crd_cmd.set_defaults(func=_operator_crd)

    a = sub.add_parser(
        "audit",
        help="check with Spark that every backup holds what the primary holds (docs/audit.md)",
        description="Compare every member's queue depths with the primary's at the same log "
        "position; exit 1 when one diverged, lags past the limits or does not answer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    where = a.add_mutually_exclusive_group(required=True)
    where.add_argument("--cluster", help="a local cluster's admin URL (reads its /cluster)")
    where.add_argument("--members", help="members' admin URLs, comma-separated")
    where.add_argument(
        "--kubernetes", metavar="NAME[.NAMESPACE]", help="a BrokerCluster (its headless Service)"
    )
    a.add_argument("--out", default="tandem-audit", help="where the report goes")
    a.add_argument("--history", help="a directory the audit appends to, for trends")
    a.add_argument("--history-format", choices=("parquet", "json"), default="parquet")
    a.add_argument(
        "--master",
        help="the Spark master (default: spark-submit's when run by it, else local[2])",
    )
    a.add_argument("--max-lag-records", type=int, default=100_000, help="LAG_EXCEEDED past it")
    a.add_argument("--max-lag-seconds", type=float, default=30.0, help="LAG_EXCEEDED past it")
    a.add_argument("--token", help="admin token, if the members require one")
    a.add_argument(
        "--checkpoint", action="store_true", help="ask the primary for a fresh checkpoint first"
    )
    a.add_argument("--textfile", help="write the figures as a Prometheus textfile here")
    a.add_argument("--pushgateway", help="push the figures to this Prometheus Pushgateway")
    a.set_defaults(func=_audit)

    h = sub.add_parser(
        "handover",
        help="a primary pod's preStop: wait until the primary role has moved elsewhere",
    )
    h.add_argument("--admin-port", type=_port, default=15672)
    h.add_argument("--key-file", default="/etc/tandem/cluster/key", help="the cluster key")
    h.add_argument("--timeout", type=float, default=25.0, help="seconds to wait at most")
    h.set_defaults(func=_handover)

    c = sub.add_parser(
        "ctl",
        help="manage a running node (users, vhosts, permissions)",
        description="Manage a running node with rabbitmqctl's verbs, through its admin API.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    c.add_argument("verb", choices=sorted(CTL_VERBS))
    c.add_argument("args", nargs="*")
    c.add_argument(
        "--url",
        default=os.environ.get("TANDEM_ADMIN_URL", "http://127.0.0.1:15672"),
        help="the node's admin URL (or TANDEM_ADMIN_URL)",
    )
    c.add_argument("--token", help="admin token (or TANDEM_ADMIN_TOKEN)")
    c.add_argument("-p", "--vhost", default="/", help="vhost for permissions")
    c.add_argument("--tags", help="comma-separated user tags for add_user")
    c.add_argument("--format", choices=("table", "json"), default="table", help="how answers print")
    c.set_defaults(func=_ctl)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra:
        # `ctl VERB -p VHOST ARGS...`: positionals after an option arrive here.
        if args.command != "ctl" or any(e.startswith("-") and e != "-" for e in extra):
            p.error(f"unrecognized arguments: {' '.join(extra)}")
        args.args += extra
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
