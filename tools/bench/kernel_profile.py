"""A training step's time by kind of kernel, from a torch.profiler trace (issue 52, target 2).

`profile_steps(step, steps, cuda, trace)` runs `steps` calls of `step` under torch.profiler (CUDA
activity on a GPU, CPU activity otherwise), keeps the Chrome trace (gzipped) where asked, and
returns, per step: each kind's seconds and share of the step's wall time, `idle` (the wall time in
which no kernel ran on any stream), the share `accounted` (every kind but `other`: the kernels the
rule table names, and idle), the top kernels, and a verdict on what bounds the step.

Attribution, so that the kinds and idle add up to the wall time exactly: within one lane (a CUDA
stream; a CPU thread) an instant belongs to the innermost event running then (CPU ops nest, an
annotation's own time is idle); an instant in which several lanes are busy is split evenly among
them. On a CPU, ops inside an optimizer or communication annotation take its kind.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# (kind, pattern searched in the lower-cased kernel or op name); the first match wins. Real names:
# cuBLAS's sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_... and nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT,
# torch's pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<...cutlass::bfloat16_t...>>
# (hence attention before gemm), multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>,
# FusedAdamMathFunctor<...>> and <TensorListMetadata<1>, LpNormFunctor<...>> (the gradient norm:
# hence optimizer before norms), ncclDevKernel_AllReduce_Sum_bf16_RING_LL, Inductor's
# triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0 (a compiled RMSNorm), at::native's
# vectorized_elementwise_kernel<4, ...>; on a CPU, aten::mm, aten::_foreach_mul_, c10d::allreduce_.
# The last rule's short words are aten's op names on a CPU (aten::mul, aten::sum); what none of the
# rules names lands in `other`, and the JSON's top kernels show it.
RULES: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|c10d::|gloo"),
    ("optimizer", r"adam|multi_tensor_apply|lpnorm_cleanup|_foreach_|optimizer\."),
    ("attention", r"flash|fmha|sdpa|attention"),
    ("gemm", r"gemm|gemv|nvjet|xmma|cutlass|cublas|splitkreduce|triton_tem_|^aten::(mm|addmm|bmm|baddbmm|addmv|mv)$"),
    ("memcpy_memset", r"^memcpy|^memset"),
    (
        "norm_elementwise",
        (
            r"norm|elementwise|reduce|softmax|triton_|cat|index|gather|embedding|fill|copy|where"
            r"|add|sub|mul|div|pow|sqrt|exp|log|neg|silu|sigmoid|mean|sum|max|min|clamp"
        ),
    ),
)
KINDS = (*(kind for kind, _ in RULES), "other", "idle")
PATTERNS = tuple((kind, re.compile(pattern)) for kind, pattern in RULES)
STICKY = frozenset({"optimizer", "communication"})  # an enclosing event of these kinds lends it to its children
# CPU events whose own time is host overhead, not work: autograd's wrappers around the backward's ops.
WRAPPER = re.compile(r"^autograd::engine|backward\d+$")
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATEGORIES = frozenset({"cpu_op", "user_annotation"})


def classify(name: str) -> str:
    """The kind of a kernel or op by its name: the first rule that matches, else `other`."""
    lowered = name.lower()
    return next((kind for kind, pattern in PATTERNS if pattern.search(lowered)), "other")


@dataclass(frozen=True)
class Event:
    """A kernel, copy or op on one lane, in microseconds (the Chrome trace's unit)."""

    name: str
    start: float
    end: float
    lane: tuple[Any, Any] = (0, 0)
    context: bool = False  # an annotation or wrapper: its own time is idle, it may lend its kind


def events_from_trace(trace: dict[str, Any], cuda: bool) -> list[Event]:
    """A Chrome trace's device work (kernels, copies, memsets per stream) or, without a GPU, its
    CPU ops and annotations per thread."""
    categories = DEVICE_CATEGORIES if cuda else HOST_CATEGORIES
    events = []
    for e in trace.get("traceEvents", []):
        category = str(e.get("cat", "")).lower()
        if e.get("ph") != "X" or category not in categories:
            continue
        name = str(e.get("name", ""))
        context = category == "user_annotation" or bool(WRAPPER.search(name.lower()))
        start = float(e["ts"])
        events.append(Event(name, start, start + float(e.get("dur", 0.0)), (e.get("pid"), e.get("tid")), context))
    return events


def lane_pieces(events: Iterable[Event]) -> list[tuple[float, float, str, str]]:
    """One lane's timeline as pieces (start, end, kind, name) that do not overlap: each instant goes
    to the innermost event running then; an annotation's own time goes to no one (idle)."""
    pieces: list[tuple[float, float, str, str]] = []
    stack: list[tuple[Event, str]] = []  # the open events, outermost first, with their kinds
    cursor = 0.0

    def give(until: float) -> None:  # the time since the cursor to the innermost open event
        nonlocal cursor
        if stack and until > cursor and not stack[-1][0].context:
            pieces.append((cursor, until, stack[-1][1], stack[-1][0].name))
        cursor = max(cursor, until)

    def close(until: float) -> None:  # the events that end by `until`, innermost first
        while stack and stack[-1][0].end <= until:
            give(stack[-1][0].end)
            stack.pop()

    for event in sorted(events, key=lambda e: (e.start, -e.end)):
        close(event.start)
        give(event.start)
        outer = stack[-1][1] if stack else None
        kind = outer if outer in STICKY else classify(event.name)
        end = min(event.end, stack[-1][0].end) if stack else event.end  # clock rounding: stay inside the parent
        stack.append((Event(event.name, event.start, end, event.lane, event.context), kind))
    close(float("inf"))
    return pieces


@dataclass
class Profile:
    """Seconds per step of each kind and each kernel, and the step's wall time."""

    wall_s: float
    steps: int
    kind_s: dict[str, float] = field(default_factory=dict)
    kernel_s: dict[tuple[str, str], float] = field(default_factory=dict)  # (kind, name) -> seconds
    events: int = 0

    def shares(self) -> dict[str, float]:
        return {kind: seconds / self.wall_s for kind, seconds in self.kind_s.items()}

    def accounted(self) -> float:
        """The share of the step that the rule table explains: everything but `other`."""
        return 1.0 - self.shares()["other"]

    def verdict(self) -> str:
        """The largest kind bounds the step; idle as the largest means the host does."""
        shares = self.shares()
        if not self.events:
            return "no kernels recorded: nothing to say"
        kind = max(shares, key=lambda k: shares[k])
        if kind == "idle":
            return f"host-bound: no kernel runs for {shares['idle']:.0%} of the step, more than any kind takes"
        return f"{kind}-bound: {kind} takes {shares[kind]:.0%} of the step; no kernel runs for {shares['idle']:.0%}"

    def to_json(self, top: int = 15) -> dict[str, Any]:
        shares = self.shares()
        kernels = sorted(self.kernel_s.items(), key=lambda kv: -kv[1])[:top]
        return {
            "steps": self.steps,
            "step_s": round(self.wall_s, 4),
            "kernels_per_step": round(self.events / self.steps),
            "kinds": {
                k: {"s": round(self.kind_s[k], 4), "share": round(shares[k], 4)}
                for k in sorted(self.kind_s, key=lambda k: -self.kind_s[k])
            },
            "accounted": round(self.accounted(), 4),
            "verdict": self.verdict(),
            "top": [
                {"kind": kind, "name": name[:160], "s": round(s, 5), "share": round(s / self.wall_s, 4)}
                for (kind, name), s in kernels
            ],
        }


def account(events: list[Event], wall_s: float, steps: int = 1) -> Profile:
    """Split `steps` steps' wall time among the kinds of `events` and idle (per step). The wall
    time is at least the trace's own span, so a clock that disagrees cannot make idle negative."""
    lanes: dict[tuple[Any, Any], list[Event]] = defaultdict(list)
    for event in events:
        lanes[event.lane].append(event)
    points = []  # (instant, +1 opens / -1 closes, kind, name); closes sort first
    for lane in lanes.values():
        for start, end, kind, name in lane_pieces(lane):
            points += [(start, 1, kind, name), (end, -1, kind, name)]
    points.sort(key=lambda p: (p[0], p[1]))
    kernel_us: dict[tuple[str, str], float] = defaultdict(float)
    active: dict[tuple[str, str], int] = defaultdict(int)
    busy, last = 0, 0.0
    for instant, delta, kind, name in points:
        if busy and instant > last:  # split the time since the last point among the busy lanes
            for key, count in active.items():
                kernel_us[key] += (instant - last) * count / busy
        active[(kind, name)] += delta
        busy += delta
        last = instant
    span_us = (max(e.end for e in events) - min(e.start for e in events)) if events else 0.0
    wall_us = max(wall_s * 1e6, span_us)
    kind_s = dict.fromkeys(KINDS, 0.0)
    for (kind, _), us in kernel_us.items():
        kind_s[kind] += us / 1e6 / steps
    kind_s["idle"] = (wall_us - sum(kernel_us.values())) / 1e6 / steps
    kernel_s = {key: us / 1e6 / steps for key, us in kernel_us.items() if us > 0}
    return Profile(wall_us / 1e6 / steps, steps, kind_s, kernel_s, len(events))


def profile_steps(step: Callable[[], object], steps: int, cuda: bool, trace: Path | None = None) -> dict[str, Any]:
    """Profile `steps` calls of `step` (already warm) and account for their time; the Chrome trace
    is kept gzipped at `trace` when given. On a GPU only CUDA activity is recorded, so the host's
    profiling overhead stays out of idle; should CUPTI hand back no kernels, the steps run again
    with CPU activity too (a torch.profiler quirk seen by others), and the JSON says so."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    tries = (
        [[ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]] if cuda else [[ProfilerActivity.CPU]]
    )
    for activities in tries:
        synchronize()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            synchronize()
            wall_s = time.perf_counter() - start
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            events = events_from_trace(json.loads(raw.read_text()), cuda)
            if events or activities is tries[-1]:
                if trace is not None:
                    trace.parent.mkdir(parents=True, exist_ok=True)
                    with raw.open("rb") as source, gzip.open(trace, "wb") as target:
                        shutil.copyfileobj(source, target)
                break
    names = "+".join(a.name.lower() for a in activities)
    return account(events, wall_s, steps).to_json() | {"activities": names, "trace": str(trace) if trace else None}
