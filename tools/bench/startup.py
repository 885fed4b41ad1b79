"""Start-up of the embedded default: command -> first trained step, per role, wall and CPU seconds.

    python tools/bench/startup.py [--runs 3] [--config configs/tiny-grpo.yaml] [--repo DIR] [key=value ...]

Each run starts `python -m relax_hpc.submit --config CONFIG` in a fresh RUN_DIR, waits for the
trainer's first step record, adds up the CPU seconds of every process of the job at that moment
(the launcher, the trainer's ranks and their parent: torchrun, or the trainer that forked them;
the engines, the driver: user + system, with their reaped children), then kills the job. Each
role's own record (RUN_DIR/metrics/startup.jsonl, relax_hpc.metrics.startup) says where its part
went: import (interpreter start and the role's imports), its initialisation phases (model,
process_group, registered, weight_sync, ...) and its first piece of work. The baseline, a bare
`python -c 'import torch, transformers'`, runs before each run of the job: on a shared machine
its figures tell how loaded the machine was. `--repo` runs the job from another checkout, with
its own code (the main branch, for a before/after pair; a release without the start-up records
gives the totals alone).

Prints one JSON object: per run the baseline, `first_step_wall_s` (command to the first step's
record), `cpu_s` (summed over all processes), each process's CPU, and each role's phases; then
the medians over the runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from relax_hpc.metrics.jsonl import read_jsonl

REPO = Path(__file__).resolve().parents[2]
BASELINE = "import torch, transformers"


def timed_child(argv: list[str]) -> dict[str, float]:
    """Wall and CPU seconds (user + system, from the kernel's accounting) of one child process."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{argv} failed with {proc.returncode}")
    return {"wall_s": round(time.monotonic() - started, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)}


def tree_cpu(root: psutil.Process) -> dict[str, float]:
    """CPU seconds of every live process under (and with) `root`, by name; each one's reaped
    children are in its own count, so nothing is counted twice."""
    out: dict[str, float] = {}
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = process.cpu_times()
            name = role_name(process.cmdline(), process.pid)
            out[name] = round(t.user + t.system + t.children_user + t.children_system, 3)
    return out


def role_name(argv: list[str], pid: int) -> str:
    """A readable name for a process of the job, from its command line (a forked role's is one
    string, its title: relax_hpc.forkserver)."""
    argv = " ".join(argv).split()
    if "relax_hpc.forkserver" in argv:
        return "forkserver"
    if "relax_hpc.submit" in argv:
        return "launcher"
    if "torch.distributed.run" in argv:
        return "torchrun"
    for flag in ("--engine-id",):
        if flag in argv:
            return argv[argv.index(flag) + 1]
    for module, name in (("relax_hpc.trainer.main", "trainer"), ("relax_hpc.rollout.driver", "driver")):
        if module in argv:
            return f"{name}-{pid}"
    return f"{Path(argv[0]).name if argv else '?'}-{pid}"


def first_step(train_jsonl: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError):
        for line in train_jsonl.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("step") == 1 and "loss" in record:
                    return dict(record)
    return None


def kill_tree(root: psutil.Process) -> None:
    """SIGKILL to the job's every process (the roles run in sessions of their own)."""
    below = root.children(recursive=True)
    for process in [root, *below]:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs([root, *below], timeout=10)


def one_run(repo: Path, config: str, overrides: list[str], timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        argv = [sys.executable, "-m", "relax_hpc.submit", "--config", config, f"run.dir={run_dir}", *overrides]
        started = time.time()
        proc = subprocess.Popen(argv, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        root = psutil.Process(proc.pid)
        try:
            deadline = time.monotonic() + timeout_s
            while (record := first_step(run_dir / "metrics" / "train.jsonl")) is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    logs = sorted((run_dir / "logs").glob("*/*.log"))
                    raise SystemExit(f"no first step (exit {proc.returncode}); logs: {[str(p) for p in logs]}")
                time.sleep(0.02)
            cpu = tree_cpu(root)
        finally:
            kill_tree(root)
            proc.wait()
        roles = read_jsonl(run_dir / "metrics" / "startup.jsonl")  # none from a release before the records
    return {
        "first_step_wall_s": round(record["time"] - started, 3),
        "cpu_s": round(sum(cpu.values()), 3),
        "processes_cpu_s": cpu,
        "roles": {r["role"]: role_summary(r, started) for r in sorted(roles, key=lambda r: r["role"])},
    }


def role_summary(record: dict[str, Any], command_started: float) -> dict[str, Any]:
    """A role's start (seconds after the command), its wall and CPU seconds to its first piece of
    work, and each phase's."""
    start = round(record["started"] - command_started, 3)
    return {"start_s": start, "wall_s": record["wall"], "cpu_s": record["cpu"], "phases": record["phases"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--config", default="configs/tiny-grpo.yaml")
    parser.add_argument("--timeout-s", type=float, default=180.0)
    parser.add_argument(
        "--repo", type=Path, default=REPO, help="the checkout whose code runs the job (another: before/after)"
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        baseline = timed_child([sys.executable, "-c", BASELINE])
        runs.append({"baseline": baseline, **one_run(args.repo, args.config, args.overrides, args.timeout_s)})
    median = lambda key, sub=None: round(statistics.median(r[key][sub] if sub else r[key] for r in runs), 3)  # noqa: E731
    print(
        json.dumps(
            {
                "command": f"python -m relax_hpc.submit --config {args.config} {' '.join(args.overrides)}".strip(),
                "repo": str(args.repo.resolve()),
                "machine": {"cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 2)},
                "runs": runs,
                "median": {
                    "first_step_wall_s": median("first_step_wall_s"),
                    "cpu_s": median("cpu_s"),
                    "baseline_wall_s": median("baseline", "wall_s"),
                    "baseline_cpu_s": median("baseline", "cpu_s"),
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
