"""The policy as the rollout engines serve it: batches of generate calls over HTTP.

A batch of calls is split across the engines that hold an eligible policy version (at least
`min_version`), one /generate request each, a group's calls and a session's to one engine
(relax_hpc.rollout.routing). A request whose engine dies
or times out is re-issued to another one; an answer from an older version, or aborted, is
re-issued too, unless partial rollout is on: then an aborted answer (the engines abort what is in
flight when new weights arrive) keeps the tokens it has and continues from them on an engine with
the new weights, with the rest of its token budget; each token keeps the version that sampled it.
With LoRA adapter sync (relax_hpc.weights.adapters) a request names the adapter of its engine's
version (lora_path), and its answer counts as that version, every token of it (vLLM stamps tokens
with the engine's version, which a push moves while the old adapter answers). A vLLM engine
(rollout.engine vllm) is asked through relax_hpc.protocol.vllm.VllmClient, which answers in
SGLang's shape with each token's own version. An engine the trainer found holding other weights
than it pushed (relax_hpc.weights.verify: a marker in RUN_DIR/weights/quarantine) gets no new
request, and what it answers meanwhile is re-issued to another engine.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from relax_hpc.config.schema import MEDIA_KINDS as KINDS
from relax_hpc.data.media import Kind, data_uri
from relax_hpc.data.processor import up_to_media_token
from relax_hpc.envs.base import Sampled
from relax_hpc.envs.context import GenerateCall
from relax_hpc.paths import RunPaths, draining
from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineClient, EngineRequestError, EngineUnavailable
from relax_hpc.protocol.registry import EngineRecord, read_quarantine, read_records
from relax_hpc.protocol.requests import adapter_name
from relax_hpc.protocol.vllm import client_class
from relax_hpc.rollout.routing import Affinity, assign

log = logging.getLogger("relax_hpc.driver")


class Stopping(Exception):
    """The driver was asked to stop while waiting for an engine."""


@dataclass
class Engine:
    record: EngineRecord
    client: EngineClient
    version: int


class EnginePool:
    """The engines that answer, with the policy version each holds (re-read at most every
    `every` seconds of refresh, 0.5 by default). `kind`: rollout.engine (which API they speak);
    `evaluation`: the run's evaluation engines (rollout.eval_engines) instead of its rollout ones."""

    def __init__(self, paths: RunPaths, timeout_s: float, kind: str = "torch", evaluation: bool = False) -> None:
        self.paths = paths
        self.evaluation = evaluation  # the pool of rollout.eval_engines, else the rollout engines
        self.api_key = paths.read_token()
        self.timeout_s = timeout_s
        self.client_class = client_class(kind)
        self.engines: list[Engine] = []
        self._held: dict[str, str] = {}  # engine id -> the process held out of service (quarantine)
        self._last = 0.0

    def refresh(self, force: bool = False, every: float = 0.5) -> None:
        if not force and time.monotonic() - self._last < every:
            return
        self._last = time.monotonic()
        engines = []
        leaving = draining(self.paths)  # elastic engines asked to leave: nothing new for them
        self._held = {m.engine_id: m.instance for m in read_quarantine(self.paths.weights_quarantine).values()}
        for record in read_records(self.paths.engines):
            if record.engine_id in leaving or record.evaluates != self.evaluation or self.held_out(record):
                continue
            client = self.client_class(record.url, self.api_key, self.timeout_s)
            try:
                engines.append(Engine(record, client, int(client.weight_version())))
            except (EngineUnavailable, EngineRequestError, ValueError):
                continue
        self.engines = engines

    def held_out(self, record: EngineRecord) -> bool:
        """The trainer found this engine's weights other than it pushed: out of service (as of
        the last refresh)."""
        return self._held.get(record.engine_id) == record.instance

    def eligible(self, min_version: int) -> list[Engine]:
        return [e for e in self.engines if e.version >= min_version]

    def mark_down(self, engine: Engine) -> None:
        self.engines = [e for e in self.engines if e.record.instance != engine.record.instance]

    def prefix_cache(self) -> dict[str, tuple[float, float]]:
        """Each engine's prefix-cache counters so far, (tokens hit, tokens queried), by instance,
        for the engines that report them (vLLM's)."""
        counters = {}
        for e in self.engines:
            try:
                reported = e.client.prefix_cache()
            except (EngineUnavailable, EngineRequestError):
                continue
            if reported is not None:
                counters[e.record.instance] = reported
        return counters


