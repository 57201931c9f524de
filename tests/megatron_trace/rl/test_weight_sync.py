"""The sharded weight sync (rl.weight_sync) of a disaggregated job: trainer ranks under TP / EP /
DP / PP layouts send the slices they hold, in buckets, over the bridge to an engine rank
(`RemoteEngine` / `serve_engine`), which writes them in place.

Reference for the bytes: every full tensor quantized in one process by the shared quantizer and
loaded whole (what the former rank-0 gather sent: gathering is exact, see test_collectives)."""

from __future__ import annotations

import pytest
import torch

from megatron_trace.model_config import FP4_WEIGHT_SUFFIXES, PRESETS
from tests.support import scenarios as sc
from tests.support.disaggregated import spawn_job

CFG = PRESETS["tiny"]
REQUESTS = (("g0", (1, 2, 3, 4)), ("g1", (9, 8, 7)))


def engine_bytes(engine) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every weight the engine holds, as raw tensors: FP4 codes, block scale bytes, global
    scale; or the plain tensor (its dtype included in the comparison)."""
    from trace_kernels.fp4 import QTensor

    out = {}
    for name, t in engine.weights.tensors.items():
        if isinstance(t, QTensor):
            out[name] = (t.codes.clone(), t.block_scales.view(torch.uint8).clone(), t.global_scale.clone())
        else:
            out[name] = (t.clone(),)
    return out


def reference_bytes(sd: dict, precision: str, cfg=CFG) -> dict:
    """The engine's weights after a whole-tensor update: each FP4 site quantized in one process
    (MLA's two down projections with the amax of both: one global scale, docs/design.md 3.1)."""
    from sglang_rollout.engine import EngineConfig, TraceEngine
    from trace_kernels.fp4 import quantize

    def amax(name):
        down = [n for n in sd if n.startswith(name.rsplit(".", 2)[0]) and n.endswith("_down_proj.weight")]
        return max(sd[n].abs().max() for n in down) if name.endswith("_down_proj.weight") else sd[name].abs().max()

    engine = TraceEngine(cfg, EngineConfig(precision=precision, device="cpu"))
    fp4 = precision == "fp4"
    engine.update_weights({k: quantize(v, "nvfp4", global_amax=amax(k)) if fp4 and k.endswith(FP4_WEIGHT_SUFFIXES)
                           else v for k, v in sd.items()}, 0)
    return engine_bytes(engine)


def _trainer(cfg, sd=None):
    """The Megatron trainer (rl.trainer's interface) over an FP32 model, holding `sd` if given."""
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.trainer import MegatronTrainer
    from megatron_trace.megatron.weights import load_full_state_dict

    model = build_model(cfg, "bf16", params_dtype=torch.float32, grouped_gemm=True)
    if sd is not None:
        load_full_state_dict(model, sd)
    return MegatronTrainer(model, cfg)


def _stop(bridge) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        for e in bridge.roles.engines:
            bridge.send(("stop",), e)


def _allocated_peak(fn):
    """(the most bytes torch had allocated and not yet freed, counted from 0 when fn starts, at
    any moment while fn ran; fn()): torch's allocator events as its profiler records them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, out


def _rss_growth(fn):
    """(bytes the process's peak resident memory rose above its resident memory before fn, fn()):
    the kernel's high-water mark VmHWM is reset first (/proc/self/clear_refs, 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_bytes("VmRSS")
    out = fn()
    return _status_bytes("VmHWM") - before, out


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def trainer_sync(rank, bridge, *, sd, precision, bucket_mb, cfg=CFG):
    """Sync version 0 (this rank's bytes sent), then generate through the engine: the dtypes
    routed experts arrive in, and those the trainer's micro-batch guidance widens them to."""
    from megatron_trace.megatron.context import MicroBatchGuidance
    from megatron_trace.rl.disaggregated import RemoteEngine
    from megatron_trace.rl.weight_sync import sync_weights
    from megatron_trace.rollout import GroupRequest, SamplingParams

    trainer = _trainer(cfg, sd)
    remote = RemoteEngine(bridge, precision, "none", "dense")
    sent = sync_weights(trainer, remote, 0, bucket_mb)
    out = remote.generate([GroupRequest(g, p, n=2) for g, p in REQUESTS], SamplingParams(max_new_tokens=3, seed=1))
    owners = (*out.guidance.groups.values(), *out.guidance.samples.values())
    wire = {t.dtype for o in owners for t in o.routed_experts.values()}
    used = MicroBatchGuidance.from_batch(out.guidance, list(out.guidance.samples)) if out.samples else None
    _stop(bridge)
    return {"sent": sent, "wire": wire, "used": {t.dtype for t in used.routed_experts.values()} if used else set(),
            "versions": {s.weight_version for s in out.samples}}


def engine_serve(rank, bridge, cfg=CFG, **_):
    """serve_engine with the built-in engine; returns its weights' bytes once the trainers stop."""
    from megatron_trace.rl.disaggregated import serve_engine
    from sglang_rollout.engine import EngineConfig, TraceEngine

    made = []

    def make(precision, guide, coding):
        made.append(TraceEngine(cfg, EngineConfig(precision=precision, guide=guide, coding=coding, device="cpu",
                                                  block_size=4, num_blocks=64)))
        return made[-1]
    serve_engine(bridge, make)
    return {"weights": engine_bytes(made[-1]), "version": made[-1].weight_version}


def _payload_bytes(sd: dict, precision: str) -> int:
    """Bytes of one copy of the weights as the sync packs them (no alignment, no headers)."""
    n = 0
    for name, t in sd.items():
        if precision == "fp4" and name.endswith(FP4_WEIGHT_SUFFIXES):
            n += t.numel() // 2 + t.numel() // 16 + 4
        else:
            n += t.numel() * (2 if t.dim() == 2 else 4)
    return n


@pytest.mark.parametrize("layout, precision", [({"tp": 2}, "fp4"), ({"ep": 2, "dp": 2}, "fp4"),
                                               ({"pp": 2}, "fp4"), ({"tp": 2, "ep": 2, "etp": 1}, "bf16")],
                         ids=["tp2", "ep2xdp2", "pp2", "tp2xep2-bf16"])
def test_the_engine_holds_the_bytes_of_each_full_tensor_quantized_in_one_process(layout, precision):
    """TP2 (expert TP2: fc1's gate and up slices, fc2 and proj column slices), EP2 x DP2 (dense
    weights from one data-parallel rank, experts from both), PP2, and BF16 slices under TP2 x
    EP2: codes, block scales, global scales and plain tensors equal the one-process reference
    bit for bit. Buckets of 16 KiB, so tensors are cut into several. The ranks' bytes add up
    to one packed copy of the model plus headers and alignment."""
    sd = {k: v.float() for k, v in sc.random_full_state_dict(CFG, seed=7).items()}
    *trainers, engine = spawn_job(trainer_sync, engine_serve, layout, sd=sd, precision=precision, bucket_mb=1 / 64)
    want = reference_bytes(sd, precision)
    assert engine["version"] == 0 and set(engine["weights"]) == set(want)
    for name, parts in want.items():
        got = engine["weights"][name]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, parts, strict=True)), name
    sent = [t["sent"] for t in trainers]
    payload = _payload_bytes(sd, precision)
    print(f"{layout} {precision}: bytes sent per trainer rank {sent}, packed payload {payload}")
    assert all(n > 0 for n in sent) and payload < sum(sent) < 1.2 * payload, (sent, payload)
    for t in trainers:  # routed experts travel in the smallest type, the trainer widens them
        assert t["versions"] <= {0} and t["wire"] <= {torch.uint8} and t["used"] <= {torch.int64}
    assert any(t["wire"] == {torch.uint8} and t["used"] == {torch.int64} for t in trainers)


