"""One colocated RL step (DESIGN.md section 5): rollout, rewards, GRPO advantages, the trainer's
(guided) forward, rollout correction, policy loss, optimizer step, weight sync.

The trainer is a one-process TraceGPTModel; the engine any RolloutBackend. Each step is
on-policy: the trainer's log-probs before the update are the PPO "old" log-probs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from trace_kernels.fp4 import quantize

from ..megatron import qat
from ..megatron.context import MicroBatchGuidance
from ..megatron.model import pack_sequences, set_precision, token_logprobs
from ..model_config import FP4_WEIGHT_SUFFIXES
from ..rollout import GroupRequest, RolloutOutput, SamplingParams
from .losses import grpo_advantages, policy_loss, rollout_correction
from .metrics import mismatch_metrics
from .mismatch import TRAINER_PRECISION, FlipCounter


@dataclass(frozen=True)
class StepConfig:
    """precision: bf16, fp4 (rollout only), fp4-qat or trace. group_size: samples per prompt.
    clip_low / clip_high: PPO clip range (clip_high > clip_low is DAPO's clip-higher).
    correction: none, tis or mis (see losses.rollout_correction), with `correction_threshold`."""

    precision: str = "trace"
    group_size: int = 4
    clip_low: float = 0.2
    clip_high: float = 0.28
    correction: str = "none"
    correction_threshold: float = 2.0


def sync_weights(trainer, engine, version: int) -> int:
    """Send the trainer's weights to the engine as `version`: FP4 sites packed with the shared
    quantizer when the engine runs FP4 (codes + scales), BF16 otherwise. Returns bytes sent."""
    fp4 = getattr(getattr(engine, "config", None), "precision", "bf16") == "fp4"
    sd, nbytes = {}, 0
    for name, t in trainer.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        t = t.detach()
        if fp4 and name.endswith(FP4_WEIGHT_SUFFIXES):
            q = quantize(t, "nvfp4")
            sd[name], nbytes = q, nbytes + q.codes.numel() + q.block_scales.numel() + 4
        else:
            sd[name], nbytes = t, nbytes + t.numel() * t.element_size()
    engine.update_weights(sd, version)
    return nbytes


def rl_step(trainer, optimizer, engine, prompts: list[tuple[int, ...]], reward_fn, cfg: StepConfig,
            sampling: SamplingParams, step: int) -> dict:
    """Rollout, train on it, sync the new weights; returns the step's metrics."""
    t0 = time.perf_counter()
    batch = rollout(engine, prompts, reward_fn, cfg, sampling, step)
    t1 = time.perf_counter()
    metrics = train_on(trainer, optimizer, batch, cfg)
    t2 = time.perf_counter()
    metrics["weight_sync_bytes"] = sync_weights(trainer, engine, engine.weight_version + 1)
    t3 = time.perf_counter()
    tokens = sum(len(s.tokens) for s in batch.out.samples)
    return {"step": step, **metrics, "response_tokens": tokens, "rollout_tokens_per_s": tokens / (t1 - t0),
            "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2}


@dataclass
class RolloutBatch:
    """A rollout with its prompts (by group id) and rewards (float [N], sample order)."""

    out: RolloutOutput
    prompts: dict[str, tuple[int, ...]]
    rewards: torch.Tensor


def rollout(engine, prompts, reward_fn, cfg: StepConfig, sampling: SamplingParams, step: int) -> RolloutBatch:
    """`group_size` samples of each prompt, rewarded by reward_fn(prompt_ids, response_ids) -> float."""
    requests = [GroupRequest(f"s{step}-p{i}", tuple(p), cfg.group_size) for i, p in enumerate(prompts)]
    out = engine.generate(requests, sampling)
    failed = [s.error for s in out.samples if s.error]
    if failed:
        raise ValueError(f"rollout failed: {failed[0]}")
    by_group = {r.group_id: r.prompt_ids for r in requests}
    rewards = torch.tensor([float(reward_fn(by_group[s.group_id], s.tokens)) for s in out.samples])
    return RolloutBatch(out, by_group, rewards)


def response_logprobs(trainer, batch: RolloutBatch, cfg: StepConfig, observer=None):
    """The trainer's log-probs of every response token (with gradient), the sample of each
    token, and the rollout's log-probs: ([T], int64 [T], [T]). `observer(full_guidance)`, if
    given, makes a qat observer that watches the forward (e.g. a FlipCounter)."""
    dev, out = next(trainer.parameters()).device, batch.out
    seqs = [torch.tensor(list(batch.prompts[s.group_id]) + s.tokens) for s in out.samples]
    tokens, positions, psp = pack_sequences(seqs, dev)
    full = MicroBatchGuidance.from_batch(out.guidance, [s.sample_id for s in out.samples])
    guidance = full if cfg.precision == "trace" else MicroBatchGuidance(full.num_tokens,
                                                                        routed_experts=full.routed_experts)
    set_precision(trainer, TRAINER_PRECISION[cfg.precision])
    if observer is not None:
        qat.observers.append(observer(full))
    try:
        lp = token_logprobs(trainer, tokens, positions, torch.roll(tokens, -1, 1), packed_seq_params=psp,
                            guidance=guidance.to(dev)).reshape(-1)
    finally:
        qat.observers.clear()
    index, sample_of, offset = [], [], 0  # a response token's log-prob sits at the position before it
    for i, (s, q) in enumerate(zip(out.samples, seqs, strict=True)):
        index += range(offset + s.prompt_len - 1, offset + len(q) - 1)
        sample_of += [i] * len(s.tokens)
        offset += len(q)
    index, sample_of = torch.tensor(index, device=dev), torch.tensor(sample_of, device=dev)
    return lp[index], sample_of, torch.cat([s.logprobs for s in out.samples]).to(dev)


def train_on(trainer, optimizer, batch: RolloutBatch, cfg: StepConfig) -> dict:
    """GRPO update on one rollout; returns reward, loss, clip/kept fractions and the mismatch."""
    out, rewards = batch.out, batch.rewards
    adv = grpo_advantages(rewards, cfg.group_size)
    counters = []

    def observe(full):  # flip rates wherever the engine sent dense guidance (measured or applied)
        counters.append(FlipCounter(full.to(next(trainer.parameters()).device)))
        return counters[-1]
    fp4_trainer = TRAINER_PRECISION[cfg.precision] != "bf16"
    logp, sample_of, logp_rollout = response_logprobs(trainer, batch, cfg, observe if fp4_trainer else None)
    weights, keep = rollout_correction(logp.detach(), logp_rollout, sample_of, cfg.correction,
                                      cfg.correction_threshold)
    loss, info = policy_loss(logp, logp.detach(), adv.to(logp.device)[sample_of], clip_low=cfg.clip_low,
                             clip_high=cfg.clip_high, weights=weights.to(logp.dtype), keep=keep)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    per_sample = [logp.detach()[sample_of == i].cpu() for i in range(len(out.samples))]
    flips = counters[0].rates() if counters else {}
    if flips and cfg.precision != "trace":  # nothing applied: the codes are the trainer's own
        flips = {k: v for k, v in flips.items() if not k.startswith("residual")}
    return {"reward": float(rewards.mean()), "loss": float(loss.detach()), **info, **flips,
            "guidance_bytes_per_token": out.guidance.bytes_per_token() if cfg.precision == "trace" else 0.0,
            **mismatch_metrics(per_sample, [s.logprobs for s in out.samples])}
