"""Command lines of the checkpoint tools (console entry points; `tools/*.py` call the same mains).

    trace-convert-hf-to-megatron --hf DIR --out DIR [--tp N --ep N --pp N --etp N]
    trace-convert-megatron-to-hf --megatron DIR --out DIR
    trace-export-fp4 (--megatron DIR | --hf DIR) --out DIR --format modelopt|compressed-tensors
    trace-ptq-fp4 --hf DIR --out DIR            (round-to-nearest FP4 of a BF16 model: the baseline)
    trace-rl audit [--model PRESET | --hf DIR | --megatron DIR] [--export DIR ...]

FP4 exports calibrate the static input scales with the rollout engine (named by dotted path, as
in `trace-rl`) in fp4 precision, on JSONL token ids (`--calib`), on random tokens
(`--calib-random N`, the default, with a warning) or from a saved amax file (`--input-amax`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ..backend import DEFAULT_ENGINE, make_backend
from ..model_config import PRESETS, ModelConfig, fp4_site_of
from ..modes import EnginePrecision, TrainerPrecision
from .fp4_export import FORMATS, KV_CACHE, export_fp4, input_amax_json, load_input_amax

_UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "B": 1}


def parse_size(text: str) -> int:
    """'2GB', '500MB', '100KB' or a byte count -> bytes."""
    t = text.strip().upper()
    for unit, mult in _UNITS.items():
        if t.endswith(unit) and t[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * mult)
    if t.isdigit():
        return int(t)
    raise argparse.ArgumentTypeError(f"size {text!r}: expected e.g. 2GB, 500MB, 100KB or bytes")


def _fail(e: Exception) -> SystemExit:
    return SystemExit(f"error: {e}")


# -- conversion ---------------------------------------------------------------------------------
def convert_hf_main(argv: list[str] | None = None) -> None:
    """`trace-convert-hf-to-megatron`: an HF Qwen3-MoE checkpoint as a Megatron distributed checkpoint."""
    from .convert import hf_to_megatron

    ap = argparse.ArgumentParser(prog="trace-convert-hf-to-megatron",
                                 description="HF Qwen3-MoE safetensors -> Megatron distributed checkpoint")
    ap.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("--out", required=True, help="Megatron checkpoint directory to create")
    for name in ("tp", "ep", "pp", "etp"):
        ap.add_argument(f"--{name}", type=int, default=1, help=f"{name.upper()} size of the layout that writes it")
    args = ap.parse_args(argv)
    try:
        out = hf_to_megatron(args.hf, args.out, args.tp, args.ep, args.pp, args.etp)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise _fail(e) from None
    print(f"wrote {out}")


def convert_megatron_main(argv: list[str] | None = None) -> None:
    """`trace-convert-megatron-to-hf`: a Megatron distributed checkpoint (any layout) as HF safetensors."""
    from .convert import megatron_to_hf

    ap = argparse.ArgumentParser(prog="trace-convert-megatron-to-hf",
                                 description="Megatron distributed checkpoint -> HF Qwen3-MoE safetensors")
    ap.add_argument("--megatron", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-shard-size", type=parse_size, default="2GB")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    try:
        out = megatron_to_hf(args.megatron, args.out, args.max_shard_size, args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise _fail(e) from None
    print(f"wrote {out}")


# -- FP4 export ---------------------------------------------------------------------------------
def _source(args) -> tuple[ModelConfig, dict, Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """(model config, HF config, a function returning a fresh (name, tensor) stream) of --hf or --megatron."""
    if args.hf:
        from .hf import HFCheckpoint

        ckpt = HFCheckpoint(args.hf)
        return ckpt.model_cfg, ckpt.hf_config, ckpt.items
    from .convert import megatron_configs, megatron_tensors

    cfg, hf = megatron_configs(args.megatron)
    return cfg, hf, lambda: megatron_tensors(args.megatron)


def read_calibration(path: str, model_cfg: ModelConfig) -> list[list[int]]:
    """Token-id sequences from JSONL lines {"input_ids": [...]}. ValueError naming a bad line."""
    seqs = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)["input_ids"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{i}: expected a JSON object with input_ids") from None
        if not ids or not all(isinstance(t, int) and 0 <= t < model_cfg.vocab_size for t in ids):
            raise ValueError(f"{path}:{i}: input_ids must be a non-empty list of ids in [0, {model_cfg.vocab_size})")
        if len(ids) > model_cfg.max_position_embeddings:
            raise ValueError(f"{path}:{i}: {len(ids)} tokens exceed "
                             f"max_position_embeddings={model_cfg.max_position_embeddings}")
        seqs.append(ids)
    if not seqs:
        raise ValueError(f"{path}: no calibration sequences")
    return seqs


def calibrate(args, model_cfg: ModelConfig, tensors) -> dict[tuple[int, str], float]:
    """{(layer, site): amax} of the FP4 sites' inputs, as the engine's FP4 forward sees them."""
    if args.input_amax:
        return load_input_amax(args.input_amax)
    if args.calib:
        seqs = read_calibration(args.calib, model_cfg)
    else:
        print(f"warning: calibrating input scales on {args.calib_random} random-token sequences; pass --calib "
              "with representative token ids for a served model", file=sys.stderr)
        rng = random.Random(0)
        seqs = [[rng.randrange(model_cfg.vocab_size) for _ in range(args.calib_len)] for _ in range(args.calib_random)]
    longest = max(map(len, seqs))
    engine = make_backend(args.engine, model_cfg, precision=EnginePrecision.FP4, device=args.device, block_size=16,
                          num_blocks=math.ceil(longest / 16), max_batch_tokens=longest, model_id="calibration")
    engine.update_weights(dict(tensors()), 0)
    return engine.activation_amax(seqs)


def _export_args(ap: argparse.ArgumentParser, hf_only: bool) -> None:
    if hf_only:
        ap.add_argument("--hf", required=True, help="HF BF16 checkpoint directory")
    else:
        src = ap.add_mutually_exclusive_group(required=True)
        src.add_argument("--megatron", help="Megatron distributed checkpoint directory (trained)")
        src.add_argument("--hf", help="HF BF16 checkpoint directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--kv-cache", default="fp4", choices=KV_CACHE, help="KV-cache setting recorded in the config")
    cal = ap.add_mutually_exclusive_group()
    cal.add_argument("--calib", help="JSONL of {\"input_ids\": [...]} to calibrate input scales on")
    cal.add_argument("--input-amax", help="JSON {\"<layer>.<site>\": amax} from an earlier calibration")
    cal.add_argument("--calib-random", type=int, default=8, help="random-token sequences (default 8)")
    ap.add_argument("--calib-len", type=int, default=256)
    ap.add_argument("--engine", default=DEFAULT_ENGINE, help="rollout backend module:Class used to calibrate")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-shard-size", type=parse_size, default="2GB")
    ap.add_argument("--overwrite", action="store_true")


def _export(args) -> Path:
    cfg, hf, tensors = _source(args)
    amax = calibrate(args, cfg, tensors)
    return export_fp4(tensors(), cfg, hf, args.out, args.format, amax, args.kv_cache, args.max_shard_size,
                      args.overwrite, extra_files={"trace_input_amax.json": input_amax_json(amax)})


def export_main(argv: list[str] | None = None) -> None:
    """`trace-export-fp4`: the final FP4 checkpoint (ModelOpt or compressed-tensors NVFP4)."""
    ap = argparse.ArgumentParser(prog="trace-export-fp4", description="a final FP4 checkpoint (ModelOpt or "
                                 "compressed-tensors NVFP4) from a Megatron or HF BF16 checkpoint")
    _export_args(ap, hf_only=False)
    args = ap.parse_args(argv)
    try:
        out = _export(args)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise _fail(e) from None
    print(f"wrote {out}")


def ptq_main(argv: list[str] | None = None) -> None:
    """Round-to-nearest FP4 of a BF16 HF checkpoint, and how far each FP4 weight moved."""
    from trace_kernels.fp4 import fake_quantize

    from .hf import HFCheckpoint

    ap = argparse.ArgumentParser(prog="trace-ptq-fp4", description="post-training FP4 quantization (the "
                                 "round-to-nearest baseline TRACE's final FP4 model is compared against)")
    _export_args(ap, hf_only=True)
    args = ap.parse_args(argv)
    args.megatron = None
    try:
        out = _export(args)
        errors = {}
        for name, w in HFCheckpoint(args.hf).items():
            if fp4_site_of(name):
                w = w.float()
                errors[name] = ((fake_quantize(w) - w).norm() / w.norm().clamp_min(1e-30)).item()
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise _fail(e) from None
    worst = max(errors, key=errors.get)
    print(f"wrote {out}: {len(errors)} FP4 weights, relative RMS error mean "
          f"{sum(errors.values()) / len(errors):.4f}, worst {errors[worst]:.4f} ({worst})")


# -- audit --------------------------------------------------------------------------------------
def audit_main(args: argparse.Namespace) -> list[str]:
    """Print every site's precision per side; exit non-zero naming each disagreement."""
    from ..megatron.model import build_model
    from ..megatron.spawn import init_one_process
    from .audit import audit

    if args.hf:
        from .hf import HFCheckpoint

        cfg = HFCheckpoint(args.hf).model_cfg
    elif args.megatron:
        from .convert import megatron_configs

        cfg = megatron_configs(args.megatron)[0]
    elif args.model in PRESETS:
        cfg = PRESETS[args.model]
    else:
        raise SystemExit(f"--model: unknown preset {args.model!r}; choose from {sorted(PRESETS)}")
    init_one_process()
    engine = make_backend(args.engine, cfg, precision=args.engine_precision, num_blocks=1)
    engines = {"engine": engine.quantization_table()}
    for path in args.also_engine or []:  # e.g. sglang_rollout.sglang:SGLangEngine: a column of its own
        other = make_backend(path, cfg, precision=args.engine_precision, num_blocks=64)
        engines[path.partition(":")[0].rpartition(".")[2]] = other.quantization_table()
        getattr(other, "shutdown", lambda: None)()
    if args.trainer == "deepspeed":  # transformers' Qwen3-MoE with TRACE's sites (the architecture alone)
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        from ..deepspeed.model import attach_fp4_sites, fp4_sites
        from .hf_layout import hf_config

        with torch.device("meta"):  # the sites alone: no weights are allocated, whatever the model's size
            hf_model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_config(cfg)))
        trainer = fp4_sites(attach_fp4_sites(hf_model, args.trainer_precision))
    else:
        trainer = build_model(cfg, args.trainer_precision)
    tables, problems = audit(cfg, trainer, engines, args.export or [])
    sides = list(tables)
    print(f"{'site':48s} " + " ".join(f"{s:>8s}" for s in sides))
    for m in sorted(tables["trainer"]) if args.verbose else []:
        print(f"{m:48s} " + " ".join(f"{tables[s].get(m, 'absent'):>8s}" for s in sides))
    for s in sides:
        counts = {}
        for p in tables[s].values():
            counts[p] = counts.get(p, 0) + 1
        print(f"{s}: " + ", ".join(f"{n} {p}" for p, n in sorted(counts.items())))
    if problems:
        raise SystemExit("audit FAILED:\n  " + "\n  ".join(problems))
    print(f"audit passed: {len(tables['trainer'])} sites agree across {', '.join(sides)}")
    return problems


