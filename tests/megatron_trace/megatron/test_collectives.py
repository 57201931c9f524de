"""Trainer collectives of the disaggregated job: the full state dict gathered from any layout,
and gradients reduced by Megatron's DDP across data- and expert-parallel ranks (and the
sequence-parallel norms' over TP), against one process."""

import torch

from megatron_trace.megatron.spawn import spawn
from megatron_trace.model_config import PRESETS
from tests.support import scenarios as sc
from tests.support.ranks import skip_unless_gpus_for

CFG = PRESETS["tiny"]


def run_grads(rank, *, sd, seqs):
    """{global name: float32 grad} reduced by Megatron's DDP (`megatron.optimizer`), on every
    replica; this rank trains on seqs[dp_rank] (one process: on all of them, as one micro-batch)."""
    from megatron.core import parallel_state as ps

    from megatron_trace.config import OptimSection
    from megatron_trace.megatron.model import build_model, pack_sequences
    from megatron_trace.megatron.optimizer import TrainerOptimizer
    from megatron_trace.megatron.schedule import run_microbatch
    from megatron_trace.megatron.weights import global_name, load_full_state_dict
    from tests.support.full_gather import gather_full_state_dict

    model = build_model(CFG, "bf16", params_dtype=torch.float32, grouped_gemm=True)
    load_full_state_dict(model, sd)
    gathered = gather_full_state_dict(model)
    dp, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = seqs[dp::dp_size]
    ids, pos, psp = pack_sequences(mine)
    targets = torch.cat([torch.roll(s, -1) for s in mine])[None]
    keep = torch.cat([torch.arange(len(s)) < len(s) - 1 for s in mine])  # no target past a sequence
    opt = TrainerOptimizer(model, 1e-3, OptimSection(distributed=False))
    opt.zero_grad()
    run_microbatch(opt.ddp, ids, pos, targets, psp, lambda logp: (-(logp * keep).sum() / keep.sum(), {}))
    grads = {global_name(n, model): p.main_grad.float().clone() for n, p in model.named_parameters()}
    return gathered, grads, ps.get_tensor_model_parallel_rank()


def _slice(full, name, rank, size=2):
    """The TP / expert-TP slice of a full tensor (tp2 with expert-TP 2), as weights.shard_of cuts it."""
    from megatron_trace.megatron.weights import _split_rule

    group, dim, gated = _split_rule(name)
    if group is None:
        return full
    if gated:
        return torch.cat([part.chunk(size, dim)[rank] for part in full.chunk(2, dim)], dim)
    return full.chunk(size, dim)[rank]


def test_gathered_weights_and_reduced_grads_match_one_process():
    sd = {k: v.float() for k, v in sc.random_full_state_dict(CFG, seed=2).items()}
    seqs = sc.make_sequences(CFG, [10, 10], seed=4)  # equal lengths: the mean of means is the mean
    (full, want, _), = spawn(run_grads, {}, sd=sd, seqs=seqs)
    assert set(full) == set(sd) and all(torch.equal(full[k], sd[k]) for k in sd)
    skip_unless_gpus_for({"dp": 2})
    for layout in ({"ep": 2, "dp": 2}, {"tp": 2}):
        results = spawn(run_grads, layout, sd=sd, seqs=seqs)
        gathered = results[0][0]
        assert set(gathered) == set(sd) and all(torch.equal(gathered[k], sd[k]) for k in sd), layout
        assert results[1][0] is None  # only the destination rank holds the full state dict
        seen = set()
        for _, grads, tp_rank in results:
            for name, g in grads.items():
                expect = _slice(want[name], name, tp_rank) if layout.get("tp") else want[name]
                torch.testing.assert_close(g, expect, rtol=1e-4, atol=1e-6, msg=f"{layout} {name}")
                seen.add(name)
        assert seen == set(want)  # every tensor checked: EP both ranks' experts, DP/TP every dense weight
