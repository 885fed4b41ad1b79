"""kind=sft: the loss against hand-computed values, which tokens it counts, the rows it refuses
(by line), the data order, and the config rules (what sft refuses, a model.path naming a run)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from relax_hpc.algos.aggregation import Normalizer
from relax_hpc.algos.sft import sft_loss
from relax_hpc.config.load import ConfigError, load_config, read_frozen, to_yaml, validate
from relax_hpc.data.prompts import DatasetError
from relax_hpc.data.sft import batch_indices, load_examples, messages_example, prompt_response_example
from relax_hpc.models.tiny import build_char_tokenizer
from relax_hpc.submit import check_inputs
from relax_hpc.trainer.backend import BackendConfig
from relax_hpc.trainer.build import build_backend
from relax_hpc.trainer.sft_loop import examples_batch
from relax_hpc.trainer.torch_backend import TorchBackend

REPO = Path(__file__).resolve().parents[2]
SFT = REPO / "configs" / "tiny-sft.yaml"
KEYS = {"prompt": "prompt", "response": "response", "messages": "messages"}
# A chat template for the character tokenizer: every character it uses is in its alphabet.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}({{ m['content'] }}){% if m['role'] == 'assistant' %}"
    "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}a({% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    t = build_char_tokenizer()
    t.chat_template = TEMPLATE
    return t


# -- the loss ------------------------------------------------------------------------------------


def test_the_loss_is_the_mean_nll_of_response_tokens_only():
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.125, 1.0], [0.5, 0.5, 0.1, 0.2]]))
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]])  # prompt / padding tokens are 0
    loss, stats = sft_loss(logprobs, mask, "token_mean", Normalizer(tokens=3, sequences=2))
    # (ln 4 + ln 8 + ln 10) / 3: the 0.5s and the 1.0 (prompt, padding) do not count.
    assert loss.item() == pytest.approx((math.log(4) + math.log(8) + math.log(10)) / 3)
    assert stats.sums["tokens"] == 3
    assert stats.sums["nll"] == pytest.approx(math.log(4) + math.log(8) + math.log(10))
    assert stats.maxes["nll"] == pytest.approx(math.log(10)) and stats.mins["nll"] == pytest.approx(math.log(4))


def test_sequence_aggregation_weighs_every_example_the_same():
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.125, 1.0], [0.5, 0.5, 0.1, 0.2]]))
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    loss, _ = sft_loss(logprobs, mask, "seq_mean_token_mean", Normalizer(tokens=3, sequences=2))
    assert loss.item() == pytest.approx(((math.log(4) + math.log(8)) / 2 + math.log(10)) / 2)


def test_a_rank_divides_by_the_global_batch():
    """Two ranks' losses sum to the loss of the whole batch: each divides by the global count."""
    logprobs = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.2]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    whole, _ = sft_loss(logprobs, mask, "token_mean", Normalizer(3, 2))
    parts = [sft_loss(logprobs[i : i + 1], mask[i : i + 1], "token_mean", Normalizer(3, 2))[0] for i in (0, 1)]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item())


# -- examples and masks --------------------------------------------------------------------------


def test_prompt_response_masks_the_prompt_and_learns_the_eos(tok):
    ex = prompt_response_example({"prompt": "3+4=", "response": "7"}, "prompt", "response", tok, "row")
    assert ex.ids == [*tok.encode("3+4=7"), tok.eos_token_id]
    assert ex.loss_mask == [0, 0, 0, 0, 1, 1]
    batch = examples_batch([ex], [0], tok.pad_token_id)
    # Next-token targets: position t scores token t + 1, so the loss counts the targets "7" and EOS.
    scored = batch.targets[batch.loss_mask > 0].tolist()
    assert scored == [tok.convert_tokens_to_ids("7"), tok.eos_token_id]


def test_padding_and_short_rows_are_not_scored(tok):
    long = prompt_response_example({"prompt": "12+34=", "response": "46"}, "prompt", "response", tok, "row")
    short = prompt_response_example({"prompt": "1+1=", "response": "2"}, "prompt", "response", tok, "row")
    batch = examples_batch([long, short], [0, 1], tok.pad_token_id)
    assert batch.loss_mask.sum(-1).tolist() == [3.0, 2.0]  # "46"+EOS, "2"+EOS
    assert (batch.loss_mask * (batch.attention_mask == 0)).sum() == 0


