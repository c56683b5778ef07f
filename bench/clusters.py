"""The two clusters the HA benchmarks compare, each on this machine: a 3-member Tandem local
cluster (`tandem cluster up`) and a 3-node RabbitMQ cluster for quorum queues.

RabbitMQ's three nodes run side by side with their own RABBITMQ_NODENAME, RABBITMQ_NODE_PORT,
RABBITMQ_DIST_PORT, RABBITMQ_MNESIA_BASE, RABBITMQ_LOG_BASE and RABBITMQ_PID_FILE; nodes 2 and
3 join node 1 with `rabbitmqctl -n NODE stop_app; reset; join_cluster rabbit1@HOST; start_app`.
The same user's Erlang cookie lets them talk. Everything lives in a temporary directory that
`stop()` removes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(ok: Any, what: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = ok()
            if value:
                return value
        except (OSError, ValueError, KeyError, StopIteration):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed node's process may wait to be reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def keep_if_failed(data: Path, output: Path, what: str, failed: bool, lines: int = 40) -> None:
    """After a run: delete `data`; after a failed one (a run that cannot finish is a bug),
    keep it and show the end of `output`, which says why."""
    if not failed:
        shutil.rmtree(data, ignore_errors=True)
        return
    tail = output.read_text(errors="replace").splitlines()[-lines:]
    print(f"{what} ({data}, kept), its end:", *tail, sep="\n  ")


class TandemCluster:
    def __init__(self, replicas: int = 3, env: dict[str, str] | None = None, *args: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-ha-bench-"))
        self.env = env
        self.log = open(self.dir / "cluster.log", "wb")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tandem.cli",
                "cluster",
                "up",
                "--replicas",
                str(replicas),
                "--amqp-port",
                "0",
                "--admin-port",
                "0",
                "--data-dir",
                str(self.dir / "data"),
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        info = _wait(lambda: json.loads((self.dir / "data" / "cluster.json").read_text()), "tandem")
        self.port, self.admin = info["amqp"], info["admin"]
        self.replicas = replicas
        self.wait_healthy()

    @property
    def urls(self) -> list[str]:
        return [f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"]

    def state(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/cluster", timeout=5) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def wait_healthy(self) -> dict[str, Any]:
        return _wait(  # type: ignore[no-any-return]
            lambda: (s := self.state())["serving"] and len(s["isr"]) == self.replicas and s,
            "a full ISR",
        )

    def leader_pid(self) -> int:
        s = self.state()
        return int(next(m["pid"] for m in s["members"] if m["node"] == s["primary"]))

    def wait_new_leader(self, old_pid: int) -> None:
        _wait(lambda: self.state()["serving"] and self.leader_pid() != old_pid, "a new primary")

    def rejoined(self, node: str, deadline: float) -> float | None:
        """Seconds from now until `node` (just killed) is in the in-sync set again and
        answering, or None if not by `deadline` (time.monotonic())."""
        start = time.monotonic()
        gone = False
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                s = self.state()
                member = next(m for m in s["members"] if m["node"] == node)
                gone = gone or node not in s["isr"] or member.get("role") != "primary"
                if gone and node in s["isr"] and member.get("role") == "backup":
                    return time.monotonic() - start
            time.sleep(0.05)  # polling the cluster's admin port
        return None

    def recover(self, pid: int) -> None:
        """After a kill: the cluster restarts the member itself; wait until it is in sync."""
        self.wait_healthy()

    def stop(self, failed: bool = False) -> None:
        """Stop the cluster and delete its data; after a failed run, keep them and show the
        end of its log, which says what the cluster decided."""
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)
        self.log.close()
        keep_if_failed(self.dir, self.dir / "cluster.log", "tandem cluster log", failed)


class RabbitCluster:
    def __init__(self, nodes: int = 3) -> None:
        if shutil.which("rabbitmq-server") is None:
            raise SystemExit("rabbitmq-server is not installed (apt-get install rabbitmq-server)")
        self.dir = Path(tempfile.mkdtemp(prefix="rabbit-bench-"))
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [f"rabbit{i}" for i in range(1, nodes + 1)]
        self.ports = {n: _free_port() for n in self.nodes}
        self.dist = {n: _free_port() for n in self.nodes}
        for n in self.nodes:
            self.start(n)
        for n in self.nodes[1:]:
            for cmd in ("stop_app", "reset", f"join_cluster rabbit1@{self.host}", "start_app"):
                self.ctl(n, *cmd.split())

    def env(self, node: str) -> dict[str, str]:
        base = self.dir / node
        return {
            **os.environ,
            "RABBITMQ_NODENAME": f"{node}@{self.host}",
            "RABBITMQ_NODE_PORT": str(self.ports[node]),
            "RABBITMQ_DIST_PORT": str(self.dist[node]),
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_PID_FILE": str(base / "pid"),
            # No plugins: nothing else wants a port (management, prometheus).
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
        }

    def start(self, node: str) -> None:
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / node).mkdir(parents=True, exist_ok=True)
        (self.dir / node / "pid").unlink(missing_ok=True)  # a killed node's stale pid
        # Debian's wrappers run the server and rabbitmqctl as the rabbitmq user.
        subprocess.run(["chown", "-R", "rabbitmq:rabbitmq", str(self.dir)], check=False)
        subprocess.run(["rabbitmq-server", "-detached"], env=self.env(node), check=True)
        self.ctl(node, "wait", str(self.dir / node / "pid"), "--timeout", "120")
        self.ctl(node, "await_startup", "--timeout", "120")

    def ctl(self, node: str, *args: str) -> str:
        out = subprocess.run(
            ["rabbitmqctl", "-n", f"{node}@{self.host}", *args],
            env=self.env(node),
            capture_output=True,
            text=True,
            timeout=180,
        )
        if out.returncode != 0:
            raise SystemExit(f"rabbitmqctl {' '.join(args)} on {node}: {out.stderr}{out.stdout}")
        return out.stdout

    def pid(self, node: str) -> int:
        return int((self.dir / node / "pid").read_text().strip())

    @property
    def urls(self) -> list[str]:
        return [f"amqp://guest:guest@127.0.0.1:{self.ports[n]}/%2F" for n in self.nodes]

    @property
    def pids(self) -> list[int]:
        return [self.pid(n) for n in self.nodes]

    def leader(self, queue: str) -> str:
        for n in self.nodes:
            try:
                out = self.ctl(n, "list_queues", "name", "leader", "--quiet", "--no-table-headers")
            except SystemExit:
                continue
            for line in out.splitlines():
                name, _, leader = line.partition("\t")
                if name == queue and leader:
                    return leader.split("@")[0]
        raise SystemExit(f"no leader for {queue}")

    def node_of_pid(self, pid: int) -> str:
        return next(n for n in self.nodes if self.pid(n) == pid)

    def recover(self, pid: int) -> None:
        """Restart a killed node (it rejoins its cluster) and wait until every node runs."""
        node = self.node_of_pid(pid)
        if not _running(pid):
            self.start(node)
        for n in self.nodes:
            self.ctl(n, "await_startup", "--timeout", "120")

    def stop(self) -> None:
        for n in self.nodes:
            subprocess.run(
                ["rabbitmqctl", "-n", f"{n}@{self.host}", "stop"],
                env=self.env(n),
                capture_output=True,
                timeout=120,
            )
        shutil.rmtree(self.dir, ignore_errors=True)
