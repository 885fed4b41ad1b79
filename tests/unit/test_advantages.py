"""Advantage estimators and rollout-side reward shaping against values worked out by hand.

Every expected value is computed in the comments from the estimator's definition (the papers
cited in relax_hpc/algos/advantages.py and shaping.py), never by calling the implementation.
"""

import math
import statistics

import pytest
import torch

from relax_hpc.algos import advantages as adv
from relax_hpc.algos.shaping import informative, overlong_penalty
from tests.unit.algo_helpers import TwoRankGroup, close, ids, t

torch.set_num_threads(1)


# -- GRPO / Dr. GRPO -------------------------------------------------------------------------------


def test_grpo_by_hand_with_unbiased_std():
    # Group 7: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = sqrt(1/3).
    # Group 3: rewards 0, 0, 1 -> mean 1/3, unbiased std sqrt((1/9 + 1/9 + 4/9) / 2) = sqrt(1/3).
    rewards = t([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    groups = ids([7, 7, 7, 7, 3, 3, 3])
    s = math.sqrt(1 / 3)
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, -1 / 3 / s, -1 / 3 / s, 2 / 3 / s]
    assert adv.grpo(rewards, groups, normalize_std=True, eps=0.0).tolist() == pytest.approx(expected, rel=1e-12)


def test_grpo_adds_eps_to_the_std():
    # rewards 3, 1 -> mean 2, centred +-1, unbiased std sqrt(2 / 1); eps = 0.5 is added to the std.
    out = adv.grpo(t([3.0, 1.0]), ids([0, 0]), eps=0.5, normalize_std=True)
    assert out.tolist() == pytest.approx([1 / (math.sqrt(2) + 0.5), -1 / (math.sqrt(2) + 0.5)])


def test_grpo_groups_may_be_interleaved_and_use_any_integers():
    # group -4: rewards 2, 0 -> centred +1, -1, std sqrt(2); group 11: rewards 5, 1 -> +2, -2, std sqrt(8).
    out = adv.grpo(t([2.0, 5.0, 0.0, 1.0]), ids([-4, 11, -4, 11]), eps=0.0, normalize_std=True)
    assert out.tolist() == pytest.approx([1 / math.sqrt(2), 2 / math.sqrt(8), -1 / math.sqrt(2), -2 / math.sqrt(8)])


def test_dr_grpo_only_centres():
    # Dr. GRPO: r - mean, mean of 2, 0, 1 is 1.
    assert adv.grpo(t([2.0, 0.0, 1.0]), ids([0, 0, 0]), normalize_std=False, eps=1e-6).tolist() == pytest.approx(
        [1.0, -1.0, 0.0]
    )


@pytest.mark.parametrize("value, size, eps", [(0.7, 3, 1e-6), (0.9, 3, 1e-6), (1.3, 6, 1e-6), (0.7, 3, 0.0)])
def test_grpo_all_equal_group_gets_zero_advantage(value, size, eps):
    # value - mean(value, ..., value) = 0 and so is the std: nothing to learn from this group, with or
    # without eps (config: "all-equal groups get 0"). float32 rewards, as the trainer builds them.
    rewards = torch.tensor([value] * size + [1.0, 0.0])
    out = adv.grpo(rewards, ids([0] * size + [1, 1]), eps=eps, normalize_std=True)
    assert torch.isfinite(out).all()
    assert out[:size].tolist() == pytest.approx([0.0] * size, abs=1e-6)


@pytest.mark.parametrize("value, size", [(0.7, 3), (0.9, 3), (1.3, 6)])
def test_dr_grpo_and_rloo_all_equal_group_get_zero_advantage(value, size):
    rewards, groups = torch.tensor([value] * size), ids([0] * size)
    assert adv.grpo(rewards, groups, normalize_std=False, eps=1e-6).tolist() == pytest.approx([0.0] * size, abs=1e-6)
    assert adv.rloo(rewards, groups).tolist() == pytest.approx([0.0] * size, abs=1e-6)


def test_group_of_one_gets_zero_advantage_in_every_estimator():
    rewards = t([0.5, 1.0, 0.0])
    groups = ids([9, 1, 1])  # group 9 has one sample: no baseline
    assert adv.grpo(rewards, groups, normalize_std=True, eps=1e-6)[0] == 0.0
    assert adv.grpo(rewards, groups, normalize_std=False, eps=1e-6)[0] == 0.0
    assert adv.rloo(rewards, groups)[0] == 0.0


def test_empty_completion_counts_in_group_statistics_but_gets_no_tokens():
    # Group rewards 1, 0, 0; sample 1 produced no completion token but its reward 0 is real.
    # mean 1/3; centred 2/3, -1/3, -1/3; unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3.
    rewards = t([1.0, 0.0, 0.0])
    mask = t([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    per_sample = adv.grpo(rewards, ids([0, 0, 0]), eps=0.0, normalize_std=True)
    s = math.sqrt(1 / 3)
    assert per_sample.tolist() == pytest.approx([2 / 3 / s, -1 / 3 / s, -1 / 3 / s])
    close(adv.per_token(per_sample, mask), [[2 / 3 / s, 2 / 3 / s, 0], [0, 0, 0], [-1 / 3 / s, 0, 0]])


# -- RLOO ------------------------------------------------------------------------------------------


def test_rloo_by_hand():
    # group 0 (1, 0, 0, 1): sample 0 -> 1 - (0 + 0 + 1) / 3 = 2/3; sample 1 -> 0 - (1 + 0 + 1) / 3 = -2/3.
    # group 5 (3, 1): 3 - 1 = 2 and 1 - 3 = -2.
    out = adv.rloo(t([1.0, 0.0, 0.0, 1.0, 3.0, 1.0]), ids([0, 0, 0, 0, 5, 5]))
    assert out.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2.0])


def test_remax_subtracts_the_greedy_baseline_or_the_group_mean_where_it_failed():
    # group 0 (1, 0, 1), greedy reward 1: 0, -1, 0. group 4 (0.5, 1.5), greedy failed (NaN): the
    # group mean 1 stands in: -0.5, 0.5. group 7, one sample 2 with greedy 0.5 (ReMax's own setting:
    # one sample per prompt): 1.5.
    nan = float("nan")
    out = adv.remax(t([1.0, 0.0, 1.0, 0.5, 1.5, 2.0]), t([1.0, 1.0, 1.0, nan, nan, 0.5]), ids([0, 0, 0, 4, 4, 7]))
    assert out.tolist() == pytest.approx([0.0, -1.0, 0.0, -0.5, 0.5, 1.5])


# -- token rewards and discounted returns (REINFORCE++) --------------------------------------------


def test_outcome_lands_on_the_last_completion_token():
    mask = t([[0, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1]])
    out = adv.outcome_on_last_token(t([2.0, -1.0, 5.0, 3.0]), mask)
    # row 1 has a gap: its last completion token is position 2; row 2 is empty: no reward anywhere.
    assert out.tolist() == [[0, 0, 2, 0], [0, 0, -1, 0], [0, 0, 0, 0], [0, 0, 0, 3]]


def test_discounted_returns_by_hand():
    # gamma 0.5, rewards 0, 0, 1: G2 = 1, G1 = 0 + 0.5 * 1 = 0.5, G0 = 0.25.
    out = adv.discounted_returns(t([[0, 0, 1.0]]), t([[1, 1, 1]]), gamma=0.5)
    close(out, [[0.25, 0.5, 1.0]])


def test_discounted_returns_skip_masked_gaps():
    # Completion positions 0, 1, 3 (position 2 is tool output, position 4 padding); gamma 0.5.
    # G3 = 2; G1 = 1 + 0.5 * G3 = 2 (one step to position 3, not two); G0 = 0.5 + 0.5 * G1 = 1.5.
    rewards = t([[0.5, 1.0, 0.0, 2.0, 0.0]])
    mask = t([[1, 1, 0, 1, 0]])
    close(adv.discounted_returns(rewards, mask, gamma=0.5), [[1.5, 2.0, 0.0, 2.0, 0.0]])


def test_discounted_returns_of_length_one_and_empty_completions():
    out = adv.discounted_returns(t([[0, 3.0, 0], [0, 0, 0]]), t([[0, 1, 0], [0, 0, 0]]), gamma=0.9)
    assert out.tolist() == [[0, 3.0, 0], [0, 0, 0]]


def _whiten(values):
    """Plain-Python (x - mean) / unbiased std."""
    m, s = statistics.mean(values), statistics.stdev(values)
    return [(v - m) / s for v in values]


def test_reinforce_pp_by_hand():
    # gamma 0.5; sample 0 has 3 tokens and reward 1, sample 1 has 2 tokens and reward -1.
    # returns: sample 0 (0.25, 0.5, 1), sample 1 (-0.5, -1).
    # mean of the five = 0.25 / 5 = 0.05; squared deviations 0.04, 0.2025, 0.9025, 0.3025, 1.1025
    # sum 2.55, unbiased var 2.55 / 4 = 0.6375.
    mask = t([[1, 1, 1], [1, 1, 0]])
    token_rewards = adv.outcome_on_last_token(t([1.0, -1.0]), mask)
    out = adv.reinforce_pp(token_rewards, mask, gamma=0.5)
    s = math.sqrt(0.6375)
    close(out, [[0.2 / s, 0.45 / s, 0.95 / s], [-0.55 / s, -1.05 / s, 0.0]])
    assert _whiten([0.25, 0.5, 1.0, -0.5, -1.0]) == pytest.approx([0.2 / s, 0.45 / s, 0.95 / s, -0.55 / s, -1.05 / s])


def test_masked_whiten_ignores_masked_entries_and_empty_rows():
    # Only 1, 2, 3 are in the mask: mean 2, unbiased std 1.
    x = t([[1.0, 100.0], [2.0, 3.0], [-50.0, 7.0]])
    mask = t([[1, 0], [1, 1], [0, 0]])
    close(adv.masked_whiten(x, mask), [[-1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])


@pytest.mark.parametrize("value, shape", [(0.9, (2, 3)), (0.8, (4, 3)), (2.2, (4, 3))])
def test_masked_whiten_of_a_constant_is_zero(value, shape):
    # x - mean(x) = 0 for a constant x, whatever the (zero) std: no signal, no advantage. float32.
    x = torch.full(shape, value)
    out = adv.masked_whiten(x, torch.ones(shape))
    assert out.abs().max().item() == pytest.approx(0.0, abs=1e-6)


def test_reinforce_pp_of_a_batch_with_equal_rewards_is_zero():
    # gamma 1: every token's return is the outcome 0.9, the same for all: whitened to 0 (float32 rewards).
    mask = torch.ones(2, 3)
    token_rewards = adv.outcome_on_last_token(torch.tensor([0.9, 0.9]), mask)
    out = adv.reinforce_pp(token_rewards, mask, gamma=1.0)
    assert out.abs().max().item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("base", [1.0, 10.0, 100.0])
def test_masked_whiten_is_shift_invariant_in_float32(base):
    # Whitening subtracts the mean, so base + d whitens like d. d: mean 0.0008333, stdev 0.014720.
    d = [0.01, -0.01, 0.02, -0.02, 0.0, 0.005]
    out = adv.masked_whiten(torch.tensor([[base + v for v in d]]), torch.ones(1, 6))
    close(out, [_whiten(d)], rel=1e-3, abs=1e-3)


def test_masked_whiten_of_an_empty_batch_is_zero():
    out = adv.masked_whiten(t([[1.0, 2.0]]), t([[0, 0]]))
    assert out.tolist() == [[0.0, 0.0]]


def test_masked_whiten_split_over_two_ranks_equals_one_process():
    torch.manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.float64)
    mask = (torch.rand(6, 5) > 0.3).double()
    mask[4] = 0  # an empty row on rank 1
    whole = adv.masked_whiten(x, mask)
    top, bottom = TwoRankGroup().run(adv.masked_whiten, (x[:3], mask[:3]), (x[3:], mask[3:]))
    assert torch.allclose(torch.cat([top, bottom]), whole, atol=1e-12)
    # and the single-process value is the plain whitening of the masked entries
    kept = x[mask > 0].tolist()
    assert whole[mask > 0].tolist() == pytest.approx(_whiten(kept), rel=1e-6)


# -- GAE -------------------------------------------------------------------------------------------


def test_gae_by_hand():
    # gamma 0.9, lambda 0.8, reward 1 on the last token, V = 0.5, 0.2, 0.4 (V after the end = 0).
    # delta2 = 1 + 0.9 * 0 - 0.4 = 0.6                     A2 = 0.6
    # delta1 = 0 + 0.9 * 0.4 - 0.2 = 0.16                  A1 = 0.16 + 0.72 * 0.6 = 0.592
    # delta0 = 0 + 0.9 * 0.2 - 0.5 = -0.32                 A0 = -0.32 + 0.72 * 0.592 = 0.10624
    # returns = A + V = 0.60624, 0.792, 1.0
    a, ret = adv.gae(t([[0, 0, 1.0]]), t([[0.5, 0.2, 0.4]]), t([[1, 1, 1]]), gamma=0.9, lam=0.8)
    close(a, [[0.10624, 0.592, 0.6]])
    close(ret, [[0.60624, 0.792, 1.0]])


def test_gae_lambda_one_is_monte_carlo_and_lambda_zero_is_td():
    rewards, values, mask = t([[0, 0, 1.0]]), t([[0.5, 0.2, 0.4]]), t([[1, 1, 1]])
    # lambda 1: A_t = G_t - V_t with G = 0.81, 0.9, 1 (gamma 0.9).
    a1, _ = adv.gae(rewards, values, mask, gamma=0.9, lam=1.0)
    close(a1, [[0.81 - 0.5, 0.9 - 0.2, 1.0 - 0.4]])
    # lambda 0: A_t = delta_t = -0.32, 0.16, 0.6.
    a0, _ = adv.gae(rewards, values, mask, gamma=0.9, lam=0.0)
    close(a0, [[-0.32, 0.16, 0.6]])


def test_gae_skips_masked_gaps():
    # Position 1 is masked (tool output): its value 99 is not a step. Positions 0 and 2 are adjacent.
    # delta2 = 1 - 0.4 = 0.6, A2 = 0.6; delta0 = 0.9 * 0.4 - 0.5 = -0.14, A0 = -0.14 + 0.72 * 0.6 = 0.292.
    a, ret = adv.gae(t([[0, 0, 1.0]]), t([[0.5, 99.0, 0.4]]), t([[1, 0, 1]]), gamma=0.9, lam=0.8)
    close(a, [[0.292, 0.0, 0.6]])
    close(ret, [[0.792, 0.0, 1.0]])


def test_gae_length_one_and_empty_completions():
    # One token: A = r - V = 2 - 0.5; an empty row gets nothing.
    a, ret = adv.gae(t([[0, 2.0, 0], [0, 0, 0]]), t([[7, 0.5, 7], [1, 1, 1]]), t([[0, 1, 0], [0, 0, 0]]), 0.9, 0.8)
    close(a, [[0, 1.5, 0], [0, 0, 0]])
    close(ret, [[0, 2.0, 0], [0, 0, 0]])


# -- on-policy distillation ------------------------------------------------------------------------


def test_distillation_advantage_is_teacher_minus_student():
    # log pi_T - log pi_S: -1 - (-1.5) = 0.5, -2 - (-1) = -1; masked position gets 0.
    student, teacher, mask = t([[-1.5, -1.0, -3.0]]), t([[-1.0, -2.0, -0.1]]), t([[1, 1, 0]])
    close(adv.distillation(student, teacher, mask), [[0.5, -1.0, 0.0]])


# -- DAPO shaping ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, expected",
    [
        (10, 0.0),  # well inside L - B = 15
        (15, 0.0),  # exactly L - B
        (16, -0.2),  # (15 - 16) / 5
        (18, -0.6),  # (15 - 18) / 5
        (20, -1.0),  # at the limit L
    ],
)
def test_overlong_penalty_by_hand(length, expected):
    # DAPO eq. (13): L_max = 20, L_cache = 5.
    assert overlong_penalty(length, max_len=20, buffer=5, penalty=1.0) == pytest.approx(expected)


def test_overlong_penalty_scales_and_switches_off():
    assert overlong_penalty(20, 20, 5, penalty=0.5) == pytest.approx(-0.5)
    assert overlong_penalty(18, 20, 4, penalty=2.0) == pytest.approx(-2.0 * 2 / 4)
    assert overlong_penalty(20, 20, buffer=0, penalty=1.0) == 0.0
    assert overlong_penalty(20, 20, buffer=5, penalty=0.0) == 0.0


def test_overlong_penalty_beyond_the_limit_is_the_full_penalty():
    # DAPO eq. (13): R_length(y) = -1 when |y| > L_max (the penalty never exceeds its full value).
    assert overlong_penalty(21, max_len=20, buffer=5, penalty=1.0) == pytest.approx(-1.0)


def test_informative_groups_are_those_whose_rewards_differ():
    assert informative([1.0, 0.0, 1.0])
    assert informative([0.5, 0.5, 0.25])
    assert not informative([1.0, 1.0, 1.0])
    assert not informative([0.0, 0.0])
    assert not informative([0.3])  # a group of one never has a nonzero advantage
