"""Train-rollout mismatch metrics (docs/design.md 4.5), with verl's and slime's names.

With r = logp_train - logp_rollout per sampled token (the rollout is the sampling policy):
    k3_kl     mean(exp(r) - r - 1)            KL(rollout || train), k3 estimator (verl)
    kl        mean(-r)                        the same KL, k1 estimator
    chi2_token  mean(exp(2 r)) - 1            chi-square divergence of train from rollout
    probs_diff_mean / _max   |exp(logp_train) - exp(logp_rollout)|
    log_ppl_diff   mean over sequences of (mean_t logp_rollout - mean_t logp_train)
    train_rollout_logprob_abs_diff   mean over samples of each sample's mean |r|  (slime's default)
    rollout_is_ratio_fraction_high / _low   share of tokens whose importance ratio exp(r) lies
                  above c / below 1/c (verl)
Token means run over every token of the batch; exponentials see r clamped to +-20 (verl).
"""

from __future__ import annotations

import torch

from .losses import SAFETY_BOUND


def mismatch_metrics(logp_train: list[torch.Tensor], logp_rollout: list[torch.Tensor],
                     clip: float = 2.0) -> dict[str, float]:
    """Metrics over samples (one float tensor [T_i] of sampled-token log-probs per sample, T_i >= 1);
    `clip`: the importance-ratio threshold c of the fraction metrics."""
    if len(logp_train) != len(logp_rollout) or not logp_train:
        raise ValueError("mismatch_metrics needs the same non-zero number of train and rollout samples")
    for a, b in zip(logp_train, logp_rollout, strict=True):
        if a.shape != b.shape:
            raise ValueError(f"train and rollout log-probs of a sample differ in shape: {tuple(a.shape)} "
                             f"vs {tuple(b.shape)}")
    t = torch.cat(logp_train).double()
    ro = torch.cat(logp_rollout).double()
    r = t - ro
    ratio = r.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    pairs = list(zip(logp_train, logp_rollout, strict=True))
    seq = torch.stack([b.double().mean() - a.double().mean() for a, b in pairs])
    abs_diff = torch.stack([(a.double() - b.double()).abs().mean() for a, b in pairs])
    return {
        "k3_kl": float((r.exp() - r - 1).mean()),
        "kl": float((-r).mean()),
        "chi2_token": float(ratio.square().mean() - 1),
        "probs_diff_mean": float((t.exp() - ro.exp()).abs().mean()),
        "probs_diff_max": float((t.exp() - ro.exp()).abs().max()),
        "log_ppl_diff": float(seq.mean()),
        "train_rollout_logprob_abs_diff": float(abs_diff.mean()),
        "rollout_is_ratio_fraction_high": float((ratio > clip).double().mean()),
        "rollout_is_ratio_fraction_low": float((ratio < 1 / clip).double().mean()),
        "tokens": int(r.numel()),
    }
