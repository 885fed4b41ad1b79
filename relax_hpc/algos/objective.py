"""The configured objective: algo.* settings -> the functions of this package, composed.

The trainer backend computes log-probabilities (current, proximal, reference, teacher) and
values with its models; everything it does with them is here, so that every backend trains the
same objective and the learning tests exercise exactly what runs at scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax_hpc.algos import advantages as adv_lib
from relax_hpc.algos import policy_losses
from relax_hpc.algos.aggregation import Normalizer, aggregate
from relax_hpc.algos.comm import LOCAL, Comm
from relax_hpc.algos.kl import kl_estimate
from relax_hpc.algos.off_policy import behaviour_weights
from relax_hpc.algos.stats import Stats
from relax_hpc.algos.value import value_loss
from relax_hpc.config.schema import AlgoConfig


@dataclass(slots=True)
class Advantages:
    advantages: torch.Tensor  # [n, T]
    returns: torch.Tensor | None = None  # [n, T], gae only: the critic's targets


class Objective:
    def __init__(self, algo: AlgoConfig, comm: Comm = LOCAL) -> None:
        """`algo` as JobConfig resolves it: its settings that depend on others are concrete."""
        off, loss = algo.off_policy, algo.policy_loss
        assert off.old_logprobs != "auto" and loss.aggregation_constant > 0, "pass a resolved JobConfig's algo"
        self.cfg, self.comm = algo, comm
        self.old_is_rollout = off.old_logprobs == "rollout"
        self.needs_reference = algo.kl.coef > 0
        self.needs_teacher = algo.advantage.estimator == "distill"
        self.needs_critic = algo.advantage.estimator == "gae"
        self.agg_constant = float(loss.aggregation_constant)

    # -- advantages -------------------------------------------------------------------------------

    def advantages(
        self,
        rewards: torch.Tensor,
        group_ids: torch.Tensor,
        mask: torch.Tensor,
        old_logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor | None = None,
        teacher_logprobs: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        baselines: torch.Tensor | None = None,
    ) -> Advantages:
        """old_logprobs: the policy that sampled (as far as the ratio is concerned), for the KL
        reward penalty and the distillation advantage; baselines: each sample's greedy reward
        (remax; NaN where the greedy episode's reward failed). All inputs carry no gradient."""
        a, kl = self.cfg.advantage, self.cfg.kl
        penalty = torch.zeros_like(mask)
        if self.needs_reference and kl.placement == "reward":
            clamp = self.cfg.policy_loss.log_ratio_clamp
            assert ref_logprobs is not None, "kl.coef > 0 needs the reference's log-probabilities"
            penalty = -kl.coef * kl_estimate(old_logprobs, ref_logprobs, kl.estimator, clamp=clamp) * mask
        if a.estimator == "remax":
            assert baselines is not None, "remax needs the greedy baselines"
            # Each token gets its reward-to-go: the outcome plus the KL penalty of this and the later
            # tokens (an earlier token's penalty does not depend on this token's choice), as in verl.
            per_sample = adv_lib.remax(rewards, baselines, group_ids)
            return Advantages(adv_lib.per_token(per_sample, mask) + adv_lib.discounted_returns(penalty, mask, 1.0))
        if a.estimator in ("grpo", "rloo"):
            rewards = rewards + penalty.sum(-1)
            if a.estimator == "grpo":
                per_sample = adv_lib.grpo(rewards, group_ids, normalize_std=a.normalize_std, eps=a.std_eps)
            else:
                per_sample = adv_lib.rloo(rewards, group_ids)
            return Advantages(adv_lib.per_token(per_sample, mask))
        if a.estimator == "distill":
            assert teacher_logprobs is not None, "the distill estimator needs the teacher's log-probabilities"
            return Advantages(adv_lib.distillation(old_logprobs, teacher_logprobs, mask))
        if a.estimator == "reinforce_pp_baseline":
            rewards = adv_lib.grpo(rewards, group_ids, normalize_std=False, eps=0.0)
        token_rewards = adv_lib.outcome_on_last_token(rewards, mask) + penalty
        if a.estimator in ("reinforce_pp", "reinforce_pp_baseline"):
            return Advantages(adv_lib.reinforce_pp(token_rewards, mask, a.gamma, self.comm))
        assert values is not None, "gae needs the critic's values"
        advantages, returns = adv_lib.gae(token_rewards, values, mask, a.gamma, a.lam)
        if a.whiten:
            advantages = adv_lib.masked_whiten(advantages, mask, self.comm)
        return Advantages(advantages, returns)

    # -- losses ---------------------------------------------------------------------------------

    def _policy_terms(
        self, logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> policy_losses.PolicyTerms:
        p = self.cfg.policy_loss
        clamp = p.log_ratio_clamp
        if p.kind == "ppo":
            return policy_losses.ppo(
                logprobs,
                old,
                adv,
                clip_low=p.clip_low,
                clip_high=p.clip_high,
                dual_clip=p.dual_clip,
                log_ratio_clamp=clamp,
            )
        if p.kind == "gspo":
            return policy_losses.gspo(
                logprobs, old, adv, mask, clip_low=p.clip_low, clip_high=p.clip_high, log_ratio_clamp=clamp
            )
        if p.kind == "sapo":
            return policy_losses.sapo(
                logprobs, old, adv, tau_pos=p.sapo_tau_pos, tau_neg=p.sapo_tau_neg, log_ratio_clamp=clamp
            )
        if p.kind == "cispo":
            return policy_losses.cispo(
                logprobs, old, adv, clip_low=p.clip_low, clip_high=p.clip_high, log_ratio_clamp=clamp
            )
        if p.kind == "gmpo":
            return policy_losses.gmpo(
                logprobs, old, adv, mask, log_bounds=(-p.clip_low, p.clip_high), log_ratio_clamp=clamp
            )
        if p.kind == "m2po":
            return policy_losses.m2po(logprobs, old, adv, mask, tau=p.m2po_tau, log_ratio_clamp=clamp, comm=self.comm)
        return policy_losses.reinforce(logprobs, adv)

    def policy_loss(
        self,
        logprobs: torch.Tensor,
        entropy: torch.Tensor,
        old_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        norm: Normalizer,
        ref_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Stats]:
        """This rank's share of the mini-batch loss (summing it over ranks gives the loss)."""
        p, kl, off = self.cfg.policy_loss, self.cfg.kl, self.cfg.off_policy
        weight, mismatch = behaviour_weights(
            old_logprobs,
            rollout_logprobs,
            off.correction,
            cap=off.is_cap,
            low=off.icepop_low,
            high=off.icepop_high,
            log_ratio_clamp=p.log_ratio_clamp,
            mask=mask,
        )
        loss_mask, norm = self._rejected_removed(mask, weight, norm)
        terms = self._policy_terms(logprobs, old_logprobs, advantages, loss_mask)
        per_token = terms.loss * weight - p.entropy_coef * entropy
        stats = Stats()
        if self.needs_reference:
            assert ref_logprobs is not None, "kl.coef > 0 needs the reference's log-probabilities"
            divergence = kl_estimate(logprobs, ref_logprobs, kl.estimator, clamp=p.log_ratio_clamp)
            if kl.placement == "loss":
                per_token = per_token + kl.coef * divergence
            stats.mean_of("kl_ref", divergence, mask)
            stats.mean_of("kl_ref_k1", (logprobs - ref_logprobs).detach(), mask)
        loss = aggregate(
            per_token, loss_mask, p.aggregation, Normalizer(norm.tokens, norm.sequences, self.agg_constant)
        )
        log_ratio = (logprobs - old_logprobs).detach().clamp(-p.log_ratio_clamp, p.log_ratio_clamp)
        stats.add_sum("tokens", mask.sum())
        stats.mean_of("pg_loss", terms.loss * weight, mask)
        stats.mean_of("entropy", entropy, mask)
        # A token with a zero advantage has no policy gradient to clip: every loss counts the others only.
        stats.mean_of("clip_fraction", (terms.clipped & (advantages != 0)).to(mask.dtype), mask)
        # k3 estimate of KL(pi_old || pi) on tokens sampled from pi_old: (r - 1) - log r
        stats.mean_of("approx_kl", torch.exp(log_ratio) - 1 - log_ratio, mask)
        stats.mean_of("kl_k1", -log_ratio, mask)  # the plain estimate, log pi_old - log pi
        stats.mean_of("ratio_mean", terms.ratio, mask)
        stats.range_of("ratio", terms.ratio, mask)
        stats.mean_of("advantage_mean", advantages, mask)
        stats.mean_of("advantage_abs_mean", advantages.abs(), mask)
        stats.range_of("advantage", advantages, mask)
        stats.mean_of("rollout_mismatch_mean", mismatch, mask)
        # |trainer - engine| log-probability of the sampled tokens: the agreement of the two
        # forward passes (precision, kernels, and for media the processing) when the samples are
        # on-policy (max_staleness 0) and the step has one mini-batch; policy drift adds to it otherwise.
        stats.mean_of("logprob_diff_abs", (logprobs.detach() - rollout_logprobs).abs(), mask)
        stats.range_of("rollout_mismatch", mismatch, mask)
        if off.correction != "none":
            stats.mean_of("is_weight_mean", weight, mask)
            stats.mean_of("is_dropped_fraction", (weight == 0).to(mask.dtype), mask)
        return loss, stats

    def _rejected_removed(
        self, mask: torch.Tensor, weight: torch.Tensor, norm: Normalizer
    ) -> tuple[torch.Tensor, Normalizer]:
        """(mask, counts) of the loss: with mis_rejects=token, without the tokens mis or seq_mis
        rejected (their counts summed over ranks: one all-reduce per call)."""
        off = self.cfg.off_policy
        if off.mis_rejects != "token" or off.correction not in ("mis", "seq_mis"):
            return mask, norm
        kept = mask * (weight > 0).to(mask.dtype)
        lost_tokens = (mask - kept).sum()
        lost_sequences = ((mask.sum(-1) > 0) & (kept.sum(-1) == 0)).sum().to(mask.dtype)
        lost = self.comm.all_sum(torch.stack([lost_tokens, lost_sequences]).double())
        return kept, Normalizer(norm.tokens - float(lost[0]), norm.sequences - float(lost[1]), norm.constant)

    def critic_loss(
        self,
        values: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        mask: torch.Tensor,
        norm: Normalizer,
    ) -> tuple[torch.Tensor, Stats]:
        critic = self.cfg.critic
        per_token, clipped = value_loss(values, old_values, returns, critic.value_clip)
        stats = Stats()
        stats.mean_of("value_loss", per_token, mask)
        stats.mean_of("value_mean", values, mask)
        stats.mean_of("return_mean", returns, mask)
        stats.mean_of("value_clip_fraction", clipped.to(mask.dtype), mask)
        constant = Normalizer(norm.tokens, norm.sequences, self.agg_constant)
        return aggregate(per_token, mask, critic.loss_aggregation, constant), stats
