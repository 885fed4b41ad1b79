"""Checkpoints: torch.distributed.checkpoint (DCP) for model and optimizer, plus the run state.

    ckpt/step-00000050/            complete checkpoint after 50 steps
        .metadata, __*.distcp      DCP: model + optimizer, sharded as the ranks hold them (the
                                   backend writes them: torch DCP of FSDP state dicts, or
                                   megatron's distributed checkpoint in its torch_dist format)
        trainer_state.json         step, policy version, counters, spool claims of every step
        rank-R.pt                  that rank's RNG states and LR-scheduler state
    ckpt/latest -> step-00000050   moved (atomically) only after a checkpoint is complete

Once a checkpoint is complete, the older ones beyond the newest `keep` are deleted, except the one
`protect()` names (ckpt.export_version=best: the best evaluated version, relax_hpc.ckpt.best).

A checkpoint is written to ckpt/.step-N.tmp and renamed when every rank has finished, so a crash
or a full disk mid-save leaves the previous checkpoint as `latest`. Resuming needs no arguments:
if `latest` exists, the trainer loads it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from relax_hpc import fence
from relax_hpc.ckpt.best import complete_steps, prunable
from relax_hpc.ckpt.layout import STATE_FILE, latest_dir
from relax_hpc.paths import CkptDirs, fsync_dir, write_atomic

log = logging.getLogger("relax_hpc.ckpt")


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class Checkpointer:
    def __init__(self, ckpt_root: Path, keep: int, protect: Callable[[], int | None] = lambda: None) -> None:
        self.root = ckpt_root
        self.dirs = CkptDirs(ckpt_root)
        self.keep = keep
        self.protect = protect  # the step pruning keeps beyond the newest `keep` (None: none)
        self.rank = dist.get_rank()

    def save(self, step: int, write_model: Callable[[Path], None], rank_state: dict, trainer_state: dict) -> bool:
        """Collective. `write_model(folder)` writes the backend's sharded state (a collective
        too). Returns False (and keeps the previous checkpoint) if any rank failed."""
        tmp, final = self.dirs.partial(step), self.dirs.step(step)
        name = final.name
        fence.check(f"checkpoint {name}")  # every rank: a superseded one must not write into tmp
        if latest_dir(self.root) == final:
            # This step is the latest checkpoint already (a stop right after a periodic save): the
            # state is the same, and rewriting it would leave `latest` dangling meanwhile (a kill
            # then would lose every checkpoint). Every rank reads the same answer.
            return True
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        dist.barrier()
        failed = False
        try:
            write_model(tmp)
            torch.save(rank_state, tmp / f"rank-{self.rank}.pt")
        # ENOSPC, EIO, quota: keep training, keep the old checkpoint. DCP wraps a rank's failure
        # in CheckpointException, which derives from BaseException, not Exception.
        except (Exception, CheckpointException) as e:  # noqa: BLE001  # any failure to write: keep training
            log.error("checkpoint %s failed on rank %d: %s", name, self.rank, e)
            failed = True
        if _any_rank(failed):
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                log.error("checkpoint %s abandoned; `latest` still points to the previous one", name)
            return False
        if self.rank == 0:
            try:
                fence.check(f"checkpoint {name} commit", fresh=True)
                write_atomic(tmp / STATE_FILE, json.dumps(trainer_state).encode())
                if final.exists():
                    shutil.rmtree(final)
                os.rename(tmp, final)
                link_tmp = self.dirs.latest_partial
                link_tmp.unlink(missing_ok=True)
                os.symlink(name, link_tmp)
                os.replace(link_tmp, self.dirs.latest)
                fsync_dir(self.root)
                self._prune()
            except OSError as e:
                log.error("checkpoint %s could not be finalised: %s", name, e)
                shutil.rmtree(tmp, ignore_errors=True)
                failed = True
        return not _any_rank(failed)

    def load(self, read_model: Callable[[Path], None]) -> tuple[dict, dict] | None:
        """Load the latest checkpoint (`read_model(folder)` restores the backend's state); returns
        (rank_state, trainer_state), or None when there is none."""
        target = latest_dir(self.root)
        if target is None:
            return None
        read_model(target)
        rank_file = target / f"rank-{self.rank}.pt"
        if not rank_file.exists():
            raise RuntimeError(f"{target} was written by fewer ranks than this run has (no {rank_file.name})")
        rank_state = torch.load(rank_file, weights_only=False)
        return rank_state, json.loads((target / STATE_FILE).read_text())

    def _prune(self) -> None:
        # Computed afresh from the files at every save: a crash between a save and its prune
        # leaves extra checkpoints that the next save prunes, and a resumed run protects the same one.
        for old in prunable(complete_steps(self.root), self.keep, self.protect()):
            shutil.rmtree(self.dirs.step(old), ignore_errors=True)
