"""The built-in rollout engine: an HF transformers model behind SGLang's native HTTP protocol.

    python -m relax_hpc.engines.torch_engine --run-dir RUN_DIR --engine-id engine-0 --port 0

Requests queue up; a scheduler thread takes everything queued and samples it as one batch
(relax_hpc.engines.sampling), so concurrent /generate calls share forward passes. Weight updates
take the model lock, so they land between batches: every completion comes from one policy
version, which its meta_info reports as `weight_version`.

LoRA adapters (trainer.lora.sync adapter) as SGLang serves them: /load_lora_adapter reads a PEFT
folder, a request's `lora_path` names the adapter it is sampled with (a request holds the adapter's
tensors from its arrival, so /unload_lora_adapter never takes it from a queued request), and a
request naming an adapter unloaded since loads it again from its folder. A batch holds requests
of one adapter, which is merged onto the base weights (AdapterMerger.apply) before it is sampled.
"""

from __future__ import annotations

import argparse
import base64
import errno
import functools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections import ChainMap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from transformers import AutoTokenizer

from relax_hpc import fence
from relax_hpc.data.media import Kind, MediaError, MediaRef
from relax_hpc.data.processor import Processed, ProcessorError, media_processor
from relax_hpc.engines.sampling import Completion, SamplingSpec, input_logprobs, sample
from relax_hpc.engines.torch_weights import EngineBusy, EngineWeights
from relax_hpc.metrics.jsonl import JsonlWriter
from relax_hpc.metrics.startup import StartupClock
from relax_hpc.models.hf import EngineParameters, load_policy, torch_dtype
from relax_hpc.paths import RunPaths
from relax_hpc.protocol import requests as P
from relax_hpc.protocol import routes as R
from relax_hpc.protocol.registry import EngineRecord, remove_record, write_record
from relax_hpc.weights.catchup import SNAPSHOT, SnapshotReq
from relax_hpc.weights.group import SideGroup
from relax_hpc.weights.lora import AdapterMerger
from relax_hpc.weights.receiver import BucketReceiver

log = logging.getLogger("relax_hpc.engine")


@dataclass
class _Job:
    prompts: list[list[int]]  # placeholders expanded for the prompt's media
    specs: list[SamplingSpec]
    seeds: list[int | None]
    rids: list[str]
    return_logprob: list[bool]
    inputs: list[dict[str, torch.Tensor]]  # each prompt's processor tensors (empty without media)
    return_prompt_ids: bool = False
    routed_from: int | None = None  # return_routed_experts: from this position (routed_experts_start_len)
    input_from: list[int] = field(default_factory=list)  # logprob_start_len per prompt, -1: none
    inputs_scored: list[list[float | None]] = field(default_factory=list)  # input_token_logprobs per prompt
    done: threading.Event = field(default_factory=threading.Event)
    completions: list[Completion] | None = None
    version: str = ""  # weight_version that produced the completions
    adapter: dict[str, torch.Tensor] | None = None  # the tensors of the lora_path it names (None: the base)
    aborted: bool = False


def _spec(params: dict[str, Any]) -> tuple[SamplingSpec, int | None]:
    try:
        return SamplingSpec.from_params(params)
    except ValueError as e:
        raise P.ProtocolError(str(e)) from None


def _row_aborted(rows: list[tuple[_Job, int]], row: int) -> bool:
    return rows[row][0].aborted


def _media_of(req: P.GenerateReqInput, batched: bool, n: int) -> list[list[tuple[Kind, bytes]]]:
    """Each prompt's media items, read as SGLang 0.5.23 normalises /generate's fields: for one
    prompt an item or a list; for a batch one entry (item or list) per prompt, or one item that
    every prompt shares."""
    out: list[list[tuple[Kind, bytes]]] = [[] for _ in range(n)]
    kinds: tuple[tuple[Kind, P.MediaData | None], ...] = (
        ("image", req.image_data), ("audio", req.audio_data), ("video", req.video_data)
    )  # fmt: skip
    for kind, value in kinds:
        if value is None or value == []:
            continue
        if not batched:
            entries: list[Any] = [value]
        elif isinstance(value, str):
            entries = [value] * n
        elif len(value) != n:
            raise P.ProtocolError(f"{kind}_data has {len(value)} entries for {n} prompts")
        else:
            entries = value
        for i, entry in enumerate(entries):
            for item in [entry] if isinstance(entry, str) else entry:
                if item.startswith(("http://", "https://")):
                    raise P.ProtocolError(
                        f"{kind}_data: the built-in engine reads data: URIs and local paths, not URLs"
                    )
                try:
                    out[i].append((kind, MediaRef(kind, item).read()))
                except MediaError as e:
                    raise P.ProtocolError(f"{kind}_data of prompt {i}: {e}") from None
    return out


