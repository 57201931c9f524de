"""GRPO advantages, rollout corrections and the clipped policy loss against float64 by hand."""

import math
import statistics

import pytest
import torch

from megatron_trace.rl.losses import (
    grpo_advantages,
    informative_groups,
    kl_penalty,
    policy_loss,
    rollout_correction,
)


def test_grpo_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    adv = grpo_advantages(rewards, group_size=4)
    for g, rs in enumerate(([1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 5.0])):
        mu, sd = statistics.mean(rs), statistics.stdev(rs)
        assert adv[4 * g:4 * g + 4].tolist() == pytest.approx([(r - mu) / (sd + 1e-6) for r in rs], rel=1e-6)
    assert grpo_advantages(torch.ones(4), 2).abs().max() == 0  # equal rewards: no signal
    assert grpo_advantages(rewards, 4, normalize_std=False)[7] == pytest.approx(5 - 2.75)
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(rewards, 3)


def test_rollout_corrections_follow_their_definitions():
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    roll = torch.tensor([-1.5, -1.0, -0.5, -1.0], dtype=torch.float64)
    sample_of = torch.tensor([0, 0, 1, 1])
    w, keep = rollout_correction(old, roll, sample_of, "none")
    assert w.tolist() == [1, 1, 1, 1] and keep.all()
    w, keep = rollout_correction(old, roll, sample_of, "tis", threshold=1.5)
    assert w.tolist() == pytest.approx([min(math.exp(0.5), 1.5), math.exp(-1.0), 1.0, math.exp(-2.0)], rel=1e-6)
    assert keep.all()
    w, keep = rollout_correction(old, roll, sample_of, "mis", threshold=2.0)
    # sample 0: exp(0.5 - 1.0) = 0.61 kept; sample 1: exp(0 - 2) = 0.14 < 1/2 rejected
    assert w.tolist() == pytest.approx([math.exp(-0.5)] * 2 + [math.exp(-2.0)] * 2, rel=1e-6)
    assert keep.tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="unknown rollout correction"):
        rollout_correction(old, roll, sample_of, "icepop")


def test_policy_loss_by_hand_with_clip_higher_and_rejection():
    logp_old = torch.log(torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64))
    logp = torch.log(torch.tensor([0.65, 0.3, 0.55], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    loss, info = policy_loss(logp, logp_old, adv, clip_low=0.2, clip_high=0.28)
    ratios = [1.3, 0.6, 1.1]
    clipped = [min(max(r, 0.8), 1.28) for r in ratios]
    per = [max(-a * r, -a * c) for a, r, c in zip([1.0, -1.0, 2.0], ratios, clipped, strict=True)]
    assert float(loss.detach()) == pytest.approx(sum(per) / 3, rel=1e-9)
    assert info["clip_frac"] == pytest.approx(2 / 3)  # token 0 above 1.28, token 1 below 0.8
    loss.backward()
    # clipped tokens pass no gradient; the third gets -A * ratio / 3 (d ratio / d logp = ratio)
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -2.0 * 1.1 / 3], rel=1e-9)
    keep = torch.tensor([True, False, True])
    weights = torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)
    loss, info = policy_loss(logp.detach(), logp_old, adv, clip_low=0.2, clip_high=0.28, weights=weights, keep=keep)
    assert float(loss) == pytest.approx((2.0 * per[0] + 0.5 * per[2]) / 2, rel=1e-9)  # rejected: not counted
    assert info["kept_frac"] == pytest.approx(2 / 3)


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -0.2, -3.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -0.2, -1.0], dtype=torch.float64)
    d = [-0.5, 0.0, 2.0]
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, 0.0, -2.0])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([x * x / 2 for x in d])
    k3 = kl_penalty(logp, ref, "k3")
    assert k3.tolist() == pytest.approx([math.exp(x) - x - 1 for x in d], rel=1e-12)
    k3.sum().backward()  # d/dlogp (e^d - d - 1) = 1 - e^d
    assert logp.grad.tolist() == pytest.approx([1 - math.exp(x) for x in d], rel=1e-12)
    # the k3 estimator is unbiased: sampling from p, E[k3] = KL(p || q) for two categoricals
    p, q = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64), torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    estimate = float((p * kl_penalty(p.log(), q.log(), "k3")).sum())
    assert estimate == pytest.approx(exact, rel=1e-12)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(logp, ref, "k4")


def test_informative_groups_drop_groups_with_equal_rewards():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 1.0])
    assert informative_groups(rewards, 3).tolist() == [False, False, True]
    assert informative_groups(torch.tensor([0.0, 1.0]), 2).tolist() == [True]
    with pytest.raises(ValueError, match="groups of 4"):
        informative_groups(rewards, 4)


