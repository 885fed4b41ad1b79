"""The no-progress guard: a time limit that cannot fit a step is refused at submit (the run's own
times where RUN_DIR has history), and a job stops requeueing itself after allocations in a row
without a new checkpointed step."""

from __future__ import annotations

import json
from pathlib import Path

from relax_hpc.config.load import load_config
from relax_hpc.launch.guard import idle_allocations, stop_requeueing, time_limit_problem, timings
from relax_hpc.metrics.jsonl import JsonlWriter
from relax_hpc.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]


def slurm_config(tmp_path: Path, *overrides: str):
    return load_config(REPO / "configs" / "tiny-grpo.yaml", [f"run.dir={tmp_path / 'run'}", "launch.executor=slurm",
                                                           *overrides])  # fmt: skip


def write_lines(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def checkpoint_at(paths: RunPaths, step: int) -> None:
    """What the checkpoint manager leaves: the link ckpt/latest to a folder with trainer_state.json."""
    folder = paths.ckpt / f"step-{step:08d}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    (paths.ckpt / "latest").symlink_to(folder.name)


def test_the_issue_s_thrashing_limit_is_refused_with_estimates_said_as_such(tmp_path):
    cfg = slurm_config(tmp_path, "launch.slurm.time_min=2", "launch.slurm.signal_lead_s=60")
    problem = time_limit_problem(cfg, RunPaths(Path(cfg.run.dir)))
    assert problem is not None and problem.startswith("launch.slurm.time_min=2 (120 s) cannot fit one step")
    assert "(estimated: RUN_DIR has no steps yet)" in problem and "at least 3" in problem
    assert time_limit_problem(slurm_config(tmp_path, "launch.slurm.time_min=3", "launch.slurm.signal_lead_s=60"),
                              RunPaths(Path(cfg.run.dir))) is None  # fmt: skip


def test_a_run_with_history_is_judged_by_its_own_start_up_and_checkpoint(tmp_path):
    cfg = slurm_config(tmp_path, "launch.slurm.time_min=3", "launch.slurm.signal_lead_s=60")
    paths = RunPaths(Path(cfg.run.dir))
    # Two starts: 50 s and 70 s to their first step; steps of 2 s; a checkpoint took 15 s.
    write_lines(paths.events_metrics, [{"time": 100.0, "event": "start", "step": 0},
                                       {"time": 300.0, "event": "start", "step": 2}])  # fmt: skip
    write_lines(paths.train_metrics, [
        {"time": 150.0, "step": 1, "loss": 0.1, "time_step": 2.0, "time_checkpoint": 0.0},
        {"time": 152.0, "step": 2, "loss": 0.1, "time_step": 2.0, "time_checkpoint": 15.0},
        {"time": 370.0, "step": 3, "loss": 0.1, "time_step": 2.0, "time_checkpoint": 0.0},
    ])  # fmt: skip
    t = timings(paths)
    assert (t.start_s, t.step_s, t.checkpoint_s, t.measured) == (60.0, 2.0, 15.0, True)
    problem = time_limit_problem(cfg, paths)  # 60 + 2 + 15 + 60 + 60 = 197 s > 180 s
    assert problem is not None and "start-up 60 s + a step 2 s + a checkpoint 15 s (measured in this run" in problem
    assert "= 197 s" in problem and "at least 4" in problem


def test_requeueing_stops_after_the_configured_allocations_without_a_new_step(tmp_path):
    cfg = slurm_config(tmp_path)  # max_idle_allocations 3 by default
    paths = RunPaths(Path(cfg.run.dir))
    paths.create()
    checkpoint_at(paths, 4)
    events = JsonlWriter(paths.events_metrics)
    events.log({"event": "start", "step": 0, "slurm_job_id": "11", "slurm_restart_count": 0})
    events.log({"event": "start", "step": 4, "slurm_job_id": "11", "slurm_restart_count": 1})
    assert idle_allocations(paths, "11") == 1 and stop_requeueing(cfg, paths, "11") is None
    events.log({"event": "start", "step": 4, "slurm_job_id": "11", "slurm_restart_count": 1})  # a trainer restart
    events.log({"event": "start", "step": 4, "slurm_job_id": "11", "slurm_restart_count": 2})
    assert idle_allocations(paths, "11") == 2 and stop_requeueing(cfg, paths, "11") is None
    events.log({"event": "start", "step": 4, "slurm_job_id": "11", "slurm_restart_count": 3})
    why = stop_requeueing(cfg, paths, "11")
    assert why is not None and why.startswith("not requeued: 3 allocation(s) in a row ended without a new step")
    assert "stays at step 4" in why
    assert idle_allocations(paths, "12") == 0  # a new submission starts counting afresh
    assert stop_requeueing(slurm_config(tmp_path, "launch.slurm.max_idle_allocations=0"), paths, "11") is None


def test_preempted_allocations_do_not_count_but_time_limits_and_failures_do(tmp_path):
    """The issue's job: three preemptions during start-up failed it, advising a longer time_min."""
    cfg = slurm_config(tmp_path)  # max_idle_allocations 3 by default
    paths = RunPaths(Path(cfg.run.dir))
    paths.create()
    events = JsonlWriter(paths.events_metrics)
    for count in range(4):  # four allocations, none of which trained a step
        events.log({"event": "start", "step": 0, "slurm_job_id": "11", "slurm_restart_count": count})
        if count in (0, 1, 3):
            events.log({"event": "preempted", "slurm_job_id": "11", "slurm_restart_count": count})
    assert idle_allocations(paths, "11") == 1 and stop_requeueing(cfg, paths, "11") is None  # only allocation 2
    for count in (4, 5):  # ended by their time limit (or failed) without a step: they count
        events.log({"event": "start", "step": 0, "slurm_job_id": "11", "slurm_restart_count": count})
    why = stop_requeueing(cfg, paths, "11")
    assert why is not None and why.startswith("not requeued: 3 allocation(s) in a row ended without a new step")
    events.log({"event": "preempted", "slurm_job_id": "12", "slurm_restart_count": 5})  # another job's
    assert idle_allocations(paths, "11") == 3
