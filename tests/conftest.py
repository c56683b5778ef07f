from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import support
from tests.support import BUG_PHRASE, Broker, LocalCluster


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Nothing any broker or cluster of this run logged says "report it as a bug" (issue 14):
    the run fails and names the lines, whichever test started the process, including those
    whose own checks did not read the log."""
    found = support.bug_reports()
    if not found:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.section("logs that say: report it as a bug", red=True)
        for line in found[:50]:
            reporter.line(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
