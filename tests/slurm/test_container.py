"""launch.container for real: the tiny run through the Slurm executor with every role inside a
container (charliecloud's ch-run, the runtime Debian ships; Apptainer's command line is checked
in tests/unit/test_launch_layout.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm.jobs import REPO, describe, job_id, job_state, sacct, submit, train_events


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    missing = [tool for tool in ("mmdebstrap", "ch-run") if shutil.which(tool) is None]
    if missing:
        reason = f"{', '.join(missing)} not installed (bash tools/containers/install.sh)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    prebuilt = os.environ.get("RELAX_TEST_IMAGE")
    if prebuilt:  # .ci/run builds it beside the checks: a Debian bootstrap, mostly downloads
        return _wait_for_image(Path(prebuilt))
    out = tmp_path_factory.mktemp("image") / "relax_hpc"
    build = subprocess.run(
        ["bash", "tools/containers/make_test_image.sh", str(out)],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    return out


def _wait_for_image(image: Path, timeout_s: float = 900) -> Path:
    """The image that .ci/run builds in the background: IMAGE.done or IMAGE.failed ends the wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if image.with_suffix(".done").exists():
            return image
        if image.with_suffix(".failed").exists():
            log = image.with_suffix(".log")
            pytest.fail(f"building {image} failed:\n" + (log.read_text()[-3000:] if log.exists() else ""))
        time.sleep(1)
    pytest.fail(f"{image} was not built within {timeout_s:.0f} s")


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
