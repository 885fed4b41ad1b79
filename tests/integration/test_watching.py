"""What a user watches a run with, on one real run of the local executor that is stopped with
Ctrl-C (SIGINT), resumed to completion, then started once more: the messages at each edge, the
trainer's step lines and time breakdown, the evaluations, TensorBoard and ClearML (offline) fed
across the restart as one run, `status`, `plot`, the pruned spool and the HF export."""

from __future__ import annotations

import json
import re
import resource
import signal
import stat
import subprocess
import sys
import time

import pytest
from PIL import Image

from relax_hpc.ckpt.layout import latest_dir
from relax_hpc.metrics.accounting import accounting
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths, SpoolDirs
from tests.integration.conftest import REPO, Job

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 8
# A stop acts within seconds, at any moment (README): 1.6 s measured alone (BENCHMARKS.md,
# "Start-up"), 11.9 s once under CI's load before forked roles' exits were made cheap; the bound
# keeps the promise's order of magnitude with room for that load.
STOP_WITHIN_S = 20
OVERRIDES = (
    f"trainer.total_steps={STEPS}", "ckpt.every_steps=2", "rollout.prompts_per_step=8", "rollout.eval_every=4",
    "metrics.tensorboard=true", "metrics.clearml.enabled=true", "metrics.clearml.offline=true",
    "metrics.progress_every_s=0.5",
)  # fmt: skip


