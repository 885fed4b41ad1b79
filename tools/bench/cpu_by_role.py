"""CPU time by role of everything this machine runs while a command runs (CI, a test file).

    python tools/bench/cpu_by_role.py [--every 2] -- CI=true bash .ci/run

Samples every process's CPU (utime + stime, /proc/PID/stat) every `--every` seconds while the
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

TICK = os.sysconf("SC_CLK_TCK")
# The first pattern that a command line matches names its role (order matters: a role's
# arguments hold RUN_DIRs under /tmp/pytest-of-..., so pytest itself comes after the roles).
ROLES = (
    ("relax_hpc.trainer.main", "trainer rank"), ("torch.distributed.run", "torchrun agent"),
    ("torch_engine", "built-in engine"), ("vllm", "vLLM"), ("relax_hpc.rollout.driver", "driver"),
    ("relax_hpc.inprocess", "in-process learning run"), ("relax_hpc.metrics.sinks", "metrics role"),
    ("relax_hpc.submit", "launcher (submit)"), ("relax_hpc.pipeline", "pipeline"), ("relax_hpc", "other relax_hpc"),
    ("pytest|xdist|execnet", "pytest worker"), ("slurm|munge|mariadb|mysqld", "Slurm daemons and steps"),
    ("mypy|ruff", "checks"), ("python", "other python"),
)  # fmt: skip


def role(cmdline: str) -> str:
    return next((name for pattern, name in ROLES if re.search(pattern, cmdline)), "other")


def uptime_ticks() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) * TICK


def sample(seen: dict[str, list], born_after: float) -> None:
    """Each live process's CPU seconds into `seen` (key pid:start -> [cmdline, first, last])."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu, start = (int(fields[11]) + int(fields[12])) / TICK, int(fields[19])
            key = f"{pid}:{start}"
            if key not in seen:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                seen[key] = [cmdline, 0.0 if start >= born_after else cpu, cpu]
            seen[key][2] = cpu
        except (OSError, ValueError, IndexError):
            continue  # the process ended between the listing and the read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("command", nargs="+", help="the command, after --")
    args = parser.parse_args()
    seen: dict[str, list] = {}
    born_after, t0 = uptime_ticks(), time.monotonic()
    proc = subprocess.Popen(" ".join(args.command), shell=True)
    while proc.poll() is None:
        sample(seen, born_after)
        time.sleep(args.every)
    wall = time.monotonic() - t0
    by_role: dict[str, list[float]] = defaultdict(list)
    for cmdline, first, last in seen.values():
        by_role[role(cmdline)].append(last - first)
    total = sum(sum(v) for v in by_role.values())
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
