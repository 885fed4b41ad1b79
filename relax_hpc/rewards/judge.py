"""A generative judge as the reward (`reward.name: judge`, settings in `reward.judge`).

The judge model is served by engines of its own (`judge-N` roles: the run's engine kind on
`reward.judge.model`, registered in RUN_DIR/registry/judge, never part of weight sync). A round's
samples become one greedy /generate batch: `reward.judge.prompt_template` filled with the row's
prompt, the response and the answer, tokenized with the judge's tokenizer. The first group of
`reward.judge.pattern` found in each verdict is the reward: a number, or yes (1) / no (0); a
verdict without a match fails its sample. A judge engine that dies is replaced by the launcher
like any engine; its requests go to another judge engine meanwhile.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from transformers import PreTrainedTokenizerFast

from relax_hpc.config.schema import JudgeConfig
from relax_hpc.paths import RunPaths
from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineClient, PoolClient, PoolUnavailable
from relax_hpc.rewards.scoring import RewardError, RewardInput


class Verdict(ValueError):
    """The judge answered something the pattern does not find a reward in."""


def verdict_reward(text: str, pattern: re.Pattern[str]) -> float:
    match = pattern.search(text)
    if match is None:
        raise Verdict(f"no match for reward.judge.pattern in the verdict {text[:100]!r}")
    value = match.group(1)
    words = {"yes": 1.0, "no": 0.0}
    return words[value.lower()] if value.lower() in words else float(value)


class JudgeReward:
    """The batched reward function `judge` of one driver."""

    def __init__(
        self,
        judge: JudgeConfig,
        request_timeout_s: float,
        paths: RunPaths,
        wait_s: float = 600.0,
        client: type[EngineClient] = EngineClient,
    ) -> None:
        """`client`: the judge engines' API (relax_hpc.protocol.vllm.client_class)."""
        if judge.model is None:
            raise RewardError("reward.name=judge needs reward.judge.model")
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(judge.model)
        self.template, self.max_new_tokens = judge.prompt_template, judge.max_new_tokens
        self.pattern = re.compile(judge.pattern)
        self.engines = PoolClient(paths.judge_engines, paths.read_token(), request_timeout_s, wait_s, client)

    def prompt(self, item: RewardInput) -> str:
        prompt = item.row.prompt if isinstance(item.row.prompt, str) else str(list(item.row.prompt))
        return self.template.format(prompt=prompt, response=item.response, answer=item.answer)

    async def __call__(self, items: list[RewardInput]) -> list[Any]:
        ids = [self.tokenizer(self.prompt(i))["input_ids"] for i in items]
        request = P.GenerateReqInput(
            input_ids=ids, sampling_params={"max_new_tokens": self.max_new_tokens, "temperature": 0.0}
        )
        outputs = await asyncio.to_thread(self._generate, request)
        results: list[Any] = []
        for output in outputs:
            try:
                results.append(verdict_reward(self.text(output), self.pattern))
            except (Verdict, ValueError) as e:
                results.append(Verdict(str(e)))
        return results

    def text(self, output: dict) -> str:
        """The verdict's text: SGLang's and the built-in engine's `text`, else (a vLLM engine
        answers token ids only) the ids decoded as SGLang decodes them."""
        if "text" in output:
            return str(output["text"])
        return self.tokenizer.decode(output["output_ids"], skip_special_tokens=True)

    def _generate(self, request: P.GenerateReqInput) -> list[dict]:
        """One batch on a judge engine, re-issued while judge engines fail."""
        try:
            return self.engines.generate(request)
        except PoolUnavailable as e:
            raise RewardError(f"judge: {e}") from None
