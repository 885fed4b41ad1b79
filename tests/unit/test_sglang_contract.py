"""The engine protocol against SGLang's own definitions, imported from the pinned release.

sglang (constraints.txt) is installed with --no-deps plus the light packages its import chain
needs (tools/install.sh), and imported through tests/sglang_import.py, which stands in for triton
and torchvision. Checked against the imported classes:

- every request relax_hpc sends, built the way the driver and the weight sender build it and
  turned into its body by protocol.to_json: SGLang's class of the same name
  (sglang.srt.managers.io_struct) is constructed with exactly those keyword arguments (an unknown
  name fails), and each value must match the type hint of SGLang's field (typing.get_type_hints;
  the annotation's source text where a hint does not resolve);
- the protocol's dataclasses: each field is one of SGLang's, with the same default;
- sampling parameters (the driver's and the ones the torch engine accepts) against the signature of
  SamplingParams, which also verifies them;
- launch_server's arguments as relax_hpc.engines.sglang_engine builds them: parsed by SGLang's own
  parser (ServerArgs.add_cli_args), each one a field of ServerArgs with a value of its type.

Routes are still read from the source (srt/entrypoints/http_server.py, with a regular expression):
importing the HTTP server would take fastapi, uvicorn and the rest of the serving runtime.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
import glob
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import types
import typing
import warnings
from collections import abc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from relax_hpc.config import load_config
from relax_hpc.data.processor import video_spec
from relax_hpc.data.prompts import PromptRow, load_prompts
from relax_hpc.engines.sglang_engine import server_args
from relax_hpc.engines.torch_engine import _ACTIONS
from relax_hpc.envs.context import GenerateCall
from relax_hpc.exchange.spool import SampleBatch
from relax_hpc.protocol import requests as P
from relax_hpc.protocol import routes as R
from relax_hpc.protocol.requests import adapter_name
from relax_hpc.rollout.engine_policy import EnginePolicy
from relax_hpc.rollout.rounds import sampling_params
from relax_hpc.rollout.teacher import scoring_request
from relax_hpc.weights.buckets import BucketPlan, pack
from relax_hpc.weights.digests import checker_answer, engine_digests
from relax_hpc.weights.files import write_dense
from relax_hpc.weights.tensors import bucket_records, deserialize, serialize, serialize_bucket
from relax_hpc.weights.verify import sglang_answer
from tests.sglang_import import import_sglang

REPO = Path(__file__).resolve().parents[2]
_PIN = re.search(r"^sglang==(\S+)$", (REPO / "constraints.txt").read_text(), re.MULTILINE)
assert _PIN is not None, "constraints.txt pins sglang"
PINNED = _PIN.group(1)

# Every request class relax_hpc sends (or the torch engine accepts) and every route it calls: the
# protocol's route table.
CLASSES = [r.request for r in R.ROUTES.values() if r.request is not None]
ROUTES = [r.path for r in R.ROUTES.values()]


@pytest.fixture(scope="module")
def sglang() -> SimpleNamespace:
    if importlib.util.find_spec("sglang") is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("sglang is not installed: tools/install.sh installs it")
        pytest.skip("sglang is not installed (tools/install.sh installs it)")
    assert importlib.metadata.version("sglang") == PINNED, "installed sglang differs from constraints.txt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU-only notices from its quantization modules
        io, sampling, args = import_sglang(
            "sglang.srt.managers.io_struct", "sglang.srt.sampling.sampling_params", "sglang.srt.server_args"
        )
    return SimpleNamespace(io=io, SamplingParams=sampling.SamplingParams, ServerArgs=args.ServerArgs)


def sent_requests(cfg) -> list[Any]:
    """Each request as relax_hpc builds it (relax_hpc/rollout/driver.py, relax_hpc/weights/sender.py)."""
    sampling = sampling_params(cfg.rollout)
    greedy = {**sampling, "temperature": 0.0}
    init = P.InitWeightsUpdateGroupReqInput(
        master_address="127.0.0.1",
        master_port=29517,
        rank_offset=0,
        world_size=3,
        group_name="relax-0123456789ab",
        backend="gloo",
    )
    bucket: dict[str, Any] = {
        "names": ["model.embed_tokens.weight", "lm_head.weight"],
        "dtypes": ["float32", "bfloat16"],
        "shapes": [[32, 128], [32, 128]],
        "group_name": init.group_name,
        "load_format": "flattened_bucket",
    }
    return [
        policy_request([GenerateCall([5, 6, 7], {**sampling, "sampling_seed": s}) for s in (11, 12)]),
        policy_request([GenerateCall(ids, greedy) for ids in ([5, 6, 7], [8, 9])]),  # evaluation
        # routing replay: the routers' choices with the answer
        policy_request([GenerateCall([5, 6, 7], {**sampling, "sampling_seed": 3})], routing=True),
        # a multi-turn environment's second turn: a stop token, fewer new tokens
        policy_request([GenerateCall([5, 6, 7, 9], {**sampling, "max_new_tokens": 2, "stop_token_ids": [9]})]),
        *media_requests(sampling),
        teacher_request(),  # a teacher engine scores a group: no new token, input log-probabilities
        init,
        P.InitWeightsUpdateGroupReqInput(**{**P.to_json(init), "rank_offset": 1}),
        P.PauseGenerationReqInput(mode="in_place"),
        P.BeginWeightUpdateReqInput(),
        P.UpdateWeightsFromDistributedReqInput(**bucket, flush_cache=False, weight_version=None),
        P.UpdateWeightsFromDistributedReqInput(**bucket, flush_cache=True, weight_version="7"),  # the last bucket
        P.EndWeightUpdateReqInput(),
        P.ContinueGenerationReqInput(),
        P.DestroyWeightsUpdateGroupReqInput(init.group_name),
        # colocated (relax_hpc/weights/colocated.py): memory turns, weights by reference
        P.ReleaseMemoryOccupationReqInput(),
        P.ResumeMemoryOccupationReqInput(),
        P.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=colocated_payload(2), load_format="flattened_bucket", flush_cache=False
        ),
        P.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=colocated_payload(1), load_format="flattened_bucket", weight_version="7"
        ),
        P.UpdateWeightsFromTensorReqInput(serialized_named_tensors=serialize(COLOCATED_NAMED)),  # in place (bench)
        # the file channel (relax_hpc/weights/files.py): a whole version from the run's folder
        P.UpdateWeightFromDiskReqInput(model_path="/runs/r/weights/files/v7", weight_version="7"),
        P.AbortReq(abort_all=True),
        P.AbortReq(rid="r-1"),
        P.GetWeightsByNameReqInput(name="lm_head.weight", truncate_size=2),
        # LoRA adapter sync (relax_hpc/weights/adapters.py): a version's folder, the version, the
        # adapter before last; the driver names an engine's adapter in each request
        P.LoadLoRAAdapterReqInput(lora_name="v3", lora_path="/runs/r/weights/lora/v3"),
        P.UpdateWeightVersionReqInput("3", abort_all_requests=False),
        P.UnloadLoRAAdapterReqInput("v1"),
        dataclasses.replace(policy_request([GenerateCall([5, 6, 7], sampling)]), lora_path=adapter_name(3)),
        # weights verified after a push (relax_hpc/weights/verify.py): every tensor's digest
        P.CheckWeightsReqInput(),
    ]


COLOCATED_NAMED = [
    ("model.embed_tokens.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4)),
    ("model.norm.weight", torch.ones(5, dtype=torch.bfloat16)),
]


def colocated_payload(tp_size: int) -> list[str]:
    """A bucket of two parameters as a colocated trainer rank sends it (one payload per TP rank)."""
    plan = BucketPlan([n for n, _ in COLOCATED_NAMED], ["float32", "bfloat16"], [[3, 4], [5]])
    return serialize_bucket(pack([t for _, t in COLOCATED_NAMED]), bucket_records(plan), tp_size)


def policy_request(calls: list[GenerateCall], routing: bool = False) -> P.GenerateReqInput:
    """A /generate request as the driver's engine policy builds it from episodes' calls."""
    return EnginePolicy._request(SimpleNamespace(routing=routing), calls)  # type: ignore[arg-type]  # all it reads


def teacher_request() -> P.GenerateReqInput:
    """A prompt group's scoring request as the driver sends it to a teacher engine."""
    batch = SampleBatch.from_samples(
        seq=0, sequences=[[5, 6, 7, 8, 9], [5, 6, 7, 2]], prompt_lens=[3, 3], logprobs=[[-0.5, -0.5], [-0.5]],
        rewards=[1.0, 0.0], group_ids=[4, 4], policy_version=[0, 0], prompt_index=[2, 2],
    )  # fmt: skip
    return scoring_request(batch, [0, 1])