def test_deepseek_v3_weights_arrive_as_quantized_in_one_process_under_tp2():
    """The DeepSeek-V3 family's weights (MLA projections, the dense layer, shared experts, the
    expert bias in FP32) synced from TP2 trainer ranks: the engine holds the one-process bytes,
    the two MLA down projections with the one global scale of both."""
    from megatron_trace.model_config import from_hf, full_weight_shapes
    from tests.support.hf_families import tiny_deepseek

    cfg = from_hf(tiny_deepseek(num_hidden_layers=2).to_dict())
    g = torch.Generator().manual_seed(3)
    sd = {n: (torch.randn(s, generator=g) * s[-1] ** -0.5) if len(s) == 2 else
          (0.05 * torch.randn(s, generator=g) if n.endswith("expert_bias") else 1 + 0.1 * torch.randn(s, generator=g))
          for n, s in full_weight_shapes(cfg).items()}
    *_, engine = spawn_job(trainer_sync, engine_serve, {"tp": 2}, sd=sd, precision="fp4", bucket_mb=1 / 64, cfg=cfg)
    want = reference_bytes(sd, "fp4", cfg)
    assert engine["version"] == 0 and set(engine["weights"]) == set(want)
    for name, parts in want.items():
        got = engine["weights"][name]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, parts, strict=True)), name
    a = "decoder.layers.1.self_attention."
    q, kv = want[a + "linear_q_down_proj.weight"], want[a + "linear_kv_down_proj.weight"]
    assert torch.equal(q[2], kv[2])


