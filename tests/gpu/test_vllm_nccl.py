"""The trainer's end of vLLM's nccl weight transfer (relax_hpc.weights.vllm_channel.NcclTransport)
on real NCCL. vLLM's CUDA build cannot reach the GPU machine, so its worker is played by a process
that does what vLLM 0.32's NCCLWeightTransferEngine does with `packed: false` (checked against its
source in tests/unit/test_vllm_contract.py): join from the unique id, all_reduce one float32
zero, then receive each tensor the update info names into an empty tensor of its dtype and shape.
With one GPU the trainer's end runs alone (a group of one); two GPUs run both ends."""

from __future__ import annotations

import base64
import multiprocessing as mp
import time

import pytest
import torch

from relax_hpc.weights import nccl_lib
from relax_hpc.weights.buckets import plan_buckets
from relax_hpc.weights.group import Abandoned
from relax_hpc.weights.vllm_channel import NcclTransport, PushBytes, SparseNcclTransport, VllmTransfer, update_info

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g),
        "model.norm.weight": torch.randn(16, generator=g).bfloat16(),
        "lm_head.weight": torch.randn(64, 16, generator=g).t(),  # not contiguous: sent as a copy
    }


def _worker(init: dict, updates: list[dict], out: mp.Queue, device: int) -> None:
    """vLLM's worker side, as NCCLWeightTransferEngine.init_transfer_engine and receive_weights do."""
    torch.cuda.set_device(device)
    stream = torch.cuda.current_stream()
    comm = nccl_lib.Communicator(base64.b64decode(init["nccl_unique_id_b64"]), init["world_size"], init["rank_offset"])
    comm.all_reduce(torch.zeros(1, device="cuda"), stream)
    got = {}
    for info in updates:
        for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
            comm.broadcast(tensor, 0, stream)
            got[name] = tensor.cpu()
    comm.destroy()
    out.put(got)


def test_a_group_of_one_opens_warms_up_and_broadcasts():
    transport = NcclTransport(torch.device("cuda", 0), 60.0)
    assert len(transport.unique_id) == 128  # NCCL's unique id, sent base64 in the init info
    transport.open(1, abandon=lambda: False)
    params = weights()
    sent = [t.cuda() for t in params.values()]
    transport.send(sent, abandon=lambda: False)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(sent, params.values(), strict=True))  # root keeps its own
    transport.close()
    assert transport.comm is None


def test_a_group_of_one_broadcasts_sparse_nccl_patches_from_the_gpu():
    """weights.delta over nccl (vLLM's sparse_nccl, tests/unit/test_vllm_contract.py): what
    VllmTransfer makes of GPU tensors (compared on the GPU against its copy in host memory), a
    group's whole first push as patches of every index, then a delta's int32 indices and values,
    broadcast on real NCCL."""
    transport = SparseNcclTransport(torch.device("cuda", 0), 60.0)
    transport.open(1, abandon=lambda: False)
    transfer = VllmTransfer([], "key", transport, 2**20, 60.0, delta=True)
    params = weights()
    plans = plan_buckets(((n, t.shape, t.dtype) for n, t in params.items()), 2**20)
    for version in (1, 2):
        kept: dict[int, torch.Tensor] = {}
        for k, plan in enumerate(plans):
            tensors = [params[name].cuda().contiguous() for name in plan.names]  # as VllmTransfer takes them
            if version == 2:
                tensors[-1].view(-1)[5] += 1
            payload = transfer.payload(k, plan, tensors, PushBytes(), kept)
            assert payload is not None
            info, sent = payload
            assert all(t.is_cuda for t in sent) and all(t.dtype == torch.int32 for t in sent[::2])
            if version == 1:
                assert info["num_updates_list"] == [t.numel() for t in tensors]
            else:
                assert info["names"] == plan.names[-1:] and info["num_updates_list"] == [1]
                assert sent[0].tolist() == [5] and torch.equal(sent[1], tensors[-1].view(-1)[5:6])
            transport.send(sent, abandon=lambda: False)
        transfer.base = kept
    assert all(not t.is_cuda for t in transfer.base.values())  # the copies live in host memory
    torch.cuda.synchronize()
    transfer.close()


def test_every_dtype_a_checkpoint_holds_has_an_nccl_type():
    comm = nccl_lib.Communicator(nccl_lib.unique_id(), 1, 0)
    stream = torch.cuda.current_stream()
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        comm.broadcast(torch.ones(3, dtype=dtype, device="cuda"), 0, stream)
    x = torch.full((4,), 2.0, device="cuda")
    comm.all_reduce(x, stream)
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4  # a sum over one rank
    with pytest.raises(nccl_lib.NcclError, match="no type"):
        comm.broadcast(torch.ones(2, dtype=torch.complex64, device="cuda"), 0, stream)
    comm.destroy()


def test_an_engine_that_never_joins_is_given_up_on():
    """NCCL's init has no timeout: the transport's does (and `abandon`, for an engine whose
    /init_weight_transfer_engine failed), so the trainer is not held by a peer that never comes."""
    transport = NcclTransport(torch.device("cuda", 0), 2.0)
    started = time.monotonic()
    with pytest.raises(Abandoned, match="not every engine joined within 2 s"):
        transport.open(2, abandon=lambda: False)
    failed = NcclTransport(torch.device("cuda", 0), 60.0)
    with pytest.raises(Abandoned):
        failed.open(2, abandon=lambda: True)
    assert time.monotonic() - started < 10


def exchange(worker_device: int) -> tuple[int | None, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The trainer's end on GPU 0 pushes `weights()` in several buckets to a worker process on
    `worker_device`: the worker's exit code, what it received, what was sent."""
    params = weights()
    plans = plan_buckets(((n, t.shape, t.dtype) for n, t in params.items()), 2048)  # several buckets
    transport = NcclTransport(torch.device("cuda", 0), 120.0)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    updates = [update_info(p) for p in plans]
    worker = ctx.Process(target=_worker, args=(transport.init_info(1, 2), updates, out, worker_device))
    worker.start()
    transport.open(2, abandon=lambda: False)
    for plan in plans:
        transport.send([params[name].cuda() for name in plan.names], abandon=lambda: False)
    got = out.get(timeout=120)
    worker.join(timeout=60)
    transport.close()
    return worker.exitcode, got, params


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_worker_receives_every_tensor_bit_for_bit():
    code, got, params = exchange(1)
    assert code == 0
    assert got.keys() == params.keys()
    for name, tensor in params.items():
        assert torch.equal(got[name], tensor), name
