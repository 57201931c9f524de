"""RL tasks: prompts with reference answers, a tokenizer, and a verifiable reward.

`ArithmeticTask` is the embedded default: "a+b=" (or "-", "*") with the exact integer result
as the answer, tokenized by `CharTokenizer` (small enough for the tiny model's vocabulary).
`JsonlTask` reads real prompts and answers from a JSONL file and scores responses with any
reward function of `rewards` (e.g. the math verifier); `HFTokenizer` wraps a model's own.
A task's `state_dict()` is what a resumed run needs to draw the same problems next.
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

    bos_id, eos_id = BOS, EOS

    @property
    def vocab_size(self) -> int:
        return 3 + len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; ValueError naming characters outside the alphabet."""
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
        """The next `n` problems (the task's draw state moves on)."""
        out = []
        for _ in range(n):
            a, b = (self.rng.randrange(10**self.digits) for _ in range(2))
            op = self.rng.choice(self.ops)
            value = a + b if op == "+" else a - b if op == "-" else a * b
            out.append(Problem(f"{a}{op}{b}=", str(value)))
        return out

    def prompt_ids(self, p: Problem) -> list[int]:
        """The prompt's token ids, as the engine receives them."""
        return [BOS, *self.tokenizer.encode(p.prompt)]

    def sft_example(self, p: Problem) -> tuple[list[int], list[bool]]:
        """(tokens, loss mask): <bos> prompt answer <eos>, the loss on the answer and <eos>."""
        prompt = self.prompt_ids(p)
        answer = [*self.tokenizer.encode(p.answer), EOS]
        return prompt + answer, [False] * len(prompt) + [True] * len(answer)

    def reward(self, p: Problem, response_ids: list[int]) -> float:
        """1.0 when the response (up to <eos>) is exactly the answer."""
        return float(self.tokenizer.decode(response_ids) == p.answer)

    def state_dict(self) -> dict:
        """The draw state, for a checkpoint."""
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])


class HFTokenizer:
    """A Hugging Face tokenizer (from a model directory) behind CharTokenizer's interface."""

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError("task.tokenizer names a Hugging Face tokenizer; install transformers") from None
        self.tok = AutoTokenizer.from_pretrained(path)
        if self.tok.eos_token_id is None:
            raise ValueError(f"tokenizer {path} has no eos token; RL needs one to end responses")
        self.bos_id, self.eos_id = self.tok.bos_token_id, self.tok.eos_token_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text up to the first eos."""
        ids = ids[: ids.index(self.eos_id)] if self.eos_id in ids else ids
        return self.tok.decode(ids, skip_special_tokens=True)


class JsonlTask:
    """Problems from a JSONL file of {"prompt": str, "answer": str}, drawn in a seeded order
    without replacement (reshuffled every epoch), scored by reward_fn(prompt, response, answer).

    Raises ValueError naming the file and line of a malformed record."""

    def __init__(self, path: str, tokenizer, reward_fn, seed: int = 0):
        import json

        self.problems_all: list[Problem] = []
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                prompt, answer = rec["prompt"], rec["answer"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{i}: expected a JSON object with 'prompt' and 'answer'") from None
            if not isinstance(prompt, str) or not isinstance(answer, (str, int, float)) or not prompt:
                raise ValueError(f"{path}:{i}: 'prompt' must be a non-empty string and 'answer' a string or number")
            self.problems_all.append(Problem(prompt, str(answer)))
        if not self.problems_all:
            raise ValueError(f"{path}: no problems")
        self.tokenizer, self.reward_fn, self.rng = tokenizer, reward_fn, random.Random(seed)
        for p in self.problems_all:  # fail now on text the tokenizer cannot encode
            tokenizer.encode(p.prompt + p.answer)
        self.order: list[int] = []

    def problems(self, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            if not self.order:
                self.order = list(range(len(self.problems_all)))
                self.rng.shuffle(self.order)
            out.append(self.problems_all[self.order.pop()])
        return out

    def prompt_ids(self, p: Problem) -> list[int]:
        bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        return bos + self.tokenizer.encode(p.prompt)

    def sft_example(self, p: Problem) -> tuple[list[int], list[bool]]:
        """(tokens, loss mask): prompt, answer, eos; the loss on the answer and eos."""
        prompt = self.prompt_ids(p)
        answer = [*self.tokenizer.encode(p.answer), self.tokenizer.eos_id]
        return prompt + answer, [False] * len(prompt) + [True] * len(answer)

    def reward(self, p: Problem, response_ids: list[int]) -> float:
        """The reward of a response (token ids) to problem `p`."""
        return float(self.reward_fn(p.prompt, self.tokenizer.decode(response_ids), p.answer))

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "order": list(self.order)}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        self.order = list(state["order"])
