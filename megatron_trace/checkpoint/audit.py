"""Quantization audit: the precision of every linear and KV site as the trainer, the engine and an
exported checkpoint each hold it, keyed by HF module name, and every disagreement named.

The failure this catches is known elsewhere (verl#7519): an ignore pattern such as `mlp.gate`
that substring-matches `gate_up_proj` silently leaves layers in BF16 on one side. A checkpoint's
exclusion list is therefore read under every matching rule the serving stacks use (exact name,
`fnmatch` wildcards, substring, and compressed-tensors' `re:` regexes): a quantized module caught
by any of them, or a BF16 linear that no rule excludes, is a disagreement.

A table maps "model.layers.{L}.self_attn.q_proj" (and the other linears, including the router
"mlp.gate" and "lm_head") and "model.layers.{L}.self_attn.kv_cache" to "fp4" or "bf16".
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable

from ..model_config import ModelConfig, full_weight_shapes
from .hf_layout import hf_parts
from .safetensors_io import SafetensorsDir

Table = dict[str, str]
_LINEAR_SUFFIXES = ("proj.weight", "proj_with_mqa.weight", "mlp.gate.weight", "lm_head.weight")


def _kv(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.kv_cache"


def linear_modules(name: str, model_cfg: ModelConfig) -> list[str]:
    """HF linear modules that Megatron weight `name` feeds (empty for norms and embeddings)."""
    return [h.removesuffix(".weight") for h, _ in hf_parts(name, model_cfg) if h.endswith(_LINEAR_SUFFIXES)]


def table_from_weights(model_cfg: ModelConfig, is_fp4: Callable[[str], bool], kv_fp4: bool) -> Table:
    """A table from a predicate over full Megatron weight names (the engine's view)."""
    table = {m: "fp4" if is_fp4(name) else "bf16" for name in full_weight_shapes(model_cfg)
             for m in linear_modules(name, model_cfg)}
    return table | {_kv(L): "fp4" if kv_fp4 else "bf16" for L in range(model_cfg.num_layers)}


def trainer_table(model, model_cfg: ModelConfig) -> Table:
    """The table of a one-process trainer: a Megatron model (each FP4 site with the weights it
    touches, megatron.model.fp4_site_weights) or a list of FP4Sites (the DeepSpeed trainer's
    Qwen3-MoE sites, deepspeed.model.fp4_sites): a module is fp4 when every site touching it
    (its weight's and its input's) runs an FP4 precision."""
    if isinstance(model, list):
        touched = [(site, _qwen3_site_weights(site, model_cfg)) for site in model]
    else:
        from ..megatron.model import KV_CACHE, fp4_site_weights  # megatron-core only when auditing a trainer

        touched = [(site, [_kv(site.layer) if w == KV_CACHE else m for w in weights
                           for m in ([w] if w == KV_CACHE else linear_modules(w, model_cfg))])
                   for site, weights in fp4_site_weights(model)]
    table = table_from_weights(model_cfg, lambda name: False, False)
    votes: dict[str, set[bool]] = {}
    for site, modules in touched:
        for m in modules:
            votes.setdefault(m, set()).add(site.precision.quantizes)
    for m, v in votes.items():
        table[m] = "mixed" if len(v) > 1 else "fp4" if v.pop() else "bf16"
    return table


def _qwen3_site_weights(site, model_cfg: ModelConfig) -> list[str]:
    """The HF modules a Qwen3-MoE site touches (from its name, layer and expert)."""
    L = site.layer
    if site.name in ("k", "v"):
        return [_kv(L)]
    if site.name in ("qkv", "proj"):
        suffix = "linear_qkv.weight" if site.name == "qkv" else "linear_proj.weight"
        return linear_modules(f"decoder.layers.{L}.self_attention.{suffix}", model_cfg)
    # fc1 / fc2 of one expert, of all experts (grouped), or the fc1 input of every expert
    experts = range(model_cfg.num_experts) if site.expert is None else [site.expert]
    return [m for e in experts for m in linear_modules(
        f"decoder.layers.{L}.mlp.experts.local_experts.{e}.linear_{site.name}.weight", model_cfg)]


def _matches(pattern: str, module: str) -> list[str]:
    """The matching rules under which `pattern` excludes `module`."""
    if pattern.startswith("re:"):
        return ["regex"] if re.match(pattern[3:], module) else []
    rules = []
    if pattern == module:
        rules.append("exact")
    if any(c in pattern for c in "*?[") and fnmatch.fnmatch(module, pattern):
        rules.append("fnmatch")
    if pattern != module and pattern in module:
        rules.append("substring")
    return rules


def checkpoint_table(path: str | os.PathLike, model_cfg: ModelConfig) -> tuple[Table, list[str]]:
    """The table of an exported checkpoint from its tensors and config.json, and the problems
    found within it (a quantized module its exclusion list catches, a BF16 linear it does not)."""
    ckpt = SafetensorsDir(path)
    qcfg = ckpt.json("config.json").get("quantization_config") or {}
    ignore = qcfg.get("exclude_modules") or qcfg.get("ignore") or []
    kv = qcfg.get("kv_cache_quant_algo") or qcfg.get("kv_cache_scheme")
    table = {}
    for name in full_weight_shapes(model_cfg):
        for m in linear_modules(name, model_cfg):
            packed = f"{m}.weight_packed" in ckpt or f"{m}.weight_scale" in ckpt
            table[m] = "fp4" if packed else "bf16" if f"{m}.weight" in ckpt else "missing"
    kv_fp4 = kv == "NVFP4" or (isinstance(kv, dict) and kv.get("num_bits") == 4)
    table |= {_kv(L): "fp4" if kv_fp4 else "bf16" for L in range(model_cfg.num_layers)}
    problems = []
    for m, precision in table.items():
        if m.endswith("kv_cache"):
            continue
        caught = [(p, r) for p in ignore for r in _matches(p, m)]
        if precision == "fp4" and caught:
            p, r = caught[0]
            problems.append(f"{m} is quantized but the exclusion entry {p!r} matches it ({r}): a server "
                            f"using that rule would load it as BF16")
        if precision == "bf16" and not caught:
            problems.append(f"{m} is BF16 but no exclusion entry names it: a server would expect FP4 tensors")
    return table, problems


def compare(tables: dict[str, Table]) -> list[str]:
    """Disagreements between the sides' tables, one line per module, e.g.
    "model.layers.3.mlp.gate: trainer=bf16 engine=fp4"."""
    modules = sorted(set().union(*tables.values()))
    out = []
    for m in modules:
        seen = {side: t.get(m, "absent") for side, t in tables.items()}
        if len(set(seen.values())) > 1:
            out.append(f"{m}: " + " ".join(f"{side}={p}" for side, p in seen.items()))
    return out


def audit(model_cfg: ModelConfig, trainer_model, engine_tables: Table | dict[str, Table],
          exports: list[str | os.PathLike] = ()) -> tuple[dict[str, Table], list[str]]:
    """Every side's table ("trainer", then each engine's: "engine" for a single table, or the
    names of {name: table}, then "export" or "export0", "export1", ...) and every problem:
    disagreements between sides, then each export's internal problems."""
    one = all(isinstance(v, str) for v in engine_tables.values())
    engines = {"engine": engine_tables} if one else engine_tables
    tables = {"trainer": trainer_table(trainer_model, model_cfg)} | engines
    problems = []
    for i, path in enumerate(exports):
        table, found = checkpoint_table(path, model_cfg)
        tables["export" if len(exports) == 1 else f"export{i}"] = table
        problems += [f"{path}: {p}" for p in found]
    return tables, compare(tables) + problems
