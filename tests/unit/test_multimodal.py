"""Images and audio from the dataset to the loss: the shipped tiny Qwen2.5-VL and Qwen2-Audio,
and tiny Qwen3-VL and Qwen3-Omni (the GPU recipes' families) built for the test.

The engine expands the placeholders, samples, and reports the prompt it conditioned on; the
batch goes through a real spool file; the trainer rebuilds the model inputs from the stored media
and must see the same prompt and give the same log-probabilities (CPU, fp32). Text-only rows ride
in the same batch, and prompts of different lengths exercise padding and multimodal positions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from relax_hpc.data.media import Kind
from relax_hpc.data.processor import MediaProcessor, prompt_encoder, up_to_media_token, video_spec
from relax_hpc.data.prompts import PromptRow, load_prompts
from relax_hpc.engines.torch_engine import TorchEngine
from relax_hpc.envs.base import Sampled, Trajectory
from relax_hpc.envs.context import GenerateCall
from relax_hpc.exchange.spool import read_batch, write_batch
from relax_hpc.models.hf import EngineParameters, load_policy
from relax_hpc.models.tiny_multimodal import CELL, GRID
from relax_hpc.protocol import requests as P
from relax_hpc.rollout.engine_policy import EnginePolicy
from relax_hpc.rollout.plan import Group, to_sample_batch
from relax_hpc.trainer.batching import share_of, token_logprobs_and_entropy
from tests.models.qwen3_family import build_qwen3_omni, build_qwen3_vl, build_qwen3_vl_video

ASSETS = Path(__file__).resolve().parents[2] / "assets"
SHAPES, BEEPS = ASSETS / "shapes/shapes.jsonl", ASSETS / "beeps/beeps.jsonl"
MOTION = ASSETS / "motion/motion.jsonl"
# name -> (model folder or builder, dataset, media field, placeholder tokens per item)
TASKS: dict[str, tuple[Path | Callable[[Path], Path], Path, str, int]] = {
    "qwen2.5-vl": (ASSETS / "tiny-qwen2.5-vl-shapes", SHAPES, "images", GRID * GRID),
    "qwen2-audio": (ASSETS / "tiny-qwen2-audio-beeps", BEEPS, "audios", 25),
    # 4 frames of 56 x 56 (2 s at 2 fps): 2 temporal patches of 2 x 2 merged tokens
    "qwen2.5-vl-video": (ASSETS / "tiny-qwen2.5-vl-motion", MOTION, "videos", 8),
    "qwen3-vl": (build_qwen3_vl, SHAPES, "images", 4),  # 64 x 64 pixels: 2 x 2 merged patches of 16
    # the motion clips at 64 x 64: 2 temporal patches of 2 x 2 merged tokens, each after its time
    "qwen3-vl-video": (build_qwen3_vl_video, MOTION, "videos", 8),
    "qwen3-omni-image": (build_qwen3_omni, SHAPES, "images", 4),
    "qwen3-omni-audio": (build_qwen3_omni, BEEPS, "audios", 13),  # 1 s: 100 frames, 13 tokens
}
KINDS: dict[str, Kind] = {"images": "image", "audios": "audio", "videos": "video"}
COPIES, NEW_TOKENS = 2, 4


@pytest.fixture(scope="module", params=sorted(TASKS))
def task(request, tmp_path_factory) -> SimpleNamespace:
    source, data, field, tokens = TASKS[request.param]
    model = source if isinstance(source, Path) else source(tmp_path_factory.mktemp(request.param))
    kind: Kind = KINDS[field]
    engine = TorchEngine(str(model), "float32")
    assert engine.processor is not None
    rows = load_prompts(data, "prompt", "answer", {kind: field}, video=video_spec(str(model)))[:2]
    marker = f"<{kind}>"
    rows += [
        PromptRow(2, f"{marker}count them all, please", "1", rows[0].media),  # a longer prompt, same item
        PromptRow(3, "how many?", "0"),  # text only, in the same batch
    ]
    encode = prompt_encoder(str(model), engine.processor)
    return SimpleNamespace(
        name=request.param, kind=kind, model=str(model), engine=engine, processor=engine.processor, rows=rows,
        prompt_ids=[encode(r) for r in rows], tokens_per_item=tokens,
    )  # fmt: skip


def generate(task: SimpleNamespace) -> tuple[list[int], list[dict]]:
    """Every row COPIES times, as the driver asks an engine."""
    indices = [i for i in range(len(task.rows)) for _ in range(COPIES)]
    sampling = [
        {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7 + k}
        for k in range(len(indices))
    ]
    calls = [
        GenerateCall(task.prompt_ids[i], params, [(r.kind, r.read()) for r in task.rows[i].media])
        for i, params in zip(indices, sampling, strict=True)
    ]
    request = EnginePolicy._request(SimpleNamespace(routing=False), calls)  # type: ignore[arg-type]  # all it reads
    outputs = task.engine.generate(request)
    assert isinstance(outputs, list)
    return indices, outputs


def groups_of(task: SimpleNamespace, outputs: list[dict]) -> list[Group]:
    """The answers as the driver stores them: cut before a sampled media token (random-init
    models sample them), the prompt the engine conditioned on, the group's items."""
    groups = []
    for i, row in enumerate(task.rows):
        trajectories = []
        for o in outputs[i * COPIES : (i + 1) * COPIES]:
            keep = up_to_media_token(o["output_ids"], task.processor.media_token_ids)
            logprobs = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]][:keep]
            sampled = Sampled(o["output_ids"][:keep], logprobs, [0] * keep, "length", "", o["prompt_token_ids"])
            media = [(ref.kind, ref.read()) for ref in row.media]
            trajectories.append(Trajectory(o["prompt_token_ids"], media=media).add_sampled(sampled))
        groups.append(Group(10 + i, i, trajectories, [1.0, 0.0]))
    return groups


