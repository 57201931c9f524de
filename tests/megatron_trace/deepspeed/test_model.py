"""FP4 sites in transformers' Qwen3-MoE (megatron_trace.deepspeed.model), the DeepSpeed trainer's
model: its packed forward against transformers' own per-sequence forward, its FP4 forward against
the Megatron trainer's on the same weights, and in trace mode the engine's codes at every site."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_trace.deepspeed.model import attach_fp4_sites, fp4_sites, set_precision
from megatron_trace.guidance.codec import GuidanceFormatError
from megatron_trace.megatron import context, qat
from megatron_trace.megatron.context import MicroBatchGuidance
from megatron_trace.megatron.spawn import spawn
from megatron_trace.model_config import PRESETS
from tests.support import scenarios as sc
from tests.support.hf_models import hf_from_megatron, hf_tiny, packed

CFG = PRESETS["tiny"]
SITES = [(layer, site) for layer in range(CFG.num_layers) for site in sc.SITE_ORDER]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """Megatron weights, the stand-in engine's rollouts with guidance on every layer, the Megatron
    trainer's logits in fp4-rne and fp4-guided, and the HF model on the same weights."""
    sd = sc.random_full_state_dict(CFG)
    # FP32 norms holding BF16 values, as after loading an HF checkpoint (the HF model holds them in BF16)
    sd = {k: v.bfloat16().float() if v.dtype == torch.float32 else v for k, v in sd.items()}
    seqs = sc.make_sequences(CFG, [9, 7, 12], seed=4)
    gb, sids, codes, engine_logits = sc.engine_rollout(CFG, sd, seqs, [4, 3, 5], layers=range(CFG.num_layers))
    batch = dict(seqs=seqs, guidance=gb, sample_ids=sids, codes=codes)
    megatron = spawn(sc.run_layout, {}, cfg=CFG, sd=sd, batches=[batch], modes=["bf16", "fp4-rne", "fp4-guided"])[0]
    model = attach_fp4_sites(hf_from_megatron(sd, tmp_path_factory.mktemp("hf")))
    return dict(sd=sd, batch=batch, engine_logits=engine_logits, megatron=megatron[0], model=model)


def _forward(model, batch, mode, checker=None):
    """The HF model's float32 logits [T, V] on the packed batch in `mode`; in fp4-guided with the
    batch's guidance and routed experts active (rows numbered as the checker expects)."""
    set_precision(model, mode)
    ids, pos, cu = packed(batch["seqs"])
    mb = None
    if mode == "fp4-guided":
        mb = MicroBatchGuidance.from_batch(batch["guidance"], batch["sample_ids"])
    if checker is not None:
        qat.observers.append(checker)
    context.activate(mb)
    try:
        with torch.no_grad():
            return model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, use_cache=False).logits[0].float()
    finally:
        context.activate(None)
        qat.observers.clear()


