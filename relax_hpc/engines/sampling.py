"""Batched autoregressive sampling for HF causal LMs, with a seed per sample.

Every sample draws its random numbers from its own generator seeded by the request's
`sampling_seed`, so a sample's tokens do not depend on which other requests share its batch or on
which engine serves it. This is what makes on-policy runs reproducible across restarts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from relax_hpc.data.processor import concat_inputs, rope_positions
from relax_hpc.models.routing import recording, routers
from relax_hpc.protocol.requests import SAMPLING_PARAMS


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """The subset of SGLang's SamplingParams the built-in engine implements."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> tuple[SamplingSpec, int | None]:
        """(spec, sampling_seed) of SGLang sampling params; ValueError names the unsupported ones."""
        unknown = set(params) - set(SAMPLING_PARAMS)
        if unknown:
            raise ValueError(f"sampling_params {sorted(unknown)} are not supported; supported: {SAMPLING_PARAMS}")
        spec = cls(
            max_new_tokens=int(params.get("max_new_tokens", 128)),
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", -1)),
            stop_token_ids=tuple(params.get("stop_token_ids") or ()),
            ignore_eos=bool(params.get("ignore_eos", False)),
        )
        return spec, params.get("sampling_seed")


@dataclass(slots=True)
class Completion:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    matched: int | None = None
    # MoE, when asked: the experts each input position's routers chose, [prompt + output - 1,
    # layers, top_k] (the last token is never an input), as SGLang's return_routed_experts.
    routed: np.ndarray | None = None


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class _Positions:
    """Each step's position ids. Text models: each row counts its own tokens (left padding).
    Multimodal RoPE (Qwen VL): the prompt's three axes from the model's own rope index, then each
    new token at (its row's tokens so far + the row's delta) on all three axes."""

    def __init__(self, model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, inputs: dict) -> None:
        rope = rope_positions(model, ids, mask, inputs)
        self.prompt: torch.Tensor | None = None if rope is None else rope[0]
        self.deltas: torch.Tensor | None = None if rope is None else rope[1]

    def at(self, step: int, mask: torch.Tensor, new: int) -> torch.Tensor:
        if self.prompt is None or self.deltas is None:
            return (mask.cumsum(-1) - 1).clamp(min=0)[:, -new:]
        if step == 0:
            return self.prompt
        return (mask.sum(-1, keepdim=True) - 1 + self.deltas).unsqueeze(0).expand(3, -1, -1)


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    prompts: list[list[int]],
    specs: list[SamplingSpec],
    seeds: Sequence[int | None],
    eos_token_id: int,
    pad_token_id: int,
    inputs: Sequence[dict[str, torch.Tensor]] | None = None,
    aborted: Callable[[int], bool] | None = None,
    record_routing: bool = False,
) -> list[Completion]:
    """Sample one completion per prompt. Returned logprobs follow SGLang: log-softmax of the logits
    divided by the temperature, before top-k/top-p filtering; with temperature 1 they are the
    model's own log-probabilities, which the trainer's importance ratios compare against.

    `inputs`: each prompt's processor tensors (relax_hpc.data.processor.process) when its
    placeholders are expanded for media; the first forward pass (the prompts') takes them.
    `aborted(i)`, asked before every decoding step, stops row i where it is: its completion keeps
    the tokens it has, finish_reason "abort" (as SGLang answers an aborted request).
    `record_routing`: an MoE model's routers' choices go into each completion's `routed`.

    Rows with the same prompt (a GRPO group's samples) share its prefill: the forward pass reads
    each distinct prompt once and their rows copy its KV cache and last logits, which cuts the
    prompt's share of the work by the group size (text prompts without routing replay, whose
    record is per row; a VL model's rope positions are per row too)."""
    routing = record_routing and bool(routers(model))
    with recording(model) if routing else nullcontext() as calls:
        out = _sample(model, prompts, specs, seeds, eos_token_id, pad_token_id, inputs, aborted, not routing)
    if calls:
        _attach_routing(out, [len(p) for p in prompts], calls)
    return out


def _attach_routing(out: list[Completion], prompt_lens: list[int], calls: list[list[torch.Tensor]]) -> None:
    """Per row, its input positions' choices: its prompt (left-padded in the prefill), then the
    decoding steps that fed its own tokens."""
    n, width = len(out), max(prompt_lens)
    prefill = torch.stack(calls[0], dim=1).reshape(n, width, len(calls[0]), -1)  # [rows, width, layers, k]
    steps = [torch.stack(call, dim=1) for call in calls[1:]]  # each [rows, layers, k]
    for i, completion in enumerate(out):
        fed = len(completion.output_ids) - 1  # decoding steps that took one of this row's tokens
        rows = [prefill[i, width - prompt_lens[i] :], *(step[i : i + 1] for step in steps[: max(fed, 0)])]
        completion.routed = torch.cat(rows).numpy()


