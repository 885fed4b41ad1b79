"""Datasets with images and audio: every defect of a row or of its media is named with its line."""

from __future__ import annotations

import base64
import io
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image

from relax_hpc.config import load_config
from relax_hpc.config.load import ConfigError
from relax_hpc.data.media import Kind, MediaRef, data_uri, decode_audio, parse_data_uri
from relax_hpc.data.prompts import DatasetError, load_data, load_prompts
from relax_hpc.submit import check_inputs
from tests.models.qwen3_family import build_qwen3_omni

REPO = Path(__file__).resolve().parents[2]
MEDIA: dict[Kind, str] = {"image": "images", "audio": "audios"}


def png(colour: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(out, format="PNG")
    return out.getvalue()


def wav(rate: int) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, np.zeros(rate // 10, dtype=np.float32), rate, format="WAV")
    return out.getvalue()


def dataset(tmp_path: Path, *rows: dict) -> Path:
    (tmp_path / "a.png").write_bytes(png())
    (tmp_path / "b.png").write_bytes(png((0, 0, 255)))
    (tmp_path / "c.wav").write_bytes(wav(16000))
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_items_come_in_the_order_the_prompt_places_them(tmp_path):
    path = dataset(
        tmp_path,
        {"prompt": "<audio>then<image>and<image>?", "answer": "1", "images": ["a.png", "b.png"], "audios": "c.wav"},
    )
    (row,) = load_prompts(path, "prompt", "answer", MEDIA, check_media=True, sampling_rate=16000)
    assert [(ref.kind, Path(ref.source).name) for ref in row.media] == [
        ("audio", "c.wav"),
        ("image", "a.png"),
        ("image", "b.png"),
    ]
    parts = row.messages()[0]["content"]
    assert [p["type"] for p in parts] == ["audio", "text", "image", "text", "image", "text"]


def test_chat_messages_place_media_with_content_parts(tmp_path):
    messages = [
        {"role": "system", "content": "count"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many?"}]},
    ]
    path = dataset(tmp_path, {"prompt": messages, "answer": "2", "images": ["a.png"]})
    (row,) = load_prompts(path, "prompt", "answer", MEDIA)
    assert row.is_chat and row.messages() == messages and row.media[0].kind == "image"


def test_a_prompt_without_markers_gets_its_items_before_the_text(tmp_path):
    path = dataset(tmp_path, {"prompt": "what is it?", "answer": "x", "images": "a.png"})
    (row,) = load_prompts(path, "prompt", "answer", MEDIA)
    assert [p["type"] for p in row.messages()[0]["content"]] == ["image", "text"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "<image><image>?", "images": ["a.png"]}, r"2 image placeholder\(s\) but the row gives 1 image"),
        ({"prompt": "<image>?", "images": ["a.png"], "audios": ["c.wav"]}, r"0 audio placeholder\(s\) but the row gives 1"),  # noqa: E501
        ({"prompt": "<image>?", "images": ["missing.png"]}, r"image file .*missing.png does not exist"),
        ({"prompt": "<image>?", "images": [3]}, r"field 'images' \(data.media.image\) must hold a path or a list"),
        ({"prompt": [{"role": "user", "content": [{"type": "gif"}]}]}, r"content is a string or a list of parts"),
        ({"prompt": "<video>which way?"}, r"1 video placeholder\(s\) but the row gives 0 video"),
        ({"prompt": [{"content": "hi"}]}, r"a chat message needs a 'role' and a 'content'"),
    ],
    ids=["too-few-items", "item-without-place", "missing-file", "not-a-path", "unknown-part", "video-without-item",
         "no-role"],
)  # fmt: skip
def test_defective_rows_are_named_with_their_line(tmp_path, row, message):
    path = dataset(tmp_path, {"prompt": "fine", "answer": "1"}, {**row, "answer": "1"})
    with pytest.raises(DatasetError, match=rf"d.jsonl:2: .*{message}"):
        load_prompts(path, "prompt", "answer", MEDIA)


