"""Policy losses (and the critic's value loss) against values and gradients worked out by hand.

r is the importance ratio pi / pi_old; the tests build log-probabilities as logs of chosen ratios so
that every expected number follows from the paper's formula in a line of arithmetic.
"""

import math

import pytest
import torch

from relax_hpc.algos import policy_losses as pl
from relax_hpc.algos.aggregation import Normalizer, aggregate
from relax_hpc.algos.value import value_loss
from tests.unit.algo_helpers import TwoRankGroup, close, t

torch.set_num_threads(1)


def leaf_logprobs(log_ratios, old=-1.0):
    """(logprobs as a leaf with grad, old logprobs) whose difference is `log_ratios`."""
    log_ratios = t(log_ratios)
    old_lp = torch.full_like(log_ratios, old)
    return (old_lp + log_ratios).requires_grad_(True), old_lp


def grad_of_sum(loss, logprobs):
    (g,) = torch.autograd.grad(loss.sum(), logprobs)
    return g


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


# -- GMPO ------------------------------------------------------------------------------------------


def test_gmpo_geometric_mean_of_log_clipped_ratios_by_hand():
    # eps 0.4 (log space). Sample 0, A = +1, log r = 0.2, 0.6, -0.6: the pessimistic side for A > 0
    # is min(l, clip(l)): 0.2, 0.4 (clipped: no gradient), -0.6 (below: kept) -> mean 0 -> R = 1,
    # loss -1 on each token; gradient of -A exp(mean m) in each unclipped log pi: -A R / 3 = -1/3.
    # Sample 1, A = -2, log r = 0.6, -0.6 (and a masked token): for A < 0 the pessimistic side is
    # max(l, clip(l)): 0.6 (kept), -0.4 (clipped) -> mean 0.1 -> R = e^0.1, loss 2 e^0.1;
    # gradient -A R / 2 = e^0.1 on the kept token.
    lp, old = leaf_logprobs([[0.2, 0.6, -0.6], [0.6, -0.6, 0.0]])
    a = t([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    terms = pl.gmpo(lp, old, a, mask, log_bounds=(-0.4, 0.4), log_ratio_clamp=20.0)
    r1 = math.exp(0.1)
    close(terms.loss, [[-1.0] * 3, [2 * r1] * 3])
    close(grad_of_sum(terms.loss * mask / mask.sum(-1, keepdim=True), lp), [[-1 / 3, 0.0, -1 / 3], [r1, 0.0, 0.0]])
    assert terms.clipped.tolist() == [[False, True, False], [False, True, False]]
    # The ratio reported is the unclipped geometric mean: exp((0.2 + 0.6 - 0.6) / 3) and exp((0.6 - 0.6) / 2).
    close(terms.ratio, [[math.exp(0.2 / 3)] * 3, [1.0] * 3])


def test_gmpo_is_the_paper_objective_under_seq_mean_token_mean():
    # The paper's loss: -(1/N) sum_i sign(A_i) prod_t |min(r_t A_i, clip(r_t, e^-0.4, e^0.4) A_i)|^(1/|o_i|).
    torch.manual_seed(0)
    lp = (torch.randn(3, 5, dtype=torch.float64) * 0.3).requires_grad_(True)
    old = torch.zeros(3, 5, dtype=torch.float64)
    adv = t([[1.5] * 5, [-0.5] * 5, [2.0] * 5])
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    terms = pl.gmpo(lp, old, adv, mask, log_bounds=(-0.4, 0.4), log_ratio_clamp=20.0)
    ours = aggregate(terms.loss, mask, "seq_mean_token_mean", Normalizer(9.0, 3.0))
    per_sample = []
    for i in range(3):
        n, sign = int(mask[i].sum()), math.copysign(1.0, float(adv[i, 0]))
        r = torch.exp(lp[i, :n] - old[i, :n])
        clipped = r.clamp(math.exp(-0.4), math.exp(0.4))
        inner = torch.minimum(r * adv[i, :n], clipped * adv[i, :n]).abs()
        per_sample.append(-sign * torch.prod(inner) ** (1 / n))
    paper = torch.stack(per_sample).mean()
    torch.testing.assert_close(ours, paper)
    g_ours, g_paper = (torch.autograd.grad(x, lp, retain_graph=True)[0] for x in (ours, paper))
    torch.testing.assert_close(g_ours, g_paper)


# -- PPO -------------------------------------------------------------------------------------------


def test_ppo_values_gradients_and_clip_flags_by_hand():
    # eps 0.2; per token (r, A):
    #   (1.6, +1): min(1.6, 1.2) = 1.2 -> loss -1.2, clipped, no gradient
    #   (1.1, +1): min(1.1, 1.1)       -> loss -1.1, d(-rA)/dlog pi = -rA = -1.1
    #   (0.7, -1): min(-0.7, -0.8) = -0.8 -> loss 0.8, clipped, no gradient
    #   (0.9, -1): min(-0.9, -0.9)     -> loss 0.9, gradient -rA = 0.9
    #   (0.7, +1): min(0.7, 0.8) = 0.7 -> loss -0.7, unclipped (pessimistic side), gradient -0.7
    #   (1.6, -1): min(-1.6, -1.2) = -1.6 -> loss 1.6, unclipped, gradient 1.6
    r = [1.6, 1.1, 0.7, 0.9, 0.7, 1.6]
    lp, old = leaf_logprobs([[math.log(x) for x in r]])
    a = t([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0]])
    terms = pl.ppo(lp, old, a, clip_low=0.2, clip_high=0.2, dual_clip=None, log_ratio_clamp=20.0)
    close(terms.loss, [[-1.2, -1.1, 0.8, 0.9, -0.7, 1.6]])
    close(grad_of_sum(terms.loss, lp), [[0.0, -1.1, 0.0, 0.9, -0.7, 1.6]])
    assert terms.clipped.tolist() == [[True, False, True, False, False, False]]
    close(terms.ratio, [r])
    assert not terms.ratio.requires_grad


def test_ppo_clip_higher_widens_only_the_upper_side():
    # DAPO clip-higher: eps_low 0.2, eps_high 0.28.
    #   (1.25, +1): 1.25 < 1.28 -> unclipped, loss -1.25, gradient -1.25 (symmetric 0.2 would clip it)
    #   (1.30, +1): clipped at 1.28 -> loss -1.28, no gradient
    #   (0.75, -1): 0.75 < 0.8 -> clipped at 0.8 -> loss 0.8, no gradient
    r = [1.25, 1.3, 0.75]
    lp, old = leaf_logprobs([[math.log(x) for x in r]])
    a = t([[1.0, 1.0, -1.0]])
    terms = pl.ppo(lp, old, a, clip_low=0.2, clip_high=0.28, dual_clip=None, log_ratio_clamp=20.0)
    close(terms.loss, [[-1.25, -1.28, 0.8]])
    close(grad_of_sum(terms.loss, lp), [[-1.25, 0.0, 0.0]])
    symmetric = pl.ppo(lp, old, a, clip_low=0.2, clip_high=0.2, dual_clip=None, log_ratio_clamp=20.0)
    close(symmetric.loss[0, :1], [-1.2])
    assert symmetric.clipped[0, 0]


def test_ppo_dual_clip_caps_negative_advantage_losses():
    # Dual-clip c = 3 (Ye et al. 2020): for A < 0 the objective is max(min(rA, clip(r)A), cA),
    # i.e. the loss is at most -cA.
    #   (5, -1): PPO loss 5 -> capped at 3, no gradient
    #   (2, -1): PPO loss 2 < 3 -> kept, gradient -rA = 2
    #   (5, -2): PPO loss 10 -> capped at 6
    #   (5, +1): positive advantage: PPO's own clip, loss -1.2, no gradient
    r = [5.0, 2.0, 5.0, 5.0]
    lp, old = leaf_logprobs([[math.log(x) for x in r]])
    a = t([[-1.0, -1.0, -2.0, 1.0]])
    terms = pl.ppo(lp, old, a, dual_clip=3.0, clip_low=0.2, clip_high=0.2, log_ratio_clamp=20.0)
    close(terms.loss, [[3.0, 2.0, 6.0, -1.2]])
    close(grad_of_sum(terms.loss, lp), [[0.0, 2.0, 0.0, 0.0]])
    assert terms.clipped.tolist() == [[True, False, True, True]]


def test_ppo_at_ratio_one_is_the_policy_gradient():
    lp, old = leaf_logprobs([[0.0, 0.0]])
    terms = pl.ppo(lp, old, t([[1.5, -0.5]]), clip_low=0.2, clip_high=0.2, dual_clip=None, log_ratio_clamp=20.0)
    close(terms.loss, [[-1.5, 0.5]])
    close(grad_of_sum(terms.loss, lp), [[-1.5, 0.5]])


def test_ppo_extreme_log_ratios_are_clamped_and_finite():
    # log r = +-50 is clamped to +-20 (no gradient beyond the clamp): r = e^20 or e^-20.
    big, tiny = math.exp(20.0), math.exp(-20.0)
    lp, old = leaf_logprobs([[50.0, 50.0, -50.0, -50.0]])
    a = t([[1.0, -1.0, 1.0, -1.0]])
    terms = pl.ppo(lp, old, a, clip_low=0.2, clip_high=0.2, dual_clip=None, log_ratio_clamp=20.0)
    #   (e^20, +1): clipped at 1.2 -> -1.2;  (e^20, -1): pessimistic, -min(-e^20, -1.2) = e^20
    #   (e^-20, +1): -min(e^-20, 0.8) = -e^-20;  (e^-20, -1): clipped at 0.8 -> 0.8
    close(terms.loss, [[-1.2, big, -tiny, 0.8]])
    close(terms.ratio, [[big, big, tiny, tiny]])
    g = grad_of_sum(terms.loss, lp)
    assert torch.isfinite(g).all() and g.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    dual = pl.ppo(lp, old, a, dual_clip=3.0, clip_low=0.2, clip_high=0.2, log_ratio_clamp=20.0)
    close(dual.loss, [[-1.2, 3.0, -tiny, 0.8]])  # dual-clip caps the e^20 loss at -cA = 3
    assert torch.isfinite(grad_of_sum(dual.loss, lp)).all()


def test_ppo_clamp_is_configurable():
    lp, old = leaf_logprobs([[3.0]])
    terms = pl.ppo(lp, old, t([[-1.0]]), log_ratio_clamp=1.0, clip_low=0.2, clip_high=0.2, dual_clip=None)
    close(terms.ratio, [[math.e]])
    close(terms.loss, [[math.e]])


# -- GSPO ------------------------------------------------------------------------------------------


def gspo_case():
    # Sequence 0: tokens 0, 1 (position 2 padding), log r = 0.1, -0.3 -> s0 = exp(-0.1) = 0.904837.
    # Sequence 1: three tokens, log r = 0.2 each -> s1 = exp(0.2) = 1.221403.
    lp, old = leaf_logprobs([[0.1, -0.3, 5.0], [0.2, 0.2, 0.2]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    a = t([[-1.0, -1.0, -1.0], [2.0, 2.0, 2.0]])  # sequence-level advantages
    return lp, old, mask, a


def test_gspo_uses_the_sequence_ratio_on_every_token():
    lp, old, mask, a = gspo_case()
    terms = pl.gspo(lp, old, a, mask, clip_low=0.2, clip_high=0.2, log_ratio_clamp=20.0)
    s0, s1 = math.exp(-0.1), math.exp(0.2)
    close(terms.ratio * mask, [[s0, s0, 0.0], [s1, s1, s1]])
    # seq 0: A = -1, s0 inside [0.8, 1.2] -> loss -(s0 * -1) = s0, gradient per token -s0 A = s0.
    # seq 1: A = 2, s1 > 1.2 -> clipped: loss -1.2 * 2 = -2.4, no gradient.
    close(terms.loss * mask, [[s0, s0, 0.0], [-2.4, -2.4, -2.4]])
    close(grad_of_sum(terms.loss * mask, lp), [[s0, s0, 0.0], [0.0, 0.0, 0.0]])
    assert (terms.clipped & (mask > 0)).tolist() == [[False, False, False], [True, True, True]]


def test_gspo_token_form_matches_the_sequence_objective_gradient():
    # GSPO (eq. 5): J = 1/G sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(1/|y_i| sum_t log r_it).
    # With seq_mean_token_mean aggregation the token form has the same gradient:
    # d(-J)/dlog pi_it = -s_i A_i / (G |y_i|) inside the clip range, 0 outside.
    lp, old, mask, a = gspo_case()
    terms = pl.gspo(lp, old, a, mask, clip_low=0.2, clip_high=0.2, log_ratio_clamp=20.0)
    loss = aggregate(terms.loss, mask, "seq_mean_token_mean", Normalizer(tokens=5, sequences=2))
    s0 = math.exp(-0.1)
    # seq 0: -s0 * (-1) / (2 * 2) = s0 / 4; seq 1 clipped -> 0
    close(grad_of_sum(loss, lp), [[s0 / 4, s0 / 4, 0.0], [0.0, 0.0, 0.0]])
    # the loss value: (s0 + (-2.4)) / 2
    assert float(loss.detach()) == pytest.approx((s0 - 2.4) / 2)


def test_gspo_empty_sequence_has_ratio_one_and_no_gradient():
    lp, old = leaf_logprobs([[0.3, 0.4], [0.0, 0.0]])
    mask = t([[0, 0], [1, 1]])
    terms = pl.gspo(lp, old, t([[1.0, 1.0], [1.0, 1.0]]), mask, clip_low=0.2, clip_high=0.2, log_ratio_clamp=20.0)
    assert torch.isfinite(terms.loss).all()
    close(terms.ratio[0], [1.0, 1.0])
    close(grad_of_sum(terms.loss * mask, lp)[0], [0.0, 0.0])


def test_gspo_extreme_log_ratios_are_clamped_and_finite():
    lp, old = leaf_logprobs([[50.0, 50.0], [-50.0, -50.0]])
    mask = t([[1, 1], [1, 1]])
    terms = pl.gspo(lp, old, t([[-1.0, -1.0], [1.0, 1.0]]), mask, clip_low=0.2, clip_high=0.2, log_ratio_clamp=20.0)
    close(terms.ratio, [[math.exp(20.0)] * 2, [math.exp(-20.0)] * 2])
    assert torch.isfinite(terms.loss).all() and torch.isfinite(grad_of_sum(terms.loss, lp)).all()


# -- SAPO ------------------------------------------------------------------------------------------


def test_sapo_at_ratio_one_has_gradient_minus_advantage():
    # f(r) = 4/tau sigmoid(tau (r - 1)); f(1) = 2/tau, f'(1) = 1, so d(-f(r)A)/dlog pi = -A r f'(r) = -A.
    lp, old = leaf_logprobs([[0.0, 0.0]])
    terms = pl.sapo(lp, old, t([[1.5, -0.5]]), tau_pos=1.0, tau_neg=1.05, log_ratio_clamp=20.0)
    # loss: -(4/1) * 0.5 * 1.5 = -3; -(4/1.05) * 0.5 * (-0.5) = 1/1.05
    close(terms.loss, [[-3.0, 1 / 1.05]])
    close(grad_of_sum(terms.loss, lp), [[-1.5, 0.5]])


def test_sapo_soft_gate_by_hand():
    # Token 0: r = e^0.5, A = +1, tau_pos = 1: s = sigmoid(e^0.5 - 1);
    #   loss -4 s, gradient d/dlog pi = -4 s (1 - s) r A.
    # Token 1: r = e^-0.4, A = -2, tau_neg = 2: s = sigmoid(2 (e^-0.4 - 1));
    #   loss -(4/2) s (-2) = 4 s, gradient -4 s (1 - s) r A = 8 s (1 - s) r.
    r0, r1 = math.exp(0.5), math.exp(-0.4)
    s0, s1 = sigmoid(r0 - 1), sigmoid(2 * (r1 - 1))
    lp, old = leaf_logprobs([[0.5, -0.4]])
    terms = pl.sapo(lp, old, t([[1.0, -2.0]]), tau_pos=1.0, tau_neg=2.0, log_ratio_clamp=20.0)
    close(terms.loss, [[-4 * s0, 4 * s1]])
    close(grad_of_sum(terms.loss, lp), [[-4 * s0 * (1 - s0) * r0, 8 * s1 * (1 - s1) * r1]])


def test_sapo_marks_tokens_whose_gate_weight_fell_below_half():
    # Gradient weight 4 s (1 - s), s = sigmoid(tau (r - 1)), tau 1:
    #   r = 1.5: s = sigmoid(0.5) = 0.6225, 4 s (1 - s) = 0.940 -> not clipped
    #   r = 3:   s = sigmoid(2) = 0.8808,   4 s (1 - s) = 0.420 -> clipped
    lp, old = leaf_logprobs([[math.log(1.5), math.log(3.0)]])
    terms = pl.sapo(lp, old, t([[1.0, 1.0]]), tau_pos=1.0, tau_neg=1.05, log_ratio_clamp=20.0)
    assert terms.clipped.tolist() == [[False, True]]


def test_sapo_extreme_log_ratios_are_finite():
    lp, old = leaf_logprobs([[50.0, -50.0, 50.0, -50.0]])
    terms = pl.sapo(lp, old, t([[1.0, 1.0, -1.0, -1.0]]), tau_pos=1.0, tau_neg=1.05, log_ratio_clamp=20.0)
    # r = e^20: the gate saturates at 1 -> loss -4/tau A; r = e^-20: gate sigmoid(-tau) (approximately).
    close(terms.loss[0, :1], [-4.0])
    assert torch.isfinite(terms.loss).all() and torch.isfinite(grad_of_sum(terms.loss, lp)).all()


# -- CISPO -----------------------------------------------------------------------------------------


def test_cispo_values_and_gradients_by_hand():
    # loss = -sg(clip(r, 0.8, 1.28)) A log pi; gradient on log pi = -clip(r) A, never zero.
    #   log pi -1.0, old -1.5: r = e^0.5 = 1.6487 -> weight 1.28, A = 2: loss -1.28*2*(-1) = 2.56, grad -2.56
    #   log pi -2.0, old -1.9: r = e^-0.1 = 0.9048 -> weight r, A = -1: loss -0.9048*(-1)*(-2) = -1.8097,
    #                                                               grad 0.9048
    #   log pi -0.5, old  0.5: r = e^-1 = 0.3679 -> weight 0.8, A = 1: loss -0.8*1*(-0.5) = 0.4, grad -0.8
    lp = t([[-1.0, -2.0, -0.5]]).requires_grad_(True)
    old = t([[-1.5, -1.9, 0.5]])
    w1 = math.exp(-0.1)
    terms = pl.cispo(lp, old, t([[2.0, -1.0, 1.0]]), clip_low=0.2, clip_high=0.28, log_ratio_clamp=20.0)
    close(terms.loss, [[2.56, -2 * w1, 0.4]])
    close(grad_of_sum(terms.loss, lp), [[-2.56, w1, -0.8]])
    close(terms.ratio, [[math.exp(0.5), w1, math.exp(-1.0)]])
    assert terms.clipped.tolist() == [[True, False, True]]  # weight clipped (the gradient is not)


def test_cispo_extreme_log_ratio_keeps_the_capped_weight():
    lp = t([[-0.5, -0.5]]).requires_grad_(True)
    old = t([[-50.5, 49.5]])  # log r = 50 and -50
    terms = pl.cispo(lp, old, t([[1.0, 1.0]]), clip_low=1.0, clip_high=4.0, log_ratio_clamp=20.0)
    # weight clip(e^20, 0, 5) = 5 and clip(e^-20, 0, 5) = e^-20
    close(grad_of_sum(terms.loss, lp), [[-5.0, -math.exp(-20.0)]])
    assert torch.isfinite(terms.loss).all()


# -- M2PO ------------------------------------------------------------------------------------------


def m2po_case():
    # Loss tokens' log r: 0.1, -0.5, 0.3 | 0.05, -0.2, 0.4   (squares 0.01, 0.25, 0.09 | 0.0025, 0.04, 0.16)
    # Position 3 of each row is padding (log r 0.0 and 2.0, not counted).
    log_r = [[0.1, -0.5, 0.3, 0.0], [0.05, -0.2, 0.4, 2.0]]
    mask = t([[1, 1, 1, 0], [1, 1, 1, 0]])
    return log_r, mask


def test_m2po_masks_the_largest_second_moments_until_the_mean_is_below_tau():
    # tau = 0.055. Mean of the six squares: 0.5525 / 6 = 0.0921 > tau.
    #   drop 0.25 (log r -0.5): 0.3025 / 5 = 0.0605 > tau
    #   drop 0.16 (log r 0.4):  0.1425 / 4 = 0.0356 <= tau -> stop
    # (Counting the padding's 0.0 would stop after one drop: 0.3025 / 6 = 0.0504.)
    log_r, mask = m2po_case()
    keep = pl.m2po_mask(t(log_r), mask, tau=0.055)
    assert keep.tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]


def test_m2po_keeps_everything_when_the_mean_is_already_below_tau():
    log_r, mask = m2po_case()
    # mean of squares 0.0921 <= 0.1
    assert pl.m2po_mask(t(log_r), mask, tau=0.1).tolist() == mask.tolist()


def test_m2po_drops_ties_with_the_last_removed_value():
    # squares 0.09, 0.09, 0.01, 0.01: mean 0.05 > 0.04; one 0.09 dropped gives 0.11 / 3 = 0.0367 <= 0.04,
    # and its tie goes too.
    keep = pl.m2po_mask(t([[0.3, -0.3, 0.1, -0.1]]), t([[1, 1, 1, 1]]), tau=0.04)
    assert keep.tolist() == [[0, 0, 1, 1]]


def test_m2po_loss_is_unclipped_ratio_times_advantage_on_kept_tokens():
    log_r, mask = m2po_case()
    lp, old = leaf_logprobs(log_r)
    a = t([[1.0, 1.0, -2.0, 0.0], [-1.0, 3.0, 1.0, 0.0]])
    terms = pl.m2po(lp, old, a, mask, tau=0.055, log_ratio_clamp=20.0)
    # kept: (0,0) r=e^0.1, A=1; (0,2) r=e^0.3, A=-2; (1,0) r=e^0.05, A=-1; (1,1) r=e^-0.2, A=3.
    # loss -rA, gradient -rA (no clip even though e^0.3 > 1.2 would be outside PPO's range).
    e = math.exp
    expected = [[-e(0.1), 0.0, 2 * e(0.3), 0.0], [e(0.05), -3 * e(-0.2), 0.0, 0.0]]
    close(terms.loss * mask, expected)
    close(grad_of_sum(terms.loss * mask, lp), expected)
    assert terms.clipped.tolist() == [[False, True, False, False], [False, False, True, False]]


def split_m2po(log_r, mask, tau, rows_on_rank0):
    top, bottom = TwoRankGroup().run(
        lambda lr, m, comm: pl.m2po_mask(lr, m, tau=tau, comm=comm),
        (log_r[:rows_on_rank0], mask[:rows_on_rank0]),
        (log_r[rows_on_rank0:], mask[rows_on_rank0:]),
    )
    return torch.cat([top, bottom])


def test_m2po_mask_split_over_two_ranks_equals_one_process():
    # Rank 0 holds squares 0.045, 0.045, 0.045; rank 1 holds 0.05 and 0.0. tau = 0.04.
    # Whole batch: mean (0.135 + 0.05) / 5 = 0.037 <= tau -> nothing masked.
    # Rank 0 on its own would see mean 0.045 > tau and drop all three (ties): the threshold must be global.
    x = math.sqrt(0.045)
    log_r = t([[x, -x, x], [math.sqrt(0.05), 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    assert pl.m2po_mask(log_r[:1], mask[:1], tau=0.04).tolist() == [[0, 0, 0]]  # rank 0 alone
    assert pl.m2po_mask(log_r, mask, tau=0.04).tolist() == mask.tolist()
    assert split_m2po(log_r, mask, 0.04, 1).tolist() == mask.tolist()


def test_m2po_mask_split_over_two_ranks_equals_one_process_on_a_random_batch():
    torch.manual_seed(1)
    log_r = torch.randn(8, 6, dtype=torch.float64) * 0.3
    mask = (torch.rand(8, 6) > 0.25).double()
    single = pl.m2po_mask(log_r, mask, tau=0.04)
    assert 0 < float(single.sum()) < float(mask.sum())  # some, not all, masked
    assert split_m2po(log_r, mask, 0.04, 5).tolist() == single.tolist()
    # and the hand example of the single-rank test, split by rows
    hand_log_r, hand_mask = m2po_case()
    assert split_m2po(t(hand_log_r), hand_mask, 0.055, 1).tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]


def test_m2po_with_no_loss_tokens_keeps_the_empty_mask():
    assert pl.m2po_mask(t([[1.0, 2.0]]), t([[0, 0]]), tau=0.04).tolist() == [[0, 0]]


# -- REINFORCE -------------------------------------------------------------------------------------


def test_reinforce_loss_and_gradient_are_minus_advantage():
    lp = t([[-0.3, -2.0, -0.1]]).requires_grad_(True)
    terms = pl.reinforce(lp, t([[1.5, -0.5, 2.0]]))
    close(terms.loss, [[-1.5, 0.5, -2.0]])  # r = 1
    close(grad_of_sum(terms.loss, lp), [[-1.5, 0.5, -2.0]])
    close(terms.ratio, [[1.0, 1.0, 1.0]])
    assert not terms.clipped.any()


# -- every loss: fully masked batch, length-1 completions, gradcheck --------------------------------


def all_losses(lp, old, a, mask):
    return {
        "ppo": pl.ppo(lp, old, a, clip_low=0.2, clip_high=0.28, dual_clip=3.0, log_ratio_clamp=20.0),
        "gspo": pl.gspo(lp, old, a, mask, clip_low=0.2, clip_high=0.2, log_ratio_clamp=20.0),
        "sapo": pl.sapo(lp, old, a, tau_pos=1.0, tau_neg=1.05, log_ratio_clamp=20.0),
        "cispo": pl.cispo(lp, old, a, clip_low=0.2, clip_high=0.28, log_ratio_clamp=20.0),
        "m2po": pl.m2po(lp, old, a, mask, tau=0.04, log_ratio_clamp=20.0),
        "reinforce": pl.reinforce(lp, a),
    }


def test_fully_masked_batch_gives_zero_loss_and_finite_gradient():
    lp, old = leaf_logprobs([[0.3, -0.2], [0.1, 0.0]])
    mask = torch.zeros(2, 2, dtype=torch.float64)
    a = t([[1.0, 1.0], [-1.0, -1.0]])
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        for name, terms in all_losses(lp, old, a, mask).items():
            loss = aggregate(terms.loss, mask, mode, Normalizer(tokens=0.0, sequences=0.0))
            (g,) = torch.autograd.grad(loss, lp, allow_unused=True)
            assert float(loss.detach()) == 0.0, (name, mode)
            assert g is None or (torch.isfinite(g).all() and not g.any()), (name, mode)


def test_length_one_completions():
    # One loss token per sample at ratio 1: every loss gives gradient -A on it (SAPO f'(1) = 1, GSPO s = r,
    # CISPO weight 1, M2PO (log r)^2 = 0 <= tau), and, but for CISPO (-A log pi) and SAPO (-2A/tau),
    # the loss -A.
    lp, old = leaf_logprobs([[0.0, 0.0], [0.0, 0.0]])
    mask = t([[0, 1], [1, 0]])
    a = t([[0.0, 2.0], [-1.0, 0.0]])
    for name, terms in all_losses(lp, old, a, mask).items():
        g = grad_of_sum(terms.loss * mask, lp)
        close(g, [[0.0, -2.0], [1.0, 0.0]])
        if name == "sapo":  # f(1) = 4/tau * 1/2: -2 * 2 / 1 and -2 * (-1) / 1.05
            close(terms.loss * mask, [[0.0, -4.0], [2 / 1.05, 0.0]])
        elif name != "cispo":
            close(terms.loss * mask, [[0.0, -2.0], [1.0, 0.0]])


def gradcheck_point():
    # Log-ratios between -0.15 and 0.15 plus a few far outside [0.8, 1.28]: away from every clip kink.
    torch.manual_seed(0)
    old = -torch.rand(3, 5, dtype=torch.float64) - 0.5
    log_r = (torch.rand(3, 5, dtype=torch.float64) - 0.5) * 0.3
    log_r[0, 0], log_r[1, 2], log_r[2, 4] = 0.6, -0.7, 1.2
    lp = (old + log_r).requires_grad_(True)
    mask = t([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    a = t([[0.7], [-1.3], [0.4]]).expand(3, 5) * t([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, -2, 1, 3, -1]])
    return lp, old, a, mask


@pytest.mark.parametrize("name", ["ppo", "ppo_dual", "sapo", "m2po"])
def test_gradcheck_of_the_losses_without_stop_gradients(name):
    lp, old, a, mask = gradcheck_point()
    fns = {
        "ppo": lambda x: pl.ppo(x, old, a, clip_low=0.2, clip_high=0.28, dual_clip=None, log_ratio_clamp=20.0).loss,
        "ppo_dual": lambda x: pl.ppo(x, old, a, clip_low=0.2, clip_high=0.28, dual_clip=1.5, log_ratio_clamp=20.0).loss,
        "sapo": lambda x: pl.sapo(x, old, a, tau_pos=1.0, tau_neg=1.05, log_ratio_clamp=20.0).loss,
        "m2po": lambda x: (
            pl.m2po(x, old, a, mask, tau=0.04, log_ratio_clamp=20.0).loss
        ),  # the mask is piecewise constant
    }
    assert torch.autograd.gradcheck(lambda x: fns[name](x) * mask, (lp,))


def test_gradcheck_of_gmpo_aggregated_as_in_the_paper():
    # Log-ratios away from the +-0.4 kinks (some far outside them: clipped, no gradient).
    lp, old, _, mask = gradcheck_point()
    a = t([[0.7], [-1.3], [0.4]]).expand(3, 5)
    norm = Normalizer(tokens=float(mask.sum()), sequences=3.0)
    assert torch.autograd.gradcheck(
        lambda x: aggregate(
            pl.gmpo(x, old, a, mask, log_bounds=(-0.4, 0.4), log_ratio_clamp=20.0).loss,
            mask,
            "seq_mean_token_mean",
            norm,
        ),
        (lp,),
    )


def test_gradcheck_of_gspo_aggregated_as_in_the_paper():
    # The token form's value is GSPO's sequence objective; with sequence-level advantages and
    # seq_mean_token_mean its gradient is that objective's gradient, so gradcheck applies.
    lp, old, _, mask = gradcheck_point()
    a = t([[0.7], [-1.3], [0.4]]).expand(3, 5)
    norm = Normalizer(tokens=float(mask.sum()), sequences=3.0)
    for clip in (0.2, 0.01):  # wide: nothing clipped; narrow: every sequence clipped
        assert torch.autograd.gradcheck(
            lambda x, clip=clip: aggregate(
                pl.gspo(x, old, a, mask, clip_low=clip, clip_high=clip, log_ratio_clamp=20.0).loss,
                mask,
                "seq_mean_token_mean",
                norm,
            ),
            (lp,),
        )


def numerical_grad(f, x, h=1e-6):
    """Central differences of the scalar f at x."""
    g = torch.zeros_like(x)
    flat = g.view(-1)
    for i in range(x.numel()):
        step = torch.zeros_like(x).view(-1)
        step[i] = h
        step = step.view_as(x)
        flat[i] = (float(f(x + step)) - float(f(x - step))) / (2 * h)
    return g


def test_reinforce_gradient_is_the_on_policy_importance_sampling_gradient():
    # The stop-gradient surrogate has a constant value, so gradcheck does not apply; its gradient must
    # be the derivative of the on-policy objective sum -A pi/pi_x0 = sum -A exp(x - x0) at x = x0.
    lp, _, a, mask = gradcheck_point()
    x0 = lp.detach()
    expected = numerical_grad(lambda x: (-a * torch.exp(x - x0) * mask).sum(), x0)
    close(grad_of_sum(pl.reinforce(lp, a).loss * mask, lp), expected.tolist(), rel=1e-6, abs=1e-8)


def test_cispo_gradient_is_that_of_the_frozen_weight_objective():
    # CISPO = sum -sg(w) A log pi: its gradient is the derivative of sum -w0 A x with the weight w0 =
    # clip(r, 0.8, 1.28) frozen at the point (some tokens inside the band, some clipped).
    lp, old, a, mask = gradcheck_point()
    w0 = torch.exp(lp.detach() - old).clamp(0.8, 1.28)
    expected = numerical_grad(lambda x: (-w0 * a * x * mask).sum(), lp.detach())
    close(
        grad_of_sum(pl.cispo(lp, old, a, clip_low=0.2, clip_high=0.28, log_ratio_clamp=20.0).loss * mask, lp),
        expected.tolist(),
        rel=1e-6,
        abs=1e-8,
    )


# -- the critic's clipped value loss ---------------------------------------------------------------


def test_value_loss_by_hand():
    # 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), c = 0.2, V_old = 0.5:
    #   V 1.0, R 2.0: unclipped 1, clipped V 0.7 -> 1.69: loss 0.845, gradient 0 (the clipped branch wins)
    #   V 1.0, R 0.0: unclipped 1, clipped 0.49: loss 0.5, gradient V - R = 1
    #   V 0.6, R 2.0: inside the clip: 1.96 both: loss 0.98, gradient V - R = -1.4
    #   V 0.2, R 0.0: clipped V 0.3 -> 0.09, unclipped 0.04: loss 0.045, gradient 0
    v = t([[1.0, 1.0, 0.6, 0.2]]).requires_grad_(True)
    out, clipped = value_loss(v, t([[0.5] * 4]), t([[2.0, 0.0, 2.0, 0.0]]), clip=0.2)
    close(out, [[0.845, 0.5, 0.98, 0.045]])
    close(grad_of_sum(out, v), [[0.0, 1.0, -1.4, 0.0]])
    assert clipped.tolist() == [[True, False, False, True]]  # the value clip fraction counts these


def test_value_loss_gradcheck():
    torch.manual_seed(0)
    v = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    old = v.detach() + t([[0.5, -0.5, 0.05, -0.05], [0.9, 0.01, -0.02, -0.8]])
    returns = torch.randn(2, 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: value_loss(x, old, returns, 0.2)[0], (v,))
