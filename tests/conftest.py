from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import BUG_PHRASE, Broker, LocalCluster


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[type]:
    """Start brokers with a given config; stops them and checks their logs afterwards."""
    started: list[Broker] = []

    def make(config: dict | None = None, name: str = "node") -> Broker:
        b = Broker(tmp_path / name, config)
        started.append(b)
        return b.start()

    yield make  # type: ignore[misc]
    for b in started:
        b.stop()
        assert BUG_PHRASE not in b.log(), b.log()


@pytest.fixture
def broker(broker_factory) -> Broker:  # type: ignore[no-untyped-def]
    return broker_factory()  # type: ignore[no-any-return]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """`tandem cluster up` with three members on free ports; its logs are checked after."""
    c = LocalCluster(tmp_path / "cluster", 3).start()
    yield c
    c.stop()
    assert BUG_PHRASE not in c.logs(), c.logs()


@pytest.fixture
def certs(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