def media_requests(sampling: dict[str, Any]) -> list[P.GenerateReqInput]:
    """The driver's requests for rows with images, with audio, and for a batch mixing rows with
    and without media (a video's canonical clip among them), built from the shipped datasets."""
    images = load_prompts(REPO / "assets/shapes/shapes.jsonl", "prompt", "answer", {"image": "images"})[:2]
    audios = load_prompts(REPO / "assets/beeps/beeps.jsonl", "prompt", "answer", {"audio": "audios"})[:2]
    motion = str(REPO / "assets/tiny-qwen2.5-vl-motion")
    videos = load_prompts(
        REPO / "assets/motion/motion.jsonl", "prompt", "answer", {"video": "videos"}, video=video_spec(motion)
    )[:1]  # fmt: skip
    both = [*images, audios[0], videos[0], PromptRow(9, "text only", "1")]
    requests = []
    for rows, indices in ((images, [0, 0, 1, 1]), (audios, [0, 1]), (both, [0, 2, 3, 4, 4])):
        calls = [
            GenerateCall([5, 6, 7], {**sampling, "sampling_seed": k}, [(r.kind, r.read()) for r in rows[i].media])
            for k, i in enumerate(indices)
        ]
        requests.append(policy_request(calls))
    assert all(r.return_prompt_token_ids for r in requests) and requests[2].image_data and requests[2].audio_data
    assert requests[2].video_data and requests[2].video_data[2][0].startswith("data:video/x-msvideo;base64,")
    return requests


