"""The DeepSpeed trainer's step primitives (megatron_trace.deepspeed.trainer) under ZeRO-2 on 2 CPU
processes: its log-probs against the Megatron trainer's on the same weights and micro-batch, and
its caller-owned gradient accumulation against one packed micro-batch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_trace.config import OptimSection
from megatron_trace.deepspeed.trainer import REQUIRED_CONFIG, deepspeed_config
from megatron_trace.megatron.context import MicroBatchGuidance
from megatron_trace.megatron.schedule import MicroBatch
from megatron_trace.megatron.spawn import spawn
from megatron_trace.model_config import PRESETS
from megatron_trace.rl.metrics import mismatch_metrics
from tests.support import deepspeed_cpu
from tests.support import scenarios as sc

CFG = PRESETS["tiny"]
MODES = ("bf16", "fp4-rne", "fp4-guided")


def micro_batch(seqs, guidance=None) -> MicroBatch:
    """The Megatron trainer's packed micro-batch of `seqs` (targets: each sequence's next tokens;
    its last token predicts its own first, a target like any other here)."""
    from megatron_trace.megatron.model import pack_sequences

    ids, pos, psp = pack_sequences(seqs, torch.device("cpu"))
    targets = torch.cat([s.roll(-1) for s in seqs])[None]
    return MicroBatch(ids, pos, targets, psp, guidance)


def _deepspeed(rank, *, hf_dir, batch, halves):
    from transformers import Qwen3MoeForCausalLM

    from megatron_trace.deepspeed.model import attach_fp4_sites
    from megatron_trace.deepspeed.trainer import DeepSpeedTrainer, deepspeed_config

    def trainer():
        model = attach_fp4_sites(Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16))
        config = deepspeed_config({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                                   "gradient_clipping": 1.0, "steps_per_print": 10**9})
        t = DeepSpeedTrainer(deepspeed_cpu.initialize(model, config, lr=1e-3, weight_decay=0.0), CFG,
                             OptimSection(lr_warmup_steps=0))
        t.start_phase(1e-3)
        return t

    out = {"logp": {}}
    t = trainer()
    for mode in MODES:  # guidance and routing replay in fp4-guided, as the Megatron run had them
        t.set_precision(mode)
        mb = batch if mode == "fp4-guided" else dataclasses.replace(batch, guidance=None)
        with torch.no_grad():
            out["logp"][mode] = t.run_microbatches([mb], lambda i, lp: (lp.sum(), {"logp": lp}),
                                                   forward_only=True)[0]["logp"]
    # the same loss over the same tokens: two micro-batches accumulated, or one holding both
    for name, mbs in (("two", halves), ("one", [batch])):
        t = trainer()
        t.set_precision("fp4-guided")
        t.zero_grad()
        t.run_microbatches(mbs, lambda i, lp: (-lp.mean() * lp.numel() / batch.targets.numel(), {}))
        out[name] = {**t.step(), "weights": deepspeed_cpu.gathered_weights(t.module)}
    return out


def _resume(rank, *, hf_dir, batch, ckpt):
    """ZeRO-3: three steps uninterrupted (the learning rate warming up over two); two steps, saved,
    a fresh engine loading it, the third."""
    from transformers import Qwen3MoeForCausalLM

    from megatron_trace.checkpoint.hf import HFCheckpoint
    from megatron_trace.deepspeed.model import attach_fp4_sites
    from megatron_trace.deepspeed.trainer import DeepSpeedTrainer, deepspeed_config
    from megatron_trace.deepspeed.weights import megatron_weights

    def trainer():
        model = attach_fp4_sites(Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16), "fp4-guided")
        config = deepspeed_config({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                   "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 10**9})
        t = DeepSpeedTrainer(deepspeed_cpu.initialize(model, config, lr=1e-3, weight_decay=0.1), CFG,
                             OptimSection(lr_warmup_steps=2))
        t.start_phase(1e-3)
        return t

    def steps(t, n):
        for _ in range(n):
            t.zero_grad()
            t.run_microbatches([batch], lambda i, lp: (-lp.mean(), {}))
            t.step()

    whole = trainer()
    steps(whole, 3)
    first = trainer()
    steps(first, 2)
    ckpt = Path(ckpt)
    first.save(ckpt)
    second = trainer()
    second.load_weights(ckpt)
    second.start_phase(1e-3)  # as a resumed run's phase starts: a fresh optimizer, then the saved state
    second.load_optimizer(ckpt)
    steps(second, 1)
    return dict(whole=deepspeed_cpu.gathered_weights(whole.module), resumed=deepspeed_cpu.gathered_weights(
        second.module), two=deepspeed_cpu.gathered_weights(first.module),
                saved=dict(HFCheckpoint(ckpt / "model").items()) if rank == 0 else None,
                two_megatron=dict(megatron_weights(first.module, CFG)))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from tests.support.hf_models import hf_from_megatron

    sd = sc.random_full_state_dict(CFG, seed=7)
    # FP32 norms holding BF16 values, as after loading an HF checkpoint (the HF model holds them in BF16)
    sd = {k: v.bfloat16().float() if v.dtype == torch.float32 else v for k, v in sd.items()}
    seqs = sc.make_sequences(CFG, [9, 7, 12, 6], seed=8)
    gb, sids, codes, _ = sc.engine_rollout(CFG, sd, seqs, [4, 3, 5, 2], layers=range(CFG.num_layers))
    hf_dir = tmp_path_factory.mktemp("hf")
    hf_from_megatron(sd, hf_dir)
    whole = micro_batch(seqs, MicroBatchGuidance.from_batch(gb, sids))
    halves = [micro_batch(seqs[:2], MicroBatchGuidance.from_batch(gb, sids[:2])),
              micro_batch(seqs[2:], MicroBatchGuidance.from_batch(gb, sids[2:]))]
    megatron = spawn(sc.run_layout, {}, cfg=CFG, sd=sd, batches=[dict(seqs=seqs, guidance=gb, sample_ids=sids,
                                                                        codes=codes)], modes=list(MODES))[0][0]
    ranks = deepspeed_cpu.spawn(_deepspeed, world=2, hf_dir=str(hf_dir), batch=whole, halves=halves)
    resume = deepspeed_cpu.spawn(_resume, world=2, hf_dir=str(hf_dir), batch=whole,
                                 ckpt=str(tmp_path_factory.mktemp("ds") / "ckpt"))
    return dict(batch=whole, megatron=megatron, ranks=ranks, resume=resume)


def test_logprobs_are_the_megatron_trainers_bit_for_bit(case):
    """Same weights, same packed micro-batch, on both ranks (ZeRO-2): the engine's codes and routed
    experts in fp4-guided, free routing in bf16 and fp4-rne, as the Megatron run had them. The HF
    model computes the Megatron trainer's arithmetic (TRACE's router, norms and packed attention,
    the experts' order), so every log-prob is the same float: k3_kl 0."""
    targets = case["batch"].targets[0]
    for mode in MODES:
        want = torch.log_softmax(case["megatron"]["logits"][mode], -1).gather(1, targets[:, None])[:, 0]
        for rank in case["ranks"]:
            got = rank["logp"][mode]
            assert torch.equal(got, want), (mode, mismatch_metrics([got], [want])["k3_kl"],
                                            float((got - want).abs().max()))
    assert not torch.equal(case["ranks"][0]["logp"]["fp4-rne"], case["ranks"][0]["logp"]["bf16"])


