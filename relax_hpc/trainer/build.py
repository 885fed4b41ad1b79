"""The configured trainer backend, imported lazily: megatron-core is an optional dependency."""

from __future__ import annotations

import torch

from relax_hpc.config.schema import JobConfig
from relax_hpc.trainer.backend import Backend


def build_backend(job: JobConfig, device: torch.device) -> Backend:
    if job.trainer.backend == "megatron":
        if device.type != "cuda":  # megatron's kernels and optimizer are GPU code (tests patch them onto the CPU)
            raise RuntimeError("trainer.backend=megatron needs CUDA GPUs; use trainer.backend=torch on CPU")
        from relax_hpc.trainer.megatron_backend import MegatronBackend

        return MegatronBackend(job, device)
    from relax_hpc.trainer.torch_backend import TorchBackend

    return TorchBackend(job, device)