@pytest.mark.pin_guard
def test_pin_guard_sglang_answers_the_expanded_prompt_at_the_top_level(sglang):
    """The driver stores `prompt_token_ids` of each answer as the prompt the engine conditioned
    on; SGLang sets it on the answer itself, not in meta_info. A guard of the SGLang pin: it reads
    SGLang's source only, so nothing in relax_hpc can fail it; an upgrade that moves it does."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "srt" / "managers" / "tokenizer_manager.py").read_text()
    assert re.search(r"\bout(?:_dict)?\[\"prompt_token_ids\"\]\s*=", source), (
        "SGLang no longer answers prompt_token_ids"
    )


def test_sglang_scores_input_tokens_as_the_teacher_path_reads_them(sglang):
    """The teacher's scoring request relies on three rules of SGLang's scheduler: max_new_tokens
    0 is a prefill-only request; input_token_logprobs are given for origin_input_ids from
    logprob_start_len on; their first value is None (the last is dropped: it scores the token
    that would be sampled). relax_hpc.rollout.teacher asks from the last prompt token on and
    reads entries 1.. as the completion's; the built-in engine answers by the same rules."""
    root = Path(inspect.getfile(sglang.io)).parent
    batch = (root / "schedule_batch.py").read_text()
    assert re.search(r"return self\.sampling_params\.max_new_tokens == 0", batch), "prefill-only rule changed"
    processor = (root / "scheduler_components" / "logprob_result_processor.py").read_text()
    assert "input_token_logprobs_val = [None] + input_token_logprobs[:-1]" in processor, "first-token None changed"
    assert "req.origin_input_ids[req.logprob_start_len :]" in processor, "input_token_logprobs' tokens changed"
    request = teacher_request()
    assert request.logprob_start_len == [2, 2] and request.sampling_params == {"max_new_tokens": 0}


# -- matching JSON values against SGLang's type hints -------------------------------------------

ARRAYS = (list, set, frozenset, tuple, abc.Sequence, abc.Set)  # what a JSON array may be decoded into
MAPPINGS = (dict, abc.Mapping)


