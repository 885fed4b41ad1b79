"""Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman 2020,
http://joschu.net/blog/kl-approx.html), with log_ratio = log pi(y_t) - log pi_ref(y_t):

    k1 = log_ratio                              unbiased, high variance, can be negative
    k2 = log_ratio^2 / 2                        biased, low variance, >= 0
    k3 = exp(-log_ratio) - 1 + log_ratio        unbiased, low variance, >= 0 (GRPO's choice)

Straight-through forms take the value of one and the gradient of another (v + sg(u - v)):
`k3_grad_k2` has k3's value and k2's gradient, log_ratio * grad log pi, which is the unbiased
gradient of KL(pi || pi_ref) in the loss (the gradient of k3 itself is not: Zhang et al. 2025,
"On the design of KL-regularized policy gradient algorithms", arXiv:2505.17508; verl's `k3+`);
`k3_grad_k1` has k3's value and k1's gradient (grad log pi).

The log-ratio is clamped to [-clamp, clamp] first (no gradient beyond it), so that one token the
reference finds nearly impossible cannot turn the loss into inf.
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3", "k3_grad_k2", "k3_grad_k1"]


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator, *, clamp: float
) -> torch.Tensor:
    log_ratio = (logprobs - ref_logprobs).clamp(-clamp, clamp)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    k3 = torch.exp(-log_ratio) - 1 + log_ratio
    if estimator == "k3":
        return k3
    if estimator in ("k3_grad_k2", "k3_grad_k1"):
        grad_of = 0.5 * log_ratio**2 if estimator == "k3_grad_k2" else log_ratio
        return grad_of + (k3 - grad_of).detach()
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2, k3, k3_grad_k2 or k3_grad_k1)")
