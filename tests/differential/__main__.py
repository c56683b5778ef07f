"""The differential test from the command line:

    python -m tests.differential --seed N --count M

runs M sequences of the client surface (seeded), each followed by kill -9 and a restart of
the broker, and compares the state before and after. A failure prints the shortest sequence
that shows it (hypothesis shrinks it)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tests.differential import harness


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=100)
    args = ap.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tandem-differential-") as root:
        figures = harness.run(Path(root), args.count, args.seed)
    took = time.monotonic() - start
    print(f"differential: {figures} in {took:.0f} s (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
