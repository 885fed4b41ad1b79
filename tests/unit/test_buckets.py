"""Weight-sync buckets: planning by size and dtype; uint8 flattening and splitting (SGLang's
"flattened_bucket" layout)."""

import torch

from relax_hpc.weights.buckets import pack, plan_buckets, unpack


def test_buckets_respect_size_and_dtype_and_keep_order():
    specs = [
        ("a", torch.Size([4, 4]), torch.float32),  # 64 bytes
        ("b", torch.Size([8]), torch.float32),  # 32
        ("c", torch.Size([10]), torch.float32),  # 40 -> would exceed 100 bytes: new bucket
        ("d", torch.Size([3]), torch.bfloat16),  # dtype change: new bucket
        ("e", torch.Size([100]), torch.float32),  # larger than a bucket: travels alone
    ]
    plans = plan_buckets(specs, max_bytes=100)
    assert [p.names for p in plans] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [p.nbytes for p in plans] == [96, 40, 6, 400]
    assert plans[2].dtypes == ["bfloat16"] and plans[0].shapes == [[4, 4], [8]]


def test_pack_unpack_round_trip_is_bit_exact():
    tensors = {"x": torch.randn(3, 5), "y": torch.randn(7), "z": torch.tensor(2.5)}
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in tensors.items()], max_bytes=1 << 20)[0]
    flat = pack(list(tensors.values()))
    assert flat.dtype == torch.uint8 and flat.numel() == plan.nbytes == 4 * 23
    for name, tensor in unpack(flat.clone(), plan):
        assert torch.equal(tensor, tensors[name]) and tensor.shape == tensors[name].shape


def test_bf16_bucket_round_trip():
    t = torch.randn(9).to(torch.bfloat16)
    plan = plan_buckets([("w", t.shape, t.dtype)], 1 << 20)[0]
    ((name, back),) = unpack(pack([t]), plan)
    assert name == "w" and back.dtype == torch.bfloat16 and torch.equal(back, t)
