"""Environments: token in, token out through the spool to the trainer's tensors; how episodes'
generate calls are batched and seeded; how environments are named in a config."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from relax_hpc.config import load_config
from relax_hpc.data.prompts import PromptRow, load_prompts
from relax_hpc.envs import load_env
from relax_hpc.envs.base import EnvError, Sampled, Trajectory
from relax_hpc.envs.calculator import Calculator, tool_output
from relax_hpc.envs.context import Batcher, EpisodeContext, GenerateCall, call_seed, run_episodes
from relax_hpc.exchange.spool import BatchHeader, read_batch, write_batch
from relax_hpc.inprocess import LocalPolicy
from relax_hpc.rewards import make_scorer
from relax_hpc.rollout.plan import Group, to_sample_batch
from relax_hpc.rollout.rounds import Rounds
from relax_hpc.trainer.batching import share_of
from relax_hpc.trainer.claims import fresh_samples

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "assets" / "tiny-qwen3-calculator"
SAMPLING = {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def policy() -> LocalPolicy:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(MODEL)
    return LocalPolicy(Qwen3ForCausalLM.from_pretrained(MODEL).eval(), tokenizer, None)


class Recording:
    """A policy that keeps what another one sampled."""

    def __init__(self, policy: LocalPolicy) -> None:
        self.policy = policy
        self.sampled: list[Sampled] = []

    def generate(self, calls):
        out = self.policy.generate(calls)
        self.sampled += out
        return out


class CountingPolicy:
    """Records each batch of calls it gets; answers with fixed tokens."""

    def __init__(self) -> None:
        self.batches: list[list[GenerateCall]] = []

    def generate(self, calls):
        self.batches.append(list(calls))
        return [Sampled([7, 8], [-0.5, -0.25], [3, 3], "stop", "78") for _ in calls]


async def three_turns(row: PromptRow, ctx) -> Trajectory:
    """Sample, read an observation, sample, read another, sample."""
    trajectory = ctx.trajectory()
    for turn in range(3):
        trajectory.add_sampled(await ctx.generate(trajectory.ids))
        if turn < 2:
            trajectory.add_observation(ctx.encode(f"({turn})"))
    return trajectory


def context(row: PromptRow, ids: list[int], seed: int, batcher: Batcher, tokenizer) -> EpisodeContext:
    return EpisodeContext(row, ids, seed, batcher, SAMPLING, tokenizer, {})


def test_a_three_turn_trajectory_trains_exactly_the_sampled_and_the_observed_tokens(policy, tmp_path):
    tok = policy.tokenizer
    rows = load_prompts(REPO / "assets" / "calculator.jsonl", "prompt", "answer")[:2]
    prompts = [tok(r.prompt)["input_ids"] for r in rows]
    recording = Recording(policy)  # what the engine sampled, call by call
    batcher = Batcher(recording)
    contexts = [context(r, p, 100 + k, batcher, tok) for k, (r, p) in enumerate(zip(rows, prompts, strict=True))]
    episodes = asyncio.run(run_episodes(three_turns, contexts))
    sampled = recording.sampled
    assert len(sampled) == 6  # 3 batches of 2 calls: the two episodes' turns went together
    trajectories = [ts[0] for ts in episodes]
    for k, t in enumerate(trajectories):
        turns = sampled[k::2]
        observations = [tok("(0)")["input_ids"], tok("(1)")["input_ids"]]
        expected = prompts[k] + turns[0].token_ids + observations[0] + turns[1].token_ids + observations[1]
        assert t.ids == expected + turns[2].token_ids
    batch_path = tmp_path / "b.h5"
    write_batch(batch_path, to_sample_batch(5, [Group(1, 0, trajectories, [1.0, 0.0])]), writer="test")
    batch = read_batch(batch_path)
    train, _ = share_of(batch, [0, 1], 0, 1, tok.pad_token_id)
    for k, t in enumerate(trajectories):
        ids = t.ids
        turns = sampled[k::2]
        assert train.input_ids[k, : len(ids)].tolist() == ids  # token in, token out: nothing re-encoded
        # targets[i] = ids[i + 1]: the loss mask marks exactly the sampled tokens' positions
        mask = train.loss_mask[k, : len(ids) - 1].tolist()
        want = [0] * (len(prompts[k]) - 1) + [1] * 3 + [0] * 3 + [1] * 3 + [0] * 3 + [1] * 3
        assert mask == want
        logprobs = train.rollout_logprobs[k][train.loss_mask[k].bool()].tolist()
        assert logprobs == pytest.approx([lp for s in turns for lp in s.logprobs])
        assert t.versions == [0] * 3 + [-1] * 3 + [0] * 3 + [-1] * 3 + [0] * 3


def test_episodes_calls_are_batched_while_they_all_wait_and_seeded_per_call():
    policy = CountingPolicy()
    batcher = Batcher(policy)
    row = PromptRow(0, "1+1=", "2")
    contexts = [context(row, [5, 6], seed, batcher, None) for seed in (11, 12, 13)]

    async def two_calls(row, ctx):
        t = ctx.trajectory()
        t.add_sampled(await ctx.generate(t.ids))
        return t.add_sampled(await ctx.generate(t.ids, {"max_new_tokens": 1}))

    episodes = asyncio.run(run_episodes(two_calls, contexts))
    assert [len(b) for b in policy.batches] == [3, 3]
    assert [c.sampling["sampling_seed"] for c in policy.batches[0]] == [11, 12, 13]  # the plan's seeds
    assert [c.sampling["sampling_seed"] for c in policy.batches[1]] == [call_seed(s, 1) for s in (11, 12, 13)]
    assert policy.batches[1][0].sampling["max_new_tokens"] == 1 and policy.batches[1][0].token_ids == [5, 6, 7, 8]
    assert episodes[0][0].versions == [3, 3, 3, 3]


def test_a_broken_trajectory_is_refused_with_what_is_wrong():
    async def broken(row, ctx):
        t = ctx.trajectory()
        t.tokens.append(9)  # a token without its mask, log-probability and version
        return t

    async def nothing(row, ctx):
        return None

    batcher = Batcher(CountingPolicy())
    ctx = context(PromptRow(0, "x", "y"), [5], 1, batcher, None)
    with pytest.raises(EnvError, match=r"trajectory arrays differ in length: tokens 1, loss_mask 0"):
        asyncio.run(run_episodes(broken, [ctx]))
    with pytest.raises(EnvError, match=r"returned None, not a Trajectory"):
        asyncio.run(run_episodes(nothing, [ctx]))


def test_environments_are_named_by_builtin_or_module_attribute(monkeypatch):
    assert load_env("single_turn", {}).__name__ == "single_turn"
    assert isinstance(getattr(load_env("calculator", {"max_tool_calls": 2}), "__self__", None), Calculator)
    module = ModuleType("my_envs")

    async def mine(row, ctx):
        return ctx.trajectory()

    class WithSettings:
        def __init__(self, settings):
            self.n = settings["n"]

        async def rollout(self, row, ctx):
            return ctx.trajectory()

    for name, value in (("mine", mine), ("WithSettings", WithSettings), ("plain", lambda row, ctx: None)):
        setattr(module, name, value)
    monkeypatch.setitem(sys.modules, "my_envs", module)
    assert load_env("my_envs:mine", {}) is mine
    bound: Any = load_env("my_envs:WithSettings", {"n": 3})
    assert bound.__self__.n == 3
    with pytest.raises(EnvError, match=r"an environment is an async function"):
        load_env("my_envs:plain", {})
    with pytest.raises(EnvError, match=r"my_envs has no attribute 'nope'"):
        load_env("my_envs:nope", {})
    with pytest.raises(EnvError, match=r"cannot import no_such_module"):
        load_env("no_such_module:x", {})
    with pytest.raises(EnvError, match=r"a built-in \(single_turn, calculator, long_tail\) or module:attribute"):
        load_env("calculater", {})
    with pytest.raises(EnvError, match=r"takes no settings"):
        load_env("my_envs:mine", {"n": 1})
    with pytest.raises(ValueError, match=r"unknown calculator settings \['tools'\]"):
        load_env("calculator", {"tools": 1})


def test_the_calculator_appends_the_tools_output_and_scores_the_answer(policy):
    """A round of the calculator task through the batch plan: a call's observation is the tool's
    output for the called operator; the rewards are the answers' exact match (a second call ends
    the episode with reward 0)."""
    cfg = load_config(
        REPO / "configs" / "tiny-agentic-grpo.yaml", ["rollout.prompts_per_step=4", "rollout.group_size=4"]
    )
    rows = load_prompts(cfg.data.path, "prompt", "answer")
    tok = policy.tokenizer
    rounds = Rounds(cfg, rows, [tok(r.prompt)["input_ids"] for r in rows], tok, policy, make_scorer(cfg.reward))
    groups = asyncio.run(rounds.sample_round(0, 0))
    assert len(groups) == 4 and all(len(g.trajectories) == 4 for g in groups)
    calls = 0
    for group in groups:
        row = rows[group.prompt_index]
        question = str(row.prompt)
        for t, reward in zip(group.trajectories, group.rewards, strict=True):
            text = tok.decode(t.tokens)
            if t.metrics["tool_calls"]:
                calls += 1
                op = text[1]
                assert text.startswith(f"({op}){tool_output(question, op)}")
                observed = [tok.decode([x]) for x, m in zip(t.tokens, t.loss_mask, strict=True) if not m]
                assert "".join(observed) == tool_output(question, op)
            assert reward == float(t.response.strip() == row.answer)
    stats = rounds.take_stats()
    assert calls > 0 and stats["env_tool_calls"] == calls / 16 and 0 < stats["masked_token_share"] < 1
    assert json.dumps(stats)  # plain numbers for rollout.jsonl


def test_a_sample_without_sampled_tokens_takes_the_batchs_newest_version():
    """Its completion was cut before the media token it sampled first: it has no token to age.
    At version 0 it made its whole group stale for the trainer (and a batch of such groups stalled
    the run); at the batch's newest version its group trains."""
    sampled = Trajectory([5, 6]).add_sampled(Sampled([7, 8], [-0.1, -0.2], [4, 5], "stop", "", None))
    cut = Trajectory([5, 6]).add_sampled(Sampled([], [], [], "stop", "", None))
    batch = to_sample_batch(6, [Group(1, 0, [sampled, cut], [1.0, 0.0])])
    assert batch.policy_version.tolist() == [4, 5]
    assert batch.newest_version is not None, "derived at construction"
    header = BatchHeader(batch.seq, batch.group_ids, batch.policy_version, batch.rewards, batch.newest_version)
    assert fresh_samples(header, version=6, max_staleness=2) == ([0, 1], [])