def test_messages_learn_every_assistant_turn_and_only_them(chat_tok):
    row = {
        "messages": [
            {"role": "user", "content": "1+1"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "2+2"},
            {"role": "assistant", "content": "4"},
        ]
    }
    ex = messages_example(row, "messages", chat_tok, "row")
    assert chat_tok.decode(ex.ids) == "u(1+1)a(2)<|im_end|>u(2+2)a(4)<|im_end|>"
    learnt = [chat_tok.decode([t]) for t, m in zip(ex.ids, ex.loss_mask, strict=True) if m]
    # Each assistant turn's content, its end-of-turn and end-of-sequence, never the "a(" the
    # template writes before it (that is the generation prompt).
    assert learnt == ["2", ")", "<|im_end|>", "4", ")", "<|im_end|>"]


def _write(tmp_path: Path, rows: list) -> Path:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("rows", "fmt", "message"),
    [
        ([{"prompt": "1+1=", "response": "2"}, {"prompt": "1+2="}], "prompt_response",
         r":2: no 'response' field \(fields: prompt\)"),
        ([{"prompt": "1+1=", "response": 2}], "prompt_response", r":1: 'response' must be a non-empty string"),
        (["{not json"], "prompt_response", ":1: not valid JSON"),
        (["[1, 2]"], "prompt_response", ":1: a row must be a JSON object"),
        ([{"prompt": "1+1=", "response": "2" * 30}], "prompt_response", r":1: 35 tokens, more than sft.max_tokens"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "messages", ":1: no assistant message"),
        ([{"messages": [{"role": "user"}]}], "messages", r":1: message 0 must be"),
        ([{"messages": "hi"}], "messages", ":1: 'messages' must be a non-empty list"),
    ],
)  # fmt: skip
def test_bad_rows_are_refused_naming_the_line(tmp_path, chat_tok, rows, fmt, message):
    with pytest.raises(DatasetError, match=message):
        load_examples(_write(tmp_path, rows), fmt, KEYS, chat_tok, max_tokens=32)


def test_messages_need_a_chat_template(tmp_path, tok):
    path = _write(tmp_path, [{"messages": [{"role": "assistant", "content": "1"}]}])
    with pytest.raises(DatasetError, match="the model has none"):
        load_examples(path, "messages", KEYS, tok, max_tokens=32)


# -- the order: a pure function of (seed, step) ----------------------------------------------------


def test_each_epoch_takes_every_example_once_across_batch_boundaries():
    steps = [batch_indices(10, 4, s, seed=3) for s in range(5)]  # 20 examples: two epochs
    stream = [i for s in steps for i in s]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:]  # a fresh order each epoch
    assert batch_indices(10, 4, 2, seed=3) == steps[2]  # the step alone says where the data is
    assert batch_indices(10, 4, 2, seed=4) != steps[2]


# -- the config ----------------------------------------------------------------------------------


def test_an_sft_config_refuses_rl_sections_and_what_makes_no_sense():
    with pytest.raises(ConfigError, match="rollout: a kind=sft job has no rollout"):
        load_config(SFT, ["rollout.num_engines=4"], base_dir=REPO)
    with pytest.raises(ConfigError, match=r"sft\.data is required"):
        load_config(None, ["kind=sft"], base_dir=REPO)
    with pytest.raises(ConfigError, match=r"sft\.batch_size must be at least trainer\.num_ranks"):
        load_config(SFT, ["sft.batch_size=1"], base_dir=REPO)
    with pytest.raises(ConfigError, match="sft: a kind=rl job is not kind=sft or kind=eval"):
        load_config(None, ["sft.batch_size=8"], base_dir=REPO)


def test_sft_takes_the_megatron_backend_which_needs_cuda():
    cfg = load_config(SFT, ["trainer.backend=megatron"], base_dir=REPO)
    with pytest.raises(RuntimeError, match=r"trainer\.backend=megatron needs CUDA GPUs"):
        build_backend(cfg, torch.device("cpu"))


def test_a_resolved_configs_full_dump_validates_again():
    """Only what the user writes is checked for another kind's sections: a dump of a resolved
    config holds every section (relax_hpc.scale re-validates the run's config that way)."""
    for path in (SFT, REPO / "configs" / "tiny-grpo.yaml"):
        cfg = load_config(path, base_dir=REPO)
        assert validate(json.loads(cfg.model_dump_json())) == cfg


