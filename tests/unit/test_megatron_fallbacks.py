"""What the megatron backend puts in place of megatron's slow fallbacks for apex kernels: torch's
multi-tensor norm and scale under amp_C's contracts, and torch's fused Adam switched on in the
parameter groups of an already built optimizer."""

from types import SimpleNamespace

import torch

from relax_hpc.trainer.megatron_state import foreach_l2_norm, foreach_scale, fuse_adam


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in ((3, 4), (7,), (2, 2, 5))]


def test_l2_norm_is_the_norm_of_all_tensors_together():
    tensors = _tensors()
    norm, per_tensor = foreach_l2_norm(2048, torch.zeros(1, dtype=torch.int), [tensors], False)
    assert norm.shape == (1,) and per_tensor is None
    torch.testing.assert_close(norm[0], torch.cat([t.flatten() for t in tensors]).norm())


def test_scale_in_place_and_into_other_tensors():
    src, dst = _tensors(0), _tensors(1)
    expected = [t * 0.25 for t in src]
    foreach_scale(2048, None, [src, dst], 0.25)
    for d, e in zip(dst, expected, strict=True):
        torch.testing.assert_close(d, e)
    foreach_scale(2048, None, [dst, dst], 2.0)  # clipping passes the same list twice
    for d, e in zip(dst, expected, strict=True):
        torch.testing.assert_close(d, e * 2.0)


def _adam_steps(fuse: bool) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(t) for t in _tensors()]
    adam = torch.optim.Adam(params, lr=0.1, betas=(0.9, 0.99), weight_decay=0.01)
    if fuse:  # the shape of megatron's chained optimizer: wrappers holding torch optimizers
        fuse_adam(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)]))
        assert all(group["fused"] for group in adam.param_groups)
    for step in range(3):
        for p, g in zip(params, _tensors(10 + step), strict=True):
            p.grad = g
        adam.step()
    return [p.detach() for p in params]


def test_fused_adam_takes_the_same_steps():
    for fused, plain in zip(_adam_steps(True), _adam_steps(False), strict=True):
        torch.testing.assert_close(fused, plain)
