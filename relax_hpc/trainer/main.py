"""The trainer role's entry point. Run under torchrun by the launcher:

    torchrun --nproc-per-node N -m relax_hpc.trainer.main --run-dir RUN_DIR

or, for a trainer on this machine's CPU, as its own launcher (relax_hpc.trainer.ranks: the
imports once, then a fork per rank):

    python -m relax_hpc.trainer.main --run-dir RUN_DIR --nproc-per-node N

Each rank joins the process group, reads the frozen config and runs relax_hpc.trainer.loop.Trainer
(an RL job) or relax_hpc.trainer.sft_loop.SftTrainer (kind=sft).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from relax_hpc import fence
from relax_hpc.config.load import read_frozen
from relax_hpc.metrics.startup import StartupClock
from relax_hpc.paths import RunPaths
from relax_hpc.trainer.loop import Trainer


def main() -> None:
    startup = StartupClock()
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.trainer.main", description="relax_hpc trainer rank (run under torchrun)"
    )
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument(
        "--nproc-per-node", type=int, default=0, help="fork this many ranks here instead (one machine, CPU)"
    )
    args = parser.parse_args()
    paths = RunPaths(args.run_dir)
    if args.nproc_per_node:
        sys.exit(fork_ranks(paths, args.nproc_per_node, startup))
    run_rank(paths, startup)


def fork_ranks(paths: RunPaths, count: int, startup: StartupClock) -> int:
    """Import what every rank imports, then fork the ranks (relax_hpc.trainer.ranks)."""
    from relax_hpc.trainer.ranks import run_ranks

    cfg = read_frozen(paths.config)
    # The backend's imports (transformers) too; megatron-core's stay in the ranks.
    if cfg.trainer.backend == "torch":
        importlib.import_module("relax_hpc.trainer.torch_backend")
    if cfg.kind == "sft":
        importlib.import_module("relax_hpc.trainer.sft_loop")
    startup.finish(paths.metrics, "trainer", "imports")
    return run_ranks(count, lambda: run_rank(paths, StartupClock()))


def run_rank(paths: RunPaths, startup: StartupClock) -> None:
    fence.install(paths.root)  # in each rank: a forked rank has no thread of its parent's
    cfg = read_frozen(paths.config)
    torch.set_num_threads(cfg.launch.threads_per_process)
    timeout = datetime.timedelta(hours=2)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        # nccl for the model's collectives, gloo for the small CPU ones (commands, statistics).
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    startup.mark("process_group")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s trainer[{rank}] %(name)s %(levelname)s %(message)s")
    torch.manual_seed(cfg.run.seed + rank)
    if cfg.kind == "sft":
        from relax_hpc.trainer.sft_loop import SftTrainer

        trainer: Trainer | SftTrainer = SftTrainer(cfg, paths, device)
    else:
        trainer = Trainer(cfg, paths, device)
        trainer.startup = startup  # finished at the first step
    startup.mark("model")
    trainer.resume()
    startup.mark("resume")
    trainer.log_start()
    trainer.run()
    # Leave together: a rank that tears gloo down while a peer still uses it can abort
    # ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    # Everything is written (records flush per line, the checkpoint is committed): leave now.
    # The interpreter's own teardown of torch can take seconds, past the launcher's patience
    # at a stop (it then ends torchrun, whose SignalException traceback reads like a crash).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
