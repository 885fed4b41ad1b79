"""The megatron backend's checkpoints on a GPU: a run resumed from a checkpoint holds exactly the
saved weights and takes the step the uninterrupted run took, and tools/dcp_to_hf.py turns the
checkpoint into an HF folder that transformers loads with exactly those weights. bf16, so the
training step runs the GPU kernels (packed flash attention, compiled norms, RoPE, log-probs).
kind=sft: the megatron backend's sft_step takes the torch backend's step.
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


def test_routing_replay_takes_the_engines_experts(megatron_world, tmp_path):
    """A tiny Qwen3-MoE samples in bfloat16 in the torch engine; its experts travel through a spool
    file; the float32 megatron backend's forward routes every recorded token through exactly them,
    and its log-probabilities then match the engine's more closely than when its routers decide."""
    import base64
    from dataclasses import replace

    import numpy as np

    from relax_hpc.config.load import load_config
    from relax_hpc.engines.torch_engine import TorchEngine
    from relax_hpc.models.megatron_routing import recording
    from relax_hpc.trainer.backend import BackendConfig
    from relax_hpc.trainer.batching import share_of
    from relax_hpc.trainer.megatron_backend import MegatronBackend
    from tests.models.qwen3_family import build_qwen3_moe
    from tests.unit.test_routing import LAYERS, TOP_K, answers, batch_of

    folder = build_qwen3_moe(tmp_path / "moe")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 30, (8,), generator=g).tolist() for _ in range(64)]
    out = answers(TorchEngine(str(folder), "bfloat16", "cuda"), prompts)
    routed = [
        np.frombuffer(base64.b64decode(o["meta_info"]["routed_experts"]), dtype=np.int32).reshape(-1, LAYERS * TOP_K)
        for o in out
    ]
    batch, _ = share_of(batch_of(out, prompts, routed, tmp_path), list(range(len(prompts))), 0, 1, 0)
    cfg = load_config(REPO / "configs/gpu-tiny-megatron.yaml", [f"run.dir={tmp_path / 'run'}", f"model.path={folder}",
                      "algo.off_policy.routing_replay=true"])  # fmt: skip
    backend = MegatronBackend(BackendConfig.of(cfg), torch.device("cuda", 0))
    batch = batch.to(torch.device("cuda", 0))

    with recording(backend.model) as replayed_calls:
        replayed = backend._frozen_logprobs(backend.model, batch)
    with recording(backend.model) as free_calls:
        free = backend._frozen_logprobs(backend.model, replace(batch, routed=None))
    assert replayed is not None and free is not None
    packed = [mb.routed for mb in backend._microbatches(batch) if mb.routed is not None]
    given = torch.cat(packed).reshape(-1, LAYERS, TOP_K).sort(-1).values
    recorded = (given >= 0).all(-1)  # [tokens, layers]
    taken = torch.cat(replayed_calls).reshape(-1, LAYERS, TOP_K)
    assert torch.equal(taken[recorded], given[recorded])
    own = torch.cat(free_calls).reshape(-1, LAYERS, TOP_K)
    flips = (own != given).any(-1)[recorded].float().mean()
    assert flips > 0  # bfloat16 and float32 routers disagree somewhere: what replay is for

    mask = batch.loss_mask.bool()
    with_replay = (replayed[mask] - batch.rollout_logprobs[mask]).abs()
    without = (free[mask] - batch.rollout_logprobs[mask]).abs()
    assert with_replay.mean() < without.mean() and with_replay.max() < without.max()


