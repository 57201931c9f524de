"""Rewards for tests: functions of the response alone that a model after a short SFT earns in
part, so that every group has a signal to learn from."""


def ones_share(prompt: str, response: str, answer: str) -> float:
    """The share of the response's characters that are the digit 1."""
    return response.count("1") / max(1, len(response))