def test_media_that_do_not_decode_are_found_before_the_job_starts(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (tmp_path / "slow.wav").write_bytes(wav(8000))
    path = dataset(tmp_path, {"prompt": "<image>?", "answer": "1", "images": "bad.png"})
    load_prompts(path, "prompt", "answer", MEDIA)  # a listing only looks at the paths
    with pytest.raises(DatasetError, match=r"d.jsonl:1: image .*bad.png: unreadable image"):
        load_prompts(path, "prompt", "answer", MEDIA, check_media=True)
    path = dataset(tmp_path, {"prompt": "<audio>?", "answer": "1", "audios": "slow.wav"})
    with pytest.raises(
        DatasetError, match=r"d.jsonl:1: audio .*slow.wav: audio at 8000 Hz; .* 16000 Hz \(resample it\)"
    ):
        load_prompts(path, "prompt", "answer", MEDIA, check_media=True, sampling_rate=16000)


def test_data_uris_are_items_too_and_decode_to_the_same_bytes(tmp_path):
    uri = data_uri("image", png())
    assert uri.startswith("data:image/png;base64,") and parse_data_uri(uri) == ("image/png", png())
    path = dataset(tmp_path, {"prompt": "<image>?", "answer": "1", "images": [uri]})
    (row,) = load_prompts(path, "prompt", "answer", MEDIA, check_media=True)
    assert row.media[0].read() == png()
    broken = "data:image/png;base64," + base64.b64encode(png()).decode()[:-3] + "!!!"
    path = dataset(tmp_path, {"prompt": "<image>?", "answer": "1", "images": [broken]})
    with pytest.raises(DatasetError, match=r"d.jsonl:1: .*base64 does not decode"):
        load_prompts(path, "prompt", "answer", MEDIA, check_media=True)


def test_audio_decodes_to_mono_at_the_processor_rate():
    out = io.BytesIO()
    stereo = np.stack([np.full(1600, 0.5), np.full(1600, -0.1)], axis=1).astype(np.float32)
    soundfile.write(out, stereo, 16000, format="FLAC")
    samples = decode_audio(out.getvalue(), 16000)
    assert samples.shape == (1600,) and np.allclose(samples, 0.2, atol=1e-3)


def test_submit_refuses_media_the_model_cannot_take(tmp_path):
    text_model = load_config(None, ["data.path=assets/shapes/shapes.jsonl", "data.media={image: images}"])
    with pytest.raises(ConfigError, match=r"data.media.image: .*tiny-qwen3-addition has no image encoder"):
        check_inputs(text_model)
    megatron = ["trainer.backend=megatron", "launch.executor=slurm"]
    for config, engine in itertools.product(("tiny-vision-grpo.yaml", "tiny-audio-grpo.yaml"), ("sglang", "torch")):
        # a vision- or audio-language model on megatron, either engine: only the missing GPUs
        with pytest.raises(ConfigError) as refused:
            check_inputs(load_config(REPO / "configs" / config, [*megatron, f"rollout.engine={engine}"]))
        assert str(refused.value).startswith("trainer.backend=megatron runs one rank per GPU"), (config, engine)
    omni = build_qwen3_omni(tmp_path / "omni")  # an Omni thinker (MoE) on megatron: SGLang's engines
    with pytest.raises(ConfigError, match=r"rollout.engine=torch with trainer.backend=megatron and an MoE model"):
        check_inputs(load_config(REPO / "configs/tiny-audio-grpo.yaml", [*megatron, f"model.path={omni}"]))
    gae = ["algo.advantage.estimator=gae"]  # the torch backend's critic is a text-only class
    with pytest.raises(ConfigError, match=r"^algo.advantage.estimator=gae: the torch backend's critic"):
        check_inputs(load_config(REPO / "configs/tiny-vision-grpo.yaml", gae))
    with pytest.raises(ConfigError, match=r"^trainer.backend=megatron runs one rank per GPU"):  # not the critic
        check_inputs(load_config(REPO / "configs/tiny-vision-grpo.yaml", [*megatron, *gae]))
    wrong_kind = load_config(REPO / "configs/tiny-vision-grpo.yaml", ["data.media={audio: images}"])
    with pytest.raises(ConfigError, match=r"data.media.audio: .* has no audio encoder"):
        check_inputs(wrong_kind)


def test_submit_reads_the_held_out_set_as_it_reads_the_training_set(tmp_path):
    config = REPO / "configs/tiny-vision-grpo.yaml"
    check_inputs(load_config(config, []))  # the shipped held-out set passes
    broken = tmp_path / "heldout.jsonl"
    broken.write_text(json.dumps({"prompt": "<image>how many?", "answer": "1", "images": ["gone.png"]}) + "\n")
    with pytest.raises(ConfigError, match=r"heldout.jsonl:1: image .*gone.png") as refused:
        check_inputs(load_config(config, [f"data.eval_path={broken}"]))
    assert "shapes.jsonl" not in str(refused.value)  # the training set is fine: only the held-out one is named
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"^data.eval_path: .*empty.jsonl holds no rows$"):
        check_inputs(load_config(config, [f"data.eval_path={tmp_path / 'empty.jsonl'}"]))
    rows = load_data(load_config(config, []).data, None, held_out=True)
    assert len(rows) == 40 and rows[0].media[0].source.endswith("heldout-0000.png")
    with pytest.raises(DatasetError, match=r"data\.eval_path is not set"):
        load_data(load_config(None, []).data, None, held_out=True)


def test_a_media_ref_names_what_it_could_not_read(tmp_path):
    ref = MediaRef("image", str(tmp_path / "gone.png"))
    with pytest.raises(ValueError, match=r"image .*gone.png: No such file"):
        ref.read()
