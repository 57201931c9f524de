"""One colocated RL step per run mode, with the real engine and Megatron trainer."""

import math

import pytest
import torch

from megatron_trace.megatron.spawn import spawn
from megatron_trace.model_config import PRESETS
from tests.support import scenarios as sc


def sgd(model, lr):
    """The Megatron trainer over `model` with Megatron's optimizer as plain SGD (optim.megatron
    passes the choice through): an update linear in the gradients, so that micro-batching and
    layouts compare closely."""
    from megatron_trace.config import OptimSection
    from megatron_trace.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(model, PRESETS["tiny"], OptimSection(
        clip_grad=0.0, lr_warmup_steps=0, distributed=False,  # Megatron shards Adam only
        megatron={"optimizer": "sgd", "sgd_momentum": 0.0}))
    trainer.start_phase(lr)
    return trainer


def reward_low_ids(prompt, response):
    return sum(t < 128 for t in response) / max(len(response), 1)


def run_steps(rank, *, precision, correction):
    from megatron_trace.config import RLSection
    from megatron_trace.megatron.model import build_model
    from megatron_trace.model_config import PRESETS
    from megatron_trace.rl.losses import grpo_advantages
    from megatron_trace.rl.rollout_batch import rollout
    from megatron_trace.rl.step import response_logprobs, train_on
    from megatron_trace.rl.weight_sync import sync_weights
    from megatron_trace.rollout import SamplingParams
    from sglang_rollout.engine import EngineConfig, TraceEngine

    cfg = PRESETS["tiny"]
    trainer = sgd(build_model(cfg, "bf16", grouped_gemm=True), 0.05)
    engine = TraceEngine(cfg, EngineConfig(precision="bf16" if precision == "bf16" else "fp4",
                                           guide="all" if precision == "trace" else "none"))
    sync_weights(trainer, engine, 0)
    rl = RLSection(mode=precision, group_size=4, correction=correction)
    prompts = [(1, 2, 3, 4), (9, 8, 7)]
    batch = rollout(engine, prompts, reward_low_ids, rl.group_size, SamplingParams(max_new_tokens=8, seed=1), 0)
    adv = grpo_advantages(batch.rewards, 4)

    def objective():  # token-mean of A * log p over the batch: what the step ascends
        with torch.no_grad():
            logp, sample_of, _ = response_logprobs(trainer, batch, rl)
        return float((adv[sample_of.cpu()] * logp.cpu()).mean())

    before = objective()
    metrics = train_on(trainer, batch, rl)
    after = objective()
    sync_weights(trainer, engine, 1)
    again = engine.generate([], SamplingParams())  # engine still healthy after the update
    return {"before": before, "after": after, "metrics": metrics, "version": engine.weight_version,
            "empty": len(again.samples)}


def test_a_step_in_each_run_mode_ascends_the_policy_objective():
    for precision, correction in (("bf16", "none"), ("fp4-qat", "tis"), ("trace", "mis")):
        r = spawn(run_steps, {}, precision=precision, correction=correction)[0]
        m = r["metrics"]
        assert all(math.isfinite(v) for v in (m["loss"], m["reward"], m["k3_kl"])), (precision, m)
        assert r["after"] > r["before"], (precision, r["before"], r["after"])
        assert r["version"] == 1 and r["empty"] == 0 and m["guidance_bytes_per_token"] > 0
        if precision == "trace":  # the trainer's first forward follows the engine's codes exactly
            assert m["k3_kl"] < 1e-9 and m["kept_frac"] == 1.0


