"""The headline RL experiment on one GPU (issue 23): SFT a real-sized MoE from random
initialisation on a verifiable task, GRPO from it in several run modes and seeds, then evaluate
the final policies as they would be served.

    python bench/rl_experiment.py --smoke                # CPU, demo preset, a few minutes
    python bench/rl_experiment.py --time-limit 540       # the real settings (GPU: bench/gpu_rl_experiment.sh)
    python bench/rl_experiment.py --modes bf16,trace-all --seeds 0 --rl-steps 20

Stages, each resumable:

(a) SFT once (`trace-rl sft`, seed 0) from random init of `--preset` (moe-0.4b) on the chain task
    (`task.kind=chain`: worked multi-step arithmetic, reward on the final answer);
(b) GRPO (`trace-rl train`) from the SFT checkpoint (model.megatron=<sft>/checkpoints/rl-000000/model,
    sft.steps=0) per seed (`seed=`: the same prompts and sampling seeds for every mode of a seed)
    and mode: `bf16`, `fp4-rollout`, `fp4-qat`, `trace-deep<K>` (rl.guide=deep:K), `trace-all`
    (rl.guide=all), `trace-sparse` (rl.guide=all, rl.coding=sparse);
(c) evaluation of each final policy on held-out prompts (`ChainTask.eval_problems`: never in the
    training stream), greedy, accuracy with a 95% Wilson interval (`megatron_trace.rl.evaluate`),
    served the way a user serves it: an FP4-trained policy (`fp4-qat`, `trace-*`) exported by
    `trace-export-fp4` and run by the FP4 engine; a BF16-trained one (`bf16`, `fp4-rollout`, and
    the SFT model) converted by `trace-convert-megatron-to-hf` and run by the BF16 engine (the
    ceiling) and, rounded by `trace-ptq-fp4`, by the FP4 engine (the PTQ baseline). Each
    evaluation is a process of its own (`--evaluate`), started by the worker that trained the run,
    so the runs' evaluations go on beside each other and beside training (2026-12-04 on one
    H200: one at a time in the main process, 85-205 s each, they held up a seed by minutes);
(d) the report: <out>/rl_experiment_<date>_<gpu|cpu>.{md,json,png}.

Resuming. Everything finished is recorded in a state file (`--state`, default <runs>/state.json)
after each unit of work, and the report's JSON carries the same state, so a later session on a
fresh machine continues from a copy of it (`--resume-from bench/results/rl_experiment_..._gpu.json`):
finished runs and evaluations are not redone. A run interrupted by `--time-limit` (or killed)
continues from its last checkpoint while its run directory survives (a warm machine); on a fresh
machine the SFT is redone first (its weights' SHA-256 is recorded per run, so the report says
whether every run started from the same SFT model: GPU training need not be bitwise
reproducible, and a fresh machine's model differs). The modes of a seed are compared from one SFT
model: a mode of a seed whose other runs started from another model is skipped there, with the
reason (give it a new seed). Each SFT model is evaluated once, and the report pairs each policy
with the PTQ baseline of its own seed. A run's checkpoints are deleted once it is evaluated
(`--keep-checkpoints` keeps them). With `--time-limit S` nothing is started that cannot make
progress before S seconds, a training process still running then is stopped (it resumes from its
checkpoint), the report is written and the script exits with status 3: run it again to continue.
When a trainer or a tool fails, the report of what finished is written, with the failing log's
tail, and the status is 1.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/rl_experiment.py` from a checkout
    sys.path.insert(0, str(ROOT))

STATE_VERSION = 2  # 2: the SFT evaluations are kept per SFT model (its weights' fingerprint)
STOPPED = 3  # exit status when the time limit stopped the experiment (run again to continue)


# -- settings -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything a recorded result depends on (modes and seeds may grow between sessions)."""

    preset: str = "moe-0.4b"
    digits: int = 2
    ops: str = "+-"
    terms: int = 4
    sft_steps: int = 800
    sft_batch: int = 128
    sft_lr: float = 5e-4
    rl_steps: int = 40
    prompts_per_step: int = 16
    group_size: int = 8
    mini_batches: int = 2
    prompt_set: int = 0  # fresh training problems every step: the held-out evaluation measures generalisation
    # 1e-4 drove bf16 GRPO from reward 0.55 to 0.18 (2026-12-02); 3e-6, 1e-5, 3e-5 all rose (2026-12-03)
    rl_lr: float = 1e-5
    temperature: float = 1.0
    eval_n: int = 500
    eval_seed: int = 0
    calib_n: int = 64


SMOKE = dict(preset="demo", sft_steps=60, sft_batch=16, sft_lr=3e-3, rl_steps=3, prompts_per_step=4, group_size=8,
             mini_batches=1, rl_lr=3e-4, eval_n=16, calib_n=4)


def mode_sets(mode: str) -> list[str]:
    """The `--set` overrides of an experiment mode name: `bf16`, `fp4-rollout`, `fp4-qat`,
    `trace-all`, `trace-deep<K>`, `trace-sparse`, each optionally with `@lr=<float>` for its own RL
    learning rate (a sweep sharing the one SFT model, e.g. `bf16@lr=1e-5`)."""
    base, at, lr = mode.partition("@lr=")
    fixed = {"bf16": ["rl.mode=bf16"], "fp4-rollout": ["rl.mode=fp4-rollout"], "fp4-qat": ["rl.mode=fp4-qat"],
             "trace-all": ["rl.mode=trace", "rl.guide=all"],
             "trace-sparse": ["rl.mode=trace", "rl.guide=all", "rl.coding=sparse"]}
    if base in fixed:
        sets = fixed[base]
    elif m := re.fullmatch(r"trace-deep(\d+)", base):
        sets = ["rl.mode=trace", f"rl.guide=deep:{m[1]}"]
    else:
        raise SystemExit(f"unknown mode {mode!r}: bf16, fp4-rollout, fp4-qat, trace-all, trace-deep<K>, "
                         "trace-sparse, optionally with @lr=<float>")
    if at:
        try:
            if not float(lr) > 0:
                raise ValueError
        except ValueError:
            raise SystemExit(f"mode {mode!r}: @lr= needs a positive number, got {lr!r}") from None
        sets = [*sets, f"rl.lr={lr}"]  # after the experiment's rl.lr: the later --set wins
    return sets


def eval_kinds(mode: str) -> list[str]:
    """How a mode's final policy is served: FP4-trained ones as their FP4 export; BF16-trained
    ones in BF16 (the ceiling) and rounded to FP4 after training (PTQ)."""
    base = mode.partition("@")[0]
    return ["bf16", "ptq-fp4"] if base in ("bf16", "fp4-rollout", "sft") else ["fp4-export"]


