"""The agent gateway (relax_hpc.agents) with the official openai SDK over a real socket, on two
real built-in engine processes serving the calculator model: the answers' shapes (whole,
streamed, with logprobs and usage), tool calls, the API's own errors, and the tokens it records,
which are the engine's; then whole runs, in which an agent written against the SDK trains the very
tokens the built-in calculator environment trains."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from relax_hpc.agents.env import AgentEnv
from relax_hpc.agents.examples import calculator_anthropic as anthropic_agent
from relax_hpc.agents.examples import calculator_responses as responses_agent
from relax_hpc.agents.examples.calculator_openai import TOOLS, solve
from relax_hpc.config.load import read_frozen
from relax_hpc.envs.calculator import tool_output
from relax_hpc.envs.context import GenerateCall, call_seed
from relax_hpc.exchange.spool import read_batch
from relax_hpc.rollout.driver import Driver
from tests.integration.conftest import REPO, Engines, Job, make_run

pytestmark = pytest.mark.integration

EXAMPLES = {"chat": solve, "responses": responses_agent.solve, "anthropic": anthropic_agent.solve}

AGENT = (
    f"model.path={REPO / 'assets' / 'tiny-qwen3-calculator'}",
    f"data.path={REPO / 'assets' / 'calculator.jsonl'}",
    "rollout.max_new_tokens=8",
    "rollout.env.name=agent",
    "rollout.env.settings={agent: relax_hpc.agents.examples.calculator_openai:solve, parser: calculator}",
)


@pytest.fixture(scope="module")
def driver(tmp_path_factory, engine_forks):
    cfg, paths = make_run(tmp_path_factory.mktemp("gateway") / "run", *AGENT)
    engines = Engines(cfg, paths, engine_forks)
    for i in range(2):
        engines.start(f"engine-{i}")
    engines.wait_registered(2)
    driver = Driver(read_frozen(paths.config), paths)
    driver.pool.refresh(force=True)
    yield driver
    engines.stop()


async def _open(driver, row: int = 0, seed: int = 11):
    ctx = driver.rounds._contexts([row], [seed], False)[0]
    gateway = await driver.rounds.env.__self__._gateway(ctx)  # the AgentEnv whose rollout the driver runs
    session, key = gateway.open(ctx, 32)
    return gateway, session, ctx, AsyncOpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)


def _engine_tokens(driver, ids: list[int], ctx, call: int) -> list[int]:
    """What the engines sample for `ids` with the episode's seed of its `call`-th request."""
    params = {**ctx.sampling, "stop_token_ids": ctx.encode(")"), "sampling_seed": call_seed(ctx.seed, call)}
    (out,) = driver.policy.generate([GenerateCall(ids, params, session=ctx.session)])
    return out.token_ids


def test_a_chat_completion_is_what_the_engine_sampled_with_usage_and_logprobs(driver):
    async def run():
        _, session, ctx, client = await _open(driver)
        question = str(ctx.row.prompt)
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": question}], tools=TOOLS, logprobs=True
        )
        (segment,) = session.transcript.segments
        return reply, segment, ctx

    reply, segment, ctx = asyncio.run(run())
    sampled = [t for t, m in zip(segment.tokens, segment.loss_mask, strict=True) if m]
    assert sampled == _engine_tokens(driver, segment.prompt_ids, ctx, 0)  # recorded exactly as sampled
    assert segment.prompt_ids == ctx.encode(str(ctx.row.prompt))
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(segment.prompt_ids), len(sampled))
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [round(t.logprob, 5) for t in choice.logprobs.content] == [round(x, 5) for x in segment.logprobs]
    if choice.message.tool_calls:  # "(+)": a call of the calculator tool
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "calculator"
        assert json.loads(choice.message.tool_calls[0].function.arguments)["op"] in "+-*"
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content == ctx.decode(sampled)


def test_a_streamed_completion_has_the_chunks_an_sdk_expects(driver):
    async def run():
        _, session, ctx, client = await _open(driver, row=1)
        stream = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": str(ctx.row.prompt)}], tools=TOOLS,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        return chunks, session

    chunks, session = asyncio.run(run())
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[0].delta.role == "assistant" and choices[-1].finish_reason in ("stop", "length", "tool_calls")
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    (segment,) = session.transcript.segments
    assert chunks[-1].usage.completion_tokens == sum(segment.loss_mask)
    called = [d.tool_calls[0] for d in (c.delta for c in choices) if d.tool_calls]
    assert bool(called) == (choices[-1].finish_reason == "tool_calls")


