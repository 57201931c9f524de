"""Verifiable rewards: exact match, a math-answer verifier, and user functions by import path.

A reward function takes (prompt text, response text, reference answer) and returns a float.
`load_reward("exact" | "math" | "package.module:function")` gives one.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from fractions import Fraction

RewardFn = Callable[[str, str, str], float]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None  # unbalanced: no answer


def extract_answer(response: str) -> str | None:
    """The final answer of a response: the last \\boxed{...}, else what follows the last "####"
    or "answer is", else the last number; None when there is none."""
    boxed = _boxed(response)
    if boxed is not None:
        return boxed
    for marker in ("####", "answer is"):
        at = response.lower().rfind(marker)
        if at >= 0:
            tail = response[at + len(marker):].strip().rstrip(".")
            if tail:
                return tail.split("\n")[0].strip()
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def _normalize(s: str) -> str:
    s = _FRAC.sub(r"(\1)/(\2)", s.strip().strip("$").strip())
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace(" ", "").rstrip(".")
    s = re.sub(r"^[a-zA-Z]\s*=", "", s)  # "x = 3" -> "3"
    return s.replace("{", "").replace("}", "")


def _value(s: str) -> Fraction | None:
    """A number written as an integer, decimal, a/b or (a)/(b), with thousands commas; else None."""
    s = s.replace(",", "").replace("(", "").replace(")", "")
    try:
        if "/" in s:
            num, den = s.split("/")
            return Fraction(num) / Fraction(den)
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response's final answer equals `answer` (as normalized text or as a number,
    exactly for fractions and within 1e-6 relative for decimals), else 0.0."""
    got = extract_answer(response)
    if got is None:
        return 0.0
    a, b = _normalize(got), _normalize(answer)
    if a == b:
        return 1.0
    va, vb = _value(a), _value(b)
    if va is None or vb is None:
        return 0.0
    return float(va == vb or math.isclose(float(va), float(vb), rel_tol=1e-6, abs_tol=1e-12))


def exact_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response, stripped, is exactly the answer."""
    return float(response.strip() == answer.strip())


BUILTIN = {"exact": exact_reward, "math": math_reward}


def load_reward(spec: str) -> RewardFn:
    """A built-in reward by name or a user function `package.module:function`.

    Raises ValueError naming the spec when it cannot be imported or is not callable."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module, sep, name = spec.partition(":")
    if not sep:
        raise ValueError(f"reward {spec!r}: use one of {sorted(BUILTIN)} or 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward {spec!r}: cannot import it ({e})") from None
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable")
    return fn
