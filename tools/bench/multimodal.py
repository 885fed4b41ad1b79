"""What images cost: spool bytes, processing time, and engine throughput, each against its baseline
measured in the same run.

    python tools/bench/multimodal.py [--group-size 8] [--image-px 448] [--repeat 3]

- spool: bytes per sample of a batch whose groups share one picture, stored once per group (what
  the spool does) against once per sample (the layout it avoids), on real HDF5 files.
- processor: the model processor's time per sample (decode, resize, patchify, expand the
  placeholders; what every trainer rank does once per group) against the model's forward pass
  over the same sample, for the tiny Qwen2.5-VL and a small one (hidden 512, 4 layers, random).
- engine: the built-in engine's samples/s on prompts with a picture against the same prompts with
  the picture left out (the tiny Qwen2.5-VL, CPU, the same sampling settings and seeds).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from relax_hpc.data.media import Kind, data_uri
from relax_hpc.data.processor import MediaProcessor, concat_inputs, rope_positions
from relax_hpc.data.prompts import PromptRow
from relax_hpc.engines.torch_engine import TorchEngine
from relax_hpc.exchange.spool import SampleBatch, write_batch
from relax_hpc.models import tiny_multimodal as tm
from relax_hpc.protocol import requests as P

ASSETS = Path(__file__).resolve().parents[2] / "assets"
TINY_VL = ASSETS / "tiny-qwen2.5-vl-shapes"


def photo(px: int, seed: int) -> bytes:
    """A JPEG that compresses like a photograph (smooth shapes plus sensor noise), not like a
    flat test card."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:px, 0:px] / px
    base = np.stack([np.sin(6 * x + rng.random() * 6), np.cos(5 * y + rng.random() * 6), x * y], axis=-1)
    pixels = np.clip((base * 0.5 + 0.5) * 255 + rng.normal(0, 12, (px, px, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def spool_bytes(folder: Path, groups: int, group_size: int, px: int) -> dict:
    """File bytes per sample with the picture once per group, and once per sample."""
    pictures = [photo(px, g) for g in range(groups)]
    n = groups * group_size
    sequences = [[5] * 300 + [7] * 200 for _ in range(n)]  # 300 prompt + 200 completion tokens

    def batch(per_sample: bool) -> SampleBatch:
        group_ids = list(range(n)) if per_sample else [i // group_size for i in range(n)]
        media: dict[int, list[tuple[Kind, bytes]]] = {
            gid: [("image", pictures[i // group_size])] for i, gid in enumerate(group_ids)
        }
        return SampleBatch.from_samples(
            seq=0, sequences=sequences, prompt_lens=[300] * n, logprobs=[[-0.5] * 200] * n, rewards=[0.0] * n,
            group_ids=group_ids, policy_version=[0] * n, prompt_index=group_ids, media=media,
        )  # fmt: skip

    sizes = {}
    for name, per_sample in (("per_group", False), ("per_sample", True)):
        path = folder / f"{name}.h5"
        write_batch(path, batch(per_sample), writer="bench")
        sizes[name] = path.stat().st_size / n
    return {
        "picture_bytes": statistics.mean(len(p) for p in pictures),
        "bytes_per_sample_per_group": round(sizes["per_group"]),
        "bytes_per_sample_per_sample": round(sizes["per_sample"]),
        "ratio": sizes["per_sample"] / sizes["per_group"],
    }


def small_vl(folder: Path) -> Path:
    """The tiny Qwen2.5-VL's architecture at hidden 512 with 4 layers (random weights)."""
    tokenizer = tm.build_tokenizer()
    model = tm.build_vision_model(tokenizer)
    config = model.config
    text = config.get_text_config()
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = 512, 1536, 4
    text.num_attention_heads, text.num_key_value_heads = 8, 4
    text.layer_types = ["full_attention"] * text.num_hidden_layers
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [8, 12, 12]}  # half of head_dim 64
    vision: Any = config.vision_config  # a Qwen2.5-VL vision config
    vision.out_hidden_size, vision.depth, vision.hidden_size, vision.intermediate_size = 512, 4, 256, 512
    model = type(model)(config)
    processor = tm.image_processor()
    processor.size = {"shortest_edge": 56 * 56, "longest_edge": 448 * 448}
    tm.save_model(model, tokenizer, processor, folder)
    return folder


def time_it(fn, repeat: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def processor_vs_forward(
    model_path: Path, prompt: str, media: list[tuple[Kind, bytes]], completion: int, repeat: int
) -> dict:
    """The processor's time per sample (decode, resize, patchify, expand) against the model's
    forward over the same sample, `prompt` with `media` and a `completion`-token answer."""
    from relax_hpc.models.hf import load_policy

    processor = MediaProcessor(str(model_path))
    model = load_policy(str(model_path), torch.float32).eval()
    ids = processor.prompt_ids(PromptRow(0, prompt, "", ()))
    processed = processor.process(ids, media)
    input_ids = torch.tensor([processed.input_ids + [7] * completion])
    mask = torch.ones_like(input_ids)

    @torch.no_grad()
    def forward() -> None:
        inputs = concat_inputs([processed.tensors])
        rope = rope_positions(model, input_ids, mask, inputs)
        model(input_ids=input_ids, attention_mask=mask, position_ids=rope[0] if rope else None, **inputs)

    process_s = time_it(lambda: processor.process(ids, media), repeat)
    forward_s = time_it(forward, repeat)
    kind = media[0][0]
    return {
        "tokens": int(input_ids.shape[1]),
        f"{kind}_tokens": processed.input_ids.count(processor.placeholders[kind]),
        "processor_ms": round(process_s * 1000, 2),
        "forward_ms": round(forward_s * 1000, 2),
        "processor_over_forward": process_s / forward_s,
    }


def picture_vs_forward(model_path: Path, px: int, repeat: int) -> dict:
    """A photo-like picture of `px` x `px` and a 64-token answer."""
    prompt = "<image>what is in the picture? answer in one word."
    return processor_vs_forward(model_path, prompt, [("image", photo(px, 1))], 64, repeat)


def engine_throughput(prompts: int, repeat: int) -> dict:
    engine = TorchEngine(str(TINY_VL), "float32")
    assert engine.processor is not None
    pictures = sorted((ASSETS / "shapes").glob("*.png"))[:prompts]
    with_image = engine.processor.prompt_ids(PromptRow(0, "<image>how many shapes?", "", ()))
    text_only = engine.processor.prompt_ids(PromptRow(0, "how many shapes?", "", ()))
    sampling = [
        {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": k} for k in range(prompts)
    ]
    uris = [[data_uri("image", p.read_bytes())] for p in pictures]

    def run(images: bool) -> None:
        ids = with_image if images else text_only
        engine.generate(
            P.GenerateReqInput(input_ids=[ids] * prompts, sampling_params=sampling, image_data=uris if images else None)
        )

    images_s = time_it(lambda: run(True), repeat)
    text_s = time_it(lambda: run(False), repeat)
    return {
        "prompts": prompts,
        "samples_per_s_images": prompts / images_s,
        "samples_per_s_text": prompts / text_s,
        "ratio": text_s / images_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python tools/bench/multimodal.py", description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--image-px", type=int, default=448)
    parser.add_argument("--prompts", type=int, default=64, help="engine benchmark: prompts per request")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        result = {
            "spool": spool_bytes(folder, args.groups, args.group_size, args.image_px),
            "processor_tiny": picture_vs_forward(TINY_VL, tm.CELL * tm.GRID, args.repeat),
            "processor_small": picture_vs_forward(small_vl(folder / "small"), args.image_px, args.repeat),
            "engine": engine_throughput(args.prompts, args.repeat),
            "torch_threads": torch.get_num_threads(),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
