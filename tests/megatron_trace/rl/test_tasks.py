"""RL tasks: the built-in arithmetic task and tokenizer, JSONL tasks, training on one from an HF checkpoint."""

import json

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


def _jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_jsonl_task_draws_every_problem_once_per_epoch_and_resumes(tmp_path):
    from megatron_trace.rl.rewards import math_reward
    from megatron_trace.rl.tasks import JsonlTask

    records = [{"prompt": f"{i}+{i}=", "answer": 2 * i} for i in range(5)]
    task = JsonlTask(_jsonl(tmp_path / "t.jsonl", records), CharTokenizer(), math_reward, seed=3)
    first = task.problems(5)
    assert sorted(p.prompt for p in first) == sorted(r["prompt"] for r in records)  # an epoch: each once
    state = task.state_dict()
    nxt = task.problems(7)
    task.load_state_dict(state)
    assert task.problems(7) == nxt  # a resumed run draws the same problems
    p = first[0]
    ids, mask = task.sft_example(p)
    assert ids[0] == BOS and ids[-1] == EOS and sum(mask) == len(p.answer) + 1
    answer_ids = CharTokenizer().encode(p.answer) + [EOS, 5]
    assert task.reward(p, answer_ids) == 1.0 and task.reward(p, CharTokenizer().encode("9999")) == 0.0


def test_jsonl_task_names_bad_records(tmp_path):
    from megatron_trace.rl.rewards import exact_reward
    from megatron_trace.rl.tasks import JsonlTask

    for lines, message in ((['{"prompt": "1+1="}'], r"t.jsonl:1: expected a JSON object with 'prompt' and 'answer'"),
                           (['{"prompt": "1+1=", "answer": 2}', "not json"], r"t.jsonl:2: expected"),
                           (['{"prompt": "", "answer": 2}'], "non-empty string"),
                           (['{"prompt": "what?", "answer": 2}'], "not in the tokenizer's alphabet")):
        (tmp_path / "t.jsonl").write_text("\n".join(lines))
        with pytest.raises(ValueError, match=message):
            JsonlTask(str(tmp_path / "t.jsonl"), CharTokenizer(), exact_reward)


def answer_length_reward(prompt, response, answer):
    """A user reward for the import-path test: 1 when the response is as long as the answer."""
    return float(len(response) == len(answer))


def run_jsonl_train(rank, *, out_dir, hf_dir, data):
    from megatron_trace.cli import main

    main(["train", "--set", "sft.steps=5", "--set", "rl.steps=2", "--set", "rl.prompts_per_step=3",
          "--set", f"model.hf={hf_dir}", "--set", "task.kind=jsonl", "--set", f"task.path={data}",
          "--set", "task.reward=tests.megatron_trace.rl.test_tasks:answer_length_reward",
          "--set", f"output_dir={out_dir}"])


def test_train_on_a_jsonl_task_from_an_hf_checkpoint_with_a_user_reward(tmp_path):
    from megatron_trace.megatron.spawn import spawn
    from tests.support.hf_models import save_hf_tiny

    save_hf_tiny(tmp_path / "hf")
    data = _jsonl(tmp_path / "d.jsonl",
                  [{"prompt": f"{a}*{b}=", "answer": a * b} for a in range(3, 9) for b in (7, 11)])
    spawn(run_jsonl_train, {}, out_dir=str(tmp_path / "run"), hf_dir=str(tmp_path / "hf"), data=data)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(0 <= r["reward"] <= 1 for r in rows)
    assert all(r["k3_kl"] < 1e-9 for r in rows)  # trace mode on the converted HF model
