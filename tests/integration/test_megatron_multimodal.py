"""The tiny Qwen2.5-VL (the shipped asset), a tiny Qwen3-VL (built for the test: interleaved
multimodal RoPE, DeepStack features) and the tiny Qwen2-Audio (the shipped asset) on the megatron
backend, on the CPU (megatron's GPU code redirected as in test_megatron_checkpoint.py): the real
MegatronBackend, loaded from the HF folder, against the torch backend (transformers' own model)
on the same weights and one batch of rows with zero, one and two pictures (clips), packed several
to a micro-batch.

- per-token log-probabilities agree: the megatron GPT language model, the HF vision tower's
  embeddings scattered at the image tokens and the multimodal RoPE (the audio tower's and
  projector's at the audio tokens) reproduce transformers' forward (fp32; 1e-5 absolute, measured
  5e-7: the two compute the same sums in other orders, fused q/k/v and [gate; up] matmuls,
  per-document attention. One-dimensional RoPE in place of the multimodal one gave 1.6e-3 on
  this tiny model, leaving the images out 5.8e-2);
- one GRPO step gives the same loss and gradient norm (1e-4 relative: the gradient's size), the
  same gradients of every HF tensor (the towers included) wherever they are above rounding, and
  the same update there (WEIGHT_ATOL below: its sign; _assert_same_step says why only there);
- the weights export to the HF checkpoint exactly, and so does a megatron checkpoint of them,
  which a fresh backend resumes from exactly;
- the built-in engine takes the export under the checkpoint's names (what SGLang loads) over each
  channel's receiving path: the broadcast (gloo side group), the colocated one (shared memory,
  CUDA IPC's CPU form) and the file one; it then holds the trainer's weights bit for bit, and its
  log-probabilities of what it samples for a prompt with a picture (a clip) are the megatron
  backend's.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
import torch.distributed as dist
from PIL import Image, ImageDraw
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from relax_hpc.ckpt.export import convert
from relax_hpc.ckpt.manager import Checkpointer
from relax_hpc.config.load import load_config, to_yaml
from relax_hpc.config.schema import MediaKind
from relax_hpc.data.processor import MediaProcessor, up_to_media_token
from relax_hpc.data.prompts import PromptRow
from relax_hpc.engines.torch_engine import TorchEngine
from relax_hpc.models.hf import checkpoint_layout, empty_policy, load_policy, module_names
from relax_hpc.models.hf_checkpoint import megatron_checkpoint_to_hf
from relax_hpc.paths import RunPaths
from relax_hpc.protocol import requests as P
from relax_hpc.trainer.backend import BackendConfig
from relax_hpc.trainer.batching import TrainBatch, pad_samples, token_logprobs_and_entropy
from relax_hpc.trainer.megatron_backend import MegatronBackend
from relax_hpc.trainer.torch_backend import TorchBackend
from relax_hpc.weights.buckets import BucketPlan, pack, plan_buckets
from relax_hpc.weights.files import write_dense
from relax_hpc.weights.group import SideGroup
from relax_hpc.weights.sender import free_port
from relax_hpc.weights.tensors import FLATTENED_BUCKET, bucket_records, serialize_bucket
from tests.integration.test_megatron_checkpoint import megatron_on_cpu
from tests.models.qwen3_family import build_qwen3_omni, build_qwen3_vl, build_qwen3_vl_video

__all__ = ["megatron_on_cpu"]  # the fixture, requested by name
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the megatron backend's tests"),
]
REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-5
LR = 1e-3
# Adam's first step moves a weight by lr * g / (|g| + eps), about lr * sign(g): a gradient of the
# wrong sign, or a weight left out, differs by lr to 2 lr; rounding-level differences of a gradient
# within rounding of zero move it by a small fraction of lr (measured: 7e-6 and 1.1e-5).
WEIGHT_ATOL = 0.05 * LR
# Gradients: fp32 sums in other orders differ by rounding, measured at most 3e-6 of their tensor's
# largest gradient (GRAD_ATOL) and 1.2e-4 relative (GRAD_RTOL) above 1e-4 of it. A tensor whose
# gradient is zero in exact arithmetic (attention's key bias: softmax ignores a shift) holds only
# rounding, 1e-13 here: below GRAD_FLOOR of the model's largest gradient, it counts as zero.
GRAD_SIGNIFICANT, GRAD_RTOL, GRAD_ATOL, GRAD_FLOOR = 1e-3, 1e-3, 1e-5, 1e-9
OVERRIDES = ["trainer.num_ranks=1", "model.dtype=float32", f"trainer.lr={LR}"]
MEGATRON = [
    "trainer.backend=megatron",
    "trainer.megatron.attention=sdpa",
    "trainer.megatron.max_tokens_per_microbatch=96",
]


AUDIO = REPO / "assets/tiny-qwen2-audio-beeps"
VIDEO_MODEL = REPO / "assets/tiny-qwen2.5-vl-motion"


@dataclass(frozen=True)
class Media:
    """What differs between a vision- and an audio-language model in these tests."""

    kind: MediaKind
    config: str  # the shipped tiny config of the kind
    placeholder: str  # in a prompt's text
    items: tuple[Path, ...]  # three of the kind's assets
    hf_towers: tuple[str, ...]  # in the checkpoint's names of the towers (trainer.freeze_encoder keeps them)
    mcore_towers: tuple[str, ...]  # megatron's names of the towers start with these
    media_input: str  # a micro-batch with media carries this processor tensor
    first_attention: str  # in the names of the tower's first attention block (one step moves it)


VISION = Media(
    "image", "tiny-vision-grpo.yaml", "<image>", tuple(REPO / f"assets/shapes/{i:04d}.png" for i in range(3)),
    ("visual.",), ("vision.",), "pixel_values", "visual.blocks.0.attn",
)  # fmt: skip
SOUND = Media(
    "audio", "tiny-audio-grpo.yaml", "<audio>", tuple(REPO / f"assets/beeps/{i:04d}.flac" for i in range(3)),
    ("audio_tower.",), ("audio.audio_tower.",), "input_features", "audio_tower.layers.0.self_attn",
)  # fmt: skip
# The tiny Qwen2.5-VL of the motion task: videos (8 frames at 4 fps, kept at 2 fps: 4 frames)
MOTION = Media(
    "video", "tiny-video-grpo.yaml", "<video>", tuple(REPO / f"assets/motion/{i:04d}.mp4" for i in range(3)),
    ("visual.",), ("vision.",), "pixel_values_videos", "visual.blocks.0.attn",
)  # fmt: skip
# The Qwen3-Omni thinker: pictures and clips, one row with both (its batch: _batch).
OMNI = Media(
    "image", "tiny-vision-grpo.yaml", "<image>", VISION.items, ("visual.", "audio_tower."),
    ("vision.", "audio.audio_tower."), "pixel_values", "visual.blocks.0.attn",
)  # fmt: skip


def media_of(model: Path) -> Media:
    if model == AUDIO:
        return SOUND
    if model == VIDEO_MODEL or model.name.startswith("qwen3-vl-video"):
        return MOTION
    return OMNI if model.name.startswith("qwen3-omni") else VISION


def _source(model: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of the policy: an Omni folder's thinker's (not its talker's)."""
    tensors = load_file(model / "model.safetensors")
    omni = media_of(model) is OMNI
    return {n: t for n, t in tensors.items() if n.startswith("thinker.") or not omni}


