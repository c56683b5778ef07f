"""The HA loop's ports over the members' admin HTTP API, for every controller.

The local cluster and the Kubernetes operator both observe members through `GET /status` and
command them through `/ha/*` with the cluster key; they differ only in where a member is and
whether it is known dead (a process exit, a pod's termination). That is the `Endpoint` each
controller hands in. Liveness is judged as DESIGN asks, on the controller's own clock: a member
known dead is down at once, and so is one restarted that has not answered in its new life yet;
otherwise it is up while it answers and silent (for how long) while it does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import aiohttp

from tandem.broker.status import MemberReport, NodeStatus, ReplicationStatus
from tandem.ha.model import ElectionRecord, Liveness, Member, Position, Role

log = logging.getLogger(__name__)

# A look waits this long for the polls it sends; a poll not answered by then goes on, and
# its answer counts in a later look if it comes within ANSWER_SECONDS.
LOOK_SECONDS = 0.4
# How long a poll's answer is still taken, at least: longer than the default failover delay,
# so that a member answering late because it is busy (every member under a saturating load on
# two cores) is slow, not silent. A longer delay lengthens it (`HttpObserver.failover_delay`).
# Silence is the time since the last answer, whatever this is.
ANSWER_SECONDS = 2.0
COMMAND_TIMEOUT = 2.0
RENEW_SECONDS = 1.0


class Endpoint(Protocol):
    """One member as its controller knows it."""

    node: str
    started: float  # when the controller last saw it start, on its monotonic clock
    last_answer: float  # when it last answered a poll, on the same clock
    status: dict[str, Any]  # its last /status answer

    @property
    def alive(self) -> bool:
        """False once the controller knows it dead (process exited, pod gone)."""

    @property
    def admin_address(self) -> str | None:
        """host:port of its admin API; None while unknown."""

    @property
    def replication_address(self) -> str: ...

    @property
    def amqp_address(self) -> str: ...


class HttpObserver:
    """Implements ha.ports.Observer over each member's /status."""

    def __init__(
        self,
        procs: Mapping[str, Endpoint],
        session: aiohttp.ClientSession,
        key: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.procs = procs
        self.session = session
        self.headers = {"Authorization": f"Bearer {key}"}
        self.clock = clock
        self.polls: dict[str, asyncio.Task[None]] = {}  # each member's poll under way
        self.unanswered: set[str] = set()  # members whose last poll got no answer
        self.seen: dict[str, float] = {}  # each member's last answer, as the last look saw it
        # The controller's, kept up to date by its owner: an answer within it is taken, so a
        # member answering every poll within the delay is never silent for the delay.
        self.failover_delay = 0.0

    async def _poll(self, proc: Endpoint) -> None:
        if not proc.alive or not proc.admin_address:
            return
        url = f"http://{proc.admin_address}/status?brief=1"
        timeout = aiohttp.ClientTimeout(total=max(ANSWER_SECONDS, self.failover_delay))
        try:
            async with self.session.get(url, headers=self.headers, timeout=timeout) as resp:
                if resp.status == 200:
                    answer = await resp.json()
                    NodeStatus.model_validate(answer)  # not the contract: no answer
                    proc.status = answer
                    proc.last_answer = self.clock()
                    self.unanswered.discard(proc.node)
                    return
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass  # ValueError: not JSON, or not a status (pydantic's ValidationError)
        self.unanswered.add(proc.node)

    def listening(self, node: str) -> None:
        """`node` was restarted and listens (its store recovered): the next look waits for
        its answer, though its last poll, to its last life or to this one starting, got
        none. Not waited for, its first answer came after the look, and the controller told
        it whom to follow a poll later (up to 0.1 s of a rejoin)."""
        self.unanswered.discard(node)

    async def observe(self, record: ElectionRecord) -> tuple[Member, ...]:
        """One look at every member. It waits up to LOOK_SECONDS for the polls it sends, and
        not at all for a member whose poll is still under way or that did not answer its
        last poll (unless it is `listening` since): a paused primary would otherwise hold
        every turn, and the failover delay would be judged late. An answer that comes after
        the look counts in the next one: a member busy enough to answer in 0.6 s is slow,
        not silent (issue 16: backups under a saturating load answered in 0.3-1.2 s, and a
        poll timeout of 0.4 s dropped them from the ISR several times a minute)."""
        procs = list(self.procs.values())
        before = {p.node: self.seen.get(p.node, p.last_answer) for p in procs}
        waited = []
        for p in procs:
            task = self.polls.get(p.node)
            if task is None or task.done():
                task = self.polls[p.node] = asyncio.create_task(self._poll(p))
                if p.node not in self.unanswered:
                    waited.append(task)
        if waited:
            await asyncio.wait(waited, timeout=LOOK_SECONDS)
        for p in procs:
            self.seen[p.node] = p.last_answer  # answers from now on count in the next look
        now = self.clock()
        primary = self.procs.get(record.holder or "")
        report: dict[str, MemberReport] = {}
        if primary is not None and primary.last_answer != before.get(primary.node):
            report = ReplicationStatus.model_validate(primary.status).members
        members = []
        for p in procs:
            if not p.alive:
                members.append(Member(p.node, Liveness.DOWN))
                continue
            answered = p.last_answer != before[p.node]  # since the last look
            if p.status and p.last_answer < p.started:
                # Restarted, and not answering yet (what it said, if in this look, its last
                # life said): that life ended and took its memory and its link with it.
                # Taken for silent, a backup killed and restarted by the local cluster before
                # the controller's next look stayed in the ISR for the failover delay, and
                # the primary waited for it (issue 16). The operator forgets a pod's status
                # when it sees it start again: that pod was down while it did not run.
                members.append(Member(p.node, Liveness.DOWN))
                continue
            if not answered and not p.status:
                since = max(p.last_answer, p.started)  # nothing seen of any life yet
                members.append(Member(p.node, Liveness.SILENT, silent_for=now - since))
                continue
            # Silent, a member is what it last answered (a paused primary is still the
            # primary of its epoch, and its clients wait for it: decide.route), as the
            # simulation's members are.
            s = ReplicationStatus.model_validate(p.status)
            r = report.get(p.node) or MemberReport()
            members.append(
                Member(
                    p.node,
                    Liveness.UP if answered else Liveness.SILENT,
                    Role(s.role) if s.role in ("primary", "backup") else Role.BACKUP,
                    s.epoch,
                    Position(s.last_epoch, s.position),
                    following=s.following,
                    caught_up=r.caught_up,
                    waited=r.waited,
                    applied_version=s.applied_version,
                    lag_records=r.lag_records,
                    lag_seconds=r.lag_seconds,
                    behind=r.behind,
                    whole=s.whole,
                    diverged=s.diverged,
                    silent_for=0.0 if answered else now - p.last_answer,
                )
            )
        return tuple(members)


class HttpActuator:
    """Implements ha.ports.Actuator over each member's /ha/* commands."""

    def __init__(
        self,
        procs: Mapping[str, Endpoint],
        session: aiohttp.ClientSession,
        key: str,
        link_address: Callable[[Endpoint], str] | None = None,
    ) -> None:
        self.procs = procs
        self.session = session
        # Where the others reach a member's replication listener (a proxy may stand there).
        self.link_address = link_address or (lambda p: p.replication_address)
        self.headers = {"Authorization": f"Bearer {key}"}
        self.renewed: tuple[int, float] = (-1, 0.0)

    async def _post(
        self, node: str, command: str, body: dict[str, Any], status: bool = True
    ) -> bool:
        proc = self.procs.get(node)
        if proc is None or not proc.alive or not proc.admin_address:
            return False
        url = f"http://{proc.admin_address}/ha/{command}"
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
                answer = await resp.json()
                if status:  # the commands answer the member's replication status
                    ReplicationStatus.model_validate(answer)
                    proc.status.update(answer)
                return True
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
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
            "amqp": p.amqp_address,
        }
        await self._post(node, "follow", body)

    async def set_isr(self, primary: str, record: ElectionRecord, why: str = "") -> None:
        body: dict[str, Any] = {"record": record.to_dict()}
        if why:
            body["why"] = why
        if await self._post(primary, "record", body):
            self.renewed = (record.version, time.monotonic())

    async def import_users(self, primary: str, definitions: dict[str, Any]) -> bool:
        """Users, vhosts and permissions (a definitions document) onto the primary, which
        records them in its log; True once it answered that they are recorded."""
        return await self._post(primary, "users", definitions, status=False)

    async def renew(self, primary: str, record: ElectionRecord) -> None:
        version, when = self.renewed
        if version == record.version and time.monotonic() - when < RENEW_SECONDS:
            return
        await self.set_isr(primary, record)


class WakeableClock:
    """Implements ha.ports.Clock; a member's exit cuts the loop's sleep short, and `looked`
    tells when the loop has looked at the cluster since."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.sleeping = False
        # (sleeps still to begin, the future told then): those waiting in `looked`.
        self.waiting: list[tuple[int, asyncio.Future[None]]] = []

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        # The loop sleeps after its turns: each waiter counts down to its own.
        waiting, self.waiting = self.waiting, []
        for left, told in waiting:
            if left > 1:
                self.waiting.append((left - 1, told))
            elif not told.done():
                told.set_result(None)
        self.sleeping = True
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), seconds)
        finally:
            self.sleeping = False
        self.wake.clear()

    async def looked(self, most: float) -> None:
        """Return once the loop has taken a turn that began after now and slept after it (it
        has acted on what it saw: a primary's exit failed over), or after `most` seconds. A
        loop asleep now begins that turn when woken; one in a turn now finishes that one
        first, which may have looked before."""
        told: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append((1 if self.sleeping else 2, told))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(told, most)
