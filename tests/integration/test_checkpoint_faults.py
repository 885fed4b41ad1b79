"""Faults of a full disk on a real filesystem: mid-save it keeps the previous checkpoint; mid-run it
stops the run in one line, and the same command resumes it."""

import errno
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from relax_hpc.ckpt.layout import latest_dir, read_trainer_state
from relax_hpc.ckpt.manager import Checkpointer
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths
from tests.integration.conftest import REPO

pytestmark = pytest.mark.integration


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: real ENOSPC, not a mocked one (the tests run as root, as CI does)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def _writer(state: dict):
    return lambda folder: dcp.save(state, checkpoint_id=str(folder))


def test_full_disk_keeps_the_previous_checkpoint(small_disk, one_rank):
    ckpt = Checkpointer(small_disk, keep=2)
    small = {"w": torch.arange(1000, dtype=torch.float32)}
    assert ckpt.save(1, _writer(small), {"rng": torch.get_rng_state()}, {"step": 1, "version": 1})
    huge = {"w": torch.zeros(1_000_000)}  # 4 MB > the disk
    assert not ckpt.save(2, _writer(huge), {"rng": torch.get_rng_state()}, {"step": 2, "version": 2})
    latest = latest_dir(small_disk)
    assert latest is not None and latest.name == "step-00000001"
    assert read_trainer_state(small_disk) == {"step": 1, "version": 1}
    assert sorted(os.listdir(small_disk)) == ["latest", "step-00000001"]  # the partial one is gone
    loaded = {"w": torch.zeros(1000)}
    resumed = ckpt.load(lambda folder: dcp.load(loaded, checkpoint_id=str(folder)))
    assert resumed is not None
    _, state = resumed
    assert torch.equal(loaded["w"], small["w"]) and state["step"] == 1
    # Space is free again: the next save succeeds and older ones are pruned to `keep`.
    for step in (3, 4):
        assert ckpt.save(step, _writer(small), {}, {"step": step, "version": step})
    assert sorted(os.listdir(small_disk)) == ["latest", "step-00000003", "step-00000004"]


def test_a_run_whose_disk_fills_stops_in_one_line_and_the_same_command_resumes_it(small_disk):
    """The run folder on a 1 MiB tmpfs: the spool refuses a batch the disk cannot hold (HDF5
    crashed the driver, SIGSEGV, when its write failed), and the launcher stops the run with one
    line naming the file and exit 75 instead of restarting roles that would fail the same way.
    No role died of a signal; once the disk has room, the same command finishes the run."""
    subprocess.run(["mount", "-o", "remount,size=1m", str(small_disk)], check=True)
    paths = RunPaths(small_disk / "run")
    argv = [sys.executable, "-m", "relax_hpc.submit", f"run.dir={paths.root}", "trainer.total_steps=6"]
    full = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    said = [line for line in (full.stdout + full.stderr).splitlines() if os.strerror(errno.ENOSPC) in line]
    assert full.returncode == 75 and len(said) == 1, full.stdout[-3000:] + full.stderr[-3000:]
    assert f"'{paths.spool}/ready/" in said[0] and said[0].endswith(f"of {paths.root} and run the same command")
    assert "Traceback" not in full.stdout + full.stderr
    exits = [e["exit"] for e in read_jsonl(paths.events_metrics) if e["event"] in ("role_exit", "end")]
    assert exits[-1] == 75 and all(code >= 0 for code in exits), exits
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0 and "training complete at step 6/6" in again.stdout, again.stdout[-3000:]
