"""Users, vhosts, permissions, the admin API and its token, `tandem ctl`, TLS, alarms."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import pika
import pika.exceptions
import pytest
from pamqp import commands

from tandem.broker.status import NodeStatus
from tests.support import Broker, RawClient

CONFIG = {
    "admin_token": "s3cret-token",
    "vhosts": ["/", "prod"],
    "users": [
        {"name": "admin", "password": "adminpw", "tags": ["administrator"]},
        {"name": "app", "password": "apppw"},
    ],
    "permissions": [
        {"user": "admin", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
        {"user": "admin", "vhost": "prod", "configure": ".*", "write": ".*", "read": ".*"},
        {
            "user": "app",
            "vhost": "prod",
            "configure": "^app\\.",
            "write": "^app\\.|amq\\.direct",
            "read": "^app\\.",
        },
    ],
}


def connect(
    broker: Broker, user: str, password: str, vhost: str = "%2F"
) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(broker.url(user, password, vhost)))


def test_configured_users_replace_guest(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(CONFIG)
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        connect(broker, "guest", "guest")
    connect(broker, "admin", "adminpw").close()


def test_permissions_configure_write_read(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(CONFIG)
    conn = connect(broker, "app", "apppw", "prod")
    ch = conn.channel()
    ch.queue_declare("app.jobs")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("other")
    assert err.value.reply_code == 403
    ch = conn.channel()
    ch.basic_publish("", "app.jobs", b"x")  # write on the default exchange "" is refused
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("app.jobs", passive=True)
    assert err.value.reply_code == 403
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_bind("app.jobs", "amq.direct", "jobs")  # needs read on amq.direct too
    assert err.value.reply_code == 403
    ch = conn.channel()
    ch.basic_publish("amq.direct", "jobs", b"x")  # write on amq.direct is granted
    ch.queue_declare("app.jobs", passive=True)
    conn.close()


def test_permission_denied_bind_without_read_on_exchange(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(
        {
            **CONFIG,
            "permissions": [
                {
                    "user": "app",
                    "vhost": "prod",
                    "configure": ".*",
                    "write": ".*",
                    "read": "^app\\.",
                }
            ],
        }
    )
    conn = connect(broker, "app", "apppw", "prod")
    ch = conn.channel()
    ch.queue_declare("app.q")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_bind("app.q", "amq.fanout")
    assert err.value.reply_code == 403
    conn.close()


def test_vhost_without_permission_is_refused(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(CONFIG)
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError):
        connect(broker, "app", "apppw", "%2F")


def test_vhosts_isolate_queues(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(CONFIG)
    a = connect(broker, "admin", "adminpw", "%2F").channel()
    b = connect(broker, "admin", "adminpw", "prod").channel()
    a.queue_declare("same-name")
    b.queue_declare("same-name")
    a.basic_publish("", "same-name", b"root")
    assert b.basic_get("same-name", auto_ack=True)[0] is None
    assert a.basic_get("same-name", auto_ack=True)[2] == b"root"


def test_admin_token_protects_all_but_health_and_metrics(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(CONFIG)
    assert broker.http("GET", "/health")[0] == 200
    assert broker.http("GET", "/metrics")[0] == 200
    for path in ("/status", "/ready", "/api/users"):
        assert broker.http("GET", path)[0] == 401
        assert broker.http("GET", path, token="wrong")[0] == 401
        assert broker.http("GET", path, token="s3cret-token")[0] == 200


def test_status_contract(broker: Broker) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(broker.url()))
    ch = conn.channel()
    ch.queue_declare("st", durable=True)
    ch.queue_declare("st-none", arguments={"x-tandem-replicate": "none"})
    ch.basic_publish("", "st", b"1")
    ch.basic_publish("", "st", b"2")
    ch.basic_get("st")
    status = broker.status()
    # The broker publishes the typed contract every reader parses (tandem.broker.status):
    # nothing it says is left undeclared, and a lone node says nothing of replication.
    parsed = NodeStatus.model_validate(status)
    assert not parsed.model_extra, f"fields the contract does not declare: {parsed.model_extra}"
    assert parsed.role == "standalone" and "isr" not in status and "whole" not in status
    q = broker.queue("st")
    assert (q["depth"], q["ready"], q["unacked"], q["replicate"]) == (2, 1, 1, "all")
    assert broker.queue("st-none")["replicate"] == "none"
    before = status["position"]
    ch.basic_publish("", "st", b"3", pika.BasicProperties(delivery_mode=2))
    ch.queue_declare("st", passive=True)
    assert broker.status()["position"] > before
    conn.close()


def test_metrics(broker: Broker) -> None:
    params = pika.URLParameters(broker.url())
    params.client_properties = {"connection_name": "billing-worker"}
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("m", durable=True)
    for _ in range(3):
        ch.basic_publish("", "m", b"x", pika.BasicProperties(delivery_mode=2))
    ch.basic_get("m", auto_ack=True)
    code, text = broker.http("GET", "/metrics")
    assert code == 200
    assert 'tandem_queue_depth{queue="m",vhost="/"} 2.0' in text
    assert 'tandem_queue_published_total{queue="m",vhost="/"} 3.0' in text
    assert "tandem_connections 1.0" in text
    assert "tandem_channels 1.0" in text
    assert "tandem_fsync_seconds_count" in text
    assert "process_resident_memory_bytes" in text
    count = [line for line in text.splitlines() if line.startswith("tandem_fsync_seconds_count")]
    assert float(count[0].split()[-1]) >= 1
    conn.close()
    assert "'billing-worker' (user 'guest', vhost '/')" in broker.log()


def ctl(broker: Broker, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "ctl",
        "--url",
        f"http://127.0.0.1:{broker.admin_port}",
        *args,
    ]
    if token:
        cmd += ["--token", token]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def test_ctl_manages_users_vhosts_permissions_and_they_persist(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(CONFIG)
    tok = "s3cret-token"
    assert ctl(broker, "add_vhost", "staging", token=tok).returncode == 0
    assert ctl(broker, "add_user", "carol", "carolpw", token=tok).returncode == 0
    r = ctl(broker, "set_permissions", "-p", "staging", "carol", ".*", ".*", ".*", token=tok)
    assert r.returncode == 0, r.stderr
    connect(broker, "carol", "carolpw", "staging").close()
    assert ctl(broker, "add_user", "x", "y").returncode == 1  # no token
    broker.restart()
    connect(broker, "carol", "carolpw", "staging").close()
    assert "carol" in ctl(broker, "list_users", token=tok).stdout
    assert ctl(broker, "delete_user", "carol", token=tok).returncode == 0
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        connect(broker, "carol", "carolpw", "staging")
    stored = (broker.data_dir / "auth.json").read_text()
    assert "adminpw" not in stored  # hashed, never in clear


def test_deleting_a_vhost_closes_its_connections(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(CONFIG)
    conn = connect(broker, "admin", "adminpw", "prod")
    assert broker.http("DELETE", "/api/vhosts/prod", token="s3cret-token")[0] == 200
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as err:
        conn.process_data_events(time_limit=1)
        conn.channel()
    assert err.value.reply_code == 320


def test_guest_is_loopback_only_unless_configured(broker_factory) -> None:  # type: ignore[no-untyped-def]
    from tandem.broker.model.auth import Users

    users = Users()
    users.add("guest", password="guest", loopback_only=True)
    assert users.authenticate("guest", "guest", loopback=True) is not None
    assert users.authenticate("guest", "guest", loopback=False) is None


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("amqp_port: 'five'\n")
    r = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "broker", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert "amqp_port: must be a valid integer (got 'five')" in r.stderr
    cfg.write_text("nonsense_key: 1\n")
    r = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "broker", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "unknown setting 'nonsense_key'" in r.stderr


def test_tls_listener(broker_factory, certs: tuple[Path, Path]) -> None:  # type: ignore[no-untyped-def]
    cert, key = certs
    broker = broker_factory({"tls_certfile": str(cert), "tls_keyfile": str(key), "tls_port": 0})
    assert broker.tls_port
    ctx = ssl.create_default_context(cafile=str(cert))
    params = pika.ConnectionParameters(
        "127.0.0.1", broker.tls_port, ssl_options=pika.SSLOptions(ctx, "localhost")
    )
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.queue_declare("tls")
    ch.basic_publish("", "tls", b"secret")
    assert ch.basic_get("tls", auto_ack=True)[2] == b"secret"
    conn.close()


def test_disk_alarm_blocks_publishers(broker_factory) -> None:  # type: ignore[no-untyped-def]
    # A free-disk limit no disk meets: the alarm goes off at once.
    broker = broker_factory({"disk_free_limit": 1 << 60})
    c = RawClient(broker.amqp_port)
    c.handshake()
    blocked = c.expect(commands.Connection.Blocked)
    assert "free disk space" in blocked.reason
    assert "disk" in broker.status()["alarms"]


def test_memory_alarm_blocks_and_stops_reading_publishers(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory({"memory_high_watermark": 1})
    c = RawClient(broker.amqp_port)
    c.handshake()
    assert "memory" in c.expect(commands.Connection.Blocked).reason
    c.open_channel()
    c.send_method(1, commands.Confirm.Select())
    c.expect(commands.Confirm.SelectOk)
    c.send_method(1, commands.Queue.Declare(queue="held"))
    c.expect(commands.Queue.DeclareOk)
    c.publish(1, "", "held", b"first")
    c.expect(commands.Basic.Ack)  # the publish was handled; reading stops after it
    c.send_method(1, commands.Queue.Declare(queue="held", passive=True))
    c.sock.settimeout(1.0)
    with pytest.raises(TimeoutError):
        c.recv_frame()  # no answer: the broker no longer reads this publisher
    assert broker.queue("held")["depth"] == 1


RABBITMQ_DEFINITIONS = {
    "rabbit_version": "3.10.8",
    "users": [
        {
            "name": "legacy",
            # RabbitMQ's documented example hash of the password "test12".
            "password_hash": "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR",
            "hashing_algorithm": "rabbit_password_hashing_sha256",
            "tags": "administrator",
        }
    ],
    "vhosts": [{"name": "/"}, {"name": "legacy-vh"}],
    "permissions": [
        {"user": "legacy", "vhost": "legacy-vh", "configure": ".*", "write": ".*", "read": ".*"}
    ],
    "exchanges": [
        {
            "name": "orders",
            "vhost": "legacy-vh",
            "type": "topic",
            "durable": True,
            "auto_delete": False,
            "internal": False,
            "arguments": {},
        }
    ],
    "queues": [
        {
            "name": "orders.eu",
            "vhost": "legacy-vh",
            "durable": True,
            "auto_delete": False,
            "arguments": {"x-max-length": 1000},
        }
    ],
    "bindings": [
        {
            "source": "orders",
            "vhost": "legacy-vh",
            "destination": "orders.eu",
            "destination_type": "queue",
            "routing_key": "eu.#",
            "arguments": {},
        }
    ],
}


def test_rabbitmq_definitions_import_and_export(broker_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import json

    path = tmp_path / "definitions.json"
    path.write_text(json.dumps(RABBITMQ_DEFINITIONS))
    broker = broker_factory({"definitions": str(path)})
    conn = connect(broker, "legacy", "test12", "legacy-vh")
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish(
        "orders", "eu.de", b"bestellung", pika.BasicProperties(delivery_mode=2), mandatory=True
    )
    assert (
        ch.queue_declare(
            "orders.eu", durable=True, arguments={"x-max-length": 1000}, passive=True
        ).method.message_count
        == 1
    )
    conn.close()
    code, exported = broker.http("GET", "/api/definitions")
    assert code == 200
    assert {
        "name": "orders.eu",
        "vhost": "legacy-vh",
        "durable": True,
        "auto_delete": False,
        "arguments": {"x-max-length": 1000},
    } in exported["queues"]
    assert any(b["source"] == "orders" and b["routing_key"] == "eu.#" for b in exported["bindings"])
    user = next(u for u in exported["users"] if u["name"] == "legacy")
    assert user["password_hash"] == RABBITMQ_DEFINITIONS["users"][0]["password_hash"]
    assert user["hashing_algorithm"] == "rabbit_password_hashing_sha256"
    # Loading is idempotent: a restart with the same file keeps the queue's messages.
    broker.restart()
    assert broker.queue("orders.eu", "legacy-vh")["depth"] == 1


def test_definitions_posted_to_a_running_broker_merge_users_and_persist(broker: Broker) -> None:
    """POST /api/definitions, as RabbitMQ's import: users, vhosts and permissions created or
    replaced, none deleted; recorded, so a restart keeps them. Queues, exchanges and bindings
    are refused with a reason rather than half applied."""
    doc = {
        "users": [{"name": "app", "password": "first", "tags": []}],
        "vhosts": [{"name": "apps"}],
        "permissions": [
            {"user": "app", "vhost": "apps", "configure": ".*", "write": ".*", "read": ".*"}
        ],
    }
    code, answer = broker.http("POST", "/api/definitions", doc)
    assert code == 200 and answer == {"users": 1, "vhosts": 1, "permissions": 1}, answer
    connect(broker, "app", "first", "apps").close()
    doc["users"][0]["password"] = "second"  # a rotation
    assert broker.http("POST", "/api/definitions", {"users": doc["users"]})[0] == 200
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        connect(broker, "app", "first", "apps")
    broker.restart()
    connect(broker, "app", "second", "apps").close()  # kept: its permission too
    connect(broker, "guest", "guest").close()  # not in the document, not deleted
    queue = {"name": "q", "vhost": "/", "durable": True, "auto_delete": False, "arguments": {}}
    code, answer = broker.http("POST", "/api/definitions", {"queues": [queue]})
    assert code == 400 and "cannot be imported into a running broker" in answer, answer
    code, answer = broker.http("POST", "/api/definitions", {"users": [{"name": "x"}]})
    assert code == 400 and "needs 'password' or 'password_hash'" in answer, answer


def test_bad_definitions_file_is_a_clear_error(tmp_path: Path) -> None:
    import json

    bad = dict(
        RABBITMQ_DEFINITIONS,
        users=[
            {
                "name": "x",
                "password_hash": "abc",
                "hashing_algorithm": "rabbit_password_hashing_md5",
            }
        ],
    )
    path = tmp_path / "definitions.json"
    path.write_text(json.dumps(bad))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"definitions: {path}\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "broker",
            "--config",
            str(cfg),
            "--amqp-port",
            "0",
            "--admin-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert "rabbit_password_hashing_md5" in r.stderr and str(path) in r.stderr
