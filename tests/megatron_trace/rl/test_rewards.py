"""The math verifier on hand-written cases, and rewards by import path."""

import pytest

from megatron_trace.rl.rewards import extract_answer, load_reward, math_reward


@pytest.mark.parametrize("response, answer, want", [
    ("so the total is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{3}{4}}", "3/4", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
    ("The answer is 3/4.", "0.75", 1.0),
    ("we get 1,000 apples\n#### 1,000", "1000", 1.0),
    ("x = -3", "-3", 1.0),
    ("first 12, then 41", "42", 0.0),
    ("I do not know", "42", 0.0),
    ("\\boxed{x+1}", "x + 1", 1.0),
    ("\\boxed{x+1}", "x+2", 0.0),
    ("\\boxed{3.0000001}", "3", 1.0),
    ("\\boxed{3.01}", "3", 0.0),
    ("\\boxed{1/0}", "1", 0.0),
    ("unbalanced \\boxed{12", "12", 1.0),  # no box: falls back to the last number
])
def test_math_reward(response, answer, want):
    assert math_reward("", response, answer) == want


def test_extract_answer_prefers_the_last_box():
    assert extract_answer("\\boxed{1} then \\boxed{{2}}") == "{2}"
    assert extract_answer("nothing here") is None


def test_rewards_by_name_and_import_path():
    assert load_reward("exact")("", " 7 ", "7") == 1.0
    assert load_reward("math") is math_reward
    assert load_reward("megatron_trace.rl.rewards:exact_reward")("", "7", "8") == 0.0
    for spec, message in (("nope", "use one of"), ("no.such.module:f", "cannot import"),
                          ("megatron_trace.rl.rewards:BUILTIN", "not callable")):
        with pytest.raises(ValueError, match=message):
            load_reward(spec)
