"""Weights verified inside a run (weights.verify_every): after a push, every engine that took the
version reports a digest of each tensor it holds, computed from its live parameters by its own
checker, and the trainer's rank 0 compares them with its own digests of what it pushed, in the
engine's layout and with the engine's hash (`KINDS`, one entry per rollout.engine):

- the built-in engine and SGLang answer SGLang's POST /weights_checker {action: checksum}: per
  rank, a digest of each tensor under the engine's own names. SGLang's names fuse q/k/v into
  qkv_proj and gate/up into gate_up_proj and pad the embedding's rows to a multiple of 64
  (FusedView), and its digest of a weight on a GPU is its triton hash (`mix64`,
  relax_hpc.weights.digests, computed here with torch: the same function on any device). The
  built-in engine's names are the pushed ones, its digest mix64 on a GPU and mh64 (a multilinear
  hash at memory speed) in host memory; its answer says which, and the version it read them at.
- vLLM answers POST /weight_checker (VllmTransfer.checksums): the sha256 of each tensor's bytes,
  named as SGLang's and prefixed by its worker's place (dp0:pp0:pcp0:tp0:). Its CPU build
  prepacks some linear layers for oneDNN and keeps no raw weight (the digest of nothing): those
  are compared through what they compute instead (`Probe`): the engine scores a fixed sequence
  of tokens, and rank 0 scores it with a model made of the tensors it pushed; their
  log-probabilities must agree within the pushed dtype's tolerance (PROBE_ATOL).

The check is written once, above the weight channels (relax_hpc.weights.channel): the trainer
hands its channel a tapped parameter stream (WeightCheck.params) that digests each tensor before
the channel takes it, and once the push returned, asks every engine of the registry in parallel
(WeightCheck.pushed). The engines at the pushed version are compared; what one holds that cannot
be compared (tensor-parallel shards, prepacked layers, adapters in an engine's LoRA memory, a hash
made on another kind of device) is said in the verdict, never counted as a match or a mismatch.
For LoRA adapter sync, the built-in engine reports the tensors of the adapter of its version.

An engine whose digest differs for any tensor is taken out of service: an error event in
RUN_DIR/metrics/events.jsonl (weights_mismatch), a marker naming its process
(relax_hpc.protocol.registry.write_quarantine) that the driver honours (no new requests, and an
answer that comes back from it is re-issued elsewhere), and the engine told to report version -1
(what it has in flight aborted; no catch-up copies from it; every channel's check of the
engines' versions finds it needs the current one). Every push is then checked until one
matches that engine whole, which lifts the marker (weights_recovered); a restarted engine is a
new process, which the marker does not name.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from relax_hpc.protocol import requests as P
from relax_hpc.protocol import routes as R
from relax_hpc.protocol import vllm as V
from relax_hpc.protocol.client import EngineClient, EngineRequestError, EngineUnavailable
from relax_hpc.protocol.registry import (
    EngineRecord,
    Quarantine,
    lift_quarantine,
    read_quarantine,
    read_records,
    write_quarantine,
)
from relax_hpc.weights.digests import Hash, digest
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.vllm_channel import GlooTransport, VllmTransfer

log = logging.getLogger("relax_hpc.weights")

RETRY_S = 5.0  # while an engine is out of service, the longest time without a push
Named = tuple[str, torch.Tensor | None]
FullParameters = Callable[[], Iterable[Named]]

# -- the engines' layouts ----------------------------------------------------------------------------

_FUSED = {
    "q_proj": ("qkv_proj", 0, 3), "k_proj": ("qkv_proj", 1, 3), "v_proj": ("qkv_proj", 2, 3),
    "gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2),
}  # fmt: skip
_PADDED = ("embed_tokens.weight", "lm_head.weight")
VOCAB_PADDING = 64  # SGLang's and vLLM's DEFAULT_VOCAB_PADDING_SIZE


class View(Protocol):
    """The trainer's tensors (engine layout: HF names, the pushed dtype) as an engine's checker
    names and lays them out: called per tensor in push order, returns the engine tensors it
    completes, each as its parts laid end to end."""

    def __call__(self, name: str, tensor: torch.Tensor) -> list[tuple[str, list[torch.Tensor]]]: ...


def same_view(name: str, tensor: torch.Tensor) -> list[tuple[str, list[torch.Tensor]]]:
    """The built-in engine holds what was pushed, under the pushed names."""
    return [(name, [tensor])]


class FusedView:
    """SGLang's and vLLM's layout: q/k/v stacked along dim 0 as qkv_proj, gate/up as gate_up_proj
    (their load_weights' stacked_params_mapping), the embedding's and output layer's rows padded
    with zeros to a multiple of 64. A part that completes no fused tensor yet is kept (a copy: the
    trainer's tensor may be reused once the channel took it)."""

    def __init__(self) -> None:
        self.parts: dict[str, dict[int, torch.Tensor]] = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> list[tuple[str, list[torch.Tensor]]]:
        pieces = name.split(".")
        if len(pieces) >= 2 and pieces[-2] in _FUSED:
            fused, index, count = _FUSED[pieces[-2]]
            key = ".".join([*pieces[:-2], fused, pieces[-1]])
            parts = self.parts.setdefault(key, {})
            if len(parts) + 1 < count:
                parts[index] = tensor.detach().clone()
                return []
            parts[index] = tensor
            del self.parts[key]
            return [(key, [parts[i] for i in range(count)])] if sorted(parts) == list(range(count)) else []
        if name.endswith(_PADDED) and tensor.dim() == 2:
            pad = -tensor.shape[0] % VOCAB_PADDING
            return [(name, [tensor, tensor.new_zeros(pad, tensor.shape[1])] if pad else [tensor])]
        return [(name, [tensor])]


# -- what an engine reports ----------------------------------------------------------------------------


@dataclass
class Reported:
    """An engine's answer: its weight version, each comparable tensor's digest by the trainer's
    name for it, the tensors whose digest says nothing (prepacked: no raw weight), and why nothing
    at all is comparable (None: the digests are)."""

    version: str
    digests: dict[str, str] = field(default_factory=dict)
    unchecked: set[str] = field(default_factory=set)
    why_not: str | None = None


def sglang_answer(answer: dict[str, Any], version: str, how: Hash) -> Reported:
    """SGLang's /weights_checker answer (and the built-in engine's, which says its hash): every
    rank's checksums (tensor parallelism: shards, which are not compared)."""
    ranks = answer.get("ranks") or []
    held = answer.get("hash", "mix64")  # SGLang's weights are on GPUs
    if held != how:
        return Reported(version, why_not=f"the engine hashes with {held}, the trainer with {how} (another device)")
    infos = [info for rank in ranks for info in rank.get("parallelism_info") or []]
    if any(int(info.get("tp_size", 1)) > 1 for info in infos):
        return Reported(version, why_not="tensor-parallel shards")
    digests: dict[str, str] = {}
    for rank in ranks:
        digests.update(rank["checksums"])
    return Reported(version, digests)


EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # vLLM's digest of a prepacked layer's raw weight
_VLLM_PLACE = re.compile(r"^dp\d+:pp\d+:pcp\d+:tp(\d+):")


def vllm_answer(checksums: dict[str, str], version: str) -> Reported:
    """vLLM's /weight_checker checksums: the place prefix dropped, LoRA's base_layer too."""
    reported = Reported(version)
    for key, value in checksums.items():
        place = _VLLM_PLACE.match(key)
        if place is not None and int(place.group(1)) > 0:
            return Reported(version, why_not="tensor-parallel shards")
        name = key[place.end() :] if place else key
        name = name.replace(".base_layer.", ".")  # vLLM with LoRA enabled wraps every linear layer
        if value == EMPTY_SHA256:
            reported.unchecked.add(name)
        else:
            reported.digests[name] = value
    return reported


def ask_sglang(record: EngineRecord, api_key: str, timeout_s: float, how: Hash) -> Reported:
    """SGLang's route; the built-in engine's answer says the version its digests were read at,
    SGLang's is asked after the digests (the trainer, which asks, is the only one to push)."""
    client = EngineClient(record.url, api_key, timeout_s)
    answer = client.post(R.WEIGHTS_CHECKER.path, P.CheckWeightsReqInput())
    version = answer["weight_version"] if "weight_version" in answer else client.weight_version()
    return sglang_answer(answer, str(version), how)


def score_vllm(record: EngineRecord, api_key: str, timeout_s: float, ids: list[int]) -> list[float]:
    """vLLM's log-probability of each token of `ids` after the first (prompt_logprobs)."""
    answer = EngineClient(record.url, api_key, timeout_s).call(
        "POST", V.GENERATE, V.generate_body(V.scoring_request("probe", ids))
    )
    return [entry[0] for entry in V.scored_answer(answer, ids, 0)["meta_info"]["input_token_logprobs"][1:]]


def ask_vllm(record: EngineRecord, api_key: str, timeout_s: float, how: Hash) -> Reported:
    version = str(V.VllmClient(record.url, api_key, timeout_s).weight_version())
    # VllmTransfer wraps the route; its transport is never opened for a checksum.
    transfer = VllmTransfer([record.url], api_key, GlooTransport("127.0.0.1", 0, timeout_s), 1, timeout_s)
    try:
        return vllm_answer(transfer.checksums()[0], version)
    finally:
        transfer.close()


HELD_VERSION = "-1"  # what an engine out of service reports: no version the trainer pushed


def relabel_sglang(record: EngineRecord, api_key: str, timeout_s: float) -> None:
    """SGLang's /update_weight_version, aborting what the engine has in flight."""
    EngineClient(record.url, api_key, timeout_s).post(
        R.UPDATE_WEIGHT_VERSION.path, P.UpdateWeightVersionReqInput(HELD_VERSION, abort_all_requests=True)
    )


def relabel_vllm(record: EngineRecord, api_key: str, timeout_s: float) -> None:
    EngineClient(record.url, api_key, timeout_s).call("POST", V.UPDATE_WEIGHT_VERSION, {"new_version": HELD_VERSION})


@dataclass(frozen=True)
class Kind:
    """How one engine kind is checked: its layout (a new View per push), its hash (None: the
    trainer's device decides, as the built-in engine's does), how it is asked, and how it is made
    to report HELD_VERSION."""

    view: Callable[[], View]
    hash: Hash | None
    ask: Callable[[EngineRecord, str, float, Hash], Reported]
    relabel: Callable[[EngineRecord, str, float], None]
    score: Callable[[EngineRecord, str, float, list[int]], list[float]] | None = None  # for tensors it cannot digest


KINDS: dict[str, Kind] = {
    "torch": Kind(lambda: same_view, None, ask_sglang, relabel_sglang),
    "sglang": Kind(FusedView, "mix64", ask_sglang, relabel_sglang),
    "vllm": Kind(FusedView, "sha256", ask_vllm, relabel_vllm, score_vllm),
}


# -- what the digests cannot see: the log-probabilities of a probe ---------------------------------------

PROBE_TOKENS = 8  # 7 positions, each of which every layer computes: enough to see a stale one
PROBE_ATOL = {torch.float32: 1e-3, torch.float64: 1e-3}  # fp32 on both sides agreed within 1e-5 here
PROBE_ATOL_HALF = 0.1  # bf16/fp16: the engine computes in them, rank 0 in fp32 from the same bits
PROBED = "log-probabilities (layers without a digest)"  # the name a differing probe is listed under


class Probe:
    """Rank 0's scoring of a fixed token sequence with a model of the pushed tensors (the engine
    layout: HF names), copied into it while the stream is digested. Used only for an engine kind
    that scores (`Kind.score`) and only with the trainer on the CPU: there vLLM's build prepacks
    layers; on GPUs it keeps every raw weight, and a copy of the model would cost memory that the
    digests do not. The model is made once (fp32) and refilled at each checked push."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.model: torch.nn.Module | None = None
        self.params: dict[str, torch.Tensor] = {}
        self.filled: set[str] = set()
        self.dtypes: set[torch.dtype] = set()
        self.ids: list[int] = []
        self._answer: torch.Tensor | None = None

    def begin(self) -> None:
        """A checked push's stream starts."""
        if self.model is None:
            from transformers import AutoConfig, AutoModelForCausalLM  # only where a probe is made

            config = AutoConfig.from_pretrained(self.model_path)
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            self.params = dict(self.model.named_parameters())  # a tied output layer is listed once
            self.ids = torch.randint(
                config.vocab_size, (PROBE_TOKENS,), generator=torch.Generator().manual_seed(0)
            ).tolist()
        self.filled, self.dtypes, self._answer = set(), set(), None

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.params:
            with torch.no_grad():
                self.params[name].copy_(tensor)
            self.filled.add(name)
            self.dtypes.add(tensor.dtype)

    def tolerance(self) -> float:
        return max((PROBE_ATOL.get(d, PROBE_ATOL_HALF) for d in self.dtypes), default=PROBE_ATOL_HALF)

    def answer(self) -> tuple[list[int], torch.Tensor]:
        """(the probe's tokens, rank 0's log-probability of each after the first), once per push;
        ValueError where the push did not fill the model."""
        if self._answer is None:
            assert self.model is not None
            if set(self.params) - self.filled:
                raise ValueError(f"the push lacks {sorted(set(self.params) - self.filled)[:3]} of the model")
            with torch.no_grad():
                logp = torch.log_softmax(self.model(torch.tensor([self.ids])).logits[0, :-1].float(), dim=-1)
            self._answer = logp.gather(-1, torch.tensor(self.ids[1:])[:, None]).squeeze(-1)
        return self.ids, self._answer


# -- the comparison --------------------------------------------------------------------------------


@dataclass
class Verdict:
    """One engine against the trainer's digests of a version: the tensors compared, those that
    differ, the pushed ones it reports nothing comparable for, or why it was not compared."""

    engine: str
    instance: str
    version: str
    checked: int = 0
    differ: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    skipped: str | None = None
    probe_gap: float | None = None  # the largest log-probability difference of the probe, where scored

    @property
    def matches(self) -> bool:
        return self.skipped is None and self.checked > 0 and not self.differ


def compare(record: EngineRecord, expected: Mapping[str, str], reported: Reported, version: str) -> Verdict:
    verdict = Verdict(record.engine_id, record.instance, reported.version)
    if reported.version != version:
        verdict.skipped = f"holds version {reported.version}, not {version}"
    elif reported.why_not is not None:
        verdict.skipped = reported.why_not
    else:
        for name, want in expected.items():
            got = reported.digests.get(name)
            if got is None:
                verdict.not_checked.append(name)
            else:
                verdict.checked += 1
                if got != want:
                    verdict.differ.append(name)
    return verdict


def probed(verdicts: list[Verdict]) -> str:
    """The log line's note of the probe: the largest log-probability gap, where one was scored."""
    gaps = [v.probe_gap for v in verdicts if v.probe_gap is not None]
    return f" but through the probe's log-probabilities (largest gap {max(gaps):.2e})" if gaps else ""


# -- the trainer's side ----------------------------------------------------------------------------


class WeightCheck:
    """Rank 0's check of every `every`-th push (weights.verify_every), and of every push while an
    engine is out of service. `layout`: the channel's (None: the pushed tensors are the engines');
    `device`: where the trainer's tensors are (the built-in engine's hash follows it)."""

    def __init__(
        self,
        kind: str,
        every: int,
        registry: Path,
        quarantine: Path,
        events: Callable[[dict[str, Any]], None],
        api_key: str,
        timeout_s: float,
        layout: EngineLayout | None,
        device: torch.device,
        model_path: str | None = None,
    ) -> None:
        self.kind, self.every = KINDS[kind], every
        # `model_path`: the HF config a Probe's model is made from (None: no probe; adapter sync).
        scores = self.kind.score is not None and device.type == "cpu" and model_path is not None
        self.probe = Probe(model_path) if scores and model_path is not None else None
        self.registry, self.quarantine, self._event = registry, quarantine, events
        self.api_key, self.timeout_s, self.layout = api_key, timeout_s, layout
        self.hash: Hash = self.kind.hash or ("mix64" if device.type == "cuda" else "mh64")
        self.expected: dict[str, str] = {}
        self.tapped = False  # the last params() stream was digested
        self.countdown = 0  # pushes until the next due one (0: the next)
        self.digest_s = 0.0  # the last tapped push's digest time
        self.last_push = time.monotonic()  # when a push last reached engines
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="weights-check")

    def due(self) -> bool:
        return self.countdown <= 0 or bool(read_quarantine(self.quarantine))

    def wants_push(self) -> bool:
        """An engine is out of service and no push reached the engines for RETRY_S: push the
        current version again (a run whose every engine is out of service samples nothing, so
        trains nothing, so would push nothing)."""
        return time.monotonic() - self.last_push > RETRY_S and bool(read_quarantine(self.quarantine))

    def params(self, full_parameters: FullParameters) -> FullParameters:
        """The stream to push: when a check is due, each tensor is digested (in the engines'
        layout) before the channel takes it."""
        self.tapped = self.due()
        return self._tap(full_parameters) if self.tapped else full_parameters

    def _tap(self, full_parameters: FullParameters) -> FullParameters:
        def stream() -> Iterator[Named]:
            self.expected, self.digest_s = {}, 0.0
            view = self.kind.view()
            if self.probe is not None:
                self.probe.begin()
            for name, tensor in full_parameters():
                if tensor is not None:
                    start = time.perf_counter()
                    pairs = [(name, tensor)] if self.layout is None else self.layout.tensors([(name, tensor)])
                    for engine_name, engine_tensor in pairs:
                        assert engine_tensor is not None
                        if self.probe is not None:
                            self.probe.keep(engine_name, engine_tensor)
                        for held, parts in view(engine_name, engine_tensor):
                            self.expected[held] = digest(parts, self.hash)
                    self.digest_s += time.perf_counter() - start
                yield name, tensor

        return stream

    def pushed(self, version: int) -> list[Verdict]:
        """After a push that reached engines: check it if its stream was digested."""
        self.last_push = time.monotonic()
        if not self.tapped:
            self.countdown -= 1
            return []
        self.tapped, self.countdown = False, self.every - 1
        return self.verify(version)

    def ask(self, record: EngineRecord) -> Reported | str:
        try:
            return self.kind.ask(record, self.api_key, self.timeout_s, self.hash)
        except (EngineUnavailable, EngineRequestError, KeyError, TypeError, ValueError) as e:
            return f"no answer ({e})"

    def verify(self, version: int) -> list[Verdict]:
        """Ask every registered engine for its digests, compare those at `version`, and take out
        of service (or back into it) the engines the comparison says."""
        start = time.perf_counter()
        records = read_records(self.registry)
        answers = list(self._pool.map(self.ask, records))
        verdicts = []
        for record, answer in zip(records, answers, strict=True):
            if isinstance(answer, str):
                verdicts.append(Verdict(record.engine_id, record.instance, "", skipped=answer))
            else:
                verdict = compare(record, self.expected, answer, str(version))
                if verdict.skipped is None and answer.unchecked:
                    self._compare_probe(record, verdict)
                verdicts.append(verdict)
        self._act(verdicts, records, version)
        seconds = time.perf_counter() - start
        compared = [v for v in verdicts if v.skipped is None]
        log.info(
            "weights v%d verified on %d engine(s): %d differ; %d tensors compared, %d not checked%s "
            "(digests %.3f s, engines %.3f s)",
            version, len(compared), sum(1 for v in compared if v.differ), max((v.checked for v in compared), default=0),
            max((len(v.not_checked) for v in compared), default=0), probed(compared), self.digest_s, seconds,
        )  # fmt: skip
        for v in verdicts:
            if v.skipped is not None:
                log.info("weights v%d: engine %s not compared: %s", version, v.engine, v.skipped)
        return verdicts

    def _compare_probe(self, record: EngineRecord, verdict: Verdict) -> None:
        """The tensors the engine gave no digest of, through the probe's log-probabilities: a gap
        above the tolerance counts as one differing entry (PROBED)."""
        if self.probe is None or self.kind.score is None:
            return
        try:
            ids, mine = self.probe.answer()
            theirs = torch.tensor(self.kind.score(record, self.api_key, self.timeout_s, ids))
        except (EngineUnavailable, EngineRequestError, KeyError, TypeError, ValueError) as e:
            log.info("engine %s: the probe was not scored (%s)", record.engine_id, e)
            return
        verdict.probe_gap = float((theirs - mine).abs().max())
        verdict.checked += 1
        if verdict.probe_gap > self.probe.tolerance():
            verdict.differ.append(PROBED)

    def _act(self, verdicts: list[Verdict], records: list[EngineRecord], version: int) -> None:
        held_out = read_quarantine(self.quarantine)
        live = {r.engine_id: r.instance for r in records}
        for engine, marker in held_out.items():
            if live.get(engine) != marker.instance:  # restarted or gone: a new process is not held out
                lift_quarantine(self.quarantine, engine)
                self._event({"event": "weights_recovered", "engine": engine, "version": version, "why": "restarted"})
        for v in verdicts:
            was = held_out.get(v.engine)
            since = was.since if was is not None and was.instance == v.instance else None
            if v.differ:
                log.error(
                    "engine %s holds other weights than the trainer pushed as v%d: %d of %d tensors differ (%s); "
                    "it takes no requests until a push matches",
                    v.engine, version, len(v.differ), v.checked, ", ".join(v.differ[:3]),
                )  # fmt: skip
                held = Quarantine(v.engine, v.instance, str(version), v.differ[:5], len(v.differ), v.checked,
                                  since or time.time())  # fmt: skip
                write_quarantine(self.quarantine, held)
                self._relabel(next(r for r in records if r.instance == v.instance))
                if since is None:  # one event per time out of service; the marker follows each check
                    self._event(
                        {"event": "weights_mismatch", "level": "error", "engine": v.engine, "instance": v.instance,
                         "version": version, "differ": len(v.differ), "checked": v.checked, "tensors": v.differ[:5],
                         "not_checked": len(v.not_checked)}
                    )  # fmt: skip
            elif since is not None and v.matches:
                lift_quarantine(self.quarantine, v.engine)
                log.info("engine %s matches the trainer's weights again at v%d: back in service", v.engine, version)
                self._event({"event": "weights_recovered", "engine": v.engine, "version": version, "why": "matched"})

    def _relabel(self, record: EngineRecord) -> None:
        """The engine reports HELD_VERSION (and drops what it has in flight), best effort: no
        version the driver samples from or a catch-up copies, and one every channel's check of
        the engines' versions sees as needing the current one (a file channel then serves it the
        whole version, where a delta would patch its wrong base)."""
        try:
            self.kind.relabel(record, self.api_key, self.timeout_s)
        except (EngineUnavailable, EngineRequestError) as e:
            log.warning("engine %s did not take version %s: %s", record.engine_id, HELD_VERSION, e)
