"""The driver's rollout throughput against its engine's own offline throughput (issue 48, item 4).

    python tools/bench/rollout_limit.py [--shapes tiny 0.1b 0.5b] [--engines torch vllm]
                                        [--prompts 8] [--batches 2] [--threads 2]

Per model shape and engine kind, one engine with `--threads` threads, one measurement after the
other (each has the machine to itself):
- the limit: the engine's own batched generation in one process, warmed up on the first batch:
  for vLLM `LLM.generate` with SamplingParams(n=group_size) in .venv-vllm, with the server's
  max_num_seqs, KV cache size, block size, dtype and eager mode (relax_hpc.engines.vllm_engine's
  arguments and environment); for the built-in engine its sampler (relax_hpc.engines.sampling.
  sample) on the whole batch, as its scheduler calls it;
- the driver: the engine server started as a run starts it, and the rollout driver's own
  `generate_batch` (relax_hpc.rollout.driver.Driver: episodes, seeds, routing, requests,
  rewards, the spool batch), warmed up on the same first batch.
Both sample the same batches (the plan's prompts of batches 1..--batches; batch 0 warms up),
group_size samples per prompt, temperature 1, max_new_tokens tokens each (ignore_eos: a
random-init model would otherwise stop anywhere). The configuration is configs/tiny-grpo.yaml's
but `--prompts` prompts per step and, for vLLM, a KV cache of --kv-cache-mib in blocks of 32 tokens
(the CPU's default of 128 holds a whole block per sample: 64 MiB of them hold two samples of
the 0.5b shape at once).

`--split SHAPE`: instead, when a group is split: one prompt of 16 samples per batch on two
built-in engines of one thread each, the driver's batches timed with the group halved across
them (the routing's rule when a round has fewer groups than engines) and sent whole to one.

Shapes: `tiny`, the embedded default's model; `0.1b` (16 layers, hidden 768, 12 heads of 64,
4 KV heads, MLP 2048: 0.10B) and `0.5b` (Qwen3-0.6B's body: 28 layers, hidden 1024, 16 heads of
128, 8 KV heads, MLP 3072: 0.44B), random-init Qwen3s with the embedded default's character
vocabulary. Prints one JSON object: per shape and engine both samples/s and the driver's share
of the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from vllm_engine import start  # a sibling script (tools/bench is no package)

from relax_hpc.config import load_config
from relax_hpc.data.processor import prompt_encoder
from relax_hpc.data.prompts import load_data
from relax_hpc.engines.sampling import SamplingSpec, sample
from relax_hpc.engines.vllm_engine import engine_python, server_args, server_env
from relax_hpc.launch.commands import local_commands
from relax_hpc.launch.supervisor import child_env
from relax_hpc.paths import RunPaths
from relax_hpc.protocol.registry import read_records
from relax_hpc.rollout import routing
from relax_hpc.rollout.driver import Driver
from relax_hpc.rollout.plan import BatchPlan
from relax_hpc.submit import freeze

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-grpo.yaml"
TINY = REPO / "assets" / "tiny-qwen3-addition"  # its model
SHAPES = {  # Qwen3Config fields over the tiny model's own
    "0.1b": {"num_hidden_layers": 16, "hidden_size": 768, "num_attention_heads": 12, "head_dim": 64,
             "num_key_value_heads": 4, "intermediate_size": 2048},
    "0.5b": {"num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16, "head_dim": 128,
             "num_key_value_heads": 8, "intermediate_size": 3072},
}  # fmt: skip

# The vLLM limit, run by vLLM's own Python: a JSON job on stdin, samples/s on stdout.
VLLM_LIMIT = """
import json, sys, time
from vllm import LLM, SamplingParams, TokensPrompt
job = json.load(sys.stdin)
llm = LLM(model=job["model"], dtype=job["dtype"], seed=job["seed"], enforce_eager=job["eager"],
          kv_cache_memory_bytes=job["kv_bytes"], max_num_seqs=job["max_num_seqs"], block_size=job["block_size"])
