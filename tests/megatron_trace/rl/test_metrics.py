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
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(0.3, rel=1e-12)
    assert m["is_ratio_clip_frac"] == 0.0 and m["tokens"] == 3
    assert mismatch_metrics(train, rollout, clip=1.5)["is_ratio_clip_frac"] == pytest.approx(1 / 3)  # e^0.5 > 1.5
    assert mismatch_metrics(train, rollout, clip=1.4)["is_ratio_clip_frac"] == pytest.approx(2 / 3)  # e^-0.4 < 1/1.4


def test_identical_policies_have_no_mismatch_and_bad_input_is_refused():
    x = [torch.randn(5)]
    m = mismatch_metrics(x, x)
    assert m["k3_kl"] == 0 and m["kl"] == 0 and m["chi2_token"] == 0 and m["probs_diff_max"] == 0
    with pytest.raises(ValueError, match="differ in shape"):
        mismatch_metrics([torch.zeros(3)], [torch.zeros(4)])
    with pytest.raises(ValueError, match="same non-zero number"):
        mismatch_metrics([], [])
