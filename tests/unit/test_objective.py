"""The configured Objective: advantages, losses and statistics of a few algo configs by hand."""

import math
import statistics

import pytest
import torch

from relax_hpc.algos.aggregation import Normalizer, local_counts
from relax_hpc.algos.objective import Objective
from relax_hpc.algos.stats import Stats
from relax_hpc.config.schema import JobConfig
from tests.unit.algo_helpers import TwoRankGroup, close, ids, t

torch.set_num_threads(1)


def objective(cfg, max_new_tokens=4, max_staleness=0):
    """The Objective of `algo: cfg` in a job config, resolved as loading resolves it."""
    rollout = {"max_new_tokens": max_new_tokens, "max_staleness": max_staleness}
    return Objective(JobConfig.model_validate({"algo": cfg, "rollout": rollout}).algo)


def norm_of(mask):
    return Normalizer(*local_counts(mask))


def whiten(values):
    """Plain-Python (x - mean) / unbiased std."""
    m, s = statistics.mean(values), statistics.stdev(values)
    return [(v - m) / s for v in values]


def grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


# -- grpo + ppo ------------------------------------------------------------------------------------


def grpo_ppo_case():
    # Group 0: rewards 1, 0 -> centred +-0.5, unbiased std sqrt(0.5), eps 1e-6: a = 0.5 / (sqrt(0.5) + 1e-6).
    # Group 1: rewards 0.5, 0.5 -> 0.
    rewards, groups = t([1.0, 0.0, 0.5, 0.5]), ids([0, 0, 1, 1])
    mask = t([[1, 1], [1, 0], [1, 1], [0, 1]])
    old = torch.full((4, 2), -1.0, dtype=torch.float64)
    # log r per token (masked positions get large values that must not show anywhere)
    log_r = t([[0.0, 0.5], [-0.5, 2.0], [0.1, -0.1], [3.0, -0.1]])
    lp = (old + log_r).requires_grad_(True)
    entropy = t([[0.5, 0.5], [0.5, 9.0], [0.5, 0.5], [9.0, 0.5]])
    return rewards, groups, mask, old, lp, entropy


def test_grpo_ppo_advantages_by_hand():
    obj = objective({"advantage": {"estimator": "grpo"}, "policy_loss": {"kind": "ppo"}})
    rewards, groups, mask, old, _, _ = grpo_ppo_case()
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    out = obj.advantages(rewards, groups, mask, old)
    close(out.advantages, [[a, a], [-a, 0], [0, 0], [0, 0]])
    assert out.returns is None


def test_grpo_ppo_loss_gradient_and_stats_by_hand():
    obj = objective({"policy_loss": {"kind": "ppo", "clip_low": 0.2, "clip_high": 0.2, "entropy_coef": 0.01}})
    rewards, groups, mask, old, lp, entropy = grpo_ppo_case()
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    advantages = obj.advantages(rewards, groups, mask, old).advantages
    loss, stats = obj.policy_loss(lp, entropy, old, old, advantages, mask, norm_of(mask))
    # (0,0) r 1, A a: -a.  (0,1) r e^0.5 > 1.2, A a: -1.2 a, clipped.  (1,0) r e^-0.5 < 0.8, A -a: 0.8 a, clipped.
    # Group 1's tokens have A = 0: loss 0. pg sum = -a - 1.2 a + 0.8 a = -1.4 a over 6 tokens.
    # Entropy bonus: -0.01 * 0.5 on each of the 6 loss tokens.
    assert float(loss.detach()) == pytest.approx((-1.4 * a - 6 * 0.01 * 0.5) / 6)
    # Only token (0,0) has a gradient: -r A / 6 = -a / 6.
    close(grad(loss, lp), [[-a / 6, 0], [0, 0], [0, 0], [0, 0]])
    e = math.exp
    assert stats.sums["tokens"] == 6
    assert stats.sums["pg_loss"] == pytest.approx(-1.4 * a)
    assert stats.sums["entropy"] == pytest.approx(3.0)
    assert stats.sums["clip_fraction"] == 2
    assert stats.sums["ratio_mean"] == pytest.approx(1 + e(0.5) + e(-0.5) + e(0.1) + 2 * e(-0.1))
    assert stats.maxes["ratio"] == pytest.approx(e(0.5)) and stats.mins["ratio"] == pytest.approx(e(-0.5))
    assert stats.sums["advantage_mean"] == pytest.approx(a)  # a + a - a
    assert stats.sums["advantage_abs_mean"] == pytest.approx(3 * a)
    assert stats.maxes["advantage"] == pytest.approx(a) and stats.mins["advantage"] == pytest.approx(-a)
    assert stats.sums["rollout_mismatch_mean"] == pytest.approx(6.0)  # rollout = old: w = 1
    assert "kl_ref" not in stats.sums and "is_weight_mean" not in stats.sums