EVAL_LABELS = {"fp4-export": "trace-export-fp4 -> FP4 engine", "ptq-fp4": "trace-ptq-fp4 -> FP4 engine",
               "bf16": "BF16 (HF) -> BF16 engine"}


def make_chain_task(s: Settings, seed: int = 0):
    from megatron_trace.rl.tasks import ChainTask

    return ChainTask(s.digits, s.ops, s.terms, seed=seed)


# -- the state ----------------------------------------------------------------------------------
def new_state(s: Settings) -> dict:
    """sft.eval: {SFT fingerprint: {kind: result}}; runs: {"<mode>/s<seed>": entry}."""
    return {"version": STATE_VERSION, "settings": asdict(s), "sft": {"fingerprints": [], "wall_s": [], "eval": {}},
            "runs": {}, "sessions": []}


def upgrade_state(state: dict, source: str) -> dict:
    """A recorded state in this script's version. Version 1 kept one set of SFT evaluations; they
    were made in the session of the first SFT recorded (the SFT model is evaluated right after its
    training), so they belong to its fingerprint."""
    if state.get("version") == 1:
        ev, fps = state["sft"]["eval"], state["sft"]["fingerprints"]
        state = {**state, "version": 2, "sft": {**state["sft"], "eval": {fps[0]: ev} if ev and fps else {}}}
    if state.get("version") != STATE_VERSION:
        raise SystemExit(f"{source}: state version {state.get('version')}, this script writes {STATE_VERSION}")
    return state


def run_progress(entry: dict) -> tuple[int, int, int]:
    return int(bool(entry.get("rl_done"))), len(entry.get("eval", {})), len(entry.get("partial_metrics", []))


def read_metrics(path: Path) -> list[dict]:
    """A run's metrics.jsonl rows (one per finished RL step); [] before its first step."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def partial_line(key: str, entry: dict, steps: int) -> str:
    """'mode/sN (k/steps steps, ...)': how far an unfinished run got, from its recorded steps."""
    rows = entry.get("partial_metrics") or []
    if not rows:
        return f"{key} (no step finished)"
    k = window(rows)
    kl, step_s = mean(r.get("k3_kl") for r in rows), mean(r.get("step_s") for r in rows)
    return (f"{key} ({len(rows)}/{steps} steps" + (f", {step_s:.1f} s/step" if step_s is not None else "") + ", reward "
            f"{mean(r['reward'] for r in rows[:k]):.3f} -> {mean(r['reward'] for r in rows[-k:]):.3f}"
            + (f", k3_kl {kl:.2e}" if kl is not None else "") + ")")


def merge_state(into: dict, other: dict, source: str) -> None:
    """Add `other`'s finished work to `into` (the same settings, or SystemExit naming the first
    difference); per run the entry with more done wins."""
    if "state" in other:  # a report's JSON
        other = other["state"]
    other = upgrade_state(other, source)
    for key, value in into["settings"].items():
        if other["settings"].get(key) != value:
            raise SystemExit(f"{source}: recorded with {key}={other['settings'].get(key)!r}, now {value!r}; "
                             "use another --runs/--state (or the same settings)")
    sft, osft = into["sft"], other["sft"]
    sft["fingerprints"] += [f for f in osft["fingerprints"] if f not in sft["fingerprints"]]
    sft["wall_s"] += [w for w in osft["wall_s"] if w not in sft["wall_s"]]  # one per SFT trained
    for fp, evals in osft["eval"].items():
        for kind, res in evals.items():
            sft["eval"].setdefault(fp, {}).setdefault(kind, res)
    for key, entry in other["runs"].items():
        mine = into["runs"].get(key)
        if mine is None or run_progress(entry) > run_progress(mine):
            into["runs"][key] = entry
    into["sessions"] += [x for x in other["sessions"] if x not in into["sessions"]]


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


# -- processes ----------------------------------------------------------------------------------
class Deadline:
    def __init__(self, limit_s: float | None):
        self.end = time.monotonic() + limit_s if limit_s else math.inf

    def left(self) -> float:
        return self.end - time.monotonic()


class TimeUp(Exception):
    """The time limit stopped a unit of work; it resumes in the next session."""


def run_process(cmd: list[str], what: str, log: Path, deadline: Deadline, verbose: bool) -> None:
    """Run `cmd` with its output in `log` (and on the terminal with --verbose); stopped (SIGTERM,
    then SIGKILL, its own process group) when the deadline comes: TimeUp. RuntimeError naming the
    log's tail when it fails. `what` names it in both."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"\n$ {what}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=None if verbose else f,
                                stderr=subprocess.STDOUT if not verbose else None, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, deadline.left()) if math.isfinite(deadline.left()) else None)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise TimeUp(f"{what} stopped at the time limit") from None
    if rc:
        tail = "\n".join(log.read_text().splitlines()[-30:]) if not verbose else ""
        raise RuntimeError(f"{what} failed (exit {rc}); log {log}:\n{tail}")


def trace_rl(args: list[str], log: Path, deadline: Deadline, verbose: bool) -> None:
    """`python -m megatron_trace.cli <args>` through `run_process`."""
    run_process([sys.executable, "-m", "megatron_trace.cli", *args], f"trace-rl {args[0]}", log, deadline, verbose)


def tool(main, argv: list[str]) -> None:
    """One of the checkpoint tools' mains (the console entry points' code), in this process."""
    try:
        main(argv)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise RuntimeError(f"{main.__name__} {' '.join(argv)}: {e}") from None


def evaluate_model(s: Settings, kind: str, model_dir: Path, work: Path, calib: Path) -> dict:
    """The accuracy of the Megatron checkpoint `model_dir` served as `kind` ("bf16": converted to
    HF, BF16 engine; "ptq-fp4": that HF model rounded by trace-ptq-fp4, FP4 engine; "fp4-export":
    trace-export-fp4, FP4 engine) on the settings' held-out problems; intermediate files in `work`."""
    import torch

    from megatron_trace.checkpoint.cli import convert_megatron_main, export_main, ptq_main
    from megatron_trace.checkpoint.fp4_export import load_fp4_export
    from megatron_trace.rl.evaluate import eval_engine, evaluate, hf_state

    t = time.time()
    task = make_chain_task(s)
    max_new_tokens = task.max_response_tokens()
    hf, fp4 = work / "hf", work / f"{kind}-modelopt"
    if kind in ("bf16", "ptq-fp4") and not (hf / "config.json").exists():
        tool(convert_megatron_main, ["--megatron", str(model_dir), "--out", str(hf), "--overwrite"])
    if kind == "ptq-fp4":
        tool(ptq_main, ["--hf", str(hf), "--out", str(fp4), "--format", "modelopt", "--calib", str(calib),
                        "--overwrite"])
    elif kind == "fp4-export":
        tool(export_main, ["--megatron", str(model_dir), "--out", str(fp4), "--format", "modelopt", "--calib",
                           str(calib), "--overwrite"])
    cfg, state = hf_state(hf) if kind == "bf16" else load_fp4_export(fp4)
    problems = task.eval_problems(s.eval_n, s.eval_seed)
    backend = eval_engine(cfg, "bf16" if kind == "bf16" else "fp4", min(len(problems), 512), task.prompt_tokens(),
                          max_new_tokens)
    backend.update_weights(state, 0)
    del state
    result = evaluate(backend, task, problems, max_new_tokens, keep_examples=4).as_dict()
    del backend
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    result["wall_s"] = time.time() - t
    return result


