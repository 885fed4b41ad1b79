"""One-GPU process group and megatron's parallel state for the GPU tests."""

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def one_gpu_world():
    from tests.unit.test_hf_mapping import free_port

    torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 products on both sides,
    torch.backends.cudnn.allow_tf32 = False  # convolutions' too (the towers' patch and mel convs)
    torch.cuda.set_device(0)
    # The trainer's group: NCCL for CUDA tensors, gloo for the CPU ones (checkpoint flags, counts).
    dist.init_process_group(
        "cpu:gloo,cuda:nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    yield
    dist.destroy_process_group()


@pytest.fixture
def mp(one_gpu_world):
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()


@pytest.fixture
def megatron_world(one_gpu_world):
    from megatron.core import parallel_state

    yield  # the megatron backend initialises megatron's parallel state from the job's config
    parallel_state.destroy_model_parallel()
