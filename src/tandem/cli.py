"""`tandem broker | ctl`: the command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tandem import errors


def _broker(args: argparse.Namespace) -> int:
    from tandem.broker import config as config_mod
    from tandem.broker.node import Node

    try:
        cfg = config_mod.load(args.config) if args.config else config_mod.Config()
    except errors.ConfigError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
    if args.amqp_port is not None:
        cfg.amqp_port = args.amqp_port
    if args.admin_port is not None:
        cfg.admin_port = args.admin_port
    if args.data_dir is not None:
        cfg.data_dir = Path(args.data_dir)
    if args.node_id is not None:
        cfg.node_id = args.node_id
    if args.host is not None:
        cfg.host = args.host
    if cfg.data_dir is not None:
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=getattr(logging, cfg.log_level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [{cfg.node_id}] %(name)s: %(message)s",
    )
    try:
        node = Node(cfg)
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            asyncio.run(node.run())
        else:
            uvloop.run(node.run())
    except errors.ConfigError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"tandem: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


CTL_VERBS: dict[str, tuple[str, str, list[str]]] = {
    # verb: (method, path template, argument names)
    "status": ("GET", "/status", []),
    "list_users": ("GET", "/api/users", []),
    "add_user": ("PUT", "/api/users/{name}", ["name", "password"]),
    "delete_user": ("DELETE", "/api/users/{name}", ["name"]),
    "list_vhosts": ("GET", "/api/vhosts", []),
    "add_vhost": ("PUT", "/api/vhosts/{name}", ["name"]),
    "delete_vhost": ("DELETE", "/api/vhosts/{name}", ["name"]),
    "list_permissions": ("GET", "/api/permissions", []),
    "set_permissions": (
        "PUT",
        "/api/permissions/{vhost}/{user}",
        ["user", "configure", "write", "read"],
    ),
    "clear_permissions": ("DELETE", "/api/permissions/{vhost}/{user}", ["user"]),
    "list_queues": ("GET", "/api/queues", []),
    "export_definitions": ("GET", "/api/definitions", []),
}


def _ctl(args: argparse.Namespace) -> int:
    method, template, names = CTL_VERBS[args.verb]
    if len(args.args) != len(names):
        print(
            f"tandem ctl {args.verb} takes: {' '.join(n.upper() for n in names) or 'nothing'}",
            file=sys.stderr,
        )
        return 2
    values = dict(zip(names, args.args, strict=True))
    values["vhost"] = args.vhost
    path = template.format(**{k: urllib.parse.quote(v, safe="") for k, v in values.items()})
    body: dict[str, Any] | None = None
    if args.verb == "add_user":
        body = {"password": values["password"], "tags": args.tags.split(",") if args.tags else []}
    elif args.verb == "set_permissions":
        body = {k: values[k] for k in ("configure", "write", "read")}
    req = urllib.request.Request(
        args.url.rstrip("/") + path,
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    token = args.token or os.environ.get("TANDEM_ADMIN_TOKEN")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            print(json.dumps(json.loads(resp.read() or b"null"), indent=2))
            return 0
    except urllib.error.HTTPError as exc:
        print(f"tandem ctl: {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except urllib.error.URLError as exc:
        print(f"tandem ctl: cannot reach {args.url}: {exc.reason}", file=sys.stderr)
        return 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("broker", help="run one broker node in the foreground")
    b.add_argument("--amqp-port", type=int, help="AMQP port (0 picks a free one)")
    b.add_argument("--admin-port", type=int, help="admin HTTP port (0 picks a free one)")
    b.add_argument("--data-dir", help="where the log and definitions live (none: memory only)")
    b.add_argument("--node-id", help="this node's name")
    b.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    b.add_argument("--config", help="YAML configuration file")
    b.set_defaults(func=_broker)
    c = sub.add_parser("ctl", help="manage a running node (users, vhosts, permissions)")
    c.add_argument("verb", choices=sorted(CTL_VERBS))
    c.add_argument("args", nargs="*")
    c.add_argument("--url", default="http://127.0.0.1:15672", help="the node's admin URL")
    c.add_argument("--token", help="admin token (or TANDEM_ADMIN_TOKEN)")
    c.add_argument("-p", "--vhost", default="/", help="vhost for permissions")
    c.add_argument("--tags", default="", help="comma-separated user tags for add_user")
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
