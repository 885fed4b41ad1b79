"""Supervised fine-tuning examples (kind=sft): JSONL rows -> token ids with a loss mask, and the
deterministic order in which the trainer takes them.

An example is the token ids of prompt + response and a mask that is 1 on the response tokens
(what the model learns to produce) and 0 on the prompt's (what it is given). Two row formats:

    prompt_response   {"prompt": "3+4=", "response": "7"}       ids(prompt) + ids(response) + EOS
    messages          {"messages": [{"role": "user", ...}, {"role": "assistant", ...}, ...]}

A `messages` row is rendered with the model's chat template; each assistant message's tokens are
the ids its rendering adds after the conversation before it, prompted for the assistant's turn
(`add_generation_prompt`), so the template's own turn markers stay prompt and the assistant's
end-of-turn token is learnt. A template whose rendering of a conversation is not a prefix of the
rendering of its continuation cannot be split that way, and the row is refused, named.

The order is a pure function of (seed, step), as the RL prompts' are: step s trains examples
s * batch .. (s + 1) * batch - 1 of the stream of epochs, each epoch a fresh permutation seeded by
(seed, epoch). A checkpoint's step is therefore the data position: a resume takes the next batch
exactly where the checkpoint left off.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from relax_hpc.config.schema import SftConfig
from relax_hpc.data.prompts import DatasetError, jsonl_objects


@dataclass(frozen=True, slots=True)
class Example:
    ids: list[int]
    loss_mask: list[int]  # 1: a response token the loss counts


class Tokenizer(Protocol):
    """What an example needs of a tokenizer (transformers' tokenizers have it)."""

    eos_token_id: int | None
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def _text(row: dict[str, Any], key: str, where: str) -> str:
    if key not in row:
        raise DatasetError(f"{where}: no {key!r} field (fields: {', '.join(sorted(row)) or 'none'})")
    value = row[key]
    if not isinstance(value, str) or not value:
        raise DatasetError(f"{where}: {key!r} must be a non-empty string, got {value!r:.60}")
    return value


def prompt_response_example(
    row: dict[str, Any], prompt_key: str, response_key: str, tok: Tokenizer, where: str
) -> Example:
    prompt = tok.encode(_text(row, prompt_key, where), add_special_tokens=False)
    response = tok.encode(_text(row, response_key, where), add_special_tokens=False)
    if tok.eos_token_id is None:
        raise DatasetError(f"{where}: the tokenizer has no EOS token to end the response with")
    response = [*response, tok.eos_token_id]
    return Example(prompt + response, [0] * len(prompt) + [1] * len(response))


def _render(tok: Tokenizer, messages: list[dict[str, Any]], prompt: bool) -> list[int]:
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt, return_dict=False)
    return list(ids)


def messages_example(row: dict[str, Any], key: str, tok: Tokenizer, where: str) -> Example:
    messages = row.get(key)
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: {key!r} must be a non-empty list of chat messages, got {messages!r:.60}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: message {i} must be {{'role': str, 'content': str}}, got {m!r:.60}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DatasetError(f"{where}: no assistant message, so nothing to learn")
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tok, messages[:i], prompt=True) if i else []
        through = _render(tok, messages[: i + 1], prompt=False)
        if through[: len(before)] != before or before[: len(ids)] != ids:
            raise DatasetError(
                f"{where}: the chat template does not render message {i} as a continuation of the messages "
                "before it, so its tokens cannot be told from the prompt's"
            )
        mask += [0] * (len(before) - len(ids)) + [1] * (len(through) - len(before))
        ids = through
    return Example(ids, mask)


def load_examples(
    path: str | Path,
    fmt: str,
    keys: dict[str, str],
    tok: Tokenizer,
    max_tokens: int,
) -> list[Example]:
    """Every row of the JSONL file as an Example; a DatasetError names the first bad row (its
    line number) and what is wrong with it. `keys`: prompt, response, messages (the row fields)."""
    if fmt == "messages" and not tok.chat_template:
        raise DatasetError("sft.format=messages renders rows with the model's chat template, and the model has none")
    examples = []
    for where, row in jsonl_objects(Path(path)):
        if fmt == "messages":
            example = messages_example(row, keys["messages"], tok, where)
        else:
            example = prompt_response_example(row, keys["prompt"], keys["response"], tok, where)
        if len(example.ids) > max_tokens:
            raise DatasetError(f"{where}: {len(example.ids)} tokens, more than sft.max_tokens={max_tokens}")
        examples.append(example)
    if not examples:
        raise DatasetError(f"{path}: no examples")
    return examples


def configured_examples(sft: SftConfig, tok: Tokenizer) -> list[Example]:
    """The examples of an sft job's config (what submit checks and every trainer rank trains on)."""
    assert sft.data is not None, "the config requires sft.data for kind=sft"
    keys = {"prompt": sft.prompt_key, "response": sft.response_key, "messages": sft.messages_key}
    return load_examples(sft.data, sft.format, keys, tok, sft.max_tokens)


def batch_indices(num_examples: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The examples step `step` trains: a pure function of (seed, step), so that the checkpoint's
    step is the data position."""
    first, last = step * batch_size, (step + 1) * batch_size  # positions in the stream of epochs
    epochs = range(first // num_examples, (last - 1) // num_examples + 1)
    stream = np.concatenate([np.random.default_rng([seed, e]).permutation(num_examples) for e in epochs])
    start = first - epochs[0] * num_examples
    return stream[start : start + batch_size].tolist()
