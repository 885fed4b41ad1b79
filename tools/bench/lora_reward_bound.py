"""The highest sampled reward a LoRA policy can reach when the final norm and the output embedding
stay frozen (trainer.lora's adapters on linear projections, without modules_to_save), on a
question/answer task.

    python tools/bench/lora_reward_bound.py [--model assets/tiny-qwen3-addition] [--data assets/addition.jsonl]

A decoder's logits are W (g * x): W the output embedding, g the final RMSNorm's weight, x the last
hidden state after normalisation (root mean square 1). Adapters on the projections move x but
not W or g, so each token's probability at temperature 1 is at most the largest softmax(W (g * x))
over such x, whatever rank, scale or rate they train with. The script finds that maximum for every
token of the answers and the end of sequence (Adam on x over 16 starts, one of them the token's
own direction), and bounds each problem's exact-match reward by the product over its answer's
tokens and the closing EOS. Prints one JSON object: the bound per token and its mean over the
problems (the batch reward's ceiling when prompts are drawn uniformly).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

STARTS, ITERS = 16, 3000


def max_probability(out_emb: torch.Tensor, norm_weight: torch.Tensor, token: int) -> float:
    """max over x with RMS 1 of softmax(out_emb @ (norm_weight * x))[token], numerically."""
    torch.manual_seed(token)
    h = torch.randn(STARTS, out_emb.shape[1])
    h[0] = out_emb[token] / norm_weight  # the start pointing at the token itself
    h.requires_grad_(True)
    opt = torch.optim.Adam([h], lr=0.05)
    for _ in range(ITERS):
        x = h / h.pow(2).mean(-1, keepdim=True).sqrt()
        logp = torch.log_softmax((norm_weight * x) @ out_emb.T, -1)[:, token]
        opt.zero_grad()
        (-logp.sum()).backward()
        opt.step()
    return logp.max().exp().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="assets/tiny-qwen3-addition")
    parser.add_argument("--data", default="assets/addition.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    out_emb = model.get_output_embeddings().weight.detach()
    norm_weight = model.model.norm.weight.detach()
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    answers = [tokenizer.encode(r["answer"], add_special_tokens=False) for r in rows]
    eos = model.config.eos_token_id
    tokens = sorted({t for a in answers for t in a} | {eos})
    bound = {t: max_probability(out_emb, norm_weight, t) for t in tokens}
    per_problem = [bound[eos] * torch.tensor([bound[t] for t in a]).prod().item() for a in answers]
    print(
        json.dumps(
            {
                "token_bound": {tokenizer.decode([t]) or str(t): round(p, 3) for t, p in bound.items()},
                "problems": len(rows),
                "mean_reward_bound": round(sum(per_problem) / len(per_problem), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