@pytest.fixture(scope="module")
def watched(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("watched") / "run"
    before = _children_cpu_s()
    first = Job(run_dir, *OVERRIDES).start()
    first.wait_for_step(3, timeout_s=300)
    assert first.proc is not None
    first.proc.send_signal(signal.SIGINT)  # Ctrl-C: checkpoint and stop
    asked = time.monotonic()
    assert first.wait(timeout_s=120) == 75, first.text()[-3000:]
    assert time.monotonic() - asked < STOP_WITHIN_S, "Ctrl-C took too long to act"
    second = Job(run_dir, *OVERRIDES)
    assert second.run(timeout_s=400) == 0, second.text()[-3000:]
    cpu_s = _children_cpu_s() - before  # both starts' every process, as the kernel counted them
    third = Job(run_dir, *OVERRIDES)
    assert third.run(timeout_s=120) == 0, third.text()[-3000:]
    return {"run_dir": run_dir, "paths": RunPaths(run_dir), "first": first.text(), "second": second.text(),
            "third": third.text(), "cpu_s": cpu_s}  # fmt: skip


def _children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def test_each_edge_of_the_run_says_what_happened(watched):
    assert "devices: CPU only" in watched["first"] and "SIGINT" in watched["first"]
    assert "stopped at step" in watched["first"] and "run the same command to resume" in watched["first"]
    second = watched["second"]
    assert second.startswith("run dir:") and "resuming at step" in second, second[:500]  # the header first
    assert f"training complete at step {STEPS}/{STEPS}" in second and "reward " in second
    assert f"HF model:   {watched['paths'].export}" in second
    # The same command on a finished run: recognised at once, nothing started.
    assert f"already complete at step {STEPS}" in watched["third"]
    assert sorted(p.name for p in watched["paths"].logs_root.iterdir()) == ["0", "1"]
    events = read_jsonl(watched["paths"].events_metrics)
    assert [e["exit"] for e in events if e["event"] == "end"] == [75, 0]


def test_a_clean_stop_leaves_no_traceback_at_the_end_of_the_trainer_s_log(watched):
    lines = (watched["run_dir"] / "logs" / "0" / "trainer.log").read_text().splitlines()
    saved = max(i for i, line in enumerate(lines) if "checkpoint step" in line and "saved" in line)
    # The ranks left by themselves: after the stop's checkpoint only the other rank's own log
    # lines may come (its output reaches the file when it does), no traceback, no SignalException.
    assert all(re.match(r"\d{4}-\d\d-\d\d [\d:,]+ trainer\[\d+\] ", line) for line in lines[saved + 1 :]), lines[saved:]


def test_the_trainer_logs_each_step_and_where_its_time_went(watched):
    log = (watched["paths"].logs(1) / "trainer.log").read_text()
    assert f"step {STEPS}/{STEPS} | loss" in log and "fwd/bwd" in log and "overlap" in log
    steps = [r for r in read_jsonl(watched["paths"].train_metrics) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # each once, across the stop
    for r in steps:
        phases = sum(r[f"time_{p}"] for p in ("wait", "read", "fwd_bwd", "optimizer", "push", "checkpoint"))
        assert phases == pytest.approx(r["time_step"], rel=0.02, abs=0.01), r
        assert r["time_generate"] > 0 and r["time_fwd_bwd"] > 0 and r["overlap_bound"] >= 1.0
    assert any(r["time_checkpoint"] > 0 for r in steps if r["step"] % 2 == 0)


def test_evaluations_carry_the_version_evaluated_and_a_resume_adds_no_untrained_row(watched):
    versions = [r["version"] for r in read_jsonl(watched["paths"].eval_metrics)]
    # Every 4 versions, at the newest an engine holds when the driver gets to it (4 or 5 here).
    assert versions[0] == 0 and versions[-1] == STEPS and versions == sorted(set(versions)), versions
    assert len(versions) == 3


def test_tensorboard_holds_one_run_across_the_restart(watched):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(watched["paths"].tensorboard))
    accumulator.Reload()
    steps = [e.step for e in accumulator.Scalars("train/reward")]
    assert steps == list(range(1, STEPS + 1))
    evaluated = [r["version"] for r in read_jsonl(watched["paths"].eval_metrics)]
    assert [e.step for e in accumulator.Scalars("eval/greedy_accuracy")] == evaluated


def test_usage_per_role_comes_from_the_launchers_events_without_slurm(watched):
    """The local executor: each start's two usage events (what ran until the stop, written before
    it so that the metric sinks forward it, then what the stop itself took), added up per role
    kind: the CPU time (user + system) of every process of the run, within 10 % of what the
    kernel counted for both starts and never more. The stop's own record matters: without it the
    record was 5 % short alone and 12.6 % under CI's load; the old wall time x threads recorded
    3.5x the kernel's count. No GPU here. The summary says so, and TensorBoard got all but the
    last stop's record as each start's sinks stopped (the next start would forward that one)."""
    events = read_jsonl(watched["paths"].events_metrics)
    usage = [e for e in events if e["event"] == "usage"]
    starts, ends = [e for e in events if e["event"] == "start"], [e for e in events if e["event"] == "end"]
    kinds = [(e["event"], e.get("stop", False)) for e in events if e["event"] in ("start", "usage")]
    assert kinds == [("start", False), ("usage", False), ("usage", True)] * 2, kinds
    ran = [u for u in usage if not u.get("stop")]
    for used, start, end in zip(ran, starts, ends, strict=True):
        assert set(used["roles"]) == {"trainer", "driver", "engine-0", "engine-1", "metrics"}
        assert all(0 < r["s"] <= end["time"] - start["time"] and r["gpus"] == 0 for r in used["roles"].values())
        assert all(r["cpu_s"] > 0 for r in used["roles"].values()) and used["launcher_cpu_s"] > 0
    stops = [u for u in usage if u.get("stop")]
    assert all(r["cpu_s"] >= 0 and r["s"] > 0 for u in stops for r in u["roles"].values())
    assert any(r["cpu_s"] > 0 for u in stops for r in u["roles"].values())  # a stop costs something
    recorded = sum(sum(r["cpu_s"] for r in u["roles"].values()) + u["launcher_cpu_s"] for u in usage)
    assert 0.9 * watched["cpu_s"] <= recorded <= 1.01 * watched["cpu_s"], (recorded, watched["cpu_s"])
    facts = accounting(watched["paths"])
    trainer = sum(u["roles"].get("trainer", {}).get("cpu_s", 0.0) for u in usage) / 3600
    assert facts["source"] == "events" and facts["roles"]["trainer"]["cpu_h"] == pytest.approx(trainer)
    assert facts["total"]["cpu_h"] == pytest.approx(recorded / 3600)
    assert (
        set(facts["roles"]) == {"trainer", "driver", "engine", "metrics", "launcher"} and facts["samples_per_cpu_h"] > 0
    )
    assert "usage:       trainer 0.000 GPU-h" in watched["second"] and "(events);" in watched["second"]
    assert (
        "usage:       CPU-h: user + system time of every process; GPU-h: elapsed time x the GPUs held"
        in watched["second"]
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(watched["paths"].tensorboard))
    accumulator.Reload()
    points = [e.value for e in accumulator.Scalars("usage/trainer_cpu_h")]
    forwarded = trainer - usage[-1]["roles"].get("trainer", {}).get("cpu_s", 0.0) / 3600
    assert len(points) == 2 and points[0] < points[1] == pytest.approx(forwarded, rel=1e-3)


def test_clearml_keeps_one_task_across_the_restart(watched):
    state = watched["paths"].clearml
    task_id = (state / "task_id.offline").read_text().strip()
    sessions = [p for p in (state / "offline").iterdir() if p.is_dir()]
    assert [p.name for p in sessions] == [task_id]  # the restart reopened the task, not a second one
    events = [e for line in (sessions[0] / "metrics.jsonl").read_text().splitlines() for e in json.loads(line)]
    rewards = {e["iter"] for e in events if e.get("metric") == "train" and e.get("variant") == "reward"}
    assert rewards == set(range(1, STEPS + 1)) and {e["task"] for e in events} == {task_id}
    task = json.loads((sessions[0] / "task.json").read_text())
    assert "config" in json.dumps(task.get("hyperparams", {})) and "hf_model" in json.dumps(task.get("execution", {}))


def test_status_describes_the_finished_run(watched):
    out = subprocess.run(
        [sys.executable, "-m", "relax_hpc.status", str(watched["run_dir"])], capture_output=True, text=True, check=True
    ).stdout
    assert "state:       complete" in out and f"progress:    step {STEPS}/{STEPS}" in out
    assert "checkpoint:  " in out and "time/step:" in out and "starts:      2" in out
    facts = json.loads(
        subprocess.run(
            [sys.executable, "-m", "relax_hpc.status", str(watched["run_dir"]), "--json"],
            capture_output=True, text=True, check=True,
        ).stdout
    )  # fmt: skip
    assert facts["checkpoint_step"] == STEPS and facts["eval"]["version"] == STEPS


def test_plots_are_drawn(watched, tmp_path):
    subprocess.run([sys.executable, "-m", "relax_hpc.plot", str(watched["run_dir"]), "--out", str(tmp_path), "--trace"],
                   cwd=REPO, check=True, capture_output=True)  # fmt: skip
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["kl_entropy.png", "overview.png", "reward.png", "staleness.png", "time.png", "trace.json"]
    spans = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in spans} == {"driver", "trainer"} and all(e["dur"] >= 0 for e in spans)
    with Image.open(tmp_path / "overview.png") as image:
        assert image.size[0] > 1000 and image.size[1] > 600
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 50  # lines and text, not an empty canvas


