"""The trainer's ranks forked on one machine (relax_hpc.trainer.ranks), in a process of their own:
they form a real gloo process group through the parent's store; a failing rank ends the others
and sets the exit status; SIGTERM reaches every rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# argv: OUT_DIR MODE. Each rank joins the group, all-reduces its rank and writes what it saw.
RANKS = """
import json, os, signal, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

from relax_hpc.trainer.ranks import run_ranks

out, mode = Path(sys.argv[1]), sys.argv[2]


def rank_main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    seen = {"rank": rank, "world": dist.get_world_size(), "sum": total.item(), "pid": os.getpid()}
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    if mode == "fail" and rank == 1:
        sys.exit(3)
    if mode == "fail":
        dist.barrier()  # waits for rank 1, which is gone: only a kill ends it
    if mode == "signal":
        got = []
        signal.signal(signal.SIGTERM, lambda *_: got.append(1))
        (out / f"ready{rank}").touch()
        while not got:
            time.sleep(0.01)
        (out / f"signalled{rank}").touch()
    dist.destroy_process_group()


sys.exit(run_ranks(2, rank_main))
"""


def start(tmp_path: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RANKS, str(tmp_path), mode], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def seen(tmp_path: Path) -> list[dict]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_forked_ranks_form_one_process_group_and_exit_zero(tmp_path):
    proc = start(tmp_path, "ok")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out.decode()[-2000:]
    ranks = seen(tmp_path)
    assert [(r["rank"], r["world"], r["sum"]) for r in ranks] == [(0, 2, 1.0), (1, 2, 1.0)]
    assert len({r["pid"] for r in ranks} | {proc.pid}) == 3  # two processes besides the parent


def test_a_failing_rank_ends_the_other_and_sets_the_exit_status(tmp_path):
    proc = start(tmp_path, "fail")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out.decode()[-2000:]
    assert b"trainer rank 1 exited with 3: ending the other ranks" in out
    rank0 = seen(tmp_path)[0]["pid"]
    assert not Path(f"/proc/{rank0}").exists()  # killed out of its barrier, and reaped


def test_sigterm_to_the_parent_reaches_every_rank(tmp_path):
    proc = start(tmp_path, "signal")
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0].decode()[-2000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)  # the parent alone, not its process group
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out.decode()[-2000:]
    assert all((tmp_path / f"signalled{r}").exists() for r in range(2))
