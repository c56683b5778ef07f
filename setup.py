"""The broker's hot modules compiled with mypyc (docs/performance.md, "Compiled").

Everything else about the package is in pyproject.toml. mypyc turns these type-checked
modules into C extensions, the way mypy and black ship: the code stays Python, and the same
modules run as they are where nothing is compiled. The broker then spends about 40% less CPU
per message. Without a C compiler, or with TANDEM_COMPILE=0, the install is pure Python and
works the same, only slower. Compiled code whose source changed since it was built is not
used (`tandem._compiled`).
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# What the broker does per message: framing, routing, queues, the log and its records,
# replication.
COMPILED = [
    "src/tandem/broker/server.py",
    "src/tandem/broker/protocol/connection.py",
    "src/tandem/broker/protocol/channel.py",
    "src/tandem/broker/protocol/basic.py",
    "src/tandem/broker/protocol/confirm.py",
    "src/tandem/broker/protocol/frames.py",
    "src/tandem/broker/model/vhost.py",
    "src/tandem/broker/model/exchange.py",
    "src/tandem/broker/model/queue.py",
    "src/tandem/broker/model/message.py",
    "src/tandem/broker/model/journal.py",
    "src/tandem/broker/model/records.py",
    "src/tandem/broker/model/apply.py",
    "src/tandem/broker/model/shards.py",
    "src/tandem/broker/store/log.py",
    "src/tandem/broker/replication/core.py",
    "src/tandem/broker/replication/link.py",
    "src/tandem/broker/replication/log.py",
    "src/tandem/broker/replication/member.py",
    "src/tandem/broker/replication/wire.py",
]


# The commands that build: pip reads setup.py for the metadata too (egg_info, dist_info).
_BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "install", "develop"}
# Those that build into the tree, where an earlier build's modules may be current.
_IN_PLACE = {"editable_wheel", "develop", "--inplace"}


@functools.cache
def _extensions() -> list[object]:
    if os.environ.get("TANDEM_COMPILE", "1") == "0" or not _BUILDS & set(sys.argv):
        return []
    if _IN_PLACE & set(sys.argv) and not {"--force", "-f"} & set(sys.argv) and _compiled_already():
        print("tandem: the compiled modules are of the sources as they are; not compiling")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("tandem: mypyc is not installed; installing pure Python", file=sys.stderr)
        return []
    # The build environment has none of the runtime dependencies: their types are unknown
    # (Any) here, and the strict checks (CI's mypy) are not repeated.
    options = ["--config-file=", "--ignore-missing-imports"]
    try:
        extensions = mypycify(
            COMPILED + options,
            opt_level="3",
            debug_level="0",
            group_name="tandem",
            multi_file=True,  # C files of a module each, not one of them all
        )
    except (Exception, SystemExit) as exc:  # mypy exits on a type error
        print(f"tandem: mypyc failed ({exc!r}); installing pure Python", file=sys.stderr)
        return []
    for ext in extensions:
        ext.optional = True  # a compile that fails (no compiler) leaves the install pure Python
    return extensions


class _BuildExt(build_ext):
    """Runs mypyc when the extensions are built, not whenever setup.py is read: it type-checks
    the package first (half a minute), and pip reads setup.py twice more for the metadata."""

    def finalize_options(self) -> None:
        self.started = time.time()  # before mypyc reads the sources
        self.distribution.ext_modules = _extensions()
        super().finalize_options()
        self.parallel = self.parallel or True  # the modules' own small extensions

    def build_extensions(self) -> None:
        self.compiler.compile = _each_on_its_own(self.compiler.compile)
        super().build_extensions()

    def run(self) -> None:
        # A wheel built in this tree packs all of build/lib: no extension of an earlier build
        # goes in beside this one's sources.
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        for old in Path(self.build_lib).rglob("*" + suffix):
            old.unlink()
        super().run()
        # The compiled code is of the sources as they were when mypyc read them: a source
        # saved during the build is newer than it (tandem._compiled).
        for where in (Path(self.build_lib), Path("src")):
            for lib in where.glob("tandem__mypyc*"):
                if lib.stat().st_mtime >= self.started:
                    os.utime(lib, (self.started, self.started))


def _compiled_already() -> bool:
    """An editable install run again (the README's first command is `pip install -e` then
    `tandem cluster up`) finds the tree's compiled modules current: each one's extension and
    the group's library are there, and no source, nor setup.py or pyproject.toml, is newer
    than the library, which is dated when mypyc read the sources (`run`). Any edit compiles
    them all again, as `tandem._compiled` would otherwise not use them."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    group = Path("src", "tandem__mypyc" + suffix)
    if not group.exists() or not all(Path(m).with_suffix(suffix).exists() for m in COMPILED):
        return False
    built = group.stat().st_mtime
    inputs = [Path("setup.py"), Path("pyproject.toml"), *Path("src", "tandem").rglob("*.py")]
    return all(path.stat().st_mtime <= built for path in inputs)


def _each_on_its_own(compile_c: Callable[..., list[str]]) -> Callable[..., list[str]]:
    """The compiler's `compile`, running a C compiler per source file at once, one per core:
    the group's library is a file per module, and one after another they took two thirds
    of the install."""

    def compile_all(sources: list[str], *args: Any, **kwargs: Any) -> list[str]:
        if len(sources) < 2:
            return compile_c(sources, *args, **kwargs)
        with ThreadPoolExecutor(_cores()) as pool:
            parts = pool.map(lambda source: compile_c([source], *args, **kwargs), sources)
            return [obj for part in parts for obj in part]

    return compile_all


def _cores() -> int:
    """The cores this build may use (a container's CPU set, not the host's), at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return min(cores, 8)


# A stand-in that tells setuptools there are extensions to build (and the wheel is
# platform-specific); _BuildExt replaces it with mypyc's.
setup(ext_modules=[Extension("tandem__mypyc", [])], cmdclass={"build_ext": _BuildExt})
