"""The trainer's optimizer is Megatron's own (`megatron_trace.megatron.optimizer`): DDP with
bucketed, overlapped reduction and `get_megatron_optimizer`, the distributed optimizer sharding
FP32 main parameters and AdamW moments over the data-parallel ranks.

Checked over real gloo process groups (CPU patch P8 lets Megatron's dtype checks accept CPU
tensors): the distributed optimizer against the non-distributed one in the same ranks, both
against one process on the same global batch, gradient clipping and AdamW against a float64
re-computation, per-rank optimizer bytes measured from the live tensors.
"""

import pytest
import torch

from megatron_trace.megatron.spawn import spawn
from megatron_trace.model_config import PRESETS
from tests.support import scenarios as sc
from tests.support.ranks import skip_unless_gpus_for

CFG = PRESETS["tiny"]
STEPS = 3
LR = 3e-3


def _slice(full, name, rank, size):
    """This TP / expert-TP rank's slice of a full tensor, as megatron_trace.megatron.weights cuts it."""
    from megatron_trace.megatron.weights import _split_rule

    group, dim, gated = _split_rule(name)
    if group is None or size == 1:
        return full
    if gated:
        return torch.cat([part.chunk(size, dim)[rank] for part in full.chunk(2, dim)], dim)
    return full.chunk(size, dim)[rank]


def run_training(rank, *, sd, seqs, clip, lr=LR):
    """STEPS steps of both optimizers (non-distributed, distributed) from the same weights; this
    data-parallel rank trains on its share of `seqs`, the loss the token mean over all of them.
    Returns per optimizer: {global name: weight}, grad norms, optimizer bytes; and the TP rank."""
    from megatron.core import parallel_state as ps

    from megatron_trace.config import OptimSection
    from megatron_trace.megatron.model import build_model, pack_sequences
    from megatron_trace.megatron.optimizer import TrainerOptimizer
    from megatron_trace.megatron.schedule import run_microbatch
    from megatron_trace.megatron.weights import global_name, load_full_state_dict

    dp, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = seqs[dp::dp_size]
    total = sum(len(s) - 1 for s in seqs)  # predicted tokens of the global batch
    pad = (-sum(len(s) for s in mine)) % ps.get_tensor_model_parallel_world_size()
    ids, pos, psp = pack_sequences(mine, pad=pad)
    targets = torch.roll(ids, -1, 1)
    keep = torch.cat([torch.arange(len(s)) < len(s) - 1 for s in mine] + [torch.zeros(pad, dtype=torch.bool)])
    out = {}
    for dtype, distributed in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False),
                               (torch.float32, True)):
        model = build_model(CFG, "bf16", grouped_gemm=True, params_dtype=dtype)
        load_full_state_dict(model, sd)
        opt = TrainerOptimizer(model, lr, OptimSection(distributed=distributed, clip_grad=clip, lr_warmup_steps=0))
        norms, first = [], None
        for _ in range(STEPS):
            opt.zero_grad()
            run_microbatch(opt.ddp, ids, pos, targets, psp,
                           lambda logp: (-(logp * keep).sum() / (total / dp_size), {}))
            norms.append(opt.step()["grad_norm"])
            weights = {global_name(n, model): p.detach().clone() for n, p in model.named_parameters()}
            first = first or weights
        out[dtype, distributed] = {"weights": weights, "first": first, "norms": norms,
                                   "bytes": opt.local_state_bytes()}
    return out, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _same_weights(got: dict, want: dict, what) -> None:
    """The distributed optimizer's weights against the non-distributed one's. FP32 parameters
    (all of an FP32 model, the FP32 main copies and norms of a BF16 one) show the clip factor's
    last bits (from the norm's summation order): within 1e-6 but for an element or two. BF16 weights are those FP32 main
    parameters rounded: equal, except where a main parameter sat that close to a BF16 rounding
    midpoint, one BF16 ulp apart (expected about once in 10^5 elements a step)."""
    for name, w in want.items():
        if w.dtype == torch.bfloat16:
            g = got[name]
            ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(w.float().abs(), g.float().abs())
            off = g != w
            assert bool(((g.float() - w.float()).abs() <= ulp)[off].all()), f"{what} {name}: more than one ulp"
            assert int(off.sum()) <= max(8, 1e-3 * w.numel()), f"{what} {name}: {int(off.sum())} of {w.numel()} differ"
        else:
            # AdamW divides each element by its own gradient's magnitude, so where that gradient is
            # a near-cancelling sum the clip factor's last bits move it more: all but two elements
            # within 1e-6 (measured: one at 1.15e-6 on one CPU, none on another), those within lr / 10
            off = (got[name] - w).abs()
            assert int((off > 1e-6).sum()) <= 2 and float(off.max()) <= LR / 10, \
                f"{what} {name}: {int((off > 1e-6).sum())} elements off by more than 1e-6, at most {float(off.max())}"