def conforms(value: Any, hint: Any) -> bool:
    """Whether a JSON value (lists, dicts, str, numbers, bool, None) fits the type hint."""
    if isinstance(hint, str):
        return _conforms_source(value, hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or isinstance(hint, typing.TypeVar):
        return True
    if origin is typing.Annotated:
        if any(type(m).__name__ == "Base64Bytes" for m in args[1:]):  # bytes that travel as base64 text
            return _conforms_base64(value, args[0])
        return conforms(value, args[0])
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None) or hint is None:
        return value is None
    if origin in ARRAYS or hint in ARRAYS:
        item = args[0] if args else Any  # tuple[int, ...] too
        return isinstance(value, list) and all(conforms(v, item) for v in value)
    if origin in MAPPINGS or hint in MAPPINGS:
        key, item = args or (Any, Any)
        return isinstance(value, dict) and all(conforms(k, key) and conforms(v, item) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(hint, type) and isinstance(value, hint)


def _conforms_base64(value: Any, hint: Any) -> bool:
    if hint is bytes:
        try:
            return isinstance(value, str) and bool(base64.b64decode(value, validate=True))
        except binascii.Error:
            return False
    if typing.get_origin(hint) in ARRAYS:
        return isinstance(value, list) and all(_conforms_base64(v, typing.get_args(hint)[0]) for v in value)
    return conforms(value, hint)


def _conforms_source(value: Any, annotation: str) -> bool:
    """Where a hint does not resolve: the value's JSON type must be named in the annotation."""
    names = set(re.findall(r"[A-Za-z_]+", annotation))
    if "Any" in names:
        return True
    json_names = {
        bool: {"bool"},
        int: {"int", "float"},
        float: {"float"},
        str: {"str"},
        type(None): {"None", "Optional"},
        list: {"list", "List", "Set", "set", "Sequence", "Tuple", "tuple"},
        dict: {"dict", "Dict", "Mapping"},
    }
    return bool(json_names[type(value)] & names)


def hints(cls: type) -> dict[str, Any]:
    """Field -> resolved type hint, or the annotation's source where it does not resolve."""
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except Exception:  # noqa: BLE001  # any hint that does not resolve (a TYPE_CHECKING-only name, say): read the source
        annotations: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            annotations.update(getattr(klass, "__annotations__", {}))
        return {name: a if isinstance(a, str) else repr(a) for name, a in annotations.items()}


def field_defaults(cls: type) -> dict[str, Any]:
    """SGLang's fields (dataclass or msgspec Struct) -> default, dataclasses.MISSING where required."""
    import msgspec

    if dataclasses.is_dataclass(cls):
        fields = [(f.name, f.default, f.default_factory) for f in dataclasses.fields(cls)]
    else:
        fields = [(f.name, f.default, f.default_factory) for f in msgspec.structs.fields(cls)]
    missing = (dataclasses.MISSING, getattr(msgspec, "NODEFAULT", None))
    return {
        name: default if default not in missing else factory() if factory not in missing else dataclasses.MISSING
        for name, default, factory in fields
    }


# -- the checks ---------------------------------------------------------------------------------


CFG = load_config(None, ["rollout.engine=sglang"])
REQUESTS = sent_requests(CFG)


@pytest.mark.parametrize("request_", REQUESTS, ids=[f"{i}-{type(r).__name__}" for i, r in enumerate(REQUESTS)])
def test_sent_requests_construct_sglangs_classes(sglang, request_):
    name = type(request_).__name__
    theirs = getattr(sglang.io, name, None)
    assert theirs is not None, f"SGLang {PINNED} has no request class {name}"
    body = json.loads(json.dumps(P.to_json(request_)))  # as it travels
    obj = theirs(**body)  # TypeError on a name SGLang does not know, or a field it requires
    their_hints = hints(theirs)
    for key, value in body.items():
        assert conforms(value, their_hints[key]), f"{name}.{key} = {value!r} does not fit SGLang's {their_hints[key]}"
    if name == "GenerateReqInput":
        obj.normalize_batch_and_arguments()  # SGLang's own checks of a batch's per-item lists
        sampling = body.get("sampling_params") or {}
        for params in sampling if isinstance(sampling, list) else [sampling]:
            check_sampling_params(sglang, params)


def test_sglang_reads_the_colocated_bucket_as_the_senders_tensors(sglang):
    """SGLang's own MultiprocessingSerializer (its SafeUnpickler's exact list of globals) opens
    the flattened bucket the colocated sender packs, and its weight updater's steps (the records
    into its FlattenedTensorMetadata, FlattenedTensorBucket.reconstruct_tensors) give the
    sender's tensors, as relax_hpc's engine reads them."""
    common, bucket = import_sglang("sglang.srt.utils.common", "sglang.srt.weight_sync.tensor_bucket")
    payload = colocated_payload(1)[0]
    data = common.MultiprocessingSerializer.deserialize(payload)
    records = [
        bucket.FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel)
        for m in data["metadata"]
    ]
    theirs = bucket.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=records)
    ours = deserialize(payload, "flattened_bucket")
    for named in (theirs.reconstruct_tensors(), ours):
        assert_sent(named)


