"""The typed settings model: every field's type and range, named in one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.broker import config
from tandem.broker.model import definitions, spec
from tandem.errors import ConfigError

PERM = {"user": "app", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"}


def refused(raw: Any) -> str:
    with pytest.raises(ConfigError) as err:
        config.parse(raw, "t.yaml")
    text = str(err.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"amqp_port": 99999}, "amqp_port: must be less than or equal to 65535 (got 99999)"),
        ({"amqp_port": -5}, "amqp_port: must be greater than or equal to 0 (got -5)"),
        ({"admin_port": 70000}, "admin_port: must be less than or equal to 65535"),
        ({"amqp_port": True}, "amqp_port: must be a valid integer"),
        ({"heartbeat": True}, "heartbeat: must be a valid integer (got True)"),
        ({"heartbeat": "soon"}, "heartbeat: must be a valid integer (got 'soon')"),
        ({"log_level": "LOUD"}, "log_level: must be 'DEBUG', 'INFO', 'WARNING', 'ERROR' or"),
        ({"nonsense": 1}, "unknown setting 'nonsense'"),
        ({"users": {"alice": {"password": "x"}}}, "users: must be a valid list"),
        ({"users": [{"name": "a", "password": 1234}]}, "users[0].password: must be a valid string"),
        ({"users": [{"name": "a"}]}, "users[0]: user 'a' needs 'password' or 'password_hash'"),
        ({"users": [{"name": "a", "password_hash": "xyz"}]}, "not a RabbitMQ SHA-256 password"),
        ({"vhosts": "prod"}, "vhosts: must be a valid list"),
        ({"tls_certfile": "cert.pem"}, "'tls_certfile' is set but 'tls_keyfile' is not"),
        ({"tls_keyfile": "key.pem"}, "'tls_keyfile' is set but 'tls_certfile' is not"),
        ({"tls_port": 5671}, "'tls_port' needs 'tls_certfile' and 'tls_keyfile'"),
        ({"data_dir": 5}, "data_dir: must be a path"),
        ({"frame_max": 100}, "frame_max: must be greater than or equal to 4096"),
    ],
)
def test_each_bad_setting_is_named(raw: dict[str, Any], expected: str) -> None:
    assert expected in refused(raw)


def test_a_number_given_as_a_password_says_to_quote_it() -> None:
    assert "quote it in YAML: '1234'" in refused({"users": [{"name": "a", "password": 1234}]})


@pytest.mark.parametrize("missing", ["user", "vhost", "configure", "write", "read"])
def test_a_permission_needs_every_field(missing: str) -> None:
    perm = {k: v for k, v in PERM.items() if k != missing}
    assert f"permissions[0]: '{missing}' is required" in refused({"permissions": [perm]})


@pytest.mark.parametrize("field", ["configure", "write", "read"])
def test_a_permission_pattern_must_be_a_regex(field: str) -> None:
    text = refused({"permissions": [{**PERM, field: "["}]})
    assert f"permissions[0].{field}: not a valid regular expression" in text


def test_tags_as_one_comma_separated_string_are_tags_not_letters() -> None:
    cfg = config.parse({"users": [{"name": "a", "password": "p", "tags": "administrator"}]})
    assert cfg.users[0].tags == ["administrator"]
    cfg = config.parse({"users": [{"name": "a", "password": "p", "tags": "admin, monitoring"}]})
    assert cfg.users[0].tags == ["admin", "monitoring"]


def test_log_level_is_case_insensitive() -> None:
    assert config.parse({"log_level": "debug"}).log_level == "DEBUG"


def test_tls_with_cert_and_key_listens_on_5671_unless_told() -> None:
    cfg = config.parse({"tls_certfile": "/c.pem", "tls_keyfile": "/k.pem"})
    assert cfg.tls and cfg.amqps_port == 5671
    assert config.parse({**cfg.model_dump(), "tls_port": 0}).amqps_port == 0
    assert not config.parse({}).tls


def test_paths_in_a_file_are_relative_to_it(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "t.yaml").write_text("definitions: defs.json\ndata_dir: data\n")
    cfg = config.load(etc / "t.yaml")
    assert cfg.definitions == etc.resolve() / "defs.json"
    assert cfg.data_dir == etc.resolve() / "data"
    # The command line's paths are the user's, relative to where they stand.
    cfg = config.load(etc / "t.yaml", {"data_dir": "here"})
    assert cfg.data_dir == Path("here")


def test_command_line_overrides_the_file_and_is_validated(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("amqp_port: 5673\n")
    assert config.load(tmp_path / "t.yaml", {"amqp_port": 0}).amqp_port == 0
    assert config.load(tmp_path / "t.yaml", {"amqp_port": None}).amqp_port == 5673
    with pytest.raises(ConfigError, match="amqp_port"):
        config.load(None, {"amqp_port": 70000})


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        config.load(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("a: [\n")
    with pytest.raises(ConfigError, match="is not valid YAML") as err:
        config.load(tmp_path / "bad.yaml")
    assert "\n" not in str(err.value)
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        config.load(tmp_path / "list.yaml")


def test_definitions_go_through_the_same_specs() -> None:
    with pytest.raises(ConfigError, match=r"permissions\[0\]: 'read' is required"):
        definitions.validate({"permissions": [{k: v for k, v in PERM.items() if k != "read"}]}, "d")
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        definitions.validate({"permissions": [{**PERM, "write": "(("}]}, "d")
    # RabbitMQ's export keys Tandem does not use are ignored, as RabbitMQ ignores them.
    user = {"name": "a", "password_hash": "A" * 48, "tags": "administrator", "limits": {}}
    assert definitions.validate({"users": [user]}, "d")


def test_describe_joins_several_problems_on_one_line() -> None:
    with pytest.raises(spec.ValidationError) as err:
        config.Config.model_validate({"amqp_port": "x", "heartbeat": "y"})
    text = spec.describe(err.value)
    assert text.count(";") == 1 and "amqp_port" in text and "heartbeat" in text


# Any YAML document at all: the loader accepts it or refuses it with one line, never a traceback.
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
keys = st.sampled_from(list(config.Config.model_fields)) | st.text(max_size=10) | st.integers()
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=6),
    max_leaves=20,
)
user_like = st.fixed_dictionaries(
    {},
    optional={
        "name": scalars,
        "password": scalars,
        "password_hash": scalars,
        "tags": scalars | st.lists(scalars, max_size=3),
    },
)
perm_like = st.fixed_dictionaries(
    {}, optional={k: scalars | st.just("[") | st.just(".*") for k in PERM}
)
settings_like = st.fixed_dictionaries(
    {},
    optional={
        "users": st.lists(user_like, max_size=2) | documents,
        "permissions": st.lists(perm_like, max_size=2) | documents,
        **{name: scalars for name in config.Config.model_fields if name not in ("users",)},
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=st.one_of(documents, settings_like) | st.text(max_size=80).map(lambda t: ("raw", t)))
def test_any_yaml_document_is_accepted_or_refused_in_one_line(
    doc: Any, tmp_path_factory: Any
) -> None:
    path = tmp_path_factory.mktemp("cfg") / "t.yaml"
    if isinstance(doc, tuple):
        path.write_text(doc[1])
    else:
        path.write_text(yaml.safe_dump(doc))
    try:
        cfg = config.load(path)
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        assert isinstance(cfg, config.Config)


def test_a_name_with_a_line_break_is_refused_in_one_line(tmp_path: Any) -> None:
    """Found by the property above: a user named "\\n" was echoed raw into the error."""
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"users": [{"name": "a\nb"}]}))
    with pytest.raises(ConfigError) as refused:
        config.load(path)
    assert "\n" not in str(refused.value) and "user 'a\\nb' needs 'password'" in str(refused.value)