def test_packed_forward_matches_transformers_per_sequence():
    """BF16 mode on a pack of three sequences = transformers' unpatched model on each alone."""
    _, plain = hf_tiny(seed=2)
    ours = attach_fp4_sites(copy.deepcopy(plain))
    seqs = sc.make_sequences(CFG, [5, 11, 8], seed=9)
    ids, pos, cu = packed(seqs)
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, use_cache=False).logits[0]
        want = torch.cat([plain(input_ids=s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)  # float32, different attention batching
    assert {p.data_ptr() for p in ours.parameters()} != {p.data_ptr() for p in plain.parameters()}


def test_attach_keeps_the_parameter_objects_and_names_every_site():
    _, model = hf_tiny()
    before = {n: p for n, p in model.named_parameters()}
    attach_fp4_sites(model, "fp4-rne")
    assert all(p is before[n] for n, p in model.named_parameters()) and len(before) == len(list(model.parameters()))
    assert sorted((s.layer, s.name) for s in fp4_sites(model)) == sorted(SITES)
    assert {s.precision.value for s in fp4_sites(model)} == {"fp4-rne"}


def test_logits_are_the_megatron_trainers_bit_for_bit(case):
    """Same weights (an HF checkpoint written from the Megatron state dict, read by transformers'
    loader), same packed sequences: every logit equal in every mode. The patched model computes
    the Megatron trainer's arithmetic: TRACE's router (FP32 logits, softmax over the top k), RMSNorm
    (FP32 weight), packed attention and the experts' order; transformers' own modules differ
    (before those were replaced: logits up to 0.047 apart in bf16, 0.9 in fp4-rne)."""
    for mode in ("bf16", "fp4-rne", "fp4-guided"):
        got = _forward(case["model"], case["batch"], mode)
        assert torch.equal(got, case["megatron"]["logits"][mode]), (mode, float(
            (got - case["megatron"]["logits"][mode]).abs().max()))
    assert not torch.equal(_forward(case["model"], case["batch"], "fp4-rne"),
                           _forward(case["model"], case["batch"], "bf16"))  # the sites are active


def test_trace_mode_reproduces_the_engines_codes_at_every_site(case):
    checker = sc.CodeChecker([case["batch"]["codes"]])
    logits = _forward(case["model"], case["batch"], "fp4-guided", checker)
    assert sorted(checker.checked) == sorted(SITES) and all(n > 0 for n in checker.checked.values())
    assert checker.mismatch == dict.fromkeys(SITES, 0), checker.mismatch
    engine = case["engine_logits"]
    fp4_gap = (_forward(case["model"], case["batch"], "fp4-rne") - engine).abs().max()
    assert (logits - engine).abs().max() < fp4_gap / 3  # guidance removes most of the FP4 mismatch


def test_routing_replay_uses_the_engines_experts(case):
    """With routed experts and no guidance, every layer's experts are the supplied ones: replaying
    the reversed choices changes the logits, replaying the router's own does not."""
    model, seqs = case["model"], case["batch"]["seqs"]
    set_precision(model, "bf16")
    ids, pos, cu = packed(seqs)
    chosen = {}

    def record(module, args, out):
        chosen[module.layer] = out[2]
    hooks = [m.mlp.gate.register_forward_hook(record) for m in model.model.layers]
    with torch.no_grad():
        free = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, use_cache=False).logits
    for h in hooks:
        h.remove()

    def replayed(routed):
        context.activate(MicroBatchGuidance(ids.shape[1], routed_experts=routed))
        try:
            with torch.no_grad():
                return model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, use_cache=False).logits
        finally:
            context.activate(None)
    assert torch.equal(replayed(chosen), free)
    other = {L: (e + 1) % CFG.num_experts for L, e in chosen.items()}
    assert not torch.allclose(replayed(other), free, atol=1e-3)
    with pytest.raises(GuidanceFormatError, match="routed expert ids outside"):
        replayed({0: chosen[0] + CFG.num_experts})


def test_fp4_modes_refuse_a_padded_batch_and_unknown_models(case):
    model = case["model"]
    set_precision(model, "fp4-rne")
    with pytest.raises(ValueError, match="packed micro-batches"):
        model(input_ids=torch.zeros(2, 4, dtype=torch.long), use_cache=False)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), cu_seq_lens_q=torch.tensor([0, 3]), use_cache=False)
    with pytest.raises(ValueError, match="Qwen3-MoE"):
        attach_fp4_sites(torch.nn.Linear(2, 2))


def test_gradients_flow_to_every_parameter_in_fp4(case):
    """Straight-through estimator: a backward in fp4-guided reaches every weight of every site."""
    model = copy.deepcopy(case["model"])
    set_precision(model, "fp4-guided")
    batch = case["batch"]
    ids, pos, cu = packed(batch["seqs"])
    context.activate(MicroBatchGuidance.from_batch(batch["guidance"], batch["sample_ids"]))
    try:
        logits = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, use_cache=False).logits
        logits.float().square().mean().backward()
    finally:
        context.activate(None)
    missing = [n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert missing == []