def _sample(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    specs: Sequence[SamplingSpec],
    seeds: Sequence[int | None],
    eos_token_id: int,
    pad_token_id: int,
    inputs: Sequence[dict[str, torch.Tensor]] | None,
    aborted: Callable[[int], bool] | None,
    share_prefill: bool = True,
) -> list[Completion]:
    n = len(prompts)
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every row's next token sits at the same column
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    media = {k: v.to(device) for k, v in concat_inputs(list(inputs or [])).items()}
    positions = _Positions(model, ids, mask, media)
    generators = [torch.Generator().manual_seed(s if s is not None else random.getrandbits(63)) for s in seeds]
    temps = torch.tensor([max(s.temperature, 1e-6) for s in specs]).unsqueeze(-1)
    greedy = [s.temperature == 0.0 for s in specs]
    stops = [set(s.stop_token_ids) | ({eos_token_id} if not s.ignore_eos else set()) for s in specs]
    out = [Completion([], [], "length") for _ in range(n)]
    alive = [s.max_new_tokens > 0 for s in specs]  # max_new_tokens 0: scoring only, no token
    cache = DynamicCache()
    step_ids = ids
    plain = share_prefill and not media and positions.prompt is None
    distinct = _distinct_rows(prompts) if plain else None
    for step in range(max(s.max_new_tokens for s in specs) * any(alive)):
        if aborted is not None:
            for i in range(n):
                if alive[i] and aborted(i):
                    alive[i], out[i].finish_reason = False, "abort"
            if not any(alive):
                break
        if step == 0 and distinct is not None:  # each distinct prompt's prefill, copied to its rows
            first, of_row = distinct
            logits = _last_logits(model, ids[first], mask[first], positions.at(0, mask[first], width), cache)[of_row]
            cache.batch_select_indices(of_row.to(device))
        else:
            at = positions.at(step, mask, step_ids.shape[1])
            logits = _last_logits(model, step_ids, mask, at, cache, **(media if step == 0 else {}))
        scaled = logits / temps
        logp = torch.log_softmax(scaled, dim=-1)  # reported: after temperature, before filtering (as SGLang)
        for i, spec in enumerate(specs):
            if spec.top_k > 0 or spec.top_p < 1.0:
                scaled[i] = _filter_logits(scaled[i], spec.top_k, spec.top_p)
        draw_logp = torch.log_softmax(scaled, dim=-1)
        # Exponential race (argmax of logp - log E, E ~ Exp(1)) samples from softmax; each row
        # draws its noise from its own generator.
        noise = torch.stack([torch.empty(logp.shape[-1]).exponential_(generator=g) for g in generators])
        drawn = torch.argmax(draw_logp - noise.log(), dim=-1)
        next_tokens = torch.where(torch.tensor(greedy), torch.argmax(logits, dim=-1), drawn)
        for i in range(n):
            if not alive[i]:
                next_tokens[i] = pad_token_id
                continue
            tok = int(next_tokens[i])
            out[i].output_ids.append(tok)
            out[i].logprobs.append(float(logp[i, tok]))
            if tok in stops[i]:
                alive[i] = False
                out[i].finish_reason, out[i].matched = "stop", tok
            elif len(out[i].output_ids) >= specs[i].max_new_tokens:
                alive[i] = False
        if not any(alive):
            break
        step_ids = next_tokens.unsqueeze(-1).to(device)
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=device)], dim=-1)
    return out


def _distinct_rows(prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the first row of each distinct prompt, each row's index among those), or None when every
    prompt is distinct (nothing to share)."""
    first: dict[tuple[int, ...], int] = {}
    of_row = [first.setdefault(tuple(p), len(first)) for p in prompts]
    if len(first) == len(prompts):
        return None
    rows = [0] * len(first)
    for row, k in reversed(list(enumerate(of_row))):
        rows[k] = row
    return torch.tensor(rows), torch.tensor(of_row)


def _last_logits(
    model: PreTrainedModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    cache: DynamicCache,
    **media: torch.Tensor,
) -> torch.Tensor:
    """The logits of each row's last position, in fp32 on the CPU."""
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, **media
    )
    return out.logits[:, -1, :].float().cpu()


@torch.no_grad()
def input_logprobs(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], starts: Sequence[int]
) -> list[list[float | None]]:
    """Each prompt's input log-probabilities from position starts[i] on, as SGLang 0.5.23 answers
    logprob_start_len: entry k scores token starts[i] + k given the tokens before it, except entry
    0, which is None. The model's own log-softmax: SGLang scores input tokens without the
    request's temperature (its logprob processor normalises the raw logits)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # right padding: positions count from 0 in every row
        ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(list(p)), 1
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()
    scored = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    out: list[list[float | None]] = []
    for i, (p, start) in enumerate(zip(prompts, starts, strict=True)):
        out.append([None, *scored[i, start : len(p) - 1].tolist()] if start < len(p) else [])
    return out
