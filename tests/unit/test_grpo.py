"""GRPO advantages and loss against values worked out by hand."""

import math

import pytest
import torch

from relax_hpc.algos.grpo import PolicyLossConfig, group_advantages, policy_loss


def test_advantages_by_hand():
    # Group 7: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.57735.
    # Group 3: rewards 0, 0, 1 -> mean 1/3, unbiased std sqrt((1/9 + 1/9 + 4/9) / 2) = 0.57735.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 3])
    adv = group_advantages(rewards, groups, normalize_std=True, eps=0.0)
    s = math.sqrt(1 / 3)
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, -1 / 3 / s, -1 / 3 / s, 2 / 3 / s]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_dr_grpo_does_not_divide_by_std():
    adv = group_advantages(torch.tensor([2.0, 0.0, 1.0]), torch.tensor([0, 0, 0]), normalize_std=False)
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0])


def test_equal_rewards_and_singleton_groups_give_zero_advantage():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.5])
    groups = torch.tensor([0, 0, 0, 1])  # group 1 has a single sample: no baseline
    adv = group_advantages(rewards, groups)
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert torch.isfinite(adv).all()


def test_on_policy_loss_value_and_gradient_by_hand():
    # Two samples, three token slots; sample 0 has 2 completion tokens, sample 1 has 1.
    logits = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)  # stands for per-token log-probs
    logprobs = torch.stack([logits, logits * 2])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    adv = torch.tensor([1.5, -0.5])
    entropy = torch.tensor([[0.2, 0.4, 9.0], [9.0, 9.0, 0.6]])
    cfg = PolicyLossConfig(entropy_coef=0.1)
    loss, metrics = policy_loss(logprobs, logprobs.detach(), adv, entropy, mask, num_tokens=3.0, cfg=cfg)
    # ratio = 1 everywhere: per-token pg = -A; masked: -1.5, -1.5, +0.5 -> sum -2.5
    # entropy term: -0.1 * (0.2 + 0.4 + 0.6) = -0.12; loss = (-2.5 - 0.12) / 3
    assert float(loss) == pytest.approx((-2.5 - 0.12) / 3)
    assert metrics["pg_loss_sum"] == pytest.approx(-2.5)
    loss.backward()
    # d/dlogp of -A * exp(logp - sg(logp)) = -A at ratio 1. logits[0], logits[1] feed sample 0
    # (coefficient 1); logits[2] feeds sample 1 through logits*2.
    assert logits.grad.tolist() == pytest.approx([-1.5 / 3, -1.5 / 3, 0.5 * 2 / 3])


def test_clipping_stops_the_gradient_outside_the_trust_region():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.8, 0.55]])).requires_grad_(True)  # ratios 1.6 and 1.1
    adv = torch.tensor([1.0])
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.2)
    loss, metrics = policy_loss(new, old, adv, torch.zeros(1, 2), torch.ones(1, 2), 2.0, cfg)
    # min(1.6 * 1, 1.2 * 1) = 1.2 (clipped, no gradient); min(1.1, 1.1) = 1.1
    assert float(loss) == pytest.approx(-(1.2 + 1.1) / 2)
    loss.backward()
    assert new.grad[0, 0] == 0.0
    assert float(new.grad[0, 1]) == pytest.approx(-1.1 / 2)
    assert metrics["clipped_tokens"] == 1.0


def test_fully_masked_batch_has_zero_loss_and_finite_gradient():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, _ = policy_loss(
        logprobs, logprobs.detach(), torch.tensor([1.0, -1.0]), torch.zeros(2, 3), torch.zeros(2, 3), 1.0,
        PolicyLossConfig(),
    )
    loss.backward()
    assert float(loss) == 0.0 and torch.isfinite(logprobs.grad).all()


def test_gradcheck_of_the_loss():
    torch.manual_seed(0)
    logprobs = (torch.randn(3, 4, dtype=torch.float64) * 0.1).requires_grad_(True)
    old = logprobs.detach() + 0.05 * torch.randn(3, 4, dtype=torch.float64)
    mask = (torch.rand(3, 4) > 0.3).double()
    adv = torch.randn(3, dtype=torch.float64)
    ent = torch.rand(3, 4, dtype=torch.float64)
    cfg = PolicyLossConfig(clip_low=0.5, clip_high=0.5, entropy_coef=0.01)  # wide: no clip kink at this point
    assert torch.autograd.gradcheck(lambda lp: policy_loss(lp, old, adv, ent, mask, 7.0, cfg)[0], (logprobs,))