def test_sglang_deserializes_tensors_shared_where_they_lie(sglang):
    """load_format None (tools/bench/colocated_update.py's in-place variant): a list of pairs."""
    (common,) = import_sglang("sglang.srt.utils.common")
    payload = serialize(COLOCATED_NAMED)[0]
    for named in (common.MultiprocessingSerializer.deserialize(payload), deserialize(payload)):
        assert_sent(named)


def assert_sent(named: list) -> None:
    assert [n for n, _ in named] == [n for n, _ in COLOCATED_NAMED]
    for (_, got), (_, sent) in zip(named, COLOCATED_NAMED, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


def test_sglangs_disk_loader_reads_a_version_folder_as_the_sent_tensors(sglang, tmp_path):
    """/update_weights_from_disk (the file channel): SGLang's DefaultModelLoader takes every
    *.safetensors of a local folder without an index file (filter_duplicate_safetensors_files)
    and iterates their tensors (safetensors_weights_iterator); the bucket files the trainer
    ranks write give exactly the sent tensors."""
    (weights,) = import_sglang("sglang.srt.model_loader.weight_utils")
    names = [n for n, _ in COLOCATED_NAMED]
    for k, (name, tensor) in enumerate(COLOCATED_NAMED):  # one bucket file per dtype, as plan_buckets splits them
        plan = BucketPlan([name], [str(tensor.dtype).removeprefix("torch.")], [list(tensor.shape)])
        write_dense(tmp_path / f"b{k:05d}.safetensors", pack([tensor]), plan)
    files = weights.filter_duplicate_safetensors_files(
        glob.glob(str(tmp_path / "*.safetensors")), str(tmp_path), "model.safetensors.index.json"
    )
    assert_sent(sorted(weights.safetensors_weights_iterator(files), key=lambda nt: names.index(nt[0])))


def test_sglangs_weight_checker_answer_reads_as_the_check_expects(sglang):
    """/weights_checker {action: checksum}: SGLang's answer (its scheduler's ChecksumInfo per rank,
    turned to JSON as its tokenizer manager does) gives the check each tensor's digest; the
    built-in engine's answer has SGLang's wire shape; tensor-parallel shards are not compared.
    (SGLang's GPU hash itself: tests/unit/test_weight_verify.py.)"""
    import msgspec  # SGLang's wire format: installed with it

    checksums = {"model.norm.weight": "0ff038a16fd659f2", "lm_head.weight": "529b391785386001"}
    info = sglang.io.ParallelismInfo(role="target", tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0,
                                     pp_size=1, rank=0, size=1)  # fmt: skip
    rank = sglang.io.ChecksumInfo(checksums=checksums, per_gpu_checksum="x", parallelism_info=[info])
    answer = {"success": True, "message": "Success.", "ranks": [msgspec.to_builtins(rank)], "per_engine_checksum": "y"}
    reported = sglang_answer(json.loads(json.dumps(answer)), "7", "mix64")
    assert reported.digests == checksums and reported.why_not is None and reported.version == "7"
    ours = checker_answer(*engine_digests({"model.norm.weight": torch.ones(3)}), "7")
    for their_rank in ours["ranks"]:
        msgspec.convert(their_rank, sglang.io.ChecksumInfo)  # SGLang's wire classes take the built-in engine's answer
    sharded = json.loads(json.dumps(answer).replace('"tp_size": 1', '"tp_size": 2'))
    assert sglang_answer(sharded, "7", "mix64").why_not == "tensor-parallel shards"


def test_every_request_class_is_sent_above():
    assert {type(r) for r in REQUESTS} == set(CLASSES)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_protocol_fields_are_sglangs_with_its_defaults(sglang, cls):
    theirs = field_defaults(getattr(sglang.io, cls.__name__))
    for f in dataclasses.fields(cls):
        assert f.name in theirs, f"{cls.__name__}.{f.name} is not a field of SGLang's class: {sorted(theirs)}"
        # Required here and defaulted there is fine (relax_hpc always sends it); the reverse would
        # let to_json() leave out a field that SGLang requires.
        if theirs[f.name] is dataclasses.MISSING:
            assert f.default is dataclasses.MISSING, f"{cls.__name__}.{f.name} is required by SGLang"
        elif f.default is not dataclasses.MISSING:
            assert f.default == theirs[f.name], f"{cls.__name__}.{f.name}: {f.default!r} here, {theirs[f.name]!r} there"


def check_sampling_params(sglang, params: dict[str, Any]) -> None:
    signature = inspect.signature(sglang.SamplingParams)
    their_hints = hints(sglang.SamplingParams)
    unknown = set(params) - set(signature.parameters)
    assert not unknown, f"sampling_params {sorted(unknown)} are not SamplingParams arguments"
    for key, value in params.items():
        assert conforms(value, their_hints[key]), f"sampling_params.{key} = {value!r}: SGLang's is {their_hints[key]}"
    sglang.SamplingParams(**params).verify(vocab_size=32)  # SGLang's range checks


def test_sampling_params_the_torch_engine_accepts_are_sglangs(sglang):
    assert set(P.SAMPLING_PARAMS) <= set(inspect.signature(sglang.SamplingParams).parameters)
    check_sampling_params(
        sglang,
        {
            "max_new_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "stop_token_ids": [2],
            "ignore_eos": True,
            "sampling_seed": 3,
        },
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # fail the test instead of exiting
        raise AssertionError(f"launch_server would refuse its arguments: {message}")


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        # Every optional argument, the bf16 dtype, and extra_args of the kind rollout.sglang's docs show
        # (0.5.23 split --cuda-graph-max-bs into -decode and -prefill).
        ["model.dtype=bfloat16", "rollout.sglang.tp_size=4", "rollout.sglang.context_length=8192",
         "rollout.sglang.extra_args=[--attention-backend, fa3, --cuda-graph-max-bs-decode, '256']"],
        ["launch.colocate=true", "rollout.max_staleness=0", "algo.off_policy.routing_replay=true"],
        ["trainer.lora.rank=4", "trainer.lora.target_modules=[q_proj,v_proj,down_proj]"],
        ["model.path=assets/tiny-qwen2.5-vl-motion", "data.path=assets/motion/motion.jsonl",
         "data.media={video: videos}"],
        ["model.path={qwen3_vl_video}", "data.path=assets/motion/motion.jsonl", "data.media={video: videos}"],
    ],
    ids=["defaults", "everything", "colocated", "lora", "video", "qwen3-vl-video"],
)  # fmt: skip
def test_launch_server_arguments_are_server_args(sglang, overrides, tmp_path):
    import msgspec

    from tests.models.qwen3_family import build_qwen3_vl_video

    if any("{qwen3_vl_video}" in o for o in overrides):
        folder = build_qwen3_vl_video(tmp_path / "qwen3-vl")
        overrides = [o.replace("{qwen3_vl_video}", str(folder)) for o in overrides]
    cfg = load_config(None, ["rollout.engine=sglang", "run.seed=7", *overrides])
    device = "cuda:1" if cfg.launch.colocate else None
    argv = server_args(cfg, "0.0.0.0", 30001, "the-run-token", device=device)
    parser = _Parser(prog="launch_server")
    sglang.ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(argv)
    fields = {f.name for f in msgspec.structs.fields(sglang.ServerArgs)}
    their_hints = typing.get_type_hints(sglang.ServerArgs)
    for flag in (a for a in argv if a.startswith("--")):
        dest = parser._option_string_actions[flag].dest
        assert dest in fields, f"{flag} sets {dest}, which is not a ServerArgs field"
        value = getattr(parsed, dest)
        assert conforms(value, their_hints[dest]), f"{flag} gives {value!r}; ServerArgs.{dest} is {their_hints[dest]}"
    sg = cfg.rollout.sglang
    assert (parsed.model_path, parsed.host, parsed.port) == (cfg.model.path, "0.0.0.0", 30001)
    assert (parsed.api_key, parsed.tp_size, parsed.context_length) == ("the-run-token", sg.tp_size, sg.context_length)
    assert parsed.mem_fraction_static == sg.mem_fraction_static
    assert (parsed.dtype, parsed.random_seed, parsed.weight_version) == (cfg.model.dtype, 7, "0")
    assert parsed.enable_memory_saver is cfg.launch.colocate and parsed.base_gpu_id == (1 if device else 0)
    assert parsed.enable_return_routed_experts is cfg.algo.off_policy.routing_replay
    lora = cfg.trainer.lora  # adapter sync: the server reserves the adapters' rank and modules
    served = (True, lora.rank, lora.target_modules) if lora is not None else (None, None, None)
    assert (parsed.enable_lora, parsed.max_lora_rank, parsed.lora_target_modules) == served
    # videos: SGLang's sampling told the model's rate and pixel bounds (the tiny model's 56 x 56); a
    # Qwen3-VL model's rate alone (its bounds are the whole clip's, applied by its own processor)
    video = {"video": {"fps": 2.0, "min_pixels": 3136, "max_pixels": 3136}} if cfg.data.media else None
    if "qwen3-vl" in cfg.model.path:
        video = {"video": {"fps": 2.0}}
    assert parsed.mm_process_config == video


