"""Boxed-answer reward: 1 when the last \\boxed{...} of the completion equals the answer.

What math and geometry QA sets expect of a reasoning model ("... so the area is \\boxed{12}").
Both sides are compared after removing spaces and a trailing period, and, when both parse as
numbers, as numbers (12 == 12.0); the braces may nest (\\boxed{\\frac{1}{2}}).
"""

from __future__ import annotations

BOX = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, or None when there is none (or it is not closed)."""
    start = text.rfind(BOX)
    if start < 0:
        return None
    depth, begin = 1, start + len(BOX)
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None


def _normal(value: str) -> str:
    return "".join(value.split()).rstrip(".")


def boxed_match(completion: str, answer: str) -> float:
    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0
    got, want = _normal(boxed), _normal(answer)
    if got == want:
        return 1.0
    try:
        return 1.0 if float(got) == float(want) else 0.0
    except ValueError:
        return 0.0
