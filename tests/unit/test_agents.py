"""The agent gateway's pieces without engines: tool-call parsers (hermes against SGLang 0.5.23's
own detector), the token-exact transcript on the calculator model's template, and the example
agents' imports."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from relax_hpc.agents.toolcalls import CalculatorParser, HermesParser
from relax_hpc.agents.transcript import BadMessages, Transcript
from relax_hpc.envs.base import Sampled
from relax_hpc.models.tiny import build_qwen3_chat_tokenizer
from tests.sglang_import import import_sglang

REPO = Path(__file__).resolve().parents[2]
CALCULATOR = REPO / "assets" / "tiny-qwen3-calculator"

HERMES_CASES = {
    "one call": 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "several calls": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "B"}}\n</tool_call>'
    ),
    "text around calls": 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call> done',
    "malformed JSON": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
    "cut off by max_tokens": '<tool_call>\n{"name": "get_weather", "arg',
    "no call": "It is sunny in Paris.",
}


@pytest.fixture(scope="module")
def sglang_hermes():
    detector, protocol = import_sglang(
        "sglang.srt.function_call.hermes_detector", "sglang.srt.entrypoints.openai.protocol"
    )
    function = protocol.Function(name="get_weather", parameters={"type": "object", "properties": {"city": {}}})
    return detector.HermesDetector(), [protocol.Tool(type="function", function=function)]


@pytest.mark.parametrize("case", list(HERMES_CASES))
def test_the_hermes_parser_reads_what_sglang_s_detector_reads(case, sglang_hermes):
    detector, tools = sglang_hermes
    text = HERMES_CASES[case]
    theirs = detector.detect_and_parse(text, tools)
    ours = HermesParser().parse(text)
    assert [(c.name, c.arguments) for c in ours.tool_calls] == [
        (c.name, json.loads(c.parameters)) for c in theirs.calls
    ]
    assert (ours.content or "") == theirs.normal_text
    assert ours.failed == (case in ("malformed JSON", "cut off by max_tokens"))  # counted, never raised


def test_the_calculator_parser_makes_the_task_s_call_a_tool_call():
    parsed = CalculatorParser().parse("(+)")
    assert parsed.content is None and [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("calculator", {"op": "+"})
    ]
    assert CalculatorParser().parse("936").tool_calls == [] and not CalculatorParser().parse("936").failed
    assert CalculatorParser().parse("(%)").failed  # looks like a call, is not one: content, counted


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(CALCULATOR)


def sampled(tokenizer, text: str) -> Sampled:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Sampled(ids, [-0.5] * len(ids), [3] * len(ids), "stop", text)


def test_a_conversation_goes_on_from_the_sampled_tokens(tokenizer):
    """The calculator conversation as an agent sends it (arguments re-serialised by the SDK, the
    tool call's id echoed): the sampled ids are kept, only the tool's output is rendered, as an
    observation; the tokens are those relax_hpc.envs.calculator trains."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    transcript = Transcript(tokenizer)
    user = {"role": "user", "content": "936+12="}
    assert transcript.prompt([user]) == encode("936+12=")
    transcript.record(sampled(tokenizer, "(+)"), CalculatorParser().parse("(+)"))
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"op":  "+"}'}}
    assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "948 "}
    assert transcript.prompt([user, assistant, tool]) == encode("936+12=(+)948 ")
    transcript.record(sampled(tokenizer, "948"), CalculatorParser().parse("948"))
    (trajectory,) = transcript.segments
    assert trajectory.prompt_ids == encode("936+12=")
    assert trajectory.tokens == encode("(+)948 948")
    assert trajectory.loss_mask == [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert trajectory.versions == [3, 3, 3, -1, -1, -1, -1, 3, 3, 3]


def test_a_changed_earlier_message_starts_a_new_segment(tokenizer):
    transcript = Transcript(tokenizer)
    transcript.prompt([{"role": "user", "content": "936+12="}])
    transcript.record(sampled(tokenizer, "948"), CalculatorParser().parse("948"))
    ids = transcript.prompt([{"role": "user", "content": "936+13="}, {"role": "user", "content": "?"}])
    assert len(transcript.segments) == 2 and ids == tokenizer("936+13=?", add_special_tokens=False)["input_ids"]
    assert transcript.segments[0].tokens == tokenizer("948", add_special_tokens=False)["input_ids"]


def test_messages_the_gateway_cannot_read_are_the_request_s_error(tokenizer):
    with pytest.raises(BadMessages, match="role"):
        Transcript(tokenizer).prompt([{"role": "robot", "content": "hi"}])
    with pytest.raises(BadMessages, match="not JSON"):
        call = {"function": {"name": "calculator", "arguments": "{op"}}
        Transcript(tokenizer).prompt([{"role": "assistant", "content": "", "tool_calls": [call]}])


def test_the_example_agents_import_only_their_sdk_and_the_standard_library():

    folder = REPO / "relax_hpc" / "agents" / "examples"
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert names - {"__future__"} <= set(sys.stdlib_module_names) | {"openai", "anthropic"}, (path, names)


# The Qwen3 format (relax_hpc.models.tiny: a Qwen3-shaped template written by the project, and a
# tokenizer holding Qwen3's chat tokens as single tokens), with the hermes parser.
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_TEXT = f"<think>\nParis.\n</think>\n\nLet me check.\n{CALL}"


@pytest.fixture(scope="module")
def qwen3():
    return build_qwen3_chat_tokenizer()


def _sample(tokenizer, text: str, eos: bool = True) -> Sampled:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
    return Sampled(ids, [-0.25] * len(ids), [7] * len(ids), "stop", tokenizer.decode(ids, skip_special_tokens=True))


def _render(tokenizer, messages, tools=WEATHER) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_qwen3_format_token_for_token(qwen3):
    """One tool round trip: the sampled call (think block, text, <tool_call>, <|im_end|>) is kept as
    sampled, the tool's result is the template's text after it (the "\\n" that closes the turn,
    then the <tool_response> turn and the generation prompt), and the whole equals a fresh render
    of the conversation: exact tokens, sampled ones masked in."""
    for tag in ("<|im_start|>", "<tool_call>", "</tool_call>", "<think>"):
        assert len(qwen3(tag, add_special_tokens=False)["input_ids"]) == 1
    transcript, parser = Transcript(qwen3), HermesParser()
    user = {"role": "user", "content": "Weather in Paris?"}
    assert transcript.prompt([user], WEATHER) == _render(qwen3, [user])
    first = _sample(qwen3, CALL_TEXT)
    parsed = parser.parse(qwen3.decode(first.token_ids, skip_special_tokens=True))
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]
    transcript.record(first, parsed)
    function = {"name": "get_weather", "arguments": '{"city":"Paris"}'}  # as an SDK sends it back: a string
    echoed = {"role": "assistant", "content": parsed.content, "tool_calls": [{"id": "call_9", "function": function}]}
    meant = {**echoed, "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    tool = {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}
    ids = transcript.prompt([user, echoed, tool], WEATHER)
    assert ids == _render(qwen3, [user, meant, tool])  # the conversation rendered afresh, token for token
    (segment,) = transcript.segments
    n_prompt, n_call = len(segment.prompt_ids), len(first.token_ids)
    assert segment.tokens[:n_call] == first.token_ids and segment.loss_mask[:n_call] == [1] * n_call
    assert set(segment.loss_mask[n_call:]) == {0} and len(ids) > n_prompt + n_call


def test_the_qwen3_template_s_think_drop_starts_a_new_segment(qwen3):
    """A user turn after an assistant's think block makes the template drop that block: the
    conversation so far is no longer a prefix of the render, so a new segment starts, rendered
    whole (what the model sees), and the first keeps what was sampled."""
    transcript, parser = Transcript(qwen3), HermesParser()
    user = {"role": "user", "content": "Weather in Paris?"}
    transcript.prompt([user], WEATHER)
    answer = _sample(qwen3, "<think>\nsunny\n</think>\n\nIt is sunny.")
    transcript.record(answer, parser.parse(qwen3.decode(answer.token_ids, skip_special_tokens=True)))
    said = {"role": "assistant", "content": "<think>\nsunny\n</think>\n\nIt is sunny."}
    again = [user, said, {"role": "user", "content": "And tomorrow?"}]
    assert transcript.prompt(again, WEATHER) == _render(qwen3, again)
    first, second = transcript.segments
    assert first.tokens == answer.token_ids and second.tokens == []
    assert qwen3.decode(second.prompt_ids).count("<think>") == 0  # the block the template dropped
