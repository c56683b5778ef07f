"""The differential test from the command line:

    python -m tests.differential --seed N --count M [--cluster [--kill-every K]]

runs M sequences of the client surface (seeded), each followed by kill -9 and a restart of
the broker, and compares the state before and after. With --cluster, through the front port
of a 3-member local cluster: after each sequence every backup must equal the primary at the
same position, and after every K-th the primary is killed and the new one must equal it. A
failure prints the shortest sequence that shows it (hypothesis shrinks it)."""

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
    ap.add_argument("--cluster", action="store_true")
    ap.add_argument("--kill-every", type=int, default=10)
    args = ap.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tandem-differential-") as root:
        figures = harness.run(
            Path(root), args.count, args.seed, cluster=args.cluster, kill_every=args.kill_every
        )
    took = time.monotonic() - start
    print(f"differential: {figures} in {took:.0f} s (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