@pytest.mark.parametrize("api", sorted(EXAMPLES))
def test_an_example_agent_s_tool_calls_round_trip_token_for_token(driver, api):
    """Rows until the model calls the calculator, through each API's own SDK: the tool's output
    comes back as observation tokens, rendered from the tool message alone, and the answer
    continues from the sampled ids."""

    async def run():
        for row in range(12):
            gateway, session, ctx, _ = await _open(driver, row=row, seed=row)
            key = f"rk-{session.id}-{gateway._mac(session.id)}"
            reward = await EXAMPLES[api](gateway.base_url, key, dict(ctx.row.fields))
            gateway.close(session)
            if 0 in session.transcript.segments[0].loss_mask:
                return reward, session, ctx
        raise AssertionError("no row's model called the calculator")

    reward, session, ctx = asyncio.run(run())
    (segment,) = session.transcript.segments
    assert session.requests == 2 and reward is None and not session.refused  # a call, then an answer
    mask = segment.loss_mask
    call = segment.tokens[: mask.index(0)]  # the first turn, as sampled: "(+)"
    observed = segment.tokens[mask.index(0) : mask.index(1, mask.index(0))]
    op = ctx.decode(call).strip()[1]
    assert observed == ctx.encode(tool_output(str(ctx.row.prompt), op))  # what the built-in env appends
    assert all(v >= 0 for v, m in zip(segment.versions, mask, strict=True) if m)  # every sampled token's version


def test_the_responses_api_whole_and_streamed(driver):
    async def run():
        _, session, ctx, client = await _open(driver, row=2)
        question = str(ctx.row.prompt)
        whole = await client.responses.create(model="policy", input=question, tools=responses_agent.TOOLS)
        stream = await client.responses.create(model="policy", input=question, tools=responses_agent.TOOLS, stream=True)
        events = [event async for event in stream]
        return whole, events, session

    whole, events, session = asyncio.run(run())
    first, second = session.transcript.segments  # the same question asked twice: a segment each
    assert whole.usage is not None and whole.usage.input_tokens == len(first.prompt_ids)
    assert whole.usage.output_tokens == sum(first.loss_mask)
    assert [o.type for o in whole.output] in (["message"], ["function_call"])
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    final = events[-1].response
    assert final.usage is not None and final.usage.output_tokens == sum(second.loss_mask)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_anthropic_messages_whole_and_streamed(driver):
    async def run():
        gateway, session, ctx, _ = await _open(driver, row=3)
        key = f"rk-{session.id}-{gateway._mac(session.id)}"
        client = AsyncAnthropic(base_url=gateway.base_url.removesuffix("/v1"), api_key=key, max_retries=0)
        user: list[Any] = [{"role": "user", "content": str(ctx.row.prompt)}]
        asked: dict[str, Any] = {"model": "policy", "max_tokens": 8, "messages": user}
        whole = await client.messages.create(**asked, tools=anthropic_agent.TOOLS)
        async with client.messages.stream(**asked, tools=anthropic_agent.TOOLS) as stream:
            streamed = await stream.get_final_message()
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(**asked, thinking={"type": "enabled", "budget_tokens": 1024})
        gateway.close(session)
        with pytest.raises(anthropic.AuthenticationError):
            await client.messages.create(**asked)
        return whole, streamed, refused.value, session

    whole, streamed, refused, session = asyncio.run(run())
    first, second = session.transcript.segments
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (len(first.prompt_ids), sum(first.loss_mask))
    assert whole.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert streamed.usage.output_tokens == sum(second.loss_mask) and streamed.stop_reason == (
        "tool_use" if any(b.type == "tool_use" for b in streamed.content) else streamed.stop_reason
    )
    assert "thinking" in str(refused.message)


