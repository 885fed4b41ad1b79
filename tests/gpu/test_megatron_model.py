"""The megatron model computes what transformers computes: on tiny Qwen2 / Qwen3 / Qwen3-MoE models
loaded from the same HF folder, megatron's forward (TP=PP=1, fp32, SDPAttention core attention)
gives transformers' logits, for a plain batch and for documents packed into one row ('thd' with
cu_seqlens: each document as if alone). Run on the GPU machine: `python -m pytest tests/gpu -m gpu`."""

from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KINDS = ["qwen2", "qwen3", "qwen3-tied", "qwen3-moe"]
TOLERANCE: dict[str, Any] = {"atol": 1e-4, "rtol": 1e-4}


def _models(kind: str, folder):
    from transformers import AutoModelForCausalLM

    from relax_hpc.config.schema import MegatronConfig
    from relax_hpc.models.hf_loading import load_hf_weights
    from relax_hpc.models.megatron import build_model
    from tests.unit.test_hf_mapping import save_random_hf, tiny_configs

    config = tiny_configs()[kind]
    save_random_hf(config, folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model = build_model(config, MegatronConfig(attention="sdpa"), torch.float32, pre_process=True, post_process=True)
    assert {p.device.type for p in model.parameters()} == {"cuda"}  # the MoE router too
    load_hf_weights(model, folder)
    return config, reference.cuda().eval(), model.eval()  # type: ignore[call-arg]  # transformers types .cuda() as taking a model


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers(kind, mp, tmp_path):
    config, reference, model = _models(kind, tmp_path)
    torch.manual_seed(1)
    ids = torch.randint(config.vocab_size, (3, 13), device="cuda")
    positions = torch.arange(13, device="cuda").expand(3, -1)
    with torch.no_grad():
        expected = reference(ids).logits
        logits = model(ids, positions, None)
    assert logits.shape == (3, 13, model.vocab_size)
    torch.testing.assert_close(logits[..., : config.vocab_size], expected, **TOLERANCE)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_documents_equal_separate_rows(kind, mp, tmp_path):
    from relax_hpc.models.megatron import packed_seq_params

    config, reference, model = _models(kind, tmp_path)
    torch.manual_seed(2)
    lengths = [7, 11, 4]
    docs = [torch.randint(config.vocab_size, (n,), device="cuda") for n in lengths]
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    with torch.no_grad():
        packed = model(ids, positions, None, packed_seq_params=packed_seq_params(lengths, "cuda"))[0]
        start = 0
        for doc in docs:
            alone = model(doc[None], positions[:, : len(doc)], None)[0]
            torch.testing.assert_close(packed[start : start + len(doc)], alone, **TOLERANCE)
            expected = reference(doc[None]).logits[0]
            torch.testing.assert_close(packed[start : start + len(doc), : config.vocab_size], expected, **TOLERANCE)
            start += len(doc)
