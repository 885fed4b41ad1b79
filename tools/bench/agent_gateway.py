"""Rollout through the agent gateway against the built-in environment, on the same engines in the
same process: the calculator task (configs/tiny-agentic-grpo.yaml) as relax_hpc.envs.calculator
runs it, and as configs/tiny-agent-openai.yaml runs it (the openai SDK's agent,
relax_hpc/agents/examples/calculator_openai.py, through the gateway on the driver's event loop).

    python tools/bench/agent_gateway.py [--rounds 6] [--prompts 32] [--group 8]

Starts the config's built-in engines (two), builds the rollout driver's engine policy once, and
times sampling rounds of each environment in turn (ABAB..., the first of each left out as a
warm-up): the same rows, seeds and engines, so the only difference is the gateway's path (HTTP
over loopback, the SDK, rendering and parsing). Prints one JSON object: samples/s of each, and
the gateway's as a share of the built-in's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from relax_hpc.config.load import load_config, read_frozen
from relax_hpc.launch.commands import local_commands
from relax_hpc.launch.supervisor import child_env
from relax_hpc.paths import RunPaths
from relax_hpc.protocol.registry import read_records
from relax_hpc.rewards import make_scorer
from relax_hpc.rollout.driver import Driver
from relax_hpc.rollout.rounds import Rounds
from relax_hpc.submit import freeze

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"built_in": "tiny-agentic-grpo.yaml", "gateway": "tiny-agent-openai.yaml"}


def start_engines(run_dir: Path, overrides: list[str]) -> tuple[RunPaths, list[subprocess.Popen]]:
    cfg = load_config(REPO / "configs" / CONFIGS["gateway"], [f"run.dir={run_dir}", *overrides], base_dir=REPO)
    paths = RunPaths(run_dir)
    freeze(cfg, paths)
    commands = local_commands(cfg, paths)
    procs = [
        subprocess.Popen(argv, env=child_env(cfg), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        for name, argv in commands.items()
        if name.startswith("engine-")
    ]
    while len(read_records(paths.engines)) < len(procs):
        if any(p.poll() is not None for p in procs):
            raise SystemExit("an engine exited at start")
        time.sleep(0.2)
    return paths, procs


async def timed(rounds: Rounds, seq: int) -> tuple[float, int]:
    start = time.perf_counter()
    groups = await rounds.sample_round(seq, 0)
    return time.perf_counter() - start, sum(len(g.trajectories) for g in groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each environment (the first is a warm-up)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    args = parser.parse_args()
    overrides = [f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}"]
    with tempfile.TemporaryDirectory() as tmp:
        paths, procs = start_engines(Path(tmp) / "run", overrides)
        try:
            driver = Driver(read_frozen(paths.config), paths)
            driver.pool.refresh(force=True)
            rounds = {}
            for name, config in CONFIGS.items():
                cfg = load_config(REPO / "configs" / config, [f"run.dir={paths.root}", *overrides], base_dir=REPO)
                scorer = make_scorer(cfg.reward)
                rounds[name] = Rounds(cfg, driver.rows, driver.prompt_ids, driver.tokenizer, driver.policy, scorer)
            times: dict[str, list[float]] = {name: [] for name in CONFIGS}
            samples: dict[str, list[int]] = {name: [] for name in CONFIGS}

            async def run() -> None:
                for seq in range(args.rounds):
                    for name, r in rounds.items():
                        wall, n = await timed(r, seq)
                        times[name].append(wall)
                        samples[name].append(n)

            asyncio.run(run())
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                proc.wait(timeout=30)
    rate = {name: sum(samples[name][1:]) / sum(times[name][1:]) for name in CONFIGS}
    print(json.dumps({
        "benchmark": "agent_gateway", "prompts": args.prompts, "group": args.group, "rounds": args.rounds,
        "samples_per_s": {name: round(r, 1) for name, r in rate.items()},
        "round_s": {name: [round(t, 3) for t in times[name]] for name in CONFIGS},
        "gateway_over_built_in": round(rate["gateway"] / rate["built_in"], 3),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
