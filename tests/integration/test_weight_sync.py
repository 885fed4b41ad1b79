"""Weight sync round trip: torchrun ranks (FSDP2, gloo) -> two engine processes over HTTP + gloo."""

import json
import subprocess
import sys

import pytest

from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineClient
from tests.integration.conftest import REPO, make_run

pytestmark = pytest.mark.integration


def test_engines_hold_the_trainer_weights_after_a_push(tmp_path, engines):
    # 0.05 MiB buckets: the 1.2 MB model travels in many buckets, as a large model would.
    cfg, paths = make_run(tmp_path / "run", "weights.bucket_mb=0.05")
    group = engines(cfg, paths, 2)
    out = tmp_path / "expected.json"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "tests" / "integration" / "sync_worker.py"), str(paths.root), str(out), "7"],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    expected = json.loads(out.read_text())
    assert expected["engines"] == 2 and expected["buckets"] > 5
    token = paths.read_token()
    for record in group.wait_registered(2):
        client = EngineClient(record.url, token, 30)
        assert client.weight_version() == "7"
        for name, rows in expected["weights"].items():
            got = client.post("/get_weights_by_name", P.GetWeightsByNameReqInput(name=name, truncate_size=2))
            assert got == rows, name  # bit-exact: float32 -> JSON -> float32 round trip
        prompts = [[int(t) for t in row] for row in _prompts()]
        outputs = client.generate(
            P.GenerateReqInput(input_ids=prompts, sampling_params={"max_new_tokens": 4, "temperature": 0.0})
        )
        assert [o["output_ids"] for o in outputs] == expected["greedy"]
        assert all(o["meta_info"]["weight_version"] == "7" for o in outputs)


def _prompts():
    from transformers import AutoTokenizer

    from relax_hpc.models.tiny import addition_problems

    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-qwen3-addition")
    return [tokenizer(p)["input_ids"] for p, _ in addition_problems()]
