"""RL tasks: prompts with reference answers, a tokenizer, and a verifiable reward.

`ArithmeticTask` is the embedded default: "a+b=" (or "-", "*") with the exact integer result
as the answer, tokenized by `CharTokenizer` (small enough for the tiny model's vocabulary).
`ChainTask` chains several operands and answers with worked steps (longer responses, with a
held-out split for evaluation).
`JsonlTask` reads real prompts and answers from a JSONL file and scores responses with any
reward function of `rewards` (e.g. the math verifier); `HFTokenizer` wraps a model's own.
A task's `state_dict()` is what a resumed run needs to draw the same problems next.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

PAD, BOS, EOS = 0, 1, 2
CHARS = "0123456789+-*= ,;"  # characters are only ever appended: existing ids never change


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


class ChainTask:
    """Multi-step arithmetic with worked steps: `terms` operands of exactly `digits` digits (0-9
    for one digit) joined by operators drawn from `ops`, e.g. the prompt "37+48*29-16=".

    The answer is the exact integer value under the usual precedence (Python's `eval` of the
    expression: "*" before "+" and "-", then left to right). The SFT response works it out one
    binary operation per step, the products first (left to right), then the sums and differences
    left to right, each step written "a<op>b = c", the steps joined by ", ", then "; " and the
    final answer:

        37+48*29-16=   ->   48*29 = 1392, 37+1392 = 1429, 1429-16 = 1413; 1413

    At terms=4, digits=2 every response is at least 35 tokens with its <eos>, whatever the ops
    ("10-10 = 0, 0+10 = 10, 10-10 = 0; 0"; with ops "+" at least 39); `max_response_tokens()`
    bounds the longest.

    Reward: 1.0 when the text after the response's last ";" (up to <eos>, surrounding spaces
    stripped) is exactly the answer ("1413", "-89": no leading zeros or "+"); 0.0 otherwise,
    also for a response without ";". Only the final answer is checked, not the intermediate steps.

    Held-out split: a problem belongs to the evaluation split when the SHA-256 of its prompt (its
    first 8 bytes, big-endian) is 0 modulo `EVAL_MODULUS` (about one problem in 16, the same split
    for every seed); the training
    stream (`problems`) skips those problems, and `eval_problems(n, seed)` draws only from them,
    from its own generator, without moving the training draw state. So no evaluation prompt can
    ever be a training prompt, whatever the seeds.
    """

    EVAL_MODULUS = 16

    def __init__(self, digits: int = 2, ops: str = "+", terms: int = 4, seed: int = 0,
                 tokenizer: CharTokenizer | None = None):
        if digits < 1 or terms < 2 or not ops or any(o not in "+-*" for o in ops):
            raise ValueError(f"ChainTask needs digits >= 1, terms >= 2 and ops from '+-*', got {digits}, {terms}, "
                             f"{ops!r}")
        self.digits, self.ops, self.terms, self.rng = digits, ops, terms, random.Random(seed)
        self.tokenizer = tokenizer or CharTokenizer()

    # -- problems -----------------------------------------------------------------------------
    @classmethod
    def is_held_out(cls, prompt: str) -> bool:
        """True when `prompt` belongs to the evaluation split (never drawn for training)."""
        return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") % cls.EVAL_MODULUS == 0

    def _draw(self, rng: random.Random) -> Problem:
        lo = 10 ** (self.digits - 1) if self.digits > 1 else 0
        nums = [rng.randrange(lo, 10**self.digits) for _ in range(self.terms)]
        ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
        prompt = "".join(f"{n}{o}" for n, o in zip(nums, ops, strict=False)) + f"{nums[-1]}="
        return Problem(prompt, str(self.solve(nums, ops)[1]))

    def problems(self, n: int) -> list[Problem]:
        """The next `n` training problems (the task's draw state moves on; held-out ones skipped)."""
        out = []
        while len(out) < n:
            p = self._draw(self.rng)
            if not self.is_held_out(p.prompt):
                out.append(p)
        return out

    def eval_problems(self, n: int, seed: int = 0) -> list[Problem]:
        """`n` distinct held-out problems, the same for the same (n, seed, digits, ops, terms); the
        training draw state is untouched. ValueError when the held-out split has fewer than `n`."""
        rng = random.Random(f"chain-eval-{seed}")
        out, seen, tries = [], set(), 0
        while len(out) < n:
            tries += 1
            if tries > 1000 * n + 10_000:
                raise ValueError(f"ChainTask: could not draw {n} distinct held-out problems ({len(out)} found)")
            p = self._draw(rng)
            if self.is_held_out(p.prompt) and p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
        return out

    # -- worked steps -------------------------------------------------------------------------
    @staticmethod
    def parse(prompt: str) -> tuple[list[int], list[str]]:
        """(operands, operators) of a prompt such as "37+48*29-16="."""
        body = prompt.removesuffix("=")
        nums, ops, cur = [], [], ""
        for c in body:
            if c in "+-*":
                nums.append(int(cur))
                ops.append(c)
                cur = ""
            else:
                cur += c
        nums.append(int(cur))
        return nums, ops

    @staticmethod
    def solve(nums: list[int], ops: list[str]) -> tuple[list[str], int]:
        """(the worked steps "a<op>b = c", the value): products first, then sums and differences,
        each left to right."""
        nums, ops, steps = list(nums), list(ops), []
        while "*" in ops:
            i = ops.index("*")
            value = nums[i] * nums[i + 1]
            steps.append(f"{nums[i]}*{nums[i + 1]} = {value}")
            nums[i:i + 2], ops[i:i + 1] = [value], []
        acc = nums[0]
        for op, b in zip(ops, nums[1:], strict=True):
            value = acc + b if op == "+" else acc - b
            steps.append(f"{acc}{op}{b} = {value}")
            acc = value
        return steps, acc

    def response(self, p: Problem) -> str:
        """The worked response to `p` (without <eos>). Its final answer is `p.answer`: when that is
        not the prompt's value (a near miss from `sft.label_noise`), the last step's result is
        that answer too, as a slip in the last operation would leave it."""
        steps, value = self.solve(*self.parse(p.prompt))
        if p.answer != str(value):
            steps[-1] = f"{steps[-1].rpartition(' = ')[0]} = {p.answer}"
        return ", ".join(steps) + f"; {p.answer}"

    def max_response_tokens(self) -> int:
        """An upper bound on the tokens of any response of this task, <eos> included (for
        rl.max_new_tokens): every step at the largest magnitude the operands can reach."""
        top = 10**self.digits - 1
        bound = max(top**self.terms, self.terms * top) if "*" in self.ops else self.terms * top
        width = len(str(bound)) + ("-" in self.ops)  # of any operand or intermediate, its sign included
        step = width + 1 + width + 3 + width  # a<op>b = c (b: an operand or a product)
        return (self.terms - 1) * (step + 2) + width + 1

    def prompt_tokens(self) -> int:
        """Tokens of every prompt (<bos> included)."""
        return 1 + self.terms * self.digits + self.terms

    # -- the task interface -------------------------------------------------------------------
    def prompt_ids(self, p: Problem) -> list[int]:
        """The prompt's token ids, as the engine receives them."""
        return [BOS, *self.tokenizer.encode(p.prompt)]

    def sft_example(self, p: Problem) -> tuple[list[int], list[bool]]:
        """(tokens, loss mask): <bos> prompt worked-response <eos>, the loss on the response and <eos>."""
        prompt = self.prompt_ids(p)
        answer = [*self.tokenizer.encode(self.response(p)), EOS]
        return prompt + answer, [False] * len(prompt) + [True] * len(answer)

    def final_answer(self, response_ids: list[int]) -> str | None:
        """The text after the last ";" of the response (up to <eos>), stripped; None without ";"."""
        text = self.tokenizer.decode(response_ids)
        return text.rpartition(";")[2].strip() if ";" in text else None

    def reward(self, p: Problem, response_ids: list[int]) -> float:
        """1.0 when the final answer (after the last ";") is exactly the answer, else 0.0."""
        return float(self.final_answer(response_ids) == p.answer)

    def state_dict(self) -> dict:
        """The training draw state, for a checkpoint."""
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
