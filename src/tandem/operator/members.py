"""One BrokerCluster's failover on Kubernetes: the `tandem.ha` loop through pod adapters.

The pods come from the operator's pod watch (`Pods.seen`): a pod deleted, failed or gone is
down at once, as a process exit is locally; otherwise the shared HTTP observer polls each
member's /status on the operator's own clock. After every look `ClusterLoop` keeps the world
in step with the election record (the Lease):

- the role label: off every pod that is not the serving primary first, then onto the one
  that is, so the client Service never selects two pods;
- what Kubernetes asks of the members handed to `tandem.ha` to order: pods terminating
  (`stopping`: a primary hands over first), pods on an old revision (`stale`: the rolling
  upgrade), members a scale-down removes (`leaving`); `decide` chooses, this only acts;
- the BrokerCluster's status (phase, primary, epoch, ISR, ready members, last failover) and an
  Event for each failover, stating the decision's reason.

An operator restarted mid-failover starts from the Lease: the members fenced at the higher
epoch tell the loop that a failover is under way, and it completes it.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from tandem.broker.ha_http import HttpActuator, HttpObserver, WakeableClock
from tandem.ha import decide
from tandem.ha import loop as ha_loop
from tandem.ha.decide import Action
from tandem.ha.model import ElectionRecord, Member, Settings, View
from tandem.operator import builders
from tandem.operator.spec import BrokerClusterSpec

log = logging.getLogger(__name__)

Obj = dict[str, Any]
PAUSE_ANNOTATION = "tandem.dev/paused"
REVISION_LABEL = "controller-revision-hash"  # set on each pod by the StatefulSet controller


@dataclass(slots=True)
class Pod:
    """A member as its pod last showed it. Implements broker.ha_http.Endpoint."""

    node: str
    ip: str | None = None
    ports: dict[str, int] = field(default_factory=dict)
    running: bool = False
    terminating: bool = False
    labelled: bool = False  # carries the role label (the client Service selects it)
    revision: str = ""  # the StatefulSet revision it runs (controller-revision-hash)
    uid: str = ""
    started: float = 0.0
    last_answer: float = 0.0
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.running and self.ip is not None

    def _at(self, port: str, default: int) -> str:
        return f"{self.ip}:{self.ports.get(port, default)}"

    @property
    def admin_address(self) -> str | None:
        return self._at("admin", builders.ADMIN_PORT) if self.ip else None

    @property
    def replication_address(self) -> str:
        return self._at("replication", builders.REPLICATION_PORT)

    @property
    def amqp_address(self) -> str:
        return self._at("amqp", builders.AMQP_PORT)


def _running(obj: Mapping[str, Any]) -> bool:
    status = obj.get("status") or {}
    if status.get("phase") != "Running":
        return False
    for c in status.get("containerStatuses") or []:
        if c.get("name") == "tandem" and "running" not in (c.get("state") or {}):
            return False
    return True


class Pods:
    """The cluster's member pods, kept by the operator's pod watch."""

    def __init__(self, nodes: list[str], clock: WakeableClock) -> None:
        self.clock = clock
        self.by_node: dict[str, Pod] = {n: Pod(n) for n in nodes}

    def resize(self, nodes: list[str]) -> None:
        """In place: the HTTP ports hold this very mapping."""
        for gone in set(self.by_node) - set(nodes):
            del self.by_node[gone]
        for n in nodes:
            self.by_node.setdefault(n, Pod(n))

    def seen(self, event_type: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        pod = self.by_node.get(meta.get("name", ""))
        if pod is None:
            return
        was_alive = pod.alive
        uid = meta.get("uid", "")
        if event_type == "DELETED" and pod.uid and uid and uid != pod.uid:
            return  # an earlier pod of this name, gone after its successor appeared
        if event_type == "DELETED":
            pod.running, pod.ip, pod.terminating, pod.labelled = False, None, False, False
        else:
            ports = {
                p["name"]: int(p["containerPort"])
                for c in (obj.get("spec") or {}).get("containers") or []
                for p in c.get("ports") or []
                if "name" in p and "containerPort" in p
            }
            pod.uid = meta.get("uid", "")
            pod.ip = (obj.get("status") or {}).get("podIP") or None
            pod.ports = ports
            pod.running = _running(obj)
            pod.terminating = bool(meta.get("deletionTimestamp"))
            labels = meta.get("labels") or {}
            pod.labelled = labels.get(builders.ROLE_LABEL) == "primary"
            pod.revision = labels.get(REVISION_LABEL, "")
        if pod.alive and not was_alive:
            pod.started = self.clock.monotonic()
            pod.status = {}
        if pod.alive != was_alive or pod.terminating:
            self.clock.wake.set()  # the loop looks again at once


class PodApi(Protocol):
    """What the loop needs of the Kubernetes API (implemented by `kube.Kube`)."""

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        body: Obj,
        subresource: str | None = None,
    ) -> Obj | None: ...

    async def event(
        self, involved: Mapping[str, Any], reason: str, message: str, type_: str = "Normal"
    ) -> None: ...

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None: ...


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ClusterLoop:
    """The HA loop of one BrokerCluster and what keeps Kubernetes in step with it."""

    def __init__(
        self,
        api: PodApi,
        body: Mapping[str, Any],
        spec: BrokerClusterSpec,
        store: Any,
        pods: Pods,
        session: Any,
        key: str,
    ) -> None:
        meta = body["metadata"]
        self.key = key  # the cluster key the members run with
        self.body = body  # kopf keeps it live: annotations changed later show here
        self.store = store
        self.api, self.name, self.namespace = api, meta["name"], meta["namespace"]
        self.owner = {
            "apiVersion": body["apiVersion"],
            "kind": body["kind"],
            "metadata": {"name": self.name, "namespace": self.namespace, "uid": meta.get("uid")},
        }
        self.pods = pods
        self.published: Obj = {}
        self.down_since: float | None = None  # when the primary was last seen not serving
        self.cause: str | None = None  # the reason of the first decision after that
        self.serving: str | None = None
        self.diverged: dict[str, str] = {}  # member -> why, as last reported in an Event
        self.refused: str | None = None  # a spec edit not applied (storage), and why
        settings = Settings(failover_delay=spec.failover.delay_seconds, isr_min=spec.isr_min)
        observer = self.polls = HttpObserver(pods.by_node, session, key)
        observer.failover_delay = settings.failover_delay
        self.actuator = actuator = HttpActuator(pods.by_node, session, key)
        self.controller = ha_loop.Controller(
            f"{self.namespace}/{self.name}",
            store,
            _Watching(self, observer),
            actuator,
            pods.clock,
            settings,
            poll_interval=spec.failover.poll_seconds,
            restarter=self,
        )
        self.revision: str | None = None  # the StatefulSet's update revision, as last read
        # The users Secret's definitions as last read (digest, document), and the digest the
        # primary last recorded: an edit of the Secret reaches the running cluster.
        self.users: tuple[str, Obj] | None = None
        self.users_applied: str | None = None
        self.users_refused: str | None = None  # why the users Secret cannot be used, if so
        self.pushing: asyncio.Task[None] | None = None

    def configure(self, spec: BrokerClusterSpec) -> None:
        """A spec edit reaches the running loop: the failover delay and poll interval at once,
        the ISR minimum through the election record at the next look (decide's SET_MIN), so
        the brokers take it without a restart and agree with the controller."""
        settings = replace(
            self.controller.settings,
            failover_delay=spec.failover.delay_seconds,
            isr_min=spec.isr_min,
        )
        if settings != self.controller.settings:
            log.info(
                "cluster=%s/%s settings now: failover delay %gs, ISR minimum %d",
                self.namespace,
                self.name,
                settings.failover_delay,
                settings.isr_min,
            )
            self.controller.settings = settings
            self.polls.failover_delay = settings.failover_delay
        self.controller.poll_interval = spec.failover.poll_seconds

    async def after_look(self, record: ElectionRecord, members: tuple[Member, ...]) -> None:
        """Called by the observer after every look, before the decision."""
        notes = (self.body.get("metadata") or {}).get("annotations") or {}
        self.controller.paused = notes.get(PAUSE_ANNOTATION, "").lower() == "true"
        pods = self.pods.by_node.values()
        self.controller.stopping = frozenset(p.node for p in pods if p.terminating)
        self.controller.stale = frozenset(
            p.node for p in pods if self.revision and p.revision and p.revision != self.revision
        )
        route = decide.route(View(record, members))
        await self._label(route)
        holder = self.pods.by_node.get(route or "")
        serving = holder is not None
        now = self.pods.clock.monotonic()
        if holder is not None:
            if self.serving is not None and self.serving != holder.node:
                await self._failed_over(self.serving, holder.node, record, now)
            elif self.serving is None and self.down_since is not None and record.epoch > 1:
                await self._failed_over(None, holder.node, record, now)
            self.serving, self.down_since, self.cause = holder.node, None, None
        else:
            if self.down_since is None:
                self.down_since = now
            last = self.controller.last
            if self.cause is None and last is not None and last.action is Action.FENCE:
                self.cause = last.reason  # what set the failover going
        if holder is not None and self.users and self.users[0] != self.users_applied:
            self._push_users(holder.node, *self.users)
        await self._report_divergence(members)
        await self._publish(record, members, serving)

    def users_seen(self, definitions: Obj) -> None:
        """The users Secret as the operator last read it (`definitions.json`)."""
        digest = hashlib.sha256(json.dumps(definitions, sort_keys=True).encode()).hexdigest()
        if self.users is None or self.users[0] != digest:
            self.users = (digest, definitions)
            self.pods.clock.wake.set()

    def _push_users(self, primary: str, digest: str, definitions: Obj) -> None:
        """Beside the loop, one at a time: a primary that waits for its in-sync set before it
        answers (an import is a durable record) must not hold up a failover decision."""
        if self.pushing is None or self.pushing.done():
            self.pushing = asyncio.create_task(self._apply_users(primary, digest, definitions))

    async def _apply_users(self, primary: str, digest: str, definitions: Obj) -> None:
        if await self.actuator.import_users(primary, definitions):
            if self.users_applied is not None:  # not the first look after a start
                names = ", ".join(sorted(u["name"] for u in definitions.get("users", [])))
                await self.api.event(
                    self.owner, "UsersApplied", f"users {names} set on the cluster by {primary}"
                )
            log.info(
                "cluster=%s/%s users Secret recorded by %s", self.namespace, self.name, primary
            )
            self.users_applied = digest

    async def _report_divergence(self, members: tuple[Member, ...]) -> None:
        """One Warning Event when a member says it could not apply a record (a bug: its state
        is not the primary's until it has taken a copy), and one when it is whole again."""
        now = {m.node: m.diverged for m in members if m.diverged}
        for node, why in sorted(now.items()):
            if self.diverged.get(node) != why:
                await self.api.event(
                    self.owner,
                    "Diverged",
                    f"{node} could not apply a record from the primary ({why}); it is out of "
                    "the in-sync set until it has taken a copy. Please report it as a bug.",
                    "Warning",
                )
        for node in sorted(set(self.diverged) - set(now)):
            await self.api.event(self.owner, "Rejoined", f"{node} took a copy and is whole again")
        self.diverged = now

    async def _label(self, primary: str | None) -> None:
        # Off every other pod first, then onto the primary: never two pods at once.
        for pod in self.pods.by_node.values():
            if pod.labelled and pod.node != primary:
                await self._set_label(pod, None)
        target = self.pods.by_node.get(primary or "")
        if target is not None and not target.labelled:
            await self._set_label(target, "primary")

    async def _set_label(self, pod: Pod, value: str | None) -> None:
        body = {"metadata": {"labels": {builders.ROLE_LABEL: value}}}
        found = await self.api.patch("v1", "Pod", self.namespace, pod.node, body)
        pod.labelled = value is not None and found is not None
        log.info(
            "cluster=%s/%s role label %s %s",
            self.namespace,
            self.name,
            "onto" if value else "off",
            pod.node,
        )

    async def _failed_over(
        self, old: str | None, new: str, record: ElectionRecord, now: float
    ) -> None:
        last = self.controller.last
        reason = self.cause or (last.reason if last is not None else "failover")
        took = now - self.down_since if self.down_since is not None else 0.0
        self.published["lastFailover"] = {
            "time": _now(),
            "from": old,
            "to": new,
            "reason": reason,
            "durationSeconds": round(took, 3),
        }
        await self.api.event(
            self.owner,
            "Failover",
            f"{new} is primary at epoch {record.epoch} (was {old or 'none'}): {reason}",
        )

    async def _publish(
        self, record: ElectionRecord, members: tuple[Member, ...], serving: bool
    ) -> None:
        ready = sum(1 for m in members if m.answering)
        if self.controller.paused:
            phase = "Paused"
        elif not serving:
            phase = "Failover" if record.holder is not None else "Pending"
        elif ready < len(members) or len(record.isr) < len(members):
            phase = "Degraded"
        else:
            phase = "Running"
        in_sync = len(record.isr) == len(members)
        conditions = [
            self._condition(
                "Available",
                serving,
                "PrimaryServing" if serving else "NoPrimary",
                f"{record.holder} serves clients at epoch {record.epoch}"
                if serving
                else "no member serves clients",
            ),
            self._condition(
                "FullyReplicated",
                in_sync,
                "AllInSync" if in_sync else "MembersOutOfSync",
                f"in sync: {', '.join(sorted(record.isr)) or 'none'}",
            ),
            self._condition(
                "SpecApplied",
                self.refused is None,
                "StorageChangeRefused" if self.refused else "Applied",
                self.refused or "every field of the spec is in effect",
            ),
            self._condition(
                "Consistent",
                not self.diverged,
                "RecordNotApplied" if self.diverged else "AllRecordsApplied",
                "; ".join(f"{n} diverged: {why}" for n, why in sorted(self.diverged.items()))
                or "every answering member applied every record it took",
            ),
        ]
        status = {
            **self.published,
            "phase": phase,
            "primary": record.holder if serving else None,
            "epoch": record.epoch,
            "isr": sorted(record.isr),
            "readyMembers": ready,
            "conditions": conditions,
        }
        if status != self.published:
            self.published = status
            await self.api.patch(
                "tandem.dev/v1alpha1",
                "BrokerCluster",
                self.namespace,
                self.name,
                {"status": status},
                subresource="status",
            )

    def _condition(self, kind: str, true: bool, reason: str, message: str) -> Obj:
        """A status condition; its lastTransitionTime moves only when its status does."""
        value = "True" if true else "False"
        before = next((c for c in self.published.get("conditions", []) if c["type"] == kind), None)
        since = before["lastTransitionTime"] if before and before["status"] == value else _now()
        return {
            "type": kind,
            "status": value,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since,
        }

    def resize(self, nodes: list[str]) -> None:
        self.pods.resize(nodes)
        # Done: the leaving members are gone, or a scale-up superseded the scale-down.
        self.controller.leaving = frozenset()

    def upgrade_to(self, stateful_set: Mapping[str, Any]) -> None:
        """The StatefulSet updates OnDelete: its update revision tells which pods run an old
        one. `decide` restarts them one at a time (`restart`), backups first, the primary
        last after a switchover, and only while every member serves in sync."""
        revision = (stateful_set.get("status") or {}).get("updateRevision") or None
        if revision != self.revision:
            self.revision = revision
            self.pods.clock.wake.set()

    async def restart(self, node: str, why: str) -> None:
        """ha.ports.Restarter: delete the pod; the StatefulSet makes it again on the new
        revision, on the same claim."""
        pod = self.pods.by_node.get(node)
        if pod is None or pod.terminating:
            return
        log.info("cluster=%s/%s %s", self.namespace, self.name, why)
        await self.api.event(self.owner, "RollingUpgrade", why)
        await self.api.delete("v1", "Pod", self.namespace, node)

    async def leave(self, leaving: set[str]) -> bool:
        """Scale-down's first step, which `decide` orders: the primary role off the leaving
        members (a switchover), then they leave the ISR, never below its minimum. True once
        the record names none of them, so that their pods may go."""
        self.controller.leaving = frozenset(leaving)
        self.pods.clock.wake.set()
        record = await self.store.read()
        return record.holder not in leaving and not (record.waited & leaving)

    async def run(self, stopped: ha_loop.Stopped) -> None:
        try:
            await self.controller.run(stopped)
        finally:
            if self.pushing is not None:
                self.pushing.cancel()


class _Watching:
    """The HTTP observer, then `ClusterLoop.after_look`."""

    def __init__(self, loop: ClusterLoop, inner: HttpObserver) -> None:
        self.loop, self.inner = loop, inner

    async def observe(self, record: ElectionRecord) -> tuple[Member, ...]:
        members = await self.inner.observe(record)
        await self.loop.after_look(record, members)
        return members