def test_accumulated_microbatches_step_as_one(case):
    """managed_gradient_accumulation off: two micro-batches' gradients accumulate and reduce once
    at step, as one micro-batch of the same tokens does: gradient norms within 4e-5 (relative),
    99.94% of the BF16 weights bit-identical, the rest within 2 x lr (summation order; measured 1.95e-3)."""
    for rank in case["ranks"]:
        two, one = rank["two"], rank["one"]
        # the norm of the whole accumulated gradient (a micro-batch dropped or counted twice moves it by far more)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4) and one["grad_norm"] > 0
        same = sum(int(torch.eq(two["weights"][n], one["weights"][n]).sum()) for n in one["weights"])
        total = sum(t.numel() for t in one["weights"].values())
        assert same / total > 0.99
        # the rest: Adam's first step is lr x sign(gradient) where the gradient is large against
        # eps, so an element whose tiny gradient rounds to the other sign lands 2 x lr away
        assert max((two["weights"][n].float() - w.float()).abs().max() for n, w in one["weights"].items()) <= 2.5e-3
    assert all(torch.equal(case["ranks"][0]["one"]["weights"][n], case["ranks"][1]["one"]["weights"][n])
               for n in case["ranks"][0]["one"]["weights"])


def test_config_keeps_the_users_keys_and_refuses_contradictions():
    user = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": False}, "steps_per_print": 5}
    assert deepspeed_config(user) == {**user, **REQUIRED_CONFIG}
    assert deepspeed_config({})["bf16"] == {"enabled": True}  # TRACE computes in BF16, as the engines
    with pytest.raises(ValueError, match="fp16"):
        deepspeed_config({"fp16": {"enabled": True}})
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        deepspeed_config({"gradient_accumulation_steps": 4})
    with pytest.raises(ValueError, match="train_batch_size"):
        deepspeed_config({"train_batch_size": 64})


def test_zero3_save_and_load_resumes_the_uninterrupted_run(case):
    """Saved after 2 of 3 steps (ZeRO-3, 2 ranks, optimizer state included), loaded into a fresh
    engine, the 3rd step: every weight bit for bit the uninterrupted run's (the optimizer's moments
    and the warm-up's position restored); the checkpoint's HF model is the trained weights."""
    for rank in case["resume"]:
        assert rank["whole"].keys() == rank["resumed"].keys()
        assert all(torch.equal(rank["resumed"][n], w) for n, w in rank["whole"].items())
        assert any(not torch.equal(rank["two"][n], w) for n, w in rank["whole"].items())  # the 3rd step moved them
    saved, trained = case["resume"][0]["saved"], case["resume"][0]["two_megatron"]
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[n], t.to(saved[n].dtype)) for n, t in trained.items())
