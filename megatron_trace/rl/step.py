"""One RL step (docs/design.md section 5): rollout, rewards, GRPO advantages, the trainer's
(guided) forward, rollout correction, policy loss, optimizer step, weight sync.

The trainer is this rank's TraceGPTModel under any Megatron layout (one process when colocated;
called on every trainer rank under torchrun); the engine any RolloutBackend (a `RemoteEngine`
under torchrun). The step's settings are the `rl` section of the run's configuration. Each step
is on-policy: the trainer's log-probs before the update are the PPO "old" log-probs.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ..config import DistSection, RLSection
from ..guidance import GuidanceBatch
from ..megatron import qat
from ..megatron.model import set_precision
from ..megatron.schedule import run_microbatches
from ..modes import RunMode
from ..rollout import SamplingParams
from .losses import grpo_advantages, kl_penalty, policy_loss, rollout_correction
from .metrics import mismatch_metrics
from .mismatch import FlipCounter
from .packing import microbatches
from .ranks import all_ranks, distributed_trainer
from .rollout_batch import RolloutBatch, rollout
from .weight_sync import sync_weights


def rl_step(trainer, optimizer, engine, prompts: list[tuple[int, ...]], reward_fn, rl: RLSection,
            sampling: SamplingParams, step: int, more_prompts=None, reference=None,
            sync_bucket_mb: float = DistSection.sync_bucket_mb) -> dict:
    """Rollout, train on it, sync the new weights (in buckets of at most sync_bucket_mb MiB);
    returns the step's metrics (weight_sync_bytes: the bytes this rank sent).

    more_prompts(n) -> n further prompts: refills with dynamic sampling (else the step trains on
    the informative groups of its first round). reference: the frozen model of the KL penalty."""
    t0 = time.perf_counter()
    batch = rollout(engine, prompts, reward_fn, rl.group_size, sampling, step)
    sampled = [batch]
    first = batch
    if rl.dynamic_sampling:
        target = batch.num_groups
        batch = batch.informative()
        for r in range(1, rl.max_rounds):
            # across trainer ranks the rounds are collective: another round while any rank lacks groups
            if more_prompts is None or all_ranks(batch.num_groups >= target):
                break
            extra = rollout(engine, more_prompts(len(prompts)), reward_fn, rl.group_size, sampling, step, tag=f"r{r}")
            sampled.append(extra)
            batch = batch.merge(extra.informative())
        batch = batch.first_groups(target)
    t1 = time.perf_counter()
    trained = batch.num_groups
    if not trained and distributed_trainer():  # the other ranks' collectives need this rank's forward and
        batch = first.select([0])  # backward: a group of equal rewards has zero advantage, no gradient
    metrics = train_on(trainer, optimizer, batch, rl, reference) if batch.num_groups else {"skipped": 1.0}
    t2 = time.perf_counter()
    metrics["weight_sync_bytes"] = sync_weights(trainer, engine, engine.weight_version + 1, sync_bucket_mb)
    t3 = time.perf_counter()
    every = torch.cat([b.rewards for b in sampled])
    tokens = sum(len(s.tokens) for b in sampled for s in b.out.samples)
    metrics["reward"] = float(every.mean())  # over everything sampled, filtered or not
    if rl.dynamic_sampling:
        metrics |= {"rollout_rounds": len(sampled), "trained_groups": trained}
    return {"step": step, **metrics, "response_tokens": tokens, "rollout_tokens_per_s": tokens / (t1 - t0),
            "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2}


def response_logprobs(trainer, batch: RolloutBatch, rl: RLSection, observer=None):
    """The trainer's log-probs of every response token, the sample of each token, and the
    rollout's log-probs: ([R], int64 [R], [R]) in sample order, on every pipeline stage; no
    gradient. `observer`, if given, is a qat observer that watches the forwards, which then
    carry every record the rollout has (a FlipCounter() reads them as the active guidance)."""
    mbs = microbatches(trainer, batch, rl.max_tokens_per_microbatch,
                       records=rl.mode.applies_guidance or observer is not None)
    set_precision(trainer, rl.mode.trainer_precision)
    if observer is not None:
        qat.observers.append(observer)
    try:
        with torch.no_grad():
            infos = run_microbatches(trainer, [p.batch for p in mbs],
                                     lambda i, lp: (lp.sum(), {"logp": lp[mbs[i].index].cpu()}), forward_only=True)
    finally:
        qat.observers.clear()
    real = [(p, info) for p, info in zip(mbs, infos, strict=True) if p.weight]
    dev = mbs[0].index.device
    return (torch.cat([info["logp"] for _, info in real]).to(dev), torch.cat([p.sample_of for p, _ in real]),
            torch.cat([p.logp_rollout for p, _ in real]))


def _billed_bytes_per_token(g: GuidanceBatch, applied: bool) -> float:
    """Bytes per token the trainer needs: routed experts, plus the records when it applies them
    (records captured only to measure flips are not billed)."""
    return (g.nbytes if applied else g.nbytes - g.guidance_nbytes) / max(1, g.num_tokens)


def _dp_sum(values: list[float]) -> list[float]:
    """`values` summed over the data-parallel ranks (as they are in one process)."""
    if ps.get_data_parallel_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return t.tolist()


def train_on(trainer, optimizer, batch: RolloutBatch, rl: RLSection, reference=None) -> dict:
    """GRPO update on one rollout, under any trainer layout, in micro-batches of at most
    rl.max_tokens_per_microbatch tokens (gradients accumulate; the loss is the token mean over
    the whole rollout, over every data-parallel rank's share); `optimizer` is the trainer's
    `megatron.optimizer.TrainerOptimizer`. Returns reward, loss, the gradient norm before
    clipping, clip/kept fractions, the mismatch and flip rates (summed over trainer ranks). With
    rl.kl_coef > 0 the loss adds kl_coef times the token-mean KL estimate to `reference` (a
    frozen model of the same architecture, quantized like the policy's forward)."""
    out, rewards = batch.out, batch.rewards
    adv = grpo_advantages(rewards, rl.group_size)
    counting = rl.mode.trainer_precision.quantizes  # flips of the records the rollout has
    mbs = microbatches(trainer, batch, rl.max_tokens_per_microbatch, records=rl.mode.applies_guidance or counting)
    lengths = [len(s.tokens) for s in out.samples]
    start = [sum(lengths[:i]) for i in range(len(lengths))]  # of each sample's tokens in sample order
    tokens = sum(lengths)
    # the loss is the token mean over every data-parallel rank's kept tokens: each rank sums its
    # own over (global tokens / DP), DDP averages over DP, and the reduced gradients are rescaled
    # by global tokens / global kept tokens once the kept ones are known
    dp_tokens = _dp_sum([tokens])[0]
    normalizer = dp_tokens / ps.get_data_parallel_world_size()
    logp_ref = None
    if rl.kl_coef:
        if reference is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        # the reference quantizes like the policy (round to nearest: the engine's records are the policy's)
        ref_mode = RunMode.FP4_QAT if counting else RunMode.BF16
        logp_ref, _, _ = response_logprobs(reference, batch, dataclasses.replace(rl, mode=ref_mode))

    def loss_fn(i, lp):  # on the last pipeline stage
        p = mbs[i]
        logp = lp[p.index]
        weights, keep = rollout_correction(logp.detach(), p.logp_rollout, p.sample_of, rl.correction,
                                          rl.correction_threshold)
        loss, info = policy_loss(logp, logp.detach(), adv.to(logp.device)[p.sample_of], clip_low=rl.clip_low,
                                 clip_high=rl.clip_high, weights=weights.to(logp.dtype), keep=keep,
                                 normalizer=normalizer)
        info["loss_sum"] = float(loss.detach()) * normalizer
        if logp_ref is not None:
            first = start[int(p.sample_of[0])]
            kl = kl_penalty(logp, logp_ref[first: first + len(p.index)].to(logp.device), rl.kl_kind)
            kl_sum = (kl * keep.to(kl.dtype)).sum()
            loss = loss + rl.kl_coef * kl_sum / normalizer
            info["kl_sum"] = float(kl_sum.detach())
            info["loss_sum"] += rl.kl_coef * info["kl_sum"]
        return loss * p.weight, {**info, "logp": logp.detach().cpu()}

    # every rank counts its own rows and columns (token, head and column shards, dispatched
    # expert rows, its pipeline stage's layers, its data-parallel samples); rates() sums them
    counter = FlipCounter() if counting else None
    if counter is not None:
        qat.observers.append(counter)
    set_precision(trainer, rl.mode.trainer_precision)
    optimizer.zero_grad()
    try:
        infos = run_microbatches(optimizer.ddp, [p.batch for p in mbs], loss_fn)
    finally:
        qat.observers.clear()
    real = [(p, info) for p, info in zip(mbs, infos, strict=True) if p.weight]
    kept = sum(info["kept_tokens"] for _, info in real)
    dp_kept = _dp_sum([kept])[0]
    if 0 < dp_kept != dp_tokens:  # rejected samples (mis) leave the token mean over the kept ones
        optimizer.scale_grads(dp_tokens / dp_kept)
    stepped = optimizer.step()
    logp = torch.cat([info["logp"] for _, info in real])
    sample_of = torch.cat([p.sample_of for p, _ in real]).cpu()
    per_sample = [logp[sample_of == i] for i in range(len(out.samples))]
    denom = max(kept, 1.0)
    info = {"loss": sum(info["loss_sum"] for _, info in real) / denom,
            "clip_frac": sum(info["clipped_tokens"] for _, info in real) / denom, "kept_frac": kept / max(tokens, 1),
            "microbatches": float(len(mbs)), **stepped,
            **mismatch_metrics(per_sample, [s.logprobs for s in out.samples])}
    if logp_ref is not None:
        info["kl_ref"] = sum(i["kl_sum"] for _, i in real) / denom
    flips = counter.rates(trainer.config.num_layers if distributed_trainer() else None) if counter is not None else {}
    if flips and not rl.mode.applies_guidance:  # nothing applied: the codes are the trainer's own
        flips = {k: v for k, v in flips.items() if not k.startswith("residual")}
    return {"reward": float(rewards.mean()), **info, **flips,
            "guidance_bytes_per_token": _billed_bytes_per_token(out.guidance, rl.mode.applies_guidance)}
