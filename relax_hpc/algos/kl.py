"""Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman 2020,
http://joschu.net/blog/kl-approx.html), with x = log pi(y_t) - log pi_ref(y_t):

    k1  = x                                     unbiased, high variance, can be negative
    abs = |x|                                   biased, >= 0
    k2  = x^2 / 2                               biased, low variance, >= 0
    k3  = min(exp(-x) - 1 + x, K3_CAP)          unbiased below the cap, low variance, >= 0 (GRPO's)

k3's value is capped at K3_CAP (verl's and OpenRLHF's 10): a token beyond the cap carries no KL
gradient, and inside it |d k3 / d log pi| = |1 - exp(-x)| < K3_MAX_GRAD. Without the cap the
gradient grows as exp(-x) (-147 at x = -5, -4.4e8 at -19.9), so one token the policy finds far
less likely than the reference could dominate a step.

Straight-through forms take the value of one and the gradient of another (v + sg(u - v)):
`k3_grad_k2` has k3's value and k2's gradient, x grad log pi, which is the unbiased gradient of
KL(pi || pi_ref) in the loss (the gradient of k3 itself is not: Zhang et al. 2025, "On the design
of KL-regularized policy gradient algorithms", arXiv:2505.17508; verl's `k3+`); `k1_grad_k2` has
k1's value and the same gradient (verl's `k1+`). k3's value with k1's gradient is not offered: the
expectation of grad log pi under pi is zero, so as a loss term it regularises nothing on average,
and as a reward penalty it is k3.

The log-ratio is clamped to [-clamp, clamp] first (no gradient beyond it), so that one token the
reference finds nearly impossible cannot turn the loss into inf; the gradients of k2, k3_grad_k2
and k1_grad_k2 are therefore at most `clamp` per token, those of k1 and abs 1.
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "abs", "k2", "k3", "k3_grad_k2", "k1_grad_k2"]

K3_CAP = 10.0
# |d k3 / d log pi| just inside the cap: where exp(-x) - 1 + x = K3_CAP with x < 0 the gradient is
# 1 - exp(-x) = x - K3_CAP, so its size is K3_CAP + 2.61087 (x > 0 gives less than 1).
K3_MAX_GRAD = 12.61087


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator, *, clamp: float
) -> torch.Tensor:
    x = (logprobs - ref_logprobs).clamp(-clamp, clamp)
    if estimator == "k1":
        return x
    if estimator == "abs":
        return x.abs()
    k2 = 0.5 * x**2
    if estimator == "k2":
        return k2
    if estimator == "k1_grad_k2":
        return k2 + (x - k2).detach()
    k3 = (torch.exp(-x) - 1 + x).clamp(max=K3_CAP)
    if estimator == "k3":
        return k3
    if estimator == "k3_grad_k2":
        return k2 + (k3 - k2).detach()
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, abs, k2, k3, k3_grad_k2 or k1_grad_k2)")
