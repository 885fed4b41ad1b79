"""The file channel's format (relax_hpc.weights.files) and exact deltas (relax_hpc.weights.delta),
in one process: what an engine loads from a folder equals the trainer's tensors bit for bit."""

import json
from pathlib import Path

import pytest
import torch

from relax_hpc.engines.torch_engine import TorchEngine
from relax_hpc.protocol.requests import ProtocolError, UpdateWeightFromDiskReqInput
from relax_hpc.weights.buckets import BucketPlan, pack, plan_buckets
from relax_hpc.weights.delta import SparseDelta, diff
from relax_hpc.weights.files import DELTA_FORMAT, load_folder, write_dense, write_sparse

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


def test_the_engine_loads_a_version_and_keeps_it_when_the_next_folder_is_broken(tmp_path):
    """The built-in engine's /update_weights_from_disk: a whole version bit for bit; a folder with
    a truncated file (what a crash mid-write would leave, were it published) or a delta of
    another base is refused before any weight changes."""
    engine = TorchEngine(str(Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen3-addition"), "float32")
    new = {n: p.detach() + 0.25 for n, p in engine.params.items()}
    specs = [(n, t.shape, t.dtype) for n, t in new.items()]
    for folder, shift in (("v1", 0.0), ("v2", 0.5)):  # v2: other weights, in several files
        (tmp_path / folder).mkdir()
        for k, plan in enumerate(plan_buckets(specs, 2**18)):
            tensors = [new[n] + shift for n in plan.names]
            write_dense(tmp_path / folder / f"b{k:05d}.safetensors", pack(tensors), plan)
    assert len(list((tmp_path / "v2").iterdir())) > 2
    assert engine.update_from_disk(UpdateWeightFromDiskReqInput(str(tmp_path / "v1"), weight_version="1"))
    assert engine.weight_version == "1"
    assert all(torch.equal(engine.params[n], t) for n, t in new.items())
    last = max((tmp_path / "v2").iterdir())
    last.write_bytes(last.read_bytes()[:-100])
    with pytest.raises(Exception):  # noqa: B017  # safetensors' own error: any is a refusal
        engine.update_from_disk(UpdateWeightFromDiskReqInput(str(tmp_path / "v2"), weight_version="2"))
    folder, _, _ = delta_folder(tmp_path, bucket(0), bucket(1), base="7")
    with pytest.raises(ProtocolError, match="applies to version 7"):
        engine.update_from_disk(UpdateWeightFromDiskReqInput(str(folder), DELTA_FORMAT, weight_version="2"))
    assert engine.weight_version == "1"
    assert all(torch.equal(engine.params[n], t) for n, t in new.items())
