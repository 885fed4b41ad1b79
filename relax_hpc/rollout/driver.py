"""The rollout driver: prompts -> environment episodes on the engines -> rewards -> published batches.

    python -m relax_hpc.rollout.driver --run-dir RUN_DIR

Batch `seq` holds the prompts the batch plan assigns to it, each run through the environment
(rollout.env) group_size times with seeds derived from (run seed, seq, sample), and may be
generated only by a policy version >= seq - max_staleness (0: strictly on-policy, the driver
waits for the weights of step seq). The episodes' generate calls go to the engines in batches
(relax_hpc.rollout.engine_policy: split across the engines that hold such a version, re-issued
when an engine dies). The driver resumes from the spool (Spool.next_seq), so a restart neither
skips nor repeats a batch. With teacher engines (algo.teacher.num_engines) the teacher scores every
batch before it is published (relax_hpc.rollout.teacher). It also measures greedy accuracy over
the whole dataset (data.eval_path's held-out rows if set) every `rollout.eval_every` versions and
at the last one, then exits. With
ckpt.export_version=best the trainer holds each of those versions until it is evaluated
(relax_hpc.trainer.loop), so the newest version at an eval point is exactly the eval point.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from relax_hpc import fence
from relax_hpc.ckpt.layout import read_trainer_state
from relax_hpc.config.load import read_frozen
from relax_hpc.config.schema import JobConfig
from relax_hpc.data.processor import media_processor, prompt_encoder, video_spec
from relax_hpc.data.prompts import load_data
from relax_hpc.exchange.spool import SampleBatch, Spool
from relax_hpc.metrics.heartbeat import Heartbeat
from relax_hpc.metrics.jsonl import JsonlWriter, read_jsonl
from relax_hpc.metrics.poll import Poll
from relax_hpc.metrics.startup import StartupClock
from relax_hpc.paths import RunPaths
from relax_hpc.protocol.client import EngineRequestError, EngineUnavailable
from relax_hpc.protocol.vllm import client_class
from relax_hpc.rewards import RewardError, make_scorer
from relax_hpc.rewards.judge import JudgeReward
from relax_hpc.rollout.engine_policy import EnginePolicy, EnginePool, Stopping, hit_rate
from relax_hpc.rollout.plan import to_sample_batch
from relax_hpc.rollout.rounds import Rounds
from relax_hpc.rollout.teacher import TeacherError, TeacherScorer

log = logging.getLogger("relax_hpc.driver")


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
        video = video_spec(cfg.model.path)
        self.rows = load_data(cfg.data, video)
        # A multimodal model's processor places the media; the engines expand the placeholders.
        self.processor = media_processor(cfg.model.path)
        encode = prompt_encoder(cfg.model.path, self.processor)
        self.prompt_ids = [encode(r) for r in self.rows]  # tokenized once
        eval_rows, eval_ids = self.rows, self.prompt_ids
        if cfg.data.eval_path:
            eval_rows = load_data(cfg.data, video, held_out=True)
            eval_ids = [encode(r) for r in eval_rows]
        self.spool = Spool(paths.spool)
        self.pool = EnginePool(paths, self.ro.request_timeout_s, self.ro.engine)
        self.stopping = False
        self.startup: StartupClock | None = None  # main's, until the first published batch
        self.position = 0  # the next batch to generate (for the heartbeat)
        self.prefix_cache: dict[str, tuple[float, float]] = {}  # the engines' counters after the last batch
        self.policy = EnginePolicy(
            self.pool,
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            self.processor.media_token_ids if self.processor else (),
            partial=self.ro.partial,
            stopping=lambda: self.stopping,
            routing=cfg.algo.off_policy.routing_replay,
            adapters=cfg.lora_adapters,
        )
        self.metrics = JsonlWriter(paths.rollout_metrics)
        self.evals = JsonlWriter(paths.eval_metrics)
        self.failures = JsonlWriter(paths.reward_failures)
        judge = None
        if cfg.reward.name == "judge":
            judge = JudgeReward(cfg.reward.judge, self.ro.request_timeout_s, paths, client=client_class(self.ro.engine))
        scorer = make_scorer(cfg.reward, judge)
        self.teacher = TeacherScorer(cfg, paths) if cfg.algo.teacher.num_engines else None
        self.rounds = Rounds(cfg, self.rows, self.prompt_ids, self.tokenizer, self.policy, scorer, self.failures.log)
        # Evaluations: on the rollout engines, between batches; or on engines of their own
        # (rollout.eval_engines), beside generation. Over data.eval_path's rows if set.
        self.eval_pool, self.eval_policy = self.pool, self.policy
        if self.ro.eval_engines:
            self.eval_pool = EnginePool(paths, self.ro.request_timeout_s, self.ro.engine, evaluation=True)
            self.eval_policy = EnginePolicy(
                self.eval_pool,
                self.policy.decode,
                self.policy.media_token_ids,
                stopping=lambda: self.stopping,
                adapters=cfg.lora_adapters,
            )
        self.eval_rounds = self.rounds
        if self.eval_policy is not self.policy or eval_rows is not self.rows:
            self.eval_rounds = Rounds(
                cfg, eval_rows, eval_ids, self.tokenizer, self.eval_policy, scorer, self.failures.log
            )
        self.next_eval = 0  # the next policy version to evaluate (run() sets it)
        self._evaluation: asyncio.Task[int] | None = None  # one on the evaluation engines

    async def _beat(self) -> None:
        """The heartbeat (RUN_DIR/health/driver.json): written by the event loop, so a loop stuck
        in synchronous code, or deadlocked, falls silent and the launcher restarts the driver."""
        heartbeat = Heartbeat(self.paths, "driver")
        while True:
            heartbeat.beat(batch=self.position, engines=len(self.pool.engines), load=self.policy.load())
            await asyncio.sleep(5.0)

    async def generate_batch(self, seq: int) -> tuple[SampleBatch, dict]:
        self.policy.min_version = seq - self.ro.max_staleness
        selection = await self.rounds.plan.select(lambda round_: self.rounds.sample_round(seq, round_))
        # One reading per batch: since the last batch's (an engine's /metrics is not free to render).
        cache, self.prefix_cache = self.prefix_cache, await asyncio.to_thread(self.pool.prefix_cache)
        cached = hit_rate(cache, self.prefix_cache)
        stats = {
            "reward_sampled": selection.sampled_reward,
            "sampling_rounds": selection.rounds,
            "groups_dropped": selection.dropped,
            "groups_topped_up": selection.topped_up,
            **self.rounds.take_stats(),
            **({} if cached is None else {"prefix_cache_hit_rate": round(cached, 4)}),
        }
        batch = to_sample_batch(seq, selection.groups)
        if self.teacher is not None:  # the selected groups only: dropped ones are never trained
            started = time.monotonic()
            await self.teacher.score(batch)
            stats["teacher_seconds"] = round(time.monotonic() - started, 4)
        return batch, stats

    async def evaluate(self, version: int) -> int:
        """Greedy accuracy over the evaluation's dataset on engines holding at least `version`;
        returns the version evaluated (the oldest that answered)."""
        self.eval_policy.min_version = version
        started = time.monotonic()
        problems = len(self.eval_rounds.rows)
        accuracy = await self.eval_rounds.evaluate(list(range(problems)))
        evaluated = max(version, min((e.version for e in self.eval_pool.eligible(version)), default=version))
        seconds = round(time.monotonic() - started, 4)
        record = {
            "version": evaluated,
            "greedy_accuracy": accuracy,
            "problems": problems,
            "dataset": Path(self.cfg.data.eval_path or self.cfg.data.path).stem,  # the file it scored
            "seconds": seconds,
        }
        self.evals.log(record)
        log.info("eval at version %d: greedy accuracy %.3f", evaluated, accuracy)
        return evaluated

    def evaluated(self, version: int) -> bool:
        """Move to the next version to evaluate; True once the run's last one is evaluated."""
        total, every = self.cfg.trainer.total_steps, self.ro.eval_every or self.cfg.trainer.total_steps
        if version >= total:
            log.info("final version %d evaluated: driver done", version)
            return True
        self.next_eval = min(total, (version // every + 1) * every)
        return False

    async def evaluate_between_batches(self, newest: int) -> bool:
        """Evaluate on the rollout engines now; True once the run's last version is evaluated."""
        try:
            return self.evaluated(await self.evaluate(newest))
        except (EngineUnavailable, EngineRequestError) as e:
            log.warning("eval failed (%s); will retry", e)
            return False

    def evaluate_beside_generation(self) -> bool:
        """On the evaluation engines: collect a finished evaluation, start the next once they hold
        its version; True once the run's last version is evaluated."""
        task = self._evaluation
        if task is not None and task.done():
            self._evaluation = None
            try:
                if self.evaluated(task.result()):
                    return True
            except (EngineUnavailable, EngineRequestError) as e:
                log.warning("eval failed (%s); will retry", e)
        if self._evaluation is None:
            self.eval_pool.refresh(every=0.2)
            newest = max((e.version for e in self.eval_pool.engines), default=-1)
            if newest >= self.next_eval:
                self._evaluation = asyncio.get_running_loop().create_task(self.evaluate(newest))
        return False

    # -- main loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        total, k = self.cfg.trainer.total_steps, self.ro.max_staleness
        every = self.ro.eval_every or total
        resumed = (read_trainer_state(self.paths.ckpt) or {"version": 0})["version"]
        done = [int(r["version"]) for r in read_jsonl(self.paths.eval_metrics) if "version" in r]
        self.next_eval = first_evaluation(resumed, max(done, default=-1), every, total)
        seq = self.spool.next_seq()
        log.info("driver starts at batch %d", seq)
        self.position = seq
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())  # held: tasks are weakly referenced
        # At most 0.2 s: a run's first batch waits here for the engines to register, the next ones
        # for a version (a listing of RUN_DIR/registry, 5 times a second at most).
        poll = Poll(highest=0.2)
        while not self.stopping:
            self.pool.refresh(every=poll.cap)
            newest = max((e.version for e in self.pool.engines), default=-1)
            if self.startup and newest >= 0:
                self.startup.mark("engines")
            if self.eval_pool is not self.pool:
                if self.evaluate_beside_generation():
                    return
            elif newest >= self.next_eval:
                if await self.evaluate_between_batches(newest):
                    return
                continue
            if self.pool.eligible(seq - k) and seq < total + k:
                started = time.monotonic()
                batch, stats = await self.generate_batch(seq)
                seconds = time.monotonic() - started
                batch.attrs["generate_seconds"] = seconds  # the trainer's time breakdown reports it
                self.spool.publish(batch, writer="driver")
                if self.startup:
                    self.startup.finish(self.paths.metrics, "driver", "first_batch")
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
                        "reissued_total": self.policy.reissued,
                        "continued_total": self.policy.continued,
                        **stats,
                    }
                )
                seq = seq + 1
                self.position = seq
                poll.progressed()
                continue
            await asyncio.sleep(poll.interval())


def main() -> None:
    startup = StartupClock()
    parser = argparse.ArgumentParser(prog="python -m relax_hpc.rollout.driver", description="relax_hpc rollout driver")
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s driver %(name)s %(levelname)s %(message)s")
    paths = RunPaths(args.run_dir)
    fence.install(paths.root)
    driver = Driver(read_frozen(paths.config), paths)
    startup.mark("init")
    driver.startup = startup

    def stop(*_: object) -> None:
        driver.stopping = True

    signal.signal(signal.SIGTERM, stop)
    try:
        asyncio.run(driver.run())
    except Stopping:
        pass
    except (RewardError, TeacherError) as e:
        log.error("%s", e)
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
