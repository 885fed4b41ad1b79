"""Seeded sampling: a sample's tokens do not depend on its batch neighbours."""

import torch
from transformers import Qwen3ForCausalLM

from relax_hpc.engines.sampling import SamplingSpec, input_logprobs, sample
from relax_hpc.models.tiny import build_char_tokenizer, tiny_qwen3_config


def test_same_seed_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = Qwen3ForCausalLM(tiny_qwen3_config(tok)).eval()
    prompt = tok("3+4=")["input_ids"]
    spec = SamplingSpec(max_new_tokens=6, temperature=1.0)
    alone = sample(model, [prompt], [spec], [123], tok.eos_token_id, tok.pad_token_id)[0]
    others = [tok("12+7=")["input_ids"], tok("1=")["input_ids"]]
    mixed = sample(model, [*others, prompt], [spec] * 3, [9, 8, 123], tok.eos_token_id, tok.pad_token_id)[2]
    assert alone.output_ids == mixed.output_ids
    assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(mixed.logprobs), atol=1e-5)
    different = sample(model, [prompt], [spec], [124], tok.eos_token_id, tok.pad_token_id)[0]
    assert different.output_ids != alone.output_ids or different.logprobs != alone.logprobs


def test_greedy_matches_argmax_of_a_full_forward():
    torch.manual_seed(1)
    tok = build_char_tokenizer()
    model = Qwen3ForCausalLM(tiny_qwen3_config(tok)).eval()
    prompt = tok("5+5=")["input_ids"]
    out = sample(model, [prompt], [SamplingSpec(max_new_tokens=3, temperature=0.0, ignore_eos=True)], [None], 1, 0)[0]
    ids = list(prompt)
    for _ in range(3):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out.output_ids == ids[len(prompt) :] and out.finish_reason == "length"


def test_input_logprobs_follow_sglangs_logprob_start_len():
    """Entry 0 is None, entry k scores token start + k given the tokens before it, whatever the
    other rows of the forward pass (right padding); a sampled completion's own log-probabilities
    (temperature 1) are the same numbers."""
    torch.manual_seed(2)
    tok = build_char_tokenizer()
    model = Qwen3ForCausalLM(tiny_qwen3_config(tok)).eval()
    prompt = tok("3+4=")["input_ids"]
    spec = SamplingSpec(max_new_tokens=4, temperature=1.0, ignore_eos=True)
    out = sample(model, [prompt], [spec], [5], tok.eos_token_id, tok.pad_token_id)[0]
    sequence = prompt + out.output_ids
    start = len(prompt) - 1
    alone = input_logprobs(model, [sequence], [start])[0]
    longer = tok("12+34=567")["input_ids"]
    padded = input_logprobs(model, [longer, sequence], [0, start])
    assert alone[0] is None and padded[0][0] is None and len(alone) == len(out.output_ids) + 1
    assert len(padded[0]) == len(longer)
    torch.testing.assert_close(torch.tensor(alone[1:]), torch.tensor(out.logprobs), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(padded[1][1:]), torch.tensor(alone[1:]), rtol=0, atol=1e-5)
    assert input_logprobs(model, [sequence], [len(sequence)]) == [[]]


def test_no_new_token_is_sampled_for_max_new_tokens_0():
    tok = build_char_tokenizer()
    model = Qwen3ForCausalLM(tiny_qwen3_config(tok)).eval()
    specs = [SamplingSpec(max_new_tokens=0), SamplingSpec(max_new_tokens=2, ignore_eos=True)]
    prompts = [tok("3+4=")["input_ids"]] * 2
    scoring, sampled = sample(model, prompts, specs, [1, 2], tok.eos_token_id, tok.pad_token_id)
    assert (scoring.output_ids, scoring.finish_reason) == ([], "length") and len(sampled.output_ids) == 2


def test_a_groups_rows_share_one_prefill_and_sample_as_they_would_alone():
    """Rows with the same prompt (a group) are prefilled once: the first forward pass reads each
    distinct prompt once, and every row still samples what it samples alone with its seed."""
    torch.manual_seed(2)
    tok = build_char_tokenizer()
    model = Qwen3ForCausalLM(tiny_qwen3_config(tok)).eval()
    p, q = tok("12+34=")["input_ids"], tok("5+6=")["input_ids"]
    prompts, seeds = [q, p, p, q, p], [7, 1, 2, 8, 3]
    spec = SamplingSpec(max_new_tokens=5, temperature=1.0, ignore_eos=True)
    rows_read: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: rows_read.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    together = sample(model, prompts, [spec] * 5, seeds, tok.eos_token_id, tok.pad_token_id)
    hook.remove()
    assert rows_read[0] == 2 and set(rows_read[1:]) == {5}  # the prefill reads p and q once each
    for prompt, seed, got in zip(prompts, seeds, together, strict=True):
        alone = sample(model, [prompt], [spec], [seed], tok.eos_token_id, tok.pad_token_id)[0]
        assert got.output_ids == alone.output_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