def run_dynamic_and_kl(rank):
    from megatron_trace.config import RLSection
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.trainer import MegatronTrainer
    from megatron_trace.megatron.weights import load_full_state_dict
    from megatron_trace.model_config import PRESETS
    from megatron_trace.rl.step import rl_step
    from megatron_trace.rl.weight_sync import sync_weights
    from megatron_trace.rollout import SamplingParams
    from sglang_rollout.engine import EngineConfig, TraceEngine

    cfg = PRESETS["tiny"]
    trainer = sgd(build_model(cfg, "bf16", grouped_gemm=True), 0.05)
    reference = build_model(cfg, "bf16", grouped_gemm=True)
    load_full_state_dict(reference, {k: v for k, v in trainer.model.state_dict().items()
                                     if not k.endswith("_extra_state")})
    reference = MegatronTrainer(reference, cfg)
    engine = TraceEngine(cfg, EngineConfig(precision="bf16"))
    sync_weights(trainer, engine, 0)
    sampling = SamplingParams(max_new_tokens=8, seed=1)

    def reward(prompt, response):  # prompts starting with 1 always score 0: no signal in their group
        return 0.0 if prompt[0] == 1 else reward_low_ids(prompt, response)

    asked = []

    def more_prompts(n):
        asked.append(n)
        return [(1, 5), (7, 7, 7)][:n]

    dyn = RLSection(mode="bf16", dynamic_sampling=True, max_rounds=3, kl_coef=0.1,
                    mini_batches=1)  # one update: the step's KL is the policy's before it moves
    first = rl_step(trainer, engine, [(1, 2, 3, 4), (9, 8, 7)], reward, dyn, sampling, 0,
                    more_prompts=more_prompts, reference=reference)
    second = rl_step(trainer, engine, [(6, 5), (9, 9)], reward, dyn, sampling, 1,
                     more_prompts=more_prompts, reference=reference)
    none = rl_step(trainer, engine, [(1, 2), (1, 3)], reward, dyn, sampling, 2, reference=reference)
    return first, second, none, asked


def test_dynamic_sampling_refills_informative_groups_and_the_kl_penalty_starts_at_zero():
    first, second, none, asked = spawn(run_dynamic_and_kl, {})[0]
    # round 1 leaves one informative group of two; round 2 brings (7, 7, 7)'s group
    assert first["rollout_rounds"] == 2 and first["trained_groups"] == 2 and asked[0] == 2
    assert first["kl_ref"] == 0.0  # the policy still equals its reference
    assert second["rollout_rounds"] == 1 and second["trained_groups"] == 2
    assert second["kl_ref"] > 0 and math.isfinite(second["loss"])
    assert none["skipped"] == 1.0 and none["trained_groups"] == 0 and none["reward"] == 0.0  # no refill source


def run_microbatched_update(rank, *, sd, max_tokens, correction, threshold):
    """The full weights after one GRPO update of the data-parallel share of a fixed rollout,
    with the trainer's micro-batches capped at `max_tokens` (0: one micro-batch per rank)."""
    from megatron.core import parallel_state as ps

    from megatron_trace.config import RLSection
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.weights import load_full_state_dict
    from megatron_trace.model_config import PRESETS
    from megatron_trace.rl.disaggregated import dp_share
    from megatron_trace.rl.rollout_batch import rollout
    from megatron_trace.rl.step import train_on
    from megatron_trace.rollout import SamplingParams
    from sglang_rollout.engine import EngineConfig, TraceEngine
    from tests.support.full_gather import gather_full_state_dict

    cfg = PRESETS["tiny"]
    trainer = build_model(cfg, "bf16", params_dtype=torch.float32, grouped_gemm=True)
    load_full_state_dict(trainer, sd)
    engine = TraceEngine(cfg, EngineConfig(precision="fp4", guide="all"))
    engine.update_weights(sd, 0)
    rl = RLSection(mode="trace", group_size=3, correction=correction, correction_threshold=threshold,
                   max_tokens_per_microbatch=max_tokens, mini_batches=1)  # micro-batches of one update
    batch = rollout(engine, [(1, 2, 3, 4), (9, 8, 7), (5, 6), (7, 7, 7), (3, 3)], reward_low_ids, rl.group_size,
                    SamplingParams(max_new_tokens=8, seed=2), 0)
    mine = batch.select(list(dp_share(batch.num_groups, ps.get_data_parallel_rank(),
                                      ps.get_data_parallel_world_size())))
    metrics = train_on(sgd(trainer, 0.5), mine, rl)
    return gather_full_state_dict(trainer), metrics


def test_microbatches_accumulate_to_the_one_batch_update():
    """Micro-batches of at most 12 tokens (one sample each; under EP2 x DP2 the rank with 2 groups
    runs 3 fillers to match its peer's 9) give the update of one micro-batch, in one process, with
    two pipeline stages (1F1B, varying lengths) and under EP2 x DP2; MIS rejects samples, so the
    token mean over the kept tokens needs the rescale."""
    sd = {k: v.float() for k, v in sc.random_full_state_dict(PRESETS["tiny"], seed=5).items()}
    for layout in ({}, {"pp": 2}, {"ep": 2, "dp": 2}):
        whole, m1 = spawn(run_microbatched_update, layout, sd=sd, max_tokens=0, correction="mis", threshold=1.02)[0]
        split, m2 = spawn(run_microbatched_update, layout, sd=sd, max_tokens=12, correction="mis", threshold=1.02)[0]
        assert m1["microbatches"] == 1 and m2["microbatches"] == (9 if layout.get("dp") else 15), layout
        assert 0 < m1["kept_frac"] < 1 and m1["kept_frac"] == m2["kept_frac"], layout
        for k in ("loss", "clip_frac", "k3_kl"):
            assert abs(m1[k] - m2[k]) <= 1e-5 * (1 + abs(m1[k])), (layout, k, m1[k], m2[k])
        moved = 0
        for name, w in whole.items():
            torch.testing.assert_close(split[name], w, rtol=1e-5, atol=1e-6, msg=f"{layout} {name}")
            moved += int(not torch.equal(w, sd[name]))
        assert moved > len(sd) // 2  # the update did something


