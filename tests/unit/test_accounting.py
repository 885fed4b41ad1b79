"""GPU- and CPU-hours per role (metrics.accounting) and the resources a role's command line gives it
(launch.supervisor.given)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from relax_hpc.launch.supervisor import given
from relax_hpc.metrics.accounting import (
    accounting,
    cpu_measured,
    from_events,
    from_sacct_rows,
    per_hour,
    render,
    role_kind,
    tres,
    unaccounted,
)
from relax_hpc.metrics.jsonl import JsonlWriter
from relax_hpc.paths import RunPaths


def row(job: str, name: str, seconds: int, alloc: str, state: str = "COMPLETED") -> dict[str, str]:
    return {"JobID": job, "JobName": name, "ElapsedRaw": str(seconds), "AllocTRES": alloc, "State": state}


def test_alloc_tres_gives_cpus_and_gpus_of_any_gpu_type():
    assert tres("billing=4,cpu=4,gres/gpu=2,mem=0,node=1") == (4.0, 2.0)
    assert tres("cpu=8,gres/gpu:h100=4,mem=10G") == (8.0, 4.0)
    assert tres("cpu=2,mem=0,node=1") == (2.0, 0.0) and tres("") == (0.0, 0.0)


def test_role_kinds_add_up_numbered_roles():
    assert [role_kind(n) for n in ("engine-0", "engine-12", "judge-1", "trainer", "el3f2a1b")] == [
        "engine", "engine", "judge", "trainer", "el3f2a1b",
    ]  # fmt: skip


def test_sacct_steps_are_the_roles_and_job_rows_the_allocation():
    rows = [
        row("7", "relax_hpc", 3600, "billing=8,cpu=8,gres/gpu=4,node=2"),  # the allocation, first start
        row("7.batch", "batch", 3600, "cpu=4,gres/gpu=2,node=1"),  # the launcher: no role
        row("7.0", "relax_hpc:trainer", 1800, "cpu=4,gres/gpu=2,node=1"),
        row("7.1", "relax_hpc:engine-0", 3600, "cpu=2,gres/gpu=2,node=1"),
        row("7.2", "relax_hpc:engine-1", 1800, "cpu=2,gres/gpu=2,node=1"),
        row("7", "relax_hpc", 1800, "billing=8,cpu=8,gres/gpu=4,node=2"),  # after a requeue (sacct -D)
        row("7.0", "relax_hpc:trainer", 900, "cpu=4,gres/gpu=2,node=1"),
        row("9", "relax_hpc:el01", 7200, "cpu=1,gres/gpu=1,node=1"),  # an elastic engine job
        row("9.batch", "batch", 7200, "cpu=1,gres/gpu=1,node=1"),
    ]
    roles, total = from_sacct_rows(rows, elastic_jobs={"9"})
    assert roles["trainer"] == {"cpu_h": pytest.approx(3.0), "gpu_h": pytest.approx(1.5)}
    assert roles["engine"] == {"cpu_h": pytest.approx(3.0), "gpu_h": pytest.approx(3.0)}
    assert roles["elastic"] == {"cpu_h": pytest.approx(2.0), "gpu_h": pytest.approx(2.0)}
    assert set(roles) == {"trainer", "engine", "elastic"}
    assert total == {"cpu_h": pytest.approx(8 * 1.5 + 2), "gpu_h": pytest.approx(4 * 1.5 + 2)}


def test_heterogeneous_components_each_count_toward_the_allocation():
    rows = [row("5+0", "r", 3600, "cpu=4,gres/gpu=2"), row("5+1", "r", 3600, "cpu=2,gres/gpu=4"),
            row("5+1.0", "r:engine-0", 3600, "cpu=2,gres/gpu=4")]  # fmt: skip
    roles, total = from_sacct_rows(rows, elastic_jobs=set())
    assert total == {"cpu_h": 6.0, "gpu_h": 6.0} and roles == {"engine": {"cpu_h": 2.0, "gpu_h": 4.0}}


def test_events_give_seconds_times_resources_per_start():
    events: list[dict[str, Any]] = [
        {"event": "start"},
        {
            "event": "usage",
            "roles": {"trainer": {"s": 7200, "cpus": 4, "gpus": 2}, "engine-0": {"s": 3600, "cpus": 1, "gpus": 0}},
        },
        {"event": "usage", "roles": {"trainer": {"s": 3600, "cpus": 4, "gpus": 2}}},
    ]
    assert from_events(events) == {"engine": {"cpu_h": 1.0, "gpu_h": 0.0}, "trainer": {"cpu_h": 12.0, "gpu_h": 6.0}}
    assert not cpu_measured(events)
    # Measured (local processes): the CPU time they used, the launcher's own beside them; GPUs
    # are still held for the role's whole time.
    used = {"trainer": {"s": 3600, "cpu_s": 900, "cpus": 4, "gpus": 2}}
    measured = [{"event": "usage", "roles": used, "launcher_cpu_s": 36}]
    hours = {"launcher": {"cpu_h": 0.01, "gpu_h": 0.0}, "trainer": {"cpu_h": 0.25, "gpu_h": 2.0}}
    assert from_events(measured) == hours and cpu_measured(measured)


def test_samples_per_gpu_hour_or_per_cpu_hour_without_gpus():
    assert per_hour(1000, {"cpu_h": 10.0, "gpu_h": 2.0}) == {"samples": 1000, "samples_per_gpu_h": 500.0}
    assert per_hour(1000, {"cpu_h": 4.0, "gpu_h": 0.0}) == {"samples": 1000, "samples_per_cpu_h": 250.0}
    assert per_hour(0, {"cpu_h": 0.0, "gpu_h": 0.0}) == {"samples": 0, "samples_per_cpu_h": 0.0}
    facts = {"source": "events", "roles": {"trainer": {"cpu_h": 4.0, "gpu_h": 0.0}},
             "total": {"cpu_h": 4.0, "gpu_h": 0.0}, **per_hour(1000, {"cpu_h": 4.0, "gpu_h": 0.0})}  # fmt: skip
    assert render(facts)[-1].endswith("(events); 1000 samples, 250 per CPU-hour")


def test_a_roles_command_line_says_what_it_was_given():
    step = ["srun", "--overlap", "--nodes=2", "--cpus-per-task=8", "--nodelist=a,b", "python", "-m",
            "relax_hpc.launch.gpus", "0-3", "--", "python"]  # fmt: skip
    assert given(step, threads=1) == {"cpus": 16.0, "gpus": 8.0}
    local_trainer = ["python", "-m", "relax_hpc.launch.gpus", "none", "--", "python", "-m", "relax_hpc.trainer.main",
                     "--nproc-per-node", "2"]  # fmt: skip
    assert given(local_trainer, threads=3) == {"cpus": 6.0, "gpus": 0.0}


def test_a_final_sacct_answer_is_kept_and_the_events_stand_in_without_one(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_CONF", raising=False)  # no cluster: sacct, where installed, answers nothing
    paths = RunPaths(tmp_path)
    paths.slurm_job_id.parent.mkdir(parents=True)
    paths.slurm_job_id.write_text("42\n")
    JsonlWriter(paths.events_metrics).log({"event": "usage", "roles": {"trainer": {"s": 3600, "cpus": 2, "gpus": 0}}})
    assert accounting(paths)["source"] == "events" and accounting(paths)["total"] == {"cpu_h": 2.0, "gpu_h": 0.0}
    kept = {"source": "sacct", "jobs": ["42"], "roles": {}, "total": {"cpu_h": 8.0, "gpu_h": 4.0}}
    (tmp_path / "metrics" / "accounting.json").write_text(json.dumps(kept))
    assert accounting(paths) == {**kept, "samples": 0, "samples_per_gpu_h": 0.0}
    paths.slurm_job_id.write_text("43\n")  # submitted again: another job, the kept answer is not its
    assert accounting(paths)["source"] == "events"


def test_an_eval_jobs_samples_are_the_ones_it_scored(tmp_path):
    paths = RunPaths(tmp_path)
    JsonlWriter(paths.events_metrics).log({"event": "usage", "roles": {"engine-0": {"s": 3600, "cpus": 2, "gpus": 0}}})
    paths.eval_results.parent.mkdir(parents=True)
    for model in ("policy", "teacher"):
        JsonlWriter(paths.eval_results).log({"model": model, "dataset": "addition", "problems": 9, "samples": 45})
    assert accounting(paths, slurm=False) | {"roles": None} == {
        "source": "events", "jobs": [], "roles": None, "total": {"cpu_h": 2.0, "gpu_h": 0.0},
        "cpu_used": False, "unaccounted": [], "samples": 90, "samples_per_cpu_h": 45.0,
    }  # fmt: skip


def test_starts_killed_before_their_usage_record_are_named_as_not_counted():
    start = lambda restart: {"event": "start", "slurm_job_id": "7", "slurm_restart_count": restart, "time": 0.0}  # noqa: E731
    usage = {"event": "usage", "roles": {}}
    events = [start(0), usage, {"event": "end"}, start(1), start(2)]  # restart 1 killed with its allocation
    assert unaccounted(events, live=True) == ["job 7 (restart 1)"]  # restart 2 still runs
    assert unaccounted(events, live=False) == ["job 7 (restart 1)", "job 7 (restart 2)"]
    assert unaccounted([start(0), usage], live=False) == []
    none = {"cpu_h": 0.0, "gpu_h": 0.0}
    facts = {"source": "events", "roles": {}, "total": none, "unaccounted": ["job 7 (restart 1)"], **per_hour(0, none)}
    assert render(facts)[-1].startswith("usage:       not counted above: job 7 (restart 1), whose launcher was killed")