def run(batch):
    prompts = [TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]]
    params = [SamplingParams(n=job["n"], seed=s, max_tokens=job["max_tokens"], temperature=1.0, ignore_eos=True,
                             logprobs=0, detokenize=False) for s in batch["seeds"]]
    started = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(len(o.outputs) for o in outputs) == job["n"] * len(prompts)
    return time.monotonic() - started
run(job["batches"][0])
seconds = sum(run(b) for b in job["batches"][1:])
print(json.dumps({"seconds": seconds}))
"""


def model_folder(shape: str, out: Path) -> Path:
    """The model of `shape` as an HF folder (random init for the larger shapes, seeded)."""
    if shape == "tiny":
        return TINY
    folder = out / f"qwen3-{shape}"
    if not (folder / "config.json").exists():
        tiny = AutoConfig.from_pretrained(TINY).to_dict()
        config = Qwen3Config(**{**tiny, **SHAPES[shape], "layer_types": None})  # per layer: derived again
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).save_pretrained(folder)
        PreTrainedTokenizerFast.from_pretrained(TINY).save_pretrained(folder)
    return folder


def job_config(model: Path, engine: str, args: argparse.Namespace) -> list[str]:
    return [
        f"model.path={model}", f"rollout.engine={engine}", f"rollout.prompts_per_step={args.prompts}",
        "rollout.max_staleness=1000", f"launch.threads_per_process={args.threads}", "rollout.vllm.max_model_len=64",
        f"rollout.vllm.kv_cache_mib={args.kv_cache_mib}", "rollout.vllm.extra_args=[--block-size,'32']",
    ]  # fmt: skip


def batches(cfg: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The prompts (token ids, as the driver encodes them) and each group's first seed of batches
    0..--batches, as the plan gives them."""
    rows = load_data(cfg.data, None)
    encode = prompt_encoder(str(cfg.model.path))
    plan, g = BatchPlan(cfg, rows), cfg.rollout.group_size
    out = []
    for seq in range(args.batches + 1):
        prompts = plan.prompts(seq, 0)
        out.append({"prompts": [encode(rows[i]) for i in prompts], "seeds": plan.seeds(seq, 0, len(prompts) * g)[::g]})
    return out


def torch_limit(cfg: Any, work: list[dict[str, Any]], threads: int) -> float:
    """Seconds of the built-in engine's sampler over the timed batches, each whole (as its
    scheduler takes a batch's requests)."""
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype)).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(cfg.model.path)
    g, spec = cfg.rollout.group_size, SamplingSpec(max_new_tokens=cfg.rollout.max_new_tokens, ignore_eos=True)

    def run(batch: dict[str, Any]) -> float:
        rows = [p for p in batch["prompts"] for _ in range(g)]
        seeds = [s + i for s in batch["seeds"] for i in range(g)]
        started = time.monotonic()
        sample(model, rows, [spec] * len(rows), seeds, tokenizer.eos_token_id, tokenizer.pad_token_id)
        return time.monotonic() - started

    run(work[0])
    return sum(run(b) for b in work[1:])


