"""One colocated RL step per precision mode, with the real engine and Megatron trainer."""

import math

import torch

from megatron_trace.megatron.spawn import spawn


def reward_low_ids(prompt, response):
    return sum(t < 128 for t in response) / max(len(response), 1)


def run_steps(rank, *, precision, correction):
    from megatron_trace.megatron.model import build_model
    from megatron_trace.model_config import PRESETS
    from megatron_trace.rl.losses import grpo_advantages
    from megatron_trace.rl.step import (
        StepConfig,
        response_logprobs,
        rollout,
        sync_weights,
        train_on,
    )
    from megatron_trace.rollout import SamplingParams
    from sglang_rollout.engine import EngineConfig, TraceEngine

    cfg = PRESETS["tiny"]
    trainer = build_model(cfg, "bf16", grouped_gemm=True)
    engine = TraceEngine(cfg, EngineConfig(precision="bf16" if precision == "bf16" else "fp4",
                                           guide="all" if precision == "trace" else "none"))
    sync_weights(trainer, engine, 0)
    step_cfg = StepConfig(precision=precision, group_size=4, correction=correction)
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.05)
    prompts = [(1, 2, 3, 4), (9, 8, 7)]
    batch = rollout(engine, prompts, reward_low_ids, step_cfg, SamplingParams(max_new_tokens=8, seed=1), 0)
    adv = grpo_advantages(batch.rewards, 4)

    def objective():  # token-mean of A * log p over the batch: what the step ascends
        with torch.no_grad():
            logp, sample_of, _ = response_logprobs(trainer, batch, step_cfg)
        return float((adv[sample_of.cpu()] * logp.cpu()).mean())

    before = objective()
    metrics = train_on(trainer, optimizer, batch, step_cfg)
    after = objective()
    sync_weights(trainer, engine, 1)
    again = engine.generate([], SamplingParams())  # engine still healthy after the update
    return {"before": before, "after": after, "metrics": metrics, "version": engine.weight_version,
            "empty": len(again.samples)}


def test_a_step_in_each_precision_mode_ascends_the_policy_objective():
    for precision, correction in (("bf16", "none"), ("fp4-qat", "tis"), ("trace", "mis")):
        r = spawn(run_steps, {}, precision=precision, correction=correction)[0]
        m = r["metrics"]
        assert all(math.isfinite(v) for v in (m["loss"], m["reward"], m["k3_kl"])), (precision, m)
        assert r["after"] > r["before"], (precision, r["before"], r["after"])
        assert r["version"] == 1 and r["empty"] == 0 and m["guidance_bytes_per_token"] > 0
        if precision == "trace":  # the trainer's first forward follows the engine's codes exactly
            assert m["k3_kl"] < 1e-9 and m["kept_frac"] == 1.0
