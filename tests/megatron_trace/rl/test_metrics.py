"""Mismatch metrics against a plain float64 re-derivation on hand-made log-probabilities."""

import math

import pytest
import torch

from megatron_trace.rl.metrics import mismatch_metrics


def test_metrics_by_hand():
    f64 = torch.float64
    train = [torch.tensor([-1.0, -2.0], dtype=f64), torch.tensor([-0.5], dtype=f64)]
    rollout = [torch.tensor([-1.5, -2.0], dtype=f64), torch.tensor([-0.1], dtype=f64)]
    m = mismatch_metrics(train, rollout)
    r = [0.5, 0.0, -0.4]
    assert m["k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in r) / 3, rel=1e-12)
    assert m["kl"] == pytest.approx(-sum(r) / 3, rel=1e-12)
    assert m["chi2_token"] == pytest.approx(sum(math.exp(2 * x) for x in r) / 3 - 1, rel=1e-12)
    diffs = [abs(math.exp(a) - math.exp(b)) for a, b in [(-1.0, -1.5), (-2.0, -2.0), (-0.5, -0.1)]]
    assert m["probs_diff_mean"] == pytest.approx(sum(diffs) / 3, rel=1e-12)
    assert m["probs_diff_max"] == pytest.approx(max(diffs), rel=1e-12)
    assert m["log_ppl_diff"] == pytest.approx(((-1.75 + 1.5) + (-0.1 + 0.5)) / 2, rel=1e-12)
    # slime's default: each sample's token mean of |r|, then the mean over samples
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(((0.5 + 0.0) / 2 + 0.4) / 2, rel=1e-12)
    assert m["rollout_is_ratio_fraction_high"] == 0.0 and m["rollout_is_ratio_fraction_low"] == 0.0
    assert m["tokens"] == 3
    m = mismatch_metrics(train, rollout, clip=1.5)  # e^0.5 > 1.5
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3) and m["rollout_is_ratio_fraction_low"] == 0
    m = mismatch_metrics(train, rollout, clip=1.4)  # and e^-0.4 < 1/1.4
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)


def test_metrics_against_verl_and_slime_on_a_random_batch():
    """Ragged samples with ratios far outside [1/2, 2] and one |r| > 20: verl's token means with the
    +-20 clamp in chi2 and the IS fractions, slime's per-sample mean of |r|, in float64 lists."""
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 17, 40, 1, 9]
    rollout = [-torch.rand(n, generator=gen, dtype=torch.float64) * 4 for n in lengths]
    train = [r + torch.randn(len(r), generator=gen, dtype=torch.float64) for r in rollout]
    train[3] = rollout[3] + 25.0  # overflow territory: verl clamps before exponentiating
    m = mismatch_metrics(train, rollout)
    rs = [[a - b for a, b in zip(t.tolist(), ro.tolist(), strict=True)] for t, ro in zip(train, rollout, strict=True)]
    flat = [x for r in rs for x in r]
    safe = [math.exp(min(max(x, -20.0), 20.0)) for x in flat]
    assert m["chi2_token"] == pytest.approx(sum(w * w for w in safe) / len(flat) - 1, rel=1e-12)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(sum(w > 2 for w in safe) / len(flat))
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(sum(w < 0.5 for w in safe) / len(flat))
    slime = sum(sum(abs(x) for x in r) / len(r) for r in rs) / len(rs)
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(slime, rel=1e-12)
    assert m["train_rollout_logprob_abs_diff"] != pytest.approx(sum(abs(x) for x in flat) / len(flat), rel=1e-3)


def test_identical_policies_have_no_mismatch_and_bad_input_is_refused():
    x = [torch.randn(5)]
    m = mismatch_metrics(x, x)
    assert m["k3_kl"] == 0 and m["kl"] == 0 and m["chi2_token"] == 0 and m["probs_diff_max"] == 0
    with pytest.raises(ValueError, match="differ in shape"):
        mismatch_metrics([torch.zeros(3)], [torch.zeros(4)])
    with pytest.raises(ValueError, match="same non-zero number"):
        mismatch_metrics([], [])