@pytest.mark.pin_guard
def test_pin_guard_sglang_serves_adapters_as_adapter_sync_expects(sglang):
    """relax_hpc.weights.adapters relies on three rules of SGLang's LoRA serving: an unload waits
    until no request uses the adapter; a request naming an adapter loaded before and unloaded
    since loads it again from its folder; loading a name already loaded fails, saying so. A guard
    of the SGLang pin: it reads SGLang's source only, so an upgrade that changes a rule fails it."""
    root = Path(inspect.getfile(sglang.io)).parent
    control = (root / "tokenizer_control_mixin.py").read_text()
    assert "await self.lora_registry.wait_for_unload(lora_id)" in control, "unload no longer waits for requests"
    manager = (root / "tokenizer_manager.py").read_text()
    assert "if lora_path not in self.lora_ref_cache:" in manager and "Reloading evicted adapter" in manager
    lora_manager = (root.parent / "lora" / "lora_manager.py").read_text()
    assert "because it is already loaded" in lora_manager, "the answer to a second load changed"


def test_routes_exist_in_sglang(sglang):
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    package = Path(spec.origin).parent
    source = (package / "srt" / "entrypoints" / "http_server.py").read_text()
    served = set(re.findall(r"@app\.(?:get|post|put|api_route)\(\s*\"([^\"]+)\"", source))
    missing = [r for r in ROUTES if r not in served]
    assert missing == [], f"routes not served by SGLang {PINNED}: {missing}"


def test_the_torch_engine_serves_every_route_of_the_table():
    assert set(_ACTIONS) == set(R.ROUTES.values())


@pytest.mark.parametrize("model", ["tiny-qwen2.5-vl-shapes", "tiny-qwen2-audio-beeps", "tiny-qwen3-addition"])
def test_sglang_serves_the_architecture_of_every_shipped_model(sglang, model):
    """SGLang picks a model class by config.json's `architectures` among its modules' EntryClass."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    served = set()
    for source in (Path(spec.origin).parent / "srt" / "models").glob("*.py"):
        entry = re.search(r"^EntryClass\s*=\s*\[?([^\]\n]+)", source.read_text(), re.MULTILINE)
        if entry:
            served |= {name.strip() for name in entry.group(1).split(",") if name.strip()}
    (architecture,) = json.loads((REPO / "assets" / model / "config.json").read_text())["architectures"]
    assert architecture in served, f"SGLang {PINNED} does not serve {architecture}"