def test_trained_batches_covered_by_a_checkpoint_are_pruned_and_the_model_exported(watched):
    paths = watched["paths"]
    checkpoint = latest_dir(paths.ckpt)
    assert checkpoint is not None
    checkpoint_step = json.loads((checkpoint / "trainer_state.json").read_text())["step"]
    for step_dir in (paths.spool / "claimed").iterdir():
        files = {p.suffix for p in step_dir.iterdir()}
        step = SpoolDirs.step_of(step_dir)
        assert step is not None
        assert files == ({".json"} if step < checkpoint_step else {".json", ".h5"}), step_dir
    model = paths.export / "model.safetensors"
    assert model.is_file() and stat.S_IMODE(model.stat().st_mode) & 0o044 == 0o044


def test_a_finished_run_asked_for_another_export_version_is_refused_in_one_line(watched):
    """ckpt.export_version=best on a run that finished exporting its last version: a finished run
    starts no trainer, which alone exports, so it is refused before config.yaml takes the change,
    with the command that exports the best checkpointed version."""
    paths, frozen = watched["paths"], watched["paths"].config.read_text()
    argv = Job(paths.root, *OVERRIDES, "ckpt.export_version=best").argv
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert (out.returncode, out.stdout, len(out.stderr.splitlines())) == (2, "", 1), out.stdout + out.stderr
    said = f"error: ckpt.export_version=best: {paths.root} is complete and {paths.export} holds version {STEPS} (last)"
    assert out.stderr.startswith(said) and f"tools/dcp_to_hf.py --run-dir {paths.root} --step " in out.stderr
    assert paths.config.read_text() == frozen
