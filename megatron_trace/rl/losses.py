"""GRPO: group-normalised advantages, the clipped policy loss (DAPO's clip-higher as an option)
and the rollout corrections for the train-rollout mismatch.

Shapes: T tokens of a micro-batch (response tokens only, packed), N samples; `sample_of` int64
[T] names each token's sample. Loss aggregation is token-mean over the kept tokens. Log-ratios
are clamped to +-SAFETY_BOUND before they are exponentiated, as verl does.
"""

from __future__ import annotations

import typing
from typing import Literal

import torch

Correction = Literal["none", "tis", "mis"]
CORRECTIONS = typing.get_args(Correction)
SAFETY_BOUND = 20.0  # verl's bound on log-ratios before exp (ratios of e^20 are overflow, not signal)


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, eps: float = 1e-6,
                    normalize_std: bool = True) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps), groups of `group_size` consecutive
    samples; a group of one sample has mean 0 and std 1, as in verl (its advantage is its reward).
    rewards: float [N] with N a multiple of group_size. Returns float32 [N]."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"grpo_advantages: {tuple(rewards.shape)} rewards do not form groups of {group_size}")
    r = rewards.double().view(-1, group_size)
    if group_size == 1:
        return (r / (1 + eps) if normalize_std else r).reshape(-1).float()
    adv = r - r.mean(1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(1, keepdim=True) + eps)  # unbiased std, as GRPO's reference code
    return adv.reshape(-1).float()


def rollout_correction(logp_train_old: torch.Tensor, logp_rollout: torch.Tensor, sample_of: torch.Tensor,
                       mode: str = "none", threshold: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token importance weights and keep mask correcting for the rollout policy, as verl names them.

    r = logp_train_old - logp_rollout (the trainer's log-probs before the update against the engine's).
    none: weight 1, all kept.
    tis:  token-level truncated IS, weight min(exp(r), threshold), all kept.
    mis:  sequence-level masked IS, weight exp(sum of the sample's r) for samples whose sequence
          ratio lies in [1 / threshold, threshold]; the others are rejected (kept = False: out of
          both the loss and its token count).
    Returns (weights float32 [T], no gradient; keep bool [T]).
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; choose from {CORRECTIONS}")
    if not (logp_train_old.shape == logp_rollout.shape == sample_of.shape) or logp_rollout.dim() != 1:
        raise ValueError("rollout_correction: log-probs and sample ids must all be [T]")
    r = (logp_train_old.double() - logp_rollout.double()).detach()
    if mode == "none":
        return torch.ones_like(r, dtype=torch.float32), torch.ones_like(r, dtype=torch.bool)
    if mode == "tis":
        weights = r.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().clamp(max=threshold)
        return weights.float(), torch.ones_like(r, dtype=torch.bool)
    n = int(sample_of.max()) + 1
    seq_log_ratio = torch.zeros(n, dtype=torch.float64, device=r.device).index_add_(0, sample_of, r)
    seq_ratio = seq_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    keep = (seq_ratio >= 1 / threshold) & (seq_ratio <= threshold)
    return seq_ratio[sample_of].float(), keep[sample_of]


def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, *,
                clip_low: float = 0.2, clip_high: float | None = None, clip_ratio_c: float = 3.0,
                weights: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                normalizer: float | None = None,
                as_tensors: bool = False) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """PPO-clip policy loss with verl's dual-clip, token mean over kept tokens.

    ratio = exp(logp - logp_old) (log-ratio clamped to +-20); per token
    L = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high)), and for A < 0 also at most
    -A clip_ratio_c (dual-clip: a negative-advantage token whose ratio has run far above 1 stops
    pushing; 0 turns it off), times the rollout-correction weight. clip_high defaults to
    clip_low (DAPO's clip-higher sets it larger). All inputs [T]; advantages per token.
    `normalizer`: divide the kept tokens' sum by it instead of by their count (one micro-batch of
    several: the caller rescales). Returns (loss, {"clip_frac" (verl's pg_clipfrac),
    "clip_frac_lower" (pg_clipfrac_lower), "kept_frac", "clipped_tokens", "clipped_lower_tokens",
    "kept_tokens", "ppo_kl_sum" (sum over kept tokens of logp_old - logp)}) as floats, or with
    `as_tensors` as float64 0-d tensors on logp's device (no host synchronisation).
    """
    clip_high = clip_low if clip_high is None else clip_high
    weights = torch.ones_like(logp) if weights is None else weights
    keep = torch.ones_like(logp, dtype=torch.bool) if keep is None else keep
    log_ratio = (logp - logp_old.detach()).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    n_lower = torch.zeros((), dtype=torch.int64, device=logp.device)
    if clip_ratio_c:
        cap = -advantages * clip_ratio_c
        lower = (per_token > cap) & (advantages < 0)
        n_lower = (lower & keep).sum()
        per_token = torch.where(advantages < 0, torch.minimum(per_token, cap), per_token)
    per_token = per_token * weights
    kept = keep.to(per_token.dtype)
    count = kept.sum().clamp(min=1)
    loss = (per_token * kept).sum() / (count if normalizer is None else normalizer)
    n_clipped = ((clipped > unclipped) & keep).sum().double()
    n_lower, count = n_lower.double(), count.detach().double()
    info = {"clip_frac": n_clipped / count, "clip_frac_lower": n_lower / count, "kept_frac": kept.mean().double(),
            "clipped_tokens": n_clipped, "clipped_lower_tokens": n_lower, "kept_tokens": kept.sum().double(),
            "ppo_kl_sum": (-log_ratio.detach() * kept).sum().double()}
    if as_tensors:
        return loss, info
    return loss, dict(zip(info, torch.stack(list(info.values())).tolist(), strict=True))


KLKind = Literal["k1", "k2", "k3"]
KL_KINDS = typing.get_args(KLKind)


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens, as verl names them:
    with d = logp_ref - logp, k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1 (unbiased, >= 0, verl's
    "low_var_kl", clamped to [-10, 10] like it). Inputs [T]; gradient flows through `logp`."""
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose from {KL_KINDS}")
    if logp.shape != logp_ref.shape:
        raise ValueError(f"kl_penalty: log-probs {tuple(logp.shape)} and reference {tuple(logp_ref.shape)} differ")
    d = logp_ref.detach() - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d.square()
    return (d.exp() - d - 1).clamp(-10, 10)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: bool [N / group_size], True for groups whose rewards are
    not all equal (the others have zero advantage and give no gradient)."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"informative_groups: {tuple(rewards.shape)} rewards do not form groups of {group_size}")
    r = rewards.view(-1, group_size)
    return (r != r[:, :1]).any(1)