def verl_vanilla_loss(logp, old, adv, cl, ch, c):
    """verl's compute_policy_loss_vanilla per token, re-derived in float64 lists (dual-clip for
    A < 0, log-ratio clamped to +-20): (per-token losses, pg_clipfrac, pg_clipfrac_lower, ppo_kl)."""
    per, clipped, lower, kl = [], 0, 0, 0.0
    for lp, lo, a in zip(logp, old, adv, strict=True):
        d = min(max(lp - lo, -20.0), 20.0)
        ratio = math.exp(d)
        pg1, pg2 = -a * ratio, -a * min(max(ratio, 1 - cl), 1 + ch)
        clip1 = max(pg1, pg2)
        clipped += pg2 > pg1
        pg3 = -a * c
        lower += (clip1 > pg3) and a < 0
        per.append(min(pg3, clip1) if a < 0 else clip1)
        kl += -d
    n = len(per)
    return per, clipped / n, lower / n, kl / n


def test_dual_clip_and_safety_clamp_follow_verl():
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(64, generator=gen, dtype=torch.float64) * 3
    logp = old + torch.randn(64, generator=gen, dtype=torch.float64) * 1.5  # ratios far outside the clip range
    logp[:4] = old[:4] + torch.tensor([25.0, -25.0, 1.5, 2.0], dtype=torch.float64)  # beyond the +-20 bound
    adv = torch.randn(64, generator=gen, dtype=torch.float64)
    adv[:4] = torch.tensor([-1.0, 1.0, -2.0, -0.5], dtype=torch.float64)  # ratios e^20, e^1.5, e^2 > 3 with A < 0
    per, clipfrac, lower, kl = verl_vanilla_loss(logp.tolist(), old.tolist(), adv.tolist(), 0.2, 0.28, 3.0)
    loss, info = policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    assert float(loss) == pytest.approx(sum(per) / 64, rel=1e-12)
    assert info["clip_frac"] == pytest.approx(clipfrac) and info["clip_frac_lower"] == pytest.approx(lower)
    assert info["clip_frac_lower"] >= 3 / 64 and info["ppo_kl_sum"] / 64 == pytest.approx(kl, rel=1e-12)
    off, info_off = policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, clip_ratio_c=0.0)
    assert float(off) > float(loss) and info_off["clip_frac_lower"] == 0  # without the cap those tokens weigh more
    per_off, *_ = verl_vanilla_loss(logp.tolist(), old.tolist(), adv.tolist(), 0.2, 0.28, math.inf)
    assert float(off) == pytest.approx(sum(per_off) / 64, rel=1e-12)


def test_loss_statistics_left_on_the_device_reach_the_host_unchanged():
    """The RL loss returns its statistics as tensors (no host synchronisation between a forward
    and its backward); the schedule brings them to the host at once (`infos_to_host`)."""
    from megatron_trace.megatron.schedule import infos_to_host

    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(48, generator=gen) * 3
    logp = old + torch.randn(48, generator=gen)
    adv, keep = torch.randn(48, generator=gen), torch.rand(48, generator=gen) > 0.2
    _, floats = policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, keep=keep)
    _, tensors = policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, keep=keep, as_tensors=True)
    assert all(torch.is_tensor(v) and v.dtype == torch.float64 and v.dim() == 0 for v in tensors.values())
    assert floats["kept_tokens"] == int(keep.sum()) and floats["clipped_tokens"] > 0  # the case has clipped tokens
    infos = infos_to_host([dict(tensors, logp=logp, weight=0.5), None, {"logp": logp[:1]}])
    assert {k: v for k, v in infos[0].items() if k in floats} == floats and type(infos[0]["clip_frac"]) is float
    assert infos[0]["logp"].device.type == "cpu" and torch.equal(infos[0]["logp"], logp)
    assert infos[0]["weight"] == 0.5 and infos[1] is None
    assert torch.equal(infos[2]["logp"], logp[:1])  # a one-token micro-batch's log-probs stay a tensor


def test_single_sample_groups_and_clamped_corrections_follow_verl():
    rewards = torch.tensor([1.0, 0.0, 3.0])
    assert grpo_advantages(rewards, 1).tolist() == pytest.approx([1.0 / (1 + 1e-6), 0.0, 3.0 / (1 + 1e-6)])
    old = torch.tensor([0.0, -1.0, 30.0], dtype=torch.float64)
    roll = torch.tensor([-30.0, -1.0, 0.0], dtype=torch.float64)
    w, _ = rollout_correction(old, roll, torch.tensor([0, 1, 2]), "tis", threshold=1e12)
    assert w.tolist() == pytest.approx([math.exp(20.0), 1.0, math.exp(20.0)], rel=1e-6)  # e^30 clamped to e^20
    w, keep = rollout_correction(old, roll, torch.tensor([0, 0, 0]), "mis", threshold=1e12)
    assert w.tolist() == pytest.approx([math.exp(20.0)] * 3, rel=1e-6) and keep.all()
