"""The embedded multimodal policies and their tasks: a tiny Qwen2.5-VL that counts shapes in a
picture, another that tells which way a dot moves in a video, and a tiny Qwen2-Audio that counts
beeps in a clip, built offline from transformers' config classes (no hub) with a character
tokenizer that carries Qwen's chat and media tokens.

Both architectures are what SGLang 0.5.23 serves (Qwen2_5_VLForConditionalGeneration,
Qwen2AudioForConditionalGeneration) and transformers 5.23 trains. The folders `tools/
make_tiny_multimodal.py` writes are ordinary HF folders: config, safetensors, tokenizer with its
chat template, and the processor's configuration (the image processor's for the VL model; the
audio processor's for the audio model).

The tasks are drawn by the tool and shipped as files: a picture of a 3 x 3 grid of 28-pixel cells
(one merged vision token each), some cells holding a shape (square, disc or triangle of a random
colour), and the question how many; a one-second clip of four 250 ms slots (six audio tokens
each), some slots holding a beep (a buzz of random pitch), and the question how many. Answers are
the count, 0 to 4. The video task: two seconds (8 frames at 4 fps, H.264) of a random texture
sliding across a 56-pixel square left, right, up or down (answers 0-3); its still twin shows one
of those frames throughout, so only motion tells the answer (the baseline that must stay near
chance).
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2AudioConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2AudioProcessor,
    Qwen2VLImageProcessorPil,
    WhisperFeatureExtractor,
)

from relax_hpc.models.tiny import ALPHABET, EOS_TOKEN, PAD_TOKEN

CHAT_START = "<|im_start|>"
MEDIA_SPECIALS = [
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|audio_bos|>", "<|AUDIO|>",
    "<|audio_eos|>",
]  # fmt: skip
NAMED_TOKENS = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>", "audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}  # fmt: skip
# Qwen's chat format; a message's content is a string or a list of text, image and audio parts.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = {
    "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "bos_token_id": None,
}  # fmt: skip
CELL, GRID = 28, 2  # pixels per cell (one merged 2 x 2 group of 14-pixel patches), cells per side
SAMPLING_RATE, CLIP_S, SLOTS = 16000, 1.0, 4
MAX_COUNT = 4  # both counting tasks answer 0-4: chance is 0.2, and only the media tell the count
# The motion task: a texture of BLOCK-pixel squares slides STEP pixels per frame over FRAMES frames
# at VIDEO_FPS in a SIDE-pixel square (one merged 2 x 2 group of 14-pixel patches per 28 pixels);
# sampled at 2 fps, the model sees 4 frames (2 temporal patches). Directions: 0 left, 1 right, 2 up,
# 3 down. (A lone moving dot is not learnt by this tiny model: telling where it is needs positions
# its multimodal RoPE barely resolves; a sliding texture shows the motion in every patch.)
SIDE, BLOCK, STEP, FRAMES, VIDEO_FPS = 56, 7, 2, 8, 4
DIRECTIONS = ((-1, 0), (1, 0), (0, -1), (0, 1))
COLOURS = [(220, 40, 40), (40, 160, 40), (40, 80, 220), (200, 160, 20), (160, 40, 180)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The text default's character tokenizer, plus Qwen's chat and media tokens (each one id)."""
    return char_tokenizer([PAD_TOKEN, EOS_TOKEN, CHAT_START, *MEDIA_SPECIALS], NAMED_TOKENS, CHAT_TEMPLATE)


def char_tokenizer(specials: list[str], named: dict[str, str], chat_template: str) -> PreTrainedTokenizerFast:
    """One id per character of the text default, after `specials` (each one id, `named` as the
    processor finds them) and with `chat_template`."""
    vocab = {token: i for i, token in enumerate(specials)}
    for ch in ALPHABET + "\n:.,<>":  # <>: Qwen3-VL's frame times (<0.5 seconds>)
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, clean_up_tokenization_spaces=False,
        padding_side="left", extra_special_tokens=named,
    )  # fmt: skip
    tokenizer.chat_template = chat_template
    return tokenizer


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    return int(tokenizer.convert_tokens_to_ids(token))  # type: ignore[arg-type]  # one token: one id


