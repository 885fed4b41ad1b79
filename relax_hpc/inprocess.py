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
import asyncio
import collections
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from relax_hpc import cli
from relax_hpc.config.load import load_config
from relax_hpc.config.schema import JobConfig
from relax_hpc.data.processor import MediaProcessor, media_processor, prompt_encoder, up_to_media_token, video_spec
from relax_hpc.data.prompts import load_data
from relax_hpc.engines.sampling import SamplingSpec, sample
from relax_hpc.envs.base import Sampled
from relax_hpc.envs.context import GenerateCall
from relax_hpc.metrics.jsonl import JsonlWriter
from relax_hpc.models.hf import load_policy, torch_dtype
from relax_hpc.rewards import make_scorer
from relax_hpc.rollout.plan import to_sample_batch
from relax_hpc.rollout.rounds import Rounds
from relax_hpc.trainer.backend import BackendConfig
from relax_hpc.trainer.batching import share_of
from relax_hpc.trainer.loop import reduce_stats
from relax_hpc.trainer.torch_backend import TorchBackend
from relax_hpc.weights.lora import AdapterMerger, is_adapter_tensor


def _single_process_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@torch.no_grad()
def _load(run: InProcessRun, weights: dict[str, torch.Tensor]) -> None:
    """What a push does to an engine: copy the weights, or (LoRA) merge the adapters into the base."""
    for name, t in weights.items():
        if is_adapter_tensor(name):
            run.merger.adapter[name] = t
        else:
            run.params[name].copy_(t)
    if run.merger.adapter:
        run.merger.merge()


class LocalPolicy:
    """relax_hpc.envs.context.Policy on a model in this process: what an engine would do with a
    batch of calls (media expanded by the processor, completions cut before media tokens)."""

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, processor: MediaProcessor | None
    ) -> None:
        self.model: PreTrainedModel = model
        self.tokenizer, self.processor = tokenizer, processor
        self.version = 0
        self.routing = False  # record the routers' choices (algo.off_policy.routing_replay)

    def generate(self, calls: Sequence[GenerateCall]) -> list[Sampled]:
        specs, seeds = zip(*(SamplingSpec.from_params(c.sampling) for c in calls), strict=True)
        prompts, inputs = [], []
        for call in calls:
            processed = self.processor.process(call.token_ids, call.media) if call.media and self.processor else None
            prompts.append(processed.input_ids if processed else call.token_ids)
            inputs.append(processed.tensors if processed else {})
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        outs = sample(
            self.model, prompts, list(specs), list(seeds), eos, pad, inputs if any(inputs) else None,
            record_routing=self.routing,
        )  # fmt: skip
        results = []
        for out, prompt, call in zip(outs, prompts, calls, strict=True):
            keep = (
                up_to_media_token(out.output_ids, self.processor.media_token_ids)
                if self.processor
                else len(out.output_ids)
            )
            ids = out.output_ids[:keep]
            finish: Literal["stop", "length"] = (
                "length" if out.finish_reason == "length" and keep == len(out.output_ids) else "stop"
            )
            text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
            routed = (
                out.routed.reshape(len(out.routed), -1)[: len(prompt) + keep - 1] if out.routed is not None else None
            )
            results.append(
                Sampled(
                    ids,
                    out.logprobs[:keep],
                    [self.version] * keep,
                    finish,
                    text,
                    prompt if call.media else None,
                    routed,
                )
            )
        return results


class InProcessRun:
    """The policy being trained (backend), a sampler holding an older version, and the rounds."""

    def __init__(self, cfg: JobConfig) -> None:
        if cfg.algo.teacher.num_engines:
            raise ValueError("the single-process loop has no engines: set algo.teacher.num_engines=0 (same teacher)")
        _single_process_group()
        torch.manual_seed(cfg.run.seed)
        self.cfg = cfg
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(cfg.model.path)
        self.processor = media_processor(cfg.model.path)
        video = video_spec(cfg.model.path)
        self.rows = load_data(cfg.data, video)
        encode = prompt_encoder(cfg.model.path, self.processor)
        self.backend = TorchBackend(BackendConfig.of(cfg), torch.device("cpu"))
        self.sampler = load_policy(cfg.model.path, torch_dtype(cfg.model.dtype)).eval()
        synced = {name for name, _, _ in self.backend.parameter_specs()}
        # What weight sync would update (tied weights appear once; a frozen encoder not at all).
        self.params = {n: p for n, p in self.sampler.named_parameters() if n in synced}
        self.merger = AdapterMerger(dict(self.sampler.named_parameters()), torch.device("cpu"))
        self.policy = LocalPolicy(self.sampler, self.tokenizer, self.processor)
        self.policy.routing = cfg.algo.off_policy.routing_replay
        scorer = make_scorer(cfg.reward)
        self.rounds = Rounds(cfg, self.rows, [encode(r) for r in self.rows], self.tokenizer, self.policy, scorer)
        self.eval_rounds = self.rounds
        if cfg.data.eval_path:
            held_out = load_data(cfg.data, video, held_out=True)
            self.eval_rounds = Rounds(cfg, held_out, [encode(r) for r in held_out], self.tokenizer, self.policy, scorer)
        self.loop = asyncio.Runner()  # one event loop for the run (a remote reward's client lives in it)

    def greedy_accuracy(self) -> float:
        """Greedy accuracy of the sampler's weights over the whole evaluation dataset (data.eval_path
        if set, else the training prompts)."""
        return self.loop.run(self.eval_rounds.evaluate(list(range(len(self.eval_rounds.rows)))))

    def train(self, step: int, version: int) -> dict:
        self.policy.version = version
        selection = self.loop.run(self.rounds.plan.select(lambda round_: self.rounds.sample_round(step, round_)))
        batch = to_sample_batch(step, selection.groups)
        pad = self.tokenizer.pad_token_id
        train_batch, _ = share_of(batch, list(range(batch.num_samples)), 0, 1, pad, self.processor)
        result = self.backend.train_step(train_batch, step)
        return {
            "step": step + 1,
            "reward": float(batch.rewards.mean()),
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "reward_sampled": selection.sampled_reward,
            "groups_dropped": selection.dropped,
            **self.rounds.take_stats(),
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
    versions.append({name: t.clone() for name, t in run.backend.full_parameters()})  # the starting weights
    records = []
    for step in range(steps):
        _load(run, versions[0])  # the oldest version still allowed to sample batch `step`
        record = run.train(step, version=max(0, step - len(versions) + 1))
        versions.append({name: t.clone() for name, t in run.backend.full_parameters()})
        if greedy_every and ((step + 1) % greedy_every == 0 or step + 1 == steps):
            _load(run, versions[-1])
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
    if cfg.kind != "rl":
        parser.error(f"{args.config} is a kind={cfg.kind} config: run it with python -m relax_hpc.submit")
    torch.set_num_threads(cfg.launch.threads_per_process)
    writer = JsonlWriter(args.out)

    def report(record: dict) -> None:
        writer.log(record)
        print(f"step {record['step']}/{args.steps} | reward {record['reward']:.3f}", flush=True)

    run_inprocess(cfg, args.steps, args.greedy_every, report)


if __name__ == "__main__":
    cli.run(main)