class TorchEngine(EngineWeights):
    """The request queue and the model; the weights' routes are EngineWeights'."""

    def __init__(self, model_path: str, dtype: str, device: str = "cpu", weights_timeout_s: float = 60.0) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.device = torch.device(device)
        model = load_policy(model_path, torch_dtype(dtype))
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers types .to() as taking a model
        # The model folder's processor expands media placeholders, as SGLang's does.
        self.processor = media_processor(model_path)
        # Module names, and the checkpoint's names that the megatron backend sends (a VL model's differ).
        self.params = EngineParameters(self.model)
        self.model_path = model_path
        self.weight_version = "0"
        # Catch-up (relax_hpc.weights.catchup): every write into the weights advances the epoch,
        # and `whole` says the weights are all of weight_version (not mid-update, not abandoned
        # half-way); both change under the model lock.
        self.weights_epoch = 0
        self.whole = True
        self.updating = False  # between /begin_weight_update and /end_weight_update
        self.released: dict[str, tuple[torch.Size, torch.dtype]] = {}  # weights freed for the trainer
        self.groups: dict[str, SideGroup] = {}
        self.weights_timeout_s = weights_timeout_s  # of a weight-update group's collectives
        # Called once the weight version changed (serve() rewrites the engine's registry record).
        self.on_weights: Callable[[], object] = lambda: None
        # LoRA runs (trainer.lora) send adapters, received beside the parameters and then merged.
        self.lora = AdapterMerger(self.params, self.device)
        # What a pushed bucket writes into (ChainMap writes its first map only: the parameters are
        # read, never replaced), through a receiver per weight-update group.
        self.update_targets = ChainMap(self.lora.adapter, self.params)  # type: ignore[arg-type]
        self.receivers: dict[str, BucketReceiver] = {}
        # Adapter sync: the folder of every adapter loaded so far (a request naming one unloaded
        # since loads it again, SGLang's rule), the loaded ones, the one merged into the weights.
        self.adapter_folders: dict[str, Path] = {}
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.serving: dict[str, torch.Tensor] | None = None
        self.model_lock = threading.Lock()
        self.queue = threading.Condition()
        self.pending: list[_Job] = []
        self._paused = False
        self.running: list[_Job] = []  # the batch being sampled (an abort stops it mid-way)
        self.sampled: Callable[[], None] = lambda: None  # after each batch (serve: the start-up record)
        threading.Thread(target=self._schedule_loop, name="scheduler", daemon=True).start()

    # -- generation -----------------------------------------------------------------------------

    def generate(self, req: P.GenerateReqInput) -> list[dict[str, Any]] | dict[str, Any]:
        if self.released:  # colocated: the trainer has the device; ask again after the push
            raise EngineBusy("the engine's weights are released while the trainer trains")
        batched = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        # The first item tells the union apart, which mypy cannot follow into a list's items.
        prompts = cast(list[list[int]], req.input_ids) if batched else [cast(list[int], req.input_ids)]
        n = len(prompts)
        if n == 0 or any(len(p) == 0 for p in prompts):
            raise P.ProtocolError("input_ids: every prompt needs at least one token")

        def per_item(value: Any, default: Any) -> list[Any]:
            if isinstance(value, list):
                if len(value) != n:
                    raise P.ProtocolError(f"a per-item list has {len(value)} entries for {n} prompts")
                return value
            return [default if value is None else value] * n

        params = per_item(req.sampling_params, {})
        specs, seeds = zip(*(_spec(p) for p in params), strict=True)
        rids = per_item(req.rid, None)
        rids = [r if r is not None else uuid.uuid4().hex for r in rids]
        prompts, inputs = self._expand(prompts, _media_of(req, batched, n))
        logprob = [bool(x) for x in per_item(req.return_logprob, False)]
        routed_from = req.routed_experts_start_len if req.return_routed_experts else None
        job = _Job(prompts, list(specs), list(seeds), rids, logprob, inputs, req.return_prompt_token_ids, routed_from)
        job.input_from = self._input_from(job, per_item(req.logprob_start_len, -1))
        with self.queue:
            job.adapter = None if req.lora_path is None else self._adapter(req.lora_path)
            self.pending.append(job)
            self.queue.notify()
        job.done.wait()
        outputs = [self._output(job, i) for i in range(n)]
        return outputs if batched else outputs[0]

    @staticmethod
    def _input_from(job: _Job, starts: list[int | None]) -> list[int]:
        """Each prompt's logprob_start_len, -1 where no input log-probabilities are asked (SGLang
        ignores it without return_logprob and refuses one past the prompt)."""
        out = []
        for i, asked in enumerate(starts):
            start = -1 if asked is None or not job.return_logprob[i] else int(asked)
            if start > len(job.prompts[i]):
                raise P.ProtocolError(f"logprob_start_len {start} is past prompt {i}'s {len(job.prompts[i])} tokens")
            if start >= 0 and job.inputs[i]:
                raise P.ProtocolError("logprob_start_len: the built-in engine scores text prompts only")
            out.append(start)
        return out

    def _expand(
        self, prompts: list[list[int]], media: list[list[tuple[Kind, bytes]]]
    ) -> tuple[list[list[int]], list[dict[str, torch.Tensor]]]:
        """Each prompt with its placeholders expanded for its media, and its processor tensors."""
        if self.processor is None:
            if any(media):
                raise P.ProtocolError(
                    f"{self.model_path} is a text model: it takes no image_data, audio_data or video_data"
                )
            return prompts, [{} for _ in prompts]
        out = []
        placeholders = set(self.processor.placeholders.values())
        for i, (ids, items) in enumerate(zip(prompts, media, strict=True)):
            places = sum(token in placeholders for token in ids)
            if places != len(items):  # the model would embed a placeholder as text, silently
                raise P.ProtocolError(f"prompt {i} has {places} media placeholder(s) and {len(items)} item(s)")
            try:
                out.append(self.processor.process(ids, items) if items else Processed(ids))
            except (ProcessorError, MediaError) as e:
                raise P.ProtocolError(f"prompt {i}: {e}") from None
        return [p.input_ids for p in out], [p.tensors for p in out]

    def _output(self, job: _Job, i: int) -> dict[str, Any]:
        ids: list[int]
        logprobs: list[float]
        finish: dict[str, Any]
        if job.completions is None:
            ids, logprobs, finish = [], [], {"type": "abort", "message": "Abort before prefill"}
        else:
            c = job.completions[i]
            ids, logprobs = c.output_ids, c.logprobs
            finishes: dict[str, dict[str, Any]] = {
                "stop": {"type": "stop", "matched": c.matched},
                "length": {"type": "length", "length": len(ids)},
                "abort": {"type": "abort", "message": "Aborted"},
            }
            finish = finishes[c.finish_reason]
        meta: dict[str, Any] = {
            "id": job.rids[i],
            "finish_reason": finish,
            "prompt_tokens": len(job.prompts[i]),
            "completion_tokens": len(ids),
            "weight_version": job.version or self.weight_version,
        }
        if job.return_logprob[i]:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(logprobs, ids, strict=True)]
        if job.inputs_scored and job.input_from[i] >= 0:
            tokens = job.prompts[i][job.input_from[i] :]
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(job.inputs_scored[i], tokens, strict=True)]
        chosen = job.completions[i].routed if job.completions is not None else None
        if job.routed_from is not None and chosen is not None:
            # As SGLang: base64 of the raw int32 [positions, layers, top_k], C order, no header.
            routed = np.ascontiguousarray(chosen[job.routed_from :], dtype=np.int32)
            meta["routed_experts"] = base64.b64encode(routed.tobytes()).decode()
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        out: dict[str, Any] = {"text": text, "output_ids": ids, "meta_info": meta}
        if job.return_prompt_ids:  # top-level, as SGLang answers it
            out["prompt_token_ids"] = job.prompts[i]
        return out

    def _schedule_loop(self) -> None:
        while True:
            with self.queue:
                self.queue.wait_for(lambda: self.pending and not self._paused)
                adapter = self.pending[0].adapter  # a batch is sampled with one adapter
                jobs = [j for j in self.pending if j.adapter is adapter]
                self.pending = [j for j in self.pending if j.adapter is not adapter]
                self.running = jobs
            with self.model_lock:
                if adapter is not self.serving:
                    self.lora.apply(adapter)
                    self.serving = adapter
                flat = [(j, i) for j in jobs for i in range(len(j.prompts))]
                inputs = [j.inputs[i] for j, i in flat]
                completions = sample(
                    self.model,
                    [j.prompts[i] for j, i in flat],
                    [j.specs[i] for j, i in flat],
                    [j.seeds[i] for j, i in flat],
                    self.tokenizer.eos_token_id,
                    self.tokenizer.pad_token_id,
                    inputs if any(inputs) else None,
                    aborted=functools.partial(_row_aborted, flat),  # set by /abort_request, read per step
                    record_routing=any(j.routed_from is not None for j in jobs),
                )
                self._score_inputs(jobs)  # under the same lock: the same weights as the sampling
                version = self.weight_version
            with self.queue:
                self.running = []
            start = 0
            for job in jobs:
                job.completions = completions[start : start + len(job.prompts)]
                job.version = version
                start += len(job.prompts)
                job.done.set()
            self.sampled()

    def _score_inputs(self, jobs: list[_Job]) -> None:
        """The input log-probabilities of the prompts that asked for them (logprob_start_len),
        one forward pass per request: its numbers do not depend on which requests came along,
        so a request sent again (a batch regenerated after a restart) is scored bit for bit alike."""
        for job in jobs:
            rows = [i for i, start in enumerate(job.input_from) if start >= 0]
            if not rows:
                continue
            scored = input_logprobs(self.model, [job.prompts[i] for i in rows], [job.input_from[i] for i in rows])
            job.inputs_scored = [[] for _ in job.prompts]
            for i, values in zip(rows, scored, strict=True):
                job.inputs_scored[i] = values

    def abort(self, req: P.AbortReq) -> None:
        """Waiting requests are answered at once with no tokens; running ones stop at their next
        decoding step with the tokens they have (both: finish_reason abort, as SGLang answers).
        rid matches a request's rid or is a prefix of it (SGLang's prefix rule)."""
        with self.queue:
            keep = []
            for job in self.pending:
                if req.abort_all or any(r.startswith(req.rid or "\0") for r in job.rids):
                    job.aborted = True
                    job.done.set()
                else:
                    keep.append(job)
            self.pending = keep
            for job in self.running:
                if req.abort_all or any(r.startswith(req.rid or "\0") for r in job.rids):
                    job.aborted = True

    def pause(self, req: P.PauseGenerationReqInput) -> None:
        with self.queue:
            self._paused = True
        if req.mode == "abort":
            self.abort(P.AbortReq(abort_all=True))
        # The running batch (if any) finishes: taking the model lock waits for it.
        with self.model_lock:
            pass

    def resume(self) -> None:
        with self.queue:
            self._paused = False
            self.queue.notify()

    def model_info(self) -> dict[str, Any]:
        info = {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True}
        return {**info, "weight_version": self.weight_version}


