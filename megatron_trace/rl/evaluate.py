"""Evaluation of a policy on held-out problems: accuracy with a 95% Wilson interval.

`evaluate(backend, task, problems)` decodes every problem greedily (temperature 0) on a rollout
backend that already holds the weights and scores each response with the task's reward (1.0 =
correct). The weights reach the built-in engine (`sglang_rollout.engine.TraceEngine`) the way a
user has them, through `RolloutBackend.update_weights` (full Megatron names; BF16 tensors, or
packed NVFP4 `QTensor`s at the FP4 sites):

- a BF16 HF checkpoint (`trace-convert-megatron-to-hf` of a run's `checkpoints/<phase>-<step>/model`):
  `dict(HFCheckpoint(dir))`, into a `bf16` engine (or an `fp4` engine, which quantizes on receipt);
- a Megatron checkpoint: `megatron_state(dir)`;
- an FP4 export (`trace-export-fp4`, `trace-ptq-fp4`; ModelOpt NVFP4 or compressed-tensors):
  `checkpoint.fp4_export.load_fp4_export(dir)` (beside the writer) reads the packed codes, block
  scales and global scales back as QTensors with the engine's names, into an `fp4` engine,
  which serves exactly those bytes.
  The export's static input scales are not used: the engine quantizes activations with one
  global scale per token (docs/design.md section 2), which those formats cannot express.

    python -m megatron_trace.rl.evaluate --fp4-export DIR --set task.kind=chain --n 500 --json acc.json
    python -m megatron_trace.rl.evaluate --hf DIR --precision bf16 --set task.kind=chain

The problems come from the task's held-out split (`ChainTask.eval_problems`), never from its
training stream.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..backend import BACKENDS, DEFAULT_ENGINE, backend_path, make_backend
from ..model_config import ModelConfig
from ..modes import EnginePrecision
from ..rollout import GroupRequest, SamplingParams

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


def wilson_interval(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion `correct / total` ((0, 1) for total 0)."""
    if not 0 <= correct <= total:
        raise ValueError(f"wilson_interval needs 0 <= correct <= total, got {correct}, {total}")
    if total == 0:
        return 0.0, 1.0
    p, n, z2 = correct / total, total, z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    lo = 0.0 if correct == 0 else max(0.0, center - half)  # exact at the ends (rounding leaves 1e-16 there)
    hi = 1.0 if correct == total else min(1.0, center + half)
    return lo, hi


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """Accuracy of greedy responses: `correct` of `total`, and its 95% Wilson interval [lo, hi].
    `examples`: the first few (prompt, response, answer, reward), for reading."""

    correct: int
    total: int
    accuracy: float
    lo: float
    hi: float
    mean_response_tokens: float
    truncated: int
    examples: list[dict]

    def as_dict(self) -> dict:
        return asdict(self)


def evaluate(backend, task, problems, max_new_tokens: int, batch: int = 512, progress: bool = False,
             keep_examples: int = 8) -> EvalResult:
    """Greedy decoding (temperature 0) of every problem on `backend` (a RolloutBackend holding
    the weights), each response scored by `task.reward`; `batch` problems per generate call.
    `truncated` counts responses that reached max_new_tokens without <eos>."""
    from tqdm import tqdm

    eos = task.tokenizer.eos_id
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=(eos,), seed=0)
    correct, tokens, truncated, examples = 0, 0, 0, []
    bar = tqdm(total=len(problems), desc="eval", unit="problem", disable=not progress)
    for start in range(0, len(problems), batch):
        chunk = problems[start:start + batch]
        requests = [GroupRequest(f"eval{start + i}", tuple(task.prompt_ids(p)), n=1) for i, p in enumerate(chunk)]
        out = backend.generate(requests, sampling)
        for p, sample in zip(chunk, out.samples, strict=True):
            if sample.finish_reason == "error":
                raise ValueError(f"evaluation of {p.prompt!r} failed in the engine: {sample.error}")
            reward = task.reward(p, sample.tokens)
            correct += reward == 1.0
            tokens += len(sample.tokens)
            truncated += sample.finish_reason == "length"
            if len(examples) < keep_examples:
                examples.append({"prompt": p.prompt, "response": task.tokenizer.decode(sample.tokens),
                                 "answer": p.answer, "reward": reward})
        bar.update(len(chunk))
    bar.close()
    n = len(problems)
    lo, hi = wilson_interval(int(correct), n)
    return EvalResult(correct=int(correct), total=n, accuracy=correct / n if n else 0.0, lo=lo, hi=hi,
                      mean_response_tokens=tokens / n if n else 0.0, truncated=int(truncated), examples=examples)


