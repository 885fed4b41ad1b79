"""Prompt datasets: clear errors for bad rows; a deterministic, resumable order."""

import re

import pytest

from relax_hpc.data.prompts import DatasetError, PromptOrder, load_prompts


def test_row_without_the_prompt_field_names_line_and_option(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n')
    with pytest.raises(DatasetError, match=r"d.jsonl:2: row has no field 'prompt' .*data.prompt_key"):
        load_prompts(path, "prompt", "answer")


@pytest.mark.parametrize("line", ["not json", "[1, 2]", '{"prompt": {"x": 1}, "answer": "2"}'])
def test_malformed_rows_are_rejected(tmp_path, line):
    path = tmp_path / "d.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DatasetError, match=re.escape("d.jsonl:1")):
        load_prompts(path, "prompt", "answer")


def test_order_is_a_pure_function_of_seed_and_position():
    order = PromptOrder(10, seed=3)
    stream = [i for seq in range(5) for i in order.batch(seq, 4)]  # 20 positions = 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:]  # reshuffled every epoch
    assert PromptOrder(10, seed=3).batch(3, 4) == stream[12:16]  # a restart recomputes any batch
    assert PromptOrder(10, seed=4).batch(0, 10) != stream[:10]