class _Handler(BaseHTTPRequestHandler):
    engine: TorchEngine
    api_key: str
    # Keep-alive, so that the weight sender can pipeline a push's requests over one connection
    # (answered in order); no Nagle delay on the small answers.
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, fmt: str, *args: Any) -> None:  # route http.server's access log to logging
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s", self.address_string(), fmt % args)

    def _reply(self, status: int, body: Any) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, data: bytes | bytearray, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.api_key}":
            return True
        self.close_connection = True  # its body is left unread
        self._reply(HTTPStatus.UNAUTHORIZED, {"error": "missing or wrong API key"})
        return False

    def _superseded(self) -> bool:
        """An engine of an older generation of the run serves nothing (it exits within a second)."""
        if not fence.superseded():
            return False
        self.close_connection = True
        self._reply(HTTPStatus.CONFLICT, {"error": "this engine belongs to an older generation of the run (fenced)"})
        return True

    def do_GET(self) -> None:
        if self._superseded():
            return
        route = R.ROUTES.get(("GET", self.path))
        if route is None:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}"})
            return
        self._reply(HTTPStatus.OK, _ACTIONS[route].answered(self.engine, None))

    def do_POST(self) -> None:
        if self._superseded() or not self._authorized():
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if self.path == SNAPSHOT:  # relax_hpc's own route (catch-up): binary, outside SGLang's table
                blob = self.engine.weights_snapshot(P.parse(SnapshotReq, body))
                self._send(HTTPStatus.OK, blob, "application/octet-stream")
                return
            route = R.ROUTES.get(("POST", self.path))
            if route is None:
                self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}"})
                return
            request = None if route.request is None else P.parse(route.request, body)
            self._reply(HTTPStatus.OK, _ACTIONS[route].answered(self.engine, request))
        except (P.ProtocolError, json.JSONDecodeError) as e:
            self._reply(HTTPStatus.BAD_REQUEST, {"success": False, "message": str(e)})
        except EngineBusy as e:  # answered 503: a client tries again later, or elsewhere
            self._reply(HTTPStatus.SERVICE_UNAVAILABLE, {"success": False, "message": str(e)})
        except Exception as e:  # a failed weight transfer, a dead peer: report it, keep serving
            log.exception("request %s failed", self.path)
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"success": False, "message": f"{type(e).__name__}: {e}"})


