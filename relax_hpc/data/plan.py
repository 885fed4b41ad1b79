"""The plan of every batch: its prompts, the sampling seed of each sample, its group ids, and how
sampled prompt groups become a training batch (rewards with their shaping, dynamic sampling:
algo.dynamic_sampling, algo.overlong; relax_hpc.algos.shaping has the formulas).

Shared by the rollout driver and the single-process loop (relax_hpc.inprocess), so that both build
batches the same way. Round r of batch `seq` is fully determined by (run seed, seq, r): round 0 is
the batch's own prompts, later rounds draw from a second prompt order, every sample's seed derives
from (run seed, seq, its index), and a restart regenerates exactly the same batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from relax_hpc.algos.shaping import informative, overlong_penalty
from relax_hpc.config.schema import JobConfig
from relax_hpc.data.media import Kind
from relax_hpc.data.prompts import PromptOrder, PromptRow
from relax_hpc.exchange.spool import SampleBatch
from relax_hpc.rewards import REWARDS


def sample_seed(run_seed: int, seq: int, sample: int) -> int:
    """The sampling seed of sample `sample` of batch `seq`: a non-negative int64."""
    digest = hashlib.blake2b(f"{run_seed}:{seq}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclass(slots=True)
class Group:
    """One prompt sampled group_size times."""

    group_id: int
    prompt_index: int
    prompt_ids: list[int]  # as the engine conditioned on them (placeholders expanded for media)
    completions: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[float]
    versions: list[int]
    media: list[tuple[Kind, bytes]] = field(default_factory=list)  # the prompt's items, stored once


@dataclass(slots=True)
class Selection:
    groups: list[Group]
    rounds: int  # sampling rounds it took
    dropped: int  # groups set aside because their rewards were all equal
    topped_up: int  # of those, how many were put back to keep the batch size


class BatchPlan:
    """Which prompts, seeds and group ids each sampling round of a batch uses, and its rewards."""

    def __init__(self, cfg: JobConfig, rows: list[PromptRow]) -> None:
        self.cfg, self.rows = cfg, rows
        ds = cfg.algo.dynamic_sampling
        self.rounds = ds.max_rounds if ds.enabled else 1
        self.order = PromptOrder(len(rows), cfg.run.seed, cfg.data.shuffle)
        self.extra_order = PromptOrder(len(rows), cfg.run.seed, cfg.data.shuffle, stream=1)
        self.reward_fn = REWARDS[cfg.rollout.reward]

    def prompts(self, seq: int, round_: int) -> list[int]:
        n = self.cfg.rollout.prompts_per_step
        if round_ == 0:
            return self.order.batch(seq, n)
        return self.extra_order.batch(seq * (self.rounds - 1) + round_ - 1, n)

    def group_id(self, seq: int, round_: int, j: int) -> int:
        return (seq * self.rounds + round_) * self.cfg.rollout.prompts_per_step + j

    def sample_index(self, round_: int, k: int) -> int:
        """Index of sample k of a round among all samples of its batch (seeds derive from it)."""
        ro = self.cfg.rollout
        return round_ * ro.prompts_per_step * ro.group_size + k

    def seeds(self, seq: int, round_: int, count: int) -> list[int]:
        """The sampling seeds of a round's `count` samples (prompt-major, group_size per prompt)."""
        return [sample_seed(self.cfg.run.seed, seq, self.sample_index(round_, k)) for k in range(count)]

    def reward(self, text: str, length: int, prompt_index: int) -> float:
        """The task reward plus the overlong penalty of a completion of `length` tokens."""
        ov = self.cfg.algo.overlong
        penalty = overlong_penalty(length, self.cfg.rollout.max_new_tokens, ov.buffer, ov.penalty)
        return self.reward_fn(text, self.rows[prompt_index].answer) + penalty

    def groups(
        self,
        seq: int,
        round_: int,
        prompt_ids: list[list[int]],
        completions: list[list[int]],
        logprobs: list[list[float]],
        texts: list[str],
        versions: list[int],
        media: list[list[tuple[Kind, bytes]]] | None = None,
    ) -> list[Group]:
        """Group a round's samples (prompt-major: group_size samples of prompt j at j*g...) and
        score them. prompt_ids: the round's prompts, one per group (expanded as the engine
        expanded them); media: each prompt's items."""
        g = self.cfg.rollout.group_size
        indices = self.prompts(seq, round_)
        out = []
        for j, index in enumerate(indices):
            mine = range(j * g, (j + 1) * g)
            out.append(
                Group(
                    group_id=self.group_id(seq, round_, j),
                    prompt_index=index,
                    prompt_ids=prompt_ids[j],
                    completions=[completions[k] for k in mine],
                    logprobs=[logprobs[k] for k in mine],
                    rewards=[self.reward(texts[k], len(completions[k]), index) for k in mine],
                    versions=[versions[k] for k in mine],
                    media=media[j] if media else [],
                )
            )
        return out

    def select(self, sample_round: Callable[[int], list[Group]]) -> Selection:
        """Sample rounds until prompts_per_step informative groups are found (or rounds run out)."""
        wanted = self.cfg.rollout.prompts_per_step
        if self.rounds == 1:
            return Selection(sample_round(0), 1, 0, 0)
        kept: list[Group] = []
        dropped: list[Group] = []
        rounds = 0
        while len(kept) < wanted and rounds < self.rounds:
            for group in sample_round(rounds):
                (kept if informative(group.rewards) else dropped).append(group)
            rounds += 1
        top_up = max(0, wanted - len(kept))
        return Selection(kept[:wanted] + dropped[:top_up], rounds, len(dropped), min(top_up, len(dropped)))


def to_sample_batch(seq: int, groups: list[Group]) -> SampleBatch:
    samples = [(grp, k) for grp in groups for k in range(len(grp.completions))]
    return SampleBatch.from_samples(
        seq=seq,
        sequences=[grp.prompt_ids + grp.completions[k] for grp, k in samples],
        prompt_lens=[len(grp.prompt_ids) for grp, _ in samples],
        logprobs=[grp.logprobs[k] for grp, k in samples],
        rewards=[grp.rewards[k] for grp, k in samples],
        group_ids=[grp.group_id for grp, _ in samples],
        policy_version=[grp.versions[k] for grp, k in samples],
        prompt_index=[grp.prompt_index for grp, _ in samples],
        media={grp.group_id: grp.media for grp in groups if grp.media},
    )
