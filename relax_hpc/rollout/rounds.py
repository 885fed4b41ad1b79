"""A sampling round: the environment run group_size times per prompt, rewards, prompt groups.

Shared by the rollout driver (engines over HTTP) and the single-process loop (its own sampler):
both hand a Policy to `Rounds` and get the same groups for the same batch, round and seeds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_hpc.config.schema import JobConfig, RolloutConfig
from relax_hpc.data.prompts import PromptRow
from relax_hpc.envs import load_env
from relax_hpc.envs.base import Trajectory
from relax_hpc.envs.context import Batcher, EpisodeContext, Policy, run_episodes
from relax_hpc.rewards import RewardError, RewardInput, Scorer
from relax_hpc.rollout.plan import BatchPlan, Group

log = logging.getLogger("relax_hpc.rollout")


@dataclass
class RoundStats:
    """What a batch's rounds did besides sampling (summed over its rounds)."""

    reward_failed: int = 0
    trajectories: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # sums of the trajectories' metrics
    sampled_tokens: int = 0
    observation_tokens: int = 0

    def add(self, trajectories: Sequence[Trajectory]) -> None:
        self.trajectories += len(trajectories)
        for t in trajectories:
            for name, value in t.metrics.items():
                self.metrics[name] = self.metrics.get(name, 0.0) + value
            sampled = sum(t.loss_mask)
            self.sampled_tokens += sampled
            self.observation_tokens += len(t.tokens) - sampled

    def record(self) -> dict[str, float]:
        """Per-trajectory means of the environment's metrics and the masked share of tokens."""
        n = max(self.trajectories, 1)
        tokens = max(self.sampled_tokens + self.observation_tokens, 1)
        return {
            "reward_failed": self.reward_failed,
            **{f"env_{name}": value / n for name, value in sorted(self.metrics.items())},
            "masked_token_share": self.observation_tokens / tokens,
        }


