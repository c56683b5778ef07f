"""Pure builders: a BrokerCluster in, the Kubernetes objects that run it out, as plain dicts.

No API calls here (kopf's "only the clients talk to the API"; CloudNativePG's pkg/specs):
the operator's handlers pass these dicts to the one module that talks to Kubernetes, and the
tests compare them with golden files.

- `<name>-members`, a headless Service: each member's stable DNS name (replication, admin);
- `<name>`, the client Service: its selector follows the `tandem.dev/role: primary` label the
  operator moves to the primary pod on failover;
- `<name>-config`, the members' settings; `<name>-cluster-key`, the shared key;
- `<name>`, the StatefulSet: restricted pod security, probes on /ready and /health, one volume
  claim per member;
- a PodDisruptionBudget (one member down at a time), a NetworkPolicy (replication and admin
  only from members and the operator), and the Lease that holds the election record.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import yaml

from tandem.operator.spec import BrokerClusterSpec

AMQP_PORT = 5672
ADMIN_PORT = 15672
REPLICATION_PORT = 5673
AMQPS_PORT = 5671
DATA_DIR = "/var/lib/tandem"
CONFIG_DIR = "/etc/tandem"
KEY_DIR = "/etc/tandem/cluster"
TLS_DIR = "/etc/tandem/tls"  # a kubernetes.io/tls Secret: tls.crt, tls.key
DEFAULT_USER = "default"  # the one user of <name>-default-user, without a usersSecret
USERS_DIR = "/etc/tandem/users"  # a Secret holding definitions.json (RabbitMQ's export format)
HANDOVER_SECONDS = 25  # the preStop waits this long at most for the primary role to move
RUN_AS = 10001
ROLE_LABEL = "tandem.dev/role"
ADMIN_ACCESS = "tandem.dev/admin-access"  # a pod label that lets it reach the admin port
OPERATOR_NAME = "tandem-operator"

Obj = dict[str, Any]


def labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": OPERATOR_NAME,
    }


def selector(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": name}


def _meta(name: str, namespace: str, owner: str) -> Obj:
    return {"name": name, "namespace": namespace, "labels": labels(owner)}


def members_service(name: str, namespace: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(f"{name}-members", namespace, name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # members find each other before they are ready
            "selector": selector(name),
            "ports": [
                {"name": "amqp", "port": AMQP_PORT},
                {"name": "admin", "port": ADMIN_PORT},
                {"name": "replication", "port": REPLICATION_PORT},
            ],
        },
    }


def client_service(name: str, namespace: str, spec: BrokerClusterSpec) -> Obj:
    meta = _meta(name, namespace, name)
    if spec.service.annotations:
        meta["annotations"] = dict(spec.service.annotations)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": spec.service.type,
            "selector": {**selector(name), ROLE_LABEL: "primary"},
            "ports": [{"name": "amqp", "port": AMQP_PORT, "targetPort": "amqp"}]
            + (
                [{"name": "amqps", "port": AMQPS_PORT, "targetPort": "amqps"}]
                if spec.tls_secret
                else []
            ),
        },
    }


def member_settings(spec: BrokerClusterSpec) -> Obj:
    """Each member's tandem.yaml (the node id comes from the pod name)."""
    settings: Obj = {
        "host": "0.0.0.0",
        "admin_host": "0.0.0.0",
        "amqp_port": AMQP_PORT,
        "admin_port": ADMIN_PORT,
        "data_dir": DATA_DIR,
        "replication_port": REPLICATION_PORT,
        "replication_host": "0.0.0.0",
        "cluster_key_file": f"{KEY_DIR}/key",
        "isr_min": spec.isr_min,
        "default_replicate": spec.replication.default,
        "lease_seconds": spec.failover.lease_seconds,
    }
    if spec.tls_secret:
        settings.update(
            tls_port=AMQPS_PORT,
            tls_certfile=f"{TLS_DIR}/tls.crt",
            tls_keyfile=f"{TLS_DIR}/tls.key",
        )
    settings["definitions"] = f"{USERS_DIR}/definitions.json"  # usersSecret, or the default
    return settings


