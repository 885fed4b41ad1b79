"""launch.colocate_offload on a GPU: the optimizer state parked in host memory while colocated
engines generate comes back exactly, frees its device memory meanwhile, and the next step
trains as it would have without the round trip, in both backends (megatron's distributed
optimizer over torch's fused Adam; the torch backend's Adam over FSDP2's DTensor shards). Run
on the GPU machine: `python -m pytest tests/gpu -m gpu`."""

from pathlib import Path

import pytest
import torch

from tests.gpu.test_megatron_backend import _batch, _weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("backend", ["megatron", "torch"])
def test_optimizer_state_round_trip_is_exact_and_frees_the_device(megatron_world, tmp_path, backend):
    from relax_hpc.config.load import load_config
    from relax_hpc.trainer.build import build_backend
    from relax_hpc.trainer.offload import OptimizerOffload

    cfg = load_config(REPO / "configs/gpu-tiny-megatron.yaml", [f"run.dir={tmp_path}", "trainer.lr=3e-3",
                      "model.dtype=bfloat16", f"trainer.backend={backend}"])  # fmt: skip
    device = torch.device("cuda", 0)
    plain, parked = build_backend(cfg, device), build_backend(cfg, device)
    for b in (plain, parked):
        b.train_step(_batch(0, 46), 0)
    offload = OptimizerOffload(parked.optimizers(), device)
    before = {i: t.clone() for i, t in enumerate(offload._state())}
    assert before and all(t.is_cuda for t in before.values())

    for _ in range(2):  # the second round reuses the pinned buffers
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated(device)
        moved = offload.offload()
        assert moved == sum(t.numel() * t.element_size() for t in before.values())
        assert held - torch.cuda.memory_allocated(device) >= moved  # the state's blocks are free
        assert not offload._state()  # nothing of it left on the device
        offload.restore()
        after = offload._state()
        assert len(after) == len(before)
        for i, t in enumerate(after):
            assert t.is_cuda and torch.equal(t, before[i]), i

    expected = plain.train_step(_batch(1, 46), 1)
    got = parked.train_step(_batch(1, 46), 1)
    assert got.loss == pytest.approx(expected.loss, rel=1e-3, abs=1e-5)
    reference = _weights(plain)
    for name, tensor in _weights(parked).items():
        torch.testing.assert_close(tensor, reference[name], rtol=2e-2, atol=1e-3)
