"""The built-in rewards on the answers models really write."""

import pytest

from relax_hpc.rewards import TEXT_REWARDS as REWARDS
from relax_hpc.rewards.boxed import last_boxed


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("so the area is \\boxed{12}.", "12", 1.0),
        ("first \\boxed{3}, no wait: \\boxed{ 12.0 }", "12", 1.0),  # the last box, as numbers
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces
        ("\\boxed{13}", "12", 0.0),
        ("the answer is 12", "12", 0.0),  # no box
        ("\\boxed{12", "12", 0.0),  # not closed
        ("\\boxed{x}", "12", 0.0),
    ],
)
def test_boxed_match(completion, answer, reward):
    assert REWARDS["boxed_match"](completion, answer) == reward


def test_exact_match_ignores_surrounding_whitespace_only():
    assert REWARDS["exact_match"](" 7\n", "7") == 1.0 and REWARDS["exact_match"]("7.", "7") == 0.0


def test_last_boxed_reads_the_last_closed_box():
    assert last_boxed("\\boxed{a} \\boxed{b{c}}") == "b{c}" and last_boxed("none") is None
