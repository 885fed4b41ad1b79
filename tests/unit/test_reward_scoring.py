"""Rewards by name, with settings; what a failing reward does to its samples and to the run; the
remote reward against a real HTTP server started by the test."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import pytest

from relax_hpc.config import load_config
from relax_hpc.data.prompts import PromptRow, load_prompts
from relax_hpc.envs.base import Sampled
from relax_hpc.rewards import RewardError, RewardInput, Scorer, make_scorer
from relax_hpc.rewards.remote import RemoteReward, public_url
from relax_hpc.rollout.rounds import Rounds

REPO = Path(__file__).resolve().parents[2]
ROW = PromptRow(0, "2+2=", "4", fields={"prompt": "2+2=", "answer": "4", "level": 3})


def item(response: str) -> RewardInput:
    return RewardInput(response, ROW.answer, ROW, {})


def score(scorer: Scorer, responses: list[str]):
    return asyncio.run(scorer.score([item(r) for r in responses]))


@pytest.fixture
def rewards_module(monkeypatch) -> ModuleType:
    module = ModuleType("my_rewards")

    def graded(sample: RewardInput, bonus: float = 0.0) -> float:
        if sample.response == "boom":
            raise ValueError("cannot parse")
        if sample.response == "text":
            return "high"  # type: ignore[return-value]  # what the test checks is refused
        if sample.response == "nan":
            return math.nan
        return float(sample.response == sample.answer) + bonus * sample.row.fields.get("level", 0)

    async def slow(sample: RewardInput) -> float:
        await asyncio.sleep(5 if sample.response == "slow" else 0)
        return 1.0

    def by_length(samples: list[RewardInput]) -> list[float]:
        return [float(len(s.response)) for s in samples]

    for fn in (graded, slow, by_length):
        setattr(module, fn.__name__, fn)
    monkeypatch.setitem(sys.modules, "my_rewards", module)
    return module


def test_a_module_function_gets_its_settings_and_each_failure_fails_its_sample_only(rewards_module):
    cfg = load_config(None, ["reward.name=my_rewards:graded", "reward.settings={bonus: 0.5}"])
    results = score(make_scorer(cfg.reward), ["4", "5", "boom", "text", "nan"])
    assert [r.reward for r in results] == [2.5, 1.5, None, None, None]
    assert results[2].error == "ValueError: cannot parse"
    assert results[3].error == "returned 'high', not a finite number" and "nan" in (results[4].error or "")


def test_an_async_reward_past_its_time_limit_fails_only_that_sample(rewards_module):
    cfg = load_config(None, ["reward.name=my_rewards:slow", "reward.timeout_s=0.5"])
    results = score(make_scorer(cfg.reward), ["fast", "slow", "fast"])
    assert [r.reward for r in results] == [1.0, None, 1.0] and results[1].error == "timed out"


def test_a_batched_reward_scores_a_round_at_once_and_must_return_one_number_each(rewards_module):
    cfg = load_config(None, ["reward.name=my_rewards:by_length", "reward.batched=true"])
    assert [r.reward for r in score(make_scorer(cfg.reward), ["a", "abc"])] == [1.0, 3.0]
    short = Scorer(lambda samples: [1.0], {}, batched=True, timeout_s=5)
    assert {r.error for r in score(short, ["a", "b"])} == {"TypeError: a batched reward returned list, not 2 numbers"}


def test_unknown_rewards_are_refused_by_name():
    for name, message in (
        ("exact_matsch", r"a built-in \(exact_match, boxed_match\) or module:function"),
        ("no_such_module:f", r"cannot import no_such_module"),
        ("json:no_such_function", r"json has no function 'no_such_function'"),
    ):
        with pytest.raises(RewardError, match=message):
            make_scorer(load_config(None, [f"reward.name={name}"]).reward)
    with pytest.raises(RewardError, match=r"the built-in reward exact_match takes no settings"):
        make_scorer(load_config(None, ["reward.settings={x: 1}"]).reward)


def test_the_old_key_rollout_reward_still_names_the_reward():
    assert load_config(None, ["rollout.reward=boxed_match"]).reward.name == "boxed_match"


class Fixed:
    """A policy that answers every call with the same text."""

    def __init__(self, tokenizer, text: str) -> None:
        self.tokenizer, self.text = tokenizer, text

    def generate(self, calls):
        ids = self.tokenizer(self.text)["input_ids"]
        return [Sampled(ids, [-0.1] * len(ids), [0] * len(ids), "stop", self.text) for _ in calls]


def test_failed_samples_leave_their_group_counted_and_recorded_and_too_many_stop_the_run(rewards_module):
    from transformers import PreTrainedTokenizerFast

    overrides = [
        "reward.name=my_rewards:graded", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "reward.max_failed_share=0.5",
    ]  # fmt: skip
    cfg = load_config(REPO / "configs/tiny-grpo.yaml", overrides)
    tok = PreTrainedTokenizerFast.from_pretrained(cfg.model.path)
    rows = load_prompts(cfg.data.path, "prompt", "answer")
    failures: list[dict] = []
    rounds = Rounds(
        cfg,
        rows,
        [tok(r.prompt)["input_ids"] for r in rows],
        tok,
        Fixed(tok, "boom"),
        make_scorer(cfg.reward),
        failures.append,
    )
    with pytest.raises(
        RewardError, match=r"failed for 4 of 4 samples .*max_failed_share=0.5; the first: ValueError: cannot parse"
    ):
        asyncio.run(rounds.sample_round(0, 0))
    assert (
        len(failures) == 4 and failures[0]["reason"] == "ValueError: cannot parse" and failures[0]["response"] == "boom"
    )
    # Under the limit: the failed samples are left out, the rest of their group trains.
    mixed = MixedAnswers(tok)
    rounds = Rounds(cfg, rows, [tok(r.prompt)["input_ids"] for r in rows], tok, mixed, make_scorer(cfg.reward))
    groups = asyncio.run(rounds.sample_round(0, 0))
    assert [len(g.trajectories) for g in groups] == [1, 1] and rounds.take_stats()["reward_failed"] == 2


class MixedAnswers(Fixed):
    """Every second call's answer makes the reward raise."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, "")

    def generate(self, calls):
        out = []
        for k, _ in enumerate(calls):
            text = "boom" if k % 2 else "7"
            ids = self.tokenizer(text)["input_ids"]
            out.append(Sampled(ids, [-0.1] * len(ids), [0] * len(ids), "stop", text))
        return out