def vllm_limit(cfg: Any, work: list[dict[str, Any]], threads: int) -> float:
    """Seconds of vLLM's LLM.generate over the timed batches, set up as the server is."""
    vc, argv = cfg.rollout.vllm, server_args(cfg, "127.0.0.1", 0)
    block_size = int(argv[argv.index("--block-size") + 1]) if "--block-size" in argv else None
    job = {
        "model": str(cfg.model.path), "dtype": cfg.model.dtype, "seed": cfg.run.seed, "eager": vc.enforce_eager,
        "kv_bytes": vc.kv_cache_mib * 2**20, "max_num_seqs": vc.max_num_seqs or 128, "block_size": block_size,
        "n": cfg.rollout.group_size, "max_tokens": cfg.rollout.max_new_tokens, "batches": work,
    }  # fmt: skip
    env = {**server_env("unused", eager=vc.enforce_eager), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(
        [engine_python(vc), "-c", VLLM_LIMIT],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's offline run failed:\n{done.stderr[-3000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])


def timed_batches(driver: Driver, batches_: int) -> float:
    """Seconds of the driver's generate_batch over batches 1..batches_, after batch 0 (warm-up),
    every sample max_new_tokens long."""
    driver.rounds.sampling["ignore_eos"] = True

    async def timed() -> float:
        await driver.generate_batch(0)
        started = time.monotonic()
        for seq in range(1, batches_ + 1):
            await driver.generate_batch(seq)
        return time.monotonic() - started

    return asyncio.run(timed())


def driver_seconds(run_dir: Path, engine: str, overrides: list[str], batches_: int) -> float:
    """Seconds of the driver's generate_batch over batches 1..batches_, on one engine server."""
    proc, _, _, (cfg, paths) = start(engine, run_dir, overrides)
    try:
        return timed_batches(Driver(cfg, paths), batches_)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def split_seconds(run_dir: Path, model: Path, batches_: int, halved: bool) -> float:
    """Seconds of the driver's batches 1..batches_ of one group on two built-in engines, the group
    halved across them or whole on one (relax_hpc.rollout.routing's halving turned off)."""
    overrides = [f"model.path={model}", "rollout.prompts_per_step=1", "rollout.max_staleness=1000",
                 "rollout.num_engines=2", "launch.threads_per_process=1"]  # fmt: skip
    cfg = load_config(CONFIG, [f"run.dir={run_dir}", *overrides], base_dir=REPO)
    paths = RunPaths(run_dir)
    freeze(cfg, paths)
    commands = local_commands(cfg, paths)
    env = {**child_env(cfg), "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen(commands[f"engine-{k}"], env=env, stdout=subprocess.DEVNULL) for k in range(2)]
    whole = routing._halved
    try:
        while len(read_records(paths.engines)) < 2:
            time.sleep(0.2)
        if not halved:
            routing._halved = lambda units, engines: list(units)
        return timed_batches(Driver(cfg, paths), batches_)
    finally:
        routing._halved = whole
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["tiny", "0.1b", "0.5b"], choices=["tiny", *SHAPES])
    parser.add_argument("--engines", nargs="+", default=["torch", "vllm"], choices=["torch", "vllm"])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch (group_size samples each)")
    parser.add_argument("--batches", type=int, default=2, help="timed batches, after one warm-up")
    parser.add_argument("--threads", type=int, default=2, help="the engine's threads (launch.threads_per_process)")
    parser.add_argument("--kv-cache-mib", type=int, default=2048, help="rollout.vllm.kv_cache_mib")
    parser.add_argument("--split", choices=["tiny", *SHAPES], default=None, help="time a group halved or whole")
    args = parser.parse_args()
    if args.split is not None:
        with tempfile.TemporaryDirectory() as tmp:
            model = model_folder(args.split, Path(tmp))
            times = {h: split_seconds(Path(tmp) / f"split-{h}", model, args.batches, h) for h in (True, False)}
        print(json.dumps({"split": args.split, "batches": args.batches, "halved_s": round(times[True], 3),
                          "whole_s": round(times[False], 3), "load": os.getloadavg()}))  # fmt: skip
        return
    out: dict[str, Any] = {"prompts": args.prompts, "batches": args.batches, "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            model = model_folder(shape, Path(tmp))
            for engine in args.engines:
                run_dir = Path(tmp) / f"run-{shape}-{engine}"
                overrides = job_config(model, engine, args)
                cfg = load_config(
                    REPO / "configs" / "tiny-grpo.yaml", [f"run.dir={run_dir}", *overrides], base_dir=REPO
                )
                work = batches(cfg, args)
                limit_s = (torch_limit if engine == "torch" else vllm_limit)(cfg, work, args.threads)
                driver_s = driver_seconds(run_dir, engine, overrides, args.batches)
                samples = args.batches * args.prompts * cfg.rollout.group_size
                out[f"{shape} {engine}"] = {
                    "limit_samples_per_s": round(samples / limit_s, 1),
                    "driver_samples_per_s": round(samples / driver_s, 1),
                    "driver_share": round(limit_s / driver_s, 3),
                }
                print(json.dumps({f"{shape} {engine}": out[f"{shape} {engine}"]}), file=sys.stderr, flush=True)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
