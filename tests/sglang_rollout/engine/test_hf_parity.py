"""The engine's model math against transformers' own Qwen3-MoE (a tiny random config built
locally, no download), and the HF <-> Megatron state-dict mapping."""

from __future__ import annotations

import torch
from safetensors import safe_open

from megatron_trace.checkpoint.hf import HFCheckpoint
from megatron_trace.checkpoint.hf_layout import (
    config_from_hf,
    hf_to_megatron,
    megatron_to_hf,
)
from sglang_rollout.engine import EngineConfig, TraceEngine
from tests.support.hf_models import CFG, save_hf_tiny


def test_config_and_state_dict_map_both_ways(tmp_path):
    """transformers' own on-disk checkpoint -> full Megatron state dict -> the same HF tensors."""
    model = save_hf_tiny(tmp_path)
    assert config_from_hf(model.config.to_dict()) == CFG
    ckpt = HFCheckpoint(tmp_path)
    on_disk = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            on_disk |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    back = megatron_to_hf(dict(ckpt.items()), CFG)
    assert set(back) == set(on_disk) and all(torch.equal(back[k], on_disk[k]) for k in on_disk)
    full = hf_to_megatron(on_disk, CFG)
    assert all(torch.equal(full[k], v) for k, v in ckpt.items())


def test_engine_bf16_matches_transformers_qwen3_moe(tmp_path):
    model = save_hf_tiny(tmp_path)
    sd = dict(HFCheckpoint(tmp_path).items())
    engine = TraceEngine(CFG, EngineConfig(precision="bf16", block_size=8, num_blocks=16))
    engine.update_weights(sd, 0)
    g = torch.Generator().manual_seed(1)
    for n in (5, 33):
        tokens = torch.randint(0, CFG.vocab_size, (n,), generator=g)
        with torch.no_grad():
            hf_logits = model(tokens[None]).logits[0].float()
        want = torch.log_softmax(hf_logits[:-1], -1).gather(1, tokens[1:, None])[:, 0]
        got = engine.score(tokens.tolist())
        # both in bf16 with different op orders (e.g. HF's router logits are bf16, ours fp32)
        torch.testing.assert_close(got, want, atol=0.08, rtol=0.02)
