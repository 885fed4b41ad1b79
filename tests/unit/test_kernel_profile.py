"""tools/bench/kernel_profile.py, the step's time by kind of kernel (issue 52, target 2): the rule
table on real CUDA kernel names (cuBLAS, torch's flash and memory-efficient attention, cuDNN SDPA,
FA3, NCCL, torch's fused Adam and multi-tensor norm, Inductor and at::native kernels), the idle and
overlap arithmetic on synthetic traces, and one real torch.profiler run of a tiny model's step on
the CPU."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "bench" / "kernel_profile.py"


def load_module() -> Any:
    spec = importlib.util.spec_from_file_location("kernel_profile", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


KP = load_module()
Event = KP.Event

# Real names, their template arguments cut short ("...") where they run long.
NAMES = {
    "gemm": [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>(...)",
        "splitKreduce_kernel",
        "aten::mm",
        "aten::addmm",
    ],
    "attention": [
        # torch's FA2, whose traits name cutlass types: attention is tried before gemm
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t, ...>",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, ...>",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_cga1x1x1_kernel0_0",
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>(...)",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ],
    "communication": [
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "c10d::allreduce_",
    ],
    "optimizer": [
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, "
            "at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, ...>, ...>"
        ),
        # the gradient norm: a norm by name, the optimizer's by kind (optimizer is tried before norms)
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<1>, "
            "at::native::(anonymous namespace)::LpNormFunctor<float, ...>, float*, int>"
        ),
        "void at::native::lpnorm_cleanup<float, (at::native::(anonymous namespace)::NormType)1, float, float>(...)",
        "aten::_foreach_mul_",
        "Optimizer.step#AdamW.step",
    ],
    "norm_elementwise": [
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0",
        "triton_poi_fused_mul_silu_2",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, ...>>",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(...)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::...>",
        "aten::native_layer_norm_backward",
    ],
    "memcpy_memset": ["Memcpy DtoD (Device -> Device)", "Memcpy HtoD (Pageable -> Device)", "Memset (Device)"],
    "other": [
        "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<...>>",
        "aten::view",
    ],
}


@pytest.mark.parametrize("kind,name", [(kind, name) for kind, names in NAMES.items() for name in names])
def test_real_kernel_names_get_their_kind(kind: str, name: str) -> None:
    assert KP.classify(name) == kind


def kernel(name: str, start: float, end: float, stream: int = 7) -> Any:
    return Event(name, start, end, (0, stream))


GEMM, FLASH, NCCL = NAMES["gemm"][0], NAMES["attention"][0], NAMES["communication"][0]


def test_idle_is_the_wall_time_outside_every_kernel() -> None:
    # 100 us of wall; kernels 10-40 and 60-70 on one stream: 40 busy, 60 idle
    profile = KP.account([kernel(GEMM, 10, 40), kernel(FLASH, 60, 70)], wall_s=100e-6)
    assert profile.kind_s["gemm"] == pytest.approx(30e-6)
    assert profile.kind_s["attention"] == pytest.approx(10e-6)
    assert profile.kind_s["idle"] == pytest.approx(60e-6)
    assert sum(profile.shares().values()) == pytest.approx(1.0)
    assert profile.verdict().startswith("host-bound: no kernel runs for 60%")


def test_overlapping_streams_split_their_common_time_and_idle_is_the_union() -> None:
    # a GEMM on stream 7 (0-50) under an all-reduce on stream 13 (20-60): the 30 us they share
    # count half to each; busy is the union, 60 of 80
    events = [kernel(GEMM, 0, 50), kernel(NCCL, 20, 60, stream=13)]
    profile = KP.account(events, wall_s=80e-6)
    assert profile.kind_s["gemm"] == pytest.approx(35e-6)
    assert profile.kind_s["communication"] == pytest.approx(25e-6)
    assert profile.kind_s["idle"] == pytest.approx(20e-6)
    assert sum(profile.shares().values()) == pytest.approx(1.0)
    assert profile.verdict() == "gemm-bound: gemm takes 44% of the step; no kernel runs for 25%"


def test_steps_average_and_a_short_wall_clock_cannot_make_idle_negative() -> None:
    events = [kernel(GEMM, 0, 90), kernel(GEMM, 100, 190)]  # two steps of 90 us busy
    profile = KP.account(events, wall_s=150e-6, steps=2)  # the trace spans 190: that is the wall
    assert profile.wall_s == pytest.approx(95e-6)
    assert profile.kind_s["gemm"] == pytest.approx(90e-6)
    assert profile.kind_s["idle"] == pytest.approx(5e-6)
    assert profile.verdict() == "gemm-bound: gemm takes 95% of the step; no kernel runs for 5%"


def test_cpu_ops_go_to_the_innermost_and_an_optimizer_annotation_lends_its_kind() -> None:
    lane = (1, 1)
    events = [
        Event("aten::linear", 0, 50, lane),  # 10 us of its own (other), 40 in addmm (gemm)
        Event("aten::addmm", 5, 45, lane),
        Event("autograd::engine::evaluate_function: AddmmBackward0", 50, 80, lane, context=True),
        Event("aten::mm", 55, 75, lane),  # the wrapper's own 10 us are host time: idle
        Event("Optimizer.step#Adam.step", 80, 100, lane, context=True),
        Event("aten::mul_", 85, 95, lane),  # elementwise by name, the optimizer's by context
    ]
    profile = KP.account(events, wall_s=100e-6)
    assert profile.kind_s["gemm"] == pytest.approx(60e-6)
    assert profile.kind_s["other"] == pytest.approx(10e-6)
    assert profile.kind_s["optimizer"] == pytest.approx(10e-6)
    assert profile.kind_s["idle"] == pytest.approx(20e-6)
    assert profile.accounted() == pytest.approx(0.9)


def test_events_from_a_chrome_trace_keep_the_device_work_only() -> None:
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": GEMM, "pid": 0, "tid": 7, "ts": 1000.0, "dur": 30.0},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0, "tid": 7,
             "ts": 1040.0, "dur": 5.0},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 9, "tid": 9, "ts": 990.0, "dur": 4.0},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 9, "tid": 9, "ts": 985.0, "dur": 12.0},
            {"ph": "s", "cat": "ac2g", "name": "ac2g", "pid": 9, "tid": 9, "ts": 990.0},
        ]
    }  # fmt: skip
    events = KP.events_from_trace(trace, cuda=True)
    assert [(e.name, e.start, e.end, e.lane) for e in events] == [
        (GEMM, 1000.0, 1030.0, (0, 7)),
        ("Memcpy HtoD (Pageable -> Device)", 1040.0, 1045.0, (0, 7)),
    ]
    assert [e.name for e in KP.events_from_trace(trace, cuda=False)] == ["aten::mm"]


def test_a_real_cpu_profile_of_a_training_step_adds_up(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 16))
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    x = torch.randn(32, 64)

    def step() -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm: Adam's state
    trace = tmp_path / "tiny-cpu.json.gz"
    result = KP.profile_steps(step, steps=2, cuda=False, trace=trace)
    kinds = result["kinds"]
    assert set(kinds) == set(KP.KINDS)
    assert sum(k["share"] for k in kinds.values()) == pytest.approx(1.0, abs=5e-4)  # rounded to 1e-4 each
    assert result["accounted"] == pytest.approx(1 - kinds["other"]["share"], abs=1e-4)
    assert kinds["gemm"]["s"] > 0 and kinds["optimizer"]["s"] > 0 and kinds["norm_elementwise"]["s"] > 0
    assert result["steps"] == 2 and result["kernels_per_step"] > 0 and result["activities"] == "cpu"
    assert result["verdict"].split("-bound")[0] in KP.KINDS or result["verdict"].startswith("host-bound")
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
