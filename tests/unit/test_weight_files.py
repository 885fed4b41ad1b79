"""The file channel's format (relax_hpc.weights.files) and exact deltas (relax_hpc.weights.delta),
in one process: what an engine loads from a folder equals the trainer's tensors bit for bit."""

import json

import pytest
import torch

from relax_hpc.protocol.requests import ProtocolError
from relax_hpc.weights.buckets import BucketPlan, pack
from relax_hpc.weights.delta import SparseDelta, diff
from relax_hpc.weights.files import assign, load_folder, write_dense, write_sparse

PLAN = BucketPlan(["a", "b"], ["bfloat16", "bfloat16"], [[64, 8], [100]])


def bucket(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(torch.bfloat16) for s in PLAN.shapes]


def engine_params(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """An engine's parameters holding `tensors` (copies: the test keeps the originals)."""
    return {n: torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in zip(PLAN.names, tensors, strict=True)}


def delta_folder(tmp_path, old, new, base="3"):
    folder = tmp_path / "v4-delta"
    folder.mkdir()
    (folder / "DELTA.json").write_text(json.dumps({"base": base}))
    sparse, changed = diff(pack(old), pack(new), PLAN)
    if sparse is not None:
        write_sparse(folder / "b0.safetensors", sparse, PLAN)
    else:
        write_dense(folder / "b0.safetensors", pack(new), PLAN)
    return folder, sparse, changed


def test_a_sparse_delta_gives_the_new_bits_exactly(tmp_path):
    """A few elements change, among them +0.0 to -0.0 and a NaN (equal as numbers, not as bits)."""
    old = bucket(0)
    new = [t.clone() for t in old]
    new[0][3, 1], new[1][7], new[1][9] = 0.5, float("nan"), 0.0
    old[1][9] = -0.0
    folder, sparse, changed = delta_folder(tmp_path, old, new)
    assert sparse is not None and changed == 3 and sparse.nbytes == 3 * (4 + 2)
    params = engine_params(old)
    load_folder(folder, params, delta=True, held="3").apply(params)
    for name, expected in zip(PLAN.names, new, strict=True):
        assert torch.equal(params[name].view(torch.int16), expected.view(torch.int16)), name


def test_a_bucket_mostly_changed_travels_dense(tmp_path):
    old, new = bucket(0), bucket(1)
    folder, sparse, changed = delta_folder(tmp_path, old, new)
    assert sparse is None and changed > 0.9 * sum(t.numel() for t in new)
    params = engine_params(old)
    load_folder(folder, params, delta=True, held="3").apply(params)
    assert all(torch.equal(params[n], t) for n, t in zip(PLAN.names, new, strict=True))


def test_a_delta_is_refused_by_an_engine_without_its_base(tmp_path):
    old = bucket(0)
    folder, _, _ = delta_folder(tmp_path, old, bucket(1))
    with pytest.raises(ProtocolError, match="applies to version 3; this engine holds 2"):
        load_folder(folder, dict(zip(PLAN.names, old, strict=True)), delta=True, held="2")


def test_a_sparse_delta_pointing_outside_its_bucket_is_refused(tmp_path):
    old = bucket(0)
    new = [t.clone() for t in old]
    new[1][99] = 7.0  # the bucket's last element
    folder, sparse, _ = delta_folder(tmp_path, old, new)
    assert sparse is not None
    write_sparse(folder / "b0.safetensors", SparseDelta(sparse.index + 1, sparse.values), PLAN)
    params = engine_params(old)
    with pytest.raises(ProtocolError, match="outside the bucket"):
        load_folder(folder, params, delta=True, held="3")
    assert all(torch.equal(params[n], t) for n, t in zip(PLAN.names, old, strict=True))


def test_a_folder_of_unknown_names_or_shapes_is_refused(tmp_path):
    write_dense(tmp_path / "b0.safetensors", pack(bucket(0)), PLAN)
    with pytest.raises(ProtocolError, match="shapes differ"):
        load_folder(tmp_path, {"a": torch.zeros(64, 8), "b": torch.zeros(99)}, delta=False, held="0")
    with pytest.raises(ProtocolError, match="unknown parameter names"):
        load_folder(tmp_path, {"a": torch.zeros(64, 8)}, delta=False, held="0")


def test_buckets_are_spread_over_the_writers_by_size():
    sizes = [[1000], [10], [600], [500], [20]]
    plans = [BucketPlan([f"p{i}"], ["float32"], [s]) for i, s in enumerate(sizes)]
    owner = assign(plans, 2)
    load = [sum(p.nbytes for p, o in zip(plans, owner, strict=True) if o == r) for r in range(2)]
    assert sorted(load) == [4120, 4400]  # largest first, each to the lighter rank
