"""Whether the modules setup.py compiles with mypyc run compiled, or as the Python beside them.

An extension module is imported before a source of the same name, so an edited checkout
would run the code as it was when last built. Compiled code is used only when all of it is
current and of one build: when, in a checkout (`pip install -e .`), any of the package's
sources is newer than the build, when the group's shared library does not load or does not
hold exactly the modules found compiled, or when TANDEM_PURE=1 (a profiler such as py-spy
sees Python frames only), every one of them is imported from its source instead; never some
of each, as compiled modules call each other's classes directly.
An installed wheel is not edited in place, and its files' times are those of the unpacking.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

GROUP = "tandem__mypyc"  # setup.py's group_name: the shared library of the compiled code

_PACKAGE = Path(__file__).parent


def _found() -> dict[str, Path]:
    """Each compiled module's name, and its source."""
    out: dict[str, Path] = {}
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for ext in _PACKAGE.rglob("*" + suffix):
            source = ext.with_name(ext.name[: -len(suffix)] + ".py")
            if source.exists():
                name = ".".join(source.relative_to(_PACKAGE.parent).with_suffix("").parts)
                out[name] = source
    return out


def _why_not(found: dict[str, Path]) -> str | None:
    if not found:
        return "not compiled (setup.py)"
    if os.environ.get("TANDEM_PURE", "") not in ("", "0"):
        return "TANDEM_PURE is set"
    try:
        group = importlib.import_module(GROUP)
    except ImportError as exc:
        return f"the compiled code does not load: {exc}"
    built = {a.removeprefix("init_").replace("___", ".") for a in dir(group) if a[:5] == "init_"}
    if built != found.keys():  # a module's extension left from another build, or missing
        return f"the compiled modules are not those of one build: {sorted(built ^ found.keys())}"
    # The code is in the group's library, dated when mypyc read the sources (setup.py). The
    # compiled modules also hold what they import of the others: any source counts.
    when = Path(group.__file__ or "").stat().st_mtime
    if (_PACKAGE.parent.parent / "pyproject.toml").exists():
        for source in sorted(_PACKAGE.rglob("*.py")):
            if source.stat().st_mtime > when:
                name = source.relative_to(_PACKAGE.parent).as_posix()
                return f"{name} changed since it was compiled (pip install -e . compiles again)"
    return None


class _Sources(importlib.abc.MetaPathFinder):
    """Finds the compiled modules' sources, ahead of their extensions."""

    def __init__(self, sources: dict[str, Path]) -> None:
        self.sources = sources

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        source = self.sources.get(fullname)
        return None if source is None else importlib.util.spec_from_file_location(fullname, source)


_modules = _found()
# Why the broker runs as Python, or None when it runs compiled (the broker logs it at start).
WHY_NOT = _why_not(_modules)
MODULES = sorted(_modules)
if WHY_NOT is not None and _modules:
    sys.meta_path.insert(0, _Sources(_modules))