@dataclass(frozen=True, slots=True)
class _Action:
    """What the engine does on a route: `run(engine, request)`, answered with `answer(engine)`
    (SGLang's body for that route) or, without one, with what `run` returned. A run that returns
    True changed the weight version: the engine's record is written again before the answer."""

    run: Callable[[TorchEngine, Any], Any]
    answer: Callable[[TorchEngine], Any] | None = None

    def answered(self, engine: TorchEngine, request: Any) -> Any:
        result = self.run(engine, request)
        if self.answer is None:
            return result
        if result is True:
            engine.on_weights()
        return self.answer(engine)


def _message(body: dict[str, Any] | None) -> Callable[[TorchEngine], Any]:
    return lambda _engine: body


_UPDATED = _message({"success": True, "message": "Succeeded to update parameter online."})
_ADAPTER = _message({"success": True, "error_message": None})
_PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
_CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}

# The built-in engine's action on every route of the protocol's table (relax_hpc.protocol.routes).
_ACTIONS: dict[R.Route, _Action] = {
    R.HEALTH: _Action(lambda e, _: {}),
    R.HEALTH_GENERATE: _Action(lambda e, _: {}),
    R.MODEL_INFO: _Action(lambda e, _: e.model_info()),
    R.GET_MODEL_INFO: _Action(lambda e, _: e.model_info()),
    R.GENERATE: _Action(TorchEngine.generate),
    R.FLUSH_CACHE: _Action(lambda e, _: None, _message({"success": True, "message": "Cache flushed."})),
    R.ABORT_REQUEST: _Action(TorchEngine.abort, _message({})),
    R.PAUSE_GENERATION: _Action(TorchEngine.pause, _message(_PAUSED)),
    R.CONTINUE_GENERATION: _Action(lambda e, _: e.resume(), _message(_CONTINUED)),
    R.INIT_WEIGHTS_UPDATE_GROUP: _Action(
        TorchEngine.init_group, _message({"success": True, "message": "Succeeded to initialize custom process group."})
    ),
    R.DESTROY_WEIGHTS_UPDATE_GROUP: _Action(
        TorchEngine.destroy_group, _message({"success": True, "message": "Succeeded to destroy custom process group."})
    ),
    R.BEGIN_WEIGHT_UPDATE: _Action(
        TorchEngine.begin_update, _message({"success": True, "message": "Weight update begun."})
    ),
    R.END_WEIGHT_UPDATE: _Action(
        lambda e, _: e.end_update(), _message({"success": True, "message": "Weight update ended."})
    ),
    R.LOAD_LORA_ADAPTER: _Action(TorchEngine.load_adapter, _ADAPTER),
    R.UNLOAD_LORA_ADAPTER: _Action(TorchEngine.unload_adapter, _ADAPTER),
    R.UPDATE_WEIGHT_VERSION: _Action(
        TorchEngine.update_version, lambda e: {"success": True, "new_version": e.weight_version}
    ),
    R.GET_WEIGHTS_BY_NAME: _Action(TorchEngine.weights_by_name),
    R.UPDATE_WEIGHTS_FROM_TENSOR: _Action(TorchEngine.update_from_tensor, _UPDATED),
    R.UPDATE_WEIGHTS_FROM_DISK: _Action(
        TorchEngine.update_from_disk, _message({"success": True, "message": "Succeeded to update model weights."})
    ),
    R.RELEASE_MEMORY_OCCUPATION: _Action(TorchEngine.release_memory, _message(None)),
    R.RESUME_MEMORY_OCCUPATION: _Action(TorchEngine.resume_memory, _message(None)),
    R.UPDATE_WEIGHTS_FROM_DISTRIBUTED: _Action(TorchEngine.update_from_distributed, _UPDATED),
    R.WEIGHTS_CHECKER: _Action(TorchEngine.check_weights),
}


