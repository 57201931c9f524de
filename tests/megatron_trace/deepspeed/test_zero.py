"""DeepSpeed ZeRO-1/2/3 (deepspeed 0.19.8, 2 CPU processes over gloo) against one process.

A tiny transformers Qwen3-MoE (fused 3D expert weights) trains 3 AdamW steps of next-token
cross-entropy on a fixed batch of 4 sequences: each rank takes 2. The one-process reference takes
the same two micro-batches and averages their gradients as data parallelism does
((g0 + g1) / 2, exact in either order for two ranks), so ZeRO-1/2 must match it to the bit.
Under ZeRO-3 (every parameter partitioned, gathered by its module's hooks) the gradients differ by
float32 ulps, so its weights are held to a stated tolerance.

Variants: fp32; bf16 (DeepSpeed's bf16 mode, FP32 master weights), where the three stages must
give the same BF16 weights; fp4 (float32 weights with TRACE's FP4 sites swapped in by
`attach_fp4_sites` before `deepspeed.initialize`, round-to-nearest QAT on packed micro-batches).

All runs come from one spawn (tests/support/deepspeed_cpu.py), the reference from this process.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_trace.checkpoint.hf_layout import config_from_hf
from megatron_trace.deepspeed.model import attach_fp4_sites
from megatron_trace.deepspeed.weights import megatron_weights
from tests.support import deepspeed_cpu

VOCAB, SEQ, STEPS, RANKS = 128, 16, 3, 2
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STAGES = (1, 2, 3)
VARIANTS = ("fp32", "bf16", "fp4")
# ZeRO-3 vs one process, |weight difference| after 3 steps (weights ~0.1, Adam steps ~1e-2): the
# first backward's gradients are within 7.5e-8 (fp4: 4.8e-8), bit-identical from the loss back to
# the last layer's MoE block and apart from its attention on; Adam magnifies that where a gradient
# is near eps, and which few elements do so depends on the CPU's float kernels. Measured max
# 9.5e-7 (fp32) and 6.3e-7 (fp4) on one Xeon, 7.0e-6 and 5.8e-6 on another (2026-12-05: 7 and 3
# of 91,008 elements above 1e-6, mean 1.2e-8 and 3.2e-9). So: the mean stays at float32 noise,
# at most 0.1% of the elements drift past 1e-6, none by 1% of one Adam step. A partitioning or
# reduction fault moves many elements by a whole step (1e-2).
ZERO3_MEAN, ZERO3_FEW, ZERO3_MAX = 1e-7, 1e-6, 1e-4


def tiny_model(variant: str) -> Qwen3MoeForCausalLM:
    """2 layers, hidden 64, 4 experts top-2, head_dim 16; the same random weights in every process."""
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False, initializer_range=0.1)
    model = Qwen3MoeForCausalLM(cfg)
    if variant == "bf16":
        model = model.to(torch.bfloat16)
    if variant == "fp4":
        attach_fp4_sites(model, "fp4-rne")
    return model


def model_config():
    """The tiny model's TRACE ModelConfig, read from its HF config as the trainer reads a checkpoint's."""
    return config_from_hf(tiny_model("fp32").config.to_dict())


def micro_batch(variant: str, rank: int) -> dict:
    """The forward keywords of `rank`'s 2 sequences: [2, SEQ] rows, or for fp4 (whose sites take
    packed micro-batches) one packed row [1, 2 * SEQ] whose labels do not cross the boundary."""
    ids = torch.randint(VOCAB, (2 * RANKS, SEQ), generator=torch.Generator().manual_seed(1))[2 * rank:2 * rank + 2]
    if variant != "fp4":
        return dict(input_ids=ids, labels=ids)
    ids = ids.reshape(1, -1)
    labels = ids.clone()
    labels[0, SEQ] = -100  # the second sequence's first token is not predicted from the first's last
    return dict(input_ids=ids, labels=labels, position_ids=torch.arange(SEQ).repeat(2)[None],
                cu_seq_lens_q=torch.tensor([0, SEQ, 2 * SEQ], dtype=torch.int32), use_cache=False)


def ds_config(stage: int, variant: str) -> dict:
    """ZeRO `stage`, 2 sequences a rank, small buckets so that reduction runs in several; under
    ZeRO-3 every parameter partitioned (the default threshold would keep this model whole).
    No clipping: DeepSpeed clips at 1.0 unless told (here it scaled the first step's gradients
    by 0.31), and the reference would have to reproduce its float64 norm to the bit."""
    zero = {"stage": stage, "reduce_bucket_size": 4096, "allgather_bucket_size": 4096}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=4096)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "gradient_clipping": 0.0,
            "bf16": {"enabled": variant == "bf16"}, "steps_per_print": 10**9}


def _train_zero(rank: int, stages, variants) -> dict:
    """Each (stage, variant) on this rank: weights after STEPS steps (gathered), losses, and how
    many parameters ZeRO-3 left whole on this rank (it must partition all)."""
    out = {}
    for stage in stages:
        for variant in variants:
            batch = micro_batch(variant, rank)
            engine = deepspeed_cpu.initialize(tiny_model(variant), ds_config(stage, variant), **ADAMW)
            losses = []
            for _ in range(STEPS):
                loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach().float())
            whole = sum(p.ds_tensor.numel() == p.ds_numel for p in engine.module.parameters()) if stage == 3 else None
            out[stage, variant] = dict(weights=deepspeed_cpu.gathered_weights(engine.module), losses=losses,
                                       whole=whole)
            if stage == 3 and variant == "fp4":  # the weight sync's view: Megatron names, a layer gathered at a time
                out[stage, variant]["megatron"] = dict(megatron_weights(engine.module, model_config()))
            engine.destroy()
    return out


def _train_one_process(variant: str) -> dict:
    """The reference: the ranks' micro-batches one after the other, gradients averaged, torch AdamW."""
    torch.set_num_threads(1)  # the ranks' matmuls, split the same way
    model = tiny_model(variant)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append([])
        for rank in range(RANKS):
            loss = model(**micro_batch(variant, rank)).loss
            loss.backward()
            losses[-1].append(loss.detach().float())
        for p in model.parameters():
            p.grad.mul_(1 / RANKS)
        opt.step()
    return dict(weights={n: p.detach().clone() for n, p in model.named_parameters()}, losses=losses)


