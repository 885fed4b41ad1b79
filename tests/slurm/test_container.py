"""launch.container for real: the tiny run through the Slurm executor with every role inside a
container (charliecloud's ch-run, the runtime Debian ships; Apptainer's command line is checked
in tests/unit/test_launch_layout.py). The image: tests/slurm/conftest.py; vLLM engines run in it
too (tests/slurm/test_vllm.py)."""

from __future__ import annotations

import pytest

from tests.slurm.jobs import describe, job_id, job_state, sacct, submit, train_events


@pytest.mark.slow
def test_every_role_runs_inside_the_container(slurm_cluster, image, tmp_path):
    run_dir = tmp_path / "run"
    out = submit(
        run_dir, "trainer.total_steps=3", f"launch.container={image}",
        "launch.container_runtime=charliecloud", "--wait",
    )  # fmt: skip
    job = job_id(run_dir)
    assert out.returncode == 0, out.stdout + out.stderr + describe(run_dir, job)
    assert job_state(job) == "COMPLETED"
    assert {"relax_hpc:trainer", "relax_hpc:engine-0", "relax_hpc:driver"} <= {r["JobName"] for r in sacct(job)}
    assert train_events(run_dir, "end")[-1]["completed"] is True
    # The roles ran the image's interpreter (Debian's), not the host's venv.
    engine_log = (run_dir / "logs" / "0" / "engine-0.log").read_text()
    assert "(python /usr/bin/python" in engine_log and ".venv" not in engine_log, engine_log[-2000:]
