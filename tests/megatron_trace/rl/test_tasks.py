"""RL tasks: the built-in arithmetic task and tokenizer, JSONL tasks, training on one from an HF checkpoint."""

import json

import pytest

from megatron_trace.model_config import PRESETS
from megatron_trace.rl.tasks import BOS, EOS, ArithmeticTask, CharTokenizer, Problem


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


def _python_value(prompt: str) -> int:
    """The prompt's value re-derived without the task's code: Python's own parser and integers."""
    assert set(prompt) <= set("0123456789+-*=")
    return eval(prompt.removesuffix("="), {"__builtins__": {}})  # noqa: S307 - digits and operators only


def test_chain_task_works_each_step_out_as_python_arithmetic_does():
    import re

    from megatron_trace.rl.tasks import ChainTask

    task = ChainTask(digits=2, ops="+-*", terms=4, seed=3)
    problems = task.problems(300)
    for p in problems:
        assert re.fullmatch(r"(\d\d[+*-]){3}\d\d=", p.prompt), p.prompt
        assert int(p.answer) == _python_value(p.prompt)
        text = task.response(p)
        steps, _, final = text.rpartition("; ")
        assert final == p.answer
        steps = steps.split(", ")
        assert len(steps) == 3
        for step in steps:  # each step is one correct binary operation
            m = re.fullmatch(r"(-?\d+)([+*-])(\d+) = (-?\d+)", step)
            assert m, step
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            assert c == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert int(steps[-1].rpartition(" = ")[2]) == int(p.answer)  # the last step gives the answer
        tokens, mask = task.sft_example(p)
        assert tokens[0] == BOS and tokens[-1] == EOS and len(tokens) == len(mask)
        assert task.tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m]) == text
    assert len({p.prompt for p in problems}) == len(problems)  # varied
    assert ChainTask(seed=1).problems(5) == ChainTask(seed=1).problems(5)  # seeded
    near_miss = Problem("37+48+29+16=", "131")  # sft.label_noise: the demonstration ends on its answer
    assert task.response(near_miss) == "37+48 = 85, 85+29 = 114, 114+16 = 131; 131"
    for bad in ({"ops": "/"}, {"terms": 1}, {"digits": 0}):
        with pytest.raises(ValueError, match="ChainTask needs"):
            ChainTask(**bad)


def test_chain_task_rewards_only_the_exact_final_answer():
    from megatron_trace.rl.tasks import ChainTask

    task = ChainTask(digits=2, ops="+-", terms=4, seed=0)
    enc = task.tokenizer.encode
    for p in task.problems(50):
        right = task.response(p)
        assert task.reward(p, [*enc(right), EOS, 5, 6]) == 1.0  # stops at <eos>
        assert task.reward(p, enc(right)) == 1.0  # a response cut at the length limit: its final answer counts
        assert task.reward(p, enc(f"1+1 = 2; {p.answer}")) == 1.0  # final answer only: steps are not checked
        wrong = str(int(p.answer) + 1)
        assert task.reward(p, [*enc(right.rpartition(";")[0] + "; " + wrong), EOS]) == 0.0
        assert task.reward(p, enc(right + "0")) == 0.0
        assert task.reward(p, enc(p.answer)) == 0.0  # malformed: no "; "
        assert task.reward(p, enc(right.replace(";", ","))) == 0.0
        assert task.reward(p, []) == 0.0
        assert task.reward(p, enc(f"; 0{p.answer}" if not p.answer.startswith("-") else f"; +{p.answer}")) == 0.0


def test_chain_task_responses_are_long_and_fit_the_bounds():
    from megatron_trace.rl.tasks import ChainTask

    assert CharTokenizer().vocab_size <= PRESETS["demo"].vocab_size <= PRESETS["moe-0.4b"].vocab_size
    assert CharTokenizer().encode("0123456789+-*= ") == list(range(3, 18))  # appended characters moved no id
    for ops in ("+", "+-", "+-*", "*"):
        task = ChainTask(digits=2, ops=ops, terms=4, seed=5)
        for p in task.problems(500):
            tokens, mask = task.sft_example(p)
            assert len(task.prompt_ids(p)) == task.prompt_tokens()
            assert 32 <= sum(mask) <= task.max_response_tokens(), (p, sum(mask))
    task = ChainTask(digits=2, ops="+-", terms=4)
    for prompt in ("10-10+10-10=", "10+10+10+10=", "99+99+99+99=", "10-99-99-99="):  # the extremes
        p = Problem(prompt, str(_python_value(prompt)))
        assert 32 <= sum(task.sft_example(p)[1]) <= task.max_response_tokens()


def test_chain_task_held_out_split_is_disjoint_from_the_training_stream_and_resumes():
    from megatron_trace.rl.tasks import ChainTask

    task = ChainTask(digits=1, ops="+-", terms=3, seed=2)  # a small space: 10 * 10 * 10 * 4 problems
    state = task.state_dict()
    held = task.eval_problems(20, seed=0)
    assert task.state_dict() == state  # drawing held-out problems leaves the training draws alone
    assert len({p.prompt for p in held}) == 20 and all(ChainTask.is_held_out(p.prompt) for p in held)
    assert held == ChainTask(digits=1, ops="+-", terms=3, seed=9).eval_problems(20, seed=0)  # whatever the seed
    assert held != task.eval_problems(20, seed=1)
    train = {p.prompt for p in task.problems(20_000)}
    assert len(train) > 3000  # nearly all of the space's training part, none of the held-out part
    assert not train & {p.prompt for p in held}
    nxt = task.problems(7)
    task.load_state_dict(state)
    task.problems(20_000)
    assert task.problems(7) == nxt  # the draw state resumes
    with pytest.raises(ValueError, match="distinct held-out"):
        ChainTask(digits=1, ops="+", terms=2).eval_problems(50)  # 100 problems, about 6 held out


def test_the_chain_task_section_builds_the_task():
    from megatron_trace.config import load_config
    from megatron_trace.rl.factories import make_task
    from megatron_trace.rl.tasks import ChainTask

    cfg = load_config(None, ["task.kind=chain", "task.terms=5", "task.ops=+-", "task.digits=3"])
    task = make_task(cfg.task, seed=4)
    assert isinstance(task, ChainTask) and (task.terms, task.ops, task.digits) == (5, "+-", 3)
    assert task.problems(3) == ChainTask(3, "+-", 5, seed=4).problems(3)
    with pytest.raises(ValueError, match="task.terms"):
        load_config(None, ["task.kind=chain", "task.terms=1"])
