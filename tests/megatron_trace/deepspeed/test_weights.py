"""The DeepSpeed trainer's weights under Megatron's names (megatron_trace.deepspeed.weights),
against the Megatron state dict that transformers loaded them from."""

from __future__ import annotations

import pytest
import torch

from megatron_trace.deepspeed.model import attach_fp4_sites
from megatron_trace.deepspeed.trainer import DeepSpeedTrainer
from megatron_trace.deepspeed.weights import checkpoint_tensor, megatron_weights
from megatron_trace.model_config import PRESETS
from tests.support import scenarios as sc
from tests.support.hf_models import hf_from_megatron

CFG = PRESETS["tiny"]


def test_megatron_weights_are_the_state_dict_transformers_loaded(tmp_path):
    """Megatron -> HF checkpoint on disk -> transformers' loader (fused experts) -> back to
    Megatron's names: every tensor exactly (float32 holds the BF16 matrices and FP32 norms)."""
    sd = sc.random_full_state_dict(CFG, seed=5)
    model = attach_fp4_sites(hf_from_megatron(sd, tmp_path, dtype=torch.float32), "fp4-rne")
    got = list(megatron_weights(model, CFG))
    assert [n for n, _ in got] == list(sd)
    bad = [n for n, t in got if t.dtype != torch.float32 or not torch.equal(t, sd[n].float())]
    assert bad == []


def test_checkpoint_tensor_splits_the_fused_experts(tmp_path):
    sd = sc.random_full_state_dict(CFG, seed=6)
    params = dict(hf_from_megatron(sd, tmp_path).named_parameters())
    f = CFG.moe_intermediate_size
    fc1 = sd["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]  # [gate; up] [2f, H]
    gate = checkpoint_tensor("model.layers.1.mlp.experts.2.gate_proj.weight", params)
    up = checkpoint_tensor("model.layers.1.mlp.experts.2.up_proj.weight", params)
    assert torch.equal(gate, fc1[:f]) and torch.equal(up, fc1[f:])
    assert torch.equal(checkpoint_tensor("model.layers.1.mlp.experts.2.down_proj.weight", params),
                       sd["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"])


@pytest.mark.parametrize("precision", ["fp4", "bf16"])
def test_sync_gives_the_engine_the_weights_it_would_load_from_megatron(tmp_path, precision):
    """The built-in engine after a sync from the HF model (packed FP4 to an FP4 engine, in buckets
    smaller than a weight) scores exactly as after loading the Megatron state dict directly."""
    from sglang_rollout.engine import EngineConfig, TraceEngine

    sd = sc.random_full_state_dict(CFG, seed=7)
    sd = {k: v.bfloat16().float() if v.dtype == torch.float32 else v for k, v in sd.items()}  # BF16-valued norms
    model = attach_fp4_sites(hf_from_megatron(sd, tmp_path))
    direct, synced = (TraceEngine(CFG, EngineConfig(precision=precision, block_size=8, num_blocks=16))
                      for _ in range(2))
    direct.update_weights(sd, 1)
    from megatron_trace.rl.weight_sync import sync_weights

    sent = sync_weights(DeepSpeedTrainer(None, CFG, module=model), synced, 1, bucket_mb=0.01)
    assert synced.weight_version == 1 and sent > 0
    tokens = sc.make_sequences(CFG, [21], seed=3)[0].tolist()
    assert torch.equal(synced.score(tokens), direct.score(tokens))