def _check_layout(layout, want, sd, seqs):
    """In every rank of `layout`: the distributed optimizer gives the non-distributed one's
    weights (`_same_weights`), and FP32 training gives one process's weights
    (`want`) up to the reduction order of FP32 sums. BF16 parameters are not compared across
    layouts: a BF16 forward over another packing rounds differently, and AdamW turns a gradient
    near zero into a step of about lr whatever its size."""
    results = spawn(run_training, layout, sd=sd, seqs=seqs, clip=0.5)
    seen = set()
    for out, tp_rank, tp in results:
        for dtype in (torch.bfloat16, torch.float32):
            plain, sharded = out[dtype, False], out[dtype, True]
            # the same gradients; the sharded norm sums its squares shard by shard (FP32 order: ~1e-7).
            # A BF16 model is compared after its first step: a weight one ulp apart (_same_weights)
            # changes the next forward, and from there the runs are only close
            steps = STEPS if dtype == torch.float32 else 1
            torch.testing.assert_close(torch.tensor(sharded["norms"][:steps]), torch.tensor(plain["norms"][:steps]),
                                       rtol=1e-6, atol=0)
            key = "weights" if dtype == torch.float32 else "first"
            _same_weights(sharded[key], plain[key], layout)
        plain = out[torch.float32, False]
        torch.testing.assert_close(torch.tensor(plain["norms"]), torch.tensor(want["norms"]), rtol=1e-5, atol=0)
        for name, w in plain["weights"].items():
            ref = _slice(want["weights"][name], name, tp_rank, tp)
            # AdamW divides each gradient element by its own magnitude: an element whose gradient
            # is a near-cancelling sum moves by a visible fraction of lr under another reduction
            # order. All but two elements of a tensor within 1e-5, those within lr / 10 (a wrong
            # scale or shard is off by ~lr nearly everywhere)
            off = (w - ref).abs()
            assert int((off > 1e-5).sum()) <= 2 and float(off.max()) <= LR / 10, \
                f"{layout} {name}: {int((off > 1e-5).sum())} elements off by more than 1e-5, at most {float(off.max())}"
            seen.add(name)
    assert seen == set(want["weights"])
    return results


@pytest.fixture(scope="module")
def one_process_training():
    """(state dict, sequences, one process's runs by (param dtype, distributed optimizer))."""
    sd = sc.random_full_state_dict(CFG, seed=3)
    seqs = sc.make_sequences(CFG, [12, 9, 14, 7], seed=5)  # unequal: the loss is the global token mean
    (one, _, _), = spawn(run_training, {}, sd=sd, seqs=seqs, clip=0.5)
    return sd, seqs, one


def test_the_distributed_optimizer_on_one_rank_is_the_plain_one(one_process_training):
    _, _, one = one_process_training
    for dtype in (torch.bfloat16, torch.float32):
        torch.testing.assert_close(torch.tensor(one[dtype, True]["norms"]), torch.tensor(one[dtype, False]["norms"]),
                                   rtol=1e-6, atol=0)
        _same_weights(one[dtype, True]["weights"], one[dtype, False]["weights"], "one process")
    assert max(one[torch.float32, False]["norms"]) > 0.5  # the clip acted


@pytest.mark.parametrize("layout", [{"dp": 2}, {"ep": 2, "dp": 2}, {"tp": 2, "pp": 2}],
                         ids=["dp2", "ep2-dp2", "tp2-pp2"])