CONFIG_CHECKSUM = "tandem.dev/config-checksum"


def config_checksum(spec: BrokerClusterSpec) -> str:
    """The members' settings that need a restart to take effect, as a short digest."""
    settings = {k: v for k, v in member_settings(spec).items() if k != "isr_min"}
    raw = json.dumps(settings, sort_keys=True).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def config_map(name: str, namespace: str, spec: BrokerClusterSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(f"{name}-config", namespace, name),
        "data": {"tandem.yaml": yaml.safe_dump(member_settings(spec), sort_keys=True)},
    }


def cluster_key_secret(name: str, namespace: str, key: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(f"{name}-cluster-key", namespace, name),
        "type": "Opaque",
        "stringData": {"key": key},
    }


def users_secret_name(name: str, spec: BrokerClusterSpec) -> str:
    return spec.users_secret or f"{name}-default-user"


def default_user_secret(name: str, namespace: str, password: str) -> Obj:
    """Without a usersSecret, the operator generates one user, as RabbitMQ's operator does:
    `<name>-default-user` holds its username, password, the client URL (the client
    Service's DNS name) and the definitions.json the members load."""
    user = DEFAULT_USER
    host = f"{name}.{namespace}.svc"
    users = {
        "users": [{"name": user, "password": password, "tags": ["administrator"]}],
        "vhosts": [{"name": "/"}],
        "permissions": [
            {"user": user, "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"}
        ],
    }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(f"{name}-default-user", namespace, name),
        "type": "Opaque",
        "stringData": {
            "username": user,
            "password": password,
            "host": host,
            "port": str(AMQP_PORT),
            "url": f"amqp://{user}:{password}@{host}:{AMQP_PORT}/%2F",
            "definitions.json": json.dumps(users, sort_keys=True),
        },
    }


def stateful_set(name: str, namespace: str, spec: BrokerClusterSpec) -> Obj:
    container: Obj = {
        "name": "tandem",
        "image": spec.image,
        "args": ["broker", "--config", f"{CONFIG_DIR}/tandem.yaml", "--node-id", "$(POD_NAME)"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [
            {"name": "amqp", "containerPort": AMQP_PORT},
            {"name": "admin", "containerPort": ADMIN_PORT},
            {"name": "replication", "containerPort": REPLICATION_PORT},
        ],
        # The primary's pod, told to stop, waits until the operator has moved the primary
        # role to a member in sync (a switchover: nothing confirmed is lost, clients move once).
        "lifecycle": {
            "preStop": {
                "exec": {
                    "command": [
                        "tandem",
                        "handover",
                        "--admin-port",
                        str(ADMIN_PORT),
                        "--timeout",
                        str(HANDOVER_SECONDS),
                    ]
                }
            }
        },
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "admin"}, "periodSeconds": 2},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "admin"},
            "periodSeconds": 5,
            "failureThreshold": 6,
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "data", "mountPath": DATA_DIR},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "cluster-key", "mountPath": KEY_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    volumes: list[Obj] = [
        {"name": "config", "configMap": {"name": f"{name}-config"}},
        {"name": "cluster-key", "secret": {"secretName": f"{name}-cluster-key"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if spec.tls_secret:
        container["ports"].append({"name": "amqps", "containerPort": AMQPS_PORT})
        container["volumeMounts"].append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": spec.tls_secret}})
    container["volumeMounts"].append({"name": "users", "mountPath": USERS_DIR, "readOnly": True})
    volumes.append({"name": "users", "secret": {"secretName": users_secret_name(name, spec)}})
    resources = spec.resources.model_dump(exclude_defaults=True)
    if resources:
        container["resources"] = resources
    claim: Obj = {
        "metadata": {"name": "data", "labels": selector(name)},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": spec.storage.size}},
        },
    }
    if spec.storage.storage_class_name:
        claim["spec"]["storageClassName"] = spec.storage.storage_class_name
    template: Obj = {
        # A change of the members' settings changes the template, so the operator rolls the
        # pods onto it (backups first, the primary after a switchover). The ISR minimum is
        # left out: it takes effect live, through the election record.
        "metadata": {
            "labels": labels(name),
            "annotations": {CONFIG_CHECKSUM: config_checksum(spec)},
        },
        "spec": {
            "automountServiceAccountToken": False,  # brokers never talk to the API
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": RUN_AS,
                "runAsGroup": RUN_AS,
                "fsGroup": RUN_AS,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "terminationGracePeriodSeconds": HANDOVER_SECONDS + 5,
            "containers": [container],
            "volumes": volumes,
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(name, namespace, name),
        "spec": {
            "replicas": spec.replicas,
            "serviceName": f"{name}-members",
            "podManagementPolicy": "Parallel",
            # The operator rolls pods itself: backups first, the primary last after a
            # switchover, each only once the one before is back in sync.
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": selector(name)},
            "template": merge(template, spec.pod_template),
            "volumeClaimTemplates": [claim],
            "persistentVolumeClaimRetentionPolicy": {
                "whenDeleted": spec.storage.retention,
                "whenScaled": "Retain",
            },
        },
    }


def disruption_budget(name: str, namespace: str) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name, namespace, name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name)}},
    }