def test_the_api_s_own_errors_for_what_the_gateway_refuses(driver):
    async def run():
        gateway, session, ctx, client = await _open(driver)
        user = [{"role": "user", "content": str(ctx.row.prompt)}]
        errors = {}
        refused: dict[str, dict[str, Any]] = {
            "n": {"n": 2}, "temperature": {"temperature": 0.3}, "unknown": {"extra_body": {"guided_json": {}}},
            "tool_choice": {"tool_choice": "required"},
        }  # fmt: skip
        for name, kwargs in refused.items():
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="policy", messages=user, **kwargs)
            errors[name] = info.value
        models = await client.models.list()
        gateway.close(session)
        with pytest.raises(openai.AuthenticationError) as ended:
            await client.chat.completions.create(model="policy", messages=user)
        forged = AsyncOpenAI(base_url=gateway.base_url, api_key=f"rk-{session.id}-{'0' * 64}", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await forged.models.list()
        return errors, models, ended.value

    errors, models, ended = asyncio.run(run())
    assert errors["n"].param == "n" and errors["temperature"].param == "temperature"
    assert "Unrecognized request argument supplied: guided_json" in errors["unknown"].message
    assert errors["tool_choice"].param == "tool_choice"
    assert [m.id for m in models.data] == ["policy"]
    assert ended.code == "invalid_api_key"


async def crashing_agent(base_url: str, api_key: str, row: dict) -> float | None:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    raise RuntimeError("the agent's own bug")


async def hanging_agent(base_url: str, api_key: str, row: dict) -> float | None:
    await asyncio.sleep(3600)
    return 1.0


async def garbage_agent(base_url: str, api_key: str, row: dict) -> float | None:
    async with httpx.AsyncClient() as client:  # not JSON, then JSON of no API
        headers = {"Authorization": f"Bearer {api_key}"}
        first = await client.post(f"{base_url}/chat/completions", content=b"{not json", headers=headers)
        second = await client.post(f"{base_url}/chat/completions", json={"prompt": 1}, headers=headers)
    assert (first.status_code, second.status_code) == (400, 400)
    return 1.0  # it claims success; the gateway refused its requests


def test_a_round_s_episodes_start_the_gateway_together(driver):
    """Every episode of a round asks a new environment's gateway to start at once: all of them get
    its address (those after the first once had none while it was binding, and failed)."""
    env = AgentEnv({"agent": "relax_hpc.agents.examples.calculator_openai:solve", "parser": "calculator"})
    contexts = driver.rounds._contexts(list(range(16)), list(range(16)), False)

    async def run():
        return await asyncio.gather(*(env.rollout(ctx.row, ctx) for ctx in contexts))

    episodes = asyncio.run(run())
    assert [t.status for (t, *_) in episodes].count("failed") == 0
    assert all(t.metrics["agent_requests"] >= 1 for (t, *_) in episodes)


@pytest.mark.parametrize("agent, cause", [("crashing", "error"), ("hanging", "timeout"), ("garbage", "refused")])
def test_a_bad_agent_fails_its_own_episode(driver, agent, cause):
    """An agent that raises, hangs past its limit or sends garbage ends its episode as failed,
    reward 0 and the cause counted, within its limit plus 5 s; nothing is raised to the run."""
    env = AgentEnv({"agent": f"tests.integration.test_agent_gateway:{agent}_agent", "parser": "calculator",
                    "timeout_s": 2})  # fmt: skip
    ctx = driver.rounds._contexts([0], [5], False)[0]
    started = time.monotonic()
    (trajectory,) = asyncio.run(env.rollout(ctx.row, ctx))
    assert time.monotonic() - started < 2 + 5
    assert (trajectory.status, trajectory.reward) == ("failed", 0.0)
    assert trajectory.metrics[f"agent_failed_{cause}"] == 1.0
    trajectory.check()  # a trajectory the spool takes, whether or not a request was answered


def _trained(run_dir: Path) -> list:
    return [read_batch(p) for p in sorted((run_dir / "spool" / "claimed").glob("step-*/b*.h5"))]


@pytest.mark.slow
def test_an_sdk_agent_trains_the_tokens_the_built_in_calculator_environment_trains(tmp_path):
    """Two short on-policy runs of one seed: configs/tiny-agentic-grpo.yaml (the built-in
    environment) and configs/tiny-agent-openai.yaml (the same task through the openai SDK and the
    gateway). Every trained batch is the same: tokens, loss masks and rewards exactly, the engine's
    log-probabilities to float rounding."""
    short = ("trainer.total_steps=3", "rollout.prompts_per_step=8", "rollout.max_staleness=0",
             "rollout.eval_every=0", "ckpt.keep_trained_batches=true")  # fmt: skip
    batches = {}
    for name in ("tiny-agentic-grpo", "tiny-agent-openai"):
        job = Job(tmp_path / name, *short, config=REPO / "configs" / f"{name}.yaml")
        assert job.run(timeout_s=300) == 0, job.text()[-3000:]
        batches[name] = _trained(tmp_path / name)
    built_in, agent = batches["tiny-agentic-grpo"], batches["tiny-agent-openai"]
    assert len(built_in) == len(agent) == 3
    for a, b in zip(built_in, agent, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
        assert a.rewards.tolist() == b.rewards.tolist()
        # The engines batch the agent's requests as they come over HTTP, not as one round: the
        # log-probabilities differ in float rounding (about 1e-6), the seeded tokens do not.
        assert np.allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-4)
    assert any(0 in m for m in (b.loss_mask.tolist() for b in agent))  # tool outputs among them
