"""Tensor digests as the engines' weight checkers compute them (relax_hpc.weights.verify compares
them): sha256 of a tensor's bytes (vLLM's), SGLang's GPU hash (`mix64`: its triton kernels'
arithmetic in torch, so the same function on any device; SGLang's weights are on GPUs), and the
built-in engine's: mix64 on a GPU, mh64 of the bytes in host memory; and the built-in engine's
answer to SGLang's /weights_checker. Torch only: the built-in engine imports this at its start."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch

Hash = Literal["sha256", "mh64", "mix64"]

# -- the hashes ------------------------------------------------------------------------------------

_M32, _M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF
# SGLang's GPU hash (sglang/kernels/ops/memory/gpu_tensor_hash.py, 0.5.23): its constants.
_SEED = 0x243F6A88
_FMIX_C1, _FMIX_C2, _POS_A, _POS_B = 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2D, 0x165667B1
_TILE = 8192  # words per tile (tile_words)
_CHUNK = _TILE * 128  # words hashed at once here (4 MiB of the tensor; temporaries 8 bytes a word)


def host_bytes(t: torch.Tensor) -> Any:
    """A tensor's bytes as they lie in memory, C order (a buffer hashlib reads without a copy)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


_MH_WORDS = 1 << 14  # words per chunk of mh64: its keys and one chunk's products stay in the L2 cache
_MH_ODD = 0xFF51AFD7ED558CCD  # odd: the chunks' Horner multiplier is invertible modulo 2^64


@functools.cache
def _mh_keys() -> np.ndarray:
    """mh64's keys: splitmix64 of 1.._MH_WORDS, made odd (invertible modulo 2^64)."""
    x = np.arange(1, _MH_WORDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x | np.uint64(1)


def mh64(data: np.ndarray) -> int:
    """relax_hpc's hash of bytes in host memory, the built-in engine's (a multilinear hash: numpy
    at memory speed, 1.5 times zlib's crc32 and 3.4 times sha256 here): the bytes as 64-bit
    words, each chunk of 2^14 words summed with a key per position, modulo 2^64 (keys odd, so a
    change of one word always changes its chunk's sum), the chunks combined in order by Horner's
    rule with an odd multiplier (a changed chunk always changes the result) after the byte count,
    the tail's bytes last, and the result mixed (splitmix64). Detects every change of one word;
    not a cryptographic hash: it finds corruption, not tampering."""
    n = data.size
    words = data[: n - n % 8].view(np.uint64)
    keys, products = _mh_keys(), np.empty(_MH_WORDS, dtype=np.uint64)
    h = n
    for start in range(0, words.size, _MH_WORDS):
        chunk = words[start : start + _MH_WORDS]
        np.multiply(chunk, keys[: chunk.size], out=products[: chunk.size])  # wraps modulo 2^64
        h = (h * _MH_ODD + int(products[: chunk.size].sum(dtype=np.uint64))) & _M64
    h = (h * _MH_ODD + int.from_bytes(data[n - n % 8 :].tobytes(), "little")) & _M64
    return _splitmix64(h)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on 32-bit words held in int64 (products wrap; the low 32 bits are kept)."""
    x = x ^ (x >> 16)
    x = (x * _FMIX_C1) & _M32
    x = x ^ (x >> 13)
    x = (x * _FMIX_C2) & _M32
    return x ^ (x >> 16)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & _M32) | (x >> (32 - r))


def _splitmix64(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


@torch.no_grad()
def mix64(t: torch.Tensor) -> int:
    """SGLang's `gpu_tensor_hash` of a tensor (its triton kernels' arithmetic, in torch on the
    tensor's device): the bytes as 32-bit words (zero-padded), per tile of 8192 words two sums of
    murmur3-mixed words and positions, each mixed with the byte count; the tiles' 64-bit values
    summed, then splitmix64."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    words = data.view(torch.int32)
    n = words.numel()
    if n == 0:
        return 0
    s1, s2 = _SEED & _M32, ((_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    nbytes = (n * 4) & _M32
    total = torch.zeros((), dtype=torch.int64, device=t.device)  # sums wrap modulo 2^64, as uint64's
    for start in range(0, n, _CHUNK):
        v = words[start : start + _CHUNK].to(torch.int64) & _M32
        idx = torch.arange(start, start + v.numel(), dtype=torch.int64, device=t.device)
        tiles = -(-v.numel() // _TILE)
        halves = []
        for pos, seed, rot in ((_POS_A, s1, 15), (_POS_B, s2, 13)):
            k = _fmix32(v ^ ((((idx * pos) + seed) & _M32) ^ _rotl32(idx, rot)))
            k = torch.nn.functional.pad(k, (0, tiles * _TILE - k.numel()))  # the kernel's masked lanes add 0
            h = k.view(tiles, _TILE).sum(dim=1) & _M32
            halves.append(_fmix32(h ^ nbytes))
        total = total + ((halves[0] << 32) | halves[1]).sum()
    return _splitmix64(int(total.item()))


def digest(parts: list[torch.Tensor], how: Hash) -> str:
    """The digest of the tensors' bytes laid end to end, as an engine's checker writes it."""
    if how == "mix64":
        flat = [p.detach().contiguous().reshape(-1).view(torch.uint8) for p in parts]
        return f"{mix64(flat[0] if len(flat) == 1 else torch.cat(flat)):016x}"
    if how == "mh64":
        data = [host_bytes(p) for p in parts]
        return f"{mh64(data[0] if len(data) == 1 else np.concatenate(data)):016x}"
    h = hashlib.sha256()
    for p in parts:
        h.update(host_bytes(p))
    return h.hexdigest()


def held_hash(t: torch.Tensor) -> Hash:
    """The built-in engine's hash of a tensor where it lies: SGLang's GPU hash on a GPU, mh64 in
    host memory (SGLang takes sha256's first 8 bytes there, 3.4 times slower: BENCHMARKS.md,
    "Weights verified inside a run")."""
    return "mix64" if t.is_cuda else "mh64"


def engine_digests(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, str], Hash]:
    """The built-in engine's /weights_checker checksums, and the hash (one device: the model's)."""
    how: Hash = held_hash(next(iter(tensors.values()))) if tensors else "mh64"
    return {name: digest([t], how) for name, t in tensors.items()}, how


def checker_answer(checksums: dict[str, str], how: Hash, version: str) -> dict[str, Any]:
    """SGLang's /weights_checker answer for one rank (tp 1) of these checksums, with the version
    they were read at and the hash (relax_hpc's two fields beside SGLang's)."""
    per_gpu = _overall(checksums)
    info = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
            "rank": 0, "size": 1}  # fmt: skip
    rank = {"checksums": checksums, "per_gpu_checksum": per_gpu, "parallelism_info": [info]}
    per_engine = hashlib.sha256(per_gpu.encode()).hexdigest()
    return {"success": True, "message": "Success.", "ranks": [rank], "per_engine_checksum": per_engine,
            "weight_version": version, "hash": how}  # fmt: skip


def _overall(checksums: dict[str, str]) -> str:
    """SGLang's overall_checksum: sha256 over the sorted names and their checksums."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()