def network_policy(name: str, namespace: str, spec: BrokerClusterSpec) -> Obj:
    """Clients reach the AMQP ports from anywhere; the admin port only members, the operator
    and pods labelled `tandem.dev/admin-access: "true"` (Prometheus, the audit) reach;
    replication only the members."""
    members = {"podSelector": {"matchLabels": selector(name)}}
    operator = {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": OPERATOR_NAME}},
    }
    readers = {"namespaceSelector": {}, "podSelector": {"matchLabels": {ADMIN_ACCESS: "true"}}}
    client_ports = [{"port": AMQP_PORT}] + ([{"port": AMQPS_PORT}] if spec.tls_secret else [])
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(name, namespace, name),
        "spec": {
            "podSelector": {"matchLabels": selector(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": client_ports},
                {"from": [members, operator, readers], "ports": [{"port": ADMIN_PORT}]},
                {"from": [members], "ports": [{"port": REPLICATION_PORT}]},
            ],
        },
    }


def lease(name: str, namespace: str, holder: str | None, epoch: int, isr: list[str]) -> Obj:
    """The election record (DESIGN): the holder, leaseTransitions as the epoch, the ISR in an
    annotation. Only the operator writes it, by resourceVersion compare-and-set."""
    meta = _meta(name, namespace, name)
    meta["annotations"] = {"tandem.dev/isr": ",".join(sorted(isr))}
    body: Obj = {"leaseTransitions": epoch}
    if holder is not None:
        body["holderIdentity"] = holder
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": body,
    }


def all_objects(
    name: str, namespace: str, spec: BrokerClusterSpec, key: str, password: str
) -> list[Obj]:
    """Everything a BrokerCluster needs, in the order to create it. `key` and `password` are
    used only where the Secrets do not exist yet (the operator never replaces them)."""
    users = [] if spec.users_secret else [default_user_secret(name, namespace, password)]
    return [
        cluster_key_secret(name, namespace, key),
        *users,
        config_map(name, namespace, spec),
        members_service(name, namespace),
        client_service(name, namespace, spec),
        stateful_set(name, namespace, spec),
        disruption_budget(name, namespace),
        network_policy(name, namespace, spec),
        lease(name, namespace, None, 0, []),
    ]


def merge(base: Obj, overrides: Obj) -> Obj:
    """`overrides` laid over `base`: mappings merge key by key, anything else replaces.
    Lists of named items (containers, volumes) merge by name, as kubectl's strategic merge
    does for them."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            out[key] = merge(old, value)
        elif isinstance(old, list) and isinstance(value, list) and _named(old) and _named(value):
            by_name = {item["name"]: item for item in old}
            for item in value:
                by_name[item["name"]] = merge(by_name.get(item["name"], {}), item)
            out[key] = list(by_name.values())
        else:
            out[key] = copy.deepcopy(value)
    return out


def _named(items: list[Any]) -> bool:
    return all(isinstance(i, dict) and "name" in i for i in items)
