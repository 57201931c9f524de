"""Checkpoint tools end to end on a tiny Qwen3-MoE that `transformers` builds and saves (no download):
HF -> Megatron (one process and TP2 x EP2 x PP2) -> HF, logits against transformers, FP4 exports
read back by compressed-tensors' own decompression, the audit, and bad inputs."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_trace.checkpoint.cli import export_main
from megatron_trace.checkpoint.convert import (
    hf_to_megatron,
    layout_world,
    megatron_configs,
    megatron_to_hf,
)
from megatron_trace.checkpoint.fp4_export import load_input_amax
from megatron_trace.checkpoint.hf import HFCheckpoint
from megatron_trace.checkpoint.hf_layout import hf_parts
from megatron_trace.megatron.spawn import spawn
from megatron_trace.model_config import fp4_site_of
from sglang_rollout.engine import EngineConfig, TraceEngine
from tests.support import scenarios as sc
from tests.support.hf_models import CFG, save_hf_tiny

PAR = {"tp": 2, "ep": 2, "pp": 2}


def read_all(path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors directory, read with safetensors itself."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{"hf": HF dir, "model": transformers model, "one": Megatron ckpt from 1 process,
    "par": Megatron ckpt written under TP2 x EP2 x PP2}."""
    root = tmp_path_factory.mktemp("ckpts")
    model = save_hf_tiny(root / "hf")
    hf_to_megatron(root / "hf", root / "one")
    hf_to_megatron(root / "hf", root / "par", **PAR)
    return {"hf": root / "hf", "model": model, "one": root / "one", "par": root / "par", "root": root}


def test_hf_to_megatron_to_hf_is_bit_identical(ckpts, tmp_path):
    original = read_all(ckpts["hf"])
    for src in ("one", "par"):
        out = megatron_to_hf(ckpts[src], tmp_path / src, max_shard_bytes=100_000)
        back = read_all(out)
        assert set(back) == set(original)
        for name, t in original.items():
            assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
        assert json.loads((out / "config.json").read_text()) == json.loads((ckpts["hf"] / "config.json").read_text())
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(index) == set(original) and len(set(index.values())) > 1  # really sharded


def test_megatron_logits_match_transformers(ckpts):
    """Each checkpoint loaded under the other layout (1 process <- TP2xEP2xPP2 and back) into a
    float32 Megatron model gives transformers' float32 logits."""
    seqs = sc.make_sequences(CFG, [8, 12], seed=3)  # even total: sequence parallelism splits tokens
    with torch.no_grad():
        want = torch.cat([ckpts["model"].float()(s[None]).logits[0] for s in seqs])
    batches = [{"seqs": seqs}]
    for layout, src in (({}, "par"), (layout_world(**PAR), "one")):
        results = spawn(sc.run_layout, layout, cfg=CFG, sd=None, batches=batches, modes=["bf16"],
                        checkpoint=str(ckpts[src]), params_dtype=torch.float32)
        got = [r[0]["logits"]["bf16"] for r in results if r and r[0]["logits"]]
        assert got, "no rank returned logits"
        for logits in got:  # float32 compute on both sides, the same BF16-valued weights
            # logits are O(5); measured max |diff| 3.6e-3, mean 3e-4 (op order). A wrong mapping
            # (a head, an expert, gate/up swapped) moves logits by O(1).
            torch.testing.assert_close(logits, want, atol=5e-3, rtol=1e-3)
            assert (logits - want).abs().mean() < 1e-3


def _e2m1(codes_u8: torch.Tensor) -> np.ndarray:
    """Unpack (low nibble first) and decode E2M1 with ml_dtypes, float64."""
    c = codes_u8.numpy()
    nib = np.stack([c & 0xF, c >> 4], -1).reshape(c.shape[0], -1).astype(np.uint8)
    return nib.view(ml_dtypes.float4_e2m1fn).astype(np.float64)