def model_folder(name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model of each family: the shipped assets, Qwen3-VL and Qwen3-Omni built (tests/gpu
    uses it too)."""
    if name == "qwen2.5-vl":
        return REPO / "assets/tiny-qwen2.5-vl-shapes"
    if name == "qwen2-audio":
        return AUDIO
    if name == "qwen2.5-vl-video":
        return VIDEO_MODEL
    if name == "qwen3-omni":
        return build_qwen3_omni(tmp_path_factory.mktemp("qwen3-omni"))
    if name == "qwen3-vl-video":
        return build_qwen3_vl_video(tmp_path_factory.mktemp("qwen3-vl-video"))
    return build_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl"))


@pytest.fixture(
    scope="module", params=["qwen2.5-vl", "qwen3-vl", "qwen2-audio", "qwen3-omni", "qwen2.5-vl-video", "qwen3-vl-video"]
)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(request.param, tmp_path_factory)


def _config(model: Path, *overrides: str) -> BackendConfig:
    config = REPO / "configs" / media_of(model).config
    if model.name.startswith("qwen3-vl-video"):  # each frame's time in the prompt: longer rows, two a micro-batch
        overrides = (*overrides, "trainer.megatron.max_tokens_per_microbatch=192")
    return BackendConfig.of(load_config(config, [*OVERRIDES, f"model.path={model}", *overrides], base_dir=REPO))


@pytest.fixture
def reference(request: pytest.FixtureRequest, model: Path, tmp_path: Path) -> Iterator[TorchBackend]:
    """The torch backend, built before megatron's CPU patches apply (test_megatron_sft.py says why)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    backend = TorchBackend(_config(model), torch.device("cpu"))
    request.getfixturevalue("megatron_on_cpu")
    yield backend
    if started:
        dist.destroy_process_group()


def _batch(model: Path) -> TrainBatch:
    """Two groups of two rows: one item, two items, one item of another size (a wide picture, a
    short clip), none (pictures: 0, 4 and 8 image tokens, grids of two shapes); prompts of several
    lengths, completions of 2 to 5 tokens."""
    processor, spec = MediaProcessor(str(model)), media_of(model)
    items: list[tuple[MediaKind, bytes]] = [(spec.kind, path.read_bytes()) for path in spec.items]
    other = {"image": _wide_picture, "audio": _short_clip, "video": _wide_video}[spec.kind]()
    mark = spec.placeholder
    prompts: list[tuple[str, list[tuple[MediaKind, bytes]]]] = [
        (f"{mark}how many?", items[:1]),
        (f"{mark}{mark}how many in both?", items[1:3]),
        (f"{mark}count them", [(spec.kind, other)]),  # another size: its tokens in one row
        ("how many?", []),
    ]
    if spec is OMNI:  # a clip, and a picture with a clip in one row
        clips: list[tuple[MediaKind, bytes]] = [("audio", path.read_bytes()) for path in SOUND.items[:2]]
        prompts[1:3] = [("<audio>how many beeps?", clips[:1]), ("<image><audio>count both", [items[1], clips[1]])]
    sequences, masks, media = [], [], []
    for i, (text, items) in enumerate(prompts):
        processed = processor.process(processor.prompt_ids(PromptRow(i, text, "")), items)
        completion = processor.tokenizer(str(i) * (2 + i), add_special_tokens=False)["input_ids"]
        sequences.append(processed.input_ids + completion)
        masks.append([0] * len(processed.input_ids) + [1] * len(completion))
        media.append(processed.tensors)
    return pad_samples(
        sequences, masks, [[0.0] * len(s) for s in sequences], [1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1],
        processor.tokenizer.pad_token_id, tuple(media),
    )  # fmt: skip


def _wide_picture() -> bytes:
    """A 112 x 28 picture of stripes: a 1 x 4 grid of merged tokens where the others have 2 x 2."""
    image = Image.new("RGB", (112, 28), (255, 255, 255))
    ImageDraw.Draw(image).rectangle([30, 4, 80, 24], fill=(200, 40, 40))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _wide_video() -> bytes:
    """3 s at 2 fps of a bar crossing a 112 x 28 strip: 6 frames, 3 temporal patches of a 1 x 4
    grid of merged tokens, where the motion clips give 2 of 2 x 2."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=2, options={"crf": "18"})
        stream.width, stream.height, stream.pix_fmt = 112, 28, "yuv420p"
        for k in range(6):
            image = Image.new("RGB", (112, 28), (255, 255, 255))
            ImageDraw.Draw(image).rectangle([10 + 15 * k, 4, 25 + 15 * k, 24], fill=(40, 40, 200))
            container.mux(stream.encode(av.VideoFrame.from_image(image)))
        container.mux(stream.encode())
    return out.getvalue()


def _short_clip() -> bytes:
    """0.3 s of a 440 Hz tone: fewer audio tokens than the beeps' clips."""
    out = io.BytesIO()
    t = np.arange(4800) / 16000
    soundfile.write(out, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, format="FLAC")
    return out.getvalue()


def _torch_logprobs(backend: TorchBackend, batch: TrainBatch) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs_and_entropy(backend.model, batch)[0]


def _megatron(model: Path) -> MegatronBackend:
    return MegatronBackend(_config(model, *MEGATRON), torch.device("cpu"))


def _hf_weights(backend: TorchBackend | MegatronBackend) -> dict[str, torch.Tensor]:
    """The backend's weights under the HF checkpoint's names (the torch backend's are the
    transformers module's: model.language_model.*, model.visual.*)."""
    tensors = {name: t.detach().clone() for name, t in backend.full_parameters() if t is not None}
    convert = backend.checkpoint_layout()
    return convert(tensors) if convert is not None else tensors


def _torch_grads(backend: TorchBackend) -> dict[str, torch.Tensor]:
    """The torch backend's gradients of its last step (kept until the next zeroes them), under
    the checkpoint's names and layout, as _hf_weights names its weights."""
    synced = set(backend.synced)
    grads = {}
    for name, param in backend.model.named_parameters():
        if name in synced and param.grad is not None:
            grad = param.grad
            grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    return backend.checkpoint_layout()(grads)


def _megatron_grads(backend: MegatronBackend) -> dict[str, torch.Tensor]:
    """The megatron backend's gradients of its last step (its DDP buffers' main_grad, kept until
    the next step zeroes them), under the checkpoint's names and layout: the export of the
    weights, run on the gradients in their place (the mapping is linear)."""
    params = [p for p in backend.model.module.parameters() if p.requires_grad]
    weights = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad.view_as(p)
        return _hf_weights(backend)
    finally:
        for p, w in zip(params, weights, strict=True):
            p.data = w


def _assert_same_step(
    megatron: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    reference: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:  # fmt: skip
    """One optimizer step of the two backends agrees where that holds on every CPU: each tensor's
    gradients wherever either is clearly above rounding (GRAD_SIGNIFICANT of the tensor's largest),
    and Adam's update there. A first update is about lr * sign(g), so an element whose gradient is
    within rounding of zero may move either way with the CPU's summation order: its update is not
    compared (the omni thinker's v_proj failed so on another CPU of the same kind)."""
    (grads, after), (want_grads, want_after) = megatron, reference
    assert grads.keys() == want_grads.keys() == after.keys()
    floor = GRAD_FLOOR * max(g.abs().max() for g in want_grads.values())
    for name, want in want_grads.items():
        got, scale = grads[name], want.abs().max()
        significant = torch.maximum(got.abs(), want.abs()) > GRAD_SIGNIFICANT * scale + floor
        diff = (got - want).abs()
        assert (diff <= GRAD_RTOL * want.abs() + GRAD_ATOL * scale + floor).all(), f"{name}: gradients differ"
        step = (after[name] - want_after[name]).abs()[significant]
        assert (step <= WEIGHT_ATOL).all(), f"{name}: updates differ"


def test_megatron_logprobs_and_step_are_the_torch_backends(model, reference, tmp_path):
    batch = _batch(model)
    megatron = _megatron(model)
    mbs = megatron._microbatches(batch)
    media = media_of(model)
    assert len(mbs) > 1 and any(len(mb.rows) > 1 and media.media_input in mb.media for mb in mbs)
    expected = _torch_logprobs(reference, batch)
    got = megatron._frozen_logprobs(megatron.model, batch)
    assert got is not None
    mask = batch.loss_mask.bool()
    assert (got[mask] - expected[mask]).abs().max() < ATOL
    # every real token, the prompts' included (its image tokens' successors among them)
    real = batch.attention_mask.bool()
    assert (got[real] - expected[real]).abs().max() < ATOL

    batch.rollout_logprobs = expected * batch.loss_mask  # on-policy: ratios 1, as after sampling
    want, result = reference.train_step(batch, 0), megatron.train_step(batch, 0)
    assert result.loss == pytest.approx(want.loss, rel=1e-4, abs=1e-6)
    assert result.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
    source = _source(model)
    before, after, torch_after = source, _hf_weights(megatron), _hf_weights(reference)
    assert after.keys() == torch_after.keys() == source.keys()
    tower = [n for n in after if media.first_attention in n]
    assert tower and all(not torch.equal(after[n], before[n]) for n in tower)
    _assert_same_step((_megatron_grads(megatron), after), (_torch_grads(reference), torch_after))
    # the trained weights through a megatron checkpoint (tools/dcp_to_hf.py's reading), exactly
    megatron.save_checkpoint(tmp_path / "ckpt")
    resumed = _megatron(model)  # the source weights, an optimizer that never stepped
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(t, after[n]) for n, t in _hf_weights(resumed).items())
    converted = megatron_checkpoint_to_hf(tmp_path / "ckpt", megatron.hf_config)
    assert converted.keys() == after.keys()
    assert all(torch.equal(converted[n], after[n]) for n in after)
    # and into transformers' model as tools/dcp_to_hf.py loads them (module names; a tied head
    # aside). An MoE model's (the Omni thinker's) experts are one tensor per expert in the
    # checkpoint and fused in transformers' module: its from_pretrained fuses them at load.
    if megatron.arch.moe:
        return
    policy = empty_policy(str(model), torch.float32)
    missing, unexpected = policy.load_state_dict(module_names(policy, converted), strict=False, assign=True)
    assert unexpected == [] and missing == (["lm_head.weight"] if megatron.arch.tied else [])


def test_megatron_loads_and_exports_the_hf_weights_exactly(model, megatron_on_cpu):
    megatron = _megatron(model)
    source = _source(model)
    exported = _hf_weights(megatron)
    assert [(n, tuple(shape)) for n, shape, _ in megatron.parameter_specs()] == [
        (n, tuple(t.shape)) for n, t in exported.items()
    ]
    assert exported.keys() == source.keys()
    assert all(torch.equal(exported[n], source[n]) for n in source)
    # trainer.freeze_encoder: the tower neither trains nor goes to the engines (a projector does)
    media = media_of(model)
    frozen = MegatronBackend(_config(model, *MEGATRON, "trainer.freeze_encoder=true"), torch.device("cpu"))
    tower = [n for n in source if any(t in n for t in media.hf_towers)]
    assert tower and {n for n, _, _ in frozen.parameter_specs()} == set(source) - set(tower)
    assert set(_hf_weights(frozen)) == set(source) - set(tower)
    trained = {n for n, p in frozen.model.module.named_parameters() if p.requires_grad}
    assert trained and not any(n.startswith(media.mcore_towers) for n in trained)


def test_a_megatron_checkpoint_exports_as_the_folder_transformers_loads(model, megatron_on_cpu, tmp_path):
    """tools/dcp_to_hf.py's conversion (relax_hpc.ckpt.export) of a megatron checkpoint after one
    step: the checkpoint's names and layout as they are (an Omni thinker's under thinker.*, its
    MoE experts one tensor each), which transformers loads back to exactly those weights."""
    overrides = [*OVERRIDES, f"model.path={model}", *MEGATRON, f"run.dir={tmp_path / 'run'}"]
    cfg = load_config(REPO / "configs" / media_of(model).config, overrides, base_dir=REPO)
    paths = RunPaths(Path(cfg.run.dir))
    paths.create()
    paths.config.write_text(to_yaml(cfg))
    megatron = MegatronBackend(BackendConfig.of(cfg), torch.device("cpu"))
    batch = _batch(model)
    logprobs = megatron._frozen_logprobs(megatron.model, batch)
    assert logprobs is not None
    batch.rollout_logprobs = logprobs  # on-policy: one step
    megatron.train_step(batch, 0)
    assert Checkpointer(paths.ckpt, keep=2).save(1, megatron.save_checkpoint, {}, {"step": 1, "version": 1})
    convert(paths.root, tmp_path / "hf")
    loaded = load_policy(str(tmp_path / "hf"), torch.float32)
    got = checkpoint_layout(loaded, {n: p.detach() for n, p in loaded.named_parameters()})
    expected = _hf_weights(megatron)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)


