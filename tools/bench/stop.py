"""How long a Ctrl-C stop of the embedded default takes: roles forked by the fork server against
fresh interpreters (launch.fork_roles), alternately, in the same run.

    python tools/bench/stop.py [--runs 3] [--at-step 3] [key=value ...]

Each run starts `python -m relax_hpc.submit --config configs/tiny-grpo.yaml` in a fresh RUN_DIR
(with the metric sinks on, as tests/integration/test_watching.py runs it), waits for the trainer's
record of step `--at-step`, sends SIGINT to the launcher (what Ctrl-C does) and times it until
the launcher exits (75: stopped with a checkpoint). Prints one JSON object: every run's figures,
then the median stop per setting.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relax_hpc.metrics.jsonl import read_jsonl

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "trainer.total_steps=50", "ckpt.every_steps=2", "rollout.prompts_per_step=8", "rollout.eval_every=4",
    "metrics.tensorboard=true", "metrics.clearml.enabled=true", "metrics.clearml.offline=true",
]  # fmt: skip


def one_stop(run_dir: Path, fork: bool, at_step: int, extra: list[str]) -> dict[str, float | int | bool]:
    argv = [
        sys.executable, "-m", "relax_hpc.submit", "--config", "configs/tiny-grpo.yaml", f"run.dir={run_dir}",
        *OVERRIDES, f"launch.fork_roles={str(fork).lower()}", *extra,
    ]  # fmt: skip
    started = time.monotonic()
    with (run_dir.parent / f"{run_dir.name}.out").open("w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        train = run_dir / "metrics" / "train.jsonl"
        while not any(r.get("step", 0) >= at_step and "loss" in r for r in read_jsonl(train)):
            if proc.poll() is not None:
                raise SystemExit(f"the run ended before step {at_step}: see {out.name}")
            time.sleep(0.1)
        asked = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=300)
    return {
        "fork_roles": fork, "exit": code, "stop_s": round(time.monotonic() - asked, 2),
        "step_at_s": round(asked - started, 2),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--at-step", type=int, default=3)
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="relax-stop-") as tmp:
        runs = [
            one_stop(Path(tmp) / f"run-{i}-{fork}", fork, args.at_step, extra)
            for i in range(args.runs)
            for fork in (True, False)  # alternately: the machine's load drifts
        ]
    median = {
        ("forked" if fork else "fresh"): statistics.median(r["stop_s"] for r in runs if r["fork_roles"] is fork)
        for fork in (True, False)
    }
    print(json.dumps({"runs": runs, "median_stop_s": median}, indent=1))


if __name__ == "__main__":
    main()