@pytest.fixture(scope="module")
def exports(ckpts):
    """Both formats exported from the parallel-written Megatron checkpoint, calibrated by the
    engine on random tokens (the CLI path)."""
    out = {}
    for fmt in ("modelopt", "compressed-tensors"):
        out[fmt] = ckpts["root"] / fmt
        export_main(["--megatron", str(ckpts["par"]), "--out", str(out[fmt]), "--format", fmt,
                     "--calib-random", "2", "--calib-len", "24", "--max-shard-size", "150KB"])
    return out


def test_exported_weights_are_the_engines_weights(ckpts, exports):
    """The exported bytes equal what the engine holds after loading the same checkpoint, and both
    formats carry the same codes and scales."""
    hf = HFCheckpoint(ckpts["hf"])
    engine = TraceEngine(CFG, EngineConfig(precision="fp4", num_blocks=4))
    engine.update_weights(dict(hf.items()), 0)
    mo, ct = read_all(exports["modelopt"]), read_all(exports["compressed-tensors"])
    checked = 0
    for name in hf:
        if fp4_site_of(name) is None:
            for hf_name, _ in hf_parts(name, CFG):
                assert torch.equal(mo[hf_name], hf.dir.get(hf_name)) and torch.equal(ct[hf_name], mo[hf_name])
            continue
        q = engine.weights.tensors[name]
        for hf_name, rows in hf_parts(name, CFG):
            m = hf_name.removesuffix(".weight")
            codes = q.codes if rows is None else q.codes[rows]
            scales = q.block_scales if rows is None else q.block_scales[rows]
            assert torch.equal(mo[m + ".weight"], codes) and torch.equal(ct[m + ".weight_packed"], codes), m
            assert torch.equal(mo[m + ".weight_scale"].view(torch.uint8), scales.view(torch.uint8)), m
            assert torch.equal(ct[m + ".weight_scale"].view(torch.uint8), scales.view(torch.uint8)), m
            assert mo[m + ".weight_scale_2"].shape == () and mo[m + ".weight_scale_2"] == q.global_scale
            assert ct[m + ".weight_global_scale"].shape == (1,)
            assert ct[m + ".weight_global_scale"] == 1 / mo[m + ".weight_scale_2"]
            assert mo[m + ".input_scale"].dtype == torch.float32 and mo[m + ".input_scale"] > 0
            assert ct[m + ".input_global_scale"] == 1 / mo[m + ".input_scale"]
            checked += 1
    assert checked == CFG.num_layers * (3 + 1 + 3 * CFG.num_experts)


