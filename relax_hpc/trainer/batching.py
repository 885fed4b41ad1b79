"""From flat samples (tokens + offsets, as stored in the spool) to padded training tensors."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from relax_hpc.data.processor import MediaProcessor, ProcessorError, concat_inputs, rope_positions
from relax_hpc.exchange.spool import SampleBatch
from relax_hpc.models.hf import encoders
from relax_hpc.models.routing import replaying
from relax_hpc.models.routing import shape as routing_shape
from relax_hpc.trainer.prefix import PackedGroups, pack_groups, worth_it

log = logging.getLogger("relax_hpc.trainer")
TENSORS = (
    "input_ids",
    "attention_mask",
    "targets",
    "loss_mask",
    "rollout_logprobs",
    "rewards",
    "group_ids",
    "baselines",
)


@dataclass(slots=True)
class TrainBatch:
    """Right-padded next-token training tensors for n samples.

    input_ids[i, t] predicts targets[i, t] = input_ids[i, t + 1]; loss_mask marks the targets
    that are model-generated completion tokens. rollout_logprobs are aligned with targets.
    `media`: each row's processor tensors (pixel values, audio features; empty for a text row, the
    same objects for the rows of one prompt group), or () when no row has media.
    """

    input_ids: torch.Tensor  # long [n, T]
    attention_mask: torch.Tensor  # long [n, T]
    targets: torch.Tensor  # long [n, T]
    loss_mask: torch.Tensor  # float [n, T]
    rollout_logprobs: torch.Tensor  # float [n, T]
    rewards: torch.Tensor  # float [n]
    group_ids: torch.Tensor  # long [n]
    baselines: torch.Tensor  # float [n]: each sample's reward baseline (ReMax), NaN where none
    media: tuple[dict[str, torch.Tensor], ...] = field(default=())
    routed: torch.Tensor | None = None  # long [n, T, layers * top_k], -1: the router decides (replay)
    # float [n, T], aligned with targets: the teacher's log-probabilities from its engines (spool
    # schema 5), None when the trainer scores with its own teacher or there is none.
    teacher_logprobs: torch.Tensor | None = None

    def to(self, device: torch.device) -> TrainBatch:
        routed = None if self.routed is None else self.routed.to(device)
        teacher = None if self.teacher_logprobs is None else self.teacher_logprobs.to(device)
        return replace(
            self, routed=routed, teacher_logprobs=teacher, **{f: getattr(self, f).to(device) for f in TENSORS}
        )

    def model_inputs(self, model: torch.nn.Module) -> dict[str, Any]:
        """Everything the model's forward takes besides input_ids and attention_mask: the rows'
        processor tensors in row order, and multimodal RoPE positions from the model's own
        index when it has one (a Qwen VL model otherwise falls back to 1-D positions, silently)."""
        if not self.media:
            return {}
        device = self.input_ids.device
        inputs: dict[str, Any] = {k: v.to(device) for k, v in concat_inputs(list(self.media)).items()}
        rope = rope_positions(model, self.input_ids, self.attention_mask, inputs)
        if rope is not None:
            inputs["position_ids"] = rope[0]
        return inputs

    @property
    def num_tokens(self) -> float:
        return float(self.loss_mask.sum())

    @property
    def num_samples(self) -> int:
        return int(self.rewards.shape[0])

    def select(self, rows: torch.Tensor) -> TrainBatch:
        media = tuple(self.media[i] for i in rows.tolist()) if self.media else ()
        routed = None if self.routed is None else self.routed[rows]
        teacher = None if self.teacher_logprobs is None else self.teacher_logprobs[rows]
        return replace(
            self, media=media, routed=routed, teacher_logprobs=teacher, **{f: getattr(self, f)[rows] for f in TENSORS}
        )

    def without_loss(self) -> TrainBatch:
        """The same rows contributing nothing: what a rank with no samples in a mini-batch runs, so
        that it still joins the collectives of the forward and backward passes."""
        return replace(self, loss_mask=torch.zeros_like(self.loss_mask))

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
    media: tuple[dict[str, torch.Tensor], ...] = (),
    baselines: list[float] | None = None,
) -> TrainBatch:
    """Each sequence is prompt + completion; loss_masks and rollout_logprobs are per token of it;
    `media` (if any): each row's processor tensors; `baselines`: each row's reward baseline (NaN:
    none; default none)."""
    n = len(sequences)
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in sequences])
    flat = Flat(
        np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences]),
        np.concatenate([np.asarray(m, dtype=np.float32) for m in loss_masks]),
        np.concatenate([np.asarray(lp, dtype=np.float32) for lp in rollout_logprobs]),
        offsets,
    )
    return padded(
        flat,
        np.arange(n),
        np.asarray(rewards, dtype=np.float32),
        np.asarray(group_ids, dtype=np.int64),
        np.asarray(baselines if baselines is not None else [np.nan] * n, dtype=np.float32),
        pad_token_id,
        media,
    )


@dataclass(frozen=True, slots=True)
class Flat:
    """Samples stored back to back, as the spool holds them: sample i is [offsets[i], offsets[i + 1])
    of each per-token array."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    offsets: np.ndarray

    def grid(self, rows: np.ndarray, shift: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """([n, width] positions in the flat arrays, [n, width] mask of real entries) of `rows`
        laid out right-padded, shifted left by `shift` tokens; width is the longest row's length."""
        starts, lengths = self.offsets[rows], self.offsets[rows + 1] - self.offsets[rows]
        steps = np.arange(int(lengths.max()) if len(rows) else 0)
        real = steps < (lengths - shift)[:, None]
        return np.where(real, starts[:, None] + steps + shift, 0), real

    @staticmethod
    def take(values: np.ndarray, grid: tuple[np.ndarray, np.ndarray], fill: float) -> torch.Tensor:
        """A per-token array laid out on `grid` (from grid()) as a tensor, `fill` past each row's end."""
        index, real = grid
        real = real.reshape(real.shape + (1,) * (values.ndim - 1))  # per-token rows (routing) too
        return torch.from_numpy(np.where(real, values[index], np.asarray(fill, dtype=values.dtype)))


def padded(
    flat: Flat,
    rows: np.ndarray,
    rewards: np.ndarray,
    group_ids: np.ndarray,
    baselines: np.ndarray,
    pad_token_id: int,
    media: tuple[dict[str, torch.Tensor], ...] = (),
) -> TrainBatch:
    """`rows` of flat samples as right-padded next-token tensors, in one pass of array indexing
    (no per-sample Python: a GPU step holds thousands of samples). Position t's logits score
    token t + 1, so targets, loss mask and log-probabilities are the tokens' shifted by one."""
    tokens, shifted = flat.grid(rows), flat.grid(rows, shift=1)
    return TrainBatch(
        input_ids=flat.take(flat.tokens, tokens, pad_token_id).long(),
        attention_mask=torch.from_numpy(tokens[1]).long(),
        targets=flat.take(flat.tokens, shifted, pad_token_id).long(),
        loss_mask=flat.take(flat.loss_mask, shifted, 0).float(),
        rollout_logprobs=flat.take(flat.logprobs, shifted, 0).float(),
        rewards=torch.from_numpy(rewards[rows]).float(),
        group_ids=torch.from_numpy(group_ids[rows]).long(),
        baselines=torch.from_numpy(baselines[rows]).float(),
        media=media,
    )


def token_logprobs_and_entropy(
    model: torch.nn.Module, batch: TrainBatch, temperature: float = 1.0, share_prefix: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of every target token and the entropy of its distribution, both [n, T],
    under the sampling distribution: logits divided by the temperature, as the engines report
    their log-probabilities (so that ratios against them are 1 for the same weights). With
    `share_prefix`, each prompt group's common prefix runs once where that is cheaper and the
    model allows it (relax_hpc.trainer.prefix); the values are the padded forward's up to rounding."""
    packed = _packed(model, batch) if share_prefix else None
    if packed is not None:
        logits = model(input_ids=packed.input_ids, attention_mask=packed.mask, position_ids=packed.position_ids).logits
        logprobs, entropy = _logprobs_and_entropy(logits.float(), temperature)
        return packed.rows(logprobs).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1), packed.rows(entropy)
    inputs = batch.model_inputs(model)
    replay = nullcontext() if batch.routed is None else replaying(model, _per_layer(model, batch.routed))
    with replay:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **inputs).logits.float()
    logp_all, entropy = _logprobs_and_entropy(logits, temperature)
    return torch.gather(logp_all, -1, batch.targets.unsqueeze(-1)).squeeze(-1), entropy