def build_vision_model(tokenizer: PreTrainedTokenizerFast) -> Qwen2_5_VLForConditionalGeneration:
    def ids(token: str) -> int:
        return token_id(tokenizer, token)

    config = Qwen2_5_VLConfig(
        text_config={**TEXT, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                     "eos_token_id": tokenizer.eos_token_id,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}},
        vision_config={"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 128,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                       "fullatt_block_indexes": [1]},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(config)


def image_processor() -> Qwen2VLImageProcessorPil:
    """Pictures of exactly GRID x GRID cells stay at their size: one merged token per cell."""
    pixels = (CELL * GRID) ** 2
    return Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, size={"shortest_edge": pixels, "longest_edge": pixels},
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip


def write_video_processor_config(folder: Path) -> None:
    """The video processor's configuration (transformers' Qwen2VLVideoProcessor, which cannot be
    built without torchvision): frames stay SIDE x SIDE, 2 frames per second."""
    pixels = SIDE * SIDE
    config = {
        "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "size": {"shortest_edge": pixels, "longest_edge": pixels}, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_sample_frames": False, "fps": 2.0,
        "cap_pixels_per_frame": False, "resample": 3, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "do_convert_rgb": True,
    }  # fmt: skip
    (folder / "video_preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_audio_model(tokenizer: PreTrainedTokenizerFast) -> Qwen2AudioForConditionalGeneration:
    frames = int(CLIP_S * 100)  # 10 ms mel frames; the encoder takes exactly 2 x max_source_positions
    config = Qwen2AudioConfig(
        text_config={**TEXT, "model_type": "qwen2", "vocab_size": len(tokenizer),
                     "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id},
        audio_config={"num_mel_bins": 32, "encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 256,
                      "d_model": 64, "max_source_positions": frames // 2},
        audio_token_index=token_id(tokenizer, "<|AUDIO|>"),
    )  # fmt: skip
    config.tie_word_embeddings = False  # Qwen2-Audio never ties its head: the config says so
    return Qwen2AudioForConditionalGeneration(config)


def audio_processor(tokenizer: PreTrainedTokenizerFast) -> Qwen2AudioProcessor:
    extractor = WhisperFeatureExtractor(
        feature_size=32, sampling_rate=SAMPLING_RATE, hop_length=160, chunk_length=int(CLIP_S), n_fft=400,
        return_attention_mask=True,
    )  # fmt: skip
    return Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def draw_shapes(count: int, rng: random.Random) -> bytes:
    """A PNG picture of `count` shapes, each in its own cell of the grid."""
    image = Image.new("RGB", (CELL * GRID, CELL * GRID), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for cell in rng.sample(range(GRID * GRID), count):
        row, col = divmod(cell, GRID)
        size = rng.randint(18, 24)
        x, y = col * CELL + rng.randint(1, CELL - size - 1), row * CELL + rng.randint(1, CELL - size - 1)
        colour = rng.choice(COLOURS)
        kind = rng.randrange(3)
        if kind == 0:
            draw.rectangle([x, y, x + size, y + size], fill=colour)
        elif kind == 1:
            draw.ellipse([x, y, x + size, y + size], fill=colour)
        else:
            draw.polygon([(x, y + size), (x + size, y + size), (x + size // 2, y)], fill=colour)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def synth_beeps(count: int, rng: random.Random) -> bytes:
    """A FLAC clip of `count` beeps, each in its own slot of the clip, over faint noise. A beep is
    a buzz (a tone with its first harmonics, like a buzzer): its energy spreads over many mel
    bins, where a pure tone lights one or two of the 32 and a tiny encoder barely hears it."""
    import soundfile

    slot = int(SAMPLING_RATE * CLIP_S / SLOTS)
    gen = np.random.default_rng(rng.getrandbits(32))
    wave = gen.normal(0, 0.002, int(SAMPLING_RATE * CLIP_S)).astype(np.float32)
    for index in rng.sample(range(SLOTS), count):
        length = int(slot * rng.uniform(0.5, 0.8))
        start = index * slot + rng.randint(0, slot - length)
        t = np.arange(length) / SAMPLING_RATE
        pitch = rng.uniform(200, 600)
        buzz = sum(np.sin(2 * np.pi * pitch * k * t) / k for k in range(1, 8)) * 0.3
        wave[start : start + length] += (buzz * np.hanning(length)).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, np.clip(wave, -1, 1), SAMPLING_RATE, format="FLAC")
    return out.getvalue()


def draw_motion(direction: int, rng: random.Random, still: bool = False) -> bytes:
    """An H.264 clip of a random texture of BLOCK-pixel squares sliding across the square in
    `direction`, STEP pixels a frame; `still` holds one of its frames (chosen at random)
    throughout. Every patch sees the motion and no single frame tells it."""
    import av

    dx, dy = DIRECTIONS[direction]
    margin = STEP * (FRAMES - 1)
    cells = -(-(SIDE + 2 * margin + BLOCK) // BLOCK)
    gen = np.random.default_rng(rng.getrandbits(32))
    texture = np.kron(gen.integers(0, 2, (cells, cells)) * 200 + 20, np.ones((BLOCK, BLOCK))).astype(np.uint8)
    # where the blocks' edges fall in a frame, at random on both axes: else a frame's block phase
    # would tell the axis of motion (a still baseline reached 0.5 that way)
    phase = (rng.randrange(BLOCK), rng.randrange(BLOCK))
    shown = [rng.randrange(FRAMES)] * FRAMES if still else list(range(FRAMES))
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=VIDEO_FPS, options={"crf": "12", "preset": "medium"})
        stream.width, stream.height, stream.pix_fmt = SIDE, SIDE, "yuv420p"
        for k in shown:
            y, x = margin + phase[0] + dy * STEP * k, margin + phase[1] + dx * STEP * k
            frame = np.repeat(texture[y : y + SIDE, x : x + SIDE, None], 3, axis=2)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def write_task(folder: Path, kind: str, size: int, seed: int, still: bool = False, held_out: bool = False) -> Path:
    """A dataset of `size` rows (counts spread evenly over 0..MAX_COUNT) with its media files.
    `held_out`: rows training never sees, for data.eval_path: media drawn from another seed's
    stream, files named heldout-NNNN, rows in heldout.jsonl."""
    rng = random.Random(seed + HELD_OUT_SEED if held_out else seed)
    prefix = "heldout-" if held_out else ""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(size):
        count = i % (MAX_COUNT + 1)
        if kind == "image":
            name, data, prompt = f"{prefix}{i:04d}.png", draw_shapes(count, rng), "<image>how many shapes?"
        elif kind == "video":
            count = i % len(DIRECTIONS)
            question = "<video>which way does it move? 0 left 1 right 2 up 3 down"
            name, data, prompt = f"{prefix}{i:04d}.mp4", draw_motion(count, rng, still), question
        else:
            name, data, prompt = f"{prefix}{i:04d}.flac", synth_beeps(count, rng), "<audio>how many beeps?"
        (folder / name).write_bytes(data)
        rows.append({"prompt": prompt, "answer": str(count), f"{kind}s": [name]})
    path = folder / ("heldout.jsonl" if held_out else f"{folder.name}.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, processor: object, out: Path) -> None:
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)  # type: ignore[attr-defined]  # an image processor or a processor


DATASET_SIZE = 200  # rows per task: 40 of each count
HELD_OUT_SIZE = 40  # rows of each task's held-out set
HELD_OUT_SEED = 1000  # added to the task's seed for its held-out media
WARMUP_STEPS = 30


def format_warmup(folder: Path, dataset: Path, steps: int, rng: random.Random, answers: int = 10) -> float:
    """Teach the answer format only, in place: the task's question without its picture or clip,
    answered with a random digit (of the first `answers`) and the end of the answer. Without the
    media (whose tokens would then predict nothing), the model learns the format without learning to ignore them, and RL
    starts near chance. Returns the last step's loss."""
    from transformers import AutoModelForMultimodalLM

    from relax_hpc.data.processor import MediaProcessor
    from relax_hpc.data.prompts import MARKERS, PromptRow

    model = AutoModelForMultimodalLM.from_pretrained(folder)
    processor = MediaProcessor(str(folder))
    tokenizer = processor.tokenizer
    questions = {json.loads(line)["prompt"] for line in dataset.read_text().splitlines()}
    for marker in MARKERS.values():
        questions = {q.replace(marker, "") for q in questions}
    prompts = [processor.prompt_ids(PromptRow(0, q, "")) for q in sorted(questions)]
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(answers)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    loss = torch.zeros(())
    for _ in range(steps):
        rows = [[*rng.choice(prompts), rng.choice(digits), tokenizer.eos_token_id] for _ in range(32)]
        width = max(map(len, rows))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
        mask = (torch.arange(width) >= torch.tensor([[width - len(r)] for r in rows])).long()
        labels = torch.full_like(ids, -100)
        labels[:, -2:] = ids[:, -2:]  # the digit and the end of the answer
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(folder)
    return float(loss.detach())
