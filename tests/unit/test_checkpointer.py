"""The checkpoint manager's commit (relax_hpc/ckpt/manager.py): `latest` always names a complete
checkpoint."""

from __future__ import annotations

from pathlib import Path

from relax_hpc.ckpt.manager import Checkpointer
from tests.unit.test_fence import _model


def test_saving_the_latest_step_again_keeps_it_in_place_and_latest_never_dangles(tmp_path, one_rank):
    """A stop right after a periodic checkpoint saves the same step again (found by the chaos
    test: `latest` pointed at nothing while the folder was rewritten)."""
    ckpt = Checkpointer(tmp_path, keep=2)
    assert ckpt.save(4, _model, {}, {"step": 4})
    folder = (tmp_path / "latest").resolve()
    inode = folder.stat().st_ino

    def watched(out: Path) -> None:
        assert (tmp_path / "latest").resolve().is_dir(), "latest dangles while the step is written"
        _model(out)

    assert ckpt.save(4, watched, {}, {"step": 4})
    assert (tmp_path / "latest").resolve() == folder and folder.stat().st_ino == inode
    assert ckpt.save(6, watched, {}, {"step": 6}) and (tmp_path / "latest").resolve().name == "step-00000006"