# -- the experiment -----------------------------------------------------------------------------
class Experiment:
    def __init__(self, args, s: Settings):
        self.args, self.s = args, s
        self.runs = Path(args.runs)
        self.runs.mkdir(parents=True, exist_ok=True)
        self.state_path = Path(args.state) if args.state else self.runs / "state.json"
        self.state = new_state(s)
        if self.state_path.exists():
            merge_state(self.state, json.loads(self.state_path.read_text()), str(self.state_path))
        for path in args.resume_from:
            if not Path(path).exists():
                raise SystemExit(f"--resume-from {path}: no such file")
            merge_state(self.state, json.loads(Path(path).read_text()), path)
        # the trainer is stopped `reserve` seconds before the limit: time to stop it and report
        self.deadline = Deadline(args.time_limit - args.reserve if args.time_limit else None)
        self.task = make_chain_task(s)
        self.max_new_tokens = self.task.max_response_tokens()
        self.sft_dir = self.runs / "sft"
        self.sft_model = self.sft_dir / "checkpoints" / "rl-000000" / "model"
        self.sft_fingerprint: str | None = None
        self.failed: str | None = None
        self.lock = threading.RLock()  # the state, written by the trainer threads
        self.t0 = time.time()

    # -- shared settings -----------------------------------------------------------------------
    def task_sets(self) -> list[str]:
        s = self.s
        return ["task.kind=chain", f"task.digits={s.digits}", f"task.ops={s.ops}", f"task.terms={s.terms}",
                f"model.preset={s.preset}"]

    def rl_sets(self, mode: str, seed: int, out: Path) -> list[str]:
        s = self.s
        sets = [*self.task_sets(), f"model.megatron={self.sft_model}", "sft.steps=0", f"rl.steps={s.rl_steps}",
                f"rl.prompts_per_step={s.prompts_per_step}", f"rl.group_size={s.group_size}",
                f"rl.max_new_tokens={self.max_new_tokens}", f"rl.max_prompt_tokens={self.task.prompt_tokens()}",
                f"rl.lr={s.rl_lr}", f"rl.temperature={s.temperature}", f"rl.mini_batches={s.mini_batches}",
                f"rl.prompt_set={s.prompt_set}", *mode_sets(mode), f"seed={seed}",
                f"checkpoint.every={self.args.checkpoint_every}", "checkpoint.keep=1", f"output_dir={out}"]
        return sets

    def save(self) -> None:
        with self.lock:
            write_json(self.state_path, self.state)

    def log(self, message: str) -> None:
        """A line with the time since the start (under the progress bar)."""
        from tqdm import tqdm

        tqdm.write(f"[{(time.time() - self.t0) / 60:5.1f} min] {message}", file=sys.stdout)

    def check_time(self, what: str, need_s: float = 0.0) -> None:
        need_s = max(need_s, self.args.min_start)
        self.log(f"{what} ({self.deadline.left():.0f} s left)" if math.isfinite(self.deadline.left()) else what)
        if self.deadline.left() < need_s:
            raise TimeUp(f"{self.deadline.left():.0f} s left, {what} needs about {need_s:.0f} s")

    # -- (a) SFT -------------------------------------------------------------------------------
    def sft(self) -> None:
        """The SFT checkpoint, trained (or resumed) unless it is there; its fingerprint."""
        if not (self.sft_model / "trace_model.json").exists():
            self.check_time("the SFT")
            t = time.time()
            sets = [*self.task_sets(), f"sft.steps={self.s.sft_steps}", f"sft.batch={self.s.sft_batch}",
                    f"sft.lr={self.s.sft_lr}", "seed=0", "checkpoint.keep=1",
                    f"checkpoint.sft_every={self.args.sft_checkpoint_every}", f"output_dir={self.sft_dir}"]
            trace_rl(["sft", *[a for x in sets for a in ("--set", x)]], self.sft_dir / "log.txt", self.deadline,
                     self.args.verbose)
            self.state["sft"]["wall_s"].append(time.time() - t)
        self.sft_fingerprint = fingerprint(self.sft_model)
        if self.sft_fingerprint not in self.state["sft"]["fingerprints"]:
            self.state["sft"]["fingerprints"].append(self.sft_fingerprint)
        self.save()

    # -- (b) RL --------------------------------------------------------------------------------
    def rl(self, mode: str, seed: int) -> dict:
        key = f"{mode}/s{seed}"
        with self.lock:
            entry = self.state["runs"].setdefault(key, {"mode": mode, "seed": seed, "eval": {}})
        if entry.get("rl_done"):
            return entry
        out = self.runs / f"{mode}-s{seed}"
        self.check_time(f"RL {key}")
        t = time.time()
        try:
            trace_rl(["train", *[a for x in self.rl_sets(mode, seed, out) for a in ("--set", x)]], out / "log.txt",
                     self.deadline, self.args.verbose)
        finally:
            with self.lock:
                entry["rl_wall_s"] = entry.get("rl_wall_s", 0.0) + time.time() - t
                # the steps so far, kept in the state (and the report) if the run stops here: a
                # session cut off mid-run still shows how far and how fast each mode went
                entry["partial_metrics"] = read_metrics(out / "metrics.jsonl")
        rows = entry["partial_metrics"]
        if [r["step"] for r in rows] != list(range(self.s.rl_steps)):
            raise RuntimeError(f"{out}/metrics.jsonl has steps {[r['step'] for r in rows]}, "
                               f"not 0..{self.s.rl_steps - 1}")
        with self.lock:
            del entry["partial_metrics"]
            entry.update(metrics=rows, rl_done=True, sft_fingerprint=self.sft_fingerprint)
        self.save()
        return entry

    def final_model(self, mode: str, seed: int) -> Path | None:
        """The run's final Megatron checkpoint; None when its run directory did not survive."""
        from megatron_trace.rl.run_checkpoint import latest_checkpoint

        out = self.runs / f"{mode}-s{seed}"
        ckpt = latest_checkpoint(out) if (out / "checkpoints" / "latest").exists() else None
        if ckpt is None:
            return None
        import torch

        step = torch.load(ckpt / "state.pt", weights_only=False)["state"]["step"]
        return ckpt / "model" if step == self.s.rl_steps else None

    # -- (c) evaluation ------------------------------------------------------------------------
    def calib_file(self) -> Path:
        """Calibration sequences of the FP4 exports' static input scales: training-split prompts
        with their worked responses (never the held-out problems)."""
        path = self.runs / "calib.jsonl"
        if not path.exists():
            task = make_chain_task(self.s, seed=12345)
            lines = [json.dumps({"input_ids": task.sft_example(p)[0]}) for p in task.problems(self.s.calib_n)]
            path.write_text("\n".join(lines) + "\n")
        return path

    def evaluate(self, kind: str, model_dir: Path, work: Path) -> dict:
        """Serve the Megatron checkpoint `model_dir` as `kind` says and measure its accuracy, in a
        process of its own (`--evaluate`: several run at once beside the trainers). Its failure
        is a RuntimeError naming the model and the log's tail: the trainers still running go on
        (an evaluation once stopped every run of a session)."""
        with self.lock:
            calib = self.calib_file()
        work.mkdir(parents=True, exist_ok=True)
        result = work / f"{kind}.result.json"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--evaluate", kind, str(model_dir), str(work),
               str(calib), str(result), "--settings", json.dumps(asdict(self.s))]
        run_process(cmd, f"evaluating {model_dir} as {kind}", work / f"{kind}.log", self.deadline, self.args.verbose)
        return json.loads(result.read_text())

    def evaluate_run(self, entry: dict, model_dir: Path, work: Path) -> None:
        for kind in eval_kinds(entry["mode"]):
            if kind in entry["eval"]:
                continue
            self.check_time(f"evaluating {entry['mode']} as {kind}", self.eval_estimate(kind))
            result = self.evaluate(kind, model_dir, work)
            with self.lock:
                entry["eval"][kind] = result
            self.save()
        shutil.rmtree(work, ignore_errors=True)

    def eval_estimate(self, kind: str) -> float:
        with self.lock:
            seen = [e["eval"][kind]["wall_s"] for e in self.state["runs"].values() if kind in e.get("eval", {})]
        return 1.2 * max(seen) if seen else 0.0

    # -- all of it -----------------------------------------------------------------------------
    def pending(self, modes: list[str], seeds: list[int]) -> list[tuple[str, int]]:
        out = []
        for seed in seeds:
            for mode in modes:
                e = self.state["runs"].get(f"{mode}/s{seed}", {})
                if not e.get("rl_done") or len(e.get("eval", {})) < len(eval_kinds(mode)):
                    out.append((mode, seed))
        return out

    def sft_conflict(self, mode: str, seed: int) -> str | None:
        """Why the run cannot be trained on this machine, or None: the seed's other finished runs
        started from another SFT model (a fresh machine's SFT differs: GPU training is not bitwise
        reproducible), and a seed's modes are compared from one."""
        entry = self.state["runs"].get(f"{mode}/s{seed}", {})
        if entry.get("rl_done") and self.final_model(mode, seed) is not None:
            return None  # trained here, only its evaluation is left
        theirs = sorted({e["sft_fingerprint"] for key, e in self.state["runs"].items() if e["seed"] == seed
                         and key != f"{mode}/s{seed}" and e.get("rl_done") and e.get("sft_fingerprint")})
        if theirs and self.sft_fingerprint not in theirs:
            return (f"{mode} seed {seed}: not trained here: the seed's other runs started from SFT model "
                    f"{', '.join(theirs)}, this machine's is {self.sft_fingerprint} (GPU SFT is not bitwise "
                    "reproducible); give this mode a new seed")
        return None

    def train_run(self, mode: str, seed: int) -> tuple[dict, Path]:
        """A run trained to its end (again when its final checkpoint is gone); its entry and final model."""
        entry = self.rl(mode, seed)
        model = self.final_model(mode, seed)
        if model is None:  # trained in a session whose machine is gone, evaluated only in part
            self.log(f"{mode} seed {seed}: its final checkpoint is gone; training it again")
            with self.lock:
                del self.state["runs"][f"{mode}/s{seed}"]
            shutil.rmtree(self.runs / f"{mode}-s{seed}", ignore_errors=True)
            entry = self.rl(mode, seed)
            model = self.final_model(mode, seed)
        return entry, model

    def train_and_evaluate(self, mode: str, seed: int) -> dict:
        """A run trained and evaluated (in one worker: its evaluations run beside the others'
        training and evaluations); its entry. Evaluated even when another unit failed: on
        2026-12-06 one run's out-of-memory left three finished runs unevaluated in that call."""
        entry, model = self.train_run(mode, seed)
        self.evaluate_run(entry, model, self.runs / f"{mode}-s{seed}" / "eval")
        if not self.args.keep_checkpoints:
            shutil.rmtree(self.runs / f"{mode}-s{seed}" / "checkpoints", ignore_errors=True)
        return entry

    def run(self, modes: list[str], seeds: list[int]) -> bool:
        """Every stage still to do; False when the time limit stopped it or a unit failed. Up to
        --parallel runs are trained and then evaluated at once (one GPU is far from busy with one
        small model), each in processes of its own."""
        from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

        from tqdm import tqdm

        todo = self.pending(modes, seeds)
        bar = tqdm(total=len(todo) + bool(todo), desc="experiment", unit="run", file=sys.stdout)
        stopped: list[str] = []
        sft_eval_todo = []
        try:
            if todo:  # an SFT model is evaluated once per fingerprint: a fresh machine's SFT differs
                bar.set_postfix_str("sft")
                self.sft()
                done = self.state["sft"]["eval"].get(self.sft_fingerprint, {})
                sft_eval_todo = [k for k in eval_kinds("sft") if k not in done]
        except TimeUp as e:
            stopped.append(str(e))
        except RuntimeError as e:
            self.failed = str(e)
        if stopped or self.failed:
            todo = sft_eval_todo = []
        conflicts = {unit: self.sft_conflict(*unit) for unit in todo}
        skipped = [why for why in conflicts.values() if why]
        todo = [unit for unit in todo if not conflicts[unit]]
        with ThreadPoolExecutor(max_workers=max(1, self.args.parallel)) as pool:
            running = {pool.submit(self.train_and_evaluate, mode, seed): (mode, seed) for mode, seed in todo}
            bar.set_postfix_str(f"{len(running)} runs, up to {self.args.parallel} at once")
            try:  # the SFT model is evaluated while the first runs train
                for kind in sft_eval_todo:
                    self.check_time(f"evaluating the SFT model as {kind}")
                    ev = self.evaluate(kind, self.sft_model, self.runs / "sft-eval")
                    with self.lock:
                        self.state["sft"]["eval"].setdefault(self.sft_fingerprint, {})[kind] = ev
                    self.save()
                shutil.rmtree(self.runs / "sft-eval", ignore_errors=True)
                if todo:
                    bar.update(1)
                    self.print_sft()
            except TimeUp as e:
                stopped.append(str(e))
            except RuntimeError as e:
                tqdm.write(f"FAILED: evaluating the SFT model: {e}")
                self.failed = str(e)
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    mode, seed = running.pop(fut)
                    try:
                        entry = fut.result()
                        bar.update(1)
                        tqdm.write(run_line(entry))
                    except TimeUp as e:
                        stopped.append(f"{mode} seed {seed}: {e}")
                    except Exception as e:  # noqa: BLE001 - a trainer or tool failed: the others go on; exit 1 at the end
                        tqdm.write(f"FAILED: {mode} seed {seed}: {e}")
                        self.failed = self.failed or f"{mode} seed {seed}: {e}"
        bar.close()
        if self.failed:
            print(f"FAILED: {self.failed}")
            return False
        for why in skipped:
            print(f"skipped: {why}")
        if stopped:
            print(f"stopped: {stopped[0]}" + (f" (and {len(stopped) - 1} more)" if len(stopped) > 1 else "")
                  + f". Run the same command again to continue (state: {self.state_path}).")
            return False
        return not skipped

    def print_sft(self) -> None:
        ev = self.state["sft"]["eval"].get(self.sft_fingerprint, {})
        print(f"SFT model {self.sft_fingerprint}: "
              + ", ".join(f"{EVAL_LABELS[k]} {fmt_acc(v)}" for k, v in ev.items()))


