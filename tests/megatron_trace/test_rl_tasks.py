"""The embedded default's arithmetic task and tokenizer."""

import pytest

from megatron_trace.model_config import PRESETS
from megatron_trace.rl.tasks import BOS, EOS, ArithmeticTask, CharTokenizer


def test_tokenizer_round_trips_and_refuses_unknown_characters():
    tok = CharTokenizer()
    assert tok.decode(tok.encode("12+34=46")) == "12+34=46"
    assert tok.decode([*tok.encode("46"), EOS, *tok.encode("99")]) == "46"  # stops at <eos>
    assert tok.vocab_size <= PRESETS["tiny"].vocab_size
    with pytest.raises(ValueError, match=r"\['x'\]"):
        tok.encode("1x2")


def test_problems_rewards_and_sft_examples_follow_integer_arithmetic():
    task = ArithmeticTask(digits=3, ops="+-*", seed=7)
    problems = task.problems(200)
    for p in problems:
        a, op, b = None, None, None
        for o in "+-*":
            left, sep, right = p.prompt[:-1].partition(o)
            if sep and left and right.lstrip("-").isdigit() and left.isdigit():
                a, op, b = int(left), o, int(right)
        assert p.prompt.endswith("=") and op is not None
        assert int(p.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
        right = [*task.tokenizer.encode(p.answer), EOS, 5]
        assert task.reward(p, right) == 1.0
        assert task.reward(p, task.tokenizer.encode(p.answer + "0")) == 0.0
    assert len({p.prompt for p in problems}) > 150  # varied
    tokens, mask = task.sft_example(problems[0])
    assert tokens[0] == BOS and tokens[-1] == EOS and len(tokens) == len(mask)
    assert task.tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m]) == problems[0].answer
    assert ArithmeticTask(seed=1).problems(5) == ArithmeticTask(seed=1).problems(5)  # seeded
    with pytest.raises(ValueError, match="ops from"):
        ArithmeticTask(ops="/")
