"""The teacher served by engines (`algo.teacher.num_engines`): the driver scores every batch.

The teacher engines (`teacher-N` roles: rollout.engine's kind on algo.teacher.path, registered in
RUN_DIR/registry/teacher, never updated) answer one /generate per prompt group, as SGLang 0.5.23
defines scoring: input_ids = prompt + completion, max_new_tokens 0, return_logprob with
logprob_start_len = prompt length - 1. Entry 0 of input_token_logprobs (the last prompt token)
is None by SGLang's rule; entries 1.. are the completion tokens' log-probabilities under the
teacher, which go into the batch (spool schema 5, `teacher_logprobs`) before it is published, so
the trainer never loads the teacher. One request per group, never split or merged by the driver:
the built-in engine scores each request on its own, so a batch regenerated after a restart gets
the same numbers bit for bit. A request that fails on one engine goes to the next (each attempt
bounded by rollout.request_timeout_s); when no teacher engine answers for `wait_s` (10 minutes),
the driver stops with an error.
"""

from __future__ import annotations

import asyncio

import numpy as np

from relax_hpc.config.schema import JobConfig
from relax_hpc.exchange.spool import SampleBatch
from relax_hpc.paths import RunPaths
from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import PoolClient, PoolUnavailable
from relax_hpc.protocol.vllm import client_class

# Scoring only: no new token. SGLang scores input tokens at temperature 1 whatever the request says.
SCORING = {"max_new_tokens": 0}


class TeacherError(RuntimeError):
    """No teacher engine answered, or an answer does not score the tokens it was sent."""


def scoring_request(batch: SampleBatch, rows: list[int]) -> P.GenerateReqInput:
    """The /generate request that scores samples `rows` of a batch (one prompt group)."""
    return P.GenerateReqInput(
        input_ids=[batch.sample_tokens(i).tolist() for i in rows],
        sampling_params=SCORING,
        return_logprob=True,
        logprob_start_len=[int(batch.prompt_lens[i]) - 1 for i in rows],
    )


def completion_logprobs(answer: dict, tokens: np.ndarray, prompt_len: int) -> np.ndarray:
    """The completion tokens' log-probabilities from one answer's input_token_logprobs, checked
    against the tokens sent (an engine that scored other tokens must not train the student)."""
    entries = answer["meta_info"].get("input_token_logprobs")
    completion = tokens[prompt_len:].tolist()
    if entries is None or len(entries) != len(completion) + 1:
        raise TeacherError(f"a teacher answer scores {len(entries or [])} input tokens, not {len(completion) + 1}")
    if [int(e[1]) for e in entries[1:]] != completion or any(e[0] is None for e in entries[1:]):
        raise TeacherError("a teacher answer scores other tokens than the completion it was sent")
    return np.asarray([e[0] for e in entries[1:]], dtype=np.float32)


class TeacherScorer:
    """The teacher engines of one driver."""

    def __init__(self, cfg: JobConfig, paths: RunPaths, wait_s: float = 600.0) -> None:
        self.engines = PoolClient(
            paths.teacher_engines, paths.read_token(), cfg.rollout.request_timeout_s, wait_s,
            client_class(cfg.rollout.engine),
        )  # fmt: skip

    async def score(self, batch: SampleBatch) -> None:
        """Set batch.teacher_logprobs: the teacher's log-probability of every completion token
        (0 for prompt tokens, as rollout_logprobs), one request per prompt group, concurrently."""
        groups: dict[int, list[int]] = {}
        for i, group in enumerate(batch.group_ids.tolist()):
            groups.setdefault(group, []).append(i)
        answers = await asyncio.gather(*(self._generate(batch, rows) for rows in groups.values()))
        scored = np.zeros(len(batch.tokens), dtype=np.float32)
        for rows, outputs in zip(groups.values(), answers, strict=True):
            for i, answer in zip(rows, outputs, strict=True):
                plen = int(batch.prompt_lens[i])
                scored[batch.offsets[i] + plen : batch.offsets[i + 1]] = completion_logprobs(
                    answer, batch.sample_tokens(i), plen
                )
        batch.teacher_logprobs = scored

    async def _generate(self, batch: SampleBatch, rows: list[int]) -> list[dict]:
        try:
            return await asyncio.to_thread(self.engines.generate, scoring_request(batch, rows))
        except PoolUnavailable as e:
            raise TeacherError(f"teacher: {e}") from None
