"""One RL step (DESIGN.md section 5): rollout, rewards, GRPO advantages, the trainer's
(guided) forward, rollout correction, policy loss, optimizer step, weight sync.

The trainer is this rank's TraceGPTModel under any Megatron layout (one process when colocated;
called on every trainer rank under torchrun); the engine any RolloutBackend (a `RemoteEngine`
under torchrun). Each step is on-policy: the trainer's log-probs before the update are the PPO
"old" log-probs.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from trace_kernels.fp4 import quantize

from ..guidance import GuidanceBatch
from ..megatron import qat
from ..megatron.context import MicroBatchGuidance
from ..megatron.model import (
    pack_sequences,
    sequence_padding,
    set_precision,
)
from ..megatron.schedule import MicroBatch, run_microbatches
from ..model_config import FP4_WEIGHT_SUFFIXES
from ..rollout import GroupRequest, RolloutOutput, SamplingParams
from .losses import (
    grpo_advantages,
    informative_groups,
    kl_penalty,
    policy_loss,
    rollout_correction,
)
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
    dynamic_sampling: bool = False  # DAPO: train only on groups whose rewards differ, sampling more to refill
    max_rounds: int = 3  # rollout rounds per step at most, with dynamic sampling
    kl_coef: float = 0.0  # weight of the KL penalty to the reference model (0: none)
    kl_kind: str = "k3"  # losses.kl_penalty estimator
    max_tokens_per_microbatch: int = 0  # trainer micro-batch size in tokens (0: a rank's whole rollout at once)


def sync_weights(trainer, engine, version: int) -> int:
    """Send the trainer's weights to the engine as `version`: FP4 sites packed with the shared
    quantizer when the engine runs FP4 (codes + scales), BF16 otherwise. Returns bytes sent.
    Across trainer ranks (call on all) the full weights are gathered on rank 0, which sends them."""
    fp4 = getattr(getattr(engine, "config", None), "precision", "bf16") == "fp4"
    if distributed_trainer():
        from ..megatron.weights import gather_full_state_dict

        full = gather_full_state_dict(trainer)
        if full is None:  # not rank 0: rank 0 sends, every rank learns the version
            engine.update_weights(None, version)
            return 0
    else:
        full = {k: v for k, v in trainer.state_dict().items() if not k.endswith("_extra_state")}
    sd, nbytes = {}, 0
    for name, t in full.items():
        t = t.detach()
        if fp4 and name.endswith(FP4_WEIGHT_SUFFIXES):
            q = quantize(t, "nvfp4")
            sd[name], nbytes = q, nbytes + q.codes.numel() + q.block_scales.numel() + 4
        else:
            sd[name], nbytes = t, nbytes + t.numel() * t.element_size()
    engine.update_weights(sd, version)
    return nbytes


def rl_step(trainer, optimizer, engine, prompts: list[tuple[int, ...]], reward_fn, cfg: StepConfig,
            sampling: SamplingParams, step: int, more_prompts=None, reference=None) -> dict:
    """Rollout, train on it, sync the new weights; returns the step's metrics.

    more_prompts(n) -> n further prompts: refills with dynamic sampling (else the step trains on
    the informative groups of its first round). reference: the frozen model of the KL penalty."""
    t0 = time.perf_counter()
    batch = rollout(engine, prompts, reward_fn, cfg, sampling, step)
    sampled = [batch]
    first = batch
    if cfg.dynamic_sampling:
        target = batch.num_groups
        batch = batch.informative()
        for r in range(1, cfg.max_rounds):
            # across trainer ranks the rounds are collective: another round while any rank lacks groups
            if more_prompts is None or _all_ranks(batch.num_groups >= target):
                break
            extra = rollout(engine, more_prompts(len(prompts)), reward_fn, cfg, sampling, step, tag=f"r{r}")
            sampled.append(extra)
            batch = batch.merge(extra.informative())
        batch = batch.first_groups(target)
    t1 = time.perf_counter()
    trained = batch.num_groups
    if not trained and distributed_trainer():  # the other ranks' collectives need this rank's forward and
        batch = first.select([0])  # backward: a group of equal rewards has zero advantage, no gradient
    metrics = train_on(trainer, optimizer, batch, cfg, reference) if batch.num_groups else {"skipped": 1.0}
    t2 = time.perf_counter()
    metrics["weight_sync_bytes"] = sync_weights(trainer, engine, engine.weight_version + 1)
    t3 = time.perf_counter()
    every = torch.cat([b.rewards for b in sampled])
    tokens = sum(len(s.tokens) for b in sampled for s in b.out.samples)
    metrics["reward"] = float(every.mean())  # over everything sampled, filtered or not
    if cfg.dynamic_sampling:
        metrics |= {"rollout_rounds": len(sampled), "trained_groups": trained}
    return {"step": step, **metrics, "response_tokens": tokens, "rollout_tokens_per_s": tokens / (t1 - t0),
            "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2}


def distributed_trainer() -> bool:
    """True under torchrun with several trainer ranks (their world is torch.distributed's)."""
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _reduce_over_ranks(n: int, op) -> int:
    """`n` reduced with `op` (a torch.distributed.ReduceOp) over the trainer ranks (a collective
    when there are several)."""
    if not distributed_trainer():
        return n
    t = torch.tensor([n], device="cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
    torch.distributed.all_reduce(t, op=op)
    return int(t.item())


def _max_over_ranks(n: int) -> int:
    return _reduce_over_ranks(n, torch.distributed.ReduceOp.MAX)


def _all_ranks(flag: bool) -> bool:
    """`flag` on every trainer rank."""
    return bool(_reduce_over_ranks(int(flag), torch.distributed.ReduceOp.MIN))


@dataclass
class RolloutBatch:
    """A rollout with its prompts (by group id) and rewards (float [N], sample order); groups
    of `group_size` consecutive samples."""

    out: RolloutOutput
    prompts: dict[str, tuple[int, ...]]
    rewards: torch.Tensor
    group_size: int

    @property
    def num_groups(self) -> int:
        return len(self.out.samples) // self.group_size

    def select(self, groups: list[int]) -> RolloutBatch:
        """The batch of groups `groups` (indices, in that order), with their guidance."""
        idx = [g * self.group_size + i for g in groups for i in range(self.group_size)]
        samples = [self.out.samples[i] for i in idx]
        gids = {s.group_id for s in samples}
        guidance = self.out.guidance.subset(s.sample_id for s in samples)
        return RolloutBatch(RolloutOutput(samples, guidance), {k: v for k, v in self.prompts.items() if k in gids},
                            self.rewards[idx], self.group_size)

    def informative(self) -> RolloutBatch:
        """Only the groups whose rewards differ (DAPO's dynamic-sampling filter)."""
        keep = informative_groups(self.rewards, self.group_size)
        return self.select(keep.nonzero().flatten().tolist())

    def first_groups(self, n: int) -> RolloutBatch:
        return self if self.num_groups <= n else self.select(list(range(n)))

    def merge(self, other: RolloutBatch) -> RolloutBatch:
        """Both batches' groups (group ids must differ)."""
        if set(self.prompts) & set(other.prompts):
            raise ValueError(f"rollout batches share group ids {sorted(set(self.prompts) & set(other.prompts))[:3]}")
        guidance = GuidanceBatch(self.out.guidance.groups | other.out.guidance.groups,
                                 self.out.guidance.samples | other.out.guidance.samples)
        return RolloutBatch(RolloutOutput(self.out.samples + other.out.samples, guidance),
                            self.prompts | other.prompts, torch.cat([self.rewards, other.rewards]), self.group_size)


def rollout(engine, prompts, reward_fn, cfg: StepConfig, sampling: SamplingParams, step: int,
            tag: str = "") -> RolloutBatch:
    """`group_size` samples of each prompt, rewarded by reward_fn(prompt_ids, response_ids) -> float.
    Group ids are "s<step><tag>-p<i>", so the rounds of one step do not collide."""
    requests = [GroupRequest(f"s{step}{tag}-p{i}", tuple(p), cfg.group_size) for i, p in enumerate(prompts)]
    out = engine.generate(requests, sampling)
    failed = [s.error for s in out.samples if s.error]
    if failed:
        raise ValueError(f"rollout failed: {failed[0]}")
    by_group = {r.group_id: r.prompt_ids for r in requests}
    rewards = torch.tensor([float(reward_fn(by_group[s.group_id], s.tokens)) for s in out.samples])
    return RolloutBatch(out, by_group, rewards, cfg.group_size)


@dataclass
class _Packed:
    """Samples of a rollout as one trainer micro-batch (`batch`: ids, positions, targets
    [1, T'], T' = T plus sequence padding, THD params, the guidance it carries, padded), and
    where each response token's log-prob sits: index, sample_of (the sample's index in the
    rollout) int64 [R], the rollout's log-probs float32 [R]. `weight` 0 marks a filler
    micro-batch: it runs (the collectives of the other ranks need it) but counts nothing."""

    batch: MicroBatch
    index: torch.Tensor
    sample_of: torch.Tensor
    logp_rollout: torch.Tensor
    weight: float = 1.0


def _pack(trainer, batch: RolloutBatch, cfg: StepConfig, samples: list[int], observed: bool = False,
          weight: float = 1.0) -> _Packed:
    """The rollout's `samples` (indices) as one micro-batch. `observed`: the forward carries
    every record (flip counters read it), though only trace mode applies them."""
    dev, out = next(trainer.parameters()).device, batch.out
    chosen = [out.samples[i] for i in samples]
    seqs = [torch.tensor(list(batch.prompts[s.group_id]) + s.tokens) for s in chosen]
    pad = sequence_padding(sum(len(q) for q in seqs))
    tokens, positions, psp = pack_sequences(seqs, dev, pad)
    full = MicroBatchGuidance.from_batch(out.guidance, [s.sample_id for s in chosen])
    carried = full if cfg.precision == "trace" or observed else MicroBatchGuidance(
        full.num_tokens, routed_experts=full.routed_experts)
    index, sample_of, offset = [], [], 0  # a response token's log-prob sits at the position before it
    for i, s, q in zip(samples, chosen, seqs, strict=True):
        index += range(offset + s.prompt_len - 1, offset + len(q) - 1)
        sample_of += [i] * len(s.tokens)
        offset += len(q)
    mb = MicroBatch(tokens, positions, torch.roll(tokens, -1, 1), psp, carried.padded(pad, len(seqs[0])))
    return _Packed(mb, torch.tensor(index, device=dev, dtype=torch.long),
                   torch.tensor(sample_of, device=dev, dtype=torch.long),
                   torch.cat([s.logprobs for s in chosen]).to(dev), weight)


def split_microbatches(lengths: list[int], max_tokens: int, count: int | None = None) -> list[list[int]]:
    """Consecutive samples (by token length) in micro-batches of at most `max_tokens` tokens
    (0: all in one; a longer sample goes alone), split further into `count` micro-batches when
    asked (while some holds two samples or more). Returns lists of sample indices."""
    chunks: list[list[int]] = []
    filled = 0  # tokens in the last chunk
    for i, n in enumerate(lengths):
        if chunks and (not max_tokens or filled + n <= max_tokens):
            chunks[-1].append(i)
            filled += n
        else:
            chunks.append([i])
            filled = n
    while count is not None and len(chunks) < count:
        big = max(range(len(chunks)), key=lambda k: len(chunks[k]))
        if len(chunks[big]) < 2:
            break
        c = chunks.pop(big)
        chunks[big:big] = [c[: len(c) // 2], c[len(c) // 2:]]
    return chunks


def _microbatches(trainer, batch: RolloutBatch, cfg: StepConfig, observed: bool = False) -> list[_Packed]:
    """The rollout in micro-batches of at most cfg.max_tokens_per_microbatch tokens. Across
    trainer ranks every rank runs as many as the busiest (expert and pipeline collectives pair
    them up): a rank with fewer samples than that repeats one, as a filler of weight 0."""
    lengths = [len(batch.prompts[s.group_id]) + len(s.tokens) for s in batch.out.samples]
    own = split_microbatches(lengths, cfg.max_tokens_per_microbatch)
    count = _max_over_ranks(len(own))
    chunks = split_microbatches(lengths, cfg.max_tokens_per_microbatch, count)
    packed = [_pack(trainer, batch, cfg, c, observed) for c in chunks]
    packed += [_pack(trainer, batch, cfg, chunks[-1][-1:], observed, weight=0.0)] * (count - len(chunks))
    return packed


def response_logprobs(trainer, batch: RolloutBatch, cfg: StepConfig, observer=None):
    """The trainer's log-probs of every response token, the sample of each token, and the
    rollout's log-probs: ([R], int64 [R], [R]) in sample order, on every pipeline stage; no
    gradient. `observer`, if given, is a qat observer that watches the forwards, which then
    carry every record the rollout has (a FlipCounter() reads them as the active guidance)."""
    mbs = _microbatches(trainer, batch, cfg, observed=observer is not None)
    set_precision(trainer, TRAINER_PRECISION[cfg.precision])
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


def train_on(trainer, optimizer, batch: RolloutBatch, cfg: StepConfig, reference=None) -> dict:
    """GRPO update on one rollout, under any trainer layout, in micro-batches of at most
    cfg.max_tokens_per_microbatch tokens (gradients accumulate; the loss is the token mean over
    the whole rollout); returns reward, loss, clip/kept fractions, the mismatch and flip rates
    (summed over trainer ranks). With cfg.kl_coef > 0 the loss adds kl_coef times the token-mean
    KL estimate to `reference` (a frozen model of the same architecture, quantized like the
    policy's forward)."""
    out, rewards = batch.out, batch.rewards
    adv = grpo_advantages(rewards, cfg.group_size)
    counting = TRAINER_PRECISION[cfg.precision] != "bf16"  # flips of the records the rollout has
    mbs = _microbatches(trainer, batch, cfg, observed=counting)
    lengths = [len(s.tokens) for s in out.samples]
    start = [sum(lengths[:i]) for i in range(len(lengths))]  # of each sample's tokens in sample order
    tokens = sum(lengths)  # every loss sums its kept tokens over this; rescaled below if some are dropped
    logp_ref = None
    if cfg.kl_coef:
        if reference is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        # the reference quantizes like the policy (round to nearest: the engine's records are the policy's)
        ref_mode = "bf16" if TRAINER_PRECISION[cfg.precision] == "bf16" else "fp4-qat"
        logp_ref, _, _ = response_logprobs(reference, batch, dataclasses.replace(cfg, precision=ref_mode))

    def loss_fn(i, lp):  # on the last pipeline stage
        p = mbs[i]
        logp = lp[p.index]
        weights, keep = rollout_correction(logp.detach(), p.logp_rollout, p.sample_of, cfg.correction,
                                          cfg.correction_threshold)
        loss, info = policy_loss(logp, logp.detach(), adv.to(logp.device)[p.sample_of], clip_low=cfg.clip_low,
                                 clip_high=cfg.clip_high, weights=weights.to(logp.dtype), keep=keep,
                                 normalizer=tokens)
        info["loss_sum"] = float(loss.detach()) * tokens
        if logp_ref is not None:
            first = start[int(p.sample_of[0])]
            kl = kl_penalty(logp, logp_ref[first: first + len(p.index)].to(logp.device), cfg.kl_kind)
            kl_sum = (kl * keep.to(kl.dtype)).sum()
            loss = loss + cfg.kl_coef * kl_sum / tokens
            info["kl_sum"] = float(kl_sum.detach())
            info["loss_sum"] += cfg.kl_coef * info["kl_sum"]
        return loss * p.weight, {**info, "logp": logp.detach().cpu()}

    # every rank counts its own rows and columns (token, head and column shards, dispatched
    # expert rows, its pipeline stage's layers, its data-parallel samples); rates() sums them
    counter = FlipCounter() if counting else None
    if counter is not None:
        qat.observers.append(counter)
    set_precision(trainer, TRAINER_PRECISION[cfg.precision])
    optimizer.zero_grad(set_to_none=True)
    try:
        infos = run_microbatches(trainer, [p.batch for p in mbs], loss_fn)
    finally:
        qat.observers.clear()
    real = [(p, info) for p, info in zip(mbs, infos, strict=True) if p.weight]
    kept = sum(info["kept_tokens"] for _, info in real)
    if 0 < kept != tokens:  # rejected samples (mis) leave the token mean over the kept ones
        for param in trainer.parameters():
            if param.grad is not None:
                param.grad.mul_(tokens / kept)
    optimizer.step()
    logp = torch.cat([info["logp"] for _, info in real])
    sample_of = torch.cat([p.sample_of for p, _ in real]).cpu()
    per_sample = [logp[sample_of == i] for i in range(len(out.samples))]
    denom = max(kept, 1.0)
    info = {"loss": sum(info["loss_sum"] for _, info in real) / denom,
            "clip_frac": sum(info["clipped_tokens"] for _, info in real) / denom, "kept_frac": kept / max(tokens, 1),
            "microbatches": float(len(mbs)), **mismatch_metrics(per_sample, [s.logprobs for s in out.samples])}
    if logp_ref is not None:
        info["kl_ref"] = sum(i["kl_sum"] for _, i in real) / denom
    flips = counter.rates(trainer.config.num_layers if distributed_trainer() else None) if counter is not None else {}
    if flips and cfg.precision != "trace":  # nothing applied: the codes are the trainer's own
        flips = {k: v for k, v in flips.items() if not k.startswith("residual")}
    return {"reward": float(rewards.mean()), **info, **flips,
            "guidance_bytes_per_token": _billed_bytes_per_token(out.guidance, cfg.precision == "trace")}
