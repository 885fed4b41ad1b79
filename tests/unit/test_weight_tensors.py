"""Weights by reference (relax_hpc.weights.tensors): what a colocated engine maps, and what it refuses."""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import re
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import pytest
import torch

from relax_hpc.weights.buckets import BucketPlan, pack, unpack
from relax_hpc.weights.tensors import (
    PayloadError,
    bucket_records,
    deserialize,
    serialize,
    serialize_bucket,
    share_cpu_memory_by_name,
)

PLAN = BucketPlan(["w", "b"], ["float32", "float32"], [[2, 3], [4]])


def test_another_process_maps_the_senders_memory_not_a_copy_of_its_bytes():
    """The payload names shared memory: bytes the sender writes after serializing are what the
    reader sees, and the payload is far smaller than the tensors."""
    flat = pack([torch.zeros(2, 3), torch.zeros(4)])
    (payload,) = serialize(unpack(flat, PLAN))
    flat.view(torch.float32).copy_(torch.arange(10, dtype=torch.float32))  # written after serializing
    big = pack([torch.zeros(512, 512), torch.zeros(4)])
    assert len(serialize(unpack(big, BucketPlan(["w", "b"], ["float32"] * 2, [[512, 512], [4]])))[0]) < 2000
    assert read_elsewhere(payload) == {
        "w": ["torch.float32", [2, 3], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]],
        "b": ["torch.float32", [4], [6.0, 7.0, 8.0, 9.0]],
    }


def read_elsewhere(payload: str, load_format: str | None = None) -> dict:
    """What another process reads from the payload: {name: [dtype, shape, values]}."""
    reader = (
        "import json, sys\n"
        "from relax_hpc.weights.tensors import deserialize\n"
        f"named = deserialize(sys.stdin.read(), {load_format!r})\n"
        "print(json.dumps({n: [str(t.dtype), list(t.shape), t.float().flatten().tolist()] for n, t in named}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", reader], check=False, input=payload, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result: dict = json.loads(out.stdout)
    return result


def _pickled(obj: object) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


class _LoadsAModel:
    def __reduce__(self):
        return (torch.load, ("/tmp/x",))


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (_pickled(_RunsCode()), "may not name posix.system"),
        (_pickled(_LoadsAModel()), "may not name torch.serialization.load"),
        (_pickled({"w": 1}), "list of (name, tensor) pairs"),
        (_pickled([("w", [1.0, 2.0])]), "list of (name, tensor) pairs"),
        ("not base64!", "does not decode"),
        (base64.b64encode(b"\x80\x05junk").decode(), "does not decode"),
    ],
    ids=["os.system", "torch.load", "a dict", "a list, not a tensor", "not base64", "not a pickle"],
)
def test_a_payload_that_is_not_shared_tensors_is_refused_before_it_runs(payload, error):
    with pytest.raises(PayloadError, match=error.replace("(", r"\(").replace(")", r"\)")):
        deserialize(payload)


def test_the_payload_carries_one_copy_per_tensor_parallel_rank():
    payloads = serialize(unpack(pack([torch.ones(2, 3), torch.ones(4)]), PLAN), tp_size=4)
    assert len(payloads) == 4 and len(set(payloads)) == 1
    named = deserialize(payloads[2])
    assert [n for n, _ in named] == ["w", "b"] and named[0][1].shape == (2, 3)


def test_a_flattened_bucket_is_one_shared_buffer_read_as_the_senders_tensors():
    """load_format flattened_bucket: another process maps the one buffer (bytes written after
    serializing are what it reads) and splits it by the records into the named tensors."""
    plan = BucketPlan(["w", "h"], ["float32", "bfloat16"], [[2, 3], [4]])
    flat = pack([torch.zeros(2, 3), torch.zeros(4, dtype=torch.bfloat16)])
    (payload,) = serialize_bucket(flat, bucket_records(plan))
    flat[:24].view(torch.float32).copy_(torch.arange(6, dtype=torch.float32))
    flat[24:].view(torch.bfloat16).fill_(0.5)
    assert read_elsewhere(payload, "flattened_bucket") == {
        "w": ["torch.float32", [2, 3], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]],
        "h": ["torch.bfloat16", [4], [0.5] * 4],
    }


def _shared(obj: object) -> str:
    """Pickled as the sender does: tensors by shared memory."""
    share_cpu_memory_by_name()
    out = io.BytesIO()
    ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(out.getvalue()).decode()


def _bucket_payload(flat: object, **record: object) -> str:
    base = {"name": "w", "shape": torch.Size([2, 3]), "dtype": torch.float32, "start_idx": 0, "end_idx": 24}
    return _shared({"flattened_tensor": flat, "metadata": [SimpleNamespace(**{**base, **record})]})


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (_bucket_payload(torch.zeros(24, dtype=torch.uint8), end_idx=32), "bytes 0..32 of a 24-byte bucket"),
        (_bucket_payload(torch.zeros(24, dtype=torch.uint8), shape=torch.Size([3, 3])), "shape [3, 3]"),
        (_bucket_payload(torch.zeros(26, dtype=torch.uint8), start_idx=2, end_idx=26), "bytes 2..26"),
        (_bucket_payload(torch.zeros(6)), "1-D uint8 'flattened_tensor'"),
        (_bucket_payload(torch.zeros(24, dtype=torch.uint8), dtype="float32"), "a record's dtype is a torch.dtype"),
        (_shared({"flattened_tensor": torch.zeros(4, dtype=torch.uint8), "metadata": [{"name": "w"}]}), "records"),
        (_shared([("w", torch.zeros(2))]), "1-D uint8 'flattened_tensor'"),
    ],
    ids=["past the end", "wrong shape", "unaligned", "not bytes", "dtype a string", "a dict record", "a list"],
)
def test_a_flattened_bucket_whose_records_do_not_fit_its_buffer_is_refused(payload, error):
    with pytest.raises(PayloadError, match=re.escape(error)):
        deserialize(payload, "flattened_bucket")


@pytest.mark.parametrize("gap", [0, 8], ids=["back to back (one split)", "with a gap (a view each)"])
def test_each_record_reads_its_own_bytes(gap):
    """Records as the sender packs them are split in one call; records another sender may write
    (gaps between tensors) are viewed one by one: both give each tensor its own bytes."""
    tensors = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.arange(6, 10, dtype=torch.float32)]
    flat = torch.zeros(24 + gap + 16, dtype=torch.uint8)
    flat[:24].view(torch.float32).copy_(tensors[0].reshape(-1))
    flat[24 + gap :].view(torch.float32).copy_(tensors[1])
    records = bucket_records(BucketPlan(["w", "b"], ["float32"] * 2, [[2, 3], [4]]))
    records[1].start_idx += gap
    records[1].end_idx += gap
    named = deserialize(_shared({"flattened_tensor": flat, "metadata": records}), "flattened_bucket")
    assert [n for n, _ in named] == ["w", "b"]
    for (_, got), sent in zip(named, tensors, strict=True):
        assert torch.equal(got, sent)
