"""The whole RL loop in one process: sample -> reward -> train, with no spool, engines or HTTP.

It builds batches with the BatchPlan the driver uses (prompt order, seeds, reward shaping, dynamic
sampling), samples with the built-in engine's sampler and trains with the trainer's backend and
objective on a world of one, so a run here trains exactly what the distributed system trains,
minus the transport. It sits above both roles: nothing in them imports it. Asynchrony is
simulated faithfully: batch `s` is sampled by the policy of version max(0, s - max_staleness),
the oldest the real system would accept. Used by the learning tests and tools/recipe_sweep.py.

    python -m relax_hpc.inprocess --config configs/tiny-ppo.yaml --steps 60 --out m.jsonl
"""

from __future__ import annotations

import argparse
import collections
import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerFast

from relax_hpc.config.load import load_config
from relax_hpc.config.schema import JobConfig
from relax_hpc.data.media import Kind
from relax_hpc.data.plan import BatchPlan, Group, to_sample_batch
from relax_hpc.data.processor import media_processor, prompt_encoder, up_to_media_token
from relax_hpc.data.prompts import load_prompts
from relax_hpc.engines.sampling import Completion, SamplingSpec, sample
from relax_hpc.metrics.jsonl import JsonlWriter
from relax_hpc.models.hf import load_policy
from relax_hpc.trainer.batching import share_of
from relax_hpc.trainer.loop import reduce_stats
from relax_hpc.trainer.torch_backend import TorchBackend


def _single_process_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@torch.no_grad()
def _load(params: dict[str, torch.nn.Parameter], weights: dict[str, torch.Tensor]) -> None:
    for name, p in params.items():
        p.copy_(weights[name])


