"""HF <-> megatron mapping across real process groups: two torchrun ranks on CPU (gloo; on a
machine with two GPUs, NCCL) with TP=2, PP=2, EP=2 or data parallel alone (TP=2 also for the
shipped tiny Qwen2.5-VL and Qwen2-Audio: the language model sharded, the towers replicated, and
the log-probabilities on a prompt with a picture or a clip those of transformers' model within
1e-5). Every rank loads an HF
folder, holds exactly the block of every tensor that an independent, naive computation expects, and
export_hf run on all ranks gives rank 0 the HF checkpoint bit for bit (the other rank gets the same
names with None); with every_rank (colocated ranks) both ranks get it bit for bit, and with "stage" (the sharded
channel) the ranks of the stage that holds each tensor.

This file is also the torchrun worker: `python -m torch.distributed.run --nproc-per-node=2
tests/integration/test_hf_mapping_parallel.py FOLDERS_JSON OUT_DIR` runs every layout in turn."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pytest
import torch

from tests.integration.conftest import Engines, make_run

if TYPE_CHECKING:
    from relax_hpc.config.schema import MediaKind

REPO = Path(__file__).resolve().parents[2]
VISION = REPO / "assets/tiny-qwen2.5-vl-shapes"
AUDIO = REPO / "assets/tiny-qwen2-audio-beeps"
SHIPPED = {"qwen2.5-vl": VISION, "qwen2-audio": AUDIO}  # the shipped multimodal models, read as they are
LAYOUTS: dict[str, dict[str, Any]] = {  # MegatronConfig's parallel sizes
    "tp2": {"tensor_parallel": 2},
    "pp2": {"pipeline_parallel": 2},
    "ep2": {"expert_parallel": 2},  # TP=1, so also 2 data-parallel replicas of the dense weights
    "dp2": {},  # 2 data-parallel replicas: each holds every weight
}
# What each layout runs on, and how many layers the models have. A tied model under PP builds on
# GPUs only (megatron moves the last stage's copy of the embedding to CUDA while building).
TIED_PP = ["qwen3-tied"] if torch.cuda.is_available() else []
MODELS = {
    "tp2": (["qwen2", "qwen3-tied", "qwen3-moe", "qwen2.5-vl", "qwen2-audio"], 2),
    "pp2": (["qwen2", "qwen3", "qwen3-moe", *TIED_PP], 4),
    "ep2": (["qwen3-moe"], 2),
    "dp2": (["qwen2"], 2),
}
# The sharded channel's pushes of the shipped tiny model (untied) to two engines, in turn: case ->
# (layout, how: concurrent, each rank's buckets over connections of their own; ordered, all in one
# order; relay, in one order, each broadcast passing through the other rank (weights.relay);
# node, one sender per node and stage, the other rank relaying (weights.senders node); colocated,
# by reference, each rank's buckets to both engines).
SHARDED = {
    "tp2": ("tp2", "concurrent"), "pp2": ("pp2", "concurrent"), "pp2-ordered": ("pp2", "ordered"),
    "pp2-relay": ("pp2", "relay"), "tp2-node": ("tp2", "node"), "pp2-colocated": ("pp2", "colocated"),
}  # fmt: skip
# Global layers and experts each rank must hold (None: all of them).
HOLDS: dict[str, dict[int, tuple[list[int] | None, list[int] | None]]] = {
    "tp2": {0: (None, None), 1: (None, None)},
    "pp2": {0: ([0, 1], None), 1: ([2, 3], None)},
    "ep2": {0: (None, [0, 1]), 1: (None, [2, 3])},
    "dp2": {0: (None, None), 1: (None, None)},
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory, engine_forks) -> Iterator[dict]:
    """One torchrun of every layout (megatron's import alone takes ~10 s of CPU per process):
    {layout: {rank: {model kind: facts}}}, and the sharded pushes' facts under "sharded"."""
    from tests.unit.test_hf_mapping import save_random_hf, tiny_configs

    root = tmp_path_factory.mktemp("hf_mapping_parallel")
    cfg, paths = make_run(root / "run", f"model.path={untied_copy(root / 'untied')}", "weights.channel=sharded",
                          "weights.bucket_mb=0.05")  # fmt: skip
    engines = Engines(cfg, paths, engine_forks)
    for i in range(2):
        engines.start(f"engine-{i}")
    folders: dict[str, dict[str, str]] = {}
    for layout, (kinds, num_layers) in MODELS.items():
        configs = tiny_configs(num_layers)
        for seed, kind in enumerate(kinds):
            folder = SHIPPED.get(kind, root / layout / kind)
            if kind not in SHIPPED:
                save_random_hf(configs[kind], folder, seed=seed)
            folders.setdefault(layout, {})[kind] = str(folder)
    (root / "folders.json").write_text(json.dumps(folders))
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    # Output to a file, not a pipe: torch's shared-memory manager (the colocated case shares CPU
    # tensors by name) outlives the workers and would hold a pipe open until the engines exit.
    log = root / "torchrun.log"
    with log.open("w") as sink:
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
             str(root / "folders.json"), str(root), str(paths.root)],
            check=False, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=600,
        )  # fmt: skip
    engines.stop()
    assert result.returncode == 0, log.read_text()[-7000:]
    yield {rank: json.loads((root / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def untied_copy(folder: Path) -> Path:
    """The shipped tiny model with its own LM head (megatron builds a tied model under PP on GPUs only)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(REPO / "assets/tiny-qwen3-addition", folder)
    weights = load_file(str(folder / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return folder


@pytest.mark.integration
@pytest.mark.parametrize("case", SHARDED)
def test_the_sharded_channel_pushes_each_stages_tensors_from_its_own_ranks(case, reports):
    """weights.channel=sharded from megatron ranks to two built-in engines: both ranks send (TP=2:
    about half the bytes each; PP=2: each stage its own tensors), concurrently (the built-in
    engine's way), in one order (SGLang's; also each broadcast through the other rank,
    weights.relay; or from one sender per node, weights.senders node) or by reference
    (launch.colocate: shared memory on the CPU), and both engines then hold the trainer's weights
    bit for bit at the pushed version."""
    layout, _ = SHARDED[case]
    facts = reports[0]["sharded"][case]
    version = str(list(SHARDED).index(case) + 1)
    assert facts["served"] == 2 and facts["versions"] == [version] * 2
    assert facts["mismatched"] == [] and facts["compared"] == facts["tensors"] > 0
    shares = facts["shares"]
    assert facts["relayed_groups"] == (1 if case.endswith("-relay") else 0)  # each rank passes the other's on
    if case.endswith("-node"):  # one sender for the node's one stage, one group; rank 1 relays it
        assert shares == [facts["bytes"], 0] and facts["groups"] == 1
        assert reports[1]["sharded"][case]["relayed_groups"] == 1
        return
    assert min(shares) > 0 and sum(shares) == facts["bytes"]
    assert facts["groups"] == (None if case.endswith("-colocated") else 2)
    if layout == "tp2":  # one stage: both ranks hold every tensor, spread by size to within a tensor
        assert max(shares) <= facts["bytes"] / 2 + facts["largest_tensor"]


@pytest.mark.integration
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_hold_their_shards_and_export_the_checkpoint(layout, reports):
    kinds, num_layers = MODELS[layout]
    for rank in (0, 1):
        report = reports[rank][layout]
        assert sorted(report) == sorted(kinds)
        for kind, facts in report.items():
            layers, experts = HOLDS[layout][rank]
            assert facts["layers"] == (layers if layers is not None else list(range(num_layers))), kind
            if "moe" in kind:
                assert facts["experts"] == (experts if experts is not None else [0, 1, 2, 3]), kind
            assert facts["checked"] == facts["params"] > 0
            # rank 0 receives every tensor; the other rank iterates the same names with None
            assert facts["exported"] == facts["specs"] and facts["tensors"] == (facts["specs"] if rank == 0 else 0)
            assert facts["every_rank"] == facts["specs"]  # every_rank: this rank got every tensor, checked
            if layout != "pp2":  # one stage: every rank holds every tensor for the sharded channel
                assert facts["stage"] == facts["specs"], kind
            if kind in SHIPPED:  # fp32, sums in another order (measured 1e-6)
                assert facts["media_logprob_gap"] < 1e-5, kind
    if layout == "pp2":  # two stages: each tensor on the ranks of exactly one, both stages sending
        for kind in kinds:
            held = [reports[rank][layout][kind]["stage"] for rank in (0, 1)]
            assert sum(held) == reports[0][layout][kind]["specs"] and min(held) > 0, kind


# ---------------------------------------------------------------- the worker


def _expected_shards(model, hf: dict, groups: int, tp: tuple[int, int], etp: tuple[int, int]) -> dict:
    """Each parameter's expected block, computed naively from the HF tensors (no mapping code).
    Qwen2-Audio's checkpoint keeps the language model under language_model."""
    expected, layers, experts = {}, set(), set()
    lm = "language_model." if "language_model.model.embed_tokens.weight" in hf else ""
    for name, param in model.named_parameters():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            source = (
                hf[f"{lm}lm_head.weight"]
                if name == "output_layer.weight" and f"{lm}lm_head.weight" in hf
                else hf[f"{lm}model.embed_tokens.weight"]
            )
            padded = torch.cat([source, source.new_zeros(param.shape[0] * tp[1] - source.shape[0], source.shape[1])])
            expected[name] = padded.chunk(tp[1])[tp[0]]
            continue
        if name == "decoder.final_layernorm.weight":
            expected[name] = hf[f"{lm}model.norm.weight"]
            continue
        if name.startswith("vision."):  # the vision tower: whole on every rank
            expected[name] = hf["visual." + name.removeprefix("vision.")]
            continue
        if name.startswith("audio."):  # the audio tower and projector: whole on every rank
            expected[name] = hf[name.removeprefix("audio.")]
            continue
        match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        assert match is not None, name
        index, rest = match.groups()
        layer = model.decoder.layers[int(index)]
        layers.add(layer.layer_number - 1)
        prefix = f"{lm}model.layers.{layer.layer_number - 1}."
        expert = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(.+)", rest)
        if expert:
            global_expert = layer.mlp.local_expert_indices[int(expert[1])]
            experts.add(global_expert)
            expected[name] = _mlp_block(hf, f"{prefix}mlp.experts.{global_expert}.", expert[2], *etp)
        else:
            expected[name] = _dense_block(hf, prefix, rest, groups, *tp)
    return {"expected": expected, "layers": sorted(layers), "experts": sorted(experts)}


def _dense_block(hf: dict, prefix: str, rest: str, groups: int, rank: int, world: int) -> torch.Tensor:
    attn = prefix + "self_attn."
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = (hf[f"{attn}{x}_proj.{kind}"] for x in "qkv")
        per_group = [torch.cat([t.reshape(groups, -1, *t.shape[1:])[g] for t in (q, k, v)]) for g in range(groups)]
        return torch.cat(per_group).chunk(world)[rank]
    if rest == "self_attention.linear_proj.weight":
        return hf[attn + "o_proj.weight"].chunk(world, dim=1)[rank]
    replicated = {
        "input_layernorm.weight": prefix + "input_layernorm.weight",
        "pre_mlp_layernorm.weight": prefix + "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": attn + "q_norm.weight",
        "self_attention.k_layernorm.weight": attn + "k_norm.weight",
        "mlp.router.weight": prefix + "mlp.gate.weight",
    }
    if rest in replicated:
        return hf[replicated[rest]]
    return _mlp_block(hf, prefix + "mlp.", rest.removeprefix("mlp."), rank, world)


def _mlp_block(hf: dict, prefix: str, rest: str, rank: int, world: int) -> torch.Tensor:
    if rest == "linear_fc1.weight":  # this rank's gate rows, then its up rows
        return torch.cat(
            [hf[prefix + "gate_proj.weight"].chunk(world)[rank], hf[prefix + "up_proj.weight"].chunk(world)[rank]]
        )
    assert rest == "linear_fc2.weight", rest
    return hf[prefix + "down_proj.weight"].chunk(world, dim=1)[rank]


def _run_model(folder: str, layout: str) -> dict:
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from relax_hpc.config.schema import MegatronConfig
    from relax_hpc.models.hf_export import export_hf, hf_stages
    from relax_hpc.models.hf_loading import load_hf_weights
    from relax_hpc.models.hf_mapping import hf_specs
    from relax_hpc.models.megatron import build_model
    from tests.unit.test_hf_mapping import read_safetensors

    sizes = LAYOUTS[layout]
    ps.initialize_model_parallel(
        tensor_model_parallel_size=sizes.get("tensor_parallel", 1),
        pipeline_model_parallel_size=sizes.get("pipeline_parallel", 1),
        expert_model_parallel_size=sizes.get("expert_parallel", 1),
    )
    if torch.cuda.is_available():  # megatron initialises weights on a GPU under its RNG tracker
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    try:
        config = AutoConfig.from_pretrained(folder)
        par = MegatronConfig(attention="sdpa", **sizes)
        model = build_model(config, par, torch.float32, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
        load_hf_weights(model, folder)
        hf = read_safetensors(Path(folder))
        tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
        etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
        facts = _expected_shards(model, hf, config.get_text_config().num_key_value_heads, tp, etp)
        params = dict(model.named_parameters())
        for name, block in facts["expected"].items():
            assert params[name].shape == block.shape and torch.equal(params[name].cpu(), block), name
        exported = list(export_hf(model, config))
        specs = [name for name, _, _ in hf_specs(config, torch.float32)]
        assert [name for name, _ in exported] == specs
        tensors = [(name, t) for name, t in exported if t is not None]
        for name, tensor in tensors:
            assert torch.equal(tensor.cpu(), hf[name]), name
        everywhere = list(export_hf(model, config, to="every_rank"))
        assert [name for name, _ in everywhere] == specs
        for name, full in everywhere:
            assert full is not None and torch.equal(full.cpu(), hf[name]), name
        # "stage" (the sharded channel): every rank of the stage that holds a tensor gets it
        stage, stages = ps.get_pipeline_model_parallel_rank(), hf_stages(model, config)
        staged = list(export_hf(model, config, to="stage"))
        assert [name for name, _ in staged] == specs
        for name, full in staged:
            assert (full is not None) == (stages[name] == stage), name
            assert full is None or torch.equal(full.cpu(), hf[name]), name
        media: MediaKind | None = (
            "image" if hasattr(config, "vision_config") else "audio" if hasattr(config, "audio_config") else None
        )
        gap = {"media_logprob_gap": _media_logprob_gap(model, folder, config, media)} if media else {}
        return {
            **gap,
            "layers": facts["layers"],
            "experts": facts["experts"],
            "params": len(params),
            "checked": len(facts["expected"]),
            "specs": len(specs),
            "exported": len(exported),
            "tensors": len(tensors),
            "every_rank": len(everywhere),
            "stage": sum(full is not None for _, full in staged),
        }
    finally:
        ps.destroy_model_parallel()


def _media_logprob_gap(model, folder: str, config, kind: MediaKind) -> float:
    """max |megatron - transformers| log-probability of every next token of a prompt with a
    picture or a clip (the tower's embeddings at the media tokens; a vision model's multimodal
    RoPE; vocabulary-parallel log-probabilities over the TP group)."""
    from megatron.core import parallel_state as ps

    from relax_hpc.data.processor import MediaProcessor
    from relax_hpc.data.prompts import PromptRow
    from relax_hpc.models.hf import load_policy
    from relax_hpc.models.megatron_vision import MropePackedSeqParams, mrope_positions, rope_index_model
    from relax_hpc.trainer.vocab_parallel import logprobs_and_entropy

    processor = MediaProcessor(folder)
    item = REPO / ("assets/shapes/0001.png" if kind == "image" else "assets/beeps/0002.flac")
    mark = "<image>" if kind == "image" else "<audio>"
    prompt = processor.process(processor.prompt_ids(PromptRow(0, f"{mark}how many?", "")), [(kind, item.read_bytes())])
    ids = torch.tensor([prompt.input_ids])
    length, pad = ids.shape[1], ids.shape[1] % 2  # TP=2 takes an even packed length: one pad token
    device = next(model.parameters()).device
    cu = torch.tensor([0, length, length + pad][: 3 if pad else 2], dtype=torch.int32, device=device)
    if kind == "image":
        grids = {"image_grid_thw": prompt.tensors["image_grid_thw"]}
        positions = mrope_positions(rope_index_model(config), ids, torch.ones_like(ids), grids)  # [3, 1, length]
        mrope, position_ids, hf_positions = (
            torch.cat([positions[:, 0], positions.new_zeros(3, pad)], 1),
            None,
            positions,
        )
    else:  # one-dimensional RoPE: each packed document counts from 0
        mrope, hf_positions = None, torch.arange(length)[None]
        position_ids = torch.cat([torch.arange(length), torch.arange(pad)])[None].to(device)
    params = MropePackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=length, max_seqlen_kv=length,
        mrope_positions=None if mrope is None else mrope.to(device),
    )  # fmt: skip
    packed = torch.cat([ids, ids.new_zeros(1, pad)], 1).to(device)
    inputs = {k: v.to(device) for k, v in prompt.tensors.items()}
    targets = ids[0, 1:]
    with torch.no_grad():
        logits = model(packed, position_ids, None, packed_seq_params=params, **inputs).reshape(length + pad, -1)
        got, _ = logprobs_and_entropy(
            logits[: length - 1].float(), targets.to(device),
            vocab_start=ps.get_tensor_model_parallel_rank() * logits.shape[-1],
            group=ps.get_tensor_model_parallel_group(), entropy_grad=False, temperature=1.0,
            vocab_size=config.get_text_config().vocab_size,
        )  # fmt: skip
        hf = load_policy(folder, torch.float32).eval()
        out = hf(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=hf_positions, **prompt.tensors)
        expected = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(1, targets[:, None])[:, 0]
    return float((got.cpu() - expected).abs().max())


def _push_sharded(run: str, layout: str, version: int, how: str) -> dict:
    """Perturb the run's model held in `layout`, push it through the sharded channel, and (rank
    0) compare every engine's weights with the model's HF tensors."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from relax_hpc.config.load import read_frozen
    from relax_hpc.config.schema import MegatronConfig
    from relax_hpc.models.hf_export import export_hf, hf_stages
    from relax_hpc.models.hf_loading import load_hf_weights
    from relax_hpc.models.hf_mapping import hf_specs
    from relax_hpc.models.megatron import build_model
    from relax_hpc.paths import RunPaths
    from relax_hpc.protocol.client import EngineClient
    from relax_hpc.protocol.registry import read_records
    from relax_hpc.protocol.requests import GetWeightsByNameReqInput
    from relax_hpc.weights.colocated import ColocatedSender
    from relax_hpc.weights.layout import EngineLayout
    from relax_hpc.weights.sender import WeightSender
    from relax_hpc.weights.sharded import ShardedChannel, ShardedColocatedChannel, shares

    paths = RunPaths(Path(run))
    cfg, sizes = read_frozen(paths.config), LAYOUTS[layout]
    ps.initialize_model_parallel(
        tensor_model_parallel_size=sizes.get("tensor_parallel", 1),
        pipeline_model_parallel_size=sizes.get("pipeline_parallel", 1),
    )
    try:
        config = AutoConfig.from_pretrained(cfg.model.path)
        model = build_model(config, MegatronConfig(attention="sdpa", **sizes), torch.float32,
                            ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())  # fmt: skip
        load_hf_weights(model, cfg.model.path)
        torch.manual_seed(version)  # the same on every rank: replicated tensors stay equal
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.25 * torch.randn_like(param))
        specs = hf_specs(config, torch.float32)
        layout_, bucket_bytes = EngineLayout(specs, None), int(cfg.weights.bucket_mb * 2**20)
        stages = (ps.get_pipeline_model_parallel_rank(), hf_stages(model, config))
        channel: ShardedChannel | ShardedColocatedChannel
        if how == "colocated":
            sender = ColocatedSender(paths.engines, paths.read_token(), 30.0, dist.get_rank(), dist.get_world_size())
            channel = ShardedColocatedChannel(sender, layout_, bucket_bytes, stages)
        else:
            sender_ = WeightSender(paths.engines, paths.read_token(), "gloo", 30.0)
            concurrent, relay = how == "concurrent", how in ("relay", "node")
            senders: Literal["rank", "node"] = "node" if how == "node" else "rank"
            channel = ShardedChannel(
                sender_, layout_, bucket_bytes, stages, concurrent=concurrent, relay=relay, senders=senders
            )
        served = channel.push(lambda: export_hf(model, config, to="stage"), version)
        full = {name: t for name, t in export_hf(model, config) if t is not None}  # rank 0: every tensor
        sent = shares(channel.buckets, channel.owner, dist.get_world_size())
        relayed = len(channel.sender.relayed) if isinstance(channel, ShardedChannel) and channel.sender else 0
        groups = len(channel.group_names) if isinstance(channel, ShardedChannel) else None
        largest = max(torch.Size(s).numel() * d.itemsize for _, s, d in specs)
        facts: dict[str, Any] = {"served": served, "shares": sent, "tensors": len(specs), "largest_tensor": largest,
                                 "relayed_groups": relayed, "groups": groups,
                                 "bytes": sum(b.nbytes for b in channel.buckets)}  # fmt: skip
        if dist.get_rank() == 0:
            clients = [EngineClient(r.url, paths.read_token(), 30.0) for r in read_records(paths.engines)]
            mismatched = []
            for name, tensor in full.items():
                request = GetWeightsByNameReqInput(name=name, truncate_size=tensor.shape[0])
                if any(torch.tensor(c.post("/get_weights_by_name", request)).ne(tensor).any() for c in clients):
                    mismatched.append(name)
            facts.update(versions=[c.weight_version() for c in clients], mismatched=mismatched, compared=len(full))
        return facts
    finally:
        ps.destroy_model_parallel()


def _worker(folders_json: str, out_dir: str, run: str) -> None:
    import torch.distributed as dist

    if torch.cuda.is_available():  # the same checks over NCCL, one GPU per rank
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    folders = json.loads(Path(folders_json).read_text())
    report: dict[str, Any] = {
        layout: {kind: _run_model(folder, layout) for kind, folder in models.items()}
        for layout, models in folders.items()
    }
    report["sharded"] = {
        case: _push_sharded(run, layout, version, how)
        for version, (case, (layout, how)) in enumerate(SHARDED.items(), start=1)
    }
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