def test_compressed_tensors_decompression_reproduces_our_weights(exports):
    """compressed-tensors' own NVFP4 decompression of the export equals our dequantization bit for
    bit (in the BF16 it decompresses to), and both equal a float64 decode via ml_dtypes."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    from trace_kernels.fp4 import Format, QTensor, dequantize

    cfg = json.loads((exports["compressed-tensors"] / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(cfg).config_groups["group_0"]
    ct = read_all(exports["compressed-tensors"])
    modules = [k.removesuffix(".weight_packed") for k in ct if k.endswith(".weight_packed")]
    assert len(modules) == CFG.num_layers * (4 + 3 * CFG.num_experts)
    for m in modules:
        state = {k: ct[f"{m}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale")}
        theirs = NVFP4PackedCompressor.decompress(state, scheme)["weight"]
        g = 1 / state["weight_global_scale"].reshape(())
        ours = dequantize(QTensor(state["weight_packed"], state["weight_scale"], g, Format.NVFP4,
                                  torch.Size(theirs.shape)), torch.bfloat16)
        assert torch.equal(theirs, ours), m
        scales = state["weight_scale"].float().double().repeat_interleave(16, 1).numpy()
        ref = torch.from_numpy(_e2m1(state["weight_packed"]) * scales * float(g)).to(torch.bfloat16)
        assert torch.equal(ref, ours), m


def test_deepseek_v3_export_decompresses_to_the_engines_weights(tmp_path):
    """A DeepSeek-V3-shaped BF16 checkpoint exported to compressed-tensors NVFP4: every FP4 linear
    (MLA's q_a / kv_a_proj_with_mqa / q_b / kv_b, the dense layer, shared and routed experts) holds
    the built-in engine's codes, block scales and global scale, and compressed-tensors' own
    decompression equals the engine's weights dequantized, but where the exact value (float64)
    sits on a BF16 rounding midpoint to FP32 precision: the two round their FP32 products
    differently there, one BF16 ulp apart (measured: 175 of 208,896 elements). q_a and kv_a share
    one global scale; kv_b's input scale is the calibrated latent's; the export reads back as
    the engine's own packed weights."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    from megatron_trace.checkpoint.fp4_export import load_fp4_export
    from megatron_trace.model_config import full_weight_shapes
    from tests.support.hf_families import hf_model
    from trace_kernels.fp4 import dequantize

    _, model = hf_model("deepseek-v3")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    out = tmp_path / "ct"
    export_main(["--hf", str(tmp_path / "hf"), "--out", str(out), "--format", "compressed-tensors",
                 "--calib-random", "2", "--calib-len", "16"])
    hf = HFCheckpoint(tmp_path / "hf")
    cfg = hf.model_cfg
    engine = TraceEngine(cfg, EngineConfig(precision="fp4", num_blocks=1))
    engine.update_weights(dict(hf.items()), 0)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(qcfg).config_groups["group_0"]
    ct = read_all(out)
    checked, elements, midpoints = 0, 0, 0
    for name in full_weight_shapes(cfg):
        if fp4_site_of(name) is None:
            continue
        held = engine.weights.tensors[name]
        ours_all = dequantize(held, torch.bfloat16)
        for hf_name, rows in hf_parts(name, cfg):
            m = hf_name.removesuffix(".weight")
            state = {k: ct[f"{m}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale")}
            index = slice(None) if rows is None else rows
            assert torch.equal(state["weight_packed"], held.codes[index]), m
            assert torch.equal(state["weight_scale"].view(torch.uint8), held.block_scales[index].view(torch.uint8)), m
            # compressed-tensors stores 1 / g: in FP32 the reciprocal round trip can move g by an ulp
            g_ct = 1 / state["weight_global_scale"].reshape(())
            assert abs(float(g_ct) - float(held.global_scale)) <= 2**-23 * float(held.global_scale), m
            theirs, ours = NVFP4PackedCompressor.decompress(state, scheme)["weight"], ours_all[index]
            scales = state["weight_scale"].float().double().repeat_interleave(16, 1).numpy()
            exact = torch.from_numpy(_e2m1(state["weight_packed"]) * scales * float(held.global_scale))
            differ = theirs != ours
            mid = (theirs.double() + ours.double()) / 2
            assert ((exact - mid).abs() <= 2**-22 * exact.abs())[differ].all(), m
            checked, elements, midpoints = checked + 1, elements + ours.numel(), midpoints + int(differ.sum())
    assert checked == len([k for k in ct if k.endswith(".weight_packed")]) and checked > 8 * 3 * 2
    assert midpoints < 1e-3 * elements, (midpoints, elements)
    a = "model.layers.1.self_attn."
    assert torch.equal(ct[a + "q_a_proj.weight_global_scale"], ct[a + "kv_a_proj_with_mqa.weight_global_scale"])
    amax = load_input_amax(out / "trace_input_amax.json")
    assert float(1 / ct[a + "kv_b_proj.input_global_scale"]) == pytest.approx(amax[(1, "kv")] / (6 * 448))
    assert "model.layers.0.mlp.gate" not in qcfg["ignore"] and a + "kv_a_layernorm" in qcfg["ignore"]
    back_cfg, back = load_fp4_export(out)
    assert back_cfg == cfg
    for name, t in back.items():
        held = engine.weights.tensors[name]
        if fp4_site_of(name) is not None:
            assert torch.equal(t.codes, held.codes) and torch.equal(t.block_scales.view(torch.uint8),
                                                                    held.block_scales.view(torch.uint8)), name
            assert float(t.global_scale) == pytest.approx(float(held.global_scale), rel=2**-22), name


def test_export_configs(exports):
    mo_cfg = json.loads((exports["modelopt"] / "config.json").read_text())["quantization_config"]
    hq = json.loads((exports["modelopt"] / "hf_quant_config.json").read_text())["quantization"]
    assert mo_cfg["quant_method"] == "modelopt" and hq["quant_algo"] == "NVFP4" and hq["group_size"] == 16
    assert hq["kv_cache_quant_algo"] == "NVFP4"
    excluded = set(hq["exclude_modules"])
    assert {"lm_head", "model.embed_tokens", "model.norm", "model.layers.1.mlp.gate"} <= excluded
    assert not any("proj" in m for m in excluded)
    ct_cfg = json.loads((exports["compressed-tensors"] / "config.json").read_text())["quantization_config"]
    assert ct_cfg["format"] == "nvfp4-pack-quantized" and set(ct_cfg["ignore"]) == excluded
    # the calibration travels with the export, and input scales follow it
    amax = load_input_amax(exports["modelopt"] / "trace_input_amax.json")
    scale = read_all(exports["modelopt"])["model.layers.1.mlp.experts.3.down_proj.input_scale"]
    assert scale == torch.tensor(amax[(1, "fc2")], dtype=torch.float32) / (6 * 448)


def _run_audit(rank, *, exports, trainer_precision="fp4-rne", engine_precision="fp4", bf16_site=None, cfg=CFG):
    from megatron_trace.checkpoint.audit import audit
    from megatron_trace.megatron.model import build_model, fp4_sites
    from megatron_trace.modes import TrainerPrecision

    model = build_model(cfg, trainer_precision)
    for site in fp4_sites(model):
        if bf16_site and (site.layer, site.name, site.expert) == bf16_site:
            site.precision = TrainerPrecision.BF16
    engine = TraceEngine(cfg, EngineConfig(precision=engine_precision, num_blocks=1))
    return audit(cfg, model, engine.quantization_table(), exports)


def test_audit(exports, tmp_path):
    exported = [str(exports["modelopt"]), str(exports["compressed-tensors"])]
    (tables, problems), = spawn(_run_audit, {}, exports=exported)
    assert problems == []
    n_sites = CFG.num_layers * (4 + 3 * CFG.num_experts + 1 + 1) + 1  # linears, router, kv; lm_head
    assert all(len(t) == n_sites for t in tables.values())
    assert tables["trainer"]["model.layers.1.mlp.gate"] == "bf16"
    assert tables["export0"]["model.layers.1.mlp.experts.2.up_proj"] == "fp4"
    # a wildcard that catches the experts' gate_proj, as in verl#7519
    bad = tmp_path / "bad"
    shutil.copytree(exports["compressed-tensors"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("re:.*gate.*")
    (bad / "config.json").write_text(json.dumps(cfg))
    (_, problems), = spawn(_run_audit, {}, exports=[str(bad)], engine_precision="bf16", bf16_site=(0, "fc2", 1))
    text = "\n".join(problems)
    assert "model.layers.0.mlp.experts.0.gate_proj is quantized but the exclusion entry 're:.*gate.*'" in text
    assert "model.layers.1.self_attn.q_proj: trainer=fp4 engine=bf16" in text
    assert "model.layers.0.mlp.experts.1.down_proj: trainer=bf16 engine=bf16 export=fp4" in text
    assert "model.layers.0.self_attn.kv_cache: trainer=fp4 engine=bf16 export=fp4" in text


def _run_audits(rank, *, cases):
    return [_run_audit(rank, exports=[], **case) for case in cases]


def test_audit_of_the_deepseek_v3_family():
    """Trainer and engine agree on every site of DeepSeek-V3 (MLA's projections, the latent
    cache, the dense layer, shared experts) and GLM-4.5; a site left in BF16 is named."""
    from megatron_trace.model_config import from_hf
    from tests.support.hf_families import tiny_deepseek, tiny_glm

    ds, glm = from_hf(tiny_deepseek().to_dict()), from_hf(tiny_glm().to_dict())
    sites = ((1, "q_up", None), "model.layers.1.self_attn.q_b_proj: trainer=bf16 engine=fp4"), \
            ((2, "kv", None), "model.layers.2.self_attn.kv_cache: trainer=bf16 engine=fp4")
    cases = [dict(cfg=ds), dict(cfg=glm)] + [dict(cfg=ds, bf16_site=site) for site, _ in sites]
    (ds_run, glm_run, *bf16_runs), = spawn(_run_audits, {}, cases=cases)
    tables, problems = ds_run
    assert problems == [] and glm_run[1] == []
    t = tables["trainer"]
    for m in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.q_b_proj", "self_attn.kv_b_proj",
              "self_attn.o_proj", "self_attn.kv_cache", "mlp.shared_experts.down_proj", "mlp.experts.7.up_proj"):
        assert t[f"model.layers.1.{m}"] == "fp4", m
    assert t["model.layers.0.mlp.gate_proj"] == "fp4" and t["model.layers.1.mlp.gate"] == "bf16"
    for (_, named), (_, problems) in zip(sites, bf16_runs, strict=True):
        assert named in problems, problems


# -- bad input -------------------------------------------------------------------------------
def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_hf_checkpoints_name_the_problem(ckpts, tmp_path):
    # a config that disagrees with the tensors
    d = _copy(ckpts["hf"], tmp_path / "cfg")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"gate_proj.weight has shape \(32, 64\) but config.json "
                                         r"\(moe_intermediate_size, hidden_size\) implies \(48, 64\)"):
        HFCheckpoint(d)
    # a tensor missing from its shard
    d = _copy(ckpts["hf"], tmp_path / "missing")
    shard = next(f for f in sorted(d.glob("*.safetensors")) if "o_proj" in str(read_all_one(f)))
    tensors = read_all_one(shard)
    victim = next(k for k in tensors if "o_proj" in k)
    save_file({k: v for k, v in tensors.items() if k != victim}, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lists 1 tensors that are not in the file it names"):
        HFCheckpoint(d)
    # a truncated shard
    d = _copy(ckpts["hf"], tmp_path / "trunc")
    shard = sorted(d.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{shard.name} is not a readable safetensors file"):
        HFCheckpoint(d)
    # an architecture TRACE does not implement
    d = _copy(ckpts["hf"], tmp_path / "arch")
    cfg = json.loads((d / "config.json").read_text()) | {"norm_topk_prob": False}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="norm_topk_prob=False"):
        HFCheckpoint(d)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFCheckpoint(tmp_path / "nowhere")


def read_all_one(file):
    with safe_open(file, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_bad_megatron_checkpoints_and_outputs(ckpts, tmp_path):
    d = _copy(ckpts["one"], tmp_path / "meg")
    hf = json.loads((d / "hf_config.json").read_text()) | {"num_hidden_layers": 3}
    (d / "hf_config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="hf_config.json has num_layers=3 but the checkpoint's model was saved "
                                         "with num_layers=2"):
        megatron_configs(d)
    with pytest.raises(FileExistsError):
        megatron_to_hf(ckpts["one"], ckpts["hf"])
    with pytest.raises(FileExistsError):
        hf_to_megatron(ckpts["hf"], ckpts["one"])
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by 4"):
        hf_to_megatron(ckpts["hf"], tmp_path / "x", tp=4)
    with pytest.raises(SystemExit, match="no calibrated input amax for layer 1 site 'fc1'"):
        (tmp_path / "amax.json").write_text(json.dumps({"0.qkv": 1, "0.proj": 1, "0.fc1": 1, "0.fc2": 1,
                                                         "1.qkv": 1, "1.proj": 1}))
        export_main(["--hf", str(ckpts["hf"]), "--out", str(tmp_path / "e"), "--format", "modelopt",
                     "--input-amax", str(tmp_path / "amax.json")])
    assert not (tmp_path / "e").exists() and not list(tmp_path.glob(".e.partial-*"))
