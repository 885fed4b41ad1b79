"""Engine kinds are declared once (relax_hpc.config.engines): a fourth kind, added to the table
alone, is accepted or refused by submit's checks as its entry says, started by the launcher with
its own module, and given the weight channel of the API it speaks."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from relax_hpc.config import ConfigError, load_config
from relax_hpc.config.engines import ENGINE_KINDS
from relax_hpc.launch.commands import engine_args
from relax_hpc.paths import RunPaths
from relax_hpc.trainer.build import build_backend, build_channel
from relax_hpc.weights.sender import BroadcastChannel
from relax_hpc.weights.vllm_channel import VllmChannel

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-grpo.yaml"
# A supervised kind speaking SGLang's API that takes neither the sharded channel nor LoRA merges
# and evaluates nothing: every value differs from the built-in engine's where a check reads it.
FAKE = dataclasses.replace(
    ENGINE_KINDS["sglang"], name="fake", label="Fake", module="tests.fake_engine", tp_size=None,
    channels=frozenset({"broadcast"}), lora_sync=frozenset({"adapter"}), reloads_whole=None,
)  # fmt: skip


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(ENGINE_KINDS, "fake", FAKE)
    yield


def config(tmp_path: Path, *overrides: str):
    return load_config(CONFIG, [f"run.dir={tmp_path / 'run'}", *overrides], base_dir=REPO)


def test_an_unknown_kind_is_refused_naming_the_table_s_kinds(tmp_path):
    refusal = "rollout.engine: Input should be 'torch', 'sglang' or 'vllm' (got 'fake')"
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        config(tmp_path, "rollout.engine=fake")


def test_submit_s_checks_follow_the_new_kind_s_entry(tmp_path, fake):
    cfg = config(tmp_path, "rollout.engine=fake", "trainer.lora.rank=4")
    assert cfg.rollout.kind is FAKE and cfg.trainer.lora is not None
    assert cfg.trainer.lora.sync == "adapter"  # auto: the kind serves no merge
    for overrides, refusal in (
        (["weights.channel=sharded"], "weights.channel=sharded with rollout.engine=fake: Fake takes weights"),
        (["trainer.lora.rank=4", "trainer.lora.sync=merge"],
         "trainer.lora.sync=merge with rollout.engine=fake: Fake's weight update"),
        (["rollout.eval_engines=1"], "rollout.engine is fake: only built-in engines evaluate"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(refusal)):
            config(tmp_path, "rollout.engine=fake", *overrides)
    assert not config(tmp_path, "rollout.engine=fake", "rollout.catch_up=engine").engine_catch_up
    ENGINE_KINDS["fake"] = dataclasses.replace(FAKE, channels=frozenset({"broadcast", "sharded"}), catch_up=True)
    assert config(tmp_path, "rollout.engine=fake", "weights.channel=sharded").weights.channel == "sharded"
    assert config(tmp_path, "rollout.engine=fake", "rollout.catch_up=engine").engine_catch_up


def test_the_launcher_starts_the_new_kind_with_its_own_module(tmp_path, fake):
    cfg = config(tmp_path, "rollout.engine=fake")
    argv = engine_args(cfg, RunPaths(tmp_path / "run"), 0, "127.0.0.1")
    assert argv[:2] == ["-m", "tests.fake_engine"] and "--model-path" not in argv  # it reads config.yaml itself


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_trainer_s_channel_follows_the_api_the_kind_speaks(tmp_path, fake, one_rank):
    cfg = config(tmp_path, "rollout.engine=fake")
    paths = RunPaths(tmp_path / "run")
    paths.create()
    backend = build_backend(cfg, torch.device("cpu"))
    assert type(build_channel(cfg, paths, backend, torch.device("cpu"))) is BroadcastChannel
    ENGINE_KINDS["fake"] = dataclasses.replace(FAKE, api="vllm")
    assert type(build_channel(cfg, paths, backend, torch.device("cpu"))) is VllmChannel


def test_the_config_layer_imports_no_torch():
    code = "import sys, relax_hpc.config, relax_hpc.config.engines; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False", out.stderr
