"""CPU time by role of everything this machine runs while a command runs (CI, a test file).

    python tools/bench/cpu_by_role.py [--every 2] -- CI=true bash .ci/run

Samples every process's CPU (user + system, psutil) every `--every` seconds while the
command runs, keeps each process's last figure (a process born while sampling counts whole, one
older than the sampler only from its start) and groups the processes by role from their
command line. The baseline is the machine's own: the cores' CPU time available over the same
wall time, so `busy` says whether the command waited or computed. Processes that live less than
one interval are missed (short Slurm clients, mostly). BENCHMARKS.md, "CI", has a CI run's figures.

Prints one JSON object: the command's exit, wall seconds, CPU minutes in all, `busy` (CPU over
cores x wall) and per role the CPU minutes, their share, the process count and CPU-s each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from collections import defaultdict

import psutil

# The first pattern that a command line matches names its role (order matters: a role's
# arguments hold RUN_DIRs under /tmp/pytest-of-..., so pytest itself comes after the roles).
ROLES = (
    ("relax_hpc.forkserver", "fork server"),
    ("relax_hpc.trainer.main", "trainer rank"), ("torch.distributed.run", "torchrun agent"),
    ("torch_engine", "built-in engine"), ("vllm", "vLLM"), ("relax_hpc.rollout.driver", "driver"),
    ("relax_hpc.inprocess", "in-process learning run"), ("relax_hpc.metrics.sinks", "metrics role"),
    ("relax_hpc.submit", "launcher (submit)"), ("relax_hpc.pipeline", "pipeline"), ("relax_hpc", "other relax_hpc"),
    ("pytest|xdist|execnet", "pytest worker"), ("slurm|munge|mariadb|mysqld", "Slurm daemons and steps"),
    ("mypy|ruff", "checks"), ("python", "other python"),
)  # fmt: skip


def role(cmdline: str) -> str:
    return next((name for pattern, name in ROLES if re.search(pattern, cmdline)), "other")


def sample(seen: dict[tuple[int, float], list], born_after: float) -> None:
    """Each live process's CPU seconds into `seen` ((pid, create time) -> [cmdline, first, last])."""
    for proc in psutil.process_iter(["pid", "create_time", "cmdline", "cpu_times"]):
        info = proc.info
        if info["cpu_times"] is None:
            continue  # ended, or not ours to read
        cpu = info["cpu_times"].user + info["cpu_times"].system
        key = (info["pid"], info["create_time"])
        if key not in seen:
            seen[key] = [" ".join(info["cmdline"] or []), 0.0 if info["create_time"] >= born_after else cpu, cpu]
        seen[key][2] = cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("command", nargs="+", help="the command, after --")
    args = parser.parse_args()
    seen: dict[tuple[int, float], list] = {}
    # On psutil's own clock (boot time + the process's start ticks), not time.time(): they differ.
    born_after, t0 = psutil.Process().create_time(), time.monotonic()
    proc = subprocess.Popen(" ".join(args.command), shell=True)
    while proc.poll() is None:
        sample(seen, born_after)
        time.sleep(args.every)
    wall = time.monotonic() - t0
    by_role: dict[str, list[float]] = defaultdict(list)
    for cmdline, first, last in seen.values():
        by_role[role(cmdline)].append(last - first)
    total = sum(sum(v) for v in by_role.values()) or 1e-9  # a command too short to sample
    roles = {
        name: {"cpu_min": round(sum(v) / 60, 2), "share": round(sum(v) / total, 3), "processes": len(v),
               "cpu_s_each": round(sum(v) / len(v), 2)}
        for name, v in sorted(by_role.items(), key=lambda kv: -sum(kv[1]))
    }  # fmt: skip
    busy = total / (wall * (os.cpu_count() or 1))
    print(json.dumps({"exit": proc.returncode, "wall_s": round(wall, 1), "cpu_min": round(total / 60, 2),
                      "busy": round(busy, 3), "roles": roles}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
