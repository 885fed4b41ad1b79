"""A reward computed by a service over HTTP (`reward.name: remote`, settings in `reward.remote`).

Each sample is one POST of JSON to `reward.remote.url`:

    {"response": "...", "answer": "...", "prompt": "..." or [messages], "fields": {the whole row}}

and the answer is a number, or {"reward": number}. With `reward.batched`, one POST carries a
round's samples as {"samples": [...]} and the answer is a list of numbers, or {"rewards": [...]}.
Connection errors, timeouts, HTTP 429 and 5xx are retried (`retries` times, waiting `backoff_s`,
then twice that, ...); another 4xx fails the sample(s) at once. At most `concurrency` requests
are in flight. A bearer token, if the service wants one, is read from the environment variable
that `token_env` names, and never written anywhere (credentials in the URL go as HTTP Basic auth
instead: use one or the other); error messages show the URL without its
credentials or query.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any
from urllib.parse import urlsplit

import httpx

from relax_hpc.rewards.scoring import RewardError, RewardInput

RETRIED = {429, 500, 502, 503, 504}


def public_url(url: str) -> str:
    """The URL without user info, query or fragment (what errors and logs may show)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def payload(item: RewardInput) -> dict[str, Any]:
    prompt = item.row.prompt if isinstance(item.row.prompt, str) else list(item.row.prompt)
    return {"response": item.response, "answer": item.answer, "prompt": prompt, "fields": dict(item.row.fields)}


class RemoteReward:
    """The reward function `remote` (an async callable of one RewardInput, or of a list)."""

    def __init__(
        self, url: str, timeout_s: float, retries: int, backoff_s: float, concurrency: int, token_env: str = ""
    ) -> None:
        if not url:
            raise RewardError("reward.name=remote needs reward.remote.url")
        headers = {}
        if token_env:
            token = os.environ.get(token_env)
            if not token:
                raise RewardError(f"reward.remote.token_env: the environment variable {token_env} is not set")
            headers["Authorization"] = f"Bearer {token}"
        self.url, self.where = url, public_url(url)
        self.retries, self.backoff_s = retries, backoff_s
        self.client = httpx.AsyncClient(timeout=timeout_s, headers=headers)
        self.slots = asyncio.Semaphore(concurrency)

    async def __call__(self, item: RewardInput | list[RewardInput]) -> Any:
        if isinstance(item, list):
            answer = await self._post({"samples": [payload(i) for i in item]})
            return answer.get("rewards") if isinstance(answer, dict) else answer
        answer = await self._post(payload(item))
        return answer.get("reward") if isinstance(answer, dict) else answer

    async def _post(self, body: dict[str, Any]) -> Any:
        wait = self.backoff_s
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            async with self.slots:
                try:
                    response = await self.client.post(self.url, json=body)
                except httpx.TransportError as e:  # refused, reset, timed out
                    if last:
                        raise RewardError(f"{self.where}: {type(e).__name__}") from None
                else:
                    if response.status_code < 300:
                        return response.json()
                    if response.status_code not in RETRIED or last:
                        raise RewardError(f"{self.where}: HTTP {response.status_code}: {response.text[:200]}")
            await asyncio.sleep(wait)
            wait *= 2
        raise AssertionError("unreachable: the last attempt returns or raises")
