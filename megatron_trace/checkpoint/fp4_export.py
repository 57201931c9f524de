"""Final FP4 checkpoints in the two HF layouts that SGLang and vLLM serve.

Every FP4-site weight is quantized by the shared quantizer exactly as the engine quantizes it on
load (`quantize(w, "nvfp4")` of the whole Megatron tensor: one global scale for the fused QKV
weight and one for an expert's [gate; up]); its codes and block scales are then split by rows
into the HF linears, which therefore share the global scale, as ModelOpt's exports do and as the
serving engines' fused QKV / gate-up kernels need. Per HF linear:

| ModelOpt NVFP4 | compressed-tensors nvfp4-pack-quantized | content |
|---|---|---|
| weight uint8 [out, in/2] | weight_packed | E2M1 codes, even element in the low nibble |
| weight_scale e4m3 [out, in/16] | weight_scale | block scales |
| weight_scale_2 f32 [] | weight_global_scale f32 [1] = 1 / weight_scale_2 | global scale g = amax / (6 * 448) |
| input_scale f32 [] | input_global_scale f32 [1] = 1 / input_scale | static activation global scale |

Both formats carry one static activation global scale per linear; TRACE's engine uses one per
token instead, which neither format can express. The export writes the calibrated
`amax / (6 * 448)` of each site's inputs (`input_amax`, e.g. from the engine's
`activation_amax`). Router, embeddings, output head and norms stay BF16 and are listed by exact
module name in the exclusion list (no wildcards, so no pattern can catch a quantized linear).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm import tqdm

from trace_kernels.fp4 import quantize

from ..guidance.record import SITES
from ..model_config import ModelConfig, fp4_site_of, fp4_weight_peers, full_weight_shapes
from .hf_layout import hf_dtype, hf_parts, to_hf
from .safetensors_io import ShardedWriter

FORMATS = ("modelopt", "compressed-tensors")
KV_CACHE = ("fp4", "none")  # fp4: the engine's NVFP4 cache (dynamic per-(token, head) global scales)
E2M1_MAX, E4M3_MAX = 6.0, 448.0
# the FP4 weight sites whose input is another site's rows: MLA's kv_b reads the cached latent (`kv`)
_INPUT_SITE = {"kv_up": "kv"}


def linear_sites(model_cfg: ModelConfig, layer: int) -> list[str]:
    """The sites of `layer` whose inputs feed FP4 linears (each needs a calibrated input scale):
    qkv, proj, fc1, fc2, and in the DeepSeek-V3 family q_up (a query latent), kv (the KV latent
    that kv_b reads) and shared_fc2 (shared experts)."""
    c = model_cfg
    sites = ["qkv", "proj", "fc1", "fc2"]
    if c.mla:
        sites += ["q_up", "kv"] if c.q_lora_rank else ["kv"]
    if c.n_shared_experts and c.is_moe_layer(layer):
        sites.append("shared_fc2")
    return sites


def excluded_modules(model_cfg: ModelConfig) -> list[str]:
    """Exact names of the HF modules that stay in high precision."""
    c = model_cfg
    names = ["model.embed_tokens", "model.norm"] + ([] if c.tie_word_embeddings else ["lm_head"])
    for L in range(c.num_layers):
        h = f"model.layers.{L}."
        names += [h + "input_layernorm", h + "post_attention_layernorm"]
        if c.mla:
            names += [h + "self_attn.kv_a_layernorm"] + ([h + "self_attn.q_a_layernorm"] if c.q_lora_rank else [])
        elif c.use_qk_norm:
            names += [h + "self_attn.q_norm", h + "self_attn.k_norm"]
        if c.is_moe_layer(L):
            names.append(h + "mlp.gate")
    return names


def _weight_args() -> dict:
    return {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}


def quantization_config(fmt: str, model_cfg: ModelConfig, kv_cache: str = "fp4") -> dict:
    """The `quantization_config` entry of config.json for `fmt`."""
    ignore = excluded_modules(model_cfg)
    if fmt == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "kv_cache_quant_algo": "NVFP4" if kv_cache == "fp4" else None,
                "exclude_modules": ignore, "ignore": ignore,
                "config_groups": {"group_0": {"targets": ["Linear"],
                                              "weights": {"num_bits": 4, "type": "float", "group_size": 16,
                                                          "dynamic": False},
                                              "input_activations": {"num_bits": 4, "type": "float",
                                                                    "group_size": 16, "dynamic": False}}},
                "producer": {"name": "trace"}}
    if fmt == "compressed-tensors":
        group = {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                 "weights": _weight_args() | {"dynamic": False, "observer": "static_minmax"},
                 "input_activations": _weight_args() | {"dynamic": "local", "observer": "static_minmax"}}
        kv = _weight_args() | {"strategy": "tensor", "group_size": None, "dynamic": True} if kv_cache == "fp4" else None
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                "quantization_status": "compressed", "config_groups": {"group_0": group}, "ignore": ignore,
                "kv_cache_scheme": kv}
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def fp4_linear_tensors(fmt: str, codes: torch.Tensor, block_scales: torch.Tensor, g: torch.Tensor,
                       input_scale: float) -> dict[str, torch.Tensor]:
    """One HF linear's tensors (suffixes after the module name) in `fmt`.

    codes uint8 [out, in/2], block_scales float8_e4m3fn [out, in/16], g float32 [] (global scale)."""
    s_in = torch.tensor(input_scale, dtype=torch.float32)
    if fmt == "modelopt":
        return {"weight": codes, "weight_scale": block_scales, "weight_scale_2": g.reshape(()).float(),
                "input_scale": s_in}
    return {"weight_packed": codes, "weight_scale": block_scales, "weight_global_scale": (1 / g.float()).reshape(1),
            "input_global_scale": (1 / s_in).reshape(1)}


def input_scales(input_amax: dict[tuple[int, str], float], model_cfg: ModelConfig) -> dict[tuple[int, str], float]:
    """Static input scales amax / (6 * 448) per (layer, linear site: `linear_sites`). Raises
    ValueError naming the first missing (layer, site)."""
    out = {}
    for L in range(model_cfg.num_layers):
        for site in linear_sites(model_cfg, L):
            if (L, site) not in input_amax:
                raise ValueError(f"no calibrated input amax for layer {L} site {site!r}")
            amax = float(input_amax[(L, site)])
            out[(L, site)] = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0
    return out


def input_amax_json(amax: dict[tuple[int, str], float]) -> str:
    """{(layer, site): amax} as JSON {"<layer>.<site>": amax} (what `load_input_amax` reads)."""
    return json.dumps({f"{L}.{s}": v for (L, s), v in sorted(amax.items())}, indent=1) + "\n"


def load_input_amax(path: str | os.PathLike) -> dict[tuple[int, str], float]:
    """Read `input_amax_json`'s JSON. ValueError naming a malformed key or a negative/non-finite value."""
    out = {}
    for key, value in json.loads(Path(path).read_text()).items():
        layer, _, site = key.partition(".")
        if not layer.isdigit() or site not in SITES:
            raise ValueError(f"{path}: key {key!r} is not '<layer>.<site>'")
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{path}: {key} = {value!r} is not a finite amax >= 0")
        out[(int(layer), site)] = float(value)
    return out