# -- the remote reward, against a real HTTP server -------------------------------------------------


class Service(BaseHTTPRequestHandler):
    """Exact match over HTTP; fails the first `flaky` requests with 503; records what it got."""

    flaky = 0
    seen: ClassVar[list[dict]] = []
    headers_seen: ClassVar[list[str]] = []

    def do_POST(self) -> None:  # http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        type(self).headers_seen.append(self.headers.get("Authorization", ""))
        if type(self).flaky > 0:
            type(self).flaky -= 1
            self._send(503, {"error": "busy"})
        elif "samples" in body:
            self._send(200, {"rewards": [float(s["response"] == s["answer"]) for s in body["samples"]]})
        elif body["response"] == "bad request":
            self._send(400, {"error": "no"})
        else:
            self._send(200, {"reward": float(body["response"] == body["answer"])})

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def service() -> Iterator[str]:
    Service.flaky, Service.seen, Service.headers_seen = 0, [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://user:secret@127.0.0.1:{server.server_address[1]}/score?key=secret"
    server.shutdown()


def test_the_remote_reward_retries_a_busy_service_and_sends_the_row(service, monkeypatch):
    monkeypatch.setenv("JUDGE_TOKEN", "tok-123")
    Service.flaky = 2
    plain = service.replace("user:secret@", "")  # credentials in a URL would go as Basic auth instead
    remote = RemoteReward(plain, timeout_s=5, retries=3, backoff_s=0.01, concurrency=4, token_env="JUDGE_TOKEN")
    results = asyncio.run(Scorer(remote, {}, batched=False, timeout_s=10).score([item("4"), item("5")]))
    assert [r.reward for r in results] == [1.0, 0.0]
    assert len(Service.seen) == 4 and Service.seen[-1]["fields"]["level"] == 3 and Service.seen[-1]["prompt"] == "2+2="
    assert set(Service.headers_seen) == {"Bearer tok-123"}


def test_the_remote_reward_gives_up_with_a_reason_that_shows_no_credentials(service):
    remote = RemoteReward(service, timeout_s=5, retries=1, backoff_s=0.01, concurrency=4)
    Service.flaky = 5
    (busy,) = asyncio.run(Scorer(remote, {}, batched=False, timeout_s=10).score([item("4")]))
    assert busy.reward is None and "HTTP 503" in (busy.error or "") and "secret" not in (busy.error or "")
    assert len(Service.seen) == 2  # one try and one retry
    Service.flaky = 0
    (bad,) = asyncio.run(Scorer(remote, {}, batched=False, timeout_s=10).score([item("bad request")]))
    assert "HTTP 400" in (bad.error or "") and len(Service.seen) == 3  # a 4xx is not retried
    assert (
        public_url(service) == service.split("//")[0] + "//127.0.0.1:" + service.split(":")[-1].split("/")[0] + "/score"
    )


def test_the_remote_reward_batched_and_a_missing_token(service, monkeypatch):
    remote = RemoteReward(service, timeout_s=5, retries=0, backoff_s=0, concurrency=1)
    results = asyncio.run(Scorer(remote, {}, batched=True, timeout_s=10).score([item("4"), item("x")]))
    assert [r.reward for r in results] == [1.0, 0.0] and len(Service.seen) == 1
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    with pytest.raises(RewardError, match="the environment variable NO_SUCH_TOKEN is not set"):
        RemoteReward(service, 5, 0, 0, 1, token_env="NO_SUCH_TOKEN")


class GreedyKnows(Fixed):
    """Answers right at temperature 0 and wrong when sampling: the greedy baseline shows."""

    def __init__(self, tokenizer, answers: dict[tuple[int, ...], str]) -> None:
        super().__init__(tokenizer, "")
        self.answers = answers

    def generate(self, calls):
        out = []
        for call in calls:
            self.text = str(int(self.answers[tuple(call.token_ids)])) if call.sampling["temperature"] == 0 else "x"
            out.extend(super().generate([call]))
        return out


def test_remax_scores_one_greedy_episode_per_prompt_as_its_groups_baseline():
    from transformers import PreTrainedTokenizerFast

    cfg = load_config(REPO / "configs/tiny-remax.yaml", ["rollout.prompts_per_step=3", "rollout.group_size=2"])
    tok = PreTrainedTokenizerFast.from_pretrained(cfg.model.path)
    rows = load_prompts(cfg.data.path, "prompt", "answer")
    ids = [tok(r.prompt)["input_ids"] for r in rows]
    policy = GreedyKnows(tok, {tuple(i): r.answer for i, r in zip(ids, rows, strict=True)})
    groups = asyncio.run(Rounds(cfg, rows, ids, tok, policy, make_scorer(cfg.reward)).sample_round(0, 0))
    assert [g.baseline for g in groups] == [1.0, 1.0, 1.0]  # the greedy answers are right
    assert all(len(g.trajectories) == 2 and g.rewards == [0.0, 0.0] for g in groups)  # only sampled ones train
