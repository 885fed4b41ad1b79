"""Exact-match reward: 1 when the completion, without surrounding whitespace, equals the answer."""


def exact_match(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == answer.strip() else 0.0