def test_the_frozen_sft_config_holds_only_what_it_reads(tmp_path):
    cfg = load_config(SFT, base_dir=REPO)
    frozen = tmp_path / "config.yaml"
    frozen.write_text(to_yaml(cfg))
    assert not {"rollout", "reward", "algo", "data", "weights"} & set(yaml.safe_load(frozen.read_text()))
    assert read_frozen(frozen) == cfg
    check_inputs(cfg)  # the data tokenize with the model's tokenizer


def test_submit_names_the_first_bad_row(tmp_path):
    data = _write(tmp_path, [{"prompt": "1+1=", "response": "2"}, {"question": "1+2=", "response": "3"}])
    cfg = load_config(SFT, [f"sft.data={data}"], base_dir=REPO)
    with pytest.raises(ConfigError, match=r"sft.data: .*sft.jsonl:2: no 'prompt' field"):
        check_inputs(cfg)


def test_a_model_path_naming_a_run_is_its_export(tmp_path):
    run = tmp_path / "sft-run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(SFT, base_dir=REPO)))
    rl = load_config(None, [f"model.path={run}"], base_dir=REPO)
    assert rl.model.path == str(run / "hf")
    with pytest.raises(ConfigError, match=f"model.path: the run {run} has exported no model yet"):
        check_inputs(rl)
    (run / "hf").mkdir()
    for f in (REPO / "assets" / "tiny-qwen3-addition").iterdir():
        (run / "hf" / f.name).write_bytes(f.read_bytes())
    check_inputs(load_config(None, [f"model.path={run}"], base_dir=REPO))


def test_the_backends_sft_step_is_transformers_cross_entropy_on_the_responses(one_rank, tok):
    """End to end through the torch backend: the step's loss (taken before its update) is what
    transformers computes with the prompt and padding labelled -100, on the same weights."""
    cfg = load_config(SFT, ["trainer.num_ranks=1"], base_dir=REPO)
    examples = load_examples(REPO / "assets" / "addition-sft.jsonl", "prompt_response", KEYS, tok, 64)[::9]
    examples.append(prompt_response_example({"prompt": "9+9+9=", "response": "27"}, "prompt", "response", tok, "x"))
    batch = examples_batch(examples, list(range(len(examples))), tok.pad_token_id)
    reference = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    labels = torch.full_like(batch.input_ids, -100)
    for i, e in enumerate(examples):
        labels[i, : len(e.ids)] = torch.tensor([t if m else -100 for t, m in zip(e.ids, e.loss_mask, strict=True)])
    with torch.no_grad():
        expected = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss
    result = TorchBackend(BackendConfig.of(cfg), torch.device("cpu")).sft_step(batch, 0, "token_mean")
    assert result.loss == pytest.approx(expected.item(), rel=1e-5)
    assert result.stats.sums["tokens"] == sum(sum(e.loss_mask) for e in examples)


def test_bf16_training_keeps_fp32_master_weights_so_small_steps_are_not_rounded_away(one_rank, tok):
    """model.dtype=bfloat16 on the torch backend: the forward and backward run in bf16, but the
    optimizer steps fp32 master weights (as megatron does). A step of lr 1e-6 moves every weight
    with a gradient by about lr; on bf16 weights (spacing at least 2^-9 of the weight) it would
    round away for all but the tiniest. The engines still get bf16 tensors."""
    cfg = load_config(SFT, ["trainer.num_ranks=1", "model.dtype=bfloat16", "trainer.lr=1e-6"], base_dir=REPO)
    examples = load_examples(REPO / "assets" / "addition-sft.jsonl", "prompt_response", KEYS, tok, 64)[::9]
    backend = TorchBackend(BackendConfig.of(cfg), torch.device("cpu"))
    assert {p.dtype for p in backend.model.parameters()} == {torch.float32}
    assert {dtype for _, _, dtype in backend.parameter_specs()} == {torch.bfloat16}
    assert {t.dtype for _, t in backend.full_parameters()} == {torch.bfloat16}
    before = {n: p.full_tensor().clone() for n, p in backend.model.named_parameters()}
    backend.sft_step(examples_batch(examples, list(range(len(examples))), tok.pad_token_id), 0, "token_mean")
    moved = [(p.full_tensor() - before[n]).abs() for n, p in backend.model.named_parameters() if p.grad is not None]
    changed = sum(int((m > 0.5e-6).sum()) for m in moved) / sum(m.numel() for m in moved)
    assert changed > 0.9 and max(float(m.max()) for m in moved) <= 1.1e-6, changed  # lr and fp32's rounding
