"""The checkpoint manager's commit (relax_hpc/ckpt/manager.py): `latest` always names a complete
checkpoint; with ckpt.export_version=best, which version is the best and which ones pruning keeps
(relax_hpc/ckpt/best.py)."""

from __future__ import annotations

from pathlib import Path

from relax_hpc.ckpt.best import best_version, choose_export, complete_steps, is_eval_version, prunable
from relax_hpc.ckpt.manager import Checkpointer
from relax_hpc.metrics.jsonl import JsonlWriter
from relax_hpc.metrics.summary import best_checkpoint
from relax_hpc.paths import RunPaths
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


def _evals(paths: RunPaths, scored: dict[int, float]) -> None:
    writer = JsonlWriter(paths.eval_metrics)
    for version, accuracy in scored.items():
        writer.log({"version": version, "greedy_accuracy": accuracy, "problems": 8})


def test_the_best_is_the_highest_checkpointed_version_and_a_tie_goes_to_the_later_one():
    scored = {0: 0.99, 2: 0.5, 4: 0.9, 6: 0.9, 8: 0.7, 10: 0.95}
    assert best_version(scored, [2, 4, 6, 8]) == 6  # 0 (the base model) and 10 have no checkpoint
    assert best_version(scored, [2, 4, 8]) == 4
    assert best_version(scored, [3, 5]) is None  # none evaluated
    assert [v for v in range(12) if is_eval_version(v, total=10, every=4)] == [4, 8, 10]


def test_pruning_keeps_the_newest_and_the_best():
    assert prunable([2, 4, 6, 8, 10], keep=2, best=4) == [2, 6]
    assert prunable([2, 4, 6, 8, 10], keep=2, best=10) == [2, 4, 6]
    assert prunable([2, 4, 6], keep=2, best=None) == [2]


def test_a_crash_between_save_and_prune_and_a_resume_keep_the_best(tmp_path, one_rank):
    """The checkpoints a killed trainer left unpruned are pruned by the next save of a new
    Checkpointer (the resumed trainer's), which protects the best by the evaluations on disk."""
    paths = RunPaths(tmp_path / "run")
    paths.create()
    _evals(paths, {2: 0.6, 4: 0.8, 6: 0.8, 8: 0.7})
    unpruned = Checkpointer(paths.ckpt, keep=100)  # saves, never prunes: as if killed before each prune
    for step in (2, 4, 6, 8):
        assert unpruned.save(step, _model, {}, {"step": step})
    resumed = Checkpointer(paths.ckpt, keep=2, protect=lambda: best_checkpoint(paths, "greedy_accuracy"))
    assert resumed.save(10, _model, {}, {"step": 10})
    assert complete_steps(paths.ckpt) == [6, 8, 10]  # 6: the best (tied with 4, later)
    _evals(paths, {10: 0.9})
    assert resumed.save(12, _model, {}, {"step": 12}) and complete_steps(paths.ckpt) == [10, 12]


def test_the_export_choice_says_which_version_and_why(tmp_path, one_rank):
    ckpt = Checkpointer(tmp_path, keep=10)
    for step in (2, 4):
        assert ckpt.save(step, _model, {}, {"step": step})
    best = choose_export({2: 0.97, 4: 0.87}, tmp_path, "best", "greedy_accuracy", last=4)
    assert (best.version, best.value, best.last_value) == (2, 0.97, 0.87)
    assert best.why == "best greedy_accuracy 0.9700 at version 2, against 0.8700 at the last, 4"
    unevaluated_last = choose_export({2: 0.97}, tmp_path, "best", "greedy_accuracy", last=4)
    assert unevaluated_last.why.endswith("against the last, 4, not evaluated")
    assert choose_export({2: 0.97, 4: 0.97}, tmp_path, "best", "greedy_accuracy", last=4).version == 4
    assert choose_export({2: 0.97, 4: 0.87}, tmp_path, "last", "greedy_accuracy", last=4).version == 4
