"""Weights verified inside a run (weights.verify_every): what a checked push costs against a plain
one, measured in the same run, on CPU.

    python tools/bench/weight_verify.py                                 # the embedded default's model
    python tools/bench/weight_verify.py --shape 0.5b [--dtype float32]  # a random-init 0.5B Qwen3 shape

The trainer is this process (rank 0 of the default's broadcast channel: BroadcastChannel over
gloo), pushing to two built-in engines, the group already formed. Per round: a plain push and a
checked one (in turn, either first), as the trainer makes one every `--every` pushes: the
stream digested on its way to the channel (WeightCheck.params), then every engine asked for its
digests and compared (WeightCheck.pushed). Medians over `--repeat` rounds:

- push_s: a plain push;
- digest_s: the trainer's digests of the pushed tensors (inside the checked push);
- verify_s: asking the engines (each hashes what it holds) and comparing, after the push;
- extra_s: what a checked push took more than the plain one of its round (checked push +
  verify_s - push_s): the digests partly overlap the push, but on a loaded machine this
  difference is mostly noise;
- amortised_share: (digest_s + verify_s) / (every x push_s), the check's share of the push time
  over `every` pushes, counting the trainer's digests whole (as if they overlapped nothing);
- probe_s, probe_share: rank 0's side of the log-probability probe that a vLLM engine on the
  CPU adds for the layers it prepacks (verify.Probe: the pushed tensors copied into an fp32
  model, 8 tokens scored), timed on the same tensors, and its share as above; the engine's
  side (one 8-token prompt scored by vLLM) is not in it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync import two_engines  # the full-sync benchmark's engines

from relax_hpc.paths import RunPaths
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.sender import BroadcastChannel
from relax_hpc.weights.verify import Probe, WeightCheck

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "assets" / "tiny-qwen3-addition"  # configs/tiny-grpo.yaml's model.path


def random_qwen3_05b(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """A random-init Qwen3 of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
    MLP 4864, vocab 151936, tied embeddings: 494 M parameters), saved to `folder` for the engines."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).to(dtype)  # type: ignore[arg-type]  # transformers' stub of to()
    model.save_pretrained(folder)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("default", "0.5b"), default="default")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--every", type=int, default=10, help="weights.verify_every")
    parser.add_argument("--bucket-mb", type=float, default=512.0, help="weights.bucket_mb")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the engines beside it get the other cores, as in tools/bench/weight_sync.py
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        paths = RunPaths(Path(tmp) / "run")
        paths.create()
        if args.shape == "default":
            from transformers import AutoModelForCausalLM

            model_dir = DEFAULT_MODEL
            model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        else:
            model_dir = Path(tmp) / "model"
            model = random_qwen3_05b(model_dir, dtype)
        params = [(n, p.detach()) for n, p in model.named_parameters()]
        nbytes = sum(t.numel() * t.element_size() for _, t in params)
        layout = EngineLayout([(n, t.shape, t.dtype) for n, t in params])
        stream = lambda: iter(params)  # noqa: E731
        with two_engines(paths, model_dir, args.dtype) as sender:
            channel = BroadcastChannel(sender, layout, int(args.bucket_mb * 2**20))
            check = WeightCheck(
                "torch", args.every, paths.engines, paths.weights_quarantine, lambda _: None, paths.read_token(),
                600.0, None, torch.device("cpu"),
            )  # fmt: skip
            probe = Probe(str(model_dir))
            probe.begin()  # the model is made once, at the first checked push
            assert channel.push(stream, 1) == 2  # forms the group
            rounds, version = [], 1
            for r in range(args.repeat):
                times: dict[str, float] = {}
                for kind in ("plain", "checked") if r % 2 == 0 else ("checked", "plain"):  # either goes first
                    version += 1
                    check.countdown = 0 if kind == "checked" else 1  # the checked one is due
                    start = time.perf_counter()
                    assert channel.push(check.params(stream), version) == 2
                    times[kind] = time.perf_counter() - start
                    if kind == "checked":
                        start = time.perf_counter()
                        verdicts = check.pushed(version)
                        times["verify"] = time.perf_counter() - start
                        assert len(verdicts) == 2 and all(v.matches for v in verdicts), verdicts
                    else:
                        assert check.pushed(version) == []
                extra = times["checked"] + times["verify"] - times["plain"]
                start = time.perf_counter()
                probe.begin()
                for name, tensor in params:
                    probe.keep(name, tensor)
                probe.answer()
                rounds.append({"push_s": times["plain"], "checked_push_s": times["checked"], "digest_s": check.digest_s,
                               "verify_s": times["verify"], "extra_s": extra,
                               "probe_s": time.perf_counter() - start})  # fmt: skip
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(
        json.dumps(
            {
                "benchmark": "weight_verify_cpu",
                "shape": args.shape,
                "dtype": args.dtype,
                "params_m": round(sum(t.numel() for _, t in params) / 1e6, 1),
                "mib": round(nbytes / 2**20, 1),
                "engines": 2,
                "hash": check.hash,
                "tensors": len(check.expected),
                "repeat": args.repeat,
                **{f"{k}_median": round(v, 4) for k, v in med.items()},
                "every": args.every,
                "amortised_share": round((med["digest_s"] + med["verify_s"]) / (args.every * med["push_s"]), 4),
                "probe_share": round(med["probe_s"] / (args.every * med["push_s"]), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