def _logprobs_and_entropy(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every vocabulary entry's log-probability and the distribution's entropy, per position."""
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    return logp_all, -(logp_all.exp() * logp_all).sum(-1)


def _packed(model: torch.nn.Module, batch: TrainBatch) -> PackedGroups | None:
    """The batch packed by prompt group, or None where the padded forward stays: rows with media
    or replayed routes (their per-row inputs are laid out for padded rows), a model with encoders,
    sliding-window layers or an attention kernel that takes no 4-D mask (flash attention), or no
    saving."""
    config = getattr(model, "config", None)
    if batch.media or batch.routed is not None or encoders(model) or config is None:
        return None
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return None
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return None  # a custom mask replaces the model's own, and with it the window
    packed = pack_groups(batch.input_ids, batch.attention_mask, batch.group_ids)
    rows, width = batch.input_ids.shape
    return packed if worth_it(packed, rows, width, int(config.hidden_size)) else None


def _per_layer(model: torch.nn.Module, routed: torch.Tensor) -> torch.Tensor:
    """[n, T, layers * top_k] as [n, T, layers, top_k] for the model's routers."""
    layers_k = routing_shape(model)
    if layers_k is None:
        raise ValueError("routing replay needs an MoE model (algo.off_policy.routing_replay)")
    return routed.reshape(*routed.shape[:2], *layers_k)


def share_of(
    batch: SampleBatch,
    trained: list[int],
    rank: int,
    world: int,
    pad_id: int,
    processor: MediaProcessor | None = None,
    oldest_version: int | None = None,
) -> tuple[TrainBatch, dict[str, Any]]:
    """This rank's share of the `trained` samples of a batch: whole groups, dealt round-robin in
    group order. With media, `processor` rebuilds each group's model inputs from its stored
    media, once per group. With `oldest_version` (rollout.mask_stale_tokens), sampled tokens of
    an older version are left out of the loss."""
    groups = sorted(set(batch.group_ids[trained].tolist()))
    trained_rows = np.asarray(trained, dtype=np.int64)
    rows = trained_rows[np.isin(batch.group_ids[trained_rows], groups[rank::world])].tolist()
    media, mismatched = _group_inputs(batch, rows, processor) if len(batch.media_kind) else (None, set())
    kept = [k for k, i in enumerate(rows) if int(batch.group_ids[i]) not in mismatched]
    rows, media = [rows[k] for k in kept], None if media is None else tuple(media[k] for k in kept)
    stats = {
        "reward_sum": float(batch.rewards[trained].sum()),
        "num_samples": len(trained),
        "seq": batch.seq,
        "policy_versions": batch.policy_version[trained],
        "media_mismatched_groups": len(mismatched),
    }
    idle = _idle_media_row(batch, trained_rows, groups, processor) if media is not None and not any(media) else None
    if idle is not None:
        # A rank whose share carries no media (fewer groups than ranks, or text-only groups) runs
        # every encoder anyway: FSDP gathers an encoder's shards in its forward and reduces its
        # gradients in the backward, collectives every rank must join. It adds a row with media,
        # without loss (its loss mask cleared below).
        rows, media = [*rows, idle[0]], (*(media or ()), idle[1])
    if not rows:
        # A rank without a group (fewer groups than ranks) trains a row without loss tokens: it
        # must still join every collective of the step.
        dummy = pad_samples([[pad_id, pad_id]], [[0, 0]], [[0.0, 0.0]], [0.0], [-1], pad_id)
        if batch.teacher_logprobs is not None:  # the objective's distill advantage reads them
            dummy.teacher_logprobs = torch.zeros_like(dummy.rollout_logprobs)
        return dummy.without_loss(), stats
    loss_mask = batch.loss_mask
    if oldest_version is not None:
        assert batch.token_versions is not None, "derived at construction"
        stale = (loss_mask == 1) & (batch.token_versions < oldest_version)
        owner = np.repeat(np.arange(batch.num_samples), np.diff(batch.offsets))  # each token's sample
        stats["stale_tokens_masked"] = int(stale[np.isin(owner, rows)].sum())
        loss_mask = np.where(stale, 0, loss_mask)
    assert batch.reward_baseline is not None, "derived at construction"
    flat = Flat(batch.tokens, loss_mask, batch.rollout_logprobs, batch.offsets)
    picked = np.asarray(rows)
    tb = padded(flat, picked, batch.rewards, batch.group_ids, batch.reward_baseline, pad_id, media or ())
    if idle is not None:
        tb.loss_mask[-1] = 0
    if batch.routed_experts is not None:
        routed = flat.take(batch.routed_experts.astype(np.int64), flat.grid(picked), -1)
        tb.routed = routed.masked_fill(routed == np.iinfo(batch.routed_experts.dtype).max, -1)
    if batch.teacher_logprobs is not None:
        teacher = np.asarray(batch.teacher_logprobs, dtype=np.float32)
        tb.teacher_logprobs = flat.take(teacher, flat.grid(picked, shift=1), 0)
    return tb, stats


def _idle_media_row(
    batch: SampleBatch, trained: np.ndarray, groups: list[int], processor: MediaProcessor | None
) -> tuple[int, dict[str, torch.Tensor]] | None:
    """A trained row with media and its model inputs (the first group's that processes), or None."""
    for group in groups:
        if not batch.group_media(group):
            continue
        row = int(trained[batch.group_ids[trained] == group][0])
        inputs, mismatched = _group_inputs(batch, [row], processor)
        if not mismatched:
            return row, inputs[0]
    return None


def _group_inputs(
    batch: SampleBatch, rows: list[int], processor: MediaProcessor | None
) -> tuple[tuple[dict[str, torch.Tensor], ...], set[int]]:
    """Each row's processor tensors, made once per group from the group's stored media and the
    prompt the engine conditioned on (its expanded ids, as stored). A group whose prompt the
    trainer's processor expands differently (the engine's processor is not the model folder's:
    another version, other image settings) would train responses against shifted positions: it
    is kept out of the loss and counted, never trained."""
    if processor is None:
        raise ValueError("a batch with media needs the model's processor (MediaProcessor)")
    made: dict[int, dict[str, torch.Tensor]] = {}
    mismatched: set[int] = set()
    for i in rows:
        group = int(batch.group_ids[i])
        if group in made or group in mismatched:
            continue
        stored = batch.sample_tokens(i)[: batch.prompt_lens[i]].tolist()
        try:
            processed = processor.process(processor.collapse(stored), batch.group_media(group))
        except ProcessorError as e:
            log.warning("group %d: its media do not process (%s); left out of the loss", group, e)
            mismatched.add(group)
            continue
        if processed.input_ids != stored:
            log.warning("group %d: the engine expanded its prompt to %d tokens, the trainer's processor to %d; "
                        "left out of the loss", group, len(stored), len(processed.input_ids))  # fmt: skip
            mismatched.add(group)
            continue
        made[group] = processed.tensors
    return tuple(made.get(int(batch.group_ids[i]), {}) for i in rows), mismatched
