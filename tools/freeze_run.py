"""Make a RUN_DIR with another release's code, stopped mid-run as a preempted run is, and keep it
under tests/data/ so that tests/integration/test_frozen_run.py resumes it with today's code (a run
started by that release must go on after an upgrade).

    git clone . /tmp/relax-0.20.0 && git -C /tmp/relax-0.20.0 checkout 9195a18
    ln -s "$PWD/.venv" /tmp/relax-0.20.0/.venv
    .venv/bin/python tools/freeze_run.py --checkout /tmp/relax-0.20.0 --out tests/data/run-0.20.0

The run: configs/tiny-grpo-lora.yaml with LoRA adapters of rank 2 on q_proj (a 128 KiB
checkpoint; the full model's would be 6 MiB), 6 steps, a checkpoint every 2, every trained batch
kept; it is asked to stop (RUN_DIR/control/stop) once step 3 is trained, so it checkpoints the
step it is on and exits 75, leaving a batch generated ahead in its spool (the JSON beside the
folder records the commit and the steps trained). Kept: everything but logs/ and the HF
export. In config.yaml the checkout's path reads {REPO} and the run's {RUN_DIR}, which the test
fills in (the file holds no machine's paths).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OVERRIDES = [
    "trainer.total_steps=6", "ckpt.every_steps=2", "ckpt.keep_trained_batches=true", "rollout.eval_every=0",
    "rollout.prompts_per_step=8", "trainer.lora.rank=2", "trainer.lora.target_modules=[q_proj]",
    "trainer.lora.modules_to_save=[]",
]  # fmt: skip
STOP_AFTER = 3


def trained_steps(run_dir: Path) -> int:
    train = run_dir / "metrics" / "train.jsonl"
    if not train.exists():
        return 0
    return sum(1 for line in train.read_text().splitlines() if '"loss"' in line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", type=Path, required=True, help="the release's source tree (with .venv)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    checkout = args.checkout.resolve()
    run_dir = Path(tempfile.mkdtemp(prefix="relax-frozen-")) / "run"
    argv = [sys.executable, "-m", "relax_hpc.submit", "--config", "configs/tiny-grpo-lora.yaml",
            f"run.dir={run_dir}", *OVERRIDES]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    with (run_dir.parent / "submit.log").open("w") as log:
        proc = subprocess.Popen(argv, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
        while trained_steps(run_dir) < STOP_AFTER and proc.poll() is None:
            time.sleep(0.2)
        (run_dir / "control").mkdir(exist_ok=True)
        (run_dir / "control" / "stop").write_text("frozen")
        code = proc.wait(timeout=300)
    if code != 75:
        raise SystemExit(f"the run exited {code}, not 75 (stopped, resumable): {run_dir.parent / 'submit.log'}")
    shutil.rmtree(args.out, ignore_errors=True)
    shutil.copytree(run_dir, args.out, symlinks=True, ignore=shutil.ignore_patterns("logs", "hf", "control"))
    config = args.out / "config.yaml"
    config.write_text(config.read_text().replace(str(run_dir), "{RUN_DIR}").replace(str(checkout), "{REPO}"))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True, check=True)
    made = {"commit": commit.stdout.strip(), "overrides": OVERRIDES, "steps": trained_steps(args.out)}
    (args.out.parent / f"{args.out.name}.json").write_text(json.dumps(made, indent=1) + "\n")
    print(json.dumps({**made, "out": str(args.out)}))


if __name__ == "__main__":
    main()