def test_critic_learns_resumes_exactly_and_values_as_the_torch_critic(megatron_world, tmp_path):
    """gae in the megatron backend: on a fixed batch the critic's value loss falls (lambda = 1:
    the returns are the rewards, fixed targets); a run resumed from a checkpoint holds the saved
    critic exactly and takes the same next step, policy and critic; and for the same weights its
    values are those of the torch backend's critic (transformers' token-classification head)."""
    from transformers import AutoModelForTokenClassification

    from relax_hpc.ckpt.manager import Checkpointer
    from relax_hpc.config.load import load_config
    from relax_hpc.trainer.backend import BackendConfig
    from relax_hpc.trainer.megatron_backend import MegatronBackend

    cfg = load_config(REPO / "configs/gpu-tiny-megatron.yaml", [f"run.dir={tmp_path / 'run'}", "algo.minibatches=2",
                      "algo.advantage.estimator=gae", "algo.advantage.lam=1.0", "algo.critic.lr=5e-3"])  # fmt: skip
    device, vocab = torch.device("cuda", 0), 46
    batch = _batch(0, vocab)
    first = MegatronBackend(BackendConfig.of(cfg), device)
    value_losses = [first.train_step(batch, step).stats.sums["value_loss"] for step in range(4)]
    assert value_losses[-1] < 0.5 * value_losses[0], value_losses

    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    assert ckpt.save(4, first.save_checkpoint, {}, {"step": 4, "version": 4})
    saved_values = first._frozen_values(batch.to(device))
    after = first.train_step(_batch(1, vocab), 4)
    expected_policy, expected_values = _weights(first), first._frozen_values(batch.to(device))
    assert saved_values is not None and expected_values is not None

    resumed = MegatronBackend(BackendConfig.of(cfg), device)
    resumed.load_checkpoint(tmp_path / "ckpt" / "step-00000004")
    loaded_values = resumed._frozen_values(batch.to(device))
    assert loaded_values is not None and torch.equal(loaded_values, saved_values)
    again = resumed.train_step(_batch(1, vocab), 4)  # both optimizers' states came back too
    assert again.loss == pytest.approx(after.loss, rel=1e-4, abs=1e-6)
    assert again.stats.sums["value_loss"] == pytest.approx(after.stats.sums["value_loss"], rel=1e-4)
    torch.testing.assert_close(resumed._frozen_values(batch.to(device)), expected_values, rtol=1e-4, atol=1e-5)
    for name, tensor in _weights(resumed).items():
        torch.testing.assert_close(tensor, expected_policy[name], rtol=1e-4, atol=1e-6)

    fresh = MegatronBackend(BackendConfig.of(cfg), device)
    torch_critic = AutoModelForTokenClassification.from_pretrained(cfg.model.path, num_labels=1, dtype=torch.float32)
    torch_critic = torch_critic.to(device).eval()
    assert fresh.critic is not None
    head = torch.randn(1, torch_critic.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.1
    with torch.no_grad():
        torch_critic.score.weight.copy_(head)
        fresh.critic.module.output_layer.weight.copy_(head)
        on_gpu = batch.to(device)
        expected = torch_critic(input_ids=on_gpu.input_ids, attention_mask=on_gpu.attention_mask).logits.squeeze(-1)
    values = fresh._frozen_values(on_gpu)
    assert values is not None
    real = on_gpu.attention_mask.bool()
    torch.testing.assert_close(values[real], expected[real], rtol=1e-4, atol=1e-4)


def test_sft_step_is_the_torch_backends(megatron_world, tmp_path):
    """kind=sft on a GPU: the megatron backend's sft_step, its examples packed into several
    micro-batches, has the torch backend's loss, NLL and gradient norm on the same weights and
    batch (float32, packed attention per document), step after step; and bf16 (the flash varlen
    kernel, the compiled log-probabilities) learns the batch."""
    from relax_hpc.config.load import load_config
    from relax_hpc.data.sft import load_examples
    from relax_hpc.models.tiny import build_char_tokenizer
    from relax_hpc.trainer.backend import BackendConfig
    from relax_hpc.trainer.megatron_backend import MegatronBackend
    from relax_hpc.trainer.sft_loop import examples_batch
    from relax_hpc.trainer.torch_backend import TorchBackend

    sft, device = REPO / "configs/tiny-sft.yaml", torch.device("cuda", 0)
    base = [f"run.dir={tmp_path / 'run'}", "trainer.num_ranks=1", "model.dtype=float32"]
    megatron = [*base, "trainer.backend=megatron", "trainer.megatron.max_tokens_per_microbatch=96"]
    tok = build_char_tokenizer()
    keys = {"prompt": "prompt", "response": "response", "messages": "messages"}
    examples = load_examples(REPO / "assets/addition-sft.jsonl", "prompt_response", keys, tok, 64)[::3]
    batch = examples_batch(examples, list(range(len(examples))), tok.pad_token_id)
    reference = TorchBackend(BackendConfig.of(load_config(sft, base, base_dir=REPO)), device)
    backend = MegatronBackend(BackendConfig.of(load_config(sft, megatron, base_dir=REPO)), device)
    assert len(backend._microbatches(batch.to(device))) > 2
    for step in range(3):
        expected, got = reference.sft_step(batch, step, "token_mean"), backend.sft_step(batch, step, "token_mean")
        assert got.loss == pytest.approx(expected.loss, rel=1e-4)
        assert got.stats.sums["nll"] == pytest.approx(expected.stats.sums["nll"], rel=1e-4)
        assert got.grad_norm == pytest.approx(expected.grad_norm, rel=1e-3)

    bf16_cfg = load_config(sft, [*megatron, "model.dtype=bfloat16", "trainer.lr=3e-3"], base_dir=REPO)
    bf16 = MegatronBackend(BackendConfig.of(bf16_cfg), device)
    losses = [bf16.sft_step(batch, step, "token_mean").loss for step in range(10)]
    assert losses[-1] < 0.75 * losses[0], losses  # 1.28 -> 0.75 in bf16 on the CPU