def test_approx_kl_is_k3_of_the_old_policy_against_the_new():
    # KL(pi_old || pi) from tokens sampled by pi_old: Schulman's k3 with r = pi / pi_old is
    # (r - 1) - log r (as in CleanRL's approx_kl). log r = 1: e - 1 - 1 = 0.718282; log r = -0.5:
    # e^-0.5 - 1 + 0.5 = 0.106531.
    obj = objective({})
    old = t([[-1.0, -1.0]])
    lp = old + t([[1.0, -0.5]])
    mask = t([[1, 1]])
    _, stats = obj.policy_loss(lp, torch.zeros_like(lp), old, old, t([[0.0, 0.0]]), mask, norm_of(mask))
    assert stats.sums["approx_kl"] == pytest.approx((math.e - 2) + (math.exp(-0.5) - 0.5))


def test_kl_in_the_loss_adds_coef_times_the_estimate():
    # k3 coef 0.1; log pi - log pi_ref = 0.5: k3 = e^-0.5 - 0.5. PPO at r = 1 with A = 2: -2.
    # Gradient of the KL term: 0.1 * (1 - e^-0.5); of the policy term: -2.
    obj = objective({"kl": {"coef": 0.1, "estimator": "k3"}, "policy_loss": {"entropy_coef": 0.0}})
    assert obj.needs_reference
    lp = t([[-1.0]]).requires_grad_(True)
    old, ref, mask = t([[-1.0]]), t([[-1.5]]), t([[1.0]])
    loss, stats = obj.policy_loss(lp, t([[0.0]]), old, old, t([[2.0]]), mask, norm_of(mask), ref_logprobs=ref)
    k3 = math.exp(-0.5) - 0.5
    assert float(loss.detach()) == pytest.approx(-2 + 0.1 * k3)
    assert stats.sums["kl_ref"] == pytest.approx(k3)
    assert float(grad(loss, lp)) == pytest.approx(-2 + 0.1 * (1 - math.exp(-0.5)))


class TinyPolicy:
    """A softmax policy over 32 tokens with logits W h from fixed features: 8 samples of 12 tokens,
    groups of 4, on-policy (pi_old = pi_theta detached), the reference a little off the policy."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.layer = torch.nn.Linear(16, 32, dtype=torch.float64)
        torch.nn.init.normal_(self.layer.weight, std=0.3, generator=gen)
        self.features = torch.randn(8, 12, 16, dtype=torch.float64, generator=gen)
        self.tokens = torch.randint(0, 32, (8, 12), generator=gen)
        self.rewards = torch.randint(0, 2, (8,), generator=gen).double()
        self.groups = ids([0] * 4 + [1] * 4)
        logprobs, _ = self.forward()
        self.ref = logprobs.detach() + 0.1 * torch.randn(8, 12, dtype=torch.float64, generator=gen)

    def forward(self):
        logp = torch.log_softmax(self.layer(self.features), -1)
        return logp.gather(-1, self.tokens.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)

    def grad_norm(self, obj, mask, extra=None):
        """The step's gradient norm; `extra(logprobs)` is added to the loss."""
        self.layer.zero_grad()
        logprobs, entropy = self.forward()
        old = logprobs.detach()
        adv = obj.advantages(self.rewards, self.groups, mask, old).advantages
        loss, _ = obj.policy_loss(logprobs, entropy, old, old, adv, mask, norm_of(mask), self.ref)
        (loss if extra is None else loss + extra(logprobs)).backward()
        return float(torch.nn.utils.clip_grad_norm_(self.layer.parameters(), float("inf")))  # the trainer's norm


@pytest.mark.parametrize("coef", [0.001, 0.1, 1.0])
def test_default_kl_keeps_the_step_gradient_within_2x_on_an_adversarial_batch(coef):
    # Four tokens whose log-ratio to the reference is +-15. With the default estimator (k3, capped)
    # the step's gradient norm stays within 2x of the same batch without those tokens; k3 without
    # the cap, e^-x - 1 + x (written out here), would multiply it by far more.
    policy = TinyPolicy()
    far = [(0, 3, 15.0), (2, 5, -15.0), (5, 7, 15.0), (7, 1, -15.0)]
    with torch.no_grad():
        for i, j, x in far:
            policy.ref[i, j] = policy.forward()[0][i, j] - x
    obj = objective({"kl": {"coef": coef}})
    assert obj.cfg.kl.estimator == "k3" and obj.cfg.kl.placement == "loss"
    mask = torch.ones(8, 12, dtype=torch.float64)
    without = mask.clone()
    for i, j, _ in far:
        without[i, j] = 0.0
    adversarial, clean = policy.grad_norm(obj, mask), policy.grad_norm(obj, without)
    assert clean > 0 and adversarial <= 2 * clean

    def uncapped_excess(logprobs):
        rows, cols = [i for i, _, _ in far], [j for _, j, _ in far]
        x = logprobs[rows, cols] - policy.ref[rows, cols]
        return coef * (torch.exp(-x) - 1 + x - 10.0).sum() / mask.sum()

    assert policy.grad_norm(obj, mask, uncapped_excess) > 100 * clean


# -- rloo + reinforce ------------------------------------------------------------------------------


