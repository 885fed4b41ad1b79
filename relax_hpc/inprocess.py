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
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from relax_hpc.config.load import load_config
from relax_hpc.config.schema import JobConfig
from relax_hpc.data.plan import BatchPlan, Group, to_sample_batch
from relax_hpc.data.prompts import load_prompts
from relax_hpc.engines.sampling import Completion, SamplingSpec, sample
from relax_hpc.metrics.jsonl import JsonlWriter
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
        self.rows = load_prompts(cfg.data.path, cfg.data.prompt_key, cfg.data.answer_key)
        self.prompt_ids = [self.tokenizer(r.prompt)["input_ids"] for r in self.rows]
        self.plan = BatchPlan(cfg, self.rows)
        self.backend = TorchBackend(cfg, torch.device("cpu"))
        dtype = getattr(torch, cfg.model.dtype)
        self.sampler = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype).eval()
        self.params = dict(self.sampler.named_parameters())  # tied weights appear once, as in weight sync
        self.spec = SamplingSpec(ro.max_new_tokens, ro.temperature, ro.top_p, ro.top_k)

    def _generate(self, prompts: list[list[int]], specs: list[SamplingSpec], seeds: list[int]) -> list[Completion]:
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        return sample(self.sampler, prompts, specs, seeds, eos, pad)

    def sample_round(self, step: int, version: int, round_: int) -> list[Group]:
        indices = self.plan.prompts(step, round_)
        prompts = [self.prompt_ids[i] for i in indices for _ in range(self.cfg.rollout.group_size)]
        seeds = self.plan.seeds(step, round_, len(prompts))
        outs = self._generate(prompts, [self.spec] * len(prompts), seeds)
        return self.plan.groups(
            step,
            round_,
            [self.prompt_ids[i] for i in indices],
            [o.output_ids for o in outs],
            [o.logprobs for o in outs],
            [self.tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs],
            [version] * len(outs),
        )

    def greedy_accuracy(self) -> float:
        """Greedy accuracy of the sampler's weights over the whole dataset."""
        spec = SamplingSpec(max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=0.0)
        outs = self._generate(self.prompt_ids, [spec] * len(self.rows), [0] * len(self.rows))
        texts = [self.tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
        return sum(self.plan.reward_fn(t, r.answer) for t, r in zip(texts, self.rows, strict=True)) / len(self.rows)

    def train(self, step: int, version: int) -> dict:
        selection = self.plan.select(functools.partial(self.sample_round, step, version))
        batch = to_sample_batch(step, selection.groups)
        train_batch, _ = share_of(batch, list(range(batch.num_samples)), 0, 1, self.tokenizer.pad_token_id)
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
