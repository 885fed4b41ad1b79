"""torch.compile where it pays: on CUDA tensors, where a chain of elementwise work and reductions
becomes one generated kernel; eagerly elsewhere (on the CPU the same functions serve tests and
tiny models, and compiling them would cost more than it saves)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

MIN_ROW = 512  # elements per token (x[0]) from which compiling pays: Qwen3-0.6B's narrowest is 1024


def compiled_on_cuda(fn: Callable) -> Callable:
    """`fn(x, ...)`, compiled when x is a CUDA tensor. The leading (token) dimension of x, and of
    every tensor argument as long as it, is dynamic: micro-batches differ in length, and one
    kernel serves them all. The other sizes (hidden, heads, vocabulary) stay constants of the
    kernel: indexing by a symbolic size costs a 64-bit division per element (the log-probability
    gradient over 16,384 x 151,936 logits took 10.7 ms on an H200 with every size dynamic, 6.0 ms
    with only the tokens').

    Rows narrower than MIN_ROW elements (a tiny model's hidden size or vocabulary) run eagerly
    on CUDA too: their kernels are launch-bound either way, and compiling the norms, RoPE and
    log-probabilities cost the embedded task's first colocated step about 20 s (BENCHMARKS.md)."""
    import torch

    compiled = torch.compile(fn)

    @functools.wraps(fn)
    def call(x: torch.Tensor, *args: Any) -> Any:
        if not x.is_cuda or x[:1].numel() < MIN_ROW:
            return fn(x, *args)
        for t in (x, *args):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == x.shape[0]:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(x, *args)

    return call
