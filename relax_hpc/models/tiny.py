"""The embedded default policy: a tiny Qwen3-architecture model with a character tokenizer.

No model hub is reachable on the machines this project is tested on, so the policy is built from a
config (random init) and the tokenizer from a fixed alphabet. `tools/make_tiny_policy.py` turns
them into an ordinary HF folder (config.json, model.safetensors, tokenizer.json) that every role
loads with `from_pretrained`, exactly as it would load a real Qwen3 checkpoint.
"""

from __future__ import annotations

import random

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
ALPHABET = "0123456789+-*=?() abcdefghijklmnopqrstuvwxyz"


# The calculator model's chat template (relax_hpc.agents: an agent drives it through the gateway):
# every message is its text alone, and an assistant's calculator call is "(op)", so a conversation
# renders to exactly the tokens relax_hpc.envs.calculator trains (prompt, "(+)", the tool's output
# "936 ", the answer).
CALCULATOR_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{{ m.content or '' }}{%- for c in m.tool_calls -%}({{ c.function.arguments.op }}){%- endfor -%}"
    "{%- else -%}{{ m.content }}{%- endif -%}"
    "{%- endfor -%}"
)


# A chat template of Qwen3's shape, written by this project (no hub here; it has not been
# byte-compared with Qwen's own): a system turn that lists the tools in <tools></tools> and asks
# for <tool_call> blocks, role turns between <|im_start|> and <|im_end|>, an assistant's calls as
# <tool_call> JSON, consecutive tool results as <tool_response> blocks of one user turn, and the
# <think> block of an assistant turn kept only after the last user message (so a later turn
# rewrites an earlier one: the gateway's segment split).
QWEN3_SHAPED_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}"
    "{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content or '' -%}"
    "{%- if '</think>' in content and loop.index0 < ns.last_user -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' + content -}}"
    "{%- for call in m.tool_calls or [] -%}"
    "{%- if loop.first and content -%}{{- '\\n' -}}{%- endif -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' -}}'
    "{{- (call.function.arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
QWEN3_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


def build_qwen3_chat_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer with Qwen3's chat tokens as single tokens, and the Qwen3-shaped
    template: what the gateway's format tests render with (no Qwen3 tokenizer without a hub). As
    in Qwen3's, <|im_start|> and <|im_end|> are special (decoding skips them) and the tool and
    think tags are added tokens that decoding keeps, so a parser reads them."""
    alphabet = sorted(set(ALPHABET + "ABCDEFGHIJKLMNOPQRSTUVWXYZ\n\"{}[]:,.#<>/_'!"))
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1, "<|im_start|>": 2}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # newlines too
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, clean_up_tokenization_spaces=False,
        additional_special_tokens=["<|im_start|>"],
    )  # fmt: skip
    tokenizer.add_tokens(list(QWEN3_ADDED))
    tokenizer.chat_template = QWEN3_SHAPED_CHAT_TEMPLATE
    return tokenizer


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character of ALPHABET, plus pad and eos."""
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1}
    for ch in ALPHABET:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, clean_up_tokenization_spaces=False
    )


def tiny_qwen3_config(tokenizer: PreTrainedTokenizerFast, num_layers: int = 2, hidden_size: int = 128) -> Qwen3Config:
    """A Qwen3 config at toy scale: GQA (4 query heads, 2 kv heads), QK-norm, tied embeddings."""
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def addition_problems() -> list[tuple[str, str]]:
    """The embedded default task: all 100 single-digit additions "a+b=" with their sums."""
    return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]


def format_warmup_rows(count: int, seed: int) -> list[dict[str, str]]:
    """The format-only warm-up's examples (configs/tiny-sft-format.yaml): "a+b=" followed by a
    uniformly random number in 0..18 (the response; EOS follows it). Trained on them, the model
    learns to emit one or two digits and stop, with answers independent of the question, so it
    starts RL near chance (about 1/19) and with maximal answer entropy."""
    gen = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randint(0, hi, (count,), generator=gen) for hi in (10, 10, 19))
    return [
        {"prompt": f"{x}+{y}=", "response": str(z)} for x, y, z in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)
    ]


def teach_addition(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, steps: int, seed: int) -> float:
    """Supervised training on the correct sums: turns the policy into the distillation teacher of
    the embedded default task. Returns the last batch's loss."""
    gen = torch.Generator().manual_seed(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        # c is drawn as the format warm-up drew its random answers: the same stream of a and b.
        a, b, _c = (torch.randint(0, hi, (64,), generator=gen) for hi in (10, 10, 19))
        texts = [(f"{x}+{y}=", str(x + y)) for x, y in zip(a.tolist(), b.tolist(), strict=True)]
        rows = [tokenizer(p)["input_ids"] + tokenizer(ans)["input_ids"] + [tokenizer.eos_token_id] for p, ans in texts]
        width = max(map(len, rows))
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        labels = ids.clone()
        labels[:, :4] = -100  # the prompt "a+b=" is 4 characters: no loss on it
        labels[ids == tokenizer.pad_token_id] = -100
        loss = model(input_ids=ids, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    return float(loss.detach())


def tool_warmup(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, steps: int, seed: int) -> float:
    """Teach the calculator task's *format* only (relax_hpc.envs.calculator): for a question
    "a<op>b=", half the examples answer at once with a random number, half call the calculator
    with a random operator, "(op)", read its output (that operator's result, then a space; not
    trained on) and copy it as the answer. The model learns both forms and to copy a tool's output,
    not which form or operator is right, so RL starts low (about 1/6 of the answers use the right
    operator). Returns the last batch's loss."""
    from relax_hpc.envs.calculator import tool_output

    rng = random.Random(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    loss = torch.tensor(0.0)
    eos = tokenizer.eos_token_id
    for _ in range(steps):
        rows, masks = [], []
        for _ in range(64):
            question = f"{rng.randint(100, 999)}{rng.choice('+-*')}{rng.randint(10, 99)}="
            pieces: list[tuple[str, bool]] = [(question, False)]  # (text, trained on)
            if rng.random() < 0.5:
                pieces.append((str(rng.randint(0, 99999)), True))
            else:
                op = rng.choice("+-*")
                output = tool_output(question, op)
                pieces += [(f"({op})", True), (output, False), (output.strip(), True)]
            ids = [t for text, _ in pieces for t in tokenizer(text)["input_ids"]] + [eos]
            mask = [m for text, m in pieces for _ in tokenizer(text)["input_ids"]] + [True]
            rows.append(ids)
            masks.append(mask)
        width = max(map(len, rows))
        ids_t = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows])
        labels[~torch.tensor([m + [False] * (width - len(m)) for m in masks])] = -100
        loss = model(input_ids=ids_t, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    return float(loss.detach())
