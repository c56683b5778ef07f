"""Pure model: routing, matching, property scanning, queues, auth, config. No I/O."""

from __future__ import annotations

import pytest
from pamqp import commands

from tandem import errors
from tandem.broker.model import auth, message
from tandem.broker.model import queue as queue_mod
from tandem.broker.model.broker import Broker
from tandem.broker.model.exchange import HeadersExchange, topic_match


@pytest.mark.parametrize(
    ("pattern", "key", "match"),
    [
        ("a.b.c", "a.b.c", True),
        ("a.*.c", "a.x.c", True),
        ("a.*.c", "a.c", False),
        ("a.#", "a", True),
        ("a.#", "a.b.c.d", True),
        ("#", "", True),
        ("#", "a.b", True),
        ("*", "", False),
        ("*", "a", True),
        ("*.*", "a", False),
        ("#.c", "c", True),
        ("a.#.c", "a.c", True),
        ("a.#.c", "a.b.b.c", True),
        ("a.#.c", "a.b.b.d", False),
        ("#.#", "a", True),
        ("a.*.#", "a", False),
        ("a.*.#", "a.b", True),
        ("", "", True),
        ("", "a", False),
    ],
)
def test_topic_match(pattern: str, key: str, match: bool) -> None:
    p = tuple(pattern.split(".")) if pattern else ()
    w = tuple(key.split(".")) if key else ()
    assert topic_match(p, w) is match


@pytest.mark.parametrize(
    ("args", "headers", "match"),
    [
        ({"x-match": "all", "a": 1}, {"a": 1}, True),
        ({"x-match": "all", "a": 1, "b": 2}, {"a": 1}, False),
        ({"x-match": "any", "a": 1, "b": 2}, {"b": 2}, True),
        ({"x-match": "any", "a": 1}, {}, False),
        ({"a": 1}, {"a": 1, "z": 0}, True),  # all is the default
        ({"x-match": "all"}, {}, True),
        ({"x-match": "any-with-x", "x-k": 1}, {"x-k": 1}, True),
        ({"x-match": "any", "x-k": 1}, {"x-k": 1}, False),
    ],
)
def test_headers_match(args: dict, headers: dict, match: bool) -> None:
    assert HeadersExchange.matches(args, headers) is match


def make_msg(props: commands.Basic.Properties) -> message.Message:
    raw = props.marshal()
    return message.Message("", "rk", message.encode_route("", "rk"), raw, b"body", 4)


def test_scan_reads_delivery_mode_priority_expiration() -> None:
    m = make_msg(
        commands.Basic.Properties(
            content_type="text/plain",
            headers={"k": "v"},
            delivery_mode=2,
            priority=7,
            correlation_id="c",
            reply_to="r",
            expiration="1500",
        )
    )
    message.scan(m)
    assert (m.persistent, m.priority, m.expiration) == (True, 7, 1500)


def test_scan_of_empty_properties() -> None:
    m = make_msg(commands.Basic.Properties())
    message.scan(m)
    assert (m.persistent, m.priority, m.expiration) == (False, 0, None)


@pytest.mark.parametrize("bad", ["-1", "soon", "1.5"])
def test_scan_refuses_bad_expiration(bad: str) -> None:
    m = make_msg(commands.Basic.Properties(expiration=bad))
    with pytest.raises(ValueError):
        message.scan(m)


def test_rabbitmq_password_hash_compatibility() -> None:
    # The worked example from RabbitMQ's documentation on password hashing.
    known = "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR"
    assert auth.hash_password("test12", bytes.fromhex("908DC60A")) == known
    assert auth.check_password("test12", known)
    assert not auth.check_password("test13", known)
    assert not auth.check_password("x", "not base64!")


def test_permission_patterns_match_like_rabbitmq() -> None:
    p = auth.Permission(configure="^app\\.", write="", read=".*")
    assert p.allows("configure", "app.q")
    assert not p.allows("configure", "other")
    assert not p.allows("write", "anything")  # an empty pattern allows nothing
    assert p.allows("read", "")


def clocked() -> tuple[Broker, list[int]]:
    now = [0]
    b = Broker(clock=lambda: now[0])
    b.add_vhost("/")
    return b, now


def test_queue_ttl_with_injected_clock() -> None:
    b, now = clocked()
    vh = b.vhost("/")
    q, _ = vh.declare_queue("t", arguments={"x-message-ttl": 100})
    m = make_msg(commands.Basic.Properties())
    m.ts = now[0]
    q.enqueue(m)
    now[0] = 99
    assert q.expire_head() == 0
    now[0] = 100
    assert q.expire_head() == 1
    assert q.depth == 0


def test_drop_head_keeps_newest() -> None:
    b, _ = clocked()
    q, _ = b.vhost("/").declare_queue("m", arguments={"x-max-length": 2})
    msgs = [make_msg(commands.Basic.Properties()) for _ in range(3)]
    for m in msgs:
        assert q.enqueue(m)
    assert list(q.messages) == msgs[1:]


def test_redeclare_checks_known_arguments_only() -> None:
    b, _ = clocked()
    vh = b.vhost("/")
    vh.declare_queue("q", arguments={"x-max-length": 5})
    vh.declare_queue("q", arguments={"x-max-length": 5, "x-custom": 1})
    with pytest.raises(errors.PreconditionFailed):
        vh.declare_queue("q", arguments={"x-max-length": 6})


def test_error_classes_and_codes() -> None:
    assert not errors.NotFound("x").hard
    assert errors.NotFound.code == 404
    assert errors.FrameError("x").hard
    assert errors.FrameError("x").reply_text() == "FRAME_ERROR - x"


def test_scan_refuses_truncated_properties() -> None:
    raw = commands.Basic.Properties(content_type="text/plain", delivery_mode=2).marshal()
    m = message.Message("", "rk", message.encode_route("", "rk"), raw[:-4], b"", 0)
    with pytest.raises(ValueError, match="truncated"):
        message.scan(m)


def test_users_and_permissions_enter_the_model_through_their_specs() -> None:
    from tandem.broker.model.spec import PermissionSpec, UserSpec

    b = Broker()
    assert b.add_user(UserSpec(name="guest", password="guest")).loopback_only
    assert not b.add_user(UserSpec(name="guest", password="guest"), guest_remote=True).loopback_only
    perm = PermissionSpec(user="app", vhost="new", configure="^a", write="", read=".*")
    with pytest.raises(errors.ConfigError, match="user 'app', who does not exist"):
        b.set_permission(perm)
    b.add_user(UserSpec(name="app", password="pw", tags="monitoring"))  # type: ignore[arg-type]
    b.set_permission(perm)
    assert "new" in b.vhosts
    assert b.users.permission("app", "new") == auth.Permission("^a", "", ".*")


@pytest.mark.parametrize(
    ("name", "bad", "good"),
    [
        ("x-max-priority", 256, 255),
        ("x-max-priority", -1, 0),
        ("x-expires", 0, 1),
        ("x-message-ttl", True, 0),
        ("x-max-length", "3", 3),
    ],
)
def test_integer_arguments_are_checked_at_the_edge_and_taken_as_decided_after(
    name: str, bad: object, good: int
) -> None:
    """A client's declaration fails with RabbitMQ's error; a queue made from a record (a
    decision already taken) reads the same limits leniently and never refuses."""
    with pytest.raises(errors.PreconditionFailed, match=name):
        queue_mod.check_arguments({name: bad})
    queue_mod.check_arguments({name: good})
    assert queue_mod._int_arg({name: bad}, name) is None
    assert queue_mod._int_arg({name: good}, name) == good
