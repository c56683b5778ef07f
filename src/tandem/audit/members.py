"""Where the members are, and what each one answers: plain HTTP, no Spark.

The audit reads each member's `GET /replication/checkpoints` (the per-queue depths it recorded
at every audit checkpoint it applied) and `GET /status` (its role). A member that does not
answer, or answers something that is not a Tandem member's checkpoints, becomes one row that
says so, so the audit reports it instead of failing.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pydantic

from tandem.broker.status import ClusterStatus, NodeStatus

TIMEOUT = 5.0
ADMIN_PORT = 15672  # a member's admin port on Kubernetes (the StatefulSet's container port)

# One row of the checkpoints source; `queue` is null on the row that stands for a checkpoint
# itself (so that a checkpoint without queues still shows), every field but node, url,
# reachable and error is null on the row of a member that did not answer.
SCHEMA = (
    "node string, url string, role string, reachable boolean, error string, epoch long, "
    "position long, time double, recorded_at double, vhost string, queue string, depth long, "
    "replicate string"
)
Row = tuple[Any, ...]


class DiscoveryError(Exception):
    """The members cannot be found; the message says where the audit looked."""


def _get(url: str, token: str | None) -> Any:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=TIMEOUT) as resp:
        return json.loads(resp.read())


def from_cluster(url: str, token: str | None = None) -> list[str]:
    """The members of a local cluster (`tandem cluster up`), from its GET /cluster."""
    try:
        answer = _get(url.rstrip("/") + "/cluster", token)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DiscoveryError(
            f"cannot read the cluster's members from {url}/cluster: {exc}"
        ) from None
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    try:
        members = ClusterStatus.model_validate(answer).members
    except pydantic.ValidationError:
        raise DiscoveryError(f"{url}/cluster does not answer like a Tandem cluster") from None
    return [f"http://{host}:{m.admin_port}" for m in members if m.admin_port]


def from_kubernetes(name: str, namespace: str = "default") -> list[str]:
    """The members of a BrokerCluster: the addresses behind its headless Service."""
    host = f"{name}-members.{namespace}.svc"
    try:
        found = socket.getaddrinfo(host, ADMIN_PORT, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise DiscoveryError(
            f"cannot resolve {host} (the BrokerCluster's members): {exc}"
        ) from None
    addresses = sorted({str(info[4][0]) for info in found})
    return [f"http://{f'[{a}]' if ':' in a else a}:{ADMIN_PORT}" for a in addresses]


def read_member(url: str, token: str | None = None) -> list[Row]:
    """Every row one member contributes: its checkpoints and their queues, or why not."""
    base = url.rstrip("/")
    try:
        status = _get(base + "/status?brief=1", token)
        answer = _get(base + "/replication/checkpoints", token)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:200]
        return [_unreachable(base, f"answered {exc.code}: {detail}")]
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return [_unreachable(base, f"does not answer: {reason}")]
    except ValueError:
        return [_unreachable(base, "answered something that is not JSON")]
    try:
        node, role = str(answer["node"]), NodeStatus.model_validate(status).role
        rows: list[Row] = []
        for cp in answer["checkpoints"]:
            head = (node, base, role, True, None, int(cp["epoch"]), int(cp["position"]))
            times = (float(cp["time"]), float(cp["recorded_at"]))
            rows.append((*head, *times, None, None, None, None))
            for q in cp["depths"]:
                queue = (str(q["vhost"]), str(q["queue"]), int(q["depth"]), str(q["replicate"]))
                rows.append((*head, *times, *queue))
    except (KeyError, TypeError, ValueError) as exc:
        return [_unreachable(base, f"answered something unexpected ({exc!r} missing or wrong)")]
    if not rows:  # a member with no checkpoint yet still shows, with its role
        rows.append((node, base, role, True, None, None, None, None, None, None, None, None, None))
    return rows


def _unreachable(url: str, error: str) -> Row:
    node = urllib.parse.urlsplit(url).netloc or url  # its name is unknown: its address
    return (node, url, None, False, error, None, None, None, None, None, None, None, None)


def request_checkpoint(urls: list[str], token: str | None = None) -> str | None:
    """Ask each member for a checkpoint now; the primary makes one (the others refuse).
    Returns its "epoch:position", or None when no member took it."""
    for url in urls:
        request = urllib.request.Request(url.rstrip("/") + "/replication/checkpoints", data=b"")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as resp:
                cp = json.loads(resp.read())
                return f"{cp['epoch']}:{cp['position']}"
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
            continue
    return None