def trainer_memory(rank, bridge, *, cfg, bucket_mb):
    """This trainer rank's memory during a sharded sync (after a first one: one-time costs such
    as the allocator's own growth are not the sync's), then during a full gather."""
    from megatron_trace.rl.disaggregated import RemoteEngine
    from megatron_trace.rl.weight_sync import sync_weights
    from tests.support.full_gather import gather_full_state_dict

    trainer = _trainer(cfg)
    remote = RemoteEngine(bridge, "fp4", "none", "dense")
    sync_weights(trainer, remote, 0, bucket_mb)
    rss, _ = _rss_growth(lambda: sync_weights(trainer, remote, 1, bucket_mb))
    allocated, sent = _allocated_peak(lambda: sync_weights(trainer, remote, 2, bucket_mb))
    gather, _ = _allocated_peak(lambda: gather_full_state_dict(trainer.model))
    _stop(bridge)
    return {"allocated": allocated, "rss": rss, "gather": gather, "sent": sent,
            "params": sum(p.numel() * p.element_size() for p in trainer.model.parameters())}


def engine_memory(rank, bridge, *, cfg, bucket_mb):
    """The engine rank's memory while it takes each update (buckets received and written)."""
    from megatron_trace.rl.disaggregated import serve_engine
    from sglang_rollout.engine import EngineConfig, TraceEngine

    seen = []

    def make(precision, guide, coding):
        engine = TraceEngine(cfg, EngineConfig(precision=precision, device="cpu", block_size=4, num_blocks=16))
        update = engine.update_weights_from_buckets

        def measured(buckets, version):
            measure = (_allocated_peak, _rss_growth)[version % 2]  # version 1: RSS, 2: allocations
            seen.append(measure(lambda: update(buckets, version))[0])
        engine.update_weights_from_buckets = measured
        return engine
    serve_engine(bridge, make)
    return {"rss": seen[1], "allocated": seen[2]}


