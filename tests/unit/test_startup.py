"""Start-up: heavy packages only where they are used, and the start-up record of a role."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.metrics.startup import StartupClock, process_age

REPO = Path(__file__).resolve().parents[2]

# Builds the trainer of CONFIG as its entry module does (a process group of one rank, the real
# Trainer: backend, model, weight layout, sender, resume) and the built-in engine, then names the
# heavy packages this process imported.
BUILD_ROLES = """
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import relax_hpc.engines.torch_engine as engine
import relax_hpc.trainer.main  # noqa: F401  the entry module's imports
from relax_hpc.config.load import load_config
from relax_hpc.paths import RunPaths
from relax_hpc.submit import freeze
from relax_hpc.trainer.loop import Trainer

config, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
cfg = load_config(config, [f"run.dir={run_dir}"], base_dir=Path.cwd())
paths = RunPaths(run_dir)
freeze(cfg, paths)
dist.init_process_group("gloo", init_method=f"file://{run_dir}/store", rank=0, world_size=1)
Trainer(cfg, paths, torch.device("cpu")).resume()
engine.TorchEngine(cfg.model.path, "float32")
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules} & {"peft", "megatron"})))
"""


def heavy_modules(config: str, tmp_path: Path) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", BUILD_ROLES, str(REPO / config), str(tmp_path / "run")],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    imported: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return imported


def test_a_trainer_and_an_engine_without_lora_import_neither_peft_nor_megatron(tmp_path):
    assert heavy_modules("configs/tiny-grpo.yaml", tmp_path) == []


def test_a_lora_trainer_imports_peft(tmp_path):
    # The other side of the test above: the same build does import peft when it needs it.
    assert heavy_modules("configs/tiny-grpo-lora.yaml", tmp_path) == ["peft"]


def test_the_startup_record_has_every_phase_in_order_with_its_wall_and_cpu_seconds(tmp_path):
    clock = StartupClock()
    assert 0.1 < clock.phases["import"]["wall"] <= process_age()  # this process started before pytest's imports
    time.sleep(0.05)
    clock.mark("model")
    sum(i * i for i in range(300_000))  # some CPU
    clock.mark("model")  # passed again: keeps its first time
    clock.finish(tmp_path, "engine-0", "first_batch")
    clock.finish(tmp_path, "engine-0", "again")  # once only
    (record,) = read_jsonl(tmp_path / "startup.jsonl")
    assert record["role"] == "engine-0"
    assert list(record["phases"]) == ["import", "model", "first_batch"]
    assert record["phases"]["model"]["wall"] >= 0.05
    assert record["phases"]["first_batch"]["cpu"] > 0
    assert abs(record["wall"] - sum(p["wall"] for p in record["phases"].values())) < 1e-3
    assert record["cpu"] >= sum(p["cpu"] for p in record["phases"].values()) - 1e-3
    assert abs(record["started"] + record["wall"] - time.time()) < 1.0
