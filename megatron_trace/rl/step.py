"""One RL step (docs/design.md section 5): rollout, rewards, GRPO advantages, the trainer's
(guided) forward, rollout correction, policy loss, optimizer step, weight sync.

The trainer is this rank's `rl.trainer.Trainer` (Megatron under any layout, or DeepSpeed; one
process when colocated, called on every trainer rank under torchrun); the engine any
RolloutBackend (a `RemoteEngine` under torchrun). The step's settings are the `rl` section of
the run's configuration. Each step trains on its own rollout: the trainer's log-probs before its
first update are the PPO "old" log-probs; `rl.mini_batches` x `rl.epochs` optimizer steps follow.
"""

from __future__ import annotations

import dataclasses
import time
from itertools import pairwise

import torch
import torch.distributed as dist

from ..config import DistSection, RLSection
from ..guidance import GuidanceBatch
from ..megatron import qat
from ..modes import RunMode
from ..rollout import SamplingParams, release_backend_memory, resume_backend_memory
from .losses import grpo_advantages, kl_penalty, policy_loss, rollout_correction
from .metrics import mismatch_metrics
from .mismatch import FlipCounter
from .packing import microbatches
from .ranks import all_ranks, data_parallel, distributed_trainer, reduce_over_ranks
from .rollout_batch import RolloutBatch, rollout
from .weight_sync import sync_weights


def rl_step(trainer, engine, prompts: list[tuple[int, ...]], reward_fn, rl: RLSection,
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
    release_backend_memory(engine)  # colocated SGLang: its memory is the trainer's while it trains
    metrics = train_on(trainer, batch, rl, reference) if batch.num_groups else {"skipped": 1.0}
    t2 = time.perf_counter()
    resume_backend_memory(engine)
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
    trainer.set_precision(rl.mode.trainer_precision)
    if observer is not None:
        qat.observers.append(observer)
    try:
        with torch.no_grad():
            infos = trainer.run_microbatches([p.batch for p in mbs],
                                             lambda i, lp: (lp.sum(), {"logp": lp[mbs[i].index]}),
                                             forward_only=True)
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
    _, size, group = data_parallel()
    if size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, group=group)
    return t.tolist()


