"""Checkpoint faults on a real filesystem: a full disk mid-save keeps the previous checkpoint."""

import os
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp

from relax_hpc.ckpt.layout import latest_dir, read_trainer_state
from relax_hpc.ckpt.manager import Checkpointer

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