def eval_engine(model_cfg: ModelConfig, precision: EnginePrecision | str, problems: int, prompt_tokens: int,
                max_new_tokens: int, engine: str = DEFAULT_ENGINE, device: str | None = None):
    """A backend `engine` (a name of backend.BACKENDS, `builtin` or `sglang`, or "module:Class")
    with room for `problems` greedy responses at once (one sample each, no guidance recorded)."""
    from .plan import kv_blocks

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    options = dict(precision=EnginePrecision(precision), device=device, guide="none", model_id="eval",
                   num_blocks=kv_blocks(problems, 1, prompt_tokens, max_new_tokens))
    if backend_path(engine) == DEFAULT_ENGINE:  # the built-in engine's forward size (SGLang sizes its own)
        options["max_batch_tokens"] = max(2048, prompt_tokens * min(problems, 64))
    return make_backend(engine, model_cfg, **options)


# -- weights as a user has them -----------------------------------------------------------------
def megatron_state(directory: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, full BF16 state dict) of a TRACE Megatron checkpoint (e.g. a run's
    `checkpoints/rl-000040/model`), read in one process."""
    from ..checkpoint.convert import megatron_configs, megatron_tensors

    cfg, _ = megatron_configs(directory)
    return cfg, dict(megatron_tensors(directory))


def hf_state(directory: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, full state dict) of an HF Qwen3-MoE checkpoint directory."""
    from ..checkpoint.hf import HFCheckpoint

    ckpt = HFCheckpoint(directory)
    return ckpt.model_cfg, dict(ckpt.items())


# -- command line -------------------------------------------------------------------------------
def _weights(args) -> tuple[ModelConfig, dict, str]:
    if args.fp4_export:
        from ..checkpoint.fp4_export import load_fp4_export

        cfg, state = load_fp4_export(args.fp4_export)
        return cfg, state, "fp4"
    cfg, state = hf_state(args.hf) if args.hf else megatron_state(args.megatron)
    return cfg, state, args.precision or "bf16"


def main(argv: list[str] | None = None) -> dict:
    """`python -m megatron_trace.rl.evaluate`: accuracy of one model on the task's held-out problems."""
    from ..config import load_config
    from .factories import make_task

    ap = argparse.ArgumentParser(prog="python -m megatron_trace.rl.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--fp4-export", help="an FP4 export (trace-export-fp4 / trace-ptq-fp4): served by an fp4 engine")
    src.add_argument("--hf", help="a BF16 HF checkpoint directory")
    src.add_argument("--megatron", help="a TRACE Megatron checkpoint directory")
    ap.add_argument("--precision", choices=[p.value for p in EnginePrecision],
                    help="the engine's precision for --hf / --megatron (default bf16; an export runs in fp4)")
    ap.add_argument("--config", help="YAML of the run whose task to evaluate on")
    ap.add_argument("--set", action="append", default=[], help="section.key=value (e.g. task.kind=chain)")
    ap.add_argument("--n", type=int, default=500, help="held-out problems")
    ap.add_argument("--seed", type=int, default=0, help="which held-out problems")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0: the task's longest response")
    ap.add_argument("--engine", default="builtin",
                    help=f"the serving engine: {' or '.join(BACKENDS)} (SGLang with TRACE's plugin), or module:Class")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    if args.fp4_export and args.precision not in (None, "fp4"):
        raise SystemExit("--fp4-export runs in an fp4 engine; drop --precision")
    try:
        task = make_task(load_config(args.config, args.set).task, 0)
        if not hasattr(task, "eval_problems"):
            raise ValueError("the task has no held-out split (task.kind=chain has one)")
        problems = task.eval_problems(args.n, args.seed)
        max_new = args.max_new_tokens or task.max_response_tokens()
        cfg, state, precision = _weights(args)
        backend = eval_engine(cfg, precision, min(args.n, 512), task.prompt_tokens(), max_new, args.engine)
        backend.update_weights(state, 0)
        del state
        result = evaluate(backend, task, problems, max_new, progress=True)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"accuracy {result.accuracy:.4f} [{result.lo:.4f}, {result.hi:.4f}] ({result.correct}/{result.total}, "
          f"{precision} engine)")
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=1) + "\n")
    return result.as_dict()


if __name__ == "__main__":
    main(sys.argv[1:])
