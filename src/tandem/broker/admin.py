"""The admin HTTP API: health, readiness, status, Prometheus metrics and user management.

Everything but /health and /metrics asks for `Authorization: Bearer <token>` when a token is
configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ValidationError

from tandem.broker.config import Config
from tandem.broker.model import definitions, spec, state
from tandem.broker.model.broker import Broker
from tandem.broker.protocol.connection import Connection
from tandem.broker.replication.member import Member
from tandem.broker.status import NodeStatus
from tandem.errors import ConfigError
from tandem.ha.model import ElectionRecord

if TYPE_CHECKING:
    from tandem.broker.store.log import Store

log = logging.getLogger(__name__)


class HasConnection(Protocol):
    @property
    def conn(self) -> Connection | None: ...


class Node(Protocol):
    """What the admin API needs of its node (the port `tandem.broker.node.Node` implements)."""

    @property
    def cfg(self) -> Config: ...

    @property
    def broker(self) -> Broker: ...

    @property
    def ready(self) -> bool: ...

    @property
    def loaded(self) -> asyncio.Event: ...

    @property
    def role(self) -> str: ...

    @property
    def refusal(self) -> str | None: ...

    @property
    def cluster_key(self) -> bytes | None: ...

    @property
    def member(self) -> Member | None: ...

    @property
    def alarms(self) -> dict[str, str]: ...

    @property
    def not_applied(self) -> list[str]: ...

    @property
    def connections(self) -> Collection[HasConnection]: ...

    def status(self, brief: bool = False) -> NodeStatus: ...

    def save_auth(self) -> None: ...

    def delete_vhost(self, name: str) -> bool: ...


M = TypeVar("M", bound=BaseModel)

LISTEN_BACKLOG: Final = 128  # aiohttp's own

FSYNC_SECONDS = Histogram(
    "tandem_fsync_seconds",
    "Time one group-commit fsync of the log took",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    registry=None,
)


CHECKPOINT_SECONDS = Histogram(
    "tandem_checkpoint_seconds",
    "Time from a checkpoint's capture to its file written: a restart replays the log since the "
    "last one written",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=None,
)


def bind_store_metrics(store: Store) -> None:
    store.fsync_seconds = FSYNC_SECONDS.observe
    store.checkpoint_seconds = CHECKPOINT_SECONDS.observe


class NodeCollector:
    """Reads the model at scrape time, so the hot path counts nothing extra."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def collect(self) -> Iterator[Any]:
        node = self.node
        conns = [p.conn for p in node.connections if p.conn is not None]
        yield GaugeMetricFamily("tandem_connections", "Open client connections", value=len(conns))
        yield GaugeMetricFamily(
            "tandem_channels", "Open channels", value=sum(len(c.channels) for c in conns)
        )
        yield GaugeMetricFamily(
            "tandem_consumers",
            "Consumers",
            value=sum(len(ch.consumers) for c in conns for ch in c.channels.values()),
        )
        depth = GaugeMetricFamily(
            "tandem_queue_depth", "Messages ready plus unacked", labels=["vhost", "queue"]
        )
        ready = GaugeMetricFamily("tandem_queue_ready", "Messages ready", labels=["vhost", "queue"])
        unacked = GaugeMetricFamily(
            "tandem_queue_unacked", "Messages delivered, not acked", labels=["vhost", "queue"]
        )
        published = CounterMetricFamily(
            "tandem_queue_published", "Messages enqueued", labels=["vhost", "queue"]
        )
        delivered = CounterMetricFamily(
            "tandem_queue_delivered", "Messages delivered", labels=["vhost", "queue"]
        )
        acked = CounterMetricFamily(
            "tandem_queue_acked", "Messages acknowledged", labels=["vhost", "queue"]
        )
        for vh in node.broker.vhosts.values():
            for q in vh.queues.values():
                labels = [vh.name, q.name]
                depth.add_metric(labels, q.depth)
                ready.add_metric(labels, q.ready)
                unacked.add_metric(labels, q.unacked)
                published.add_metric(labels, q.published)
                delivered.add_metric(labels, q.delivered)
                acked.add_metric(labels, q.acked)
        yield from (depth, ready, unacked, published, delivered, acked)
        yield GaugeMetricFamily(
            "tandem_log_position", "Offset of the last log record", value=node.broker.journal.offset
        )
        yield GaugeMetricFamily("tandem_alarms", "Alarms in force", value=len(node.alarms))
        member = node.member
        yield CounterMetricFamily(
            "tandem_records_not_applied",
            "Records this node could not apply and set aside (a bug: see /status not_applied)",
            value=len(node.not_applied) + (member.log.not_applied_total if member else 0),
        )
        if member is None:
            return
        st = member.status()
        yield GaugeMetricFamily(
            "tandem_diverged",
            "1 while a record from the primary did not apply here, until a copy replaces "
            "this member's state",
            value=1 if st.diverged else 0,
        )
        role = GaugeMetricFamily("tandem_role", "1 for this node's role", labels=["role"])
        role.add_metric([node.role], 1)
        yield role
        yield GaugeMetricFamily("tandem_epoch", "The highest epoch adopted", value=st.epoch)
        yield CounterMetricFamily(
            "tandem_failovers", "Times this node became primary", value=st.failovers
        )
        yield CounterMetricFamily(
            "tandem_catch_up_bytes",
            "Bytes taken from a primary to catch up",
            value=st.catch_up_bytes,
        )
        yield GaugeMetricFamily(
            "tandem_replication_rtt_seconds",
            "From shipping a record to its ack (smoothed)",
            value=st.replication_rtt_seconds,
        )
        if st.isr is not None:
            yield GaugeMetricFamily(
                "tandem_isr_size", "Members in the in-sync set", value=len(st.isr)
            )
            yield GaugeMetricFamily(
                "tandem_flow",
                "1 while publishers are not read: too much waits for the in-sync set's acks",
                value=1 if st.flow else 0,
            )
            yield CounterMetricFamily(
                "tandem_flow_episodes",
                "Times publishers were not read until the in-sync set caught up",
                value=st.flow_episodes or 0,
            )
            lag = GaugeMetricFamily(
                "tandem_member_lag_records", "Records a member has not acked", labels=["member"]
            )
            lag_s = GaugeMetricFamily(
                "tandem_member_lag_seconds",
                "Age of the oldest record a member has not acked",
                labels=["member"],
            )
            for name, m in st.members.items():
                lag.add_metric([name], m.lag_records)
                lag_s.add_metric([name], m.lag_seconds)
            yield lag
            yield lag_s


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json_error(status: int, text: str) -> web.Response:
    return web.json_response({"error": text}, status=status)


