"""KL estimators, loss aggregation modes and off-policy behaviour weights, worked out by hand."""

import math

import pytest
import torch

from relax_hpc.algos.aggregation import Normalizer, aggregate, local_counts
from relax_hpc.algos.kl import K3_CAP, K3_MAX_GRAD, kl_estimate
from relax_hpc.algos.off_policy import behaviour_weights
from relax_hpc.config.schema import KLConfig
from tests.unit.algo_helpers import close, t

torch.set_num_threads(1)


def grad_of_sum(out, x):
    (g,) = torch.autograd.grad(out.sum(), x)
    return g


# -- KL estimators (Schulman 2020) -----------------------------------------------------------------
# With d = log pi - log pi_ref: k1 = d, k2 = d^2 / 2, k3 = e^-d - 1 + d.
# Derivatives in log pi: k1' = 1, k2' = d, k3' = 1 - e^-d.


def kl_inputs():
    lp = t([[-1.0, -2.0, -0.7]]).requires_grad_(True)
    ref = t([[-1.5, -1.5, -0.7]])  # d = 0.5, -0.5, 0
    return lp, ref


def test_k1_by_hand():
    lp, ref = kl_inputs()
    out = kl_estimate(lp, ref, "k1", clamp=20.0)
    close(out, [[0.5, -0.5, 0.0]])
    close(grad_of_sum(out, lp), [[1.0, 1.0, 1.0]])


def test_k2_by_hand():
    lp, ref = kl_inputs()
    out = kl_estimate(lp, ref, "k2", clamp=20.0)
    close(out, [[0.125, 0.125, 0.0]])
    close(grad_of_sum(out, lp), [[0.5, -0.5, 0.0]])


def test_k3_by_hand():
    # d = 0.5: e^-0.5 - 1 + 0.5 = 0.1065307; d = -0.5: e^0.5 - 1 - 0.5 = 0.1487213; d = 0: 0.
    lp, ref = kl_inputs()
    out = kl_estimate(lp, ref, "k3", clamp=20.0)
    close(out, [[math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 0.0]])
    close(grad_of_sum(out, lp), [[1 - math.exp(-0.5), 1 - math.exp(0.5), 0.0]])


def test_k3_is_the_default_and_nonnegative():
    torch.manual_seed(0)
    lp, ref = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    assert KLConfig().estimator == "k3"
    assert (kl_estimate(lp, ref, "k3", clamp=20.0) >= 0).all() and (kl_estimate(lp, ref, "k2", clamp=20.0) >= 0).all()


def test_kl_extreme_log_ratios_are_clamped_finite_and_gradient_free():
    # d = 50 -> 20: k1 = 20, k2 = 200; k3 is capped at 10 on both sides (e^-20 + 19 and e^20 - 21 exceed it).
    lp = t([[50.0, -50.0]]).requires_grad_(True)
    ref = t([[0.0, 0.0]])
    close(kl_estimate(lp, ref, "k1", clamp=20.0), [[20.0, -20.0]])
    close(kl_estimate(lp, ref, "abs", clamp=20.0), [[20.0, 20.0]])
    close(kl_estimate(lp, ref, "k2", clamp=20.0), [[200.0, 200.0]])
    close(kl_estimate(lp, ref, "k3", clamp=20.0), [[10.0, 10.0]])
    for est in ("k1", "abs", "k2", "k3", "k3_grad_k2", "k1_grad_k2"):
        g = grad_of_sum(kl_estimate(lp, ref, est, clamp=20.0), lp)
        assert g.tolist() == [[0.0, 0.0]], est
    close(kl_estimate(lp, ref, "k1", clamp=5.0), [[5.0, -5.0]])


def k3_cap_crossings():
    """The log-ratios where e^-d - 1 + d = 10, by bisection: one below 0, one above."""

    def solve(inside, outside):
        for _ in range(200):
            mid = (inside + outside) / 2
            if math.exp(-mid) - 1 + mid < 10.0:
                inside = mid
            else:
                outside = mid
        return inside

    return solve(0.0, -20.0), solve(0.0, 20.0)


