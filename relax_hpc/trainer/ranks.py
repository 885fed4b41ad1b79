"""The trainer's ranks on one machine, forked from one process instead of started by torchrun.

    python -m relax_hpc.trainer.main --run-dir RUN_DIR --nproc-per-node N

torchrun imports torch, then starts each rank as a new interpreter that imports torch,
transformers and the trainer again: about 1 + 3N CPU-seconds before the first rank does anything,
most of the embedded default's start-up on its 2 cores. Here the process imports all of that
once and forks the ranks, which share it copy-on-write. For its one machine it does what
torchrun's agent does: it hosts the rendezvous store (the ranks join it as torchrun's ranks do,
TORCHELASTIC_USE_AGENT_STORE), passes SIGTERM and SIGUSR1 on to the ranks, and when a rank fails
it kills the others (a rank whose peer is gone would wait in a collective for its timeout) and
exits with that rank's status. The ranks stay in this process's group: signalling the role's
group reaches them. Nothing here touches CUDA before the fork (each rank picks its GPU).
Trainers on several nodes (Slurm) run under torchrun.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from torch.distributed import TCPStore

FORWARDED = (signal.SIGTERM, signal.SIGUSR1)


def run_ranks(count: int, rank_main: Callable[[], None]) -> int:
    """Fork `count` ranks that each run `rank_main`; returns the exit status for the role: 0 when
    every rank succeeded, else the first failed rank's (1 for a rank killed by a signal)."""
    ranks: dict[int, int] = {}  # pid -> rank
    ports: list[int] = []  # the write end of each rank's pipe: the store's port goes through it
    for rank in range(count):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write)
            _run_rank(rank, count, read, rank_main)
        os.close(read)
        ranks[pid], ports = rank, [*ports, write]
    # Made after the fork: the store's server thread and socket stay in this process alone.
    store = TCPStore("127.0.0.1", 0, world_size=count, is_master=True, wait_for_workers=False)
    for write in ports:
        os.write(write, f"{store.port}\n".encode())
        os.close(write)

    def forward(signum: int, _frame: object) -> None:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    return _wait(ranks)


def _run_rank(rank: int, count: int, port_pipe: int, rank_main: Callable[[], None]) -> NoReturn:
    """In the forked rank: torchrun's environment, then the rank's work; never returns (os._exit:
    the parent's state, copied by the fork, is not this process's to tear down)."""
    code = 1
    try:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        with os.fdopen(port_pipe) as pipe:
            port = pipe.readline().strip()
        world = str(count)
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True",
        )  # fmt: skip
        rank_main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001  # whatever ends the rank, it ends here, with os._exit
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(ranks: dict[int, int]) -> int:
    status = 0
    while ranks:
        pid, how = os.wait()
        rank = ranks.pop(pid, None)
        code = os.waitstatus_to_exitcode(how)
        if rank is None or code == 0 or status:
            continue
        status = code if code > 0 else 1
        print(f"trainer rank {rank} exited with {code}: ending the other ranks", file=sys.stderr, flush=True)
        for other in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(other, signal.SIGKILL)
    return status
