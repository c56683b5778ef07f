"""What a new user meets first: the command line, the data dir, `tandem ctl` and the admin API
with bad input. Every refusal is one clear line and changes nothing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import BUG_PHRASE, Broker

TOKEN = "front-door-token"
ADMIN_CONFIG = {"admin_token": TOKEN}


def tandem(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def ctl(broker: Broker, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess[str]:
    extra = ["--token", token] if token else []
    return tandem("ctl", "--url", f"http://127.0.0.1:{broker.admin_port}", *args, *extra)


def one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


# -- the command line --


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--amqp-port", "99999"], "argument --amqp-port: 99999 is not a port (0 to 65535"),
        (["--amqp-port", "-5"], "argument --amqp-port: -5 is not a port"),
        (["--admin-port", "65536"], "argument --admin-port: 65536 is not a port"),
        (["--amqp-port", "five"], "argument --amqp-port: 'five' is not a port number"),
    ],
)
def test_ports_out_of_range_are_refused(args: list[str], expected: str) -> None:
    r = tandem("broker", *args)
    assert r.returncode == 2
    assert expected in r.stderr
    assert "Traceback" not in r.stderr


def test_yaml_ports_out_of_range_are_refused(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("admin_port: 99999\n")
    line = one_line_error(tandem("broker", "--config", str(tmp_path / "t.yaml")))
    assert "admin_port: must be less than or equal to 65535" in line


def test_version_and_help_show_defaults() -> None:
    r = tandem("--version")
    assert r.returncode == 0 and r.stdout.startswith("tandem 0.")
    help_text = tandem("broker", "--help").stdout
    assert "default 5672" in help_text and "default 15672" in help_text
    ctl_help = " ".join(tandem("ctl", "--help").stdout.split())
    assert "(or TANDEM_ADMIN_URL) (default: http://127.0.0.1:15672)" in ctl_help


def test_port_in_use_names_the_option(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = tandem("broker", "--amqp-port", str(port), "--admin-port", "0")
    line = one_line_error(r)
    assert f"cannot listen for AMQP on 127.0.0.1:{port}" in line
    assert "--amqp-port" in line


def test_a_data_dir_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    line = one_line_error(tandem("broker", "--data-dir", str(blocker / "data")))
    assert f"cannot create data dir {blocker / 'data'}" in line


def test_a_second_broker_on_a_live_data_dir_refuses_and_names_the_holder(
    broker_factory: Any, tmp_path: Path
) -> None:
    first: Broker = broker_factory()
    assert first.proc is not None
    before = (first.data_dir / "ports.json").read_text()
    r = tandem("broker", "--data-dir", str(first.data_dir), "--amqp-port", "0", "--admin-port", "0")
    line = one_line_error(r)
    assert f"data dir {first.data_dir} is in use by pid {first.proc.pid}" in line
    assert (first.data_dir / "ports.json").read_text() == before  # nothing overwritten
    conn = pika.BlockingConnection(pika.URLParameters(first.url()))  # the first one serves on
    conn.close()


def test_the_data_dir_lock_is_released_by_kill_9(broker_factory: Any) -> None:
    b: Broker = broker_factory()
    b.kill()
    b.start()  # the kernel dropped the lock with the process
    pika.BlockingConnection(pika.URLParameters(b.url())).close()


def test_tls_certificate_without_key_and_missing_files(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("tls_certfile: cert.pem\n")
    line = one_line_error(tandem("broker", "--config", str(tmp_path / "t.yaml")))
    assert "'tls_certfile' is set but 'tls_keyfile' is not" in line
    (tmp_path / "t.yaml").write_text("tls_certfile: cert.pem\ntls_keyfile: key.pem\n")
    line = one_line_error(
        tandem("broker", "--config", str(tmp_path / "t.yaml"), "--amqp-port", "0")
    )
    assert f"tls_certfile: cannot read {tmp_path.resolve() / 'cert.pem'}" in line


def test_relative_definitions_are_found_beside_the_config(
    broker_factory: Any, tmp_path: Path
) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "defs.json").write_text(
        json.dumps({"queues": [{"name": "from-defs", "vhost": "/", "durable": True}]})
    )
    # The test Broker writes its YAML into tmp_path; the broker runs in another directory.
    b: Broker = broker_factory({"definitions": "etc/defs.json"})
    assert b.queue("from-defs")["durable"] is True


def test_bad_permission_in_definitions_stops_the_node(tmp_path: Path) -> None:
    defs = tmp_path / "defs.json"
    perm = {"user": "guest", "vhost": "/", "configure": "[", "write": ".*", "read": ".*"}
    defs.write_text(json.dumps({"permissions": [perm]}))
    (tmp_path / "t.yaml").write_text(f"definitions: {defs}\n")
    line = one_line_error(
        tandem("broker", "--config", str(tmp_path / "t.yaml"), "--amqp-port", "0")
    )
    assert "permissions[0].configure: not a valid regular expression" in line


# -- tandem ctl and the admin API --


@pytest.fixture
def admin_broker(broker_factory: Any) -> Broker:
    return broker_factory(ADMIN_CONFIG)  # type: ignore[no-any-return]


def test_invalid_permission_pattern_is_refused_everywhere_and_changes_nothing(
    admin_broker: Broker,
) -> None:
    b = admin_broker
    assert ctl(b, "add_user", "carol", "pw").returncode == 0
    assert ctl(b, "set_permissions", "carol", "^carol", ".*", ".*").returncode == 0
    line = one_line_error(ctl(b, "set_permissions", "carol", "[", ".*", ".*"))
    assert "400" in line and "configure: not a valid regular expression" in line
    code, body = b.http(
        "PUT", "/api/permissions/%2F/carol", {"configure": ".*", "write": "(", "read": ".*"}, TOKEN
    )
    assert code == 400 and "write: not a valid regular expression" in body
    code, body = b.http("PUT", "/api/permissions/%2F/carol", {"configure": ".*"}, TOKEN)
    assert code == 400 and "'write' is required" in body and "'read' is required" in body
    perms = json.loads(ctl(b, "list_permissions", "--format", "json").stdout)
    assert {"user": "carol", "vhost": "/", "configure": "^carol", "write": ".*", "read": ".*"} in (
        perms
    )
    conn = pika.BlockingConnection(pika.URLParameters(b.url("carol", "pw")))
    ch = conn.channel()
    ch.queue_declare("carol.q")  # the user still works, with the permissions set before
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("other")
    assert err.value.reply_code == 403
    conn.close()


def test_add_user_refuses_an_existing_user_and_change_password_changes_it(
    admin_broker: Broker,
) -> None:
    b = admin_broker
    assert ctl(b, "add_user", "carol", "first", "--tags", "monitoring").returncode == 0
    assert ctl(b, "set_permissions", "carol", ".*", ".*", ".*").returncode == 0
    line = one_line_error(ctl(b, "add_user", "carol", "second"))
    assert "user 'carol' already exists" in line and "change_password" in line
    pika.BlockingConnection(pika.URLParameters(b.url("carol", "first"))).close()
    assert ctl(b, "change_password", "carol", "second").returncode == 0
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        pika.BlockingConnection(pika.URLParameters(b.url("carol", "first")))
    pika.BlockingConnection(pika.URLParameters(b.url("carol", "second"))).close()
    users = json.loads(ctl(b, "list_users", "--format", "json").stdout)
    assert {"name": "carol", "tags": ["monitoring"]} in users  # change_password kept the tags
    assert "no user 'dave'" in one_line_error(ctl(b, "change_password", "dave", "x"))


def test_ctl_prints_tables_and_json_on_request(admin_broker: Broker) -> None:
    b = admin_broker
    r = ctl(b, "add_vhost", "staging")
    assert r.stdout.strip() == "added vhost staging"
    lines = ctl(b, "list_vhosts").stdout.splitlines()
    assert lines == ["name", "/", "staging"]
    users = ctl(b, "list_users").stdout.splitlines()
    assert users[0] == "name\ttags" and "guest\tadministrator" in users
    assert json.loads(ctl(b, "list_vhosts", "--format", "json").stdout) == [
        {"name": "/"},
        {"name": "staging"},
    ]
    status = ctl(b, "status").stdout
    assert "node: test-1" in status and "vhost\tname\tdepth\tconsumers\treplicate" in status


def test_ctl_reads_the_admin_url_from_the_environment(admin_broker: Broker) -> None:
    import os

    env = {**os.environ, "TANDEM_ADMIN_URL": f"http://127.0.0.1:{admin_broker.admin_port}"}
    r = tandem("ctl", "list_vhosts", "--token", TOKEN, env=env)
    assert r.returncode == 0 and r.stdout.splitlines() == ["name", "/"]


def test_a_missing_token_says_how_to_pass_it(admin_broker: Broker) -> None:
    line = one_line_error(ctl(admin_broker, "list_users", token=None))
    assert "401" in line and "--token or TANDEM_ADMIN_TOKEN" in line


def test_access_error_names_the_default_exchange_as_rabbitmq_does(
    broker_factory: Any,
) -> None:
    b: Broker = broker_factory(
        {
            "users": [{"name": "app", "password": "pw"}],
            "permissions": [
                {"user": "app", "vhost": "/", "configure": ".*", "write": "^app", "read": ".*"}
            ],
        }
    )
    conn = pika.BlockingConnection(pika.URLParameters(b.url("app", "pw")))
    ch = conn.channel()
    ch.queue_declare("app.q")
    ch.basic_publish("", "app.q", b"x")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("app.q", passive=True)
    assert err.value.reply_code == 403
    assert "access to exchange 'amq.default' in vhost '/' refused" in err.value.reply_text
    conn.close()


# Arbitrary JSON bodies: each is accepted or refused with a 4xx and a message, never a 5xx.

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
field = (
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.just("[") | st.just(".*")
)
bodies = json_values | st.fixed_dictionaries(
    {},
    optional={
        "password": field,
        "password_hash": field | st.just("A" * 48),
        "tags": field | st.lists(field, max_size=3),
        "configure": field,
        "write": field,
        "read": field,
        "hashing_algorithm": field,
    },
)
TARGETS = ["/api/users/fuzz", "/api/vhosts/fuzz-vh", "/api/permissions/%2F/fuzz"]


@pytest.fixture(scope="module")
def fuzz_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    b = Broker(tmp_path_factory.mktemp("fuzz") / "node", ADMIN_CONFIG).start()
    code, _ = b.http("PUT", "/api/users/fuzz", {"password": "pw"}, TOKEN)
    assert code == 201
    yield b
    b.stop()
    assert BUG_PHRASE not in b.log()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(target=st.sampled_from(TARGETS), body=bodies, raw=st.booleans())
def test_any_json_body_gets_a_2xx_or_a_4xx_with_a_message(
    fuzz_broker: Broker, target: str, body: Any, raw: bool
) -> None:
    data = json.dumps(body).encode()
    if raw:
        data = data[: len(data) // 2]  # also bodies that are not JSON at all
    req = urllib.request.Request(
        f"http://127.0.0.1:{fuzz_broker.admin_port}{target}", method="PUT", data=data
    )
    req.add_header("Authorization", f"Bearer {TOKEN}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status in (200, 201)
    except urllib.error.HTTPError as exc:
        assert 400 <= exc.code < 500, exc.read()
        assert json.loads(exc.read())["error"]
    # The node still answers, and the user the fuzz may have changed still exists.
    assert fuzz_broker.http("GET", "/api/users", token=TOKEN)[0] == 200