def test_rloo_reinforce_by_hand():
    obj = objective({"advantage": {"estimator": "rloo"}, "policy_loss": {"kind": "reinforce", "entropy_coef": 0.0}})
    # Group 0: 1, 0, 0 -> 1 - 0 = 1, 0 - 0.5 = -0.5, -0.5; group 1 has one sample -> 0.
    rewards, groups = t([1.0, 0.0, 0.0, 5.0]), ids([0, 0, 0, 1])
    mask = t([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    old = torch.full((4, 3), -2.0, dtype=torch.float64)
    advantages = obj.advantages(rewards, groups, mask, old).advantages
    close(advantages, [[1, 1, 1], [-0.5, 0, 0], [-0.5, -0.5, 0], [0, 0, 0]])
    lp = (old + 0.7).requires_grad_(True)  # reinforce ignores pi_old
    loss, stats = obj.policy_loss(lp, torch.zeros_like(lp), old, old, advantages, mask, norm_of(mask))
    # token_mean of -A over 9 tokens: (-3 + 0.5 + 1.0 + 0) / 9
    assert float(loss.detach()) == pytest.approx(-1.5 / 9)
    close(grad(loss, lp), [[-1 / 9] * 3, [0.5 / 9, 0, 0], [0.5 / 9, 0.5 / 9, 0], [0, 0, 0]])
    assert stats.sums["clip_fraction"] == 0
    assert stats.maxes["ratio"] == 1.0 and stats.mins["ratio"] == 1.0


# -- reinforce_pp with the KL in the reward --------------------------------------------------------


def test_reinforce_pp_with_kl_reward_by_hand():
    obj = objective(
        {
            "advantage": {"estimator": "reinforce_pp", "gamma": 0.5},
            "kl": {"coef": 0.1, "estimator": "k1", "placement": "reward"},
        }
    )
    rewards, groups = t([1.0, 0.0]), ids([0, 0])
    mask = t([[1, 1], [1, 0]])
    ref = torch.full((2, 2), -1.0, dtype=torch.float64)
    old = ref + t([[0.2, -0.1], [0.3, 5.0]])  # k1 = log pi_old - log pi_ref
    # penalty -0.1 * k1: (-0.02, +0.01), (-0.03, masked)
    # token rewards: sample 0 (-0.02, 1 + 0.01); sample 1: (0 - 0.03) on its only token
    # returns (gamma 0.5): sample 0: G1 = 1.01, G0 = -0.02 + 0.5 * 1.01 = 0.485; sample 1: -0.03
    w = whiten([0.485, 1.01, -0.03])
    out = obj.advantages(rewards, groups, mask, old, ref_logprobs=ref)
    close(out.advantages, [[w[0], w[1]], [w[2], 0.0]])


def test_kl_in_the_reward_is_not_added_to_the_loss():
    obj = objective(
        {"kl": {"coef": 0.1, "estimator": "k1", "placement": "reward"}, "policy_loss": {"entropy_coef": 0.0}}
    )
    lp = t([[-1.0, -1.0]])
    mask = t([[1, 1]])
    loss, stats = obj.policy_loss(
        lp, torch.zeros_like(lp), lp, lp, t([[1.0, 3.0]]), mask, norm_of(mask), ref_logprobs=lp - 0.4
    )
    assert float(loss) == pytest.approx(-2.0)  # token_mean of -A only
    assert stats.sums["kl_ref"] == pytest.approx(0.8)  # still reported: k1 = 0.4 on two tokens


def test_grpo_with_kl_reward_subtracts_the_summed_penalty_from_the_outcome():
    obj = objective(
        {"advantage": {"normalize_std": False}, "kl": {"coef": 0.5, "estimator": "k1", "placement": "reward"}}
    )
    # rewards 1, 1; sample 0's k1 sums to 0.4 + 0.2 = 0.6, sample 1's to 0 -> shaped 0.7, 1.0;
    # Dr. GRPO: mean 0.85 -> -0.15, +0.15.
    ref = torch.zeros(2, 2, dtype=torch.float64)
    old = t([[0.4, 0.2], [0.0, 9.0]])
    out = obj.advantages(t([1.0, 1.0]), ids([3, 3]), t([[1, 1], [1, 0]]), old, ref_logprobs=ref)
    close(out.advantages, [[-0.15, -0.15], [0.15, 0.0]])


def test_remax_with_kl_reward_gives_each_token_its_reward_to_go():
    # ReMax with the k1 penalty in the reward: A_it = R_i - b_i - beta * sum over t' >= t of k1_it'
    # (the outcome sits on the last token; earlier tokens' penalties are not this token's doing).
    # Sample 1's greedy reward failed (NaN): its group's mean reward (its own, 0) stands in.
    obj = objective(
        {
            "advantage": {"estimator": "remax"},
            "policy_loss": {"kind": "reinforce"},
            "kl": {"coef": 0.1, "estimator": "k1", "placement": "reward"},
        }
    )
    rewards, baselines, groups = [1.0, 0.0], [0.5, math.nan], ids([0, 1])
    used = [0.5, 0.0]  # sample 1's NaN: its group's mean reward
    mask = [[1, 1, 1], [1, 0, 1]]
    k1 = [[0.2, -0.1, 0.3], [0.4, 9.0, -0.2]]
    ref = torch.full((2, 3), -1.0, dtype=torch.float64)
    to_go = [[sum(k1[i][u] * mask[i][u] for u in range(tt, 3)) for tt in range(3)] for i in range(2)]
    expected = [[(rewards[i] - used[i] - 0.1 * to_go[i][tt]) * mask[i][tt] for tt in range(3)] for i in range(2)]
    out = obj.advantages(t(rewards), groups, t(mask), ref + t(k1), ref_logprobs=ref, baselines=t(baselines))
    close(out.advantages, expected)


# -- reinforce_pp_baseline -------------------------------------------------------------------------


def test_reinforce_pp_baseline_by_hand():
    obj = objective({"advantage": {"estimator": "reinforce_pp_baseline", "gamma": 1.0}})
    # Group 0: 1, 0, 0 -> minus mean 1/3: 2/3, -1/3, -1/3. Group 1: 1, 1 -> 0, 0.
    rewards, groups = t([1.0, 0.0, 0.0, 1.0, 1.0]), ids([0, 0, 0, 1, 1])
    mask = t([[1, 1], [1, 0], [0, 1], [1, 1], [1, 0]])
    # returns (gamma 1) on the loss tokens: 2/3, 2/3 | -1/3 | -1/3 | 0, 0 | 0; whitened over all seven
    w = whiten([2 / 3, 2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0])
    out = obj.advantages(rewards, groups, mask, torch.zeros(5, 2, dtype=torch.float64))
    close(out.advantages, [[w[0], w[1]], [w[2], 0.0], [0.0, w[3]], [w[4], w[5]], [w[6], 0.0]])


# -- gae with a critic -----------------------------------------------------------------------------


def gae_case():
    # Sample 0: three tokens, reward 1, V = 0.5, 0.2, 0.4; sample 1: one token (position 1), reward -1, V 0.3.
    rewards, groups = t([1.0, -1.0]), ids([0, 0])
    mask = t([[1, 1, 1], [0, 1, 0]])
    values = t([[0.5, 0.2, 0.4], [7.0, 0.3, 7.0]])
    return rewards, groups, mask, values


def test_gae_advantages_and_returns_by_hand():
    obj = objective({"advantage": {"estimator": "gae", "gamma": 0.9, "lam": 0.8, "whiten": False}})
    assert obj.needs_critic
    rewards, groups, mask, values = gae_case()
    out = obj.advantages(rewards, groups, mask, torch.zeros(2, 3, dtype=torch.float64), values=values)
    # sample 0: A2 = 1 - 0.4 = 0.6; A1 = 0.9*0.4 - 0.2 + 0.72*0.6 = 0.592; A0 = 0.9*0.2 - 0.5 + 0.72*0.592 = 0.10624
    # sample 1: A = -1 - 0.3 = -1.3. returns = A + V.
    close(out.advantages, [[0.10624, 0.592, 0.6], [0.0, -1.3, 0.0]])
    close(out.returns, [[0.60624, 0.792, 1.0], [0.0, -1.0, 0.0]])


def test_gae_whitened_advantages_keep_the_unwhitened_returns():
    obj = objective({"advantage": {"estimator": "gae", "gamma": 0.9, "lam": 0.8, "whiten": True}})
    rewards, groups, mask, values = gae_case()
    out = obj.advantages(rewards, groups, mask, torch.zeros(2, 3, dtype=torch.float64), values=values)
    w = whiten([0.10624, 0.592, 0.6, -1.3])
    close(out.advantages, [[w[0], w[1], w[2]], [0.0, w[3], 0.0]])
    close(out.returns, [[0.60624, 0.792, 1.0], [0.0, -1.0, 0.0]])


def test_critic_loss_by_hand():
    obj = objective({"advantage": {"estimator": "gae"}, "critic": {"value_clip": 0.5}})
    _, _, mask, old_values = gae_case()
    returns = t([[0.60624, 0.792, 1.0], [0.0, -1.0, 0.0]])
    v = t([[0.6, 0.2, 0.2], [7.0, 0.9, 7.0]]).requires_grad_(True)
    loss, stats = obj.critic_loss(v, old_values, returns, mask, norm_of(mask))
    # (0,0) V 0.6 R 0.60624: 0.5 * 0.00624^2; (0,1) V 0.2 R 0.792: 0.5 * 0.592^2;
    # (0,2) V 0.2 (moved -0.2, inside the clip) R 1: 0.5 * 0.8^2;
    # (1,1) V 0.9 (moved 0.6 -> clipped 0.8) R -1: max(1.9^2, 1.8^2) -> 0.5 * 1.9^2. token_mean over 4.
    expected = 0.5 * (0.00624**2 + 0.592**2 + 0.8**2 + 1.9**2) / 4
    assert float(loss.detach()) == pytest.approx(expected)
    # gradient (V - R) / 4 on each (the unclipped branch wins everywhere)
    close(grad(loss, v), [[-0.00624 / 4, -0.592 / 4, -0.8 / 4], [0.0, 1.9 / 4, 0.0]])
    assert stats.sums["value_mean"] == pytest.approx(0.6 + 0.2 + 0.2 + 0.9)
    assert stats.sums["return_mean"] == pytest.approx(0.60624 + 0.792 + 1.0 - 1.0)
    assert stats.sums["value_loss"] == pytest.approx(expected * 4)
    assert stats.sums["value_clip_fraction"] == 0  # (1,1) was clipped, but the unclipped branch is larger


def test_critic_loss_aggregation_and_value_clip_fraction():
    obj = objective({"advantage": {"estimator": "gae"}, "critic": {"value_clip": 0.5, "loss_aggregation": "token_sum"}})
    _, _, mask, old_values = gae_case()
    returns = t([[0.60624, 0.792, 1.0], [0.0, 3.0, 0.0]])
    v = t([[0.6, 0.2, 0.2], [7.0, 0.9, 7.0]])
    loss, stats = obj.critic_loss(v, old_values, returns, mask, norm_of(mask))
    # (1,1): V 0.9 moved 0.6 from V_old 0.3, clipped to 0.8: (0.8 - 3)^2 = 4.84 > (0.9 - 3)^2 = 4.41.
    expected = 0.5 * (0.00624**2 + 0.592**2 + 0.8**2 + 2.2**2)  # token_sum: no division
    assert float(loss) == pytest.approx(expected)
    assert stats.sums["value_clip_fraction"] == 1


# -- on-policy distillation ------------------------------------------------------------------------


def test_distillation_advantages_and_loss_by_hand():
    obj = objective(
        {"advantage": {"estimator": "distill"}, "teacher": {"path": "teacher"}, "policy_loss": {"entropy_coef": 0.0}}
    )
    assert obj.needs_teacher and not obj.needs_reference
    student = t([[-1.5, -1.0, -3.0], [-0.2, -9.0, -9.0]])
    teacher = t([[-1.0, -2.0, -0.1], [-0.7, -1.0, -1.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # teacher - student: 0.5, -1.0 | -0.5; the outcome reward plays no part
    out = obj.advantages(t([100.0, -100.0]), ids([0, 0]), mask, student, teacher_logprobs=teacher)
    close(out.advantages, [[0.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    lp = student.clone().requires_grad_(True)
    loss, _ = obj.policy_loss(lp, torch.zeros_like(lp), student, student, out.advantages, mask, norm_of(mask))
    # PPO at r = 1: token_mean of -A = (-0.5 + 1.0 + 0.5) / 3
    assert float(loss.detach()) == pytest.approx(1.0 / 3)
    close(grad(loss, lp), [[-0.5 / 3, 1 / 3, 0], [0.5 / 3, 0, 0]])


# -- Dr. GRPO --------------------------------------------------------------------------------------


def dr_grpo_case():
    # rewards 1, 0, 0 in one group; sample 2 produced no token (its reward still counts).
    # Dr. GRPO: minus mean 1/3 -> 2/3, -1/3, -1/3; per token 2/3 x3 | -1/3 | nothing.
    rewards, groups = t([1.0, 0.0, 0.0]), ids([0, 0, 0])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    return rewards, groups, mask


def test_dr_grpo_seq_mean_token_sum_norm_by_hand():
    cfg = {
        "advantage": {"estimator": "grpo", "normalize_std": False},
        "policy_loss": {"aggregation": "seq_mean_token_sum_norm", "entropy_coef": 0.0},
    }
    obj = objective(cfg, max_new_tokens=4)
    rewards, groups, mask = dr_grpo_case()
    old = torch.full((3, 4), -1.0, dtype=torch.float64)
    advantages = obj.advantages(rewards, groups, mask, old).advantages
    close(advantages, [[2 / 3, 2 / 3, 2 / 3, 0], [-1 / 3, 0, 0, 0], [0, 0, 0, 0]])
    lp = old.clone().requires_grad_(True)
    norm = norm_of(mask)
    assert (norm.tokens, norm.sequences) == (4.0, 2.0)  # the empty sample is not a sequence
    loss, _ = obj.policy_loss(lp, torch.zeros_like(lp), old, old, advantages, mask, norm)
    # sum of -A = -2 + 1/3 = -5/3, divided by N * L = 2 * 4 (L = max_new_tokens)
    assert float(loss.detach()) == pytest.approx(-5 / 3 / 8)
    close(grad(loss, lp), [[-2 / 3 / 8] * 3 + [0], [1 / 3 / 8, 0, 0, 0], [0, 0, 0, 0]])
    # an explicit constant replaces max_new_tokens
    cfg["policy_loss"]["aggregation_constant"] = 10
    loss10, _ = objective(cfg, max_new_tokens=4).policy_loss(lp, torch.zeros_like(lp), old, old, advantages, mask, norm)
    assert float(loss10.detach()) == pytest.approx(-5 / 3 / 20)


# -- metrics: one definition of clip_fraction and ratio for every loss -----------------------------


def test_gmpo_metrics_use_the_ppo_definitions():
    # Bounds +-0.4 in log space. A token counts as clipped when its advantage is non-zero and its
    # log-ratio x lies beyond the bound where the clip removes its gradient (x > 0.4 for A > 0,
    # x < -0.4 for A < 0); the ratio reported is the unclipped geometric mean exp(mean_t x).
    obj = objective({"policy_loss": {"kind": "gmpo", "clip_low": 0.4, "clip_high": 0.4, "entropy_coef": 0.0}})
    x = [[0.7, -0.7], [0.6, 0.2], [-0.6, 0.3]]
    a = [[0.0, 0.0], [1.0, 1.0], [-1.0, -1.0]]
    old = torch.full((3, 2), -1.0, dtype=torch.float64)
    mask = torch.ones(3, 2, dtype=torch.float64)
    _, stats = obj.policy_loss(old + t(x), torch.zeros_like(old), old, old, t(a), mask, norm_of(mask))
    clipped = sum(
        (ai > 0 and xi > 0.4) or (ai < 0 and xi < -0.4)
        for xr, ar in zip(x, a, strict=True)
        for xi, ai in zip(xr, ar, strict=True)
    )
    assert clipped == 2 and stats.sums["clip_fraction"] == clipped
    ratios = [math.exp(sum(row) / 2) for row in x]  # 1 for the zero-advantage row, not 1.15
    assert stats.sums["ratio_mean"] == pytest.approx(2 * sum(ratios))
    assert stats.maxes["ratio"] == pytest.approx(max(ratios)) and stats.mins["ratio"] == pytest.approx(min(ratios))


@pytest.mark.parametrize("kind", ["ppo", "gspo", "gmpo", "sapo", "cispo", "m2po"])
def test_zero_advantage_tokens_never_count_as_clipped(kind):
    # log r = 1, -1, 2 is outside every loss's band (default clips, m2po_tau 0.04); with A = 0 the
    # tokens have no policy gradient to clip, with A = 1 some of them are clipped.
    obj = objective({"policy_loss": {"kind": kind}})
    old = t([[-1.0, -1.0, -1.0]])
    lp, mask = old + t([[1.0, -1.0, 2.0]]), t([[1, 1, 1]])

    def clip_fraction(a):
        _, stats = obj.policy_loss(lp, torch.zeros_like(lp), old, old, t([[a] * 3]), mask, norm_of(mask))
        return stats.sums["clip_fraction"]

    assert clip_fraction(0.0) == 0 and clip_fraction(1.0) > 0


# -- off-policy corrections ------------------------------------------------------------------------


def test_tis_weight_multiplies_only_the_policy_term():
    # w = pi_old / pi_rollout = 0.5, 3.0 -> tis (cap 2) weights 0.5, 2.0. PPO at r = 1, A = 1: -1 per token.
    # entropy bonus -0.1 * 2 and KL k1 0.2 * 0.5 are not weighted: per token -w - 0.2 + 0.1.
    obj = objective(
        {
            "off_policy": {"correction": "tis", "is_cap": 2.0},
            "policy_loss": {"entropy_coef": 0.1},
            "kl": {"coef": 0.2, "estimator": "k1"},
        }
    )
    old = t([[-1.0, -1.0]])
    rollout = old - t([[math.log(0.5), math.log(3.0)]])
    mask = t([[1, 1]])
    loss, stats = obj.policy_loss(
        old.clone(), t([[2.0, 2.0]]), old, rollout, t([[1.0, 1.0]]), mask, norm_of(mask), ref_logprobs=old - 0.5
    )
    assert float(loss) == pytest.approx((-0.5 - 2.0 - 2 * 0.1) / 2)
    assert stats.sums["pg_loss"] == pytest.approx(-2.5)
    assert stats.sums["is_weight_mean"] == pytest.approx(2.5)
    assert stats.sums["is_dropped_fraction"] == 0
    assert stats.maxes["rollout_mismatch"] == pytest.approx(3.0)
    assert stats.mins["rollout_mismatch"] == pytest.approx(0.5)


def test_icepop_drops_out_of_band_tokens_and_reports_them():
    # w = 0.4, 1.5, 3.0 -> icepop [0.5, 2]: 0, 1.5, 0. PPO at r = 1 with A = 1: loss -1.5 / 3.
    obj = objective({"off_policy": {"correction": "icepop"}, "policy_loss": {"entropy_coef": 0.0}})
    old = t([[-1.0, -1.0, -1.0]])
    rollout = old - t([[math.log(0.4), math.log(1.5), math.log(3.0)]])
    mask = t([[1, 1, 1]])
    loss, stats = obj.policy_loss(old.clone(), torch.zeros_like(old), old, rollout, t([[1.0] * 3]), mask, norm_of(mask))
    assert float(loss) == pytest.approx(-1.5 / 3)
    assert stats.sums["is_dropped_fraction"] == 2
    assert stats.sums["is_weight_mean"] == pytest.approx(1.5)


def mis_config(correction, rejects, aggregation="token_mean"):
    return {
        "off_policy": {"correction": correction, "mis_rejects": rejects},
        "policy_loss": {"entropy_coef": 0.1, "aggregation": aggregation},
        "kl": {"coef": 0.2, "estimator": "k1"},
    }


def mis_case():
    """Two samples of two tokens, on-policy (r = 1) with w = pi_old / pi_rollout given per token."""
    old = torch.full((2, 2), -1.0, dtype=torch.float64)
    lp = old.clone().requires_grad_(True)
    w = t([[1.0, 3.0], [0.4, 1.5]])
    ref, entropy, adv = old - 0.3, t([[0.5, 1.0], [1.5, 2.0]]), t([[1.0, 1.0], [-2.0, -2.0]])
    return old, lp, old - torch.log(w), ref, entropy, adv, torch.ones(2, 2, dtype=torch.float64)


def by_hand(lp, old, ref, entropy, adv, policy_kept, rest_kept, per_sample):
    """The configured per-token loss written out, -A r on the kept policy terms, -0.1 H + 0.2 k1 on
    the kept others, aggregated by `per_sample` (a function of the [n, T] terms)."""
    terms = -adv * torch.exp(lp - old) * policy_kept + (-0.1 * entropy + 0.2 * (lp - ref)) * rest_kept
    return per_sample(terms)


@pytest.mark.parametrize("rejects", ["policy_term", "token"])
def test_mis_rejected_tokens_lose_the_policy_term_or_the_whole_token(rejects):
    # mis, band [0.5, 2]: tokens (0, 1) (w = 3) and (1, 0) (w = 0.4) are rejected. token_mean over
    # the 4 tokens (policy_term) or over the 2 kept ones (token).
    old, lp, rollout, ref, entropy, adv, mask = mis_case()
    kept = t([[1, 0], [0, 1]])
    rest, tokens = (mask, 4.0) if rejects == "policy_term" else (kept, 2.0)
    expected = by_hand(lp, old, ref, entropy, adv, kept, rest, lambda x: x.sum() / tokens)
    loss, stats = objective(mis_config("mis", rejects)).policy_loss(
        lp, entropy, old, rollout, adv, mask, norm_of(mask), ref
    )
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad(loss, lp), grad(expected, lp))
    assert stats.sums["is_dropped_fraction"] == 2 and stats.sums["tokens"] == 4


@pytest.mark.parametrize("rejects", ["policy_term", "token"])
def test_seq_mis_with_token_rejects_leaves_the_sequence_count(rejects):
    # seq_mis: w_0 = 1 * 3 = 3 is out of [0.5, 2], w_1 = 0.4 * 1.5 = 0.6 is in: sample 0 is rejected.
    # seq_mean_token_mean: (1/N) sum_i mean_t, N = 2 (policy_term) or 1 (token: sample 0 is gone).
    old, lp, rollout, ref, entropy, adv, mask = mis_case()
    kept = t([[0, 0], [1, 1]])
    rest, n = (mask, 2.0) if rejects == "policy_term" else (kept, 1.0)
    expected = by_hand(lp, old, ref, entropy, adv, kept, rest, lambda x: (x.sum(-1) / 2).sum() / n)
    cfg = mis_config("seq_mis", rejects, aggregation="seq_mean_token_mean")
    loss, _ = objective(cfg).policy_loss(lp, entropy, old, rollout, adv, mask, norm_of(mask), ref)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad(loss, lp), grad(expected, lp))


def test_mis_token_rejects_sum_the_rejected_counts_over_ranks():
    # Rank 0 holds sample 0 (one rejected token), rank 1 sample 1 (one rejected); each divides by
    # the global count of kept tokens, so the two shares add up to the one-process loss.
    old, lp, rollout, ref, entropy, adv, mask = mis_case()
    algo = JobConfig.model_validate({"algo": mis_config("mis", "token"), "rollout": {"max_new_tokens": 4}}).algo
    whole, _ = Objective(algo).policy_loss(lp, entropy, old, rollout, adv, mask, norm_of(mask), ref)

    def share(rows, comm):
        obj = Objective(algo, comm)
        return obj.policy_loss(
            lp[rows], entropy[rows], old[rows], rollout[rows], adv[rows], mask[rows], norm_of(mask), ref[rows]
        )[0]

    first, second = TwoRankGroup().run(share, ([0],), ([1],))
    torch.testing.assert_close(first + second, whole)


def test_the_plain_k1_kls_are_among_the_statistics():
    # log r = log pi - log pi_old = 0.2, -0.4 -> kl_k1 = mean(-log r) = 0.1; against the reference
    # (log pi - log pi_ref = 0.5, -0.1) kl_ref_k1 = 0.2.
    obj = objective({"kl": {"coef": 0.1}})
    old = t([[-1.0, -1.0]])
    lp = old + t([[0.2, -0.4]])
    ref = lp - t([[0.5, -0.1]])
    mask = t([[1, 1]])
    _, stats = obj.policy_loss(lp, torch.zeros_like(lp), old, old, t([[1.0, 1.0]]), mask, norm_of(mask), ref)
    assert stats.sums["kl_k1"] / stats.sums["tokens"] == pytest.approx(0.1)
    assert stats.sums["kl_ref_k1"] / stats.sums["tokens"] == pytest.approx(0.2)


def test_which_log_probabilities_the_ratio_uses():
    assert objective({}, max_staleness=1).old_is_rollout  # auto, stale, no correction: rollout
    assert not objective({}, max_staleness=0).old_is_rollout
    assert not objective({"off_policy": {"correction": "tis"}}, max_staleness=1).old_is_rollout
    assert not objective({"off_policy": {"old_logprobs": "recompute"}}, max_staleness=1).old_is_rollout
    assert objective({"off_policy": {"old_logprobs": "rollout"}}, max_staleness=0).old_is_rollout


# -- edge cases and gradient checks across configs -------------------------------------------------

CONFIGS = {
    "grpo_ppo_kl_loss": {"kl": {"coef": 0.1, "estimator": "k3"}},
    "ppo_dual_clip_higher": {"policy_loss": {"clip_high": 0.28, "dual_clip": 3.0}},
    "gspo_seq_mean": {
        "policy_loss": {"kind": "gspo", "clip_low": 0.2, "clip_high": 0.2, "aggregation": "seq_mean_token_mean"}
    },
    "sapo_tis": {"policy_loss": {"kind": "sapo"}, "off_policy": {"correction": "tis"}},
    "m2po_token_sum": {"policy_loss": {"kind": "m2po", "aggregation": "seq_mean_token_sum"}},
    "gmpo_seq_mis": {
        "policy_loss": {"kind": "gmpo", "clip_low": 0.4, "clip_high": 0.4, "aggregation": "seq_mean_token_mean"},
        "off_policy": {"correction": "seq_mis", "icepop_low": 0.1, "icepop_high": 10.0},
    },
    # (a straight-through KL estimator's gradient is by design not its value's: tested by hand)
    "token_sum_seq_tis": {"policy_loss": {"aggregation": "token_sum"}, "off_policy": {"correction": "seq_tis"}},
    "dr_grpo_norm": {
        "advantage": {"normalize_std": False},
        "policy_loss": {"aggregation": "seq_mean_token_sum_norm"},
        "kl": {"coef": 0.05, "estimator": "k2"},
    },
}


def random_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 5, dtype=torch.float64, generator=g) - 0.5
    log_r = (torch.rand(4, 5, dtype=torch.float64, generator=g) - 0.5) * 0.2
    log_r[0, 1], log_r[2, 3] = 0.6, -0.7  # far outside any clip range: no kink nearby
    lp = (old + log_r).requires_grad_(True)
    rollout = old + (torch.rand(4, 5, dtype=torch.float64, generator=g) - 0.5) * 0.4
    ref = old + (torch.rand(4, 5, dtype=torch.float64, generator=g) - 0.5) * 0.4
    entropy = torch.rand(4, 5, dtype=torch.float64, generator=g)
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    return lp, old, rollout, ref, entropy, mask


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_policy_loss_gradcheck(name):
    obj = objective(CONFIGS[name])
    lp, old, rollout, ref, entropy, mask = random_batch()
    advantages = obj.advantages(t([1.0, 0.0, 0.5, 2.0]), ids([0, 0, 1, 1]), mask, old).advantages
    norm = norm_of(mask)
    assert torch.autograd.gradcheck(
        lambda x: obj.policy_loss(x, entropy, old, rollout, advantages, mask, norm, ref_logprobs=ref)[0], (lp,)
    )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fully_masked_batch_gives_zero_loss_and_finite_gradient(name):
    obj = objective(CONFIGS[name])
    lp, old, rollout, ref, entropy, _ = random_batch()
    mask = torch.zeros(4, 5, dtype=torch.float64)
    advantages = obj.advantages(t([1.0, 0.0, 0.5, 2.0]), ids([0, 0, 1, 1]), mask, old).advantages
    assert not advantages.any()
    loss, stats = obj.policy_loss(lp, entropy, old, rollout, advantages, mask, norm_of(mask), ref_logprobs=ref)
    g = grad(loss, lp)
    assert float(loss.detach()) == 0.0 and torch.isfinite(g).all() and not g.any()
    assert stats.sums["tokens"] == 0
    # extrema without tokens are registered as the identities of max and min (every rank reports a name)
    assert stats.maxes["ratio"] == -math.inf and stats.mins["ratio"] == math.inf


def test_stats_keys():
    obj = objective({"off_policy": {"correction": "decoupled"}, "kl": {"coef": 0.1}})
    lp, old, rollout, ref, entropy, mask = random_batch()
    _, stats = obj.policy_loss(lp, entropy, old, rollout, torch.ones_like(lp), mask, norm_of(mask), ref_logprobs=ref)
    for key in (
        "tokens",
        "pg_loss",
        "entropy",
        "clip_fraction",
        "approx_kl",
        "ratio_mean",
        "advantage_mean",
        "advantage_abs_mean",
        "rollout_mismatch_mean",
        "is_weight_mean",
        "is_dropped_fraction",
        "kl_ref",
    ):
        assert key in stats.sums, key
    for key in ("ratio", "advantage", "rollout_mismatch"):
        assert key in stats.maxes and key in stats.mins, key


def test_stats_add_sums_and_keeps_extrema():
    a, b = Stats(), Stats()
    a.mean_of("x", t([[1.0, 2.0]]), t([[1, 1]]))
    a.range_of("x", t([[1.0, 2.0]]), t([[1, 1]]))
    b.mean_of("x", t([[5.0, 9.0]]), t([[1, 0]]))
    b.range_of("x", t([[5.0, 9.0]]), t([[1, 0]]))  # 9 is masked out
    b.range_of("y", t([[5.0]]), t([[0]]))  # no loss token: registered as -inf / +inf
    a.add(b)
    assert a.sums == {"x": 8.0}  # 1 + 2 + 5
    assert a.maxes == {"x": 5.0, "y": -math.inf} and a.mins == {"x": 1.0, "y": math.inf}
    c = Stats()
    c.range_of("y", t([[-3.0, 4.0]]), t([[1, 1]]))
    a.add(c)  # a rank without tokens does not mask another rank's extrema
    assert a.maxes["y"] == 4.0 and a.mins["y"] == -3.0
