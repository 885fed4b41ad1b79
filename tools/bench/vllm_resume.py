"""Does a resumed run on vLLM engines reproduce the uninterrupted one? (issue 25)

    python tools/bench/vllm_resume.py [--steps 8 --stop-at 4 --engines 1]

The embedded default, shortened and on-policy (rollout.max_staleness=0: each batch is sampled by
the weights of the step before, so a resumed run can match an uninterrupted one), on vLLM engines
(.venv-vllm): once to the end, then once stopped at a step boundary with a checkpoint
(control/stop, as on Ctrl-C or a time limit) and started again to the end. Every step's loss and
reward and every trained sample's tokens are compared, as tests/runs.py's assert_reproduces does
for the built-in engine. vLLM samples each request with its own seed (the driver's), but its CPU
kernels may round differently with another batch composition, so equality is measured, not
assumed. Prints one JSON object: the first step whose loss or reward differs (null: none), per
step whether each is equal, whether the trained samples are equal (and the first claimed folder
where they are not), and the wall time of each run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.runs import final_records, trained_samples

REPO = Path(__file__).resolve().parents[2]


def command(run_dir: Path, steps: int, engines: int) -> list[str]:
    data = run_dir.parent / "addition-9.jsonl"
    if not data.exists():
        rows = (REPO / "assets" / "addition.jsonl").read_text().splitlines()
        data.write_text("\n".join(rows[::12]) + "\n")
    return [
        sys.executable, "-m", "relax_hpc.submit", "--config", str(REPO / "configs" / "tiny-grpo.yaml"),
        f"run.dir={run_dir}", "rollout.engine=vllm", "rollout.vllm.max_model_len=64",
        f"rollout.num_engines={engines}", "rollout.max_staleness=0", f"data.path={data}",
        "rollout.prompts_per_step=9", f"trainer.total_steps={steps}", "ckpt.every_steps=2",
        "rollout.eval_every=0", "ckpt.keep_trained_batches=true",
    ]  # fmt: skip


def last_step(run_dir: Path) -> int:
    records = final_records(run_dir) if (run_dir / "metrics" / "train.jsonl").exists() else {}
    return max(records, default=0)


def run(argv: list[str], log: Path, stop_at: int | None = None, run_dir: Path | None = None) -> tuple[int, float]:
    """The command to its end, or stopped (control/stop) once step `stop_at` is trained."""
    start = time.monotonic()
    with log.open("a") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        while stop_at is not None and run_dir is not None and proc.poll() is None:
            if last_step(run_dir) >= stop_at:
                (run_dir / "control" / "stop").write_text("stop")
                break
            time.sleep(0.1)
        code = proc.wait(timeout=1200)
    return code, time.monotonic() - start


def compare(reference: Path, resumed: Path, steps: int) -> dict:
    """Per step: loss and reward equal; the trained samples (tokens and rewards, by the spool's
    claimed folders) equal as a whole and where they first differ."""
    ref, got = final_records(reference), final_records(resumed)
    per_step = {
        step: {key: ref.get(step, [{}])[-1].get(key) == got.get(step, [{}])[-1].get(key) is not None
               for key in ("loss", "reward")}
        for step in range(1, steps + 1)
    }  # fmt: skip
    differ = [step for step, same in per_step.items() if not all(same.values())]
    ref_samples, got_samples = trained_samples(reference), trained_samples(resumed)
    claimed = sorted(set(ref_samples) | set(got_samples))
    samples_differ = [c for c in claimed if ref_samples.get(c) != got_samples.get(c)]
    return {
        "first_difference": differ[0] if differ else None,
        "per_step": per_step,
        "samples_equal": not samples_differ and len(claimed) == steps,
        "first_claimed_folder_differing": samples_differ[0] if samples_differ else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stop-at", type=int, default=4, help="the step after which the second run is stopped")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="where the runs go (default: a new temporary folder)")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="vllm-resume-"))
    root.mkdir(parents=True, exist_ok=True)
    reference, resumed = root / "reference", root / "resumed"
    code, reference_s = run(command(reference, args.steps, args.engines), root / "reference.log")
    assert code == 0, f"the reference run failed ({code}): {root / 'reference.log'}"
    argv = command(resumed, args.steps, args.engines)
    stopped, first_s = run(argv, root / "resumed.log", args.stop_at, resumed)
    assert stopped == 75, f"the stopped run ended with {stopped}, not 75 (resumable): {root / 'resumed.log'}"
    stopped_at = last_step(resumed)
    code, second_s = run(argv, root / "resumed.log")
    assert code == 0, f"the resumed run failed ({code}): {root / 'resumed.log'}"
    result = {
        "steps": args.steps,
        "engines": args.engines,
        "stopped_at": stopped_at,
        **compare(reference, resumed, args.steps),
        "reference_s": round(reference_s, 1),
        "stopped_s": round(first_s, 1),
        "resumed_s": round(second_s, 1),
        "dir": str(root),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
