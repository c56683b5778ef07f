"""Replication between real broker processes, driven through /ha/* as the controller drives
them: a backup holds what the primary confirmed, refuses clients, and takes over. DESIGN
rules named per test."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from pamqp import commands

from tandem.broker.replication import core, wire
from tests import support
from tests.support import BUG_PHRASE, Broker, RawClient

KEY = "test-cluster-key-0123456789abcdef"


class Cluster:
    """Members on free ports, and the controller's commands sent by hand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.members: dict[str, Broker] = {}
        self.version = 0

    def add(self, name: str, key: str = KEY, **config: Any) -> Broker:
        key_file = self.root / f"{name}.key"
        key_file.write_text(key)
        # The tests renew nothing: a lease longer than any test, unless a test says.
        cfg = {
            "replication_port": 0,
            "cluster_key_file": str(key_file),
            "lease_seconds": 600.0,
            **config,
        }
        b = Broker(self.root / name, cfg, node_id=name)
        self.members[name] = b
        return b.start()

    def ha(self, name: str, command: str, body: dict[str, Any], key: str = KEY) -> Any:
        code, answer = self.members[name].http("POST", f"/ha/{command}", body, token=key)
        assert code == 200, answer
        return answer

    def record(self, holder: str, epoch: int, isr: list[str]) -> dict[str, Any]:
        self.version += 1
        return {"holder": holder, "epoch": epoch, "isr": isr, "version": self.version}

    def promote(self, name: str, epoch: int, isr: list[str]) -> Any:
        return self.ha(name, "promote", {"record": self.record(name, epoch, isr)})

    def pair(self) -> tuple[Broker, Broker]:
        """Members a and b: a primary of epoch 1, b its backup, both in the ISR."""
        a, b = self.add("a"), self.add("b")
        self.promote("a", 1, ["a", "b"])
        self.follow("b", "a", 1)
        return a, b

    def follow(self, name: str, primary: str, epoch: int) -> Any:
        p = self.members[primary]
        body = {
            "primary": primary,
            "epoch": epoch,
            "address": f"127.0.0.1:{p.replication_port}",
            "amqp": f"127.0.0.1:{p.amqp_port}",
        }
        return self.ha(name, "follow", body)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    for b in c.members.values():
        if b.proc is not None:
            b.stop()
        assert BUG_PHRASE not in b.log(), b.log()


def publish(b: Broker, queue: str, n: int, persistent: bool = True, start: int = 0) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(b.url()))
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    ch.confirm_delivery()
    props = pika.BasicProperties(delivery_mode=2 if persistent else 1)
    for i in range(start, start + n):
        ch.basic_publish("", queue, str(i).encode(), props)
    conn.close()


def drain(b: Broker, queue: str) -> list[int]:
    conn = pika.BlockingConnection(pika.URLParameters(b.url()))
    return [int(body) for body in support.drain(conn, queue)]


def test_a_backup_holds_every_confirmed_message_and_takes_over(cluster: Cluster) -> None:
    """Rule 3: a confirm goes out once the ISR holds the message; rule 5: the backup is
    fenced, then promoted, and serves every confirmed message, transient ones included."""
    a, b = cluster.pair()
    publish(a, "q", 100, persistent=True)
    publish(a, "q", 100, persistent=False, start=100)
    # Confirmed means held by b: no waiting needed.
    assert b.queue("q")["depth"] == 200
    assert b.status()["position"] == a.status()["position"]
    a.kill()
    fenced = cluster.ha("b", "fence", {"epoch": 2})
    assert fenced["epoch"] == 2
    cluster.promote("b", 2, ["b"])
    assert b.status()["role"] == "primary"
    assert sorted(drain(b, "q")) == list(range(200))


def test_each_reliability_level_is_what_the_new_primary_holds(cluster: Cluster) -> None:
    """x-tandem-replicate: `all` replicates a queue and its messages, `configuration` its
    declaration and bindings only, `none` nothing: after a failover the first is whole, the
    second is there and routed to but empty, and the third is gone."""
    a, b = cluster.add("a", isr_min=1), cluster.add("b", isr_min=1)  # b then publishes alone
    cluster.promote("a", 1, ["a", "b"])
    cluster.follow("b", "a", 1)
    conn = pika.BlockingConnection(pika.URLParameters(a.url()))
    ch = conn.channel()
    ch.confirm_delivery()
    props = pika.BasicProperties(delivery_mode=2)
    for level in ("all", "configuration", "none"):
        ch.queue_declare(f"q-{level}", durable=True, arguments={"x-tandem-replicate": level})
        ch.queue_bind(f"q-{level}", "amq.direct", f"k-{level}")
        for i in range(3):
            ch.basic_publish("amq.direct", f"k-{level}", str(i).encode(), props)
    conn.close()
    held = {q["name"]: (q["depth"], q["replicate"]) for q in b.status()["queues"]}
    assert held == {"q-all": (3, "all"), "q-configuration": (0, "configuration")}
    a.kill()
    cluster.ha("b", "fence", {"epoch": 2})
    cluster.promote("b", 2, ["b"])
    assert drain(b, "q-all") == [0, 1, 2]
    conn = pika.BlockingConnection(pika.URLParameters(b.url()))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("amq.direct", "k-configuration", b"7", props)  # its binding came too
    assert ch.queue_declare("q-configuration", passive=True).method.message_count == 1
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as gone:
        ch.queue_declare("q-none", passive=True)
    assert gone.value.reply_code == 404
    conn.close()