def test_no_rank_holds_more_than_a_bucket_beyond_its_weights():
    """Method: under TP2 with the `small` preset (28 M parameters, 112 MB in FP32; an FP4 engine)
    and 1 MiB buckets, in every process: (a) the peak of the bytes torch's allocator hands out
    during a sync, less those it takes back (the profiler's allocator events); (b) the peak
    resident memory (VmHWM, reset through /proc/self/clear_refs) above the resident memory
    before the sync. Margins: (a) a sender holds its bucket and quantizes one chunk at a time,
    whose working set is cut to under a bucket (QUANTIZE_WORK_BYTES): 2 buckets + 1 MiB; the
    engine its received bucket and one converted piece: the same bound. (b) RSS adds the C
    allocator's slack: 4 buckets + 8 MiB. The test-only full gather the sync replaced, counted
    as (a), holds the whole model on rank 0, which shows the measurement sees it."""
    cfg, bucket_mb = PRESETS["small"], 1.0
    bucket = int(bucket_mb * 2**20)
    *trainers, engine = spawn_job(trainer_memory, engine_memory, {"tp": 2}, cfg=cfg, bucket_mb=bucket_mb)
    print(f"bucket {bucket} B; sync peak allocated per trainer rank {[t['allocated'] for t in trainers]} B, engine "
          f"{engine['allocated']} B; RSS growth trainers {[t['rss'] for t in trainers]} B, engine {engine['rss']} B; "
          f"full gather on rank 0 {trainers[0]['gather']} B; sent {[t['sent'] for t in trainers]} B")
    for t in (*trainers, engine):
        assert t["allocated"] <= 2 * bucket + 2**20 and t["rss"] <= 4 * bucket + 8 * 2**20, (t, bucket)
    assert trainers[0]["gather"] > 0.8 * sum(t["params"] for t in trainers)


def trainer_torn(rank, bridge, *, sd):
    """Version 0, then version 1 with an unknown tensor in rank 1's buckets (refused: the error
    reaches every rank), then a complete version 2 and a generate from it."""
    from megatron_trace.megatron.sync import trainer_buckets
    from megatron_trace.rl.disaggregated import RemoteEngine
    from megatron_trace.rl.weight_sync import sync_weights
    from megatron_trace.rollout import GroupRequest, SamplingParams
    from megatron_trace.weight_buckets import state_dict_buckets

    trainer = _trainer(CFG, sd)
    remote = RemoteEngine(bridge, "fp4", "none", "dense")
    sync_weights(trainer, remote, 0, 1 / 64)
    buckets = trainer_buckets(trainer.model, True, 2**14)  # collective: on every rank
    if rank == 1:
        buckets = state_dict_buckets({"decoder.layers.9.bogus.weight": torch.zeros(4, 16)}, 2**14)
    try:
        remote.update_weights_from_buckets(buckets, 1)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    sync_weights(trainer, remote, 2, 1 / 64)
    out = remote.generate([GroupRequest(g, p, n=1) for g, p in REQUESTS], SamplingParams(max_new_tokens=2))
    if rank == 1:  # a NaN in an expert only this rank holds: every rank stops before sending
        name = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"
        dict(trainer.model.named_parameters())[name].data[0, 0] = float("nan")
    try:
        sync_weights(trainer, remote, 3, 1 / 64)
        nan = None
    except ValueError as e:
        nan = str(e)
    _stop(bridge)
    return {"refused": refused, "versions": {s.weight_version for s in out.samples}, "nan": nan}


def test_a_refused_update_reaches_every_trainer_rank_and_a_complete_one_recovers():
    """Under EP2 x DP2: an unknown tensor in rank 1's buckets (rank 0's are written first) is
    refused by the engine and the error raised on both ranks; the next complete version
    generates. A NaN in an expert that only rank 1 holds stops both ranks before any send."""
    sd = {k: v.float() for k, v in sc.random_full_state_dict(CFG, seed=8).items()}
    *trainers, engine = spawn_job(trainer_torn, engine_serve, {"ep": 2, "dp": 2}, sd=sd)
    for t in trainers:
        assert "refused weights version 1" in t["refused"] and "decoder.layers.9.bogus.weight" in t["refused"]
        assert "1 FP4 weights hold NaN or Inf, e.g. ['decoder.layers.0.mlp.experts.local_experts.3.linear_fc2" \
            in t["nan"]
    assert engine["version"] == 2 and {v for t in trainers for v in t["versions"]} == {2}