def add_audit_parser(sub) -> None:
    """Add `audit` and its options to `trace-rl`'s subcommands."""
    au = sub.add_parser("audit", help="precision of every linear and KV site in trainer, engine and exports")
    src = au.add_mutually_exclusive_group()
    src.add_argument("--model", default="tiny", help="model preset")
    src.add_argument("--hf", help="HF checkpoint directory (its config.json)")
    src.add_argument("--megatron", help="Megatron checkpoint directory")
    au.add_argument("--export", action="append", help="an exported FP4 checkpoint to include (repeatable)")
    au.add_argument("--trainer-precision", default=TrainerPrecision.FP4_RNE.value,
                    choices=[p.value for p in TrainerPrecision])
    au.add_argument("--trainer", default="megatron", choices=["megatron", "deepspeed"],
                    help="the trainer backend whose sites are audited")
    au.add_argument("--engine-precision", default=EnginePrecision.FP4.value, choices=[p.value for p in EnginePrecision])
    au.add_argument("--engine", default=DEFAULT_ENGINE)
    au.add_argument("--also-engine", action="append", metavar="MODULE:CLASS",
                    help="another rollout backend whose column to add (repeatable), "
                         "e.g. sglang_rollout.sglang:SGLangEngine")
    au.add_argument("--verbose", action="store_true", help="print every site, not only the summary")
