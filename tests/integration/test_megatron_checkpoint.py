"""The megatron backend's checkpoints through megatron-core's own optimizers (distributed, and
plain with trainer.megatron.distributed_optimizer=false; torch's Adam, fused, as without
Transformer Engine or apex) and dist_checkpointing, on the CPU: after
three optimizer steps the state is saved; a fresh model and optimizer that never stepped load it
and then hold the same master weights, Adam moments and step count (one step tensor per
parameter), and the next step gives the same parameters as in the run that saved; the HF
tensors read back from the checkpoint (tools/dcp_to_hf.py) are the model's.

Without the workarounds in relax_hpc/trainer/megatron_state.py this fails the way megatron-core
0.16.1 fails on a GPU: the default optimizer layout cannot be written, loading into an optimizer
that never stepped asserts, the loaded tensors lack Adam's 'step' (KeyError), and the step
tensor shared by all parameters counts once per parameter.

megatron's optimizer is GPU code: on the CPU it needs its device strings and type names
redirected (the patches below); nothing else is changed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from relax_hpc.config.schema import MegatronConfig, TrainerConfig
from relax_hpc.models.hf_checkpoint import megatron_checkpoint_to_hf
from relax_hpc.models.hf_export import export_hf
from relax_hpc.models.megatron import as_value_model, build_model
from relax_hpc.trainer import megatron_state
from tests.unit.test_hf_mapping import free_port, tiny_configs

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of tests/gpu/test_megatron_backend.py"),
]


def _on_cpu(factory):
    def call(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return call


@pytest.fixture
def megatron_on_cpu(monkeypatch):
    type_name = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):  # megatron dispatches on 'torch.cuda.FloatTensor' & co
        name = type_name(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not (args or kwargs) and ".cuda." not in name else name

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch, "tensor", _on_cpu(torch.tensor))
    monkeypatch.setattr(torch, "zeros", _on_cpu(torch.zeros))
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.Tensor, "type", cuda_type_name)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    megatron_state.use_torch_multi_tensor_ops()
    yield
    parallel_state.destroy_model_parallel()
    if started:
        dist.destroy_process_group()


def _trainable(dtype: torch.dtype, distributed: bool, seed: int, critic: bool = False):
    torch.manual_seed(seed)
    module = build_model(tiny_configs()["qwen3"], MegatronConfig(attention="sdpa"), dtype, True, True)
    if critic:
        module = as_value_model(module)
    return megatron_state.trainable(module, TrainerConfig(lr=1e-2, weight_decay=0.1), dtype, distributed)


def _step(model, optimizer, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (1, 12), generator=g)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    # Away from 1 (not 0): the critic's value head starts at zero, where (V ** 2) has no gradient.
    ((model(ids, torch.arange(12)[None], None).float() - 1) ** 2).mean().backward()
    model.finish_grad_sync()
    ok, grad_norm, _ = optimizer.step()
    assert ok
    return grad_norm


def _optimizer_state(optimizer) -> list[dict[str, torch.Tensor]]:
    torch_optimizer = optimizer.optimizer
    return [
        {"param": p.detach().clone(), **{k: v.detach().clone() for k, v in torch_optimizer.state[p].items()}}
        for group in torch_optimizer.param_groups
        for p in group["params"]
    ]


def _assert_same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys() == {"param", "step", "exp_avg", "exp_avg_sq"}
        for key in x:
            assert torch.equal(x[key], y[key]), key


@pytest.mark.parametrize(
    ("dtype", "distributed"),
    [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["fp32-distributed-optimizer", "bf16-distributed-optimizer", "bf16-plain-optimizer"],
)
def test_a_loaded_checkpoint_takes_the_next_step_of_the_run_that_saved_it(
    dtype, distributed, megatron_on_cpu, tmp_path
):
    model, optimizer = _trainable(dtype, distributed, seed=0)
    assert all(g["fused"] for g in optimizer.optimizer.param_groups)
    for seed in range(3):
        _step(model, optimizer, seed)
    megatron_state.save(model, optimizer, tmp_path / "ckpt")
    # what tools/dcp_to_hf.py reads back from it (the optimizer's tensors left out): the HF weights
    exported = {}
    for name, t in export_hf(model.module, tiny_configs()["qwen3"]):
        assert t is not None, name  # one rank holds every tensor
        exported[name] = t.clone()
    converted = megatron_checkpoint_to_hf(tmp_path / "ckpt", tiny_configs()["qwen3"])
    assert converted.keys() == exported.keys()
    assert all(torch.equal(converted[name], exported[name]) for name in exported)

    resumed_model, resumed = _trainable(dtype, distributed, seed=1)  # other weights, an optimizer that never stepped
    megatron_state.load(resumed_model, resumed, tmp_path / "ckpt")
    _assert_same(_optimizer_state(optimizer), _optimizer_state(resumed))
    steps = [s["step"] for s in resumed.optimizer.state.values()]
    assert {float(s) for s in steps} == {3.0} and len({id(s) for s in steps}) == len(steps)
    for (name, p), (_, q) in zip(model.module.named_parameters(), resumed_model.module.named_parameters(), strict=True):
        assert torch.equal(p, q), name

    assert _step(model, optimizer, 7) == _step(resumed_model, resumed, 7)
    _assert_same(_optimizer_state(optimizer), _optimizer_state(resumed))
    for (name, p), (_, q) in zip(model.module.named_parameters(), resumed_model.module.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_the_critic_resumes_with_its_value_head(megatron_on_cpu, tmp_path):
    """The megatron backend's critic (a ValueHead in the output layer's place) through the same
    checkpoint code: its head is saved and loaded with the transformer and Adam's state."""
    model, optimizer = _trainable(torch.float32, True, seed=0, critic=True)
    assert model(torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None], None).shape == (1, 5, 1)
    for seed in range(3):
        _step(model, optimizer, seed)
    head = model.module.output_layer.weight
    assert head.shape == (1, 32) and head.abs().sum() > 0  # it learned from zero
    megatron_state.save(model, optimizer, tmp_path / "critic")

    resumed_model, resumed = _trainable(torch.float32, True, seed=1, critic=True)
    megatron_state.load(resumed_model, resumed, tmp_path / "critic")
    _assert_same(_optimizer_state(optimizer), _optimizer_state(resumed))
    assert torch.equal(resumed_model.module.output_layer.weight, head)
    assert _step(model, optimizer, 7) == _step(resumed_model, resumed, 7)
    for (name, p), (_, q) in zip(model.module.named_parameters(), resumed_model.module.named_parameters(), strict=True):
        assert torch.equal(p, q), name
