"""The local cluster's members: child processes, and the HA loop's ports on them.

`Supervisor` starts each member as a `tandem broker` process and restarts one that exits (as
a backup: every member starts as one). `HttpObserver` judges liveness as DESIGN asks, on the
controller's own clock: a process that exited is down at once; otherwise a member is up while
it answers `GET /status` and silent (for how long) while it does not. `HttpActuator` sends the
controller's commands to `/ha/*` with the cluster key.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tandem.ha.model import ElectionRecord, Liveness, Member, Position, Role

log = logging.getLogger(__name__)

STATUS_TIMEOUT = 0.4  # a poll that takes longer counts as no answer
COMMAND_TIMEOUT = 2.0
RENEW_SECONDS = 1.0
RESTART_DELAY = 0.5  # after a member exits, before it is started again (doubling to 10 s)


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends it SIGTERM when the cluster process dies
    (even by kill -9), so no member outlives its cluster holding its data dir."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


PR_SET_PDEATHSIG = 1


@dataclass(slots=True)
class Proc:
    """One member process and what the controller last saw of it."""

    node: str
    data_dir: Path
    amqp_port: int = 0
    admin_port: int = 0
    replication_port: int = 0
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    last_answer: float = 0.0
    status: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def front_socket(self) -> Path:
        return self.data_dir / "front.sock"


class Supervisor:
    """Starts the members and keeps them running."""

    def __init__(
        self,
        procs: dict[str, Proc],
        key_file: Path,
        base_config: dict[str, Any],
        on_exit: Callable[[Proc], None],
    ) -> None:
        self.procs = procs
        self.key_file = key_file
        self.base_config = base_config
        self.on_exit = on_exit
        self.stopping = False

    async def start(self, proc: Proc) -> None:
        proc.data_dir.mkdir(parents=True, exist_ok=True)
        cfg = {
            **self.base_config,
            "node_id": proc.node,
            "data_dir": str(proc.data_dir),
            "amqp_port": proc.amqp_port,
            "admin_port": proc.admin_port,
            "replication_port": proc.replication_port,
            "cluster_key_file": str(self.key_file),
            "front_socket": str(proc.front_socket),
        }
        config = proc.data_dir / "member.yaml"
        config.write_text(yaml.safe_dump(cfg))
        ports = proc.data_dir / "ports.json"
        with contextlib.suppress(FileNotFoundError):
            ports.unlink()
        out = open(proc.data_dir / "broker.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            proc.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tandem.cli",
                "broker",
                "--config",
                str(config),
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        finally:
            out.close()
        proc.started = time.monotonic()
        while not ports.exists():  # the member writes its ports once it listens
            if proc.process.returncode is not None:
                raise RuntimeError(
                    f"member {proc.node} exited at start; see {proc.data_dir / 'broker.log'}"
                )
            await asyncio.sleep(0.02)
        info = json.loads(ports.read_text())
        proc.amqp_port, proc.admin_port = info["amqp"], info["admin"]
        proc.replication_port = info["replication"]
        log.info(
            "member %s started: pid %d, amqp %d, admin %d, replication %d",
            proc.node,
            proc.process.pid,
            proc.amqp_port,
            proc.admin_port,
            proc.replication_port,
        )

    async def keep(self, proc: Proc) -> None:
        """Restart the member whenever it exits, until the cluster stops."""
        delay = RESTART_DELAY
        while not self.stopping:
            assert proc.process is not None
            code = await proc.process.wait()
            if self.stopping:
                return
            log.warning("member %s exited with %s; restarting it as a backup", proc.node, code)
            self.on_exit(proc)
            await asyncio.sleep(delay)  # a member that exits at once is not restarted in a loop
            if self.stopping:
                return
            delay = RESTART_DELAY if time.monotonic() - proc.started > 30 else min(delay * 2, 10)
            try:
                await self.start(proc)
                proc.restarts += 1
            except (RuntimeError, OSError) as exc:
                log.error("cannot restart member %s: %s", proc.node, exc)

    async def stop(self) -> None:
        self.stopping = True
        for proc in self.procs.values():
            if proc.alive:
                assert proc.process is not None
                with contextlib.suppress(ProcessLookupError):
                    proc.process.terminate()
        for proc in self.procs.values():
            if proc.process is not None:
                try:
                    await asyncio.wait_for(proc.process.wait(), 15)
                except TimeoutError:
                    proc.process.kill()
                    await proc.process.wait()


class HttpObserver:
    """Implements ha.ports.Observer over each member's /status."""

    def __init__(
        self,
        procs: dict[str, Proc],
        session: aiohttp.ClientSession,
        key: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.procs = procs
        self.session = session
        self.headers = {"Authorization": f"Bearer {key}"}
        self.clock = clock

    async def _poll(self, proc: Proc) -> None:
        if not proc.alive or not proc.admin_port:
            return
        url = f"http://127.0.0.1:{proc.admin_port}/status?brief=1"
        try:
            async with self.session.get(
                url, headers=self.headers, timeout=aiohttp.ClientTimeout(total=STATUS_TIMEOUT)
            ) as resp:
                if resp.status == 200:
                    proc.status = await resp.json()
                    proc.last_answer = self.clock()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass

    async def observe(self, record: ElectionRecord) -> tuple[Member, ...]:
        procs = list(self.procs.values())
        before = {p.node: p.last_answer for p in procs}
        await asyncio.gather(*(self._poll(p) for p in procs))
        now = self.clock()
        primary = self.procs.get(record.holder or "")
        report: dict[str, Any] = {}
        if primary is not None and primary.last_answer != before.get(primary.node):
            report = primary.status.get("members") or {}
        members = []
        for p in procs:
            if not p.alive:
                members.append(Member(p.node, Liveness.DOWN))
                continue
            answered = p.last_answer != before[p.node]
            if not answered:
                since = max(p.last_answer, p.started)
                members.append(Member(p.node, Liveness.SILENT, silent_for=now - since))
                continue
            s = p.status
            r = report.get(p.node, {})
            members.append(
                Member(
                    p.node,
                    Liveness.UP,
                    Role(s["role"]) if s.get("role") in ("primary", "backup") else Role.BACKUP,
                    int(s.get("epoch", 0)),
                    Position(int(s.get("last_epoch", 0)), int(s.get("position", 0))),
                    following=s.get("following"),
                    caught_up=bool(r.get("caught_up")),
                    waited=bool(r.get("waited")),
                    applied_version=int(s.get("applied_version", 0)),
                    lag_records=int(r.get("lag_records", 0)),
                    lag_seconds=float(r.get("lag_seconds", 0.0)),
                    whole=bool(s.get("whole", True)),
                )
            )
        return tuple(members)


class HttpActuator:
    """Implements ha.ports.Actuator over each member's /ha/* commands."""

    def __init__(
        self,
        procs: dict[str, Proc],
        session: aiohttp.ClientSession,
        key: str,
        link_address: Callable[[Proc], str] | None = None,
    ) -> None:
        self.procs = procs
        self.session = session
        # Where the others reach a member's replication listener (a proxy may stand there).
        self.link_address = link_address or (lambda p: f"127.0.0.1:{p.replication_port}")
        self.headers = {"Authorization": f"Bearer {key}"}
        self.renewed: tuple[int, float] = (-1, 0.0)

    async def _post(self, node: str, command: str, body: dict[str, Any]) -> bool:
        proc = self.procs.get(node)
        if proc is None or not proc.alive:
            return False
        url = f"http://127.0.0.1:{proc.admin_port}/ha/{command}"
        try:
            async with self.session.post(
                url,
                json=body,
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=COMMAND_TIMEOUT),
            ) as resp:
                if resp.status != 200:
                    log.warning("%s %s: %s %s", node, command, resp.status, await resp.text())
                    return False
                proc.status.update(await resp.json())
                return True
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("%s %s: %r", node, command, exc)
            return False

    async def fence(self, node: str, epoch: int) -> None:
        await self._post(node, "fence", {"epoch": epoch})

    async def promote(self, node: str, record: ElectionRecord) -> None:
        await self._post(node, "promote", {"record": record.to_dict()})

    async def follow(self, node: str, primary: str, epoch: int) -> None:
        p = self.procs[primary]
        body = {
            "primary": primary,
            "epoch": epoch,
            "address": self.link_address(p),
            "amqp": f"127.0.0.1:{p.amqp_port}",
        }
        await self._post(node, "follow", body)

    async def set_isr(self, primary: str, record: ElectionRecord) -> None:
        if await self._post(primary, "record", {"record": record.to_dict()}):
            self.renewed = (record.version, time.monotonic())

    async def renew(self, primary: str, record: ElectionRecord) -> None:
        version, when = self.renewed
        if version == record.version and time.monotonic() - when < RENEW_SECONDS:
            return
        await self.set_isr(primary, record)


class WakeableClock:
    """Implements ha.ports.Clock; a member's exit cuts the loop's sleep short."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), seconds)
        self.wake.clear()
