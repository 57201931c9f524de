"""The embedded default's task: multi-digit arithmetic with a verifiable reward, and its
character tokenizer (small enough for the tiny model's vocabulary).

A problem is "a+b=" (or "-", "*"); the answer is the exact integer result followed by <eos>.
The reward is 1 for exactly the right answer, else 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PAD, BOS, EOS = 0, 1, 2
CHARS = "0123456789+-*= "


class CharTokenizer:
    """<pad> <bos> <eos>, then one id per character of CHARS."""

    def __init__(self, chars: str = CHARS):
        self.chars = chars
        self.ids = {c: i + 3 for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return 3 + len(self.chars)

    def encode(self, text: str) -> list[int]:
        bad = sorted({c for c in text if c not in self.ids})
        if bad:
            raise ValueError(f"characters {bad} are not in the tokenizer's alphabet {self.chars!r}")
        return [self.ids[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        """Text up to the first <eos> (special ids other than <eos> are skipped)."""
        out = []
        for i in ids:
            if i == EOS:
                break
            if i >= 3 and i - 3 < len(self.chars):
                out.append(self.chars[i - 3])
        return "".join(out)


@dataclass(frozen=True)
class Problem:
    prompt: str  # "12+34="
    answer: str  # "46"


class ArithmeticTask:
    """Random problems with operands of up to `digits` digits and operators from `ops`."""

    def __init__(self, digits: int = 2, ops: str = "+", seed: int = 0, tokenizer: CharTokenizer | None = None):
        if digits < 1 or not ops or any(o not in "+-*" for o in ops):
            raise ValueError(f"ArithmeticTask needs digits >= 1 and ops from '+-*', got {digits}, {ops!r}")
        self.digits, self.ops, self.rng = digits, ops, random.Random(seed)
        self.tokenizer = tokenizer or CharTokenizer()

    def problems(self, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            a, b = (self.rng.randrange(10**self.digits) for _ in range(2))
            op = self.rng.choice(self.ops)
            value = a + b if op == "+" else a - b if op == "-" else a * b
            out.append(Problem(f"{a}{op}{b}=", str(value)))
        return out

    def prompt_ids(self, p: Problem) -> list[int]:
        return [BOS, *self.tokenizer.encode(p.prompt)]

    def sft_example(self, p: Problem) -> tuple[list[int], list[bool]]:
        """(tokens, loss mask): <bos> prompt answer <eos>, the loss on the answer and <eos>."""
        prompt = self.prompt_ids(p)
        answer = [*self.tokenizer.encode(p.answer), EOS]
        return prompt + answer, [False] * len(prompt) + [True] * len(answer)

    def reward(self, p: Problem, response_ids: list[int]) -> float:
        """1.0 when the response (up to <eos>) is exactly the answer."""
        return float(self.tokenizer.decode(response_ids) == p.answer)
