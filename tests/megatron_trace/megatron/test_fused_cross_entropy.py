"""Megatron's fused cross entropy (`trainer.megatron={cross_entropy_loss_fusion: true,
cross_entropy_fusion_impl: native}`, which issue 28's profile points at: its unfused loss spent
~40 ms of a 240 ms step on four float32 passes over the logits) gives the trainer's token
log-probabilities and their gradients as the default path does, both against a float64
log-softmax of the model's own logits."""

import torch

from megatron_trace.megatron.spawn import spawn
from tests.support import scenarios as sc

FUSED = {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "native"}


def _logprobs(rank, *, cfg, sd, seqs):
    from megatron_trace.megatron.model import build_model, token_logprobs
    from megatron_trace.megatron.weights import load_full_state_dict

    ids, pos, psp = sc.packed_inputs(seqs)
    targets = torch.roll(ids, -1, dims=1)
    out = {}
    for name, options in (("default", {}), ("fused", FUSED)):
        model = build_model(cfg, "fp4-rne", megatron_options=options)
        assert model.config.cross_entropy_loss_fusion is bool(options)  # the option reached Megatron's model
        load_full_state_dict(model, sd)
        lp = token_logprobs(model, ids, pos, targets, packed_seq_params=psp)
        weights = torch.linspace(0.5, 1.5, lp.numel()).reshape(lp.shape)  # a loss that weighs tokens apart
        (lp * weights).sum().backward()
        with torch.no_grad():
            logits = model(ids, pos, None, packed_seq_params=psp)
        grads = {}
        for n, p in model.named_parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                grads[n] = g.clone()
        out[name] = (lp.detach().reshape(-1), logits.reshape(ids.shape[1], -1).double(), targets.reshape(-1), grads)
    return out


def test_fused_cross_entropy_gives_the_default_log_probs_and_gradients():
    """Three packed sequences through the tiny MoE in fp4-rne, token-weighted loss."""
    from megatron_trace.model_config import PRESETS

    cfg = PRESETS["tiny"]
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (7, 12, 5)]
    (r,) = spawn(_logprobs, {}, cfg=cfg, sd=sc.random_full_state_dict(cfg), seqs=seqs)
    for name in ("default", "fused"):
        lp, logits, targets, _ = r[name]
        want = torch.log_softmax(logits, -1).gather(-1, targets[:, None].long()).reshape(-1)
        torch.testing.assert_close(lp.double(), want, atol=1e-5, rtol=0, msg=name)
    torch.testing.assert_close(r["fused"][0], r["default"][0], atol=1e-5, rtol=0)
    grads_d, grads_f = r["default"][3], r["fused"][3]
    assert grads_d.keys() == grads_f.keys() and grads_d
    for n in grads_d:
        err = (grads_f[n].float() - grads_d[n].float()).norm() / grads_d[n].float().norm().clamp_min(1e-12)
        assert err < 1e-3, f"{n}: relative gradient difference {float(err):.2e}"
