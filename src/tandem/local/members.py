"""The local cluster's members: child processes.

`Supervisor` starts each member as a `tandem broker` process and restarts one that exits (as
a backup: every member starts as one). A `Proc` is the `broker.ha_http.Endpoint` the HA loop's
HTTP ports observe and command; its process exit is what makes it down at once.

A restart takes a spare: a `tandem broker --spare` process started beforehand, which has
imported the broker and waits to be told which member it is. A new interpreter spent about
0.4 s importing under load, on the same cores as the new primary its clients were
reconnecting to; the spare for the next restart is made SPARE_DELAY later, once every
member that runs is in the ISR (at most SPARE_MOST_DELAY later): its import took a share of
the two cores from a backup that was catching up with a deep queue under load.
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

RESTART_DELAY = 0.1  # after a member exits, before it is started again (killed: at most)
SPARE_DELAY = 2.0  # after a spare is taken (or the members started), before the next is made
SPARE_MOST_DELAY = 10.0  # ... and at most this long while a member is not in the ISR
SPARE_LOOK = 0.1  # how often the cluster is looked at meanwhile
MAX_RESTART_DELAY = 10.0
STEADY_SECONDS = 30.0  # a member that ran this long before it exited was not crash-looping


def restart_delay(previous: float | None, code: int, ran: float, started: bool = True) -> float:
    """How long to wait before starting again a member that exited with `code` after `ran`
    seconds, the wait before its last start having been `previous` (None: its first exit);
    `started` False when that start failed (a full disk, no file descriptors): the exit is
    still the last life's, and the wait doubles as for a member failing on its own.

    The wait doubles, up to MAX_RESTART_DELAY, only for a member that fails on its own and
    soon: a bad setting or a store it cannot open would otherwise restart in a tight loop. A
    member killed from outside (SIGKILL: kill -9, the OOM killer) waits no longer however
    often it is killed, so that it rejoins the in-sync set in time for the next failure; it
    waits less (`Supervisor.keep`: until the controller has seen it gone)."""
    if started and (previous is None or code == -signal.SIGKILL or ran >= STEADY_SECONDS):
        return RESTART_DELAY
    return min((previous or RESTART_DELAY) * 2, MAX_RESTART_DELAY)


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends it SIGTERM when the cluster process dies
    (even by kill -9), so no member outlives its cluster holding its data dir. The C library
    is loaded beforehand: the child of a threaded parent should not load libraries."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)


@dataclass(slots=True)
class Proc:
    """One member process and what the controller last saw of it."""

    node: str
    data_dir: Path
    amqp_port: int = 0
    admin_port: int = 0
    replication_port: int = 0
    tls_port: int | None = None  # its own AMQPS port, when the cluster has TLS
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    last_answer: float = 0.0
    status: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def admin_address(self) -> str | None:
        return f"127.0.0.1:{self.admin_port}" if self.admin_port else None

    @property
    def replication_address(self) -> str:
        return f"127.0.0.1:{self.replication_port}"

    @property
    def amqp_address(self) -> str:
        return f"127.0.0.1:{self.amqp_port}"

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
        settled: Callable[[], bool] = lambda: True,
        looked: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_back: Callable[[Proc], None] = lambda proc: None,
    ) -> None:
        self.procs = procs
        self.key_file = key_file
        self.base_config = base_config
        self.on_exit = on_exit
        self.settled = settled  # whether every member that runs is in the ISR
        # Returns once the controller has looked at the cluster since, or after at most the
        # seconds given (WakeableClock.looked).
        self.looked = looked
        self.on_back = on_back  # a member restarted: recovered, and listening
        self.stopping = False
        self.spare: asyncio.subprocess.Process | None = None
        self.making_spare: asyncio.Task[None] | None = None

    def spare_soon(self) -> None:
        """Make a spare process SPARE_DELAY from now, or once the members are settled
        after that, unless one is being made."""
        if self.stopping:
            return
        if self.making_spare is None or self.making_spare.done():
            self.making_spare = asyncio.get_running_loop().create_task(self._make_spare())

    async def _make_spare(self) -> None:
        until = time.monotonic() + SPARE_MOST_DELAY
        await asyncio.sleep(SPARE_DELAY)
        while not self.settled() and time.monotonic() < until:
            await asyncio.sleep(SPARE_LOOK)
        if self.stopping or (self.spare is not None and self.spare.returncode is None):
            return
        try:
            # Its output is the cluster's until it is a member's (`tandem broker --spare`).
            self.spare = await asyncio.create_subprocess_exec(
                *(sys.executable, "-m", "tandem.cli", "broker", "--spare"),
                stdin=asyncio.subprocess.PIPE,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:  # the next restart starts a process of its own
            log.warning("cannot start a spare member process: %s", exc)

    def _take_spare(
        self, config: Path, out: Path, hold: bool = False
    ) -> asyncio.subprocess.Process | None:
        """The spare, told to run as the member configured in `config`, writing to `out`;
        None when there is none alive. Told to `hold`, it waits for a second line before it
        starts (`start`)."""
        spare, self.spare = self.spare, None
        if spare is None or spare.returncode is not None or spare.stdin is None:
            return None
        told = {"config": str(config), "output": str(out), "hold": hold}
        spare.stdin.write(json.dumps(told).encode() + b"\n")  # a pipe holds far more
        if not hold:
            spare.stdin.close()
        return spare

    def _hold_spare(self, proc: Proc) -> asyncio.subprocess.Process | None:
        """The spare, told to become `proc` (which exited) and to wait to start: it reads
        its log's end meanwhile (`Node.prepare`), while the controller is to see the member
        gone, and says Hello as soon as it is started (0.03-0.12 s of a rejoin under load,
        with 13,000-52,000 records after its checkpoint). None without a spare."""
        if self.spare is None or self.spare.returncode is not None:
            return None
        try:
            config = self._configure(proc)
        except OSError as exc:  # `start` meets it again and says so
            log.debug("member %s not configured ahead: %s", proc.node, exc)
            return None
        return self._take_spare(config, proc.data_dir / "broker.log", hold=True)

    async def start(self, proc: Proc, held: asyncio.subprocess.Process | None = None) -> None:
        """Start `proc`: as `held` (`_hold_spare`) when it is still waiting, else as the
        spare or a new process."""
        if held is not None and held.returncode is None and held.stdin is not None:
            held.stdin.write(b"go\n")
            held.stdin.close()
            proc.process = held
        else:  # none held, or it ended (it says why in the member's output)
            await self._spawn_or_take(proc, self._configure(proc))
        await self._started(proc)

    def _configure(self, proc: Proc) -> Path:
        """Write `proc`'s config file; its ports file, written again once it listens, goes."""
        proc.data_dir.mkdir(exist_ok=True)  # not its parent: the cluster's, never made again
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
        if cfg.get("tls_certfile"):
            cfg["tls_port"] = proc.tls_port or 0  # its own; the front port has the shared one
        config = proc.data_dir / "member.yaml"
        config.write_text(yaml.safe_dump(cfg))
        with contextlib.suppress(FileNotFoundError):
            (proc.data_dir / "ports.json").unlink()
        return config

    async def _spawn_or_take(self, proc: Proc, config: Path) -> None:
        """Run `proc` as configured in `config`: as the spare, else as a new process."""
        spare = self._take_spare(config, proc.data_dir / "broker.log")
        if spare is not None:
            proc.process = spare
        else:
            out = open(proc.data_dir / "broker.log", "ab")  # noqa: SIM115 - the child owns it
            try:
                proc.process = await asyncio.create_subprocess_exec(
                    *(sys.executable, "-m", "tandem.cli", "broker", "--config", str(config)),
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                )
            finally:
                out.close()

    async def _started(self, proc: Proc) -> None:
        """Wait for `proc`'s new process to listen."""
        assert proc.process is not None
        ports = proc.data_dir / "ports.json"
        self.spare_soon()
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
        proc.tls_port = info.get("amqps")
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
        delay: float | None = None
        failed = False  # its last restart did not start
        while not self.stopping:
            assert proc.process is not None
            code = await proc.process.wait()
            if self.stopping:
                return
            ran = time.monotonic() - proc.started
            delay = restart_delay(delay, code, ran, started=not failed)
            killed = code == -signal.SIGKILL and not failed
            log.warning(
                "member %s exited with %s; restarting it as a backup %s %.1f s",
                proc.node,
                code,
                "once the controller has seen it gone, at most in" if killed else "in",
                delay,
            )
            self.on_exit(proc)
            # A member that exits on its own waits its delay without the spare, which a
            # member killed meanwhile takes.
            held = self._hold_spare(proc) if killed else None
            if killed:
                # Killed from outside: back once the controller has seen it gone, which fails
                # a primary over at once (one back first answered as a backup, later:
                # confirms stopped for 0.25 s a kill, not 0.12); a member already back is down
                # in the next look until its new life answers (ha_http). Its sockets and its
                # store's lock went with it.
                try:
                    await self.looked(delay)
                except BaseException:
                    _release(held)  # cancelled: it must not keep the member's data dir
                    raise
            else:
                await asyncio.sleep(delay)  # a member that exits at once is not restarted in a loop
            if self.stopping:
                if held is not None:
                    _release(held)
                    await _ended(held)
                return
            try:
                await self.start(proc, held)
            except (RuntimeError, OSError) as exc:
                log.error("cannot restart member %s: %s", proc.node, exc)
                failed = True
                # It restarts on the ports of its last life, which the controller knows
                # already; one of them may have been taken since (another process's
                # connection), and the member could not start on it however often it tried.
                # The next try takes new ones, whatever the failure was: that start goes
                # without the controller's look during its load (`Node._hello_first` waits
                # its full second), once.
                proc.amqp_port = proc.admin_port = proc.replication_port = 0
                proc.tls_port = None
                continue
            failed = False
            proc.restarts += 1
            self.on_back(proc)

    async def stop(self) -> None:
        self.stopping = True
        if self.making_spare is not None:
            self.making_spare.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.making_spare
        spare, self.spare = self.spare, None
        if spare is not None and spare.returncode is None and spare.stdin is not None:
            spare.stdin.close()  # it ends at the end of its input, told nothing
            await _ended(spare)
        for proc in self.procs.values():
            if proc.alive:
                assert proc.process is not None
                with contextlib.suppress(ProcessLookupError):
                    proc.process.terminate()
        for proc in self.procs.values():
            if proc.process is not None:
                await _ended(proc.process)


def _release(held: asyncio.subprocess.Process | None) -> None:
    """End a spare held for a member (`Supervisor._hold_spare`) before it starts: told
    nothing more, it exits (`cli._broker`)."""
    if held is not None and held.stdin is not None and not held.stdin.is_closing():
        held.stdin.close()


async def _ended(process: asyncio.subprocess.Process) -> None:
    """Wait for a process told to end; killed if it has not within 15 s."""
    try:
        await asyncio.wait_for(process.wait(), 15)
    except TimeoutError:
        process.kill()
        await process.wait()
