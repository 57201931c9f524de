"""The mismatch experiment: one rollout and one training forward per run mode (modes.RunMode:
bf16, fp4-rollout, fp4-qat, trace; each pairs an engine and a trainer precision).
Every mode replays the engine's routing (rollout routing replay), so the numbers isolate the
rounding. Flip rates compare, at every FP4 site of every layer, the trainer's codes with the
engine's (from dense guidance captured for all layers): an element counts as flipped when its
mantissa bit or its block scale differs (adjacent E2M1 codes always differ in that bit).
`run_mismatch` takes a one-process Megatron model (tensor, expert and pipeline parallel size 1);
the RL step counts flips under any layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trace_kernels.fp4 import quantize, unpack_bits, unpack_codes

from ..megatron import context, qat
from ..megatron.context import MicroBatchGuidance
from ..megatron.model import pack_sequences
from ..megatron.schedule import MicroBatch
from ..modes import EnginePrecision, RunMode
from ..rollout import GroupRequest, SamplingParams, close_backend
from .metrics import mismatch_metrics


@dataclass
class FlipCounter:
    """Observer counting, per layer, elements whose trainer code disagrees with the engine's
    (the `reference` guidance, dense records; by default the forward's active guidance). Under
    tensor, expert, pipeline and data parallelism each rank counts its own rows and columns;
    `rates(num_layers)` sums them. When the reference is the forward's active guidance, the MoE
    layers dispatch its fc2 rows with the tokens (expert parallelism needs that); otherwise only
    one process can count fc2."""

    reference: MicroBatchGuidance | None = None  # None: the forward's active guidance
    rne: dict = field(default_factory=dict)  # layer -> elements whose round-to-nearest code differs
    actual: dict = field(default_factory=dict)  # layer -> elements whose applied code differs
    total: dict = field(default_factory=dict)

    def rates(self, num_layers: int | None = None) -> dict:
        """flip_rate (round to nearest vs the engine), residual_flip_rate (the trainer's actual
        codes vs the engine's) and both by layer; {} when nothing was compared. With
        `num_layers`, the counts of every trainer rank are summed first (a collective: pipeline
        stages count their own layers, data-parallel ranks their own samples)."""
        if num_layers is not None and torch.distributed.is_initialized():
            dev = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
            counts = torch.tensor([[d.get(L, 0) for L in range(num_layers)]
                                   for d in (self.rne, self.actual, self.total)], dtype=torch.float64, device=dev)
            torch.distributed.all_reduce(counts)
            self.rne, self.actual, self.total = ({L: c[L].item() for L in range(num_layers) if counts[2, L] > 0}
                                                 for c in counts)
        total = sum(self.total.values())
        if not total:
            return {}
        return {"flip_rate": sum(self.rne.values()) / total, "residual_flip_rate": sum(self.actual.values()) / total,
                "flip_rate_by_layer": {L: self.rne[L] / n for L, n in sorted(self.total.items())},
                "residual_flip_rate_by_layer": {L: self.actual[L] / n for L, n in sorted(self.total.items())}}

    def __call__(self, site, x, q, guidance):
        ref = self._reference_rows(site, x)
        if ref is None or ref.bit_known is not None or ref.scale_known is not None or ref.scale_lsb:
            return  # only dense guidance names every element's code
        ref_bits = unpack_bits(ref.bits).reshape(x.shape)
        # round to nearest as the trainer does: row amax over the ranks holding the other columns
        amax = qat.all_reduce_max(x.abs().amax(-1, keepdim=True).float(), site.row_group)
        own = quantize(x, "nvfp4", scale="row", global_amax=amax, check_finite=False)
        for store, qt in ((self.rne, own), (self.actual, q)):
            bits = unpack_codes(qt.codes) & 1
            scale_diff = (qt.block_scales.view(torch.uint8) != ref.scales).repeat_interleave(16, dim=1)
            store[site.layer] = store.get(site.layer, 0) + int(((bits != ref_bits) | scale_diff).sum())
        self.total[site.layer] = self.total.get(site.layer, 0) + x.numel()

    def _reference_rows(self, site, x):
        """The reference's rows and columns for this rank's x: the site's own selection (token
        and head shards, column shards, dispatched expert rows), as guidance is applied."""
        mb = self.reference if self.reference is not None else context.active()
        if mb is None:
            return None
        if (site.expert is not None or site.all_experts) and site.layer not in mb.expert_rows:
            # not the forward's active guidance, so nothing dispatched its fc2 rows: in one
            # process they are expert-major, tokens ascending -> (token, slot)
            ref = mb.site(site.layer, site.name)
            if ref is None:
                return None
            if not site.all_experts or site.cols is not None and site.cols.size > 1:
                raise ValueError("counting fc2 flips against guidance the forward does not carry needs one "
                                 "process with grouped-GEMM experts (build_model(grouped_gemm=True))")
            top = mb.routed_experts[site.layer].to(x.device)
            return ref.select_rows(context.expert_major_order(top)).to(x.device)
        rows = site.guidance_rows(x, mb)
        return None if rows is None else rows.to(x.device)


def run_mismatch(trainer, make_engine, state_dict, prompts: list[tuple[int, ...]], *, modes=tuple(RunMode),
                 guide: str = "all", coding: str = "dense", samples_per_prompt: int = 2,
                 sampling: SamplingParams = SamplingParams(max_new_tokens=16)) -> dict[str, dict]:
    """{mode: metrics} for each mode (RunMode or its name; see the module docstring).

    Args:
        trainer: a one-process `rl.trainer.Trainer` holding `state_dict`'s weights.
        make_engine(precision, guide, coding) -> a RolloutBackend (weights not yet loaded).
        state_dict: full Megatron state dict, loaded into each engine.
        prompts: token ids of each prompt; each gets `samples_per_prompt` samples.
        guide / coding: the guidance the trace mode applies (layer policy, "dense"/"sparse").
    Returns:
        per mode: mismatch_metrics' keys plus flip_rate, residual_flip_rate (trace only),
        flip_rate_by_layer and guidance_bits_per_element (trace only).
    """
    modes = [RunMode(m) for m in modes]  # ValueError naming an unknown one
    requests = [GroupRequest(f"p{i}", tuple(p), samples_per_prompt) for i, p in enumerate(prompts)]
    dev = trainer.device
    results = {}
    for mode in modes:
        fp4 = mode.engine_precision is EnginePrecision.FP4
        engine = make_engine(mode.engine_precision, "all" if fp4 else "none", "dense")
        engine.update_weights(state_dict, 0)
        out = engine.generate(requests, sampling)
        close_backend(engine)
        errors = [s.error for s in out.samples if s.error]
        if errors:
            raise ValueError(f"rollout failed: {errors[0]}")
        ids = [s.sample_id for s in out.samples]
        reference = MicroBatchGuidance.from_batch(out.guidance, ids)
        applied, bits = None, None
        if mode.applies_guidance:
            batch = out.guidance
            if (guide, coding) != ("all", "dense"):  # the same samples again, recorded as configured
                engine = make_engine(EnginePrecision.FP4, guide, coding)
                engine.update_weights(state_dict, 0)
                batch = engine.generate(requests, sampling).guidance
                close_backend(engine)
            applied = MicroBatchGuidance.from_batch(batch, ids)
            records = [r for o in (*batch.groups.values(), *batch.samples.values()) for r in o.records.values()]
            elems = sum(r.header.rows * r.header.cols for r in records)
            bits = 8 * sum(r.nbytes for r in records) / elems if elems else 0.0
        replay_only = MicroBatchGuidance(reference.num_tokens, routed_experts=reference.routed_experts)
        counter = FlipCounter(reference)
        seqs = [torch.tensor(list(requests[int(s.group_id[1:])].prompt_ids) + s.tokens) for s in out.samples]
        tokens, positions, psp = pack_sequences(seqs, dev)
        trainer.set_precision(mode.trainer_precision)
        if fp4 and mode.trainer_precision.quantizes:
            qat.observers.append(counter)
        mb = MicroBatch(tokens, positions, torch.roll(tokens, -1, 1), psp,
                        applied if applied is not None else replay_only)
        try:
            with torch.no_grad():
                lp = trainer.run_microbatches([mb], lambda i, logp: (logp.sum(), {"logp": logp.cpu()}),
                                              forward_only=True)[0]["logp"]
        finally:
            qat.observers.clear()
        train, offset = [], 0
        for s, q in zip(out.samples, seqs, strict=True):
            train.append(lp[offset + s.prompt_len - 1: offset + len(q) - 1])
            offset += len(q)
        m = mismatch_metrics(train, [s.logprobs for s in out.samples])
        rates = counter.rates()
        if rates:
            m["flip_rate"], m["flip_rate_by_layer"] = rates["flip_rate"], rates["flip_rate_by_layer"]
            if mode.applies_guidance:
                m["residual_flip_rate"] = rates["residual_flip_rate"]
        if bits is not None:
            m["guidance_bits_per_element"] = bits
        results[mode.value] = m
    return results

