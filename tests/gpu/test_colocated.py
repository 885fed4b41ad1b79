"""Colocated weight updates on one GPU: a torch engine on the trainer's device takes the weights
by CUDA IPC, packed into bucket buffers or shared where they lie, and after every push holds
exactly the trainer's (the parameters change in place between pushes: the same allocations,
new bytes). Run on the GPU machine: `python -m pytest tests/gpu -m gpu`."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MODEL = Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen3-addition"


@pytest.fixture
def engine(tmp_path):
    from relax_hpc.paths import RunPaths
    from relax_hpc.protocol.registry import read_records

    paths = RunPaths(tmp_path / "run")
    paths.create()
    process = subprocess.Popen(
        [sys.executable, "-m", "relax_hpc.engines.torch_engine", "--run-dir", str(paths.root), "--engine-id",
         "engine-0", "--model-path", str(MODEL), "--device", "cuda:0"],
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not read_records(paths.engines):
        assert process.poll() is None and time.monotonic() < deadline, "the engine did not start"
        time.sleep(0.2)
    yield paths
    process.terminate()
    process.wait()


@pytest.mark.parametrize("pack", [True, False])
def test_engine_holds_the_trainer_weights_after_every_push(engine, pack):
    from transformers import AutoModelForCausalLM

    from relax_hpc.protocol import requests as P
    from relax_hpc.protocol.client import EngineClient
    from relax_hpc.protocol.registry import read_records
    from relax_hpc.weights.buckets import plan_buckets
    from relax_hpc.weights.colocated import ColocatedSender

    model = AutoModelForCausalLM.from_pretrained(MODEL).to("cuda")  # type: ignore[arg-type]  # transformers types .to() as taking a model
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    buckets = plan_buckets([(n, p.shape, p.dtype) for n, p in named], int(0.1 * 2**20))
    assert len(buckets) > 3
    sender = ColocatedSender(engine.engines, engine.read_token(), 60, 0, 1, pack=pack)
    client = EngineClient(read_records(engine.engines)[0].url, engine.read_token(), 60)
    torch.manual_seed(0)
    for version in (1, 2, 3):
        with torch.no_grad():
            for _, p in named:
                p.add_(0.1 * torch.randn_like(p))  # in place: the same allocations, new bytes
        sender.release()
        assert sender.push(buckets, iter(named), version)[0] == 1
        assert client.weight_version() == str(version)
        for name, p in named:
            got = client.post("/get_weights_by_name", P.GetWeightsByNameReqInput(name=name, truncate_size=p.shape[0]))
            assert torch.equal(torch.tensor(got, dtype=p.dtype), p.cpu()), (version, name)