Push = Callable[[TorchEngine, list[BucketPlan], dict[str, torch.Tensor], Path], None]


def _broadcast(engine: TorchEngine, plans: list[BucketPlan], tensors: dict[str, torch.Tensor], _: Path) -> None:
    """As WeightSender's engines receive: a two-rank gloo side group, one flattened bucket each."""
    port = free_port("127.0.0.1")
    join = P.InitWeightsUpdateGroupReqInput("127.0.0.1", port, 1, 2, "vl", "gloo")
    with ThreadPoolExecutor(1) as engine_side:
        joined = engine_side.submit(engine.init_group, join)
        trainer = SideGroup("127.0.0.1", port, 0, 2, "vl", "gloo", 30.0)
        joined.result()
        try:
            for k, plan in enumerate(plans):
                req = P.UpdateWeightsFromDistributedReqInput(
                    plan.names, plan.dtypes, plan.shapes, "vl", load_format="flattened_bucket",
                    weight_version="1" if k == len(plans) - 1 else None,
                )  # fmt: skip
                received = engine_side.submit(engine.update_from_distributed, req)
                trainer.broadcast(pack([tensors[n] for n in plan.names]))
                received.result()
        finally:
            trainer.close()


def _colocated(engine: TorchEngine, plans: list[BucketPlan], tensors: dict[str, torch.Tensor], _: Path) -> None:
    """As ColocatedSender hands buckets over: by reference (shared memory on the CPU)."""
    for plan in plans:
        payloads = serialize_bucket(pack([tensors[n] for n in plan.names]), bucket_records(plan))
        engine.update_from_tensor(P.UpdateWeightsFromTensorReqInput(payloads, FLATTENED_BUCKET, weight_version="1"))