def hit_rate(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> float | None:
    """The share of prompt tokens the engines found in their prefix caches between two readings
    of EnginePool.prefix_cache (engines in both only); None where nothing was queried."""
    hits = queries = 0.0
    for instance in before.keys() & after.keys():
        hits += after[instance][0] - before[instance][0]
        queries += after[instance][1] - before[instance][1]
    return hits / queries if queries > 0 else None


@dataclass
class _Progress:
    """A call being answered, possibly in segments (partial rollout)."""

    call: GenerateCall
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    segments: int = 0
    finish: str = "stop"
    routed: np.ndarray | None = None  # the last answer's (a continuation's covers everything before)

    @property
    def budget(self) -> int:
        return int(self.call.sampling["max_new_tokens"]) - len(self.tokens)

    def continuation(self) -> GenerateCall:
        """The rest of the call: prompt + tokens so far, the remaining budget, a seed of its own."""
        if not self.tokens:
            return self.call
        seed = int(self.call.sampling.get("sampling_seed", 0))
        digest = hashlib.blake2b(f"{seed}:segment:{self.segments}".encode(), digest_size=8).digest()
        sampling = {
            **self.call.sampling,
            "max_new_tokens": self.budget,
            "sampling_seed": int.from_bytes(digest, "little") >> 2,
        }
        return GenerateCall(self.call.token_ids + self.tokens, sampling, self.call.media, self.call.session)


def token_versions(output: dict) -> list[int]:
    """The policy version of each output token: vLLM's answers give them per token, SGLang's one
    version for the whole answer."""
    meta = output["meta_info"]
    if "token_versions" in meta:
        return [int(v) for v in meta["token_versions"]]
    return [int(meta["weight_version"])] * len(output["output_ids"])


class EnginePolicy:
    """relax_hpc.envs.context.Policy over the run's engines."""

    def __init__(
        self,
        pool: EnginePool,
        decode: Callable[[list[int]], str],
        media_token_ids: Sequence[int] = (),
        partial: bool = False,
        stopping: Callable[[], bool] = lambda: False,
        routing: bool = False,
        adapters: bool = False,
    ) -> None:
        self.pool, self.decode, self.media_token_ids = pool, decode, list(media_token_ids)
        self.partial, self.stopping, self.routing = partial, stopping, routing
        self.adapters = adapters  # trainer.lora.sync adapter: each request names its engine's adapter
        self.min_version = 0  # set by the driver per batch
        self.reissued = 0
        self.continued = 0  # partial rollout: answers continued after an abort
        self.threads = ThreadPoolExecutor(max_workers=16, thread_name_prefix="generate")
        self._load: dict[str, int] = {}  # requests in flight per engine instance
        self.affinity = Affinity()  # which engine holds each episode's session

    def load(self) -> dict[str, int]:
        """Requests in flight per engine id (the driver's heartbeat carries it)."""
        ids = {e.record.instance: e.record.engine_id for e in self.pool.engines}
        return {ids[i]: n for i, n in self._load.items() if i in ids and n}

    def generate(self, calls: Sequence[GenerateCall]) -> list[Sampled]:
        progress = [_Progress(c) for c in calls]
        todo = list(range(len(calls)))
        while todo:
            todo = self._round(progress, todo)
        return [self._sampled(p) for p in progress]

    def _round(self, progress: list[_Progress], todo: list[int]) -> list[int]:
        """Send the unfinished calls, a group's to one engine (relax_hpc.rollout.routing); returns
        those still unfinished (aborted under partial rollout)."""
        engines = sorted(self._wait_for_engines(), key=lambda e: self._load.get(e.record.instance, 0))
        by_instance = {e.record.instance: e for e in engines}
        calls = [progress[i].continuation() for i in todo]
        work = assign(calls, list(by_instance), self.affinity)
        futures = {
            instance: self.threads.submit(self._run_chunk, by_instance[instance], [calls[k] for k in chunk])
            for instance, chunk in work.items()
        }
        unfinished = []
        for instance, chunk in work.items():
            for k, output in zip(chunk, futures[instance].result(), strict=True):
                if not self._absorb(progress[todo[k]], output):
                    unfinished.append(todo[k])
        return sorted(unfinished)

    def _wait_for_engines(self) -> list[Any]:
        wait = 0.1
        while True:
            if self.stopping():
                raise Stopping
            self.pool.refresh()
            engines = self.pool.eligible(self.min_version)
            if engines:
                return engines
            time.sleep(wait)
            wait = min(wait * 2, 2.0)

    def _request(self, calls: Sequence[GenerateCall]) -> P.GenerateReqInput:
        """One /generate batch: each call's ids (one placeholder per media item), its sampling
        params, its media as data URIs, and a request for the expanded prompt ids."""
        media: dict[Kind, list[str | list[str]]] = {kind: [] for kind in KINDS}
        for call in calls:
            for kind in KINDS:
                media[kind].append([data_uri(k, data) for k, data in call.media if k == kind])
        has = {kind: any(media[kind]) for kind in KINDS}
        return P.GenerateReqInput(
            input_ids=[c.token_ids for c in calls],
            sampling_params=[c.sampling for c in calls],
            return_logprob=True,
            image_data=media["image"] if has["image"] else None,
            audio_data=media["audio"] if has["audio"] else None,
            video_data=media["video"] if has["video"] else None,
            return_prompt_token_ids=any(has.values()),
            return_routed_experts=self.routing,
        )

    def _run_chunk(self, engine: Engine, calls: list[GenerateCall]) -> list[dict]:
        """One request on `engine`, re-issued to the least loaded eligible engine until one answers
        it; that one holds the calls' sessions from then on."""
        request = self._request(calls)
        while (outputs := self._ask(engine, request, len(calls))) is None:
            self.reissued += len(calls)
            engine = min(self._wait_for_engines(), key=lambda e: self._load.get(e.record.instance, 0))
        self.affinity.hold([c.session for c in calls], engine.record.instance)
        return outputs

    def _ask(self, engine: Engine, request: P.GenerateReqInput, count: int) -> list[dict] | None:
        """The engine's answers to `request`, or None where they must be asked elsewhere (the
        engine failed, is out of service, or answered from an older version or, without partial
        rollout, aborted)."""
        self._load[engine.record.instance] = self._load.get(engine.record.instance, 0) + 1
        if self.adapters:
            request.lora_path = adapter_name(engine.version)
        try:
            outputs: list[dict] = engine.client.generate(request)
        except EngineUnavailable as e:
            log.warning("engine %s failed (%s); re-issuing %d prompts", engine.record.engine_id, e, count)
            self.pool.mark_down(engine)
            return None
        finally:
            self._load[engine.record.instance] -= 1
        self.pool.refresh()
        if self.pool.held_out(engine.record):  # sampled with weights other than the trainer's
            log.warning("engine %s is out of service (its weights differ); re-issuing", engine.record.engine_id)
            self.pool.mark_down(engine)
            return None
        if self.adapters:  # the answer is the named adapter's, whatever the engine loaded since
            for o in outputs:  # (vLLM's per-token versions follow the base weights' version)
                o["meta_info"]["weight_version"] = str(engine.version)
                o["meta_info"].pop("token_versions", None)
        old = any(v < self.min_version for o in outputs for v in token_versions(o))
        aborted = any(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outputs)
        if not old and (self.partial or not aborted):
            return outputs
        log.warning("engine %s answered from an older version or aborted; re-issuing", engine.record.engine_id)
        return None

    def _absorb(self, p: _Progress, output: dict) -> bool:
        """Add an answer's tokens to the call; False if the call must continue (aborted)."""
        meta = output["meta_info"]
        ids: list[int] = output["output_ids"]
        logprobs = [lp for lp, _, _ in meta.get("output_token_logprobs", [])]
        if p.prompt_ids is None and output.get("prompt_token_ids"):
            p.prompt_ids = output["prompt_token_ids"]
        if "routed_experts" in meta:  # int32 [positions, layers, top_k], flattened per position
            positions = len(p.call.token_ids) + len(p.tokens) + len(ids) - 1
            choices = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
            p.routed = choices.reshape(positions, -1)
        p.tokens += ids
        p.logprobs += logprobs[: len(ids)]
        p.versions += token_versions(output)
        p.segments += 1
        aborted = meta["finish_reason"]["type"] == "abort"
        if aborted and p.budget > 0:
            self.continued += 1
            return False
        p.finish = "length" if aborted or meta["finish_reason"]["type"] == "length" else "stop"
        return True

    def _sampled(self, p: _Progress) -> Sampled:
        finish: Literal["stop", "length"] = "stop" if p.finish == "stop" else "length"
        keep = up_to_media_token(p.tokens, self.media_token_ids) if self.media_token_ids else len(p.tokens)
        tokens = p.tokens[:keep]
        if keep < len(p.tokens):
            finish = "stop"
        routed = p.routed[: len(p.call.token_ids) + keep - 1] if p.routed is not None else None
        return Sampled(tokens, p.logprobs[:keep], p.versions[:keep], finish, self.decode(tokens), p.prompt_ids, routed)
