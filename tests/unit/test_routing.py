"""MoE routing replay with a tiny Qwen3-MoE: the engine answers the routers' choices as SGLang
does, they travel through a spool file, and the trainer's forward uses exactly them."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch

from relax_hpc.engines.torch_engine import TorchEngine
from relax_hpc.envs.base import Sampled, Trajectory
from relax_hpc.exchange.spool import read_batch, write_batch
from relax_hpc.models.hf import load_policy
from relax_hpc.protocol import requests as P
from relax_hpc.rollout.plan import Group, to_sample_batch
from relax_hpc.trainer.batching import share_of, token_logprobs_and_entropy
from tests.models.qwen3_family import build_qwen3_moe

LAYERS, TOP_K, NEW = 2, 2, 5


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return build_qwen3_moe(tmp_path_factory.mktemp("moe"))


def answers(engine: TorchEngine, prompts: list[list[int]]) -> list[dict]:
    sampling = [
        {"max_new_tokens": NEW, "temperature": 1.0, "ignore_eos": True, "sampling_seed": k} for k in range(len(prompts))
    ]
    request = P.GenerateReqInput(
        input_ids=prompts, sampling_params=sampling, return_logprob=True, return_routed_experts=True
    )
    out = engine.generate(request)
    assert isinstance(out, list)
    return out


def test_the_engine_answers_every_input_positions_choices_as_sglang_does(moe):
    engine = TorchEngine(str(moe), "float32")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    for prompt, out in zip(prompts, answers(engine, prompts), strict=True):
        choices = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
        choices = choices.reshape(-1, LAYERS, TOP_K)  # SGLang's layout: int32 [positions, layers, top_k]
        assert choices.shape[0] == len(prompt) + NEW - 1  # every input position; the last token is none
        assert choices.min() >= 0 and choices.max() < 8
        assert all(len(set(row)) == TOP_K for row in choices.reshape(-1, TOP_K).tolist())  # k distinct experts


def batch_of(out: list[dict], prompts: list[list[int]], routed: list[np.ndarray], tmp_path: Path):
    trajectories = []
    for prompt, o, choices in zip(prompts, out, routed, strict=True):
        logprobs = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        trajectories.append(
            Trajectory(prompt).add_sampled(Sampled(o["output_ids"], logprobs, [0] * NEW, "length", "", None, choices))
        )
    write_batch(
        tmp_path / "b.h5", to_sample_batch(0, [Group(1, 0, trajectories, [0.0] * len(trajectories))]), writer="t"
    )
    return read_batch(tmp_path / "b.h5")


def test_the_trainer_replays_the_engines_choices_from_the_spool(moe, tmp_path):
    engine = TorchEngine(str(moe), "float32")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    out = answers(engine, prompts)
    routed = [
        np.frombuffer(base64.b64decode(o["meta_info"]["routed_experts"]), dtype=np.int32).reshape(-1, LAYERS * TOP_K)
        for o in out
    ]
    batch = batch_of(out, prompts, routed, tmp_path)
    assert batch.routed_experts is not None and batch.routed_experts.dtype == np.uint8  # 8 experts: a byte each
    train, _ = share_of(batch, [0, 1], 0, 1, 0)
    assert train.routed is not None and train.routed.shape == (2, train.input_ids.shape[1], LAYERS * TOP_K)
    model = load_policy(str(moe), torch.float32).eval()
    mask = train.loss_mask.bool()
    with torch.no_grad():
        replayed, _ = token_logprobs_and_entropy(model, train)
    assert (replayed[mask] - train.rollout_logprobs[mask]).abs().max() < 1e-4
    # Other experts than the engine's: the forward really takes what it is given.
    shifted = [(r + 1) % 8 for r in routed]
    other, _ = share_of(batch_of(out, prompts, shifted, tmp_path), [0, 1], 0, 1, 0)
    with torch.no_grad():
        forced, _ = token_logprobs_and_entropy(model, other)
    assert (forced[mask] - train.rollout_logprobs[mask]).abs().max() > 1e-3
