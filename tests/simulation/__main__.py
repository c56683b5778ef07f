"""Replay one schedule of the simulation: `python -m tests.simulation --seed N [--trace]`."""

from __future__ import annotations

import argparse
import sys

from tests.simulation.world import Violation, World


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--isr-min", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--trace", action="store_true", help="print every step")
    ap.add_argument(
        "--messages", action="store_true", help="logs as the broker's: catch-up by difference"
    )
    ap.add_argument("--scale", action="store_true", help="scale-downs and -ups among the faults")
    args = ap.parse_args()
    world = World(
        args.seed, args.nodes, args.isr_min, args.steps, messages=args.messages, scale=args.scale
    )
    try:
        world.run()
    except Violation as exc:
        print("\n".join(world.trace[-200:] if not args.trace else world.trace))
        print(f"seed {args.seed}: {exc}")
        return 1
    if args.trace:
        print("\n".join(world.trace))
    print(f"seed {args.seed}: ok, epoch {world.record.epoch}, {len(world.confirmed)} confirmed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