@pytest.fixture(scope="module")
def zero():
    """{(stage, variant): per-rank results}: every ZeRO run of this file in one spawn."""
    ranks = deepspeed_cpu.spawn(_train_zero, world=RANKS, stages=STAGES, variants=VARIANTS)
    return {key: [r[key] for r in ranks] for key in ranks[0]}


@pytest.fixture(scope="module")
def one_process():
    return {variant: _train_one_process(variant) for variant in ("fp32", "fp4")}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


def assert_bitwise(a: dict, b: dict) -> None:
    diff = [n for n in a if not torch.equal(a[n], b[n])]
    assert a.keys() == b.keys() and not diff, f"{len(diff)} tensors differ (max {max_diff(a, b):.3g}): {diff[:4]}"


@pytest.mark.parametrize("variant", ["fp32", "fp4"])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_bit_identical_to_one_process(zero, one_process, stage, variant):
    ref = one_process[variant]
    for rank, run in enumerate(zero[stage, variant]):
        assert_bitwise(run["weights"], ref["weights"])
        assert torch.equal(torch.stack(run["losses"]), torch.stack([step[rank] for step in ref["losses"]]))


@pytest.mark.parametrize("variant", ["fp32", "fp4"])
def test_zero3_within_tolerance_of_one_process(zero, one_process, variant):
    ref = one_process[variant]
    runs = zero[3, variant]
    assert all(run["whole"] == 0 for run in runs)  # every parameter really partitioned
    assert_bitwise(runs[0]["weights"], runs[1]["weights"])  # the gathered weights are one model
    d = torch.cat([(runs[0]["weights"][n].float() - ref["weights"][n].float()).abs().reshape(-1)
                   for n in ref["weights"]])
    assert float(d.mean()) <= ZERO3_MEAN, f"mean |difference| {float(d.mean()):.3g}"
    assert int((d > ZERO3_FEW).sum()) <= d.numel() // 1000, f"{int((d > ZERO3_FEW).sum())} elements past {ZERO3_FEW}"
    assert float(d.max()) <= ZERO3_MAX, f"max |difference| {float(d.max()):.3g}"
    first = torch.stack([run["losses"][0] for run in runs])
    assert torch.equal(first, torch.stack(ref["losses"][0]))  # same forward before any update


def test_megatron_weights_gathered_under_zero3(zero):
    """megatron_weights on a ZeRO-3 model (each layer gathered from both ranks' partitions) equals it
    on an unpartitioned model holding the gathered weights, on both ranks."""
    model = tiny_model("fp4")
    model.load_state_dict(zero[3, "fp4"][0]["weights"])
    want = dict(megatron_weights(model, model_config()))
    for run in zero[3, "fp4"]:
        assert run["megatron"].keys() == want.keys()
        assert all(torch.equal(run["megatron"][n], t) for n, t in want.items())


def test_bf16_stages_agree_bitwise(zero):
    """DeepSpeed's bf16 mode: ZeRO-1, -2 and -3 give the same BF16 weights on every rank."""
    runs = [run for stage in STAGES for run in zero[stage, "bf16"]]
    assert all(w.dtype == torch.bfloat16 for w in runs[0]["weights"].values())
    for run in runs[1:]:
        assert_bitwise(run["weights"], runs[0]["weights"])


def test_training_moved_the_weights(zero, one_process):
    """Guards the comparisons above against a run that changed nothing."""
    start = {n: p.detach() for n, p in tiny_model("fp32").named_parameters()}
    assert max_diff(one_process["fp32"]["weights"], start) > 1e-2
    assert max_diff(zero[1, "bf16"][0]["weights"], start) > 1e-2