class InProcessRun:
    """The policy being trained (backend), a sampler holding an older version, and the batch plan."""

    def __init__(self, cfg: JobConfig) -> None:
        _single_process_group()
        torch.manual_seed(cfg.run.seed)
        self.cfg, ro = cfg, cfg.rollout
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(cfg.model.path)
        self.processor = media_processor(cfg.model.path)
        rate = self.processor.sampling_rate if self.processor else None
        d = cfg.data
        self.rows = load_prompts(d.path, d.prompt_key, d.answer_key, d.media, sampling_rate=rate)
        encode = prompt_encoder(cfg.model.path, self.processor)
        self.prompt_ids = [encode(r) for r in self.rows]
        self.plan = BatchPlan(cfg, self.rows)
        self.backend = TorchBackend(cfg, torch.device("cpu"))
        self.sampler = load_policy(cfg.model.path, getattr(torch, cfg.model.dtype)).eval()
        synced = {name for name, _, _ in self.backend.parameter_specs()}
        # What weight sync would update (tied weights appear once; a frozen encoder not at all).
        self.params = {n: p for n, p in self.sampler.named_parameters() if n in synced}
        self.spec = SamplingSpec(ro.max_new_tokens, ro.temperature, ro.top_p, ro.top_k)

    def _expanded(self, index: int) -> tuple[list[int], dict[str, torch.Tensor], list[tuple[Kind, bytes]]]:
        """A row's prompt as the engine conditions on it: placeholders expanded for its media."""
        media = [(ref.kind, ref.read()) for ref in self.rows[index].media]
        if not media:
            return self.prompt_ids[index], {}, []
        assert self.processor is not None, "rows with media need a multimodal model (checked at submit)"
        processed = self.processor.process(self.prompt_ids[index], media)
        return processed.input_ids, processed.tensors, media

    def _generate(
        self, indices: list[int], copies: int, specs: list[SamplingSpec], seeds: list[int]
    ) -> tuple[list[Completion], list[list[int]], list[list[tuple[Kind, bytes]]]]:
        """Sample each prompt `copies` times; returns (completions, expanded prompts, media)."""
        expanded = [self._expanded(i) for i in indices]
        prompts = [ids for ids, _, _ in expanded for _ in range(copies)]
        inputs = [tensors for _, tensors, _ in expanded for _ in range(copies)]
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        outs = sample(self.sampler, prompts, specs, seeds, eos, pad, inputs if self.processor else None)
        if self.processor is not None:
            for out in outs:
                keep = up_to_media_token(out.output_ids, self.processor.media_token_ids)
                out.output_ids, out.logprobs = out.output_ids[:keep], out.logprobs[:keep]
        return outs, [ids for ids, _, _ in expanded], [media for _, _, media in expanded]

    def sample_round(self, step: int, version: int, round_: int) -> list[Group]:
        indices = self.plan.prompts(step, round_)
        g = self.cfg.rollout.group_size
        seeds = self.plan.seeds(step, round_, len(indices) * g)
        outs, prompt_ids, media = self._generate(indices, g, [self.spec] * len(seeds), seeds)
        return self.plan.groups(
            step,
            round_,
            prompt_ids,
            [o.output_ids for o in outs],
            [o.logprobs for o in outs],
            [self.tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs],
            [version] * len(outs),
            media,
        )

    def greedy_accuracy(self) -> float:
        """Greedy accuracy of the sampler's weights over the whole dataset."""
        spec = SamplingSpec(max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=0.0)
        n = len(self.rows)
        outs, _, _ = self._generate(list(range(n)), 1, [spec] * n, [0] * n)
        texts = [self.tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
        return sum(self.plan.reward_fn(t, r.answer) for t, r in zip(texts, self.rows, strict=True)) / n

    def train(self, step: int, version: int) -> dict:
        selection = self.plan.select(functools.partial(self.sample_round, step, version))
        batch = to_sample_batch(step, selection.groups)
        pad = self.tokenizer.pad_token_id
        train_batch, _ = share_of(batch, list(range(batch.num_samples)), 0, 1, pad, self.processor)
        result = self.backend.train_step(train_batch, step)
        return {
            "step": step + 1,
            "reward": float(batch.rewards.mean()),
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "groups_dropped": selection.dropped,
            **reduce_stats(result.stats, self.cfg.algo.epochs),
        }


def run_inprocess(
    cfg: JobConfig, steps: int, greedy_every: int = 0, on_step: Callable[[dict], None] | None = None
) -> list[dict]:
    """Train `steps` batches; returns each step's metrics (reward, the objective's statistics,
    and greedy accuracy over the dataset every `greedy_every` steps and at the end if set), and
    hands each to `on_step` as soon as it exists."""
    run = InProcessRun(cfg)
    versions: collections.deque[dict] = collections.deque(maxlen=cfg.rollout.max_staleness + 1)
    versions.append({name: p.detach().clone() for name, p in run.params.items()})
    records = []
    for step in range(steps):
        _load(run.params, versions[0])  # the oldest version still allowed to sample batch `step`
        record = run.train(step, version=step - len(versions) + 1)
        versions.append({name: t.clone() for name, t in run.backend.full_parameters()})
        if greedy_every and ((step + 1) % greedy_every == 0 or step + 1 == steps):
            _load(run.params, versions[-1])
            record["greedy_accuracy"] = run.greedy_accuracy()
        records.append(record)
        if on_step is not None:
            on_step(record)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.inprocess", description="relax_hpc single-process RL loop (no engines, no spool)"
    )
    parser.add_argument("--config", required=True, help="job config (YAML)")
    parser.add_argument("--steps", type=int, required=True, help="trainer steps to run")
    parser.add_argument("--greedy-every", type=int, default=0, help="greedy accuracy every N steps and at the end")
    parser.add_argument("--out", type=Path, required=True, help="JSONL file that receives one record per step")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(cfg.launch.threads_per_process)
    writer = JsonlWriter(args.out)

    def report(record: dict) -> None:
        writer.log(record)
        print(f"step {record['step']}/{args.steps} | reward {record['reward']:.3f}", flush=True)

    run_inprocess(cfg, args.steps, args.greedy_every, report)


if __name__ == "__main__":
    main()
