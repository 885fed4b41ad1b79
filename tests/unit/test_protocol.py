"""The torch engine's request parsing: SGLang's field names, types checked, unsupported fields refused."""

import pytest

from relax_hpc.protocol import requests as P


def test_valid_bodies_parse_and_defaults_are_left_out_when_sent():
    req = P.parse(P.GenerateReqInput, {"input_ids": [[1, 2], [3]], "sampling_params": {"temperature": 0}})
    assert req.input_ids == [[1, 2], [3]] and req.return_logprob is None
    assert P.to_json(P.PauseGenerationReqInput(mode="in_place")) == {"mode": "in_place"}
    assert P.to_json(P.UpdateWeightsFromDistributedReqInput(["a"], ["float32"], [[2]])) == {
        "names": ["a"],
        "dtypes": ["float32"],
        "shapes": [[2]],
    }


@pytest.mark.parametrize(
    ("cls", "body", "message"),
    [
        (P.GenerateReqInput, {"text": "hi"}, "unsupported fields ['text']"),
        (P.GenerateReqInput, {"input_ids": "1 2"}, "GenerateReqInput.input_ids: expected"),
        (P.GenerateReqInput, {"input_ids": [1, True]}, "expected"),
        (P.PauseGenerationReqInput, {"mode": "later"}, "PauseGenerationReqInput.mode"),
        (
            P.InitWeightsUpdateGroupReqInput,
            {"master_address": "h", "master_port": 1, "world_size": 2},
            "missing field 'rank_offset'",
        ),
        (P.AbortReq, [], "must be a JSON object"),
    ],
)
def test_bad_bodies_are_refused_with_the_field_named(cls, body, message):
    with pytest.raises(P.ProtocolError, match=message.replace("[", r"\[").replace("]", r"\]")):
        P.parse(cls, body)
