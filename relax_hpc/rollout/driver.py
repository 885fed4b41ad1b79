"""The rollout driver: prompts -> engines -> rewards -> published sample batches.

    python -m relax_hpc.rollout.driver --run-dir RUN_DIR

Batch `seq` holds the prompts PromptOrder assigns to it, each sampled group_size times with a
seed derived from (run seed, seq, sample), and may be generated only by a policy version
>= seq - max_staleness (0: strictly on-policy, the driver waits for the weights of step seq). Its
groups are split across the engines that hold such a version; a chunk whose engine dies or times
out is re-issued to another one. The driver resumes from the spool (Spool.next_seq), so a restart
neither skips nor repeats a batch. It also measures greedy accuracy over the whole dataset every
`rollout.eval_every` versions and at the last one, then exits.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from relax_hpc.ckpt.layout import read_trainer_state
from relax_hpc.config.load import read_frozen
from relax_hpc.config.schema import JobConfig
from relax_hpc.data.media import KINDS, Kind, data_uri
from relax_hpc.data.plan import BatchPlan, Group, Selection, to_sample_batch
from relax_hpc.data.processor import media_processor, prompt_encoder, up_to_media_token
from relax_hpc.data.prompts import load_prompts
from relax_hpc.exchange.spool import SampleBatch, Spool
from relax_hpc.metrics.jsonl import JsonlWriter, read_jsonl
from relax_hpc.paths import RunPaths
from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineClient, EngineRequestError, EngineUnavailable
from relax_hpc.protocol.registry import EngineRecord, read_records

log = logging.getLogger("relax_hpc.driver")


@dataclass
class Engine:
    record: EngineRecord
    client: EngineClient
    version: int


class EnginePool:
    """The engines that answer, with the policy version each holds (re-read at most every 0.5 s)."""

    def __init__(self, paths: RunPaths, timeout_s: float) -> None:
        self.paths = paths
        self.api_key = paths.read_token()
        self.timeout_s = timeout_s
        self.engines: list[Engine] = []
        self._last = 0.0

    def refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._last < 0.5:
            return
        self._last = time.monotonic()
        engines = []
        for record in read_records(self.paths.engines):
            client = EngineClient(record.url, self.api_key, self.timeout_s)
            try:
                engines.append(Engine(record, client, int(client.weight_version())))
            except (EngineUnavailable, EngineRequestError, ValueError):
                continue
        self.engines = engines

    def eligible(self, min_version: int) -> list[Engine]:
        return [e for e in self.engines if e.version >= min_version]

    def mark_down(self, engine: Engine) -> None:
        self.engines = [e for e in self.engines if e.record.instance != engine.record.instance]


def first_evaluation(resumed_version: int, last_evaluated: int, every: int, total: int) -> int:
    """The first policy version a (re)started driver evaluates: the next multiple of `every` after
    the last one evaluated, never below the version the run resumed from (after a restart the
    engines hold the base model until the trainer pushes the resumed weights: evaluating them would
    record the untrained score under version 0). A fresh run evaluates version 0, its baseline."""
    first = max(last_evaluated + 1, resumed_version)
    return min(total, -(-first // every) * every)


class Driver:
    def __init__(self, cfg: JobConfig, paths: RunPaths) -> None:
        self.cfg, self.paths, self.ro = cfg, paths, cfg.rollout
        # The fast tokenizer class, not AutoTokenizer: AutoTokenizer imports torch (about 3 s of
        # CPU at every start), and a text run's driver only turns prompts into token ids.
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(cfg.model.path)
        d = cfg.data
        self.rows = load_prompts(d.path, d.prompt_key, d.answer_key, d.media)
        # A multimodal model's processor places the media; the engines expand the placeholders.
        self.processor = media_processor(cfg.model.path)
        encode = prompt_encoder(cfg.model.path, self.processor)
        self.prompt_ids = [encode(r) for r in self.rows]  # tokenized once
        self.plan = BatchPlan(cfg, self.rows)
        self.spool = Spool(paths.spool)
        self.pool = EnginePool(paths, self.ro.request_timeout_s)
        self.metrics = JsonlWriter(paths.rollout_metrics)
        self.evals = JsonlWriter(paths.eval_metrics)
        self.threads = ThreadPoolExecutor(max_workers=16, thread_name_prefix="generate")
        self.stopping = False
        self.reissued = 0
        self._load: dict[str, int] = {}  # requests in flight per engine instance

    def _sampling(self, temperature: float | None = None) -> dict:
        return {
            "max_new_tokens": self.ro.max_new_tokens,
            "temperature": self.ro.temperature if temperature is None else temperature,
            "top_p": self.ro.top_p,
            "top_k": self.ro.top_k,
        }

    # -- generation with re-issue ---------------------------------------------------------------

    def _request(self, indices: list[int], sampling: list[dict], logprob: bool) -> P.GenerateReqInput:
        """A /generate batch of the rows `indices` (repeats allowed): their prompt ids with one
        placeholder per item, their media as data URIs, and a request for the expanded ids."""
        media: dict[Kind, list[str | list[str]]] = {kind: [] for kind in KINDS}
        for i in indices:
            for kind in KINDS:
                media[kind].append([data_uri(ref.kind, ref.read()) for ref in self.rows[i].media if ref.kind == kind])
        has = {kind: any(media[kind]) for kind in KINDS}
        return P.GenerateReqInput(
            input_ids=[self.prompt_ids[i] for i in indices],
            sampling_params=sampling,
            return_logprob=logprob,
            image_data=media["image"] if has["image"] else None,
            audio_data=media["audio"] if has["audio"] else None,
            return_prompt_token_ids=any(has.values()),
        )

    def _completion(self, output: dict) -> tuple[list[int], list[float], str]:
        """An answer's tokens, log-probabilities and text, cut before any media special token
        (which would break the trainer's count of placeholders against features)."""
        ids = output["output_ids"]
        logprobs = [lp for lp, _, _ in output["meta_info"].get("output_token_logprobs", [])]
        keep = up_to_media_token(ids, self.processor.media_token_ids) if self.processor else len(ids)
        if keep == len(ids):
            return ids, logprobs, output["text"]
        return ids[:keep], logprobs[:keep], self.tokenizer.decode(ids[:keep], skip_special_tokens=True)

    def _run_chunk(self, indices: list[int], seeds: list[int], min_version: int) -> list[dict]:
        """Generate one chunk on some eligible engine, re-issuing it until one answers."""
        request = self._request(indices, [{**self._sampling(), "sampling_seed": s} for s in seeds], True)
        wait = 0.1
        while not self.stopping:
            self.pool.refresh()
            candidates = self.pool.eligible(min_version)
            if not candidates:
                time.sleep(wait)
                wait = min(wait * 2, 2.0)
                continue
            engine = min(candidates, key=lambda e: self._load.get(e.record.instance, 0))
            self._load[engine.record.instance] = self._load.get(engine.record.instance, 0) + 1
            try:
                outputs = engine.client.generate(request)
            except EngineUnavailable as e:
                log.warning("engine %s failed (%s); re-issuing %d prompts", engine.record.engine_id, e, len(indices))
                self.pool.mark_down(engine)
                self.reissued += len(indices)
                continue
            finally:
                self._load[engine.record.instance] -= 1
            versions = [int(o["meta_info"]["weight_version"]) for o in outputs]
            if min(versions) >= min_version and all(
                o["meta_info"]["finish_reason"]["type"] != "abort" for o in outputs
            ):
                return outputs
            log.warning(
                "engine %s answered with version %d < %d or aborted; re-issuing",
                engine.record.engine_id,
                min(versions),
                min_version,
            )
            self.reissued += len(indices)
        raise SystemExit(0)

    def _sample_round(self, seq: int, round_: int, min_version: int) -> list[Group]:
        """Every prompt of one sampling round, group_size times, split across the eligible engines."""
        g = self.ro.group_size
        indices = self.plan.prompts(seq, round_)
        copies = [i for i in indices for _ in range(g)]
        seeds = self.plan.seeds(seq, round_, len(copies))
        num_chunks = max(1, len(self.pool.eligible(min_version)))
        groups_per_chunk = math.ceil(len(indices) / num_chunks)
        bounds = [
            (c * groups_per_chunk * g, min(len(copies), (c + 1) * groups_per_chunk * g)) for c in range(num_chunks)
        ]
        futures = [
            self.threads.submit(self._run_chunk, copies[a:b], seeds[a:b], min_version) for a, b in bounds if a < b
        ]
        outputs = [o for f in futures for o in f.result()]
        completions = [self._completion(o) for o in outputs]
        # The prompt as the engine conditioned on it: placeholders expanded for the media.
        firsts = outputs[::g]
        return self.plan.groups(
            seq,
            round_,
            [o.get("prompt_token_ids") or self.prompt_ids[i] for o, i in zip(firsts, indices, strict=True)],
            [ids for ids, _, _ in completions],
            [lps for _, lps, _ in completions],
            [text for _, _, text in completions],
            [int(o["meta_info"]["weight_version"]) for o in outputs],
            [[(ref.kind, ref.read()) for ref in self.rows[i].media] for i in indices],
        )

    def generate_batch(self, seq: int, min_version: int) -> tuple[SampleBatch, Selection]:
        selection = self.plan.select(lambda round_: self._sample_round(seq, round_, min_version))
        return to_sample_batch(seq, selection.groups), selection

    # -- evaluation -----------------------------------------------------------------------------

    def evaluate(self, engine: Engine) -> int:
        indices = list(range(len(self.rows)))
        outputs = engine.client.generate(
            self._request(indices, [self._sampling(temperature=0.0)] * len(indices), False)
        )
        texts = [self._completion(o)[2] for o in outputs]
        correct = sum(self.plan.reward_fn(t, r.answer) for t, r in zip(texts, self.rows, strict=True))
        version = min(int(o["meta_info"]["weight_version"]) for o in outputs)
        accuracy = correct / len(self.rows)
        self.evals.log({"version": version, "greedy_accuracy": accuracy, "problems": len(self.rows)})
        log.info("eval at version %d: greedy accuracy %.3f", version, accuracy)
        return version

    # -- main loop ------------------------------------------------------------------------------

    def run(self) -> None:
        total, k = self.cfg.trainer.total_steps, self.ro.max_staleness
        every = self.ro.eval_every or total
        resumed = (read_trainer_state(self.paths.ckpt) or {"version": 0})["version"]
        done = [int(r["version"]) for r in read_jsonl(self.paths.eval_metrics) if "version" in r]
        next_eval = first_evaluation(resumed, max(done, default=-1), every, total)
        seq = self.spool.next_seq()
        log.info("driver starts at batch %d", seq)
        wait = 0.05
        while not self.stopping:
            self.pool.refresh()
            newest = max((e.version for e in self.pool.engines), default=-1)
            if newest >= next_eval:
                try:
                    evaluated = self.evaluate(max(self.pool.engines, key=lambda e: e.version))
                except (EngineUnavailable, EngineRequestError) as e:
                    log.warning("eval failed (%s); will retry", e)
                else:
                    if evaluated >= total:
                        log.info("final version %d evaluated: driver done", evaluated)
                        return
                    next_eval = min(total, (evaluated // every + 1) * every)
                continue
            if self.pool.eligible(seq - k) and seq < total + k:
                started = time.monotonic()
                batch, selection = self.generate_batch(seq, seq - k)
                seconds = time.monotonic() - started
                batch.attrs["generate_seconds"] = seconds  # the trainer's time breakdown reports it
                self.spool.publish(batch, writer="driver")
                self.metrics.log(
                    {
                        "batch": seq,
                        "reward": float(batch.rewards.mean()),
                        "min_version": int(batch.policy_version.min()),
                        "max_version": int(batch.policy_version.max()),
                        "samples": batch.num_samples,
                        "seconds": round(seconds, 4),
                        "samples_per_s": batch.num_samples / max(seconds, 1e-9),
                        "engines": len(self.pool.engines),
                        "reissued_total": self.reissued,
                        "sampling_rounds": selection.rounds,
                        "groups_dropped": selection.dropped,
                        "groups_topped_up": selection.topped_up,
                    }
                )
                seq, wait = seq + 1, 0.05
                continue
            time.sleep(wait)
            wait = min(wait * 1.5, 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m relax_hpc.rollout.driver", description="relax_hpc rollout driver")
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s driver %(name)s %(levelname)s %(message)s")
    paths = RunPaths(args.run_dir)
    driver = Driver(read_frozen(paths.config), paths)

    def stop(*_: object) -> None:
        driver.stopping = True

    signal.signal(signal.SIGTERM, stop)
    driver.run()
    sys.exit(0)


if __name__ == "__main__":
    main()