def _bad_request(text: str) -> web.HTTPBadRequest:
    """A 400 with the same JSON body as `_json_error`, for helpers to raise."""
    return web.HTTPBadRequest(text=json.dumps({"error": text}), content_type="application/json")


def bearer(request: web.Request, secret: str | bytes) -> bool:
    """The request carries `Authorization: Bearer <secret>` (compared in constant time)."""
    raw = secret.decode() if isinstance(secret, bytes) else secret
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {raw}".encode())


def make_app(node: Node) -> web.Application:
    registry = CollectorRegistry()
    registry.register(NodeCollector(node))
    registry.register(FSYNC_SECONDS)
    registry.register(CHECKPOINT_SECONDS)
    ProcessCollector(registry=registry)  # process_resident_memory_bytes, open fds, CPU
    token = node.cfg.admin_token

    cluster_key = node.cluster_key

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/ha/"):
            # The controller's commands: only with the cluster key, even without a token.
            if cluster_key is None or node.member is None:
                return _json_error(404, "this node is not a cluster member")
            if not bearer(request, cluster_key):
                return _json_error(
                    401, "the HA commands need 'Authorization: Bearer <cluster key>'"
                )
            return await handler(request)
        if request.path.startswith("/api/") and not node.loaded.is_set():
            return _json_error(503, "this node is starting: its store is not loaded yet")
        if (
            node.role == "backup"
            and request.path.startswith("/api/")
            and request.method not in ("GET", "HEAD")
        ):
            return _json_error(
                503,
                f"{node.refusal}; make changes on the primary (the cluster's admin address "
                "forwards them there)",
            )
        if token and request.path not in ("/health", "/metrics"):
            if (
                request.path == "/status"
                and cluster_key is not None
                and bearer(request, cluster_key)
            ):
                return await handler(request)
            if not bearer(request, token):
                return _json_error(
                    401,
                    "a valid bearer token is required: send 'Authorization: Bearer <token>' "
                    "(tandem ctl: --token or TANDEM_ADMIN_TOKEN)",
                )
        return await handler(request)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "node": node.cfg.node_id})

    async def ready(request: web.Request) -> web.Response:
        if node.ready:
            return web.json_response({"ready": True})
        return web.json_response({"ready": False}, status=503)

    async def status(request: web.Request) -> web.Response:
        """GET /status; `?brief=1` leaves out the queues (the controller polls it often)."""
        return web.json_response(node.status(brief=bool(request.query.get("brief"))).publish())

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def ha(request: web.Request) -> web.Response:
        """POST /ha/fence {epoch}, /ha/promote {record}, /ha/follow {primary, epoch,
        address, amqp}, /ha/record {record}: the controller's commands. Each answers the
        member's replication status once the command took effect (the epoch on disk)."""
        member = node.member
        assert member is not None
        body = await _body(request)
        what = request.match_info["command"]
        try:
            if what == "fence":
                answer = member.fence(int(body["epoch"]))
            elif what == "promote":
                if not node.loaded.is_set():  # said Hello before loading (`Node.run`)
                    return _json_error(503, "this member's store is not loaded yet")
                answer = member.promote(ElectionRecord.from_dict(body["record"]))
            elif what == "record":
                answer = member.inform(
                    ElectionRecord.from_dict(body["record"]), str(body.get("why", ""))
                )
            elif what == "users":
                # The operator's copy of a users Secret: the cluster key stands for the
                # admin token here, as the controller holds no other credential.
                if node.role == "backup":
                    return _json_error(503, f"{node.refusal}; users are set on the primary")
                return await import_auth(body)
            elif what == "follow":
                host, _, port = str(body["address"]).rpartition(":")
                amqp = body.get("amqp")
                answer = member.follow(
                    str(body["primary"]),
                    int(body["epoch"]),
                    (host, int(port)),
                    None if amqp is None else str(amqp),
                )
            else:
                return _json_error(404, f"no HA command '{what}'")
        except (KeyError, TypeError, ValueError) as exc:
            return _json_error(400, f"bad {what} command: {exc!r}")
        return web.json_response(answer.publish())

    async def checkpoints(request: web.Request) -> web.Response:
        """GET: the per-queue depths this member recorded at each audit checkpoint it
        applied (the last 100). POST (on the primary): put a checkpoint into the stream now."""
        member = node.member
        if member is None:
            return _json_error(404, "audit checkpoints exist on cluster members only")
        if request.method == "POST":
            made = member.checkpoint()
            if made is None:
                return _json_error(503, f"{node.refusal}; checkpoints are made on the primary")
            return web.json_response(made)
        return web.json_response(
            {"node": node.cfg.node_id, "checkpoints": list(member.checkpoints)}
        )

    async def saved() -> None:
        """Users, vhosts or permissions changed: recorded in the log (ordered with the
        deletions before and after it) and answered once that survives a crash."""
        node.save_auth()
        await _recorded(node.broker)

    async def list_users(request: web.Request) -> web.Response:
        users = node.broker.users.users.values()
        return web.json_response([{"name": u.name, "tags": u.tags} for u in users])

    async def put_user(request: web.Request) -> web.Response:
        """Create or update, as RabbitMQ's HTTP API does. `If-None-Match: *` only creates
        (409 when the user exists: `tandem ctl add_user`); `If-Match: *` only updates (404
        when it does not: `change_password`). An update without `tags` keeps the user's."""
        name = request.match_info["name"]
        body = await _body(request)
        existing = node.broker.users.users.get(name)
        if existing is not None and request.headers.get("If-None-Match") == "*":
            return _json_error(409, f"user '{name}' already exists")
        if existing is None and request.headers.get("If-Match") == "*":
            return _json_error(404, f"no user '{name}'")
        if existing is not None and "tags" not in body:
            body["tags"] = existing.tags
        node.broker.add_user(_valid(spec.RabbitUser, {**body, "name": name}), node.cfg.guest_remote)
        await saved()
        log.info("user '%s' %s through the admin API", name, "changed" if existing else "added")
        return web.json_response({"name": name}, status=200 if existing else 201)

    async def delete_user(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if not node.broker.users.delete(name):
            return _json_error(404, f"no user '{name}'")
        await saved()
        return web.json_response({"deleted": name})

    async def list_vhosts(request: web.Request) -> web.Response:
        return web.json_response([{"name": n} for n in sorted(node.broker.vhosts)])

    async def put_vhost(request: web.Request) -> web.Response:
        name = _valid(
            spec.RabbitVhost, {**await _body(request, empty=True), **request.match_info}
        ).name
        node.broker.add_vhost(name)
        await saved()
        return web.json_response({"name": name}, status=201)

    async def delete_vhost(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if not node.delete_vhost(name):
            return _json_error(404, f"no vhost '{name}'")
        await saved()
        return web.json_response({"deleted": name})

    async def list_permissions(request: web.Request) -> web.Response:
        perms = node.broker.users.permissions.items()
        return web.json_response(
            [
                {"user": u, "vhost": v, "configure": p.configure, "write": p.write, "read": p.read}
                for (u, v), p in perms
            ]
        )

    async def put_permission(request: web.Request) -> web.Response:
        vhost, user = request.match_info["vhost"], request.match_info["user"]
        if vhost not in node.broker.vhosts:
            return _json_error(404, f"no vhost '{vhost}'")
        if user not in node.broker.users.users:
            return _json_error(404, f"no user '{user}'")
        body = await _body(request)
        node.broker.set_permission(
            _valid(spec.RabbitPermission, {**body, "user": user, "vhost": vhost})
        )
        await saved()
        return web.json_response({"user": user, "vhost": vhost}, status=201)

    async def delete_permission(request: web.Request) -> web.Response:
        vhost, user = request.match_info["vhost"], request.match_info["user"]
        if not node.broker.users.clear_permission(user, vhost):
            return _json_error(404, f"no permissions for '{user}' on '{vhost}'")
        await saved()
        return web.json_response({"deleted": True})

    async def export_definitions(request: web.Request) -> web.Response:
        return web.json_response(definitions.json_safe(definitions.export(node.broker)))

    async def import_auth(body: dict[str, Any]) -> web.Response:
        """Users, vhosts and permissions of a RabbitMQ definitions document, merged as
        RabbitMQ's import merges: each one given is created or replaced, none is deleted."""
        try:
            data = definitions.validate(body, "the definitions")
        except ConfigError as exc:
            return _json_error(400, str(exc))
        entities = [k for k in ("exchanges", "queues", "bindings") if data.get(k)]
        if entities:
            return _json_error(
                400,
                f"{', '.join(entities)} cannot be imported into a running broker; declare them "
                "from a client, or put them in the definitions file read at start",
            )
        try:
            definitions.apply_auth(node.broker, data, node.cfg.guest_remote)
        except ValidationError as exc:
            return _json_error(400, f"invalid definitions: {exc.errors()[0]['msg']}")
        await saved()
        counts = {k: len(data.get(k, [])) for k in ("users", "vhosts", "permissions")}
        log.info("definitions imported: %s", ", ".join(f"{n} {k}" for k, n in counts.items()))
        return web.json_response(counts)

    async def post_definitions(request: web.Request) -> web.Response:
        return await import_auth(await _body(request))

    async def dump_state(request: web.Request) -> web.Response:
        """The whole state, exact to the byte (model/state.py); ?durable=true: only what a
        restart keeps; ?replicated=true: only what every backup holds too."""
        durable = request.query.get("durable", "") in ("1", "true")
        replicated = request.query.get("replicated", "") in ("1", "true")
        return web.json_response(
            state.dump(node.broker, durable_only=durable, replicated_only=replicated)
        )

    async def list_queues(request: web.Request) -> web.Response:
        return web.json_response(node.status().publish()["queues"])

    app = web.Application(middlewares=[auth])
    app.add_routes(
        [
            web.get("/health", health),
            web.get("/ready", ready),
            web.get("/status", status),
            web.get("/metrics", metrics),
            web.get("/api/users", list_users),
            web.put("/api/users/{name}", put_user),
            web.delete("/api/users/{name}", delete_user),
            web.get("/api/vhosts", list_vhosts),
            web.put("/api/vhosts/{name}", put_vhost),
            web.delete("/api/vhosts/{name}", delete_vhost),
            web.get("/api/permissions", list_permissions),
            web.put("/api/permissions/{vhost}/{user}", put_permission),
            web.delete("/api/permissions/{vhost}/{user}", delete_permission),
            web.get("/api/queues", list_queues),
            web.get("/api/definitions", export_definitions),
            web.post("/api/definitions", post_definitions),
            web.get("/api/state", dump_state),
            web.post("/ha/{command}", ha),
            web.get("/replication/checkpoints", checkpoints),
            web.post("/replication/checkpoints", checkpoints),
        ]
    )
    return app


async def _recorded(broker: Broker, timeout: float = 10.0) -> None:
    """Wait until what the model recorded so far is on disk and held by the in-sync set, as a
    confirm does (at most `timeout`: an admin call does not hang on a blocked cluster)."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def finish() -> None:
        if not done.done():
            done.set_result(None)

    broker.journal.when_done(finish)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done, timeout)


async def _body(request: web.Request, empty: bool = False) -> dict[str, Any]:
    """The request's JSON object; `empty` lets a PUT without a body stand for `{}`."""
    if empty and not await request.read():
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise _bad_request("the body must be JSON") from None
    if not isinstance(body, dict):
        raise _bad_request("the body must be a JSON object")
    return body


def _valid(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _bad_request(spec.describe(exc)) from None


async def start(
    node: Node,
    host: str,
    port: int,
    shutdown_timeout: float = 60.0,
    sock: socket.socket | None = None,
) -> tuple[web.AppRunner, int]:
    """The admin API, listening on `host`:`port`, or on `sock`, bound already;
    `shutdown_timeout`: how long its cleanup waits for the requests under way. Raises
    OSError when it cannot listen."""
    if sock is not None:
        # Here, not in the site: uvloop drops an error to listen on a socket it is given (a
        # server that bound the port too, with SO_REUSEADDR, and listened first).
        sock.listen(LISTEN_BACKLOG)
    runner = web.AppRunner(make_app(node), access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site: web.BaseSite = (
        web.SockSite(runner, sock, backlog=LISTEN_BACKLOG)
        if sock is not None
        else web.TCPSite(runner, host, port)
    )
    await site.start()
    server = site._server
    assert server is not None
    sockets = getattr(server, "sockets", None) or []
    return runner, sockets[0].getsockname()[1] if sockets else port
