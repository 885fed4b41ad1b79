"""relax_hpc.protocol.vllm's reading of answers: what the driver cannot train on is refused by name,
and the driver's view of an answer keeps each token's version. What vLLM engines cannot do is
refused outside the config too: by the adapter before a request is sent, by elastic scaling.
(The fields themselves are checked against vLLM's classes in test_vllm_contract.py.)"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.config import load_config
from relax_hpc.paths import RunPaths
from relax_hpc.protocol import requests as P
from relax_hpc.protocol import vllm as V
from relax_hpc.rollout.engine_policy import token_versions
from relax_hpc.scale import ScaleError, scale_out
from relax_hpc.submit import freeze


def choice(**fields: Any) -> dict[str, Any]:
    base = {
        "token_ids": [4, 5],
        "finish_reason": "stop",
        "logprobs": {"content": [{"token_id": 4, "logprob": -0.5}, {"token_id": 5, "logprob": -1.5}]},
        "weight_versions": [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}],
    }
    return {"choices": [{**base, **fields}]}


def test_a_complete_answer_keeps_each_tokens_version() -> None:
    completion = V.parse_completion(choice())
    assert (completion.token_ids, completion.logprobs, completion.token_versions) == ([4, 5], [-0.5, -1.5], [3, 4])


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ({"choices": []}, "0 choices"),
        (choice(logprobs=None), "2 tokens with 0 log-probabilities"),
        (choice(weight_versions=[{"version": "3", "start": 0, "end": 1}]), "do not cover all 2"),
        (choice(weight_versions=None), "do not cover all 2"),
    ],
)
def test_answers_without_what_training_needs_are_refused(answer: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        V.parse_completion(answer)


def test_top_k_off_is_vllms_zero_and_the_seed_is_the_calls() -> None:
    request = V.generate_request("r", [1], {"max_new_tokens": 3, "top_k": -1}, seed=9)
    assert (request.sampling_params.top_k, request.sampling_params.seed, request.sampling_params.max_tokens) == (
        0,
        9,
        3,
    )
    assert V.generate_request("r", [1], {"max_new_tokens": 3, "top_k": 5}, seed=9).sampling_params.top_k == 5


def test_a_group_is_one_request_when_its_seeds_run_on_and_nothing_else_differs() -> None:
    """Consecutive prompts alike but for seeds s, s + 1, ... are one request with n samples;
    another prompt, other sampling, a seed out of step or none start a group of their own."""
    a, b = [1, 2, 3], [1, 2, 4]
    base = {"max_new_tokens": 8, "temperature": 1.0}
    params = [{**base, "sampling_seed": s} for s in (10, 11, 12, 40, 41, 50, 52)]
    prompts = [a, a, a, b, b, b, b]
    assert V.sample_groups(prompts, params) == [(0, 3), (3, 2), (5, 1), (6, 1)]
    hotter = [params[0], {**params[1], "temperature": 0.5}]
    assert V.sample_groups([a, a], hotter) == [(0, 1), (1, 1)]
    unseeded = [dict(base), dict(base)]
    assert V.sample_groups([a, a], unseeded) == [(0, 1), (1, 1)]


def test_a_groups_answer_is_its_choices_in_the_order_of_their_index() -> None:
    one = choice()["choices"][0]
    answer = {"choices": [{**one, "index": 1, "token_ids": [6, 7]}, {**one, "index": 0}]}
    assert [c.token_ids for c in V.parse_completions(answer, 2)] == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="answered 2 choices, expected 3"):
        V.parse_completions(answer, 3)


def test_the_prefix_caches_counters_are_read_from_prometheus_text() -> None:
    text = (
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n"
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 48.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 64.0\n'
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9\n'
    )
    counters = V.prometheus_counters(text, (V.PREFIX_CACHE_HITS, V.PREFIX_CACHE_QUERIES, "absent_total"))
    assert counters == {V.PREFIX_CACHE_HITS: 48.0, V.PREFIX_CACHE_QUERIES: 64.0, "absent_total": 0.0}


def test_the_drivers_view_of_an_answer_keeps_each_tokens_version() -> None:
    """VllmClient answers in SGLang's shape; the driver takes each token's version from it (a
    request that spanned a push under pause mode keep has two)."""
    answer = V.sglang_answer(V.parse_completion(choice(finish_reason="abort")))
    assert answer["output_ids"] == [4, 5]
    assert answer["meta_info"]["output_token_logprobs"] == [[-0.5, 4, None], [-1.5, 5, None]]
    assert answer["meta_info"]["finish_reason"] == {"type": "abort"}
    assert token_versions(answer) == [3, 4]
    sglang = {"output_ids": [7, 8, 9], "meta_info": {"weight_version": "5"}}
    assert token_versions(sglang) == [5, 5, 5]  # SGLang: one version per answer


@pytest.mark.parametrize(
    ("field", "what"),
    [
        ({"image_data": [["data:image/png;base64,AAAA"]]}, "media"),
    ],
)
def test_what_a_vllm_engine_cannot_answer_is_refused_before_sending(field: dict[str, Any], what: str) -> None:
    client = V.VllmClient("http://127.0.0.1:9", "token", 1.0)  # nothing listens: nothing is sent
    with pytest.raises(ValueError, match=what):
        client.generate(P.GenerateReqInput(input_ids=[[1, 2]], **field))


def test_a_scoring_answer_that_scores_other_positions_is_refused() -> None:
    """The teacher's scoring trusts no answer whose prompt_logprobs do not cover what it sent."""
    position = {"6": {"logprob": -0.5, "rank": 1}}
    with pytest.raises(ValueError, match="scored 2 prompt positions, not 3"):
        V.scored_answer({"prompt_logprobs": [None, position]}, [5, 6, 7], start=1)
    with pytest.raises(ValueError, match="scored 0 prompt positions"):
        V.scored_answer({}, [5, 6, 7], start=1)


def test_elastic_scaling_refuses_a_run_on_vllm_engines(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    freeze(load_config(None, [f"run.dir={paths.root}", "rollout.engine=vllm"]), paths)
    args = argparse.Namespace(id=None, url=None, engines=1, overrides=[], dry_run=True)
    with pytest.raises(ScaleError, match="elastic scaling does not take them yet"):
        scale_out(paths, args)