def test_k3_gradient_is_bounded_at_and_around_its_cap():
    # Inside the cap the gradient is Schulman's k3' = 1 - e^-d; beyond it, none. The largest one is
    # just inside the negative crossing d-: 1 - e^-d- = d- - 10 (from e^-d- = 11 - d-).
    low, high = k3_cap_crossings()
    assert low == pytest.approx(-2.6108686, abs=1e-6) and high == pytest.approx(10.99998, abs=1e-4)
    assert K3_CAP == 10.0 and abs(K3_MAX_GRAD - (10.0 - low)) < 1e-5
    near = [low - 1e-4, low + 1e-4, high - 1e-4, high + 1e-4, -5.0, -19.9, 15.0, 0.5]
    lp = t([near]).requires_grad_(True)
    out = kl_estimate(lp, torch.zeros_like(lp), "k3", clamp=20.0)
    inside = [low < d < high for d in near]
    close(out, [[math.exp(-d) - 1 + d if keep else 10.0 for d, keep in zip(near, inside, strict=True)]])
    close(grad_of_sum(out, lp), [[1 - math.exp(-d) if keep else 0.0 for d, keep in zip(near, inside, strict=True)]])
    grid = torch.linspace(-20.0, 20.0, 400_001, dtype=torch.float64).requires_grad_(True)
    g = grad_of_sum(kl_estimate(grid, torch.zeros_like(grid), "k3", clamp=20.0), grid)
    assert float(g.abs().max()) <= K3_MAX_GRAD and float(g.abs().max()) > K3_MAX_GRAD - 1e-3


def test_unknown_kl_estimator_is_rejected():
    with pytest.raises(ValueError):
        kl_estimate(t([[0.0]]), t([[0.0]]), "k4", clamp=20.0)  # type: ignore[arg-type]  # not an estimator, on purpose
    with pytest.raises(ValueError, match="k3_grad_k1 was removed: its gradient, grad log pi, has zero expectation"):
        KLConfig.model_validate({"estimator": "k3_grad_k1"})


def test_abs_by_hand():
    # |d|: 0.5, 0.5, 0; gradient sign(d) (0 at d = 0).
    lp, ref = kl_inputs()
    out = kl_estimate(lp, ref, "abs", clamp=20.0)
    close(out, [[0.5, 0.5, 0.0]])
    close(grad_of_sum(out, lp), [[1.0, -1.0, 0.0]])


@pytest.mark.parametrize(
    ("estimator", "value"),
    [("k3_grad_k2", [[math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 0.0]]), ("k1_grad_k2", [[0.5, -0.5, 0.0]])],
)
def test_straight_through_kl_has_its_value_and_k2s_gradient(estimator, value):
    # value k3 = e^-d - 1 + d or k1 = d; gradient k2' = d: 0.5, -0.5, 0.
    lp, ref = kl_inputs()
    out = kl_estimate(lp, ref, estimator, clamp=20.0)
    close(out, value)
    close(grad_of_sum(out, lp), [[0.5, -0.5, 0.0]])


def test_expected_loss_gradients_of_the_estimators_over_a_categorical_policy():
    # Exact expectations over a 5-token softmax policy pi_theta (no sampling): sum_y pi(y) grad k(y)
    # is what a KL loss term contributes on average. The k2-gradient forms give grad KL(pi || ref)
    # (autograd on sum_y pi log(pi / ref)); k1's gradient, grad log pi, averages to exactly 0, which
    # is why k3's value with k1's gradient was removed. k3's own gradient is E[(1 - ref/pi) grad log pi].
    torch.manual_seed(0)
    theta = torch.randn(5, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(5, dtype=torch.float64), -1)

    def expected_grad(estimator):
        logp = torch.log_softmax(theta, -1)
        per_token = kl_estimate(logp, ref, estimator, clamp=20.0)
        return torch.autograd.grad((logp.exp().detach() * per_token).sum(), theta)[0]

    logp = torch.log_softmax(theta, -1)
    true_kl_grad = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)[0]
    for estimator in ("k3_grad_k2", "k1_grad_k2", "k2"):
        torch.testing.assert_close(expected_grad(estimator), true_kl_grad)
    torch.testing.assert_close(expected_grad("k1"), torch.zeros(5, dtype=torch.float64))
    assert float((expected_grad("k3") - true_kl_grad).abs().max()) > 1e-3  # biased, as documented


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3"])  # not the straight-through forms, on purpose
def test_kl_gradcheck(estimator):
    torch.manual_seed(0)
    lp = (torch.randn(3, 4, dtype=torch.float64) * 0.5).requires_grad_(True)
    ref = torch.randn(3, 4, dtype=torch.float64) * 0.5
    assert torch.autograd.gradcheck(lambda x: kl_estimate(x, ref, estimator, clamp=20.0), (lp,))


# -- aggregation -----------------------------------------------------------------------------------

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "token_sum"]