def export_fp4(tensors: Iterable[tuple[str, torch.Tensor]], model_cfg: ModelConfig, hf_cfg: dict,
               out: str | os.PathLike, fmt: str, input_amax: dict[tuple[int, str], float], kv_cache: str = "fp4",
               max_shard_bytes: int = 2 << 30, overwrite: bool = False, extra_files: dict | None = None) -> Path:
    """Write the FP4 checkpoint of a model streamed as full Megatron (name, tensor) pairs.

    tensors: every weight of `full_weight_shapes(cfg)` once, any order, in the dtype the model
        holds (FP4 sites are quantized from it, as the engine does on load: MLA's two down
        projections, held until both arrived, with the global scale of both; the other weights
        are written in the HF config's dtype).
    hf_cfg: the model's HF config.json dict; written back with `quantization_config` added.
    input_amax: {(layer, site): amax} for the linear sites (see `input_scales`).
    extra_files: more files for the output directory (name -> JSON-able dict or text).

    Memory: one Megatron tensor plus one output shard. The output appears complete or not at all.
    Raises ValueError for an unknown format or KV setting, a missing, duplicate, unexpected or
    misshapen tensor, or missing calibration.
    """
    if kv_cache not in KV_CACHE:
        raise ValueError(f"kv_cache must be one of {KV_CACHE}, got {kv_cache!r}")
    qcfg = quantization_config(fmt, model_cfg, kv_cache)
    scales = input_scales(input_amax, model_cfg)
    shapes, dtype = full_weight_shapes(model_cfg), hf_dtype(hf_cfg)
    seen: set[str] = set()
    waiting: dict[str, torch.Tensor] = {}  # FP4 weights whose global-scale peers have not arrived yet
    with ShardedWriter(out, max_shard_bytes, overwrite) as writer:
        for name, t in tqdm(tensors, total=len(shapes), desc=f"export {fmt}", unit="tensor"):
            if name not in shapes or name in seen or tuple(t.shape) != shapes[name]:
                why = "unexpected" if name not in shapes else "duplicate" if name in seen else \
                    f"shape {tuple(t.shape)} where the config needs {shapes[name]}:"
                raise ValueError(f"{why} tensor {name}")
            seen.add(name)
            site = fp4_site_of(name)
            if site is None:
                if name == "output_layer.weight" and model_cfg.tie_word_embeddings:
                    continue
                for hf_name, part in to_hf(name, t.to(dtype), model_cfg):
                    writer.add(hf_name, part)
                continue
            peers = fp4_weight_peers(name, model_cfg) or (name,)
            waiting[name] = t
            if not all(p in waiting for p in peers):
                continue
            group = [(p, waiting.pop(p)) for p in peers]
            amax = torch.stack([w.abs().amax().float() for _, w in group]).amax()
            for p, w in group:
                layer, kind = fp4_site_of(p)
                q = quantize(w, "nvfp4", global_amax=amax)
                for hf_name, rows in hf_parts(p, model_cfg):
                    module = hf_name.removesuffix(".weight")
                    codes, block_scales = ((q.codes, q.block_scales) if rows is None
                                           else (q.codes[rows], q.block_scales[rows]))
                    for suffix, tensor in fp4_linear_tensors(fmt, codes, block_scales, q.global_scale,
                                                             scales[(layer, _INPUT_SITE.get(kind, kind))]).items():
                        writer.add(f"{module}.{suffix}", tensor)
        if missing := sorted(set(shapes) - seen):
            raise ValueError(f"the model stream lacks {len(missing)} tensors, e.g. {missing[0]}")
        extra: dict = {"config.json": hf_cfg | {"quantization_config": qcfg}, **(extra_files or {})}
        if fmt == "modelopt":
            extra["hf_quant_config.json"] = {"producer": {"name": "trace"}, "quantization": {
                k: qcfg[k] for k in ("quant_algo", "group_size", "kv_cache_quant_algo", "exclude_modules")}}
        return writer.close(extra)


