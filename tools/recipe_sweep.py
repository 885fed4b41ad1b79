"""Single-process GRPO on the embedded default task, for searching a robust recipe fast.

It runs the same pieces as the distributed engine (prompt order, seeded sampling, reward, GRPO
advantages and loss, padding) in one process with no spool, engines or weight sync, so a grid of
settings x seeds can run side by side, one CPU thread each:

    python tools/recipe_sweep.py --policy assets/tiny-qwen3-addition --data assets/addition.jsonl \
        --grid '{"lr": [3e-4, 1e-3], "group_size": [8, 16]}' --seeds 0 1 2 --max-seconds 300

Prints one JSON line per (setting, seed): the batch reward of every step (`rewards`), greedy
accuracy every --greedy-every steps (`greedy_curve`) and at the end. --grid may also be a JSON list
of such dicts (the union of their products). BENCHMARKS.md's recipe table came from this script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import time

import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from relax_hpc.algos.grpo import PolicyLossConfig, group_advantages, policy_loss
from relax_hpc.data.prompts import PromptOrder, load_prompts
from relax_hpc.rewards.exact_match import exact_match
from relax_hpc.rollout.sampling import SamplingSpec, sample
from relax_hpc.trainer.batching import pad_samples, token_logprobs_and_entropy

DEFAULTS = {
    "lr": 1e-3,
    "group_size": 8,
    "prompts_per_step": 32,
    "entropy_coef": 0.01,
    "temperature": 1.0,
    "normalize_std": True,
    "max_grad_norm": 1.0,
    "weight_decay": 0.0,
    "beta2": 0.999,
    "max_new_tokens": 4,
}


def greedy_accuracy(model, tokenizer, rows) -> float:
    prompts = [tokenizer(r.prompt)["input_ids"] for r in rows]
    spec = SamplingSpec(max_new_tokens=4, temperature=0.0)
    outs = sample(model, prompts, [spec] * len(rows), [0] * len(rows), tokenizer.eos_token_id, tokenizer.pad_token_id)
    texts = [tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
    return sum(exact_match(t, r.answer) for t, r in zip(texts, rows)) / len(rows)


def run_one(args: tuple[dict, int, str, str, float, int, int]) -> dict:
    setting, seed, policy, data, max_seconds, max_steps, greedy_every = args
    cfg = {**DEFAULTS, **setting}
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = Qwen3ForCausalLM.from_pretrained(policy)
    rows = load_prompts(data, "prompt", "answer")
    order = PromptOrder(len(rows), seed)
    optim = torch.optim.AdamW(
        model.parameters(), lr=cfg["lr"], betas=(0.9, cfg["beta2"]), weight_decay=cfg["weight_decay"]
    )
    loss_cfg = PolicyLossConfig(entropy_coef=cfg["entropy_coef"])
    spec = SamplingSpec(max_new_tokens=cfg["max_new_tokens"], temperature=cfg["temperature"])
    curve, start, step = [], time.perf_counter(), 0
    fine, greedy = [], []
    g = cfg["group_size"]
    while time.perf_counter() - start < max_seconds and step < max_steps:
        idx = order.batch(step, cfg["prompts_per_step"])
        prompts = [tokenizer(rows[i].prompt)["input_ids"] for i in idx for _ in range(g)]
        seeds = [hash((seed, step, k)) % 2**62 for k in range(len(prompts))]
        outs = sample(model, prompts, [spec] * len(prompts), seeds, tokenizer.eos_token_id, tokenizer.pad_token_id)
        rewards = [
            exact_match(tokenizer.decode(o.output_ids, skip_special_tokens=True), rows[idx[k // g]].answer)
            for k, o in enumerate(outs)
        ]
        batch = pad_samples(
            [p + o.output_ids for p, o in zip(prompts, outs)],
            [[0] * len(p) + [1] * len(o.output_ids) for p, o in zip(prompts, outs)],
            [[0.0] * len(p) + o.logprobs for p, o in zip(prompts, outs)],
            rewards,
            [k // g for k in range(len(prompts))],
            tokenizer.pad_token_id,
        )
        adv = group_advantages(batch.rewards, batch.group_ids, cfg["normalize_std"])
        logprobs, entropy = token_logprobs_and_entropy(model, batch)
        loss, _ = policy_loss(logprobs, logprobs.detach(), adv, entropy, batch.loss_mask, batch.num_tokens, loss_cfg)
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
        optim.step()
        step += 1
        fine.append(round(float(batch.rewards.mean()), 3))
        if step % 25 == 0:
            curve.append((step, round(time.perf_counter() - start, 1), round(float(batch.rewards.mean()), 3)))
            if greedy_every and step % greedy_every == 0:
                greedy.append((step, greedy_accuracy(model, tokenizer, rows)))
    return {
        "setting": setting,
        "seed": seed,
        "steps": step,
        "seconds": round(time.perf_counter() - start, 1),
        "curve": curve,
        "final_reward": curve[-1][2] if curve else None,
        "greedy_accuracy": greedy_accuracy(model, tokenizer, rows),
        "rewards": fine,
        "greedy_curve": greedy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", required=True, help="HF folder of the starting policy")
    parser.add_argument("--data", required=True, help="JSONL prompts with 'prompt' and 'answer'")
    parser.add_argument("--grid", default="{}", help="JSON dict: setting name -> list of values")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-seconds", type=float, default=300.0, help="wall budget of each run")
    parser.add_argument("--max-steps", type=int, default=10**9, help="step budget of each run")
    parser.add_argument("--greedy-every", type=int, default=50, help="greedy accuracy every N steps (multiple of 25)")
    parser.add_argument("--workers", type=int, default=mp.cpu_count(), help="runs side by side")
    args = parser.parse_args()
    grid = json.loads(args.grid)
    grids = grid if isinstance(grid, list) else [grid]  # a list of grids: the union of their products
    settings = [dict(zip(g, values)) for g in grids for values in itertools.product(*g.values())] or [{}]
    jobs = [(s, seed, args.policy, args.data, args.max_seconds, args.max_steps, args.greedy_every) for s in settings for seed in args.seeds]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for result in pool.imap_unordered(run_one, jobs):
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