def test_prompts_hold_one_placeholder_per_item_and_the_processor_expands_it(task):
    processor: MediaProcessor = task.processor
    placeholder = processor.placeholders[task.kind]
    row = task.rows[0]
    assert task.prompt_ids[0].count(placeholder) == 1
    processed = processor.process(task.prompt_ids[0], [(ref.kind, ref.read()) for ref in row.media])
    assert processed.input_ids.count(placeholder) == task.tokens_per_item
    assert processor.collapse(processed.input_ids) == task.prompt_ids[0]
    if task.name == "qwen2.5-vl":  # one merged token per 28-pixel cell: a GRID x GRID picture
        assert processed.tensors["image_grid_thw"].tolist() == [[1, GRID * CELL // 14, GRID * CELL // 14]]
    elif task.kind == "audio":
        assert int(processed.tensors["feature_attention_mask"].sum()) == 100  # 10 ms frames of 1 s
    elif task.name == "qwen2.5-vl-video":  # 2 s of 8 frames at 4 fps, kept at 2 fps: 4 frames, 2 temporal patches
        assert processed.tensors["video_grid_thw"].tolist() == [[2, 4, 4]]
        assert processed.tensors["second_per_grid_ts"].tolist() == [1.0]
    elif task.kind == "video":  # Qwen3-VL: each temporal patch after its time (frames 0-1, 2-3 at 2 fps)
        assert processed.tensors["video_grid_thw"].tolist() == [[2, 4, 4]]
        text = processor.tokenizer.decode(processed.input_ids)
        assert "<0.2 seconds><|vision_start|>" in text and "<1.2 seconds><|vision_start|>" in text


def test_the_engine_answers_with_the_expanded_prompt(task):
    indices, outputs = generate(task)
    for i, out in zip(indices, outputs, strict=True):
        row = task.rows[i]
        expected = task.processor.process(task.prompt_ids[i], [(r.kind, r.read()) for r in row.media]).input_ids
        assert out["prompt_token_ids"] == (expected if row.media else task.prompt_ids[i])
        assert len(out["output_ids"]) == NEW_TOKENS


def test_the_trainer_rebuilds_the_same_inputs_from_the_spool_and_agrees_on_logprobs(task, tmp_path):
    _, outputs = generate(task)
    groups = groups_of(task, outputs)
    write_batch(tmp_path / "b.h5", to_sample_batch(0, groups), writer="test")
    batch = read_batch(tmp_path / "b.h5")
    # Each group's items once, whatever the group size: rows 0 and 2 share a clip, stored twice
    # (once per group); the text row stores nothing.
    assert len(batch.media_bytes) == sum(len(data) for g in groups for _, data in g.trajectories[0].media)
    assert batch.group_media(13) == [] and batch.group_media(12) == groups[2].trajectories[0].media
    pad = task.processor.tokenizer.pad_token_id
    train, stats = share_of(batch, list(range(batch.num_samples)), 0, 1, pad, task.processor)
    assert stats["media_mismatched_groups"] == 0 and train.num_samples == len(task.rows) * COPIES
    model = load_policy(task.model, torch.float32).eval()
    with torch.no_grad():
        logprobs, _ = token_logprobs_and_entropy(model, train)
    mask = train.loss_mask.bool()
    assert int(mask.sum()) == sum(len(t.tokens) for g in groups for t in g.trajectories) > 0
    diff = (logprobs[mask] - train.rollout_logprobs[mask]).abs().max()
    assert diff < 1e-4, f"trainer and engine disagree by {float(diff):.2e}"


def test_a_group_the_trainer_expands_differently_is_left_out_and_counted(task, tmp_path):
    _, outputs = generate(task)
    groups = groups_of(task, outputs)
    placeholder = task.processor.placeholders[task.kind]
    for trajectory in groups[1].trajectories:
        ids = trajectory.prompt_ids
        at = ids.index(placeholder)
        trajectory.prompt_ids = [*ids[:at], placeholder, *ids[at:]]
    write_batch(tmp_path / "b.h5", to_sample_batch(0, groups), writer="test")
    batch = read_batch(tmp_path / "b.h5")
    pad = task.processor.tokenizer.pad_token_id
    train, stats = share_of(batch, list(range(batch.num_samples)), 0, 1, pad, task.processor)
    assert stats["media_mismatched_groups"] == 1
    assert sorted(set(train.group_ids.tolist())) == [10, 12, 13]


def test_the_engine_refuses_media_it_cannot_read(task):
    prompt = task.prompt_ids[0]
    field = f"{task.kind}_data"

    def request(input_ids: list[int] | list[list[int]], media: P.MediaData) -> P.GenerateReqInput:
        return P.GenerateReqInput(input_ids=input_ids, **{field: media})  # type: ignore[arg-type]  # one of two media fields

    with pytest.raises(P.ProtocolError, match=rf"{field}: the built-in engine reads data: URIs and local paths"):
        task.engine.generate(request(prompt, "https://example.com/x"))
    with pytest.raises(P.ProtocolError, match=rf"{field} has 1 entries for 2 prompts"):
        task.engine.generate(request([prompt, prompt], [["data:x;base64,AA=="]]))
    with pytest.raises(P.ProtocolError, match=r"prompt 0 has 1 media placeholder\(s\) and 0 item\(s\)"):
        no_items: list[list[str]] = [[]]
        task.engine.generate(request([prompt], no_items))


def test_a_text_engine_refuses_media():
    engine = TorchEngine(str(ASSETS / "tiny-qwen3-addition"), "float32")
    with pytest.raises(P.ProtocolError, match=r"is a text model: it takes no image_data, audio_data or video_data"):
        engine.generate(P.GenerateReqInput(input_ids=[5, 6], image_data="data:image/png;base64,AA=="))


def test_the_engines_parameters_answer_to_the_checkpoints_names_too():
    """The megatron backend sends Qwen2.5-VL's weights as its checkpoint names them (SGLang's);
    the engine's module holds them under transformers' names."""
    model = load_policy(str(ASSETS / "tiny-qwen2.5-vl-shapes"), torch.float32)
    params = EngineParameters(model)
    module = dict(model.named_parameters())
    assert (
        params["model.layers.0.self_attn.q_proj.weight"]
        is module["model.language_model.layers.0.self_attn.q_proj.weight"]
    )
    assert params["visual.blocks.0.attn.qkv.weight"] is module["model.visual.blocks.0.attn.qkv.weight"]
    assert "model.language_model.norm.weight" in params and "model.norm.weight" in params
    assert "model.layers.0.self_attn.no_such.weight" not in params  # still refused as unknown
    with pytest.raises(KeyError):
        params["visual.no_such.weight"]
    assert list(params) == list(module) and len(params) == len(module)  # iterated by module name only


def test_a_rank_without_media_trains_a_media_row_without_loss(task, tmp_path):
    """FSDP gathers an encoder's shards in its forward: a rank whose share holds no media (here
    the second of two ranks, with one group to share) must still run the encoders. It gets the
    group's first row with its media and no loss; the first rank's share is the group as it is."""
    _, outputs = generate(task)
    groups = groups_of(task, outputs)[:1]
    write_batch(tmp_path / "b.h5", to_sample_batch(0, groups), writer="test")
    batch = read_batch(tmp_path / "b.h5")
    pad = task.processor.tokenizer.pad_token_id
    rows = list(range(batch.num_samples))
    first, _ = share_of(batch, rows, 0, 2, pad, task.processor)
    idle, _ = share_of(batch, rows, 1, 2, pad, task.processor)
    assert first.num_samples == COPIES and first.loss_mask.any()
    assert idle.num_samples == 1 and not idle.loss_mask.any()
    assert torch.equal(idle.input_ids[0], first.input_ids[0])
    assert idle.media[0].keys() == first.media[0].keys() and len(idle.media[0]) > 0
    for key, value in idle.media[0].items():
        assert torch.equal(value, first.media[0][key])