def serve(args: argparse.Namespace, startup: StartupClock) -> None:
    torch.set_num_threads(args.threads)
    paths = RunPaths(Path(args.run_dir))
    fence.install(paths.root)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    engine = TorchEngine(args.model_path, args.dtype, device, args.weights_timeout_s)
    startup.mark("model")
    engine.sampled = lambda: startup.finish(paths.metrics, args.engine_id, "first_batch")
    try:
        server = ThreadingHTTPServer((args.host, args.port), _Handler)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise SystemExit(
                f"engine {args.engine_id}: port {args.port} on {args.host} is already in use; "
                "set rollout.base_port to a free range, or to 0 to let the OS choose"
            ) from None
        raise
    server.daemon_threads = True
    instance = uuid.uuid4().hex
    # Bound to every interface (an engine on its own Slurm node): announce the node's name.
    advertised = socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host

    def announce() -> None:
        if args.pool == "none":  # a server of its own that `relax_hpc.scale out --url` adds
            return
        record = EngineRecord(
            args.engine_id, advertised, server.server_address[1], os.getpid(), instance, engine.weight_version
        )
        write_record(paths.registry(args.pool), record)

    # A record write fsyncs (milliseconds): off the answer's path, in order.
    announcer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="announce")
    engine.on_weights = lambda: announcer.submit(announce)
    handler = type("Handler", (_Handler,), {"engine": engine, "api_key": paths.read_token()})
    server.RequestHandlerClass = handler
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    if args.catch_up_bucket_mb:
        _catch_up(engine, paths, args)
        startup.mark("catch_up")
    announce()
    startup.mark("registered")
    log.info(
        "engine %s serving %s on %s:%d (python %s)",
        args.engine_id,
        args.model_path,
        args.host,
        server.server_address[1],
        sys.executable,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        announcer.shutdown()  # a late announcement must not bring the record back
        if args.pool != "none":
            remove_record(paths.registry(args.pool), args.engine_id, instance)
        log.info("engine %s stopped", args.engine_id)


def _catch_up(engine: TorchEngine, paths: RunPaths, args: argparse.Namespace) -> None:
    """Copy the current weights from a healthy engine (rollout.catch_up engine), or say why the
    engine waits for the trainer's push instead; either way an event in the run's events."""
    start = time.monotonic()
    bucket_bytes = int(args.catch_up_bucket_mb * 2**20)
    done, why = engine.catch_up(paths.registry(args.pool), args.engine_id, paths.read_token(), bucket_bytes)
    seconds = round(time.monotonic() - start, 3)  # finding the seed, the copy, the load into the weights
    event: dict[str, Any] = {"event": "catch_up", "engine": args.engine_id, "seconds": seconds}
    if done is None:
        log.info("engine %s did not catch up (%s): it waits for the trainer's push", args.engine_id, why)
        event.update(outcome="fallback", why=why)
    else:
        log.info(
            "engine %s caught up from %s: version %s, %.1f MB in %.2f s",
            args.engine_id, done.seed, done.version, done.nbytes / 1e6, seconds,
        )  # fmt: skip
        event.update(outcome="copied", seed=done.seed, version=done.version, bytes=done.nbytes)
        event["attempts"] = done.attempts
    writer = JsonlWriter(paths.events_metrics)
    writer.log(event)
    writer.close()


def main() -> None:
    startup = StartupClock()
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.engines.torch_engine",
        description="relax_hpc's built-in torch rollout engine (SGLang protocol)",
    )
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--device", default="auto", help="where the model lives: auto (a GPU when one is visible), cpu, cuda, cuda:N"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--weights-timeout-s", type=float, default=60.0)
    parser.add_argument(
        "--catch-up-bucket-mb",
        type=float,
        default=0.0,
        help="copy the current weights from a healthy engine at start, in buckets of this many MiB (0: do not)",
    )
    parser.add_argument(
        "--pool",
        choices=("policy", "judge", "teacher", "none"),
        default="policy",
        help="which registry in RUN_DIR it registers in (none: a server that scale out --url adds)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(args, startup)


if __name__ == "__main__":
    main()