def test_a_backup_writes_over_consumed_segments_and_takes_over_with_what_is_left(
    cluster: Cluster,
) -> None:
    """A backup writes the large messages it receives into segments written over consumed
    ones (their frames salted anew for its own segments). Killed with the primary, it comes
    back with exactly the messages left and serves them."""
    a = cluster.add("a", segment_bytes=256 * 1024)
    b = cluster.add("b", segment_bytes=256 * 1024)
    cluster.promote("a", 1, ["a", "b"])
    cluster.follow("b", "a", 1)
    support.churn_behind(a.url(), "big", 100)

    def acks_on_disk() -> bool:  # acks are not confirmed: they reach b's disk soon after
        store = b.status()["store"]
        return bool(b.queue("big")["depth"] == 3 and store["synced"] == store["position"])

    wait_for(acks_on_disk, "the last acks on the backup's disk")
    assert b.status()["store"]["segments_written_over"] >= 4
    a.kill()
    b.kill()
    b.start()
    cluster.promote("b", 2, ["b"])
    conn = pika.BlockingConnection(pika.URLParameters(b.url()))
    assert [int(body.rstrip(b".")) for body in support.drain(conn, "big")] == [97, 98, 99]


def test_what_the_old_primary_delivered_goes_out_redelivered(cluster: Cluster) -> None:
    """A delivery awaiting its ack is marked in the log (one MARKS record for a queue's
    deliveries in a turn): after failover the new primary sends those messages with
    redelivered=true, and the ones never delivered with redelivered=false."""
    a, b = cluster.pair()
    publish(a, "q", 6)
    conn = pika.BlockingConnection(pika.URLParameters(a.url()))
    ch = conn.channel()
    delivered = [ch.basic_get("q")[2] for _ in range(2)]  # not acked
    assert delivered == [b"0", b"1"]
    publish(a, "q", 1, start=6)  # confirmed: b holds every record up to it, the marks too
    a.kill()
    cluster.ha("b", "fence", {"epoch": 2})
    cluster.promote("b", 2, ["b"])
    conn = pika.BlockingConnection(pika.URLParameters(b.url()))
    ch = conn.channel()
    seen = {}
    for _ in range(7):
        method, _props, body = ch.basic_get("q", auto_ack=True)
        seen[int(body)] = method.redelivered
    conn.close()
    assert seen == {0: True, 1: True, 2: False, 3: False, 4: False, 5: False, 6: False}


def test_a_backup_refuses_clients_naming_the_primary(cluster: Cluster) -> None:
    a, b = cluster.pair()
    with pytest.raises(pika.exceptions.AMQPConnectionError) as err:
        pika.BlockingConnection(pika.URLParameters(b.url()))
    # pika reports a close during the handshake as a probable access error, with the reply.
    assert "(530) 'NOT_ALLOWED - this node is a cluster backup" in str(err.value)
    assert f"the primary is a at 127.0.0.1:{a.amqp_port}" in str(err.value)


def test_a_member_with_another_key_is_refused(cluster: Cluster) -> None:
    cluster.add("a")
    cluster.add("c", key="another-cluster-key-0123456789")
    cluster.promote("a", 1, ["a"])
    p = cluster.members["a"]
    body = {"primary": "a", "epoch": 1, "address": f"127.0.0.1:{p.replication_port}"}
    cluster.ha("c", "follow", body, key="another-cluster-key-0123456789")
    log = cluster.members["a"].log
    for _ in range(200):
        if "refused replication from c: wrong cluster key" in log():
            break
        cluster.members["c"].status()  # a round trip, while the link retries
    assert "refused replication from c: wrong cluster key" in log()
    assert cluster.members["c"].status()["refused"] == "wrong cluster key"


def test_the_ha_commands_need_the_cluster_key(cluster: Cluster) -> None:
    a = cluster.add("a")
    code, answer = a.http("POST", "/ha/fence", {"epoch": 5}, token="wrong")
    assert code == 401 and "cluster key" in answer
    assert a.status()["epoch"] == 0


def test_a_restarted_backup_takes_the_difference_before_it_counts(cluster: Cluster) -> None:
    """Rule 4 and catch-up: a restarted member lost what it held in memory (transient
    messages) and says so (`whole` false); its log is a prefix of the primary's, so the
    primary sends only what differs: the transient messages, the messages published while it
    was down, and the removal of those consumed meanwhile."""
    a, b = cluster.add("a", isr_min=1), cluster.add("b", isr_min=1)
    cluster.promote("a", 1, ["a", "b"])
    cluster.follow("b", "a", 1)
    publish(a, "q", 40, persistent=True)
    publish(a, "q", 10, persistent=False, start=40)
    b.kill()
    b.start()
    assert b.status()["whole"] is False
    assert b.queue("q")["depth"] == 40  # the persistent ones, from its own disk
    cluster.ha("a", "record", {"record": cluster.record("a", 1, ["a"])})  # b left the ISR
    consumed = drain_some(a, "q", 15)
    publish(a, "q", 5, persistent=True, start=50)
    cluster.follow("b", "a", 1)
    cluster.ha("a", "record", {"record": cluster.record("a", 1, ["a", "b"])})
    publish(a, "q", 1, persistent=True, start=55)  # confirmed: b is synced
    status = b.status()
    assert status["whole"] is True and status["catch_up_bytes"] > 0
    assert "took the difference from the primary" in b.log()
    # Told by its log's end alone: the primary's window holds the 15 dequeues since.
    assert "the difference from it and the 15 dequeues since, without its digest" in a.log()
    assert consumed == list(range(15))
    assert b.queue("q")["depth"] == a.queue("q")["depth"] == 41
    b.kill()  # what it wrote to its disk reads back: the persistent ones, 40 - 15 + 5 + 1
    b.start()
    assert b.queue("q")["depth"] == 31


