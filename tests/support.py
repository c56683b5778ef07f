"""Test support: a real `tandem broker` subprocess and a raw AMQP socket client."""

from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pika
import yaml
from pamqp import commands, frame, header

BUG_PHRASE = "unexpected error, please report it as a bug"

# Every broker and cluster the tests started, in order: at the end of the run conftest reads
# all their logs for BUG_PHRASE (none may say it, whichever test started it).
STARTED: list[Broker | LocalCluster] = []


def bug_reports() -> list[str]:
    """The lines saying BUG_PHRASE in the logs of everything the tests started."""
    found = []
    for started in STARTED:
        text = started.logs() if isinstance(started, LocalCluster) else started.log()
        found += [line for line in text.splitlines() if BUG_PHRASE in line]
    return found


def wait_for_amqp(
    port: int, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Readiness by speaking the protocol: send the header, expect connection.start."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"broker exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"AMQP\x00\x00\x09\x01")
                data = s.recv(7)
                if len(data) == 7 and data[0] == 1:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no AMQP on port {port}")
        time.sleep(0.02)  # polling interval while the process boots, not synchronisation


def http(
    port: int, method: str, path: str, body: Any = None, token: str | None = None
) -> tuple[int, Any]:
    """One request to an admin API on 127.0.0.1:`port`: (status, JSON or text answer)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
    )
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
            ctype = resp.headers.get("Content-Type", "")
            return resp.status, json.loads(raw) if "json" in ctype else raw.decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class Broker:
    """`tandem broker` as a subprocess on free ports."""

    def __init__(
        self,
        data_dir: Path,
        config: dict[str, Any] | None = None,
        node_id: str = "test-1",
        log_dir: Path | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.config = config
        self.node_id = node_id
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_dir = log_dir or data_dir.parent
        self.log_path = self.log_dir / f"{data_dir.name}.log"
        self.amqp_port = 0
        self.admin_port = 0
        self.replication_port: int | None = None
        self.starts = 0

    def start(self) -> Broker:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports = self.data_dir / "ports.json"
        if ports.exists():
            ports.unlink()
        # A restart keeps the ports, as a real node's address stays the same.
        cmd = [
            sys.executable,
            "-m",
            "tandem.cli",
            "broker",
            "--amqp-port",
            str(self.amqp_port),
            "--admin-port",
            str(self.admin_port),
            "--data-dir",
            str(self.data_dir),
            "--node-id",
            self.node_id,
        ]
        if self.config is not None:
            cfg = self.log_dir / f"{self.data_dir.name}.yaml"
            cfg.write_text(yaml.safe_dump(self.config))
            cmd += ["--config", str(cfg)]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.starts += 1
        if self not in STARTED:
            STARTED.append(self)
        deadline = time.monotonic() + 30
        while not ports.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited: {self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(self.log())
            time.sleep(0.02)
        info = json.loads(ports.read_text())
        self.amqp_port = info["amqp"]
        self.admin_port = info["admin"]
        self.tls_port = info.get("amqps")
        self.replication_port = info.get("replication")
        wait_for_amqp(self.amqp_port, proc=self.proc)
        return self

    def stop(self) -> int:
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        self.proc = None
        return code

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.proc = None

    def restart(self) -> Broker:
        self.stop()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def url(self, user: str = "guest", password: str = "guest", vhost: str = "%2F") -> str:
        return f"amqp://{user}:{password}@127.0.0.1:{self.amqp_port}/{vhost}"

    def http(
        self, method: str, path: str, body: Any = None, token: str | None = None
    ) -> tuple[int, Any]:
        return http(self.admin_port, method, path, body, token)

    def status(self) -> dict[str, Any]:
        code, body = self.http("GET", "/status")
        assert code == 200, body
        return body  # type: ignore[no-any-return]

    def queue(self, name: str, vhost: str = "/") -> dict[str, Any]:
        for q in self.status()["queues"]:
            if q["name"] == name and q["vhost"] == vhost:
                return q  # type: ignore[no-any-return]
        raise KeyError(name)


class RawClient:
    """A bare AMQP client over a socket, for sending what real clients never would."""

    def __init__(self, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as real clients do
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_method(self, channel: int, method: Any) -> None:
        self.send(frame.marshal(method, channel))

    def recv_frame(self) -> tuple[int, Any]:
        while True:
            if len(self.buf) >= 7:
                size = struct.unpack(">I", self.buf[3:7])[0]
                if len(self.buf) >= size + 8:
                    consumed, channel, value = frame.unmarshal(self.buf)
                    self.buf = self.buf[consumed:]
                    return channel, value
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed by the broker")
            self.buf += data

    def recv_raw(self, n: int) -> bytes:
        while len(self.buf) < n:
            data = self.sock.recv(65536)
            if not data:
                break
            self.buf += data
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def expect(self, kind: type) -> Any:
        while True:
            _ch, value = self.recv_frame()
            if isinstance(value, kind):
                return value
            if (
                isinstance(value, commands.Connection.Close)
                and kind is not commands.Connection.Close
            ):
                raise AssertionError(f"connection closed: {value.reply_code} {value.reply_text}")

    def closed(self) -> bool:
        """True once the broker has closed the socket (waits up to the socket timeout)."""
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
                self.buf += data
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def handshake(
        self,
        user: str = "guest",
        password: str = "guest",
        vhost: str = "/",
        heartbeat: int = 0,
        frame_max: int = 131072,
    ) -> None:
        self.send(b"AMQP\x00\x00\x09\x01")
        self.expect(commands.Connection.Start)
        self.send_method(
            0,
            commands.Connection.StartOk(
                client_properties={
                    "capabilities": {"connection.blocked": True, "consumer_cancel_notify": True}
                },
                mechanism="PLAIN",
                response=f"\x00{user}\x00{password}",
                locale="en_US",
            ),
        )
        tune = self.expect(commands.Connection.Tune)
        self.send_method(0, commands.Connection.TuneOk(tune.channel_max, frame_max, heartbeat))
        self.send_method(0, commands.Connection.Open(vhost))
        self.expect(commands.Connection.OpenOk)

    def open_channel(self, number: int = 1) -> None:
        self.send_method(number, commands.Channel.Open())
        self.expect(commands.Channel.OpenOk)

    def publish(
        self,
        channel: int,
        exchange: str,
        routing_key: str,
        body: bytes,
        props: commands.Basic.Properties | None = None,
    ) -> None:
        """One write for the method, header and body frames, as real clients do."""
        from pamqp import body as body_mod

        parts = [
            frame.marshal(
                commands.Basic.Publish(exchange=exchange, routing_key=routing_key), channel
            ),
            frame.marshal(
                header.ContentHeader(0, len(body), props or commands.Basic.Properties()), channel
            ),
        ]
        if body:
            parts.append(frame.marshal(body_mod.ContentBody(body), channel))
        self.send(b"".join(parts))

    def close(self) -> None:
        self.sock.close()


class LocalCluster:
    """`tandem cluster up` as a subprocess on free ports."""

    def __init__(self, data_dir: Path, replicas: int = 3, *args: str) -> None:
        self.data_dir = data_dir
        self.replicas = replicas
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.amqp_port = 0
        self.admin_port = 0
        self.token: str | None = None  # the admin token its --config sets, if any

    def start(self) -> LocalCluster:
        info_path = self.data_dir / "cluster.json"
        if info_path.exists():
            info_path.unlink()
        cmd = [
            sys.executable,
            "-m",
            "tandem.cli",
            "cluster",
            "up",
            "--replicas",
            str(self.replicas),
            "--amqp-port",
            "0",
            "--admin-port",
            "0",
            "--data-dir",
            str(self.data_dir),
            *self.args,
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        if self not in STARTED:
            STARTED.append(self)
        deadline = time.monotonic() + 60
        while not info_path.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"cluster exited: {self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(self.log())
            time.sleep(0.05)  # polling interval while the processes boot
        info = json.loads(info_path.read_text())
        self.amqp_port, self.admin_port = info["amqp"], info["admin"]
        self.wait_for(lambda c: c["serving"] and len(c["isr"]) == self.replicas, "a full ISR")
        return self

    def stop(self) -> int:
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(60)
        self.proc = None
        return code

    def url(self, vhost: str = "%2F") -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/{vhost}"

    def http(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """The cluster's admin port: /cluster itself, everything else the primary's."""
        return http(self.admin_port, method, path, body, self.token)

    def cluster(self) -> dict[str, Any]:
        code, answer = http(self.admin_port, "GET", "/cluster", None, self.token)
        if code != 200:
            raise RuntimeError(f"GET /cluster: {code} {answer}")
        return answer  # type: ignore[no-any-return]

    def member(self, node: str) -> dict[str, Any]:
        return next(m for m in self.cluster()["members"] if m["node"] == node)

    def primary(self) -> dict[str, Any]:
        c = self.cluster()
        return next(m for m in c["members"] if m["node"] == c["primary"])

    def wait_for(self, ok: Any, what: str, timeout: float = 30.0) -> dict[str, Any]:
        """Poll GET /cluster until `ok(answer)`: waiting on observed state, with a deadline."""
        deadline = time.monotonic() + timeout
        while True:
            c = self.cluster()
            if ok(c):
                return c
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {timeout}s: {c}")
            time.sleep(0.05)

    def logs(self) -> str:
        parts = [self.log()]
        for p in sorted(self.data_dir.glob("*/broker.log")):
            parts.append(p.read_text(errors="replace"))
        return "\n".join(parts)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def drain(conn: Any, queue: str) -> list[bytes]:
    """Take every message of `queue` with basic.get (auto-ack) on a pika connection, close
    the connection, and return the bodies in order."""
    ch = conn.channel()
    got = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            break
        got.append(body)
    conn.close()
    return got


def churn_behind(url: str, queue: str, count: int, size: int = 32 * 1024) -> None:
    """Publish `count` persistent, confirmed messages of `size` bytes (each its number,
    padded with dots) to durable `queue`, each acked three behind the publisher: a message's
    ack lands in a later part of the log than its publish. The last three stay."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(queue, durable=True)
    persistent = pika.BasicProperties(delivery_mode=2)
    for n in range(count):
        ch.basic_publish("", queue, str(n).encode().ljust(size, b"."), persistent)
        if n >= 3:
            method, _props, _body = ch.basic_get(queue)
            ch.basic_ack(method.delivery_tag)
    ch.queue_declare(queue, durable=True, passive=True)  # round trip: the acks were handled
    conn.close()


CHART = Path(__file__).resolve().parents[1] / "charts" / "tandem"


def chart_objects(
    values: dict[str, Any] | None = None, namespace: str = "tandem-system"
) -> list[dict[str, Any]]:
    """charts/tandem rendered by Helm's engine (in process), as objects in template order."""
    import helm_python as helm

    rendered = helm.Chart.load(str(CHART)).render(
        values or {}, name="tandem", namespace=namespace, is_install=True
    )
    return [
        doc
        for path in sorted(rendered)
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(rendered[path])
        if doc
    ]


def sleeps_here(monkeypatch: Any) -> list[float]:
    """The turns a thread working for the loop gives it (`store.log.give_way`'s sleeps) on
    this thread, counted instead of slept; another thread's sleeps are slept. One left by an
    earlier test (a library's, sleeping a second at a time) spun on a sleep counted for all
    threads, and was counted 60,000 times."""
    here, sleep = threading.get_ident(), time.sleep
    given: list[float] = []

    def counted(seconds: float) -> None:
        if threading.get_ident() == here:
            given.append(seconds)
        else:
            sleep(seconds)

    monkeypatch.setattr(time, "sleep", counted)
    return given
