"""`trace-rl mismatch` on the tiny model: the project's headline experiment, end to end."""

import json

from megatron_trace.megatron.spawn import spawn


def run_cli(rank, argv):
    from megatron_trace.cli import main

    main(argv)


def test_trace_removes_the_fp4_mismatch(tmp_path):
    out = tmp_path / "mismatch.json"
    spawn(run_cli, {}, argv=["mismatch", "--model", "tiny", "--prompt-source", "random", "--prompts", "2",
                             "--samples", "2", "--max-new-tokens", "12",
                             "--json", str(out)])
    r = json.loads(out.read_text())
    assert set(r) == {"bf16", "fp4-rollout", "fp4-qat", "trace"}
    for mode in r:
        assert {"k3_kl", "train_rollout_logprob_abs_diff", "kl", "chi2_token"} <= set(r[mode])
    assert r["trace"]["k3_kl"] * 10 <= r["fp4-qat"]["k3_kl"]
    assert r["trace"]["k3_kl"] < 2 * r["bf16"]["k3_kl"]
    assert r["trace"]["residual_flip_rate"] == 0 and r["trace"]["flip_rate"] > 0  # dense, every layer
    assert r["fp4-qat"]["flip_rate"] > 0 and r["trace"]["guidance_bits_per_element"] > 1.5


def test_sparse_guidance_costs_fewer_bits(tmp_path):
    out = tmp_path / "sparse.json"
    spawn(run_cli, {}, argv=["mismatch", "--model", "tiny", "--prompt-source", "random", "--modes", "trace",
                             "--coding", "sparse", "--prompts", "2",
                             "--max-new-tokens", "8", "--json", str(out)])
    r = json.loads(out.read_text())["trace"]
    assert r["guidance_bits_per_element"] < 1.5  # dense is 1.5 bits + one FP32 per row
    assert r["residual_flip_rate"] < r["flip_rate"]