def run_against_master_adamw(rank):
    from megatron_trace.config import OptimSection, RLSection
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.trainer import MegatronTrainer
    from megatron_trace.rl.rollout_batch import rollout
    from megatron_trace.rl.step import train_on
    from megatron_trace.rollout import SamplingParams
    from sglang_rollout.engine import EngineConfig, TraceEngine
    from tests.support.master_adamw import MasterAdamW

    cfg = PRESETS["tiny"]
    sd = sc.random_full_state_dict(cfg, seed=11)
    ours, theirs = build_model(cfg, "bf16", grouped_gemm=True), build_model(cfg, "bf16", grouped_gemm=True)
    for m in (ours, theirs):
        m.load_state_dict(sd, strict=False)
    engine = TraceEngine(cfg, EngineConfig(precision="fp4", guide="all"))
    engine.update_weights(sd, 0)
    rl = RLSection(mode="trace", group_size=4, correction="mis", correction_threshold=1.05)
    mine = MegatronTrainer(ours, cfg, OptimSection(clip_grad=0.0, lr_warmup_steps=0))
    mine.start_phase(1e-3)
    trainers = (mine, MegatronTrainer(theirs, cfg, optimizer=MasterAdamW(theirs, 1e-3)))
    kept = []
    for step in range(3):  # new rollouts of the same (first) weights: the same batches for both
        batch = rollout(engine, [(1, 2, 3, 4), (9, 8, 7), (5, 6)], reward_low_ids, rl.group_size,
                        SamplingParams(max_new_tokens=8, seed=step), step)
        metrics = [train_on(t, batch, rl) for t in trainers]
        kept.append(metrics[0]["kept_frac"])
        assert metrics[0]["loss"] == metrics[1]["loss"], step
    moved = sum(not torch.equal(p.float(), sd[n].float()) for n, p in ours.state_dict().items() if n in sd)
    return {n: (p, theirs.state_dict()[n]) for n, p in ours.state_dict().items() if n in sd}, kept, moved


def test_megatrons_optimizer_steps_as_the_one_it_replaced():
    """Three RL steps (trace mode, MIS rejecting samples) with Megatron's distributed optimizer
    against the replaced FP32-master AdamW on the same batches, in one process: the same losses
    and the same BF16 weights bit for bit."""
    pairs, kept, moved = spawn(run_against_master_adamw, {})[0]
    assert moved > len(pairs) // 2 and any(k < 1 for k in kept)
    for name, (ours, theirs) in pairs.items():
        assert torch.equal(ours, theirs), name


def verl_token_loss64(logp, old, adv, cl=0.2, ch=0.28, c=3.0):
    """verl's vanilla PPO loss per token in float64 (clip-higher, dual-clip for A < 0, the +-20 clamp)."""
    ratio = (logp - old).clamp(-20, 20).exp()
    clip1 = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - cl, 1 + ch))
    return torch.where(adv < 0, torch.minimum(clip1, -adv * c), clip1)


