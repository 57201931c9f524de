"""Near-miss demonstrations of the warm-up (`sft.label_noise`), checked against the arithmetic itself."""

import pytest
import torch

from megatron_trace.rl.sft import with_near_misses
from megatron_trace.rl.tasks import ArithmeticTask, Problem


def test_near_misses_replace_the_asked_share_of_answers_by_a_slip_of_one_digit():
    torch.manual_seed(0)
    problems = ArithmeticTask(digits=2, ops="+-", seed=1).problems(4000)
    noisy = with_near_misses(problems, 0.3)
    assert [p.prompt for p in noisy] == [p.prompt for p in problems]
    changed = 0
    for p in noisy:
        a, op, b = p.prompt[:-1].partition("+") if "+" in p.prompt else p.prompt[:-1].partition("-")
        true = int(a) + int(b) if op == "+" else int(a) - int(b)  # from the prompt, not the task's answer
        if int(p.answer) != true:
            changed += 1
            slips = {true + d for d in (-10, -1, 1, 10)}
            if true >= 0:
                slips = {abs(v) for v in slips}
            assert int(p.answer) in slips, (p, true)
    assert abs(changed / len(problems) - 0.3) < 0.03
    assert with_near_misses(problems, 0.0) is problems


def test_near_misses_need_integer_answers():
    with pytest.raises(ValueError, match="integer answers"):
        with_near_misses([Problem("x=", "y")], 0.999)