def drain_some(b: Broker, queue: str, n: int) -> list[int]:
    conn = pika.BlockingConnection(pika.URLParameters(b.url()))
    ch = conn.channel()
    got = []
    for _ in range(n):
        method, _p, body = ch.basic_get(queue, auto_ack=True)
        assert method is not None
        got.append(int(body))
    conn.close()
    return got


def take_then_ack(b: Broker, queue: str, n: int) -> list[int]:
    """Take `n` messages, then ack them all: each is marked delivered before any goes."""
    conn = pika.BlockingConnection(pika.URLParameters(b.url()))
    ch = conn.channel()
    got, tag = [], 0
    for _ in range(n):
        method, _p, body = ch.basic_get(queue, auto_ack=False)
        assert method is not None
        got.append(int(body))
        tag = method.delivery_tag
    ch.basic_ack(tag, multiple=True)
    conn.close()
    return got


def test_below_the_isr_minimum_publishers_are_blocked(cluster: Cluster) -> None:
    """Rule 3: below the ISR minimum the primary blocks publishers rather than confirm
    alone."""
    a = cluster.add("a")
    cluster.promote("a", 1, ["a"])  # isr_min 2
    c = RawClient(a.amqp_port)
    c.handshake()
    blocked = c.expect(commands.Connection.Blocked)
    assert "in-sync set ['a'] is below its minimum of 2" in blocked.reason
    assert "replication" in a.status()["alarms"]


def test_a_paused_primary_confirms_nothing_and_steps_down(cluster: Cluster) -> None:
    """Rules 1 and 2: a primary paused while another was promoted cannot complete a round
    once it resumes (the fenced members no longer take its records); told of the higher
    epoch, it closes its clients with 320 and never confirms what it took meanwhile."""
    a, b, _c = cluster.add("a"), cluster.add("b"), cluster.add("c")
    cluster.promote("a", 1, ["a", "b", "c"])
    cluster.follow("b", "a", 1)
    cluster.follow("c", "a", 1)
    publish(a, "q", 10)
    client = RawClient(a.amqp_port)
    client.handshake()
    client.open_channel()
    client.send_method(1, commands.Confirm.Select())
    client.expect(commands.Confirm.SelectOk)
    assert a.proc is not None
    a.proc.send_signal(signal.SIGSTOP)
    cluster.ha("b", "fence", {"epoch": 2})
    cluster.ha("c", "fence", {"epoch": 2})
    cluster.promote("b", 2, ["b", "c"])
    cluster.follow("c", "b", 2)
    a.proc.send_signal(signal.SIGCONT)
    client.publish(1, "", "q", b"lost?", commands.Basic.Properties(delivery_mode=2))
    cluster.follow("a", "b", 2)
    # What comes back is the close, not an ack: nobody holds "lost?" in epoch 2.
    _ch, reply = client.recv_frame()
    assert isinstance(reply, commands.Connection.Close), reply
    assert reply.reply_code == 320 and "no longer the primary (epoch 2)" in reply.reply_text
    assert a.status()["role"] == "backup"
    assert sorted(drain(b, "q")) == list(range(10))


