"""Chaos, the full schedule: one run on the test Slurm cluster takes a seeded random schedule of
faults, every kind at least once, and must stay exact (tests/slurm/chaos.py has the faults and
the checks; tests/slurm/test_chaos.py runs a short schedule in CI).

    python tools/bench/chaos.py [--seed 23] [--faults 14]
                                    # uses $SLURM_CONF, or starts tools/slurm/cluster.sh

Prints one JSON object: faults injected and survived (recovered from, the run then verified
exact), steps trained again, time lost per fault kind (median), writes refused to superseded
processes. Run it before each release (BENCHMARKS.md, "Chaos"); CI runs three kinds a commit,
all 11 over any 4 consecutive commits (tests/slurm/chaos_cycle.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from preemption import slurm_cluster  # puts the repository on sys.path too

from tests.slurm.chaos import FAULTS, run_schedule, schedule, summary, verify


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--faults", type=int, default=14)
    args = parser.parse_args()
    faults = schedule(args.seed, args.faults, sorted(FAULTS))
    work = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    started = time.monotonic()
    with slurm_cluster(work):
        chaos = run_schedule(work / "run", args.seed, faults)
        counts = verify(chaos)
    print(json.dumps({"seed": args.seed, **summary(chaos, counts, time.monotonic() - started)}, indent=1))


if __name__ == "__main__":
    main()
