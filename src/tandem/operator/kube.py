"""The one module that talks to the Kubernetes API (kopf's own watches aside).

Everything else in the operator builds plain dicts; this module sends them. It uses the
official client's configured `ApiClient` (in-cluster service account, or the kubeconfig a
developer or a test points at) for plain REST calls on whole objects, so one small class
covers every kind the operator keeps. The client is synchronous; each call runs in a worker
thread so the handlers and the HA loop keep their event loop.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Mapping
from typing import Any

import kubernetes
import urllib3

from tandem.ha.ports import Unavailable
from tandem.operator import lease as lease_mod

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# kind -> the resource's plural, for every kind the operator reads or writes
PLURALS = {
    "Secret": "secrets",
    "ConfigMap": "configmaps",
    "Service": "services",
    "Pod": "pods",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Event": "events",
    "StatefulSet": "statefulsets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "Lease": "leases",
    "ServiceAccount": "serviceaccounts",
    "BrokerCluster": "brokerclusters",
}
MERGE_PATCH = "application/merge-patch+json"


class ApiError(Unavailable):
    """The API server refused a call (its status and answer), or did not answer (status 0)."""

    def __init__(self, status: int, text: str) -> None:
        said = f"answered {status}" if status else "did not answer"
        super().__init__(f"the Kubernetes API {said}: {text}")
        self.status = status


def _path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{PLURALS[kind]}"
    return f"{path}/{name}" if name else path


def load_config() -> None:
    """The service account inside a cluster; otherwise the kubeconfig (KUBECONFIG)."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


class Kube:
    """Whole-object REST calls. Implements lease.LeaseApi too."""

    def __init__(self, client: kubernetes.client.ApiClient | None = None) -> None:
        self.client = client or kubernetes.client.ApiClient()

    def _call_sync(
        self,
        method: str,
        path: str,
        body: Obj | None = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Obj | None:
        try:
            data = self.client.call_api(
                path,
                method,
                query_params=query or [],
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
                response_types_map={200: "object", 201: "object", 202: "object"},
                _return_http_data_only=True,
                _request_timeout=10,
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            if exc.status == 409:
                raise lease_mod.Conflict(exc.body) from None
            raise ApiError(exc.status, str(exc.body or exc.reason)) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:  # no answer at all
            raise ApiError(0, str(exc)) from None
        return data if isinstance(data, dict) else {}

    async def _call(
        self,
        method: str,
        path: str,
        body: Obj | None = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Obj | None:
        return await asyncio.to_thread(self._call_sync, method, path, body, query, content_type)

    # -- generic -----------------------------------------------------------------------------

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        return await self._call("GET", _path(api_version, kind, namespace, name))

    async def list(
        self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]
    ) -> list[Obj]:
        """The objects carrying all of `labels` (checked here too, not only by the server)."""
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        found = await self._call(
            "GET", _path(api_version, kind, namespace), query=[("labelSelector", selector)]
        )
        return [
            item
            for item in (found or {}).get("items") or []
            if labels.items() <= ((item.get("metadata") or {}).get("labels") or {}).items()
        ]

    async def post(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        return await self._call(
            "POST", _path(obj["apiVersion"], obj["kind"], meta["namespace"]), obj
        ) or dict(obj)

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        body: Obj,
        subresource: str | None = None,
    ) -> Obj | None:
        """A JSON merge patch (None removes a key); None when the object is gone."""
        path = _path(api_version, kind, namespace, name)
        if subresource:
            path = f"{path}/{subresource}"
        return await self._call("PATCH", path, body, content_type=MERGE_PATCH)

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        await self._call("DELETE", _path(api_version, kind, namespace, name))

    async def apply(self, obj: Obj) -> Obj:
        """Create the object, or bring an existing one to `obj` by merge patch."""
        try:
            return await self.post(obj)
        except lease_mod.Conflict:
            meta = obj["metadata"]
            found = await self.patch(
                obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"], obj
            )
            return found if found is not None else await self.post(obj)

    async def ensure(self, obj: Obj) -> Obj:
        """Create the object unless it exists; an existing one is left as it is (a key)."""
        meta = obj["metadata"]
        found = await self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if found is not None:
            return found
        try:
            return await self.post(obj)
        except lease_mod.Conflict:
            again = await self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
            return again if again is not None else obj

    async def event(
        self, involved: Mapping[str, Any], reason: str, message: str, type_: str = "Normal"
    ) -> None:
        """A core/v1 Event on `involved`, shown by `kubectl describe` and `kubectl get events`."""
        meta = involved["metadata"]
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            # A name of our own rather than generateName: unique, and sortable by time.
            "metadata": {
                "name": f"{meta['name']}.{time.time_ns():x}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": involved["apiVersion"],
                "kind": involved["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid", ""),
            },
            "reason": reason,
            "message": message[:1024],
            "type": type_,
            "source": {"component": "tandem-operator"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self._call("POST", _path("v1", "Event", meta["namespace"]), body)
        except (ApiError, lease_mod.Conflict) as exc:
            log.warning("could not post the event %s on %s: %s", reason, meta["name"], exc)

    # -- lease.LeaseApi ----------------------------------------------------------------------

    async def read(self, name: str, namespace: str) -> Obj | None:
        return await self.get("coordination.k8s.io/v1", "Lease", namespace, name)

    async def create(self, namespace: str, body: Obj) -> Obj:
        return await self.post(body)

    async def replace(self, name: str, namespace: str, body: Obj) -> Obj:
        """A merge patch carrying the resourceVersion read: the API server applies it only if
        nobody wrote since (409 otherwise), as it would a PUT."""
        found = await self.patch("coordination.k8s.io/v1", "Lease", namespace, name, body)
        if found is None:
            raise lease_mod.Conflict(f"the Lease {namespace}/{name} is gone")
        return found
