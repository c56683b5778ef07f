"""One set of versions: the README's commands, CI and the image all install what
constraints.txt pins, and the tests run on exactly those versions."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)$")


def pins() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        found = PIN.match(line)
        assert found, f"constraints.txt: not an exact pin: {line!r}"
        out[canonicalize_name(found[1])] = found[2]
    return out


def pip_installs(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(r"pip\b.* install ", line)]


def test_every_install_of_tandem_uses_the_constraints() -> None:
    readme = (ROOT / "README.md").read_text().split("## A five-minute tour", 1)[0]
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    for where, text in [
        ("README", readme),
        (".ci/run", (ROOT / ".ci" / "run").read_text()),
        ("Dockerfile", dockerfile),
    ]:
        installs = pip_installs(text)
        assert installs, f"{where} installs nothing"
        for line in installs:
            assert re.search(r"-c \S*constraints\.txt", line), f"{where}: {line.strip()}"


def test_every_dependency_is_pinned_within_its_range() -> None:
    pinned = pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted += [r for r in extra if not r.startswith("tandem[")]
    for text in wanted:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pinned[name]}, outside {req.specifier}"
        )


def test_the_tests_run_on_the_pinned_versions() -> None:
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    differ = {
        name: (version, installed[name])
        for name, version in pins().items()
        if name in installed and installed[name] != version
    }
    assert not differ, (
        f"installed versions differ from constraints.txt (pinned, installed): {differ}; "
        "install with: python3 -m pip install -c constraints.txt -e '.[test]'"
    )
