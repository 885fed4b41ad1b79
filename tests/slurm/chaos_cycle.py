"""Which faults a CI run of the chaos schedule injects (tests/slurm/test_chaos.py): a fixed cycle
of four draws of three kinds, the draw picked by a seed derived from the commit under test (its
place in the history).

Each draw holds one restart of the whole allocation (the kinds that cost most) and two faults
inside it, so any 4 consecutive seeds cover all 11 kinds (a cycle, not chance: 12 places, one kind
twice), and so do any 4 consecutive commits. Torch-free, so that tests/conftest.py prints the
draw in pytest's header."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SEED_ENV = "RELAX_CHAOS_SEED"  # set to replay another commit's draw
WHOLE_RUN = (
    "time limit notice (USR2)", "scontrol requeue", "partition preemption", "node crash (kill -9 all, requeue)",
)  # fmt: skip
CYCLE = (
    ("SIGSTOP/SIGCONT engine", "kill -9 driver", "time limit notice (USR2)"),
    ("SIGSTOP/SIGCONT driver", "kill -9 engine", "scontrol requeue"),
    ("SIGSTOP/SIGCONT trainer", "kill -9 trainer rank", "partition preemption"),
    ("scancel elastic engine job", "SIGSTOP/SIGCONT engine", "node crash (kill -9 all, requeue)"),
)


def commit_seed() -> int:
    """$RELAX_CHAOS_SEED, else the commit's place in the history (`git rev-list --count HEAD`), so
    that consecutive commits take consecutive draws of the cycle (0 outside git)."""
    if os.environ.get(SEED_ENV):
        return int(os.environ[SEED_ENV])
    argv = ["git", "rev-list", "--count", "HEAD"]
    try:
        count = subprocess.run(argv, check=False, cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return int(count.stdout) if count.returncode == 0 and count.stdout.strip().isdigit() else 0


def ci_kinds(seed: int) -> list[str]:
    """The draw of `seed`: its place in the cycle, in an order the seed shuffles."""
    kinds = list(CYCLE[seed % len(CYCLE)])
    random.Random(seed).shuffle(kinds)
    return kinds


def header() -> str:
    seed = commit_seed()
    return f"chaos: seed {seed} (${SEED_ENV} replays one), faults {ci_kinds(seed)}"
