"""The kopf handlers of `tandem operator run`: thin, over the pure builders.

- create, resume, update of a BrokerCluster: build every object from the typed spec and apply
  it (the cluster-key Secret only once: a key is never replaced); a scale-down first waits
  until the failover logic has the primary role off the leaving members and them out of the
  ISR (`ClusterLoop.leave`);
- a daemon per BrokerCluster runs its failover loop (`members.ClusterLoop`) on the Lease,
  and beside it keeps in step the StatefulSet's revision (a rolling upgrade, which `decide`
  orders), the users Secret, and the Secrets the operator made;
- the pod watch hands every member pod's change to its cluster's loop at once;
- delete: the finalizer deletes the members' volume claims when the retention says Delete.

Errors in a spec the API server let through (it checks the CRD's schema) end the handler
with a permanent error and an Event that names the field.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import logging
import secrets
from typing import Any

import aiohttp
import kopf
import pydantic

from tandem.broker.ha_http import WakeableClock
from tandem.ha.loop import BUG
from tandem.operator import builders
from tandem.operator import lease as lease_mod
from tandem.operator import spec as spec_mod
from tandem.operator.kube import ApiError, Kube
from tandem.operator.lease import Conflict, LeaseElectionStore
from tandem.operator.members import ClusterLoop, Pods
from tandem.operator.spec import BrokerClusterSpec

log = logging.getLogger(__name__)

Obj = dict[str, Any]
RESOURCE = (spec_mod.GROUP, spec_mod.VERSION, spec_mod.PLURAL)
ROLL_SECONDS = 2.0  # how often the revision, the users Secret and our Secrets are checked
MEMBER_PODS = {"app.kubernetes.io/managed-by": builders.OPERATOR_NAME}


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = "tandem.dev/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="tandem.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="tandem.dev")
    settings.batching.batch_window = 0.01  # a pod's deletion reaches the loop at once
    settings.posting.level = logging.WARNING  # our own Events say what matters; no chatter
    memo.kube = Kube()
    memo.loops = {}


def _nodes(name: str, replicas: int) -> list[str]:
    return [f"{name}-{i}" for i in range(replicas)]  # the StatefulSet's pod names


def _where(name: str | None, namespace: str | None) -> tuple[str, str]:
    if not name or not namespace:
        raise kopf.PermanentError("a BrokerCluster is namespaced and named")
    return name, namespace


def _spec(spec: Any) -> BrokerClusterSpec:
    try:
        return BrokerClusterSpec.model_validate(dict(spec or {}))
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"spec{''.join(f'.{part}' for part in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise kopf.PermanentError(f"invalid BrokerCluster spec: {problems}") from None


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
async def reconcile(
    body: kopf.Body,
    spec: kopf.Spec,
    name: str | None,
    namespace: str | None,
    memo: kopf.Memo,
    reason: str = "",
    **_: Any,
) -> None:
    name, namespace = _where(name, namespace)
    kube: Kube = memo.kube
    try:
        parsed = _spec(spec)
    except kopf.PermanentError as exc:
        await kube.event(body, "InvalidSpec", str(exc), "Warning")
        raise
    objects = [
        o
        for o in builders.all_objects(
            name, namespace, parsed, secrets.token_hex(32), secrets.token_hex(16)
        )
        if o["kind"] != "Lease"  # the failover loop writes the Lease, by compare-and-set
    ]
    kopf.adopt(objects, owner=body)
    loop: ClusterLoop | None = memo.loops.get((namespace, name))
    if loop is not None:
        loop.configure(parsed)  # failover settings and the ISR minimum, live
    claims = await kube.list("v1", "PersistentVolumeClaim", namespace, builders.selector(name))
    if not claims and reason == "create":
        # Only when the BrokerCluster is made: a running cluster's Lease is its own.
        await _forget_an_old_incarnation(kube, name, namespace)
    for obj in objects:
        if obj["metadata"]["name"] == f"{name}-cluster-key":
            await _ensure_cluster_key(kube, body, obj, loop, bool(claims))
        elif obj["kind"] == "Secret":
            await kube.ensure(obj)
        elif obj["kind"] == "StatefulSet":
            current = await kube.get("apps/v1", "StatefulSet", namespace, name)
            if current is not None:
                obj = await _keep_storage(kube, body, obj, current, loop)
            replicas = int((current or {}).get("spec", {}).get("replicas") or 0)
            if loop is not None and current is not None and parsed.replicas < replicas:
                leaving = set(_nodes(name, replicas)) - set(_nodes(name, parsed.replicas))
                if not await loop.leave(leaving):
                    raise kopf.TemporaryError(
                        f"scaling down: waiting for {', '.join(sorted(leaving))} to leave "
                        "the in-sync set",
                        delay=1,
                    )
            await kube.apply(obj)
        else:
            await kube.apply(obj)
    if loop is not None:
        loop.resize(_nodes(name, parsed.replicas))


def _storage(stateful_set: dict[str, Any]) -> dict[str, Any]:
    templates = (stateful_set.get("spec") or {}).get("volumeClaimTemplates") or [{}]
    claim = templates[0].get("spec") or {}
    return {
        "size": ((claim.get("resources") or {}).get("requests") or {}).get("storage"),
        "storageClassName": claim.get("storageClassName"),
    }


async def _keep_storage(
    kube: Kube,
    body: kopf.Body,
    desired: dict[str, Any],
    current: dict[str, Any],
    loop: ClusterLoop | None,
) -> dict[str, Any]:
    """A StatefulSet's claim templates cannot change (the API server refuses it, at every
    retry). A storage edit is refused once, with an Event and the SpecApplied condition, and
    the rest of the spec still applies on the claims the members have."""
    want, have = _storage(desired), _storage(current)
    if want == have:
        if loop is not None:
            loop.refused = None
        return desired
    changes = ", ".join(f"storage.{k} {have[k]} -> {want[k]}" for k in want if want[k] != have[k])
    message = (
        f"{changes}: a running cluster's volume claims cannot change (a StatefulSet's claim "
        "templates are immutable); kept as they are. Resize the claims themselves where the "
        "storage class allows it, or make a new cluster"
    )
    log.warning(
        "cluster=%s/%s %s",
        current["metadata"].get("namespace"),
        current["metadata"]["name"],
        message,
    )
    await kube.event(body, "StorageChangeRefused", message, "Warning")
    if loop is not None:
        loop.refused = message
    kept = copy.deepcopy(desired)
    kept["spec"]["volumeClaimTemplates"] = current["spec"]["volumeClaimTemplates"]
    return kept


async def _forget_an_old_incarnation(kube: Kube, name: str, namespace: str) -> None:
    """No member has data (no claim): a Lease left by an earlier cluster of this name, whose
    claims were deleted, belongs to data that is gone. Its holder, epoch and ISR would make
    the controller wait forever for members that no longer exist; it goes, and the new
    cluster starts its own record. (With claims kept, the Lease is kept, and a re-created
    cluster resumes on that data.)"""
    lease = await kube.get("coordination.k8s.io/v1", "Lease", namespace, name)
    if lease is None:
        return
    record = lease_mod.record_of(lease)
    if record.epoch == 0 and record.holder is None:
        return  # nothing decided yet
    log.warning(
        "cluster=%s/%s has no volume claims, but a Lease from an earlier cluster of this name "
        "(%s): deleting it, this cluster starts afresh",
        namespace,
        name,
        record.describe(),
    )
    await kube.delete("coordination.k8s.io/v1", "Lease", namespace, name)


async def _ensure_cluster_key(
    kube: Kube, body: kopf.Body, obj: dict[str, Any], loop: ClusterLoop | None, has_data: bool
) -> None:
    """The cluster key Secret, made once. Deleted while the cluster runs, it comes back with
    the key the members use (the running loop knows it), never a new random one; if this
    operator does not know it (it restarted since), it is not re-created, and an Event says
    how to restore it. Edited while the cluster runs, it is put back: the members
    authenticate each other with the key they started with, so a new key would leave the
    operator and every restarted member locked out; a new key needs a new cluster."""
    meta = obj["metadata"]
    found = await kube.get("v1", "Secret", meta["namespace"], meta["name"])
    if found is not None:
        if loop is not None and _decoded(found).get("key", "").strip() != loop.key:
            back = {"stringData": {"key": loop.key}}
            await kube.patch("v1", "Secret", meta["namespace"], meta["name"], back)
            message = (
                f"{meta['name']} was edited; put back: the members authenticate each other "
                "with the key they started with, and it cannot change while they run (a new "
                "key needs a new cluster)"
            )
            log.warning("%s/%s %s", meta["namespace"], meta["name"], message)
            await kube.event(body, "ClusterKeyChangeRefused", message, "Warning")
        return
    if loop is not None:
        obj = {**obj, "stringData": {"key": loop.key}}
        message = f"{meta['name']} was deleted; made again with the key the members use"
        await kube.event(body, "SecretRestored", message)
    elif has_data:
        message = (
            f"the Secret {meta['name']} is gone and the members' data needs the key it held; "
            "restore it (kubectl create secret generic "
            f"{meta['name']} --from-literal=key=...) or delete the cluster's claims to start "
            "afresh"
        )
        await kube.event(body, "ClusterKeyMissing", message, "Warning")
        raise kopf.TemporaryError(message, delay=30)
    await kube.ensure(obj)


async def _cluster_key(kube: Kube, name: str, namespace: str) -> str | None:
    secret = await kube.get("v1", "Secret", namespace, f"{name}-cluster-key")
    if secret is None:
        return None
    if (secret.get("data") or {}).get("key"):
        return base64.b64decode(secret["data"]["key"]).decode().strip()
    return str((secret.get("stringData") or {}).get("key", "")).strip() or None


@kopf.daemon(*RESOURCE, cancellation_timeout=5.0)
async def failover(
    stopped: kopf.DaemonStopped,
    body: kopf.Body,
    spec: kopf.Spec,
    name: str | None,
    namespace: str | None,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    name, namespace = _where(name, namespace)
    parsed = _spec(spec)
    kube: Kube = memo.kube
    key = await _cluster_key(kube, name, namespace)
    if key is None:
        raise kopf.TemporaryError("the cluster key Secret is not there yet", delay=1)
    nodes = _nodes(name, parsed.replicas)
    pods = Pods(nodes, WakeableClock())
    store = LeaseElectionStore(kube, name, namespace, nodes)
    async with aiohttp.ClientSession() as session:
        loop = ClusterLoop(kube, body, parsed, store, pods, session, key)
        memo.loops[(namespace, name)] = loop
        try:
            for pod in await kube.list("v1", "Pod", namespace, builders.selector(name)):
                pods.seen("ADDED", pod)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(loop.run(stopped))
                tasks.create_task(_keep_in_step(kube, loop, body, parsed, stopped))
        finally:
            memo.loops.pop((namespace, name), None)


async def _keep_in_step(
    kube: Kube,
    loop: ClusterLoop,
    body: kopf.Body,
    spec: BrokerClusterSpec,
    stopped: kopf.DaemonStopped,
) -> None:
    """Beside the failover loop, every ROLL_SECONDS: the StatefulSet's revision (a rolling
    upgrade, which `decide` orders), the users Secret (an edit reaches the running cluster),
    and the two Secrets the operator made, put back as they were if someone deleted them."""
    name, namespace = loop.name, loop.namespace
    while not stopped.is_set():
        try:
            stateful_set = await kube.get("apps/v1", "StatefulSet", namespace, name)
            if stateful_set is not None:
                loop.upgrade_to(stateful_set)
            await _keep_users(kube, loop, body, spec)
            key = builders.cluster_key_secret(name, namespace, loop.key)
            await _ensure_cluster_key(kube, body, key, loop, has_data=True)
        except (ApiError, Conflict, OSError) as exc:
            log.warning("cluster=%s/%s keeping in step: %s", namespace, name, exc)
        except Exception:
            log.exception("cluster=%s/%s keeping in step: %s", namespace, name, BUG)
        await stopped.wait(ROLL_SECONDS)


def _decoded(secret: Obj) -> dict[str, str]:
    out = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return {**out, **(secret.get("stringData") or {})}


async def _keep_users(
    kube: Kube, loop: ClusterLoop, body: kopf.Body, spec: BrokerClusterSpec
) -> None:
    """The users Secret is the source of its users: its definitions reach the primary (which
    records them), merged as RabbitMQ's import merges. The operator's own default-user Secret
    is kept whole: a new `password` is carried into its `url` and `definitions.json`; deleted,
    it is made again with the password the cluster uses."""
    name, namespace = loop.name, loop.namespace
    secret_name = builders.users_secret_name(name, spec)
    secret = await kube.get("v1", "Secret", namespace, secret_name)
    default = not spec.users_secret
    if secret is None:
        if not default:
            return  # the user's own Secret: the pods cannot start without it (kubectl says)
        known = loop.users[1] if loop.users else None
        password = _default_password(known) or secrets.token_hex(16)
        await kube.ensure(builders.default_user_secret(name, namespace, password))
        told = "with the password the cluster uses" if known else "with a new password"
        await kube.event(body, "SecretRestored", f"{secret_name} was deleted; made again {told}")
        return
    data = _decoded(secret)
    try:
        definitions = json.loads(data.get("definitions.json", ""))
        if not isinstance(definitions, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        message = f"{secret_name}: definitions.json is not a definitions document ({exc})"
        if loop.users_refused != message:
            loop.users_refused = message
            await kube.event(body, "UsersSecretInvalid", message, "Warning")
        return
    loop.users_refused = None
    edited = data.get("password")
    if default and edited and edited != _default_password(definitions):
        # The password was edited: the whole Secret follows it, then the cluster.
        fresh = builders.default_user_secret(name, namespace, edited)
        await kube.patch(
            "v1", "Secret", namespace, secret_name, {"stringData": fresh["stringData"]}
        )
        definitions = json.loads(fresh["stringData"]["definitions.json"])
    loop.users_seen(definitions)


def _default_password(definitions: Obj | None) -> str | None:
    for user in (definitions or {}).get("users", []):
        if user.get("name") == builders.DEFAULT_USER:
            return str(user.get("password") or "") or None
    return None


@kopf.on.event("", "v1", "pods", labels=MEMBER_PODS)
async def pod_changed(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    obj = event["object"]
    meta = obj.get("metadata") or {}
    cluster = (meta.get("labels") or {}).get("app.kubernetes.io/instance")
    loop: ClusterLoop | None = memo.loops.get((meta.get("namespace"), cluster))
    if loop is not None:
        loop.pods.seen(event.get("type") or "ADDED", obj)


@kopf.on.delete(*RESOURCE)
async def deleted(
    spec: kopf.Spec, name: str | None, namespace: str | None, memo: kopf.Memo, **_: Any
) -> None:
    name, namespace = _where(name, namespace)
    retention = (spec.get("storage") or {}).get("retention", "Retain")
    kube: Kube = memo.kube
    # The BrokerCluster stays (our finalizer) until its last member pod is gone. Without
    # that, one applied again at once meets pods still in their preStop: the new
    # StatefulSet cannot make a pod of the same name, and k3s's controller waited minutes
    # before it tried again.
    await kube.delete("apps/v1", "StatefulSet", namespace, name)
    members = await kube.list("v1", "Pod", namespace, builders.selector(name))
    if members:
        raise kopf.TemporaryError(
            f"waiting for {', '.join(sorted(p['metadata']['name'] for p in members))} to stop",
            delay=2,
        )
    kept = (f"{name}-cluster-key", f"{name}-default-user")
    if retention != "Delete":
        # The data stays, and what it needs with it: the Lease (never owned), the key the
        # members' stores were made with and the generated user they hold, taken out of the
        # garbage collector's reach. A BrokerCluster made again under this name resumes on
        # them, and its clients' credentials still work.
        for secret in kept:
            orphan = {"metadata": {"ownerReferences": None}}
            await kube.patch("v1", "Secret", namespace, secret, orphan)
        log.info(
            "%s/%s deleted; its volume claims, Lease and Secrets are kept (retention Retain)",
            namespace,
            name,
        )
        return
    for secret in kept:  # kept by an earlier Retain, perhaps
        await kube.delete("v1", "Secret", namespace, secret)
    claims = await kube.list("v1", "PersistentVolumeClaim", namespace, builders.selector(name))
    for claim in claims:
        await kube.delete("v1", "PersistentVolumeClaim", namespace, claim["metadata"]["name"])
        log.info("%s/%s deleted its volume claim %s", namespace, name, claim["metadata"]["name"])
    # The election record belongs to the data: with the claims, it goes too.
    await kube.delete("coordination.k8s.io/v1", "Lease", namespace, name)