def fingerprint(model_dir: Path) -> str:
    """SHA-256 over every weight's name and bytes (full tensors, in the checkpoint's order)."""
    import torch

    from megatron_trace.checkpoint.convert import megatron_tensors

    h = hashlib.sha256()
    for name, t in megatron_tensors(model_dir):
        h.update(name.encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# -- the report ---------------------------------------------------------------------------------
def fmt_acc(e: dict) -> str:
    return f"{e['accuracy']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}]"


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def window(rows: list[dict]) -> int:
    """Steps averaged at the start and end of a run: 10, fewer for short runs."""
    return max(1, min(10, len(rows) // 2))


def run_line(entry: dict) -> str:
    rows = entry["metrics"]
    k = window(rows)
    first, last = mean(r["reward"] for r in rows[:k]), mean(r["reward"] for r in rows[-k:])
    ev = ", ".join(f"{k2} {fmt_acc(v)}" for k2, v in entry["eval"].items())
    return (f"{entry['mode']} seed {entry['seed']}: reward {first:.3f} -> {last:.3f} (first/last {k} steps), "
            f"k3_kl {mean(r.get('k3_kl') for r in rows):.2e}; eval {ev}")


def spread(values: list[float], fmt: str = ".3f") -> str:
    """'mean (min-max)' over seeds, or the value alone for one seed."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    m = sum(values) / len(values)
    return f"{m:{fmt}}" if len(values) == 1 else f"{m:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def finished_runs(state: dict, mode: str, seeds: list[int]) -> list[dict]:
    """The mode's runs that trained to their end, of these seeds, in seed order."""
    return sorted((e for e in state["runs"].values() if e["mode"] == mode and e["seed"] in seeds and e.get("rl_done")),
                  key=lambda e: e["seed"])


def summarise(state: dict, modes: list[str], seeds: list[int]) -> dict:
    """Per mode: rewards, mismatch, flips, speed and evaluations over its finished runs of `seeds`."""
    from megatron_trace.rl.evaluate import wilson_interval

    out = {}
    for mode in modes:
        entries = finished_runs(state, mode, seeds)
        if not entries:
            continue
        per = []
        for e in entries:
            rows = e["metrics"]
            k = window(rows)
            by_layer = {}
            for key in ("flip_rate_by_layer", "residual_flip_rate_by_layer"):
                dicts = [r[key] for r in rows if key in r]
                if dicts:
                    by_layer[key] = {L: mean(d[L] for d in dicts) for L in sorted(dicts[0], key=int)}
            per.append({"seed": e["seed"], "reward_first": mean(r["reward"] for r in rows[:k]),
                        "reward_last": mean(r["reward"] for r in rows[-k:]), "window": k,
                        "k3_kl_mean": mean(r.get("k3_kl") for r in rows),
                        "k3_kl_max": max((r["k3_kl"] for r in rows if "k3_kl" in r), default=None),
                        "flip_rate": mean(r.get("flip_rate") for r in rows),
                        "residual_flip_rate": mean(r.get("residual_flip_rate") for r in rows),
                        "guidance_bytes_per_token": mean(r.get("guidance_bytes_per_token") for r in rows),
                        "step_s": mean(r.get("step_s") for r in rows),
                        "response_tokens": mean(r.get("response_tokens") for r in rows), **by_layer})
        evals = {}
        for kind in eval_kinds(mode):
            done = [e["eval"][kind] for e in entries if kind in e["eval"]]
            if done:
                correct, total = sum(d["correct"] for d in done), sum(d["total"] for d in done)
                lo, hi = wilson_interval(correct, total)
                evals[kind] = {"per_seed": {e["seed"]: e["eval"][kind] for e in entries if kind in e["eval"]},
                               "mean": mean(d["accuracy"] for d in done), "min": min(d["accuracy"] for d in done),
                               "max": max(d["accuracy"] for d in done), "pooled": correct / total,
                               "pooled_lo": lo, "pooled_hi": hi}
        out[mode] = {"seeds": [e["seed"] for e in entries], "per_seed": per, "eval": evals}
    return out


def sft_by_seed(state: dict, modes: list[str], seeds: list[int]) -> dict[int, list[str]]:
    """{seed: the fingerprints of the SFT models its finished runs started from} (one, when the
    seed's modes were trained on one machine)."""
    out: dict[int, list[str]] = {}
    for mode in modes:
        for e in finished_runs(state, mode, seeds):
            fp = e.get("sft_fingerprint")
            if fp and fp not in out.setdefault(e["seed"], []):
                out[e["seed"]].append(fp)
    return dict(sorted(out.items()))


def sft_line(by_seed: dict[int, list[str]]) -> str:
    """'seed 0 `ab12`, seeds 1, 2 `cd34`': the SFT model of each seed, seeds sharing one together."""
    groups: dict[str, list[int]] = {}
    for seed, fps in by_seed.items():
        groups.setdefault(" + ".join(f"`{fp}`" for fp in fps), []).append(seed)
    return ", ".join(f"seed{'s' if len(xs) > 1 else ''} {', '.join(map(str, xs))} {fps}" for fps, xs in groups.items())


def layer_means(per: list[dict], key: str) -> dict[str, float]:
    dicts = [p[key] for p in per if key in p]
    return {L: mean(d[L] for d in dicts) for L in dicts[0]} if dicts else {}


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"CPU ({os.cpu_count()} cores, {model})"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(exp: Experiment, modes: list[str], seeds: list[int], complete: bool) -> Path:
    """Write <out>/rl_experiment_<date>_<gpu|cpu>.{md,json,png}; returns the .md path."""
    import torch

    state, s = exp.state, exp.s
    date = datetime.date.today().isoformat()
    # the machines that did the work (a --report-only run elsewhere names them, not itself)
    devices = ", ".join(dict.fromkeys(x["device"] for x in state["sessions"])) or device_name()
    gpu = any(not x["device"].startswith("CPU") for x in state["sessions"]) or torch.cuda.is_available()
    tag = "gpu" if gpu else "cpu"
    out = Path(exp.args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"rl_experiment_{date}_{tag}"
    summary = summarise(state, modes, seeds)
    by_seed = sft_by_seed(state, modes, seeds)
    task = make_chain_task(s, seed=99)
    example = task.problems(1)[0]
    sessions = state["sessions"]
    lines = [f"# RL experiment: SFT, then GRPO per run mode — {date}, {devices}", "",
             "Command: " + ", ".join(dict.fromkeys(f"`python bench/rl_experiment.py {x['command']}`".replace(" `", "`")
                                                   for x in sessions) or ["-"])
             + f" (this report: commit {git_commit()}); {len(sessions)} session(s)"
             + "".join(f"; {x['date']} {x['device']} {x['wall_s'] / 60:.1f} min" for x in sessions) + ".",
             *([] if complete else ["", "**Incomplete**: the experiment stopped at its time limit, or modes and seeds "
                                    "are missing; the tables hold what finished."]), "",
             f"- Model: `{s.preset}` preset, random init. Task: `task.kind=chain`, {s.terms} operands of {s.digits} "
             f"digits, ops `{s.ops}` (prompt {task.prompt_tokens()} tokens, responses up to "
             f"{exp.max_new_tokens}); e.g. `{example.prompt}` -> `{task.response(example)}`; "
             "reward 1 for the exact final answer.",
             f"- SFT: {s.sft_steps} steps of {s.sft_batch}, lr {s.sft_lr}, seed 0"
             + (f", {spread([w / 60 for w in state['sft']['wall_s']], '.1f')} min" if state["sft"]["wall_s"] else "")
             + f"; the SFT model of each seed's runs (SHA-256 prefix of its weights): {sft_line(by_seed) or '-'}"
             + (" (**more than one model**: GPU SFT is not bitwise reproducible, so a fresh machine trains another; "
                "the modes of a seed are compared on one)" if len({f for v in by_seed.values() for f in v}) > 1
                else "") + ".",
             f"- GRPO: {s.rl_steps} steps of {s.prompts_per_step} prompts x {s.group_size} samples, "
             f"{s.mini_batches} mini-batch(es) per step, lr {s.rl_lr} (a mode named `@lr=X` uses X), "
             f"temperature {s.temperature}, "
             f"max {exp.max_new_tokens} new tokens; seeds {', '.join(map(str, seeds))} (a seed fixes the prompts and "
             "sampling seeds for every mode).",
             f"- Evaluation: {s.eval_n} held-out problems (`ChainTask.eval_problems(seed={s.eval_seed})`, disjoint "
             "from the training stream), greedy; accuracy with a 95% Wilson interval.", "",
             "## RL per mode", "",
             "Mean over seeds (min-max over seeds in brackets); reward first/last: the mean over the first/last "
             f"{window([0] * s.rl_steps)} steps.", "",
             "| mode | seeds | reward, first | reward, last | k3_kl mean | k3_kl max | flip rate | residual flip rate "
             "| guidance B/token | step s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, m in summary.items():
        per = m["per_seed"]
        lines.append(f"| {mode} | {len(per)} | {spread([p['reward_first'] for p in per])} | "
                     f"{spread([p['reward_last'] for p in per])} | {spread([p['k3_kl_mean'] for p in per], '.2e')} | "
                     f"{spread([p['k3_kl_max'] for p in per], '.2e')} | "
                     f"{spread([p['flip_rate'] for p in per], '.2e')} | "
                     f"{spread([p['residual_flip_rate'] for p in per], '.2e')} | "
                     f"{spread([p['guidance_bytes_per_token'] for p in per], '.0f')} | "
                     f"{spread([p['step_s'] for p in per], '.2f')} |")
    flips = {mode: layer_means(m["per_seed"], "flip_rate_by_layer") for mode, m in summary.items()}
    flips = {k: v for k, v in flips.items() if v}
    if flips:
        layers = sorted({L for v in flips.values() for L in v}, key=int)
        lines += ["", "## Flip rate by layer", "",
                  "Share of FP4 elements whose trainer round-to-nearest code differs from the engine's (mean over "
                  "steps and seeds); after guidance (residual) in brackets.", "",
                  "| mode | " + " | ".join(f"layer {L}" for L in layers) + " |", "|---|" + "---|" * len(layers)]
        for mode, v in flips.items():
            res = layer_means(summary[mode]["per_seed"], "residual_flip_rate_by_layer")
            cells = [f"{v[L]:.2e}" + (f" ({res[L]:.1e})" if L in res else "") if L in v else "-" for L in layers]
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += ["", "## Evaluation of the final policies", "",
              "Accuracy on the held-out problems, greedy. Per seed: accuracy [95% Wilson interval]; over seeds: "
              "mean (min-max), and the pooled count with its Wilson interval (the seeds share the problems, so the "
              "pooled interval is optimistic).", "",
              "| policy | served as | " + " | ".join(f"seed {x}" for x in seeds) + " | mean (min-max) | pooled |",
              "|---|---|" + "---|" * len(seeds) + "---|---|"]
    for kind in eval_kinds("sft"):  # each seed's SFT model; the mean and pool count each model once
        cells, models = [], {}
        for x in seeds:
            fps = by_seed.get(x, [])
            e = state["sft"]["eval"].get(fps[0], {}).get(kind) if len(fps) == 1 else None
            cells.append(fmt_acc(e) if e else "-")
            if e:
                models[fps[0]] = e
        if models:
            done = list(models.values())
            correct, total = sum(d["correct"] for d in done), sum(d["total"] for d in done)
            lines.append(f"| SFT model (before RL) | {EVAL_LABELS[kind]} | " + " | ".join(cells) +
                         f" | {spread([d['accuracy'] for d in done])} ({len(done)} model{'s' * (len(done) > 1)}) | "
                         f"{correct}/{total} |")
    order = [("trace", "fp4-export"), ("fp4-qat", "fp4-export"), ("bf16", "ptq-fp4"), ("bf16", "bf16"),
             ("fp4-rollout", "ptq-fp4"), ("fp4-rollout", "bf16")]
    rows = [(mode, kind) for prefix, kind in order for mode in summary if mode.startswith(prefix)
            and kind in summary[mode]["eval"]]
    for mode, kind in rows:
        ev = summary[mode]["eval"][kind]
        cells = [fmt_acc(ev["per_seed"][x]) if x in ev["per_seed"] else "-" for x in seeds]
        lines.append(f"| {mode} | {EVAL_LABELS[kind]} | " + " | ".join(cells) +
                     f" | {spread([v['accuracy'] for v in ev['per_seed'].values()])} | "
                     f"{ev['pooled']:.3f} [{ev['pooled_lo']:.3f}, {ev['pooled_hi']:.3f}] |")
    lines += ["", "Headline comparison: `trace-*` exported to FP4 vs `bf16` after PTQ to FP4 (both served by the FP4 "
              "engine), against `bf16` in BF16 (the ceiling). The export's static input scales are not used by the "
              "built-in engine (per-token activation scales, docs/design.md section 2).", ""]
    lines += paired_headline(summary, seeds)
    keys = [f"{m}/s{x}" for x in seeds for m in modes]
    unfinished = [k for k in keys if k in state["runs"] and not state["runs"][k].get("rl_done")]
    not_run = [k for k in keys if k not in state["runs"]]
    if unfinished:
        lines += [f"Not finished: {', '.join(partial_line(k, state['runs'][k], s.rl_steps) for k in unfinished)}.", ""]
    if not_run:  # a seed run with --modes holding some modes only
        lines += [f"Not run: {', '.join(not_run)}.", ""]
    png = stem.with_suffix(".png")
    if plot(summary, state, seeds, png, f"{s.preset}, chain task ({s.terms}x{s.digits} digits, `{s.ops}`), {devices}"):
        lines += [f"Plot: `{png.name}` (reward and k3_kl per step: mean over seeds, band min-max; flip rate by layer; "
                  "evaluation accuracy with Wilson intervals). Every step's metrics and every evaluation: "
                  f"`{stem.name}.json` (its `state` resumes the experiment: `--resume-from`)."]
    md = stem.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    write_json(stem.with_suffix(".json"), {"date": date, "device": devices, "command": sys.argv,
                                           "commit": git_commit(), "complete": complete, "modes": modes,
                                           "seeds": seeds, "summary": summary, "state": state})
    return md


def paired_headline(summary: dict, seeds: list[int]) -> list[str]:
    """Markdown lines: each FP4-served policy's accuracy minus that of PTQ FP4 of the `bf16`
    policy of the same seed (one SFT model, the same prompts and sampling seeds), on the seeds
    where both were evaluated; the means above can average over different seeds."""
    base = summary.get("bf16", {}).get("eval", {}).get("ptq-fp4", {}).get("per_seed", {})
    rows = [(mode, kind) for mode in summary for kind in ("fp4-export", "ptq-fp4", "bf16")
            if kind in summary[mode]["eval"] and (mode, kind) != ("bf16", "ptq-fp4")]
    out = []
    for mode, kind in rows:
        mine = summary[mode]["eval"][kind]["per_seed"]
        both = [x for x in seeds if x in mine and x in base]
        if both:
            diffs = [mine[x]["accuracy"] - base[x]["accuracy"] for x in both]
            out.append(f"| {mode} | {EVAL_LABELS[kind]} | {', '.join(map(str, both))} | "
                       + ", ".join(f"{d:+.3f}" for d in diffs) + f" | {sum(diffs) / len(diffs):+.3f} |")
    if not out:
        return []
    return ["Paired by seed: accuracy minus that of `bf16` -> `trace-ptq-fp4` (the PTQ baseline) of the same seed.",
            "", "| policy | served as | seeds | per seed | mean |", "|---|---|---|---|---|", *out, ""]


def plot(summary: dict, state: dict, seeds: list[int], path: Path, title: str) -> bool:
    """Reward and k3_kl per step (mean over seeds, min-max band), flip rate by layer (mean over
    seeds, min-max bars), evaluation accuracy (Wilson intervals). False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not summary:
        return False
    fig, (ax_r, ax_k, ax_f, ax_e) = plt.subplots(1, 4, figsize=(21, 4.2))
    for i, mode in enumerate(summary):
        color = f"C{i}"
        runs = [e["metrics"] for e in finished_runs(state, mode, seeds)]
        steps = min(len(r) for r in runs)
        x = list(range(steps))
        for ax, key, floor in ((ax_r, "reward", None), (ax_k, "k3_kl", 1e-18)):
            vals = [[(r[t].get(key) if r[t].get(key) is not None else math.nan) for r in runs] for t in x]
            if floor:
                vals = [[max(v, floor) for v in vs] for vs in vals]
            m = [sum(vs) / len(vs) for vs in vals]
            ax.plot(x, m, color=color, label=mode, marker="." if steps < 30 else None)
            if len(runs) > 1:
                ax.fill_between(x, [min(vs) for vs in vals], [max(vs) for vs in vals], color=color, alpha=0.2)
    flips = [(mode, m["per_seed"]) for mode, m in summary.items() if any("flip_rate_by_layer" in p
                                                                         for p in m["per_seed"])]
    width = 0.8 / max(1, len(flips))
    for j, (mode, per) in enumerate(flips):
        color = f"C{list(summary).index(mode)}"
        dicts = [p["flip_rate_by_layer"] for p in per if "flip_rate_by_layer" in p]
        layers = sorted(dicts[0], key=int)
        means = [mean(d[L] for d in dicts) for L in layers]
        err = [[m - min(d[L] for d in dicts) for m, L in zip(means, layers, strict=True)],
               [max(d[L] for d in dicts) - m for m, L in zip(means, layers, strict=True)]]
        ax_f.bar([int(L) + j * width for L in layers], means, width, color=color, label=mode, yerr=err, capsize=2)
    bars = []
    used = {fp for fps in sft_by_seed(state, list(summary), seeds).values() for fp in fps}
    for fp, evals in state["sft"]["eval"].items():
        for kind, e in evals.items():
            if fp in used:
                bars.append((f"SFT {fp[:6]}\n{kind}", e["accuracy"], e["lo"], e["hi"], "gray"))
    for i, (mode, m) in enumerate(summary.items()):
        for kind, ev in m["eval"].items():
            bars.append((f"{mode}\n{kind}", ev["pooled"], ev["pooled_lo"], ev["pooled_hi"], f"C{i}"))
    for j, (_, acc, lo, hi, color) in enumerate(bars):
        ax_e.bar(j, acc, color=color, yerr=[[acc - lo], [hi - acc]], capsize=3)
    ax_e.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=60, fontsize=7)
    ax_r.set(xlabel="RL step", ylabel="mean reward", title="reward (mean over seeds, band min-max)", ylim=(-0.02, 1.02))
    ax_k.set(xlabel="RL step", ylabel="k3_kl (train vs rollout)", title="train-rollout mismatch", yscale="log")
    ax_f.set(xlabel="layer", ylabel="fraction of FP4 elements", title="flip rate by layer (bars: min-max over seeds)")
    if flips:
        ax_f.set_xticks(sorted({int(L) for _, per in flips for p in per for L in p.get("flip_rate_by_layer", {})}))
    # zoomed to the bars' intervals: the policies differ by points, not tens of points
    floor = max(0.0, math.floor((min((b[2] for b in bars), default=0.0) - 0.05) * 20) / 20)
    ax_e.set(ylabel="held-out accuracy (greedy)", title="evaluation (pooled over seeds, 95% Wilson)", ylim=(floor, 1))
    if not flips:
        ax_f.text(0.5, 0.5, "no FP4 trainer in these runs", ha="center", va="center", transform=ax_f.transAxes)
    for ax in (ax_r, ax_k, ax_f, ax_e):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return True


# -- command line -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    import warnings

    for message in ("Transformer Engine and Apex", "Apex is not installed", "Mismatch dtype between input and weight"):
        warnings.filterwarnings("ignore", message=message)  # of the checkpoint tools and engines run in this process
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU-sized: demo preset, a few steps, 1 seed, 2 modes")
    ap.add_argument("--modes", help="comma-separated (default: bf16,trace-all,fp4-qat,trace-deep<K>,trace-sparse,"
                    "fp4-rollout; --smoke: bf16,trace-all)")
    ap.add_argument("--seeds", help="comma-separated (default 0,1,2; --smoke: 0)")
    ap.add_argument("--guide-k", type=int, default=4, help="K of the default trace-deep<K> mode (rl.guide=deep:K)")
    defaults = Settings()
    for f, v in asdict(defaults).items():
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=None, help=f"default {v} (--smoke: "
                        f"{SMOKE.get(f, v)})")
    ap.add_argument("--runs", help="run directories (default runs/rl_experiment, --smoke: runs/rl_experiment_smoke)")
    ap.add_argument("--state", help="the state file (default <runs>/state.json)")
    ap.add_argument("--resume-from", action="append", default=[],
                    help="an earlier state or report JSON whose finished work to keep (repeatable)")
    ap.add_argument("--out", help="report directory (default bench/results; --smoke: <runs>/report)")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds; stop cleanly before then (exit 3)")
    ap.add_argument("--reserve", type=float, default=45,
                    help="seconds before --time-limit at which a running trainer is stopped (to report in time)")
    ap.add_argument("--min-start", type=float, default=None,
                    help="no unit of work starts with fewer seconds left (default 60; --smoke: 10)")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="RL steps between checkpoints")
    ap.add_argument("--sft-checkpoint-every", type=int, default=500, help="SFT steps between checkpoints")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoints after its evaluation")
    ap.add_argument("--parallel", type=int, default=1,
                    help="RL runs trained at once (separate processes on the same GPU; default 1)")
    ap.add_argument("--verbose", action="store_true", help="show the trainers' own output (else in <run>/log.txt)")
    ap.add_argument("--report-only", action="store_true", help="write the report from the state, run nothing")
    ap.add_argument("--evaluate", nargs=5, metavar=("KIND", "MODEL", "WORK", "CALIB", "RESULT"),
                    help="internal: one evaluation (the experiment runs these as processes of their own); "
                    "with --settings, the JSON of the settings")
    ap.add_argument("--settings", help="internal: the settings of --evaluate, as JSON")
    args = ap.parse_args(argv)
    if args.evaluate:
        kind, model, work, calib, result = args.evaluate
        out = evaluate_model(Settings(**json.loads(args.settings)), kind, Path(model), Path(work), Path(calib))
        write_json(Path(result), out)
        return 0
    if args.min_start is None:
        args.min_start = 10.0 if args.smoke else 60.0
    values = asdict(defaults) | (SMOKE if args.smoke else {})
    values |= {f: getattr(args, f) for f in values if getattr(args, f) is not None}
    s = Settings(**values)
    modes = (args.modes or ("bf16,trace-all" if args.smoke else
                            f"bf16,trace-all,fp4-qat,trace-deep{args.guide_k},trace-sparse,fp4-rollout")).split(",")
    for mode in modes:
        mode_sets(mode)  # fail now on a bad name
    seeds = [int(x) for x in (args.seeds or ("0" if args.smoke else "0,1,2")).split(",")]
    args.runs = args.runs or ("runs/rl_experiment_smoke" if args.smoke else "runs/rl_experiment")
    args.out = args.out or (str(Path(args.runs) / "report") if args.smoke else str(ROOT / "bench" / "results"))
    exp = Experiment(args, s)
    t0 = time.time()
    complete = True
    if not args.report_only:
        try:
            complete = exp.run(modes, seeds)
        finally:
            exp.state["sessions"].append({"date": datetime.datetime.now().isoformat(timespec="minutes"),
                                          "device": device_name(), "wall_s": time.time() - t0,
                                          "command": " ".join(sys.argv[1:])})
            exp.save()
    else:
        complete = not exp.pending(modes, seeds)
    md = report(exp, modes, seeds, complete and not exp.pending(modes, seeds))
    print(f"\nreport: {md} (+ .json, .png); state: {exp.state_path}; {(time.time() - t0) / 60:.1f} min")
    summary = summarise(exp.state, modes, seeds)
    for mode, m in summary.items():
        per = m["per_seed"]
        ev = "; ".join(f"{k} {spread([v['accuracy'] for v in e['per_seed'].values()])}" for k, e in m["eval"].items())
        print(f"  {mode:14s} reward {spread([p['reward_first'] for p in per])} -> "
              f"{spread([p['reward_last'] for p in per])}, k3_kl {spread([p['k3_kl_mean'] for p in per], '.1e')}; "
              f"eval {ev}")
    for key, entry in exp.state["runs"].items():
        if entry.get("partial_metrics") and not entry.get("rl_done"):
            print("  unfinished: " + partial_line(key, entry, s.rl_steps))
    return 1 if exp.failed else 0 if complete else STOPPED


if __name__ == "__main__":
    sys.exit(main())
