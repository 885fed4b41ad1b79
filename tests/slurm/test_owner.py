"""One live job per run on the real controller: two submissions started together end with one
job, the other refused in one line naming it; `--take-over` cancels that job, waits until it
has left, then submits. The jobs are submitted held (extra_sbatch): nothing here occupies a node."""

from __future__ import annotations

import subprocess
import sys

from tests.slurm.jobs import CONFIG, REPO, TINY_SLURM, job_id, job_state, slurm, submit

NAME = "relax-owner-test"
HELD = ("launch.slurm.extra_sbatch={hold: ''}", f"launch.slurm.job_name={NAME}")


def queued() -> list[str]:
    return slurm("squeue", "-h", "--name", NAME, "-o", "%i").split()


def test_two_submissions_at_once_end_with_one_job_and_take_over_replaces_it(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "relax_hpc.submit", "--config", str(CONFIG), f"run.dir={run_dir}", *TINY_SLURM,
            *HELD]  # fmt: skip
    try:
        both = [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(2)]  # fmt: skip
        outs = [(p.wait(timeout=300), *p.communicate()) for p in both]
        (job,) = queued()
        assert job_id(run_dir) == job and sorted(code for code, _, _ in outs) == [0, 2], outs
        (refused,) = [err for code, _, err in outs if code == 2]
        assert refused == (
            f"error: run.dir {run_dir} is run by job {job} (PENDING); wait for it, `scancel {job}`, "
            "or submit with --take-over to cancel it and start this submission\n"
        )
        out = submit(run_dir, *HELD, "--take-over")
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"taking over: cancelling job {job} (PENDING) and waiting until it has left" in out.stdout
        (new,) = queued()
        assert new != job and job_id(run_dir) == new and job_state(job).startswith("CANCELLED")
    finally:
        for left in queued():
            slurm("scancel", left)