def _by_sample(logp: torch.Tensor, sample_of: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Token log-probs [R] with their sample ids int64 [R] as one CPU tensor per sample (n samples)."""
    logp, sample_of = logp.cpu(), sample_of.cpu()
    return [logp[sample_of == i] for i in range(n)]


def _per_token(per_sample: list[torch.Tensor], sample_of: torch.Tensor) -> torch.Tensor:
    """Per-sample values laid out as a micro-batch's tokens: sample_of int64 [R] runs through
    consecutive samples, each over all its tokens in order. Returns [R] on sample_of's device."""
    ids, counts = torch.unique_consecutive(sample_of.cpu(), return_counts=True)
    parts = [per_sample[int(i)] for i in ids]
    if [len(x) for x in parts] != counts.tolist():
        raise ValueError("per-sample log-probs do not match the micro-batch's tokens")
    return torch.cat(parts).to(sample_of.device)


def mini_batch_groups(num_groups: int, mini_batches: int) -> list[list[int]]:
    """The rollout's groups (indices) in `mini_batches` consecutive parts of near-equal size, or
    in as many as the trainer rank with the fewest groups has (each rank steps as often)."""
    k = max(1, min(mini_batches, reduce_over_ranks(num_groups, dist.ReduceOp.MIN)))
    bounds = [round(i * num_groups / k) for i in range(k + 1)]
    return [list(range(a, b)) for a, b in pairwise(bounds)]


def train_on(trainer, batch: RolloutBatch, rl: RLSection, reference=None) -> dict:
    """PPO/GRPO updates on one rollout, under any trainer layout: advantages over the whole
    rollout, then `rl.epochs` passes over it in `rl.mini_batches` mini-batches of whole groups,
    each one optimizer step of `trainer` (an `rl.trainer.Trainer` in its RL phase),
    in micro-batches of at most rl.max_tokens_per_microbatch tokens whose gradients accumulate.
    Each step's loss is the token mean over its mini-batch, over every data-parallel rank's share.

    The PPO old log-probs, the rollout correction's weights, the mismatch metrics and the flip
    rates are the trainer's before the first update: from the update's own forward when there is
    one update, else from one extra forward (guided in trace mode). Returns reward, loss, the
    clip fractions (verl's pg_clipfrac and pg_clipfrac_lower), ppo_kl, the gradient norm before
    clipping (means over the updates), the kept fraction, the mismatch and flip rates (summed
    over trainer ranks). With rl.kl_coef > 0 the loss adds kl_coef times the token-mean KL
    estimate to `reference` (a frozen model of the same architecture, quantized like the
    policy's forward)."""
    out, rewards = batch.out, batch.rewards
    n = len(out.samples)
    adv = grpo_advantages(rewards, rl.group_size)
    counting = rl.mode.trainer_precision.quantizes  # flips of the records the rollout has
    # every rank counts its own rows and columns (token, head and column shards, dispatched
    # expert rows, its pipeline stage's layers, its data-parallel samples); rates() sums them
    counter = FlipCounter() if counting else None
    # a backend that cannot rescale gradients after backward (DeepSpeed) needs the kept tokens,
    # which `mis` decides from the old log-probs, before the update: from an extra forward
    one_update = rl.mini_batches == 1 and rl.epochs == 1 and (trainer.scales_gradients or rl.correction != "mis")
    logp_old = None
    if not one_update:
        logp, sample_of, _ = response_logprobs(trainer, batch, rl, observer=counter)
        logp_old = _by_sample(logp, sample_of, n)
    logp_ref = None
    if rl.kl_coef:
        if reference is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        # the reference quantizes like the policy (round to nearest: the engine's records are the policy's)
        ref_mode = RunMode.FP4_QAT if counting else RunMode.BF16
        logp_ref = _by_sample(*response_logprobs(reference, batch, dataclasses.replace(rl, mode=ref_mode))[:2], n)
    updates = []
    for _ in range(rl.epochs):
        for groups in mini_batch_groups(batch.num_groups, rl.mini_batches):
            idx = [g * rl.group_size + j for g in groups for j in range(rl.group_size)]
            old, ref = ([v[i] for i in idx] if v is not None else None for v in (logp_old, logp_ref))
            updates.append(_update(trainer, batch.select(groups), adv[idx], old, ref, rl,
                                   counter if one_update else None))
    if one_update:
        logp_old = updates[0].pop("logp")
    kept, tokens = (sum(u[k] for u in updates) for k in ("kept_tokens", "tokens"))
    denom = max(kept, 1.0)
    info = {"loss": sum(u["loss"] for u in updates) / len(updates),
            "clip_frac": sum(u["clipped_tokens"] for u in updates) / denom,
            "clip_frac_lower": sum(u["clipped_lower_tokens"] for u in updates) / denom,
            "ppo_kl": sum(u["ppo_kl_sum"] for u in updates) / denom,
            "kept_frac": kept / max(tokens, 1), "updates": float(len(updates)),
            "microbatches": float(sum(u["microbatches"] for u in updates)),
            "grad_norm": sum(u["grad_norm"] for u in updates) / len(updates),
            **mismatch_metrics(logp_old, [s.logprobs for s in out.samples])}
    if logp_ref is not None:
        info["kl_ref"] = sum(u["kl_sum"] for u in updates) / denom
    layers = trainer.model_cfg.num_layers if distributed_trainer() else None
    flips = counter.rates(layers) if counter is not None else {}
    if flips and not rl.mode.applies_guidance:  # nothing applied: the codes are the trainer's own
        flips = {k: v for k, v in flips.items() if not k.startswith("residual")}
    return {"reward": float(rewards.mean()), **info, **flips,
            "guidance_bytes_per_token": _billed_bytes_per_token(out.guidance, rl.mode.applies_guidance)}


@dataclasses.dataclass(frozen=True)
class _GivenPerToken:
    """A micro-batch's loss inputs that do not depend on its forward, per token [T] on the
    device: advantages (float32), and with old log-probs given, those (float32) and the rollout
    correction's weights and keep mask; the reference log-probs if any."""

    adv: torch.Tensor
    old: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    ref: torch.Tensor | None = None


def _given_per_token(p, adv: torch.Tensor, logp_old, logp_ref, rl: RLSection) -> _GivenPerToken:
    old = weights = keep = ref = None
    if logp_old is not None:
        old = _per_token(logp_old, p.sample_of)
        weights, keep = rollout_correction(old, p.logp_rollout, p.sample_of, rl.correction, rl.correction_threshold)
    if logp_ref is not None:
        ref = _per_token(logp_ref, p.sample_of)
    return _GivenPerToken(adv=adv[p.sample_of], old=old, weights=weights, keep=keep, ref=ref)


def _update(trainer, batch: RolloutBatch, adv: torch.Tensor, logp_old: list[torch.Tensor] | None,
            logp_ref: list[torch.Tensor] | None, rl: RLSection, counter=None) -> dict:
    """One optimizer step on a mini-batch (float32 advantages [N]; per-sample old and reference
    log-probs, or None: the old ones are this forward's own). `counter` watches the forward.
    Returns sums over this rank (tokens, kept, clipped, ...), the step's token-mean loss and
    gradient norm, and, without logp_old, this forward's log-probs per sample ("logp")."""
    mbs = microbatches(trainer, batch, rl.max_tokens_per_microbatch,
                       records=rl.mode.applies_guidance or counter is not None)
    tokens = sum(len(s.tokens) for s in batch.out.samples)
    # the loss is the token mean over every data-parallel rank's kept tokens: each rank sums its
    # own over (global tokens / DP), DDP averages over DP, and the reduced gradients are rescaled
    # by global tokens / global kept tokens once the kept ones are known; a backend that cannot
    # rescale gradients divides by the global kept tokens, counted from the old log-probs first
    if not trainer.scales_gradients and logp_old is None and rl.correction == "mis":
        raise ValueError("masked IS without old log-probs needs a trainer that rescales gradients")
    # what each micro-batch's loss needs besides its forward, laid out per token on the device
    # before the schedule runs: made inside the loss, their host copies and checks stalled each
    # forward's backward. The loss returns its statistics as device tensors (to the host once,
    # after the schedule); only `mis` on the forward's own log-probs still waits inside it
    adv_device = adv.to(mbs[0].sample_of.device) if mbs else adv
    given = [_given_per_token(p, adv_device, logp_old, logp_ref, rl) for p in mbs]
    dp_size = data_parallel()[1]
    dp_tokens = _dp_sum([tokens])[0]
    if trainer.scales_gradients:
        normalizer = dp_tokens / dp_size
    else:
        kept_before = sum(int(g.keep.sum()) for p, g in zip(mbs, given, strict=True)
                          if p.weight) if rl.correction == "mis" else tokens
        normalizer = max(_dp_sum([kept_before])[0], 1.0) / dp_size

    def loss_fn(i, lp):  # on the last pipeline stage
        p, g = mbs[i], given[i]
        logp = lp[p.index]
        old, weights, keep = g.old, g.weights, g.keep
        if logp_old is None:  # this forward's own
            old = logp.detach()
            weights, keep = rollout_correction(old, p.logp_rollout, p.sample_of, rl.correction,
                                               rl.correction_threshold)
        loss, info = policy_loss(logp, old.to(logp.dtype), g.adv, clip_low=rl.clip_low, clip_high=rl.clip_high,
                                 clip_ratio_c=rl.clip_ratio_c, weights=weights.to(logp.dtype), keep=keep,
                                 normalizer=normalizer, as_tensors=True)
        info["loss_sum"] = loss.detach().double() * normalizer
        if logp_ref is not None:
            kl = kl_penalty(logp, g.ref.to(logp.dtype), rl.kl_kind)
            kl_sum = (kl * keep.to(kl.dtype)).sum()
            loss = loss + rl.kl_coef * kl_sum / normalizer
            info["kl_sum"] = kl_sum.detach().double()
            info["loss_sum"] = info["loss_sum"] + rl.kl_coef * info["kl_sum"]
        return loss * p.weight, {**info, "logp": logp.detach()}  # to the host after the schedule

    if counter is not None:
        qat.observers.append(counter)
    trainer.set_precision(rl.mode.trainer_precision)
    trainer.zero_grad()
    try:
        infos = trainer.run_microbatches([p.batch for p in mbs], loss_fn)
    finally:
        qat.observers.clear()
    real = [info for p, info in zip(mbs, infos, strict=True) if p.weight]
    kept = sum(info["kept_tokens"] for info in real)
    dp_kept = _dp_sum([kept])[0]
    if trainer.scales_gradients and 0 < dp_kept != dp_tokens:  # rejected samples (mis): the mean over the kept
        trainer.scale_grads(dp_tokens / dp_kept)
    stepped = trainer.step()
    sums = {k: sum(info[k] for info in real) for k in ("clipped_tokens", "clipped_lower_tokens", "ppo_kl_sum")}
    out = {"tokens": tokens, "kept_tokens": kept, "loss": sum(info["loss_sum"] for info in real) / max(kept, 1.0),
           "microbatches": len(mbs), "grad_norm": stepped["grad_norm"], **sums}
    if logp_ref is not None:
        out["kl_sum"] = sum(info["kl_sum"] for info in real)
    if logp_old is None:
        sample_of = torch.cat([p.sample_of for p in mbs if p.weight]).cpu()
        out["logp"] = _by_sample(torch.cat([info["logp"] for info in real]), sample_of, len(batch.out.samples))
    return out
