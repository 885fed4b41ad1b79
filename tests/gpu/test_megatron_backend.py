"""The megatron backend's checkpoints on a GPU: a run resumed from a checkpoint holds exactly the
saved weights and takes the step the uninterrupted run took, and tools/dcp_to_hf.py turns the
checkpoint into an HF folder that transformers loads with exactly those weights. bf16, so the
training step runs the GPU kernels (packed flash attention, compiled norms, RoPE, log-probs).
Run on the GPU machine: `python -m pytest tests/gpu -m gpu`."""

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
REPO = Path(__file__).resolve().parents[2]


def _batch(seed: int, vocab: int):
    from relax_hpc.trainer.batching import pad_samples

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 40, (32,), generator=g).tolist()
    seqs = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * 4 + [1] * (n - 4) for n in lengths]
    logps = [[-1.5] * n for n in lengths]
    return pad_samples(seqs, masks, logps, torch.rand(32, generator=g).tolist(), [i // 8 for i in range(32)], 0)


def _weights(backend) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in backend.full_parameters()}


def test_checkpoint_resumes_exactly_and_converts_to_hf(megatron_world, tmp_path):
    from transformers import AutoModelForCausalLM

    from relax_hpc.ckpt.export import convert
    from relax_hpc.ckpt.manager import Checkpointer
    from relax_hpc.config.load import load_config, to_yaml
    from relax_hpc.paths import RunPaths
    from relax_hpc.trainer.build import build_backend

    cfg = load_config(REPO / "configs/gpu-tiny-megatron.yaml", [f"run.dir={tmp_path / 'run'}", "trainer.lr=3e-3",
                      "model.dtype=bfloat16", "algo.minibatches=2"])  # fmt: skip
    paths = RunPaths(Path(cfg.run.dir))
    paths.create()
    paths.config.write_text(to_yaml(cfg))
    device = torch.device("cuda", 0)
    vocab = 46
    first = build_backend(cfg, device)
    first.train_step(_batch(0, vocab), 0)
    assert Checkpointer(paths.ckpt, keep=2).save(1, first.save_checkpoint, {}, {"step": 1, "version": 1})
    saved = _weights(first)
    after = first.train_step(_batch(1, vocab), 1)
    expected = _weights(first)
    assert any(not torch.equal(saved[n], expected[n]) for n in saved)  # the second step moved them

    resumed = build_backend(cfg, device)
    resumed.load_checkpoint(paths.ckpt / "step-00000001")
    for name, tensor in _weights(resumed).items():
        assert torch.equal(tensor, saved[name]), name
    again = resumed.train_step(_batch(1, vocab), 1)  # the optimizer state came back too
    assert again.loss == pytest.approx(after.loss, rel=1e-3, abs=1e-5)
    for name, tensor in _weights(resumed).items():
        torch.testing.assert_close(tensor, expected[name], rtol=2e-2, atol=1e-3)

    out = tmp_path / "hf"
    convert(paths.root, out)
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for name, param in converted.named_parameters():
        assert torch.equal(param, saved[name].cpu()), name
