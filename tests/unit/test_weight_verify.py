"""Weights verified after a push (relax_hpc.weights.verify, relax_hpc.weights.digests): the digests
as each engine kind's checker computes them, the engines' layouts, the reading of their answers,
the comparison and when a push is checked. The check against live engines, with a corrupted one:
tests/integration/test_weight_sync.py; against SGLang's own classes: tests/unit/test_sglang_contract.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from relax_hpc.protocol.registry import EngineRecord, Quarantine, read_quarantine, write_quarantine, write_record
from relax_hpc.weights.digests import digest, mh64, mix64
from relax_hpc.weights.verify import (
    EMPTY_SHA256,
    RETRY_S,
    FusedView,
    Reported,
    WeightCheck,
    compare,
    same_view,
    vllm_answer,
)

# SGLang 0.5.23's gpu_tensor_hash of these tensors: its two triton kernels run by triton 3.9's
# interpreter (TRITON_INTERPRET=1) on the CPU, the wrapper's steps without its is_cuda asserts.
SGLANG_GPU_HASH = [
    (torch.arange(16389, dtype=torch.float32) * 0.5, 0x0FF038A16FD659F2),  # 3 tiles, the last partial
    (torch.arange(24576, dtype=torch.float32).to(torch.bfloat16), 0x529B391785386001),
    (torch.arange(11, dtype=torch.uint8), 0x9555A0D21E1D5E68),  # 11 bytes: a zero-padded word
    (torch.zeros(0), 0),
]


def test_mix64_is_sglangs_gpu_hash():
    for tensor, theirs in SGLANG_GPU_HASH:
        assert mix64(tensor) == theirs, tensor.dtype


def test_digests_of_parts_are_the_digests_of_their_concatenation():
    parts = [torch.randn(3, 4), torch.randn(2, 4)]
    whole = torch.cat(parts)
    for how in ("sha256", "mh64", "mix64"):
        assert digest(parts, how) == digest([whole], how)
    assert digest([whole], "sha256") == hashlib.sha256(whole.numpy().tobytes()).hexdigest()  # vLLM's


def test_mh64_changes_with_any_byte_its_length_and_its_order():
    """The built-in engine's hash in host memory: one changed byte anywhere (the words of several
    chunks, the tail past the last whole word) changes it, and so do the length and two chunks
    swapped."""
    data = np.random.default_rng(0).integers(0, 256, size=3 * 8 * 2**14 + 5, dtype=np.uint8)
    base = mh64(data)
    for at in (0, 7, 8 * 2**14, 2 * 8 * 2**14 + 3, data.size - 1):
        changed = data.copy()
        changed[at] ^= 0x80
        assert mh64(changed) != base, at
    assert mh64(data[:-1]) != base and mh64(np.zeros(8, np.uint8)) != mh64(np.zeros(16, np.uint8))
    chunk = 8 * 2**14
    swapped = np.concatenate([data[chunk : 2 * chunk], data[:chunk], data[2 * chunk :]])
    assert mh64(swapped) != base


def test_the_fused_view_stacks_projections_and_pads_the_vocabulary():
    """SGLang's and vLLM's layout: q/k/v as qkv_proj, gate/up as gate_up_proj (in any push order),
    the embedding's rows padded with zeros to a multiple of 64; anything else as pushed."""
    q, k, v, up, gate = (torch.full((2, 3), float(i)) for i in range(5))
    embed, norm = torch.randn(70, 3), torch.ones(3)
    view = FusedView()
    out = {}
    for name, tensor in [
        ("model.layers.0.self_attn.k_proj.weight", k), ("model.layers.0.mlp.up_proj.weight", up),
        ("model.layers.0.self_attn.q_proj.weight", q), ("model.layers.0.self_attn.v_proj.weight", v),
        ("model.layers.0.mlp.gate_proj.weight", gate), ("model.embed_tokens.weight", embed),
        ("model.norm.weight", norm),
    ]:  # fmt: skip
        out.update({n: torch.cat(parts) for n, parts in view(name, tensor)})
    assert torch.equal(out.pop("model.layers.0.self_attn.qkv_proj.weight"), torch.cat([q, k, v]))
    assert torch.equal(out.pop("model.layers.0.mlp.gate_up_proj.weight"), torch.cat([gate, up]))
    padded = out.pop("model.embed_tokens.weight")
    assert padded.shape == (128, 3) and torch.equal(padded[:70], embed) and not padded[70:].any()
    assert list(out) == ["model.norm.weight"] and torch.equal(out["model.norm.weight"], norm)
    assert same_view("x", norm) == [("x", [norm])]


