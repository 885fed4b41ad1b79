"""The trainer-to-engines process group.

SGLang's contract (/init_weights_update_group): every engine joins a group of `world_size` ranks
at rank `rank_offset + tp_rank`, rendezvousing at master_address:master_port under `group_name`;
the trainer's source rank is rank 0 and hosts the store. The group lives beside each process's own
default group (a trainer rank already belongs to torchrun's), so it is built directly from a store
and a backend class rather than through init_process_group.
"""

from __future__ import annotations

import atexit
import datetime
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


class Abandoned(RuntimeError):
    """A collective was given up on: a member failed, or the group was cancelled meanwhile."""


class SideGroup:
    """A process group usable alongside (not instead of) the default group."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        self.backend = backend
        self.cancelled = False  # set by cancel(): a collective waiting in wait() gives up
        self._store: dist.TCPStore | None = dist.TCPStore(
            master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
        )
        store = dist.PrefixStore(group_name, self._store)
        self._pg: dist.ProcessGroupNCCL | dist.ProcessGroupGloo | None
        if backend == "nccl":
            self._pg = dist.ProcessGroupNCCL(store, rank, world_size)  # type: ignore[call-arg]  # torch's stub omits the binding's default options
        elif backend == "gloo":
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            raise ValueError(f"weight-sync backend must be gloo or nccl, got {backend!r}")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.wait(self.broadcast_async(tensor, src))

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Start a broadcast; its Work's wait() blocks the host on gloo, but on NCCL only makes the
        current stream wait (the broadcast itself runs on NCCL's stream, asyncOp being true, after
        the work queued on the current stream when it was issued)."""
        assert self._pg is not None, "broadcast on a closed group"
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self._pg.broadcast([tensor], opts)  # type: ignore[union-attr]  # torch's stub omits Backend.broadcast, which the binding has

    def wait(self, work: dist.Work, abandon: Callable[[], bool] | None = None) -> None:
        """Wait for a collective. On gloo the host blocks for it, up to the group's whole timeout
        if a member never joins; here it polls instead, and gives up (Abandoned) once the group is
        cancelled or `abandon()` says so. On NCCL the wait only orders the current stream: as is."""
        if self.backend == "gloo":
            while not work.is_completed():
                if self.cancelled or (abandon is not None and abandon()):
                    raise Abandoned(f"weight-sync group {self.group_name}: collective abandoned")
                time.sleep(0.005)
        work.wait()

    def cancel(self) -> None:
        """Make a collective that waits in wait() give up (another thread's call)."""
        self.cancelled = True

    def close(self) -> None:
        # Dropping the references tears down the backend's connections; there is no public
        # per-object shutdown for a group built outside init_process_group.
        self._pg = None
        self._store = None

    def close_soon(self) -> None:
        """Close on a thread of its own: a backend may wait for a collective that a failed member
        never joins. The process's exit waits for it, up to CLOSE_WAIT_S: a gloo group whose
        teardown the exit cuts short aborts the process ("terminate called without an active
        exception"), which a launcher would count as a crash."""
        thread = threading.Thread(target=self.close, name="weights-drop", daemon=True)
        thread.start()
        _closing.append(thread)


CLOSE_WAIT_S = 10.0
_closing: list[threading.Thread] = []


@atexit.register
def _wait_for_closes() -> None:
    """At exit (after the non-daemon threads, before the daemon ones are stopped)."""
    deadline = time.monotonic() + CLOSE_WAIT_S
    for thread in _closing:
        thread.join(max(0.0, deadline - time.monotonic()))
