"""The protocol fuzz at scale: 1,000,000 mutated-frame examples against the state machine.

    python bench/fuzz.py [--examples 1000000]

Runs tests/unit/test_fuzz.py with that many examples (CI runs 10,000) and prints hypothesis'
statistics: how many examples it tried, how long they took, and how the runs ended.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--examples", type=int, default=1_000_000)
    args = ap.parse_args()
    env = dict(os.environ, TANDEM_FUZZ_EXAMPLES=str(args.examples))
    print(f"fuzzing the connection state machine with {args.examples:,} examples", flush=True)
    return subprocess.call(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--timeout",
            "0",
            "--hypothesis-show-statistics",
            "tests/unit/test_fuzz.py",
        ],
        cwd=ROOT,
        env=env,
    )


if __name__ == "__main__":
    raise SystemExit(main())