def test_vllms_checksums_read_as_the_trainers_names():
    """The worker's place prefix and LoRA's base_layer go; a prepacked layer's empty digest is not
    checked; a second tensor-parallel rank means shards, which are not compared."""
    reported = vllm_answer(
        {
            "dp0:pp0:pcp0:tp0:model.layers.0.self_attn.qkv_proj.base_layer.weight": "a",
            "dp0:pp0:pcp0:tp0:model.layers.0.mlp.down_proj.weight": EMPTY_SHA256,
            "dp0:pp1:pcp0:tp0:model.norm.weight": "b",
        },
        "3",
    )
    assert reported.digests == {"model.layers.0.self_attn.qkv_proj.weight": "a", "model.norm.weight": "b"}
    assert reported.unchecked == {"model.layers.0.mlp.down_proj.weight"} and reported.why_not is None
    assert vllm_answer({"dp0:pp0:pcp0:tp1:model.norm.weight": "b"}, "3").why_not == "tensor-parallel shards"


def _record(engine: str = "engine-0", instance: str = "i0") -> EngineRecord:
    return EngineRecord(engine, "127.0.0.1", 1, 1, instance, "3")


def test_compare_says_what_differs_and_what_could_not_be_checked():
    expected = {"a": "1", "b": "2", "c": "3"}
    verdict = compare(_record(), expected, Reported("3", {"a": "1", "b": "9"}), "3")
    assert (verdict.checked, verdict.differ, verdict.not_checked, verdict.matches) == (2, ["b"], ["c"], False)
    assert compare(_record(), expected, Reported("3", dict(expected)), "3").matches
    stale = compare(_record(), expected, Reported("2", dict(expected)), "3")
    assert stale.skipped == "holds version 2, not 3" and not stale.matches
    shards = compare(_record(), expected, Reported("3", why_not="tensor-parallel shards"), "3")
    assert shards.skipped == "tensor-parallel shards" and not shards.matches


def test_every_nth_push_is_checked_and_every_push_while_an_engine_is_held_out(tmp_path: Path):
    registry, quarantine = tmp_path / "engines", tmp_path / "quarantine"
    registry.mkdir()
    check = WeightCheck("torch", 3, registry, quarantine, lambda _: None, "key", 5.0, None, torch.device("cpu"))
    stream = lambda: iter([("w", torch.ones(2))])  # noqa: E731
    tapped = []
    for version in range(1, 8):
        params = check.params(stream)
        list(params())
        tapped.append(check.tapped)
        check.pushed(version)
    assert tapped == [True, False, False, True, False, False, True]
    assert check.expected == {"w": digest([torch.ones(2)], "mh64")}
    # engine-1 held out: every push is checked while its process is registered (here it does
    # not answer, which leaves the marker as it is), and the marker goes with the process
    write_record(registry, _record("engine-1", "i1"))
    assert not check.wants_push()
    write_quarantine(quarantine, Quarantine("engine-1", "i1", "7", ["w"], 1, 1, 0.0))
    assert not check.wants_push()  # a push has just reached the engines
    check.last_push -= RETRY_S + 1
    assert check.wants_push()  # nothing pushed for a while, an engine out of service: push again
    for version in (8, 9):
        check.params(stream)
        assert check.tapped
        (verdict,) = check.pushed(version)
        assert (verdict.skipped or "").startswith("no answer")
    assert list(read_quarantine(quarantine)) == ["engine-1"]
    write_record(registry, _record("engine-1", "i2"))  # restarted
    check.params(stream)
    check.pushed(10)
    assert read_quarantine(quarantine) == {}
    check.params(stream)
    assert not check.tapped  # back to every third push
