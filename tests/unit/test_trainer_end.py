"""The trainer ends only once an engine holds the last version: the driver's final evaluation
needs it, and the last step's push may have found none (a restarted engine still starting, as in
a resumed vLLM run whose second start trained only batches already sampled: the launcher then
waited out its 120 s for an evaluation that could not come). A real Trainer of one rank (gloo),
no engine running."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from relax_hpc.config.load import load_config
from relax_hpc.paths import RunPaths
from relax_hpc.submit import freeze
from relax_hpc.trainer import loop
from relax_hpc.trainer.loop import Do, Trainer

REPO = Path(__file__).resolve().parents[2]


def test_every_step_trained_the_trainer_pushes_until_an_engine_holds_the_last_version(tmp_path, one_rank, monkeypatch):
    cfg = load_config(REPO / "configs" / "tiny-grpo.yaml", [f"run.dir={tmp_path / 'run'}", "trainer.total_steps=2"],
                      base_dir=REPO)  # fmt: skip
    paths = RunPaths(tmp_path / "run")
    freeze(cfg, paths)
    trainer = Trainer(cfg, paths, torch.device("cpu"))
    trainer.state.step = trainer.state.version = 2  # the last step trained; its push reached no engine
    assert trainer.decide().do is Do.SYNC  # push it again
    trainer.last_engine_check = time.monotonic()
    assert trainer.decide().do is Do.WAIT  # between pushes: neither END nor a step past the last
    trainer.delivered = 2  # an engine took it
    assert trainer.decide().do is Do.END
    trainer.delivered, trainer.final_push_since = 1, time.monotonic() - 1.0
    monkeypatch.setattr(loop, "FINAL_PUSH_S", 0.5)  # none took it in time: the run ends anyway
    assert trainer.decide().do is Do.END
