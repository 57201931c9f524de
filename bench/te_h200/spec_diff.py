"""Where do the TE spec and the local spec part ways? Both specs of the tiny MoE (tests' scenario:
random weights, an engine rollout with dense guidance) with the same weights, each mode's forward
with a hook on every module: prints, per mode, the modules (in the local spec's execution order)
whose outputs differ by more than BF16 reduction order, and the parameters that differ.
A diagnostic for TE version bumps; needs a GPU with TE (bench/gpu_te.sh).
    python bench/te_h200/spec_diff.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODES = ["bf16", "fp4-rne", "fp4-guided"]


def _outputs(model, mode, ids, pos, psp, guidance):
    from megatron_trace.megatron.model import set_precision

    seen, hooks = {}, []
    for name, m in model.named_modules():
        def hook(mod, args, out, name=name):
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor) and t.is_floating_point() and name not in seen:
                seen[name] = t.detach().float().clone()
        hooks.append(m.register_forward_hook(hook))
    set_precision(model, mode)
    try:
        with torch.no_grad():
            model(ids, pos, None, packed_seq_params=psp, guidance=guidance if mode == "fp4-guided" else None)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _diff(rank, *, cfg, sd, batch):
    from megatron_trace.megatron.context import MicroBatchGuidance
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.trainer import linears_for
    from megatron_trace.megatron.weights import global_name, load_full_state_dict
    from tests.support import scenarios as sc

    models = {}
    for impl in ("local", "transformer_engine"):
        models[impl] = build_model(cfg, "bf16", grouped_gemm=True, linears=linears_for(impl))
        load_full_state_dict(models[impl], sd)
    params = {impl: {global_name(n, m): p.detach().float().cpu() for n, p in m.named_parameters()}
              for impl, m in models.items()}
    lines = [f"params only local: {sorted(set(params['local']) - set(params['transformer_engine']))}",
             f"params only TE: {sorted(set(params['transformer_engine']) - set(params['local']))}"]
    for n in sorted(set(params["local"]) & set(params["transformer_engine"])):
        a, b = params["local"][n], params["transformer_engine"][n]
        if a.shape != b.shape or not torch.equal(a, b):
            lines.append(f"param {n} differs: {tuple(a.shape)} vs {tuple(b.shape)}")
    ids, pos, psp = sc.packed_inputs(batch["seqs"])
    guidance = MicroBatchGuidance.from_batch(batch["guidance"], batch["sample_ids"],
                                             layers=range(cfg.num_layers)).to(sc.device())
    for mode in MODES:
        outs = {impl: _outputs(m, mode, ids, pos, psp, guidance) for impl, m in models.items()}
        shown = 0
        for name, a in outs["local"].items():
            b = outs["transformer_engine"].get(name)
            if b is None or b.shape != a.shape:
                continue
            err = float((a - b).norm() / a.norm().clamp_min(1e-12))
            if err > 2e-2 and shown < 12:
                lines.append(f"{mode:10s} {name:60s} rel {err:.3f}  "
                             f"|local| {float(a.norm()):.3g} |te| {float(b.norm()):.3g}")
                shown += 1
        la, lb = outs["local"].get("output_layer"), outs["transformer_engine"].get("output_layer")
        if la is not None and lb is not None:
            lines.append(f"{mode:10s} logits max abs diff {float((la - lb).abs().max()):.4f}")
        missing = [n for n in outs["local"] if n not in outs["transformer_engine"]]
        lines.append(f"{mode:10s} modules only in local: {missing[:20]}")
    return "\n".join(lines)


def main() -> None:
    from megatron_trace.megatron.spawn import spawn
    from tests.megatron_trace.megatron import test_model_qat as qat_case
    from tests.support import scenarios as sc

    sd = sc.random_full_state_dict(qat_case.CFG)
    batch = qat_case._batches(sd, "dense")[0]
    batch = {k: v for k, v in batch.items() if k != "engine_logits"}
    print(spawn(_diff, {}, cfg=qat_case.CFG, sd=sd, batch=batch)[0])


if __name__ == "__main__":
    main()
