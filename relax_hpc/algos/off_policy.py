"""Corrections for tokens sampled by a policy other than the one the loss differentiates.

Three policies take part in an asynchronous step: the behaviour policy that sampled the token
(the engine's log-probabilities, `rollout_logprobs`), the proximal policy (the trainer's own
log-probabilities before this batch's first update) and the current one being trained. The PPO
ratio is taken against the proximal policy; the mismatch w = pi_prox / pi_behav (rollout engine
numerics, and staleness when rollout runs ahead) becomes a per-token weight on the policy loss:

- tis: truncated importance sampling, min(w, cap) (Yao et al. 2025, "Your efficient RL
  framework secretly brings you off-policy RL training").
- icepop: w where low <= w <= high, 0 outside: out-of-band tokens are dropped (Ling team 2025,
  IcePop in "Every step evolves", arXiv:2510.18855).
- decoupled: decoupled PPO (Fu et al. 2025, AReaL, arXiv:2505.24298): w, with the tokens whose w
  exceeds cap dropped.
- mis: masked importance sampling per token: weight 1 where low <= w <= high, 0 outside (the
  mismatch is not reweighted, only out-of-band tokens are dropped).
- seq_tis, seq_mis: the same at the sequence level, with the sequence's w_i = prod_t w_it (the
  importance ratio of the whole sample): seq_tis weighs every token of sample i by min(w_i, cap),
  seq_mis keeps the sample (weight 1) only when low <= w_i <= high (Liu et al. 2025, "When speed
  kills stability: demystifying RL collapse from the training-inference mismatch"; verl's rollout
  correction at the sequence level).

The weight carries no gradient; it multiplies the policy loss only (not the KL or entropy terms).
"""

from __future__ import annotations

from typing import Literal

import torch

Correction = Literal["none", "tis", "icepop", "decoupled", "mis", "seq_tis", "seq_mis"]


def behaviour_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    correction: Correction,
    *,
    cap: float,
    low: float,
    high: float,
    log_ratio_clamp: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, raw w), both [n, T] and detached; weight is 1 everywhere for `none`. The
    sequence-level corrections need the loss mask (which tokens make up each sample)."""
    log_w = (proximal_logprobs - behaviour_logprobs).detach()
    w = torch.exp(log_w.clamp(-log_ratio_clamp, log_ratio_clamp))
    if correction in ("seq_tis", "seq_mis"):
        assert mask is not None, "sequence-level corrections need the loss mask"
        seq = torch.exp((log_w * mask).sum(-1, keepdim=True).clamp(-log_ratio_clamp, log_ratio_clamp))
        if correction == "seq_tis":
            return seq.clamp(max=cap).expand_as(w), w
        return ((seq >= low) & (seq <= high)).to(w.dtype).expand_as(w), w
    if correction == "none":
        return torch.ones_like(w), w
    if correction == "tis":
        return w.clamp(max=cap), w
    if correction == "icepop":
        return torch.where((w >= low) & (w <= high), w, 0.0), w
    if correction == "decoupled":
        return torch.where(w <= cap, w, 0.0), w
    if correction == "mis":
        return ((w >= low) & (w <= high)).to(w.dtype), w
    raise ValueError(f"unknown off-policy correction {correction!r}")
