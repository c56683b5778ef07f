"""Compiled modules run only while they are current (tandem._compiled): an edited source, or
TANDEM_PURE=1, runs every compiled module from its source instead."""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import _compiled

ROOT = Path(__file__).resolve().parents[2]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
PROBE = (
    "import json, pkg._compiled as c, pkg.mod as m; "
    "print(json.dumps([c.WHY_NOT, c.MODULES, m.__file__]))"
)


def checkout(tmp_path: Path) -> Path:
    """A checkout of a package `pkg` with one compiled module, `mod`: its source, and in
    place of its extension and of the group's library, files that fail if imported."""
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("")
    (src / "pkg" / "__init__.py").write_text("")
    shutil.copy(Path(_compiled.__file__), src / "pkg" / "_compiled.py")
    (src / "pkg" / "mod.py").write_text("")
    (src / "pkg" / f"mod{SUFFIX}").write_text("not an extension")
    # The group's library loads, and holds `mod` (mypyc names a module's init so).
    (src / f"{_compiled.GROUP}.py").write_text("init_pkg___mod = None\n")
    return src


def compiled() -> list[str]:
    """The sources setup.py compiles, relative to the checkout."""
    return re.findall(r'"(src/[^"]+\.py)"', (ROOT / "setup.py").read_text())


def run(src: Path, **env: str) -> list[object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, "PYTHONPATH": str(src), **env},
        capture_output=True,
        text=True,
        check=True,
    )
    result: list[object] = json.loads(out.stdout)
    return result


def test_an_edited_source_runs_every_compiled_module_from_source(tmp_path: Path) -> None:
    src = checkout(tmp_path)
    for source in (src / "pkg").glob("*.py"):
        os.utime(source, (1_000_000, 1_000_000))
    os.utime(src / f"{_compiled.GROUP}.py", (2_000_000, 2_000_000))  # then the build
    (src / "pkg" / "mod.py").write_text("# edited\n")  # then an edit
    why, modules, loaded = run(src, TANDEM_PURE="")
    assert why == "pkg/mod.py changed since it was compiled (pip install -e . compiles again)"
    assert modules == ["pkg.mod"]
    assert loaded == str(src / "pkg" / "mod.py")  # not the extension, which fails to load


def test_an_extension_left_from_another_build_runs_them_from_source(tmp_path: Path) -> None:
    src = checkout(tmp_path)
    for source in (src / "pkg").glob("*.py"):
        os.utime(source, (1_000_000, 1_000_000))  # older than the build
    (src / "pkg" / "gone.py").write_text("")
    os.utime(src / "pkg" / "gone.py", (1_000_000, 1_000_000))
    (src / "pkg" / f"gone{SUFFIX}").write_text("no longer compiled")  # not in the group
    why, modules, loaded = run(src, TANDEM_PURE="")
    assert why == "the compiled modules are not those of one build: ['pkg.gone']"
    assert modules == ["pkg.gone", "pkg.mod"]
    assert loaded == str(src / "pkg" / "mod.py")


def test_tandem_pure_runs_them_from_source(tmp_path: Path) -> None:
    src = checkout(tmp_path)
    why, _modules, loaded = run(src, TANDEM_PURE="1")
    assert why == "TANDEM_PURE is set"
    assert loaded == str(src / "pkg" / "mod.py")


def test_current_compiled_code_is_used(tmp_path: Path) -> None:
    src = checkout(tmp_path)
    for source in (src / "pkg").glob("*.py"):
        os.utime(source, (1_000_000, 1_000_000))  # older than the build
    with pytest.raises(subprocess.CalledProcessError) as failed:
        run(src, TANDEM_PURE="")
    # The extension is what loads: here, one that fails, named by its path.
    assert str(src / "pkg" / f"mod{SUFFIX}") in failed.value.stderr


def test_this_install_runs_its_compiled_code() -> None:
    """An install with a C compiler runs the broker's hot modules compiled. CI says it
    expects that (TANDEM_EXPECT_COMPILED=1): a build that fell back to Python fails there."""
    if not os.environ.get("TANDEM_EXPECT_COMPILED"):
        if not _compiled.MODULES:
            pytest.skip("this install is pure Python (no C compiler, or TANDEM_COMPILE=0)")
        if _compiled.WHY_NOT is not None and "does not load" not in _compiled.WHY_NOT:
            pytest.skip(f"running as pure Python: {_compiled.WHY_NOT}")
    assert _compiled.WHY_NOT is None
    from tandem.broker.protocol import connection

    names = [path.removeprefix("src/").removesuffix(".py").replace("/", ".") for path in compiled()]
    assert sorted(names) == _compiled.MODULES
    assert connection.__file__ is not None and connection.__file__.endswith(SUFFIX)


def test_no_compiled_function_names_two_kinds_of_exception_alike() -> None:
    """mypyc gives a name in a function one type: `except A as exc` then `except B as exc`
    makes the second a TypeError when it happens (the replication link died of one)."""
    assert "src/tandem/broker/replication/member.py" in compiled()
    found = []
    for path in compiled():
        for fn in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                kinds: dict[str, set[str]] = {}
                for node in ast.walk(fn):
                    if isinstance(node, ast.ExceptHandler) and node.name and node.type:
                        kinds.setdefault(node.name, set()).add(ast.unparse(node.type))
                found += [f"{path}: {fn.name}: {n}" for n, k in kinds.items() if len(k) > 1]
    assert found == []