def _file(engine: TorchEngine, plans: list[BucketPlan], tensors: dict[str, torch.Tensor], tmp: Path) -> None:
    """As FileChannel writes a version's folder, one file per bucket, and the engine loads it."""
    folder = tmp / "v1"
    folder.mkdir()
    for k, plan in enumerate(plans):
        write_dense(folder / f"bucket-{k}.safetensors", pack([tensors[n] for n in plan.names]), plan)
    engine.update_from_disk(P.UpdateWeightFromDiskReqInput(str(folder), weight_version="1"))


@pytest.fixture
def engine(request: pytest.FixtureRequest, dense_model: Path) -> TorchEngine:
    """The built-in engine, loaded before megatron's CPU patches apply (as `reference`)."""
    built = TorchEngine(str(dense_model), "float32")
    request.getfixturevalue("megatron_on_cpu")
    return built


@pytest.fixture(scope="module", params=["qwen2.5-vl", "qwen3-vl", "qwen2-audio"])
def dense_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The families whose megatron export the built-in engine takes: not the Omni thinker, an MoE
    model (the engine holds transformers' fused experts, megatron sends one tensor per expert; submit
    refuses the pair)."""
    return model_folder(request.param, tmp_path_factory)


@pytest.mark.parametrize("push", [_broadcast, _colocated, _file], ids=["broadcast", "colocated", "file"])
def test_the_built_in_engine_takes_the_megatron_export(dense_model, engine, push: Push, tmp_path):
    model = dense_model
    megatron = _megatron(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights the engine does not hold yet (it loads the same folder)
        for p in megatron.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    exported = {n: t.detach().clone() for n, t in megatron.full_parameters() if t is not None}
    plans = plan_buckets(megatron.parameter_specs(), 2**16)  # several buckets, as a real push
    expected = module_names(engine.model, exported)
    assert expected.keys() == set(engine.params)  # every weight (the tied head is the embedding)
    if model.name == "tiny-qwen2.5-vl-shapes":  # the checkpoint's names are not the module's
        assert not any(n in set(engine.params) for n in exported if "visual." in n or ".layers." in n)
    with torch.no_grad():
        for p in engine.params.values():
            p.zero_()
    engine.begin_update(P.BeginWeightUpdateReqInput())
    push(engine, plans, exported, tmp_path)
    engine.end_update()
    assert engine.weight_version == "1"
    assert all(torch.equal(engine.params[n], t) for n, t in expected.items())

    # the engine samples for a prompt with a picture (a clip); megatron scores the same tokens
    processor, media = MediaProcessor(str(model)), media_of(model)
    item = media.items[0]
    prompt = processor.prompt_ids(PromptRow(0, f"{media.placeholder}how many?", ""))
    sampling = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 4}
    image, audio = (str(item), None) if media.kind == "image" else (None, str(item))
    request = P.GenerateReqInput(prompt, sampling, return_logprob=True, image_data=image, audio_data=audio)
    request.return_prompt_token_ids = True
    out = engine.generate(request)
    assert isinstance(out, dict)
    keep = up_to_media_token(out["output_ids"], processor.media_token_ids)
    assert keep > 1  # random weights may sample a media token: scored up to it
    sampled = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"][:keep]]
    processed = processor.process(prompt, [(media.kind, item.read_bytes())])
    assert processed.input_ids == out["prompt_token_ids"]
    sequence = processed.input_ids + out["output_ids"][:keep]
    mask = [0] * len(processed.input_ids) + [1] * keep
    batch = pad_samples(
        [sequence], [mask], [[0.0] * len(sequence)], [1.0], [0], processor.tokenizer.pad_token_id,
        (processed.tensors,),
    )  # fmt: skip
    got = megatron._frozen_logprobs(megatron.model, batch)
    assert got is not None
    assert (got[batch.loss_mask.bool()] - torch.tensor(sampled)).abs().max() < ATOL


def test_an_omni_thinker_replays_the_given_experts_as_the_torch_backend_does(request, tmp_path_factory, tmp_path):
    """Routing replay with media (the Omni thinker is MoE): both backends route every token of a
    batch with pictures and clips through the experts the batch names, and then agree on the
    log-probabilities as they do when their routers decide; other experts change them."""
    from relax_hpc.models.megatron_routing import recording

    model = model_folder("qwen3-omni", tmp_path_factory)
    replay = "algo.off_policy.routing_replay=true"
    started = not dist.is_initialized()
    if started:  # the torch backend first, before megatron's CPU patches (the reference fixture's order)
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    reference = TorchBackend(_config(model, replay), torch.device("cpu"))
    request.getfixturevalue("megatron_on_cpu")
    megatron = MegatronBackend(_config(model, *MEGATRON, replay), torch.device("cpu"))
    batch = _batch(model)
    n, width = batch.input_ids.shape
    layers = megatron.hf_config.thinker_config.text_config.num_hidden_layers
    top_k = megatron.hf_config.thinker_config.text_config.num_experts_per_tok
    experts = torch.arange(top_k).repeat(layers)  # experts 0..k-1 in every layer, for every token
    real = batch.attention_mask.bool()
    logprobs = {}
    for shift in (0, 1):
        batch.routed = ((experts + shift) % 4).expand(n, width, -1).clone()
        with recording(megatron.model) as calls:
            got = megatron._frozen_logprobs(megatron.model, batch)
        assert got is not None and calls
        assert all(torch.equal(c.unique(), torch.arange(shift, shift + top_k) % 4) for c in calls)
        expected = _torch_logprobs(reference, batch)
        assert (got[real] - expected[real]).abs().max() < ATOL
        logprobs[shift] = got[real]
    assert (logprobs[0] - logprobs[1]).abs().max() > 1e-3
    if started:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3-omni"])
def test_the_critic_learns_the_values_of_rows_with_media(name, tmp_path_factory, megatron_on_cpu):
    """gae on the megatron backend with media: the critic (the policy's model, towers included,
    with a value head) takes each micro-batch's pictures and clips, and on a fixed batch its value
    loss falls (lambda = 1: the returns are the rewards)."""
    model = model_folder(name, tmp_path_factory)
    gae = ["algo.advantage.estimator=gae", "algo.advantage.lam=1.0", "algo.critic.lr=1e-3"]
    backend = MegatronBackend(_config(model, *MEGATRON, *gae), torch.device("cpu"))
    batch = _batch(model)
    losses = [backend.train_step(batch, step).stats.sums["value_loss"] for step in range(6)]
    assert losses[-1] < 0.7 * losses[0], losses