def sampling_params(ro: RolloutConfig) -> dict[str, Any]:
    """The configured sampling settings as SGLang sampling params (an env may override them)."""
    return {"max_new_tokens": ro.max_new_tokens, "temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k}


class Rounds:
    """Runs sampling rounds of batches (and evaluations) through a Policy."""

    def __init__(
        self,
        cfg: JobConfig,
        rows: list[PromptRow],
        prompt_ids: list[list[int]],
        tokenizer: Any,
        policy: Policy,
        scorer: Scorer,
        on_failure: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg, self.rows, self.prompt_ids, self.tokenizer = cfg, rows, prompt_ids, tokenizer
        self.plan = BatchPlan(cfg, rows)
        self.env = load_env(cfg.rollout.env.name, cfg.rollout.env.settings)
        self.batcher = Batcher(policy)
        self.scorer = scorer
        self.on_failure = on_failure
        self.sampling = sampling_params(cfg.rollout)
        self.stats = RoundStats()

    def _contexts(
        self, indices: Sequence[int], seeds: Sequence[int], evaluation: bool, sampling: dict[str, Any] | None = None
    ) -> list[EpisodeContext]:
        """`sampling`: the evaluation's (default: rollout's, greedy for an evaluation)."""
        if sampling is None:
            sampling = {**self.sampling, "temperature": 0.0} if evaluation else self.sampling
        settings = self.cfg.rollout.env.settings
        return [
            EpisodeContext(
                self.rows[i], self.prompt_ids[i], seed, self.batcher, sampling, self.tokenizer, settings, evaluation
            )
            for i, seed in zip(indices, seeds, strict=True)
        ]

    async def sample_round(self, seq: int, round_: int) -> list[Group]:
        """Round `round_` of batch `seq`: every prompt group_size times, scored and grouped (with
        the remax estimator, each prompt once more greedily: its reward is the group's baseline)."""
        g = self.cfg.rollout.group_size
        prompts = self.plan.prompts(seq, round_)
        copies = [i for i in prompts for _ in range(g)]
        greedy = prompts if self.cfg.algo.advantage.estimator == "remax" else []
        contexts = self._contexts(copies, self.plan.seeds(seq, round_, len(copies)), False)
        episodes = await run_episodes(self.env, contexts + self._contexts(greedy, [0] * len(greedy), True))
        per_prompt = [[t for episode in episodes[j * g : (j + 1) * g] for t in episode] for j in range(len(prompts))]
        baselines = await self._baselines(seq, greedy, episodes[len(copies) :]) if greedy else [None] * len(prompts)
        rewards = await self._rewards(seq, prompts, per_prompt)
        groups = []
        for j, index in enumerate(prompts):
            kept = [(t, r) for t, r in zip(per_prompt[j], rewards[j], strict=True) if r is not None]
            self.stats.add([t for t, _ in kept])
            if kept:
                trajectories = [t for t, _ in kept]
                shaped = [self.plan.shaped(r, t) for t, r in kept]
                groups.append(Group(self.plan.group_id(seq, round_, j), index, trajectories, shaped, baselines[j]))
        return groups

    async def _baselines(
        self, seq: int, prompts: Sequence[int], episodes: list[list[Trajectory]]
    ) -> list[float | None]:
        """Each greedy episode's shaped reward (the mean over its trajectories); None where its
        reward failed (the trainer then falls back to the group's mean)."""
        rewards = await self._rewards(seq, prompts, episodes)
        out: list[float | None] = []
        for trajectories, scores in zip(episodes, rewards, strict=True):
            kept = [self.plan.shaped(r, t) for t, r in zip(trajectories, scores, strict=True) if r is not None]
            out.append(sum(kept) / len(kept) if kept else None)
        return out

    async def _rewards(
        self, seq: int, prompts: Sequence[int], per_prompt: list[list[Trajectory]]
    ) -> list[list[float | None]]:
        """Each trajectory's task reward (its own, or the scorer's), None where scoring failed."""
        items = [(j, k, t) for j, ts in enumerate(per_prompt) for k, t in enumerate(ts)]
        to_score = [(j, k, t) for j, k, t in items if t.reward is None and not t.turn_rewards]
        inputs = [
            RewardInput(t.response, self.rows[prompts[j]].answer, self.rows[prompts[j]], t.metrics)
            for j, _, t in to_score
        ]
        scored = await self.scorer.score(inputs)
        out: list[list[float | None]] = [
            [t.reward if t.reward is not None else sum(t.turn_rewards) if t.turn_rewards else None for t in ts]
            for ts in per_prompt
        ]
        failed = []
        for (j, k, t), result in zip(to_score, scored, strict=True):
            out[j][k] = result.reward
            if result.reward is None:
                failed.append(
                    {"batch": seq, "prompt_index": prompts[j], "response": t.response[:500], "reason": result.error}
                )
        self._count_failures(failed, len(items))
        return out

    def _count_failures(self, failed: list[dict[str, Any]], total: int) -> None:
        if not failed:
            return
        self.stats.reward_failed += len(failed)
        for record in failed:
            log.warning(
                "reward failed for prompt %d of batch %d: %s", record["prompt_index"], record["batch"], record["reason"]
            )
            if self.on_failure is not None:
                self.on_failure(record)
        if len(failed) > self.cfg.reward.max_failed_share * total:
            raise RewardError(
                f"the reward failed for {len(failed)} of {total} samples of a round, more than "
                f"reward.max_failed_share={self.cfg.reward.max_failed_share}; the first: {failed[0]['reason']}"
            )

    async def evaluate(self, indices: Sequence[int]) -> float:
        """Greedy accuracy over rows `indices`: one episode each at temperature 0; a failed
        reward counts as wrong."""
        rewards = await self.evaluation_rewards(indices, [0] * len(indices))
        return sum(rewards) / max(len(indices), 1)

    async def evaluation_rewards(
        self, indices: Sequence[int], seeds: Sequence[int], sampling: dict[str, Any] | None = None
    ) -> list[float]:
        """The reward of one evaluation episode per row of `indices` (its first trajectory's), each
        with its seed, at `sampling` (default: greedy); a failed reward counts as 0 (wrong)."""
        episodes = await run_episodes(self.env, self._contexts(indices, seeds, True, sampling))
        inputs = [
            RewardInput(ts[0].response, self.rows[i].answer, self.rows[i], ts[0].metrics)
            for i, ts in zip(indices, episodes, strict=True)
        ]
        own = [ts[0].reward for ts in episodes]
        scored = await self.scorer.score([item for item, r in zip(inputs, own, strict=True) if r is None])
        it = iter(scored)
        return [r if r is not None else (next(it).reward or 0.0) for r in own]

    def take_stats(self) -> dict[str, float]:
        """The statistics since the last call (one batch's), for rollout.jsonl."""
        stats, self.stats = self.stats, RoundStats()
        return stats.record()