def agg_case():
    # Sample 0: 2 tokens (1, 2); sample 1: 3 tokens (4, 5, 6); sample 2: empty (7, 8, 9 masked out).
    loss = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = t([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    return loss, mask


def test_local_counts_skip_empty_completions():
    _, mask = agg_case()
    assert local_counts(mask) == (5.0, 2.0)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token_mean", (1 + 2 + 4 + 5 + 6) / 5),  # 18 / 5 = 3.6
        ("seq_mean_token_mean", (3 / 2 + 15 / 3) / 2),  # (1.5 + 5) / 2 = 3.25
        ("seq_mean_token_sum", (3 + 15) / 2),  # 9
        ("seq_mean_token_sum_norm", (3 + 15) / (2 * 4)),  # L = 4: 2.25
        ("token_sum", 1 + 2 + 4 + 5 + 6),  # 18: no normalisation
    ],
)
def test_aggregation_by_hand(mode, expected):
    loss, mask = agg_case()
    out = aggregate(loss, mask, mode, Normalizer(tokens=5.0, sequences=2.0, constant=4.0))
    assert float(out) == pytest.approx(expected)


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_gradient_weights_by_hand(mode):
    # d loss / d l_it: token_mean 1/5 each; seq_mean_token_mean 1/(2*2) on sample 0, 1/(2*3) on sample 1;
    # seq_mean_token_sum 1/2; seq_mean_token_sum_norm 1/(2*4); token_sum 1; masked tokens 0.
    loss, mask = agg_case()
    loss.requires_grad_(True)
    w = {
        "token_mean": (1 / 5, 1 / 5),
        "seq_mean_token_mean": (1 / 4, 1 / 6),
        "seq_mean_token_sum": (1 / 2, 1 / 2),
        "seq_mean_token_sum_norm": (1 / 8, 1 / 8),
        "token_sum": (1.0, 1.0),
    }[mode]
    out = aggregate(loss, mask, mode, Normalizer(5.0, 2.0, 4.0))
    close(grad_of_sum(out, loss), [[w[0], w[0], 0], [w[1], w[1], w[1]], [0, 0, 0]])


@pytest.mark.parametrize("mode", MODES)
def test_ranks_with_global_counts_sum_to_the_whole_batch(mode):
    loss, mask = agg_case()
    whole = aggregate(loss, mask, mode, Normalizer(5.0, 2.0, 4.0))
    # rank 0 holds sample 0, rank 1 samples 1 and 2; each divides by the global counts.
    parts = [aggregate(loss[s], mask[s], mode, Normalizer(5.0, 2.0, 4.0)) for s in (slice(0, 1), slice(1, 3))]
    assert float(sum(parts)) == pytest.approx(float(whole))


@pytest.mark.parametrize("mode", MODES)
def test_fully_masked_batch_aggregates_to_zero_with_finite_gradient(mode):
    loss = t([[1.0, 2.0], [3.0, 4.0]]).requires_grad_(True)
    mask = torch.zeros(2, 2, dtype=torch.float64)
    tokens, sequences = local_counts(mask)
    out = aggregate(loss, mask, mode, Normalizer(tokens, sequences, 4.0))
    assert float(out.detach()) == 0.0
    g = grad_of_sum(out, loss)
    assert torch.isfinite(g).all() and not g.any()


def test_unknown_aggregation_is_rejected():
    with pytest.raises(ValueError):
        aggregate(t([[1.0]]), t([[1.0]]), "sum", Normalizer(1.0, 1.0))  # type: ignore[arg-type]  # not an aggregation, on purpose


# -- off-policy corrections ------------------------------------------------------------------------


def mismatch_case():
    # w = pi_prox / pi_behav = 0.4, 0.9, 1.5, 3.0
    w = [0.4, 0.9, 1.5, 3.0]
    behaviour = t([[-1.0] * 4])
    proximal = (behaviour + t([[math.log(x) for x in w]])).requires_grad_(True)
    return proximal, behaviour, w


def test_no_correction_weighs_one_and_reports_the_mismatch():
    prox, behav, w = mismatch_case()
    weight, raw = behaviour_weights(prox, behav, "none", cap=2.0, low=0.5, high=2.0, log_ratio_clamp=20.0)
    close(weight, [[1.0] * 4])
    close(raw, [w])


def test_tis_truncates_at_the_cap():
    prox, behav, _ = mismatch_case()
    weight, _ = behaviour_weights(prox, behav, "tis", cap=2.0, low=0.5, high=2.0, log_ratio_clamp=20.0)
    close(weight, [[0.4, 0.9, 1.5, 2.0]])  # min(w, 2)


def test_icepop_drops_tokens_outside_the_band():
    prox, behav, _ = mismatch_case()
    weight, _ = behaviour_weights(prox, behav, "icepop", low=0.5, high=2.0, cap=2.0, log_ratio_clamp=20.0)
    close(weight, [[0.0, 0.9, 1.5, 0.0]])  # w in [0.5, 2] kept as w, else 0
    weight, _ = behaviour_weights(prox, behav, "icepop", low=0.3, high=1.0, cap=2.0, log_ratio_clamp=20.0)
    close(weight, [[0.4, 0.9, 0.0, 0.0]])