# -- reading an export back (the inverse of the writer above) -----------------------------------
def _fp4_parts(ckpt, module: str, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, block scales, global scale g) of one exported HF linear."""
    if fmt == "modelopt":
        return ckpt.get(f"{module}.weight"), ckpt.get(f"{module}.weight_scale"), \
            ckpt.get(f"{module}.weight_scale_2").float().reshape(())
    g = 1 / ckpt.get(f"{module}.weight_global_scale").float().reshape(())
    return ckpt.get(f"{module}.weight_packed"), ckpt.get(f"{module}.weight_scale"), g


def load_fp4_export(directory: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """(ModelConfig, full state dict) of an FP4 export (`trace-export-fp4` / `trace-ptq-fp4`, ModelOpt
    NVFP4 or compressed-tensors): FP4-site weights as tensor-scaled NVFP4 QTensors holding the
    exported bytes (the HF linears of one Megatron weight, e.g. q/k/v or an expert's gate/up,
    share its global scale), the other weights as stored (BF16). ValueError for an export whose
    linears of one weight disagree on the global scale, or an unknown format."""
    from trace_kernels.fp4 import Format, QTensor

    from .hf_layout import config_from_hf, to_megatron
    from .safetensors_io import SafetensorsDir

    ckpt = SafetensorsDir(directory)
    hf_cfg = ckpt.json("config.json")
    fmt = (hf_cfg.get("quantization_config") or {}).get("quant_method")
    if fmt not in ("modelopt", "compressed-tensors"):
        raise ValueError(f"{directory}: config.json's quantization_config.quant_method is {fmt!r}, not an FP4 export "
                         "(modelopt or compressed-tensors)")
    model_cfg = config_from_hf(hf_cfg)
    state: dict = {}
    for name, shape in full_weight_shapes(model_cfg).items():
        spec = hf_parts(name, model_cfg)
        if fp4_site_of(name) is None:
            state[name] = to_megatron(name, [ckpt.get(h) for h, _ in spec], model_cfg)
            continue
        codes = torch.empty(shape[0], shape[1] // 2, dtype=torch.uint8)
        scales = torch.empty(shape[0], shape[1] // 16, dtype=torch.float8_e4m3fn)
        gs = []
        for hf_name, rows in spec:
            c, s, g = _fp4_parts(ckpt, hf_name.removesuffix(".weight"), fmt)
            index = slice(None) if rows is None else rows
            codes[index], scales[index] = c, s
            gs.append(g)
        if any(not torch.equal(g, gs[0]) for g in gs[1:]):
            raise ValueError(f"{directory}: the HF linears of {name} have different global scales "
                             f"({[float(g) for g in gs]}); TRACE exports share one per Megatron weight")
        state[name] = QTensor(codes, scales, gs[0].to(torch.float32), Format.NVFP4, torch.Size(shape))
    return model_cfg, state