def test_a_member_stops_at_a_corrupt_record_and_takes_the_rest_from_the_primary(
    cluster: Cluster,
) -> None:
    """In a cluster a corrupt record is not skipped: the member keeps its log up to it, sets
    the rest aside, says so, and is whole again only from the primary's copy. (No
    checkpoint: the whole log is replayed, as after a crash before the first one.)"""
    a = cluster.add("a", segment_bytes=8192)
    b = cluster.add("b", segment_bytes=8192, checkpoint_records=0)
    cluster.promote("a", 1, ["a", "b"])
    cluster.follow("b", "a", 1)
    publish(a, "q", 300)
    b.stop()
    segments = sorted((b.data_dir / "log").glob("*.seg"))
    assert len(segments) > 2
    data = bytearray(segments[1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    segments[1].write_bytes(bytes(data))
    b.start()
    assert "the rest comes from the primary" in b.log()
    assert list((b.data_dir / "log").glob("*.seg.bad"))
    assert b.status()["whole"] is False
    cluster.follow("b", "a", 1)
    publish(a, "q", 1, start=300)  # confirmed: b holds everything again
    assert b.queue("q")["depth"] == 301 and b.status()["whole"] is True


def test_a_deleted_vhosts_messages_do_not_come_back_in_a_queue_of_the_same_name(
    cluster: Cluster,
) -> None:
    """A vhost deleted and made again on the primary: the backup's next checkpoint names
    none of the old queue's messages, which its next start would otherwise put into the new
    queue of the same name."""
    a, b = cluster.pair()
    everything = {"configure": ".*", "write": ".*", "read": ".*"}
    assert a.http("PUT", "/api/vhosts/v")[0] in (201, 204)
    assert a.http("PUT", "/api/permissions/v/guest", everything)[0] in (201, 204)
    url = a.url(vhost="v")
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.queue_declare("q", durable=True)
    ch.confirm_delivery()
    for i in range(20):
        ch.basic_publish("", "q", str(i).encode(), pika.BasicProperties(delivery_mode=2))
    conn.close()
    assert a.http("DELETE", "/api/vhosts/v")[0] in (200, 204)
    assert a.http("PUT", "/api/vhosts/v")[0] in (201, 204)
    assert a.http("PUT", "/api/permissions/v/guest", everything)[0] in (201, 204)
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.queue_declare("q", durable=True)
    ch.confirm_delivery()
    ch.basic_publish("", "q", b"new", pika.BasicProperties(delivery_mode=2))  # b holds it
    conn.close()
    b.stop()  # a clean stop: a checkpoint
    b.start()
    assert "a checkpoint naming 1," in b.log()
    assert b.queue("q", vhost="v")["depth"] == 1


def test_a_corrupt_record_a_members_checkpoint_names_comes_back_from_the_primary(
    cluster: Cluster,
) -> None:
    """A member's clean stop writes a checkpoint; a message it names whose record is
    corrupt at the next start is left out and said so, and the primary's copy brings it
    back: the member is whole again with every message. (Queues in memory: a checkpoint
    leaves a queue that pages in the log, read and checked when the queue gets to it, as
    `test_a_backup_that_reads_a_corrupt_record_of_a_page_takes_it_from_the_primary` does.)"""
    a = cluster.add("a", segment_bytes=8192, queue_memory_bytes=0)
    b = cluster.add("b", segment_bytes=8192, queue_memory_bytes=0)
    cluster.promote("a", 1, ["a", "b"])
    cluster.follow("b", "a", 1)
    publish(a, "q", 300)
    b.stop()
    assert (b.data_dir / "log" / "checkpoint").exists()
    segments = sorted((b.data_dir / "log").glob("*.seg"))
    data = bytearray(segments[1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    segments[1].write_bytes(bytes(data))
    b.start()
    assert "the primary sends it" in b.log() and "a checkpoint naming 299" in b.log()
    assert b.queue("q")["depth"] == 299 and b.status()["whole"] is False
    cluster.follow("b", "a", 1)
    publish(a, "q", 1, start=300)  # confirmed: b holds everything again
    assert b.queue("q")["depth"] == 301 and b.status()["whole"] is True


def test_audit_checkpoints_record_the_same_depths_at_the_same_position(cluster: Cluster) -> None:
    """A checkpoint is a record: every member writes down its queue depths when it applies
    it, so the audit compares members at one position."""
    a, b = cluster.pair()
    publish(a, "q", 30)
    code, made = a.http("POST", "/replication/checkpoints")
    assert code == 200 and made["node"] == "a"
    publish(a, "q", 1, start=30)  # confirmed: b applied everything before it, the marker too
    code, theirs = b.http("GET", "/replication/checkpoints")
    assert code == 200 and theirs["node"] == "b"
    (cp,) = [c for c in theirs["checkpoints"] if c["position"] == made["position"]]
    assert cp["epoch"] == made["epoch"] == 1
    assert cp["time"] == made["time"]  # the primary's time, so lag in seconds has one clock
    depth = {d["queue"]: d["depth"] for d in cp["depths"]}
    assert depth == {d["queue"]: d["depth"] for d in made["depths"]} == {"q": 30}
    code, refused = b.http("POST", "/replication/checkpoints")
    assert code == 503 and "backup" in refused
    code, metrics = a.http("GET", "/metrics")
    assert "tandem_epoch 1.0" in metrics and "tandem_isr_size 2.0" in metrics
    assert 'tandem_member_lag_records{member="b"} 0.0' in metrics


def test_a_primary_whose_lease_lapsed_closes_its_clients(cluster: Cluster) -> None:
    """Liveness: a primary that stops hearing from the controller closes its clients and
    refuses new ones until the controller renews it."""
    a = cluster.add("a", lease_seconds=1.0, isr_min=1)
    cluster.promote("a", 1, ["a"])
    client = RawClient(a.amqp_port, timeout=10)
    client.handshake()
    _ch, reply = client.recv_frame()  # nothing renews a: the lease lapses
    assert isinstance(reply, commands.Connection.Close)
    assert reply.reply_code == 320 and "lease lapsed" in reply.reply_text
    assert a.status()["lease_lapsed"] is True
    cluster.ha("a", "record", {"record": cluster.record("a", 1, ["a"])})
    assert a.status()["lease_lapsed"] is False
    RawClient(a.amqp_port).handshake()  # served again


def test_a_committed_transaction_is_on_the_backup_whole(cluster: Cluster) -> None:
    """tx.commit-ok waits for the ISR like a confirm, and the transaction travels as one
    group of records."""
    a, b = cluster.pair()
    publish(a, "q", 5)
    conn = pika.BlockingConnection(pika.URLParameters(a.url()))
    ch = conn.channel()
    ch.tx_select()
    for i in range(5, 15):
        ch.basic_publish("", "q", str(i).encode(), pika.BasicProperties(delivery_mode=2))
    method, _p, _body = ch.basic_get("q")  # one delivery, acked in the transaction
    assert method is not None
    ch.basic_ack(method.delivery_tag)
    ch.tx_commit()
    conn.close()
    assert b.queue("q")["depth"] == 14


def diverge(cluster: Cluster, ahead: int, start: int = 5) -> tuple[Broker, Broker]:
    """a, primary of epoch 1, takes `ahead` messages b never sees (ids from `start`), dies;
    b, primary of epoch 2, takes 100..102 at the same offsets; a comes back and follows b,
    which then takes 103 (confirmed: a holds what b holds). Queue `q` holds 0..4 before."""
    a, b = cluster.add("a", isr_min=1), cluster.add("b", isr_min=1)
    cluster.promote("a", 1, ["a", "b"])
    cluster.follow("b", "a", 1)
    publish(a, "q", 5)
    b.kill()
    cluster.ha("a", "record", {"record": cluster.record("a", 1, ["a"])})
    publish(a, "q", ahead, start=start)  # confirmed by a alone (ISR minimum 1)
    a.kill()
    b.start()
    cluster.ha("b", "fence", {"epoch": 2})
    cluster.promote("b", 2, ["b"])
    publish(b, "q", 3, start=100)
    a.start()
    cluster.follow("a", "b", 2)
    cluster.ha("b", "record", {"record": cluster.record("b", 2, ["a", "b"])})
    publish(b, "q", 1, start=103)
    return a, b


def test_a_member_whose_log_diverged_takes_the_difference_and_starts_its_log_over(
    cluster: Cluster,
) -> None:
    """Rule 5 and catch-up: an old primary comes back with records the new primary never
    had; it takes the difference, not a full copy, and its log starts over from what it
    then holds, so that it reads back the same."""
    a, b = diverge(cluster, ahead=10)
    # Its brief digest (a restart) says too little where the logs part: b asked for its ids.
    assert "a follower restarted at offset 16: its digest is needed" in b.log()
    assert "took the difference from the primary" in a.log()
    assert "the log starts over from what this node holds" in a.log()
    assert a.queue("q")["depth"] == b.queue("q")["depth"] == 9
    position = a.status()["position"]
    # The log it started over with is checkpointed at once: a start need not replay it.
    wait_for(lambda: (a.data_dir / "log" / "checkpoint").exists(), "no checkpoint")
    a.kill()
    a.start()
    assert a.queue("q")["depth"] == 9 and a.status()["position"] == position
    assert "a checkpoint naming 8, then 1 records" in a.log()  # 103 came after it


def test_replication_runs_over_tls(cluster: Cluster, certs: tuple[Path, Path]) -> None:
    cert, key = certs
    tls = {
        "tls_certfile": str(cert),
        "tls_keyfile": str(key),
        "tls_cafile": str(cert),
        "tls_port": 0,
        "replication_tls": True,
    }
    a, b = cluster.add("a", **tls), cluster.add("b", **tls)
    cluster.promote("a", 1, ["a", "b"])
    cluster.follow("b", "a", 1)
    publish(a, "q", 20)
    assert b.queue("q")["depth"] == 20
    # The listener speaks TLS only: a plain client gets no challenge.
    assert a.replication_port is not None
    with socket.create_connection(("127.0.0.1", a.replication_port), timeout=1) as s:
        s.sendall(wire.pack(wire.ANSWER, {"version": wire.VERSION}))
        with pytest.raises((TimeoutError, ConnectionError)):
            if not s.recv(100):
                raise ConnectionError("closed")


def test_a_store_of_another_cluster_refuses_to_join(cluster: Cluster) -> None:
    """Rule 6: a member whose store belongs to another cluster says so and does not join."""
    a, c = cluster.add("a"), cluster.add("c")
    cluster.promote("a", 1, ["a"])
    cluster.promote("c", 1, ["c"])  # c's store now names a cluster of its own
    cluster.ha("c", "fence", {"epoch": 2})
    cluster.follow("c", "a", 2)
    theirs = a.status()["cluster"]
    for _ in range(200):
        refused = c.status()["refused"]
        if refused:
            break
        a.status()  # a round trip while c's link tries
    assert refused is not None and "belongs to cluster" in refused and theirs in refused
    assert "give this node an empty data dir" in refused
    assert c.status()["synced"] is False  # it took nothing from a


def test_a_peer_speaking_another_protocol_version_is_refused(cluster: Cluster) -> None:
    a = cluster.add("a")
    assert a.replication_port is not None
    with socket.create_connection(("127.0.0.1", a.replication_port), timeout=5) as s:
        data = b""
        while (got := wire.split(data)) is None:
            data += s.recv(4096)
        kind, challenge, _ = wire.header(data[: got[1]])
        assert kind == wire.CHALLENGE and challenge["version"] == wire.VERSION
        s.sendall(wire.pack(wire.ANSWER, {"version": 99, "node": "x", "proof": ""}))
        data = b""
        while (got := wire.split(data)) is None:
            chunk = s.recv(4096)
            assert chunk, "closed without a reason"
            data += chunk
        kind, reply, _ = wire.header(data[: got[1]])
    assert kind == wire.REFUSE
    assert reply["reason"] == "it speaks replication protocol version 99, this node speaks 1"


def test_a_follower_that_stops_reading_is_cut_off(cluster: Cluster) -> None:
    """Flow control: a follower that does not keep up cannot grow the primary's memory
    without bound; past 64 MiB unsent it is disconnected (and would catch up later)."""
    a = cluster.add("a", isr_min=1)
    cluster.promote("a", 1, ["a"])
    assert a.replication_port is not None
    with socket.create_connection(("127.0.0.1", a.replication_port), timeout=5) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        data = b""
        while (got := wire.split(data)) is None:
            data += s.recv(4096)
        _kind, challenge, _ = wire.header(data[: got[1]])
        proof = wire.proof(KEY.encode(), challenge["nonce"], "slow")
        s.sendall(wire.pack(wire.ANSWER, {"version": wire.VERSION, "node": "slow", "proof": proof}))
        hello = core.Hello("slow", 1, (1, 1), (), 0)
        s.sendall(wire.encode(hello))
        conn = pika.BlockingConnection(pika.URLParameters(a.url()))
        ch = conn.channel()
        ch.queue_declare("big", durable=True)
        ch.confirm_delivery()
        body = b"x" * 100_000
        for _ in range(900):  # 90 MB, none of it read by "slow"
            ch.basic_publish("", "big", body, pika.BasicProperties(delivery_mode=2))
        conn.close()
        assert "member slow is" in a.log() and "disconnecting it" in a.log()


def test_a_message_larger_than_the_slow_limit_reaches_the_backup_and_confirms(
    cluster: Cluster,
) -> None:
    """A follower is cut off past 64 MiB unsent, but one message that large (a client may
    send up to max_message_size, 128 MiB) says nothing of how fast it reads: one of 100 MiB
    got the backup cut off at every connection, for ever, and was never confirmed."""
    a, b = cluster.pair()
    body = bytes(range(256)) * (100 * 1024 * 1024 // 256)
    conn = pika.BlockingConnection(pika.URLParameters(a.url()))
    ch = conn.channel()
    ch.queue_declare("big", durable=True)
    ch.confirm_delivery()
    ch.basic_publish("", "big", body, pika.BasicProperties(delivery_mode=2))
    ch.basic_publish("", "big", b"after", pika.BasicProperties(delivery_mode=2))
    conn.close()
    assert b.queue("big")["depth"] == 2  # confirmed, so held by b
    assert "disconnecting it" not in a.log()
    a.kill()
    cluster.ha("b", "fence", {"epoch": 2})
    cluster.promote("b", 2, ["b"])
    conn = pika.BlockingConnection(pika.URLParameters(b.url()))
    ch = conn.channel()
    got = [ch.basic_get("big", auto_ack=True)[2] for _ in range(2)]
    conn.close()
    assert got[0] == body and got[1] == b"after"


def test_a_member_that_lost_its_store_takes_a_copy_larger_than_the_slow_limit(
    cluster: Cluster,
) -> None:
    """A copy is as large as the queues, and its bytes on the wire say nothing of how fast
    the follower reads: a member that lost its store (a new disk, a member added) takes a
    90 MB copy whole. It was cut off at 64 MiB unsent, again at every Hello, for ever."""
    a = cluster.add("a", isr_min=1)
    cluster.promote("a", 1, ["a"])
    conn = pika.BlockingConnection(pika.URLParameters(a.url()))
    ch = conn.channel()
    ch.queue_declare("big", durable=True)
    ch.confirm_delivery()
    for i in range(900):  # 90 MB, beyond the primary's window of 64 MiB: a copy
        ch.basic_publish(
            "", "big", b"%06d" % i + b"x" * 100_000, pika.BasicProperties(delivery_mode=2)
        )
    conn.close()
    b = cluster.add("b", isr_min=1)
    cluster.follow("b", "a", 1)
    deadline = time.monotonic() + 60
    while "took the difference from the primary" not in b.log():
        assert time.monotonic() < deadline, b.log()
        assert "disconnecting it" not in a.log(), a.log()
        time.sleep(0.1)  # polling interval while the copy travels
    assert b.queue("big")["depth"] == 900 and b.status()["whole"] is True
    cluster.ha("a", "record", {"record": cluster.record("a", 1, ["a", "b"])})
    publish(a, "big", 1)  # confirmed once b acks, which it does once the copy is on its disk
    assert "disconnecting it" not in a.log()
    b.kill()
    b.start()
    assert b.queue("big")["depth"] == 901


def test_a_stale_primarys_messages_never_pass_for_the_new_primarys_at_the_same_offset(
    cluster: Cluster,
) -> None:
    """Issue 14, problem 0. A paused primary comes back and a client still connected to it
    writes; the new primary wrote other (confirmed) messages at the same offsets in its own
    epoch. Message ids are (epoch, offset), so when the old primary rejoins, the difference
    replaces its stale messages with the confirmed ones; promoted later, it has every
    confirmed message and none of the stale ones. (With ids by offset alone it kept the
    stale ones and lost the confirmed.)"""
    a, b = diverge(cluster, ahead=3, start=900)  # b's 100..102 sit at a's 900..902 offsets
    b.kill()
    cluster.ha("a", "fence", {"epoch": 3})
    cluster.promote("a", 3, ["a"])
    assert drain(a, "q") == [0, 1, 2, 3, 4, 100, 101, 102, 103]


def test_server_named_queues_replicate_and_confirms_go_on(cluster: Cluster) -> None:
    """Issue 14, problem 2: a server-named queue (amq.gen-…) once failed to apply on every
    backup, in a loop, and froze every confirm in the cluster."""
    a, b = cluster.add("a", isr_min=2), cluster.add("b", isr_min=2)
    cluster.promote("a", 1, ["a", "b"])
    cluster.follow("b", "a", 1)
    conn = pika.BlockingConnection(pika.URLParameters(a.url()))
    ch = conn.channel()
    ch.confirm_delivery()
    names = [
        ch.queue_declare("", durable=True).method.queue,
        ch.queue_declare("", exclusive=True, arguments={"x-tandem-replicate": "all"}).method.queue,
        ch.queue_declare("", auto_delete=True).method.queue,
    ]
    for name in names:
        ch.basic_publish("", name, b"m", pika.BasicProperties(delivery_mode=2))  # confirmed
    held = {q["name"]: q["depth"] for q in b.status()["queues"]}
    assert all(held.get(name) == 1 for name in names), held
    conn.close()
    assert not b.status()["not_applied"]


# Every persistent message after a queue's first stays in the log, a page of its own.
PAGED = {"queue_memory_bytes": 1}


def wait_for(check: Any, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)  # polling interval: the condition is another process's


def test_a_restarted_member_whose_queue_pages_takes_the_difference_without_reading_it(
    cluster: Cluster,
) -> None:
    """A member's deep queue stays in its log across a restart: its digest is made of what
    its pages say they hold, the primary sends what differs, and the member then takes
    over with every message in order."""
    a, b = cluster.add("a", isr_min=1, **PAGED), cluster.add("b", isr_min=1, **PAGED)
    cluster.promote("a", 1, ["a", "b"])
    cluster.follow("b", "a", 1)
    publish(a, "q", 200)
    assert b.queue("q")["paged"] > 100  # a backup pages as the primary does
    b.kill()
    b.start()
    assert b.queue("q")["depth"] == 200 and b.queue("q")["paged"] > 100
    cluster.ha("a", "record", {"record": cluster.record("a", 1, ["a"])})  # b left the ISR
    consumed = drain_some(a, "q", 15)
    publish(a, "q", 5, start=200)
    cluster.follow("b", "a", 1)
    cluster.ha("a", "record", {"record": cluster.record("a", 1, ["a", "b"])})
    publish(a, "q", 1, start=205)  # confirmed: b is synced
    assert "took the difference from the primary" in b.log()
    assert "the difference from it and the 15 dequeues since, without its digest" in a.log()
    assert b.status()["whole"] is True
    assert b.queue("q")["depth"] == a.queue("q")["depth"] == 191
    assert b.queue("q")["paged"] > 100  # what it held was compared, not read back
    a.kill()
    cluster.ha("b", "fence", {"epoch": 2})
    cluster.promote("b", 2, ["b"])
    assert consumed + drain(b, "q") == list(range(206))


def test_a_new_member_takes_a_copy_of_a_primary_whose_queue_pages(cluster: Cluster) -> None:
    """A member added with an empty store takes a copy of a queue that is in the primary's
    log only: its pages (a checkpoint's, after a restart) are read on the copy's thread,
    and the member serves them all."""
    a = cluster.add("a", isr_min=1, **PAGED)
    cluster.promote("a", 1, ["a"])
    publish(a, "q", 300)
    a.stop()
    a.start()  # what it shipped last is not kept across a restart: b takes a copy
    cluster.promote("a", 2, ["a"])
    assert a.queue("q")["paged"] > 200
    b = cluster.add("b", isr_min=1, **PAGED)
    cluster.follow("b", "a", 2)
    wait_for(lambda: "took the difference" in b.log(), "the copy never came")
    cluster.ha("a", "record", {"record": cluster.record("a", 2, ["a", "b"])})
    publish(a, "q", 1, start=300)  # confirmed: b is synced
    assert b.queue("q")["depth"] == 301 and b.queue("q")["paged"] > 200
    a.kill()
    cluster.ha("b", "fence", {"epoch": 3})
    cluster.promote("b", 3, ["b"])
    assert drain(b, "q") == list(range(301))


def test_a_backup_that_reads_a_corrupt_record_of_a_page_takes_it_from_the_primary(
    cluster: Cluster,
) -> None:
    """A member's pages are checked when they are read back, not at a start. A backup
    forgets unread the messages the primary's consumers take and mark (journal.Page): a
    corrupt record among those costs nothing. One among the messages it still holds is
    found when a page is read (here by a dump of its state): the backup says so, takes a
    copy and holds every message again."""
    a = cluster.add("a", isr_min=1, segment_bytes=8192, **PAGED)
    b = cluster.add("b", isr_min=1, segment_bytes=8192, **PAGED)
    cluster.promote("a", 1, ["a", "b"])
    cluster.follow("b", "a", 1)
    publish(a, "q", 300)
    b.stop()
    segments = sorted((b.data_dir / "log").glob("*.seg"))
    for seg in (segments[0], segments[-1]):  # a message consumed below, and one left
        data = bytearray(seg.read_bytes())
        data[len(data) // 2] ^= 0xFF
        seg.write_bytes(bytes(data))
    b.start()
    cluster.follow("b", "a", 1)
    cluster.ha("a", "record", {"record": cluster.record("a", 1, ["a", "b"])})
    publish(a, "q", 1, start=300)  # confirmed: b took the difference
    assert take_then_ack(a, "q", 250) == list(range(250))
    publish(a, "q", 1, start=301)  # confirmed: b applied the marks and acks
    assert "takes a copy" not in b.log() and b.status()["whole"] is True
    assert b.queue("q")["depth"] == 52 and b.queue("q")["paged"] >= 50  # 250-299 unread
    b.http("GET", "/api/state")  # reads its pages back
    wait_for(lambda: "this member takes a copy from the primary" in b.log(), b.log())
    publish(a, "q", 1, start=302)  # confirmed once b holds everything again
    assert b.status()["whole"] is True and b.queue("q")["depth"] == 53
    a.kill()
    cluster.ha("b", "fence", {"epoch": 2})
    cluster.promote("b", 2, ["b"])
    got = drain(b, "q")
    assert got == list(range(250, 303)), repr(got)


def test_a_backup_whose_pages_took_acks_and_marks_unread_serves_the_rest_after_failover(
    cluster: Cluster,
) -> None:
    """Every message after a queue's first stays in the log on both members (a budget of one
    byte: a page each, knowing its id). The primary's consumer acks 100 messages and holds 50
    more unacked: the backup forgets the first unread and notes the marks of the others.
    After failover it serves exactly the 200 left, in order, the 50 redelivered."""
    a = cluster.add("a", isr_min=1, **PAGED)
    b = cluster.add("b", isr_min=1, **PAGED)
    cluster.promote("a", 1, ["a", "b"])
    cluster.follow("b", "a", 1)
    cluster.ha("a", "record", {"record": cluster.record("a", 1, ["a", "b"])})
    publish(a, "q", 300)
    assert take_then_ack(a, "q", 100) == list(range(100))
    conn = pika.BlockingConnection(pika.URLParameters(a.url()))
    ch = conn.channel()
    held = [int(ch.basic_get("q")[2]) for _ in range(50)]  # not acked
    assert held == list(range(100, 150))
    publish(a, "q", 1, start=300)  # confirmed: b holds every record up to it, marks too
    # None read back: the marked 50 are still paged (read back to mark them, 151 were left).
    assert b.queue("q")["depth"] == 201 and b.queue("q")["paged"] >= 195, b.queue("q")
    a.kill()
    cluster.ha("b", "fence", {"epoch": 2})
    cluster.promote("b", 2, ["b"])
    conn = pika.BlockingConnection(pika.URLParameters(b.url()))
    ch = conn.channel()
    seen = []
    for _ in range(201):
        method, _props, body = ch.basic_get("q", auto_ack=True)
        seen.append((int(body), method.redelivered))
    assert ch.basic_get("q")[0] is None
    conn.close()
    assert seen == [(n, 100 <= n < 150) for n in range(100, 301)]


def test_publishers_are_not_read_while_the_isr_is_far_behind(cluster: Cluster) -> None:
    """Flow control (issue 16): a publisher that does not wait for confirms ran 100,000
    records ahead of the backups, and the controller dropped them from the ISR. With a
    backup of the ISR stopped, the primary stops reading its publisher once 32 MiB wait for
    confirms, and reads it again once the backup caught up."""
    a, b = cluster.pair()
    total = 16_000  # of 4 KiB: 64 MB, more than the flow bound and any socket's buffers
    published = threading.Event()

    conn = pika.BlockingConnection(pika.URLParameters(a.url()))
    conn.channel().queue_declare("q", durable=True)  # declare-ok waits for b's ack
    conn.close()

    def publisher() -> None:
        conn = pika.BlockingConnection(pika.URLParameters(a.url()))
        ch = conn.channel()
        props = pika.BasicProperties(delivery_mode=2)
        for i in range(total):
            ch.basic_publish("", "q", str(i).encode().ljust(4096), props)
        conn.close()
        published.set()

    assert b.proc is not None
    b.proc.send_signal(signal.SIGSTOP)
    thread = threading.Thread(target=publisher, daemon=True)
    try:
        thread.start()
        wait_for(lambda: a.status()["flow"], "flow control to set in")
        # Not read, the publisher cannot finish: a primary that went on reading it takes
        # the rest in well under this.
        assert not published.wait(3.0), "the publisher was read while the ISR was behind"
        assert a.status()["position"] < total
    finally:
        b.proc.send_signal(signal.SIGCONT)
    assert published.wait(60.0), "the publisher was not read again"
    wait_for(lambda: not a.status()["flow"], "flow control to end")
    assert a.status()["flow_episodes"] >= 1
    assert drain(a, "q") == list(range(total))