def test_decoupled_ppo_drops_tokens_above_the_cap():
    prox, behav, _ = mismatch_case()
    weight, _ = behaviour_weights(prox, behav, "decoupled", cap=2.0, low=0.5, high=2.0, log_ratio_clamp=20.0)
    close(weight, [[0.4, 0.9, 1.5, 0.0]])  # w if w <= 2 else 0 (no lower bound)


def test_masked_importance_sampling_keeps_band_tokens_at_weight_one():
    prox, behav, _ = mismatch_case()
    weight, _ = behaviour_weights(prox, behav, "mis", cap=2.0, low=0.5, high=2.0, log_ratio_clamp=20.0)
    close(weight, [[0.0, 1.0, 1.0, 0.0]])  # w 0.4 and 3.0 outside [0.5, 2]


def sequence_case():
    # Sample 0: w 0.5, 1.6 (and a masked 9.0): w_0 = 0.8. Sample 1: w 2.0, 1.5, 1.0: w_1 = 3.0.
    w = [[0.5, 1.6, 9.0], [2.0, 1.5, 1.0]]
    behaviour = t([[-1.0] * 3] * 2)
    proximal = behaviour + t([[math.log(x) for x in row] for row in w])
    return proximal, behaviour, t([[1, 1, 0], [1, 1, 1]])


def test_sequence_level_tis_weighs_every_token_by_the_samples_truncated_ratio():
    prox, behav, mask = sequence_case()
    weight, raw = behaviour_weights(prox, behav, "seq_tis", cap=2.0, low=0.5, high=2.0, log_ratio_clamp=20.0, mask=mask)
    close(weight, [[0.8] * 3, [2.0] * 3])  # min(0.8, 2), min(3, 2)
    close(raw, [[0.5, 1.6, 9.0], [2.0, 1.5, 1.0]])  # the token-level mismatch is still reported


def test_sequence_level_mis_drops_whole_samples_outside_the_band():
    prox, behav, mask = sequence_case()
    weight, _ = behaviour_weights(prox, behav, "seq_mis", cap=2.0, low=0.5, high=2.0, log_ratio_clamp=20.0, mask=mask)
    close(weight, [[1.0] * 3, [0.0] * 3])  # 0.8 in [0.5, 2]: kept; 3.0 outside: dropped
    weight, _ = behaviour_weights(prox, behav, "seq_mis", cap=2.0, low=0.9, high=4.0, log_ratio_clamp=20.0, mask=mask)
    close(weight, [[0.0] * 3, [1.0] * 3])


@pytest.mark.parametrize("correction", ["none", "tis", "icepop", "decoupled", "mis", "seq_tis", "seq_mis"])
def test_behaviour_weights_carry_no_gradient(correction):
    prox, behav, _ = mismatch_case()
    weight, raw = behaviour_weights(
        prox, behav, correction, cap=2.0, low=0.5, high=2.0, log_ratio_clamp=20.0, mask=torch.ones_like(behav)
    )
    assert not weight.requires_grad and not raw.requires_grad


def test_behaviour_weights_of_extreme_log_ratios_are_clamped():
    # log w = +-50 is clamped to +-20 first.
    prox, behav = t([[49.0, -51.0]]), t([[-1.0, -1.0]])
    _, raw = behaviour_weights(prox, behav, "none", cap=2.0, low=0.5, high=2.0, log_ratio_clamp=20.0)
    close(raw, [[math.exp(20.0), math.exp(-20.0)]])
    close(
        behaviour_weights(prox, behav, "tis", cap=2.0, low=0.5, high=2.0, log_ratio_clamp=20.0)[0],
        [[2.0, math.exp(-20.0)]],
    )
    close(behaviour_weights(prox, behav, "icepop", cap=2.0, low=0.5, high=2.0, log_ratio_clamp=20.0)[0], [[0.0, 0.0]])
    close(
        behaviour_weights(prox, behav, "decoupled", cap=2.0, low=0.5, high=2.0, log_ratio_clamp=20.0)[0],
        [[0.0, math.exp(-20.0)]],
    )


def test_unknown_correction_is_rejected():
    with pytest.raises(ValueError):
        behaviour_weights(t([[0.0]]), t([[0.0]]), "vtrace", cap=2.0, low=0.5, high=2.0, log_ratio_clamp=20.0)  # type: ignore[arg-type]  # not a correction, on purpose