def run_mini_batches(rank, *, sd, mini_batches, epochs, mode):
    """train_on with `mini_batches` x `epochs` updates, and the same updates re-derived: the old
    log-probs from a forward before any update, groups split in halves, each mini-batch's loss
    the float64 token mean of verl's per-token loss, one SGD step each. Returns both models'
    weight changes and train_on's metrics."""
    from megatron_trace.config import RLSection
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.schedule import run_microbatches
    from megatron_trace.megatron.weights import load_full_state_dict
    from megatron_trace.rl.losses import grpo_advantages
    from megatron_trace.rl.packing import microbatches
    from megatron_trace.rl.rollout_batch import rollout
    from megatron_trace.rl.step import response_logprobs, train_on
    from megatron_trace.rollout import SamplingParams
    from sglang_rollout.engine import EngineConfig, TraceEngine

    cfg = PRESETS["tiny"]
    # FP32 weights keep the comparison free of BF16 rounding; trace mode needs the engine's BF16 ones
    dtype = torch.bfloat16 if mode == "trace" else torch.float32
    models = [build_model(cfg, "bf16", params_dtype=dtype, grouped_gemm=True) for _ in range(2)]
    for m in models:
        load_full_state_dict(m, sd)
    engine = TraceEngine(cfg, EngineConfig(precision="bf16" if mode == "bf16" else "fp4",
                                           guide="all" if mode == "trace" else "none"))
    engine.update_weights(sd, 0)
    rl = RLSection(mode=mode, group_size=4, mini_batches=mini_batches, epochs=epochs)
    batch = rollout(engine, [(1, 2, 3, 4), (9, 8, 7), (5, 6), (7, 7, 7)], reward_low_ids, rl.group_size,
                    SamplingParams(max_new_tokens=8, seed=4), 0)
    ours, theirs = models
    metrics = train_on(sgd(ours, 2.0), batch, rl)

    opt = sgd(theirs, 2.0)
    adv = grpo_advantages(batch.rewards, rl.group_size).double()
    logp, sample_of, _ = response_logprobs(opt, batch, rl)
    old = [logp[sample_of == i].double().cpu() for i in range(len(batch.out.samples))]
    halves = [list(range(batch.num_groups))] if mini_batches == 1 else [[0, 1], [2, 3]]
    for _ in range(epochs):
        for groups in halves:
            idx = [g * 4 + j for g in groups for j in range(4)]
            sub = batch.select(groups)
            mbs = microbatches(opt, sub, 0, records=rl.mode.applies_guidance)
            n_tokens = sum(len(s.tokens) for s in sub.out.samples)

            def loss_fn(i, lp, mbs=mbs, idx=idx, n_tokens=n_tokens):
                p = mbs[i]
                k = p.sample_of.cpu()
                o = torch.cat([old[idx[j]] for j in torch.unique_consecutive(k).tolist()])
                per = verl_token_loss64(lp[p.index].double(), o, adv[torch.tensor(idx)[k]])
                return per.sum() / n_tokens, {}

            opt.zero_grad()
            run_microbatches(opt.optimizer.ddp, [p.batch for p in mbs], loss_fn)
            opt.step()
    deltas = {n: (ours.state_dict()[n].float() - sd[n], theirs.state_dict()[n].float() - sd[n]) for n in sd}
    return deltas, metrics


@pytest.mark.parametrize("mini_batches, epochs", [(1, 1), (2, 2)])
def test_mini_batch_updates_follow_the_ppo_objective_re_derived_in_float64(mini_batches, epochs):
    """Two mini-batches over two epochs (four SGD steps from one rollout: ratios move, clipping
    acts) and the one-update step, against the same updates re-derived in float64."""
    sd = {k: v.float() for k, v in sc.random_full_state_dict(PRESETS["tiny"], seed=6).items()}
    deltas, m = spawn(run_mini_batches, {}, sd=sd, mini_batches=mini_batches, epochs=epochs, mode="bf16")[0]
    assert m["updates"] == mini_batches * epochs
    num = sum(float((a - b).square().sum()) for a, b in deltas.values()) ** 0.5
    den = sum(float(b.square().sum()) for _, b in deltas.values()) ** 0.5
    assert den > 0 and num <= 1e-4 * den, (num, den)
    if epochs == 1:
        assert m["clip_frac"] == 0 and m["ppo_kl"] == 0  # one update: the ratios are all 1
    else:
        assert m["clip_frac"] > 0.05 and m["ppo_kl"] != 0, m  # later updates see a moved policy


def test_trace_mode_old_log_probs_follow_the_engine_with_several_updates():
    """The extra forward that gives the old log-probs is guided: it reproduces the engine's FP4
    rounding exactly, so the mismatch is nil and no code disagrees with the engine's."""
    sd = {k: v.float() for k, v in sc.random_full_state_dict(PRESETS["tiny"], seed=7).items()}
    _, m = spawn(run_mini_batches, {}, sd=sd, mini_batches=2, epochs=1, mode="trace")[0]
    assert m["updates"] == 2 and m["k3_kl"] < 1e-9 and m["residual_flip_rate"] == 0 and m["flip_rate"] > 0
