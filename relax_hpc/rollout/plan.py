"""The plan of every batch: its prompts, the sampling seed of each sample, its group ids, and how
sampled prompt groups become a training batch (rewards with their shaping, dynamic sampling:
algo.dynamic_sampling, algo.overlong; relax_hpc.algos.shaping has the formulas).

Shared by the rollout driver and the single-process loop (relax_hpc.inprocess), so that both build
batches the same way. Round r of batch `seq` is fully determined by (run seed, seq, r): round 0 is
the batch's own prompts, later rounds draw from a second prompt order, every sample's seed derives
from (run seed, seq, its group's index), and a restart regenerates exactly the same batch. A
group's samples have consecutive seeds (s, s + 1, ...): what vLLM gives the completions of one
request with n = group_size and seed s (vllm/v1/engine/parallel_sampling.py), so a group sent as
one request samples what its samples sent one by one would.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from relax_hpc.algos.shaping import informative, overlong_penalty
from relax_hpc.config.schema import JobConfig
from relax_hpc.data.prompts import PromptOrder, PromptRow
from relax_hpc.envs.base import Trajectory
from relax_hpc.exchange.spool import SampleBatch


def sample_seed(run_seed: int, seq: int, sample: int) -> int:
    """The sampling seed of sample `sample` of batch `seq`: a non-negative int64."""
    digest = hashlib.blake2b(f"{run_seed}:{seq}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclass(slots=True)
class Group:
    """One prompt's trajectories (group_size episodes, each one or more trajectories) and their
    shaped rewards."""

    group_id: int
    prompt_index: int
    trajectories: list[Trajectory]
    rewards: list[float]
    baseline: float | None = None  # ReMax: the shaped reward of the prompt's greedy episode


@dataclass(slots=True)
class Selection:
    groups: list[Group]
    rounds: int  # sampling rounds it took
    dropped: int  # groups set aside because their rewards were all equal
    topped_up: int  # of those, how many were put back to keep the batch size
    # The mean reward of the batch's own prompts (round 0) before any group is dropped: the
    # policy's reward on the data, which the kept groups' mean is not once zero-signal groups go.
    sampled_reward: float


class BatchPlan:
    """Which prompts, seeds and group ids each sampling round of a batch uses, and its rewards."""

    def __init__(self, cfg: JobConfig, rows: list[PromptRow]) -> None:
        self.cfg, self.rows = cfg, rows
        ds = cfg.algo.dynamic_sampling
        self.rounds = ds.max_rounds if ds.enabled else 1
        self.order = PromptOrder(len(rows), cfg.run.seed, cfg.data.shuffle)
        self.extra_order = PromptOrder(len(rows), cfg.run.seed, cfg.data.shuffle, stream=1)

    def prompts(self, seq: int, round_: int) -> list[int]:
        n = self.cfg.rollout.prompts_per_step
        if round_ == 0:
            return self.order.batch(seq, n)
        return self.extra_order.batch(seq * (self.rounds - 1) + round_ - 1, n)

    def group_id(self, seq: int, round_: int, j: int) -> int:
        return (seq * self.rounds + round_) * self.cfg.rollout.prompts_per_step + j

    def seeds(self, seq: int, round_: int, count: int) -> list[int]:
        """The sampling seeds of a round's `count` samples (prompt-major, group_size per prompt):
        sample i of the round's group j has its group's seed + i."""
        ro = self.cfg.rollout
        first_group = round_ * ro.prompts_per_step
        return [
            sample_seed(self.cfg.run.seed, seq, first_group + k // ro.group_size) + k % ro.group_size
            for k in range(count)
        ]

    def shaped(self, reward: float, trajectory: Trajectory) -> float:
        """The task reward plus the overlong penalty on the trajectory's sampled tokens."""
        ov = self.cfg.algo.overlong
        sampled = sum(trajectory.loss_mask)
        return reward + overlong_penalty(sampled, self.cfg.rollout.max_new_tokens, ov.buffer, ov.penalty)

    async def select(self, sample_round: Callable[[int], Awaitable[list[Group]]]) -> Selection:
        """Sample rounds until prompts_per_step informative groups are found (or rounds run out)."""
        wanted = self.cfg.rollout.prompts_per_step
        first = await sample_round(0)
        sampled_reward = _mean_reward(first)
        if self.rounds == 1:
            return Selection(first, 1, 0, 0, sampled_reward)
        kept: list[Group] = []
        dropped: list[Group] = []
        rounds, groups = 0, first
        while True:
            for group in groups:
                (kept if informative(group.rewards) else dropped).append(group)
            rounds += 1
            if len(kept) >= wanted or rounds == self.rounds:
                break
            groups = await sample_round(rounds)
        top_up = max(0, wanted - len(kept))
        return Selection(
            kept[:wanted] + dropped[:top_up], rounds, len(dropped), min(top_up, len(dropped)), sampled_reward
        )


def _mean_reward(groups: list[Group]) -> float:
    rewards = [r for group in groups for r in group.rewards]
    return sum(rewards) / max(len(rewards), 1)


def to_sample_batch(seq: int, groups: list[Group]) -> SampleBatch:
    """The groups' trajectories as one spool batch: prompt then the trajectory's tokens, with its
    loss mask, log-probabilities and per-token versions; a sample's policy version is the oldest
    of its sampled tokens (what staleness is judged by). A sample without one (its completion cut
    before a media token it sampled first) has nothing to age: it takes the batch's newest version.
    Version 0 made its whole group stale, and a batch of such groups, trained by nothing, stalled
    the driver at its staleness bound (the motion task's seed 2, at step 81)."""
    samples = [(grp, t, r) for grp in groups for t, r in zip(grp.trajectories, grp.rewards, strict=True)]
    newest = max((v for _, t, _ in samples for v in t.versions if v >= 0), default=0)
    return SampleBatch.from_samples(
        seq=seq,
        sequences=[t.prompt_ids + t.tokens for _, t, _ in samples],
        prompt_lens=[len(t.prompt_ids) for _, t, _ in samples],
        logprobs=[t.logprobs for _, t, _ in samples],
        rewards=[r for _, _, r in samples],
        group_ids=[grp.group_id for grp, _, _ in samples],
        policy_version=[min((v for v in t.versions if v >= 0), default=newest) for _, t, _ in samples],
        prompt_index=[grp.prompt_index for grp, _, _ in samples],
        media={grp.group_id: grp.trajectories[0].media for grp in groups if grp.trajectories[0].media},
        loss_masks=[t.loss_mask for _, t, _ in samples],
        token_versions=[t.versions for _, t, _ in samples],
        routed=[t.routed for _, t, _ in samples],
        baselines=[grp.baseline for grp, _, _ in samples],
    )
