"""From flat samples (tokens + offsets, as stored in the spool) to padded training tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from relax_hpc.exchange.spool import SampleBatch


@dataclass(slots=True)
class TrainBatch:
    """Right-padded next-token training tensors for n samples.

    input_ids[i, t] predicts targets[i, t] = input_ids[i, t + 1]; loss_mask marks the targets
    that are model-generated completion tokens. rollout_logprobs are aligned with targets.
    """

    input_ids: torch.Tensor  # long [n, T]
    attention_mask: torch.Tensor  # long [n, T]
    targets: torch.Tensor  # long [n, T]
    loss_mask: torch.Tensor  # float [n, T]
    rollout_logprobs: torch.Tensor  # float [n, T]
    rewards: torch.Tensor  # float [n]
    group_ids: torch.Tensor  # long [n]

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(**{f: getattr(self, f).to(device) for f in self.__dataclass_fields__})

    @property
    def num_tokens(self) -> float:
        return float(self.loss_mask.sum())

    @property
    def num_samples(self) -> int:
        return int(self.rewards.shape[0])

    def select(self, rows: torch.Tensor) -> TrainBatch:
        return TrainBatch(**{f: getattr(self, f)[rows] for f in self.__dataclass_fields__})

    def without_loss(self) -> TrainBatch:
        """The same rows contributing nothing: what a rank with no samples in a mini-batch runs, so
        that it still joins the collectives of the forward and backward passes."""
        return TrainBatch(
            **{
                **{f: getattr(self, f) for f in self.__dataclass_fields__},
                "loss_mask": torch.zeros_like(self.loss_mask),
            }
        )

    def minibatches(self, count: int) -> list[torch.Tensor]:
        """Row indices of `count` mini-batches of whole groups (groups dealt out in order of first
        appearance, contiguous runs); some are empty when there are fewer groups than `count`."""
        _, sizes = torch.unique_consecutive(self.group_ids, return_counts=True)
        bounds = [0, *torch.cumsum(sizes, 0).tolist()]  # row where each group starts, then the end
        per = -(-(len(bounds) - 1) // count)  # groups per mini-batch, rounded up
        edges = [bounds[min(k * per, len(bounds) - 1)] for k in range(count + 1)]
        return [torch.arange(edges[k], edges[k + 1]) for k in range(count)]


def pad_samples(
    sequences: list[list[int]],
    loss_masks: list[list[int]],
    rollout_logprobs: list[list[float]],
    rewards: list[float],
    group_ids: list[int],
    pad_token_id: int,
) -> TrainBatch:
    """Each sequence is prompt + completion; loss_masks and rollout_logprobs are per token of it."""
    n = len(sequences)
    width = max(len(s) for s in sequences)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.float32)
    logps = torch.zeros((n, width), dtype=torch.float32)
    for i, seq in enumerate(sequences):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        mask[i, : len(seq)] = torch.tensor(loss_masks[i], dtype=torch.float32)
        logps[i, : len(seq)] = torch.tensor(rollout_logprobs[i], dtype=torch.float32)
    # Shift by one: position t's logits score token t + 1.
    targets = torch.cat([input_ids[:, 1:], torch.full((n, 1), pad_token_id)], dim=1)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        targets=targets,
        loss_mask=torch.cat([mask[:, 1:], torch.zeros((n, 1))], dim=1),
        rollout_logprobs=torch.cat([logps[:, 1:], torch.zeros((n, 1))], dim=1),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.tensor(group_ids, dtype=torch.long),
    )


def token_logprobs_and_entropy(
    model: torch.nn.Module, batch: TrainBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of every target token and the entropy of its distribution, both [n, T],
    under the sampling distribution: logits divided by the temperature, as the engines report
    their log-probabilities (so that ratios against them are 1 for the same weights)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logprobs = torch.gather(logp_all, -1, batch.targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


def share_of(
    batch: SampleBatch, trained: list[int], rank: int, world: int, pad_id: int
) -> tuple[TrainBatch, dict[str, Any]]:
    """This rank's share of the `trained` samples of a batch: whole groups, dealt round-robin in
    group order."""
    groups = sorted(set(batch.group_ids[trained].tolist()))
    mine = set(groups[rank::world])
    # A rank without a group (fewer groups than ranks) trains one row without loss tokens: it must
    # still join every collective of the step.
    rows = [i for i in trained if batch.group_ids[i] in mine] or trained[:1]
    seqs = [batch.sample_tokens(i).tolist() for i in rows]
    masks = [batch.loss_mask[batch.offsets[i] : batch.offsets[i + 1]].tolist() for i in rows]
    logps = [batch.rollout_logprobs[batch.offsets[i] : batch.offsets[i + 1]].tolist() for i in rows]
    tb = pad_samples(seqs, masks, logps, batch.rewards[rows].tolist(), batch.group_ids[rows].tolist(), pad_id)
    if not mine:
        tb = tb.without_loss()
    stats = {
        "reward_sum": float(batch.rewards[trained].sum()),
        "num_samples": len(trained),
        "seq": batch.seq,
        "policy_versions": batch.policy_version[trained],
    }
    return tb, stats