def test_distributed_optimizer_equals_the_plain_one_and_one_process_under(one_process_training, layout):
    sd, seqs, one = one_process_training
    skip_unless_gpus_for(layout)
    results = _check_layout(layout, one[torch.float32, False], sd, seqs)
    if layout == {"dp": 2}:
        for out, _, _ in results:  # each rank holds half of the FP32 main parameters and moments
            plain, sharded = out[torch.bfloat16, False]["bytes"], out[torch.bfloat16, True]["bytes"]
            assert abs(sharded - plain / 2) <= 0.02 * plain, (sharded, plain)


def run_clipped_adamw(rank, *, sd, seqs, clip, lr, warmup):
    """Megatron's optimizer next to a float64 AdamW fed the same reduced gradients, its learning
    rate ramped linearly over `warmup` steps: returns the max difference of the FP32 main
    parameters and of the reported grad norms, and the reported learning rate, per step."""
    from megatron_trace.config import OptimSection
    from megatron_trace.megatron.model import build_model, pack_sequences
    from megatron_trace.megatron.optimizer import TrainerOptimizer
    from megatron_trace.megatron.schedule import run_microbatch
    from megatron_trace.megatron.weights import load_full_state_dict

    model = build_model(CFG, "bf16", grouped_gemm=True)
    load_full_state_dict(model, sd)
    opt = TrainerOptimizer(model, lr, OptimSection(distributed=False, clip_grad=clip, lr_warmup_steps=warmup))
    params = [p for p in model.parameters() if p.requires_grad]
    ref = [p.detach().double().clone().requires_grad_() for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    ids, pos, psp = pack_sequences(seqs)
    targets = torch.roll(ids, -1, 1)
    keep = torch.cat([torch.arange(len(s)) < len(s) - 1 for s in seqs])
    rows = []
    for step in range(STEPS):
        opt.zero_grad()
        run_microbatch(opt.ddp, ids, pos, targets, psp, lambda logp: (-(logp * keep).sum() / keep.sum(), {}))
        ref_opt.param_groups[0]["lr"] = lr * min(1.0, (step + 1) / warmup) if warmup else lr
        grads = [p.main_grad.double().clone() for p in params]
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        factor = min(1.0, clip / (float(norm) + 1e-6))  # Megatron's clip_grad_by_total_norm_fp32
        for r, g in zip(ref, grads, strict=True):
            r.grad = g * factor
        ref_opt.step()
        stepped = opt.step()
        got = stepped["grad_norm"]
        main = [m for o in opt.optimizer.chained_optimizers for g in o.optimizer.param_groups for m in g["params"]]
        by_shape = {}
        for m in main:
            by_shape.setdefault(tuple(m.shape), []).append(m)
        diff = 0.0
        for r in ref:  # main parameters are in the optimizer's own order: match each by shape and closeness
            diff = max(diff, min(float((m.double() - r.detach()).abs().max()) for m in by_shape[tuple(r.shape)]))
        rows.append((abs(got - float(norm)) / float(norm), diff, factor, stepped["lr"]))
    return rows


@pytest.mark.parametrize("warmup", [0, 2])
def test_clipping_warmup_and_adamw_against_float64(warmup):
    """Clipping by global norm and AdamW, at constant lr and with a 2-step linear warm-up
    (Megatron's OptimizerParamScheduler: lr/2, then lr), against float64."""
    sd = sc.random_full_state_dict(CFG, seed=1)
    seqs = sc.make_sequences(CFG, [16, 11], seed=2)
    (rows,) = spawn(run_clipped_adamw, {}, sd=sd, seqs=seqs, clip=0.3, lr=1e-2, warmup=warmup)
    for norm_err, weight_err, _, _ in rows:
        assert norm_err < 1e-5  # Megatron's norm (FP32 squares) against float64
        assert weight_err < 1e-5  # FP32 main weights against float64 AdamW, after the clip
    assert any(f < 0.5 for _, f in ((r[0], r[2]) for r in rows))  # clipping acted
    want = [1e-2 * min(1.0, (k + 1) / warmup) if warmup else 1e-2 for k in range(STEPS)]
    assert [r[3] for r in rows] == pytest.approx(want, rel=1e-12)


def _batch(seqs):
    """This data-parallel rank's share of `seqs` packed (padded to the TP size), its loss mask,
    and the global batch's predicted tokens."""
    from megatron.core import parallel_state as ps

    from megatron_trace.megatron.model import pack_sequences

    dp, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = seqs[dp::dp_size]
    pad = (-sum(len(s) for s in mine)) % ps.get_tensor_model_parallel_world_size()
    ids, pos, psp = pack_sequences(mine, sc.device(), pad=pad)
    keep = torch.cat([torch.arange(len(s)) < len(s) - 1 for s in mine] + [torch.zeros(pad, dtype=torch.bool)])
    return ids, pos, psp, keep.to(sc.device()), sum(len(s) - 1 for s in seqs)


def _train_step(opt, seqs):
    from megatron.core import parallel_state as ps

    from megatron_trace.megatron.schedule import run_microbatch

    ids, pos, psp, keep, total = _batch(seqs)
    opt.zero_grad()
    run_microbatch(opt.ddp, ids, pos, torch.roll(ids, -1, 1), psp,
                   lambda logp: (-(logp * keep).sum() / (total / ps.get_data_parallel_world_size()), {}))
    return opt.step()["grad_norm"]


def run_resharded_resume(rank, *, sd, seqs, directory, save, dtype=torch.float32, offload=False, megatron=None):
    """save: two steps under this layout, then model and optimizer saved, then a third step.
    Else: model and optimizer loaded under this layout (and, beside them, a fresh optimizer),
    then the third step. Returns {global name: weight} after the third step (and the fresh one's)."""
    from megatron_trace.checkpoint.dist import load_model, save_model
    from megatron_trace.config import OptimSection
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.optimizer import TrainerOptimizer
    from megatron_trace.megatron.weights import global_name, load_full_state_dict

    def build():
        model = build_model(CFG, "bf16", grouped_gemm=True, params_dtype=dtype)
        load_full_state_dict(model, sd)
        return model, TrainerOptimizer(model, LR, OptimSection(distributed=True, clip_grad=0.5, cpu_offload=offload,
                                                                   megatron=megatron or {}))

    def weights(model):
        return {global_name(n, model): p.detach().clone() for n, p in model.named_parameters()}

    model, opt = build()
    if save:
        for _ in range(2):
            _train_step(opt, seqs)
        save_model(model, CFG, f"{directory}/model")
        opt.save(f"{directory}/optimizer")
        _train_step(opt, seqs)
        return weights(model), None
    load_model(model, f"{directory}/model")
    opt.load(f"{directory}/optimizer")
    _train_step(opt, seqs)
    fresh, fresh_opt = build()
    load_model(fresh, f"{directory}/model")
    _train_step(fresh_opt, seqs)
    return weights(model), weights(fresh)


def test_a_dp2_optimizer_checkpoint_resumes_under_one_rank_and_under_tp2(tmp_path):
    """The distributed optimizer's state saved at DP2 ("fully_reshardable") loads under DP1 and
    TP2, and the next step lands where the uninterrupted DP2 run's does (FP32, up to reduction
    order; the learning-rate warm-up resumes at its third step), while a fresh optimizer from the
    same weights lands far from it (its moments matter)."""
    sd = sc.random_full_state_dict(CFG, seed=7)
    seqs = sc.make_sequences(CFG, [12, 9, 14, 7], seed=8)
    skip_unless_gpus_for({"tp": 2})
    saved = spawn(run_resharded_resume, {"dp": 2}, sd=sd, seqs=seqs, directory=str(tmp_path), save=True)
    want = saved[0][0]
    for layout in ({}, {"tp": 2}):
        results = spawn(run_resharded_resume, layout, sd=sd, seqs=seqs, directory=str(tmp_path), save=False)
        for tp_rank, (got, fresh) in enumerate(results):
            tp = layout.get("tp", 1)
            far = 0.0
            for name, w in got.items():
                ref = _slice(want[name], name, tp_rank, tp)
                torch.testing.assert_close(w, ref, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{layout} {n}: {m}")
                far = max(far, float((fresh[name] - ref).abs().max()))
            assert far > 0.2 * LR, layout  # without the saved moments the step is another one


# DP2 over gloo on the CPU; on a GPU machine (NCCL, one GPU per rank) as many ranks as it has, up to 2
OFFLOAD_LAYOUT = {"dp": 2} if not torch.cuda.is_available() or torch.cuda.device_count() >= 2 else {}


@pytest.mark.parametrize("precision_aware", [True, False])
def test_cpu_offload_steps_like_the_device_optimizer_and_resumes_exactly(tmp_path, precision_aware):
    """optim.cpu_offload: Megatron's HybridDeviceOptimizer holds the FP32 masters and AdamW
    moments of each rank's shard on the host and steps them there (CPU patch P9 makes it treat
    the model's parameters as device ones, so its host copies are distinct tensors and every
    transfer a real copy). At DP2 on a BF16 model with FP32 norms, precision-aware (TRACE's
    default: no FP32 master on the device) or not (FP32 main shards on the device, copied to the
    host): three steps give the device optimizer's weights; a run saved after two steps and
    resumed gives the uninterrupted run's third step exactly, while a fresh optimizer on the same
    weights does not (megatron-core 0.19.2 raised KeyError on FP32 parameters when loading, and
    left the host copies of FP32 main shards at their values from before the load)."""
    sd = sc.random_full_state_dict(CFG, seed=7)
    seqs = sc.make_sequences(CFG, [12, 9, 14, 7], seed=8)
    kw = dict(sd=sd, seqs=seqs, dtype=torch.bfloat16, megatron={"use_precision_aware_optimizer": precision_aware})
    device = spawn(run_resharded_resume, OFFLOAD_LAYOUT, **{**kw, "megatron": {}}, directory=str(tmp_path / "device"),
                   save=True)
    saved = spawn(run_resharded_resume, OFFLOAD_LAYOUT, **kw, directory=str(tmp_path), save=True, offload=True)
    resumed = spawn(run_resharded_resume, OFFLOAD_LAYOUT, **kw, directory=str(tmp_path), save=False, offload=True)
    for (want, _), (off, _), (got, fresh) in zip(device, saved, resumed, strict=True):
        _same_weights(off, want, "offloaded against device")
        far = 0.0
        for name, w in off.items():
            assert torch.equal(got[name], w), f"resumed {name}"
            far = max(far, float((fresh[name].float() - w.float()).abs().max()))
        assert far > 0.2 * LR  # the saved moments and masters matter


def run_offload_layout(rank):
    """What optim.cpu_offload builds: every parameter the host optimizer steps is a copy apart
    from the model's main parameter, on the host, and no FP32 master stays beside the model
    (precision-aware)."""
    from megatron_trace.config import OptimSection
    from megatron_trace.megatron.cpu_patches import PATCH_HITS
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.optimizer import TrainerOptimizer

    model = build_model(CFG, "bf16", grouped_gemm=True)
    opt = TrainerOptimizer(model, LR, OptimSection(distributed=True, cpu_offload=True))
    (inner,) = [o.optimizer for o in opt.optimizer.chained_optimizers]
    params = [p for g in inner.param_groups for p in g["params"]]
    copies = list(inner.gpu_params_map_cpu_copy.values())
    return {"optimizer": type(inner).__name__, "params": len(params), "copies": len(copies),
            "apart": all(c.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
                         for p, c in inner.gpu_params_map_cpu_copy.items()),
            "copy_devices": {c.device.type for c in copies}, "param_devices": {p.device.type for p in params},
            "device_optimizer": inner.gpu_optimizer is not None,
            "precision_aware": opt.config.use_precision_aware_optimizer, "p9": PATCH_HITS.get("p9_offload_split", 0)}


def test_cpu_offload_moves_every_shard_to_the_host_optimizer():
    """On the CPU through patch P9; on a GPU the copies are on the host and the parameters on the device."""
    (r,) = spawn(run_offload_layout, {})
    assert r["optimizer"] == "HybridDeviceOptimizer" and r["precision_aware"] and not r["device_optimizer"]
    assert r["params"] > 0 and r["copies"] == r["params"] and r["apart"]
    assert r["copy_devices"] == {"cpu"}
    if torch.cuda.is_available():
        assert r["param_devices"] == {"cuda"}
    else:
        assert r["p9"] >= 1
