"""Flip counts of the RL step's trainer forward under tensor and expert parallelism, against one
process: every rank counts its own token, head and column shards and its dispatched expert rows,
and the sums cover each element of the micro-batch exactly once."""

import torch

from megatron_trace.megatron.spawn import spawn
from megatron_trace.model_config import PRESETS
from tests.support import scenarios as sc

CFG = PRESETS["tiny"]
PROMPTS = [(1, 2, 3, 4), (9, 8, 7)]
GROUP = 3  # 3 x (12 + 11) = 69 tokens: odd, so two tensor-parallel ranks pad one token


def run_counts(rank, *, sd, precision):
    """Per layer: elements counted, round-to-nearest flips, applied-code flips (summed over ranks)."""
    from megatron_trace.config import RLSection
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.trainer import MegatronTrainer
    from megatron_trace.megatron.weights import load_full_state_dict
    from megatron_trace.rl.mismatch import FlipCounter
    from megatron_trace.rl.rollout_batch import rollout
    from megatron_trace.rl.step import response_logprobs
    from megatron_trace.rollout import SamplingParams
    from sglang_rollout.engine import EngineConfig, TraceEngine

    trainer = build_model(CFG, "bf16", params_dtype=torch.float32, grouped_gemm=True)
    load_full_state_dict(trainer, sd)
    engine = TraceEngine(CFG, EngineConfig(precision="fp4", guide="all"))
    engine.update_weights(sd, 0)
    rl = RLSection(mode=precision, group_size=GROUP)
    batch = rollout(engine, PROMPTS, lambda prompt, response: 0.0, rl.group_size,
                    SamplingParams(max_new_tokens=8, seed=1), 0)
    counter = FlipCounter()
    response_logprobs(MegatronTrainer(trainer, CFG), batch, rl, observer=counter)
    counter.rates(CFG.num_layers)  # sums the counts over ranks
    tokens = sum(len(PROMPTS[int(s.group_id.split("-p")[1])]) + len(s.tokens) for s in batch.out.samples)
    return {"total": counter.total, "rne": counter.rne, "actual": counter.actual, "tokens": tokens}


def test_flip_counts_under_tensor_and_expert_parallelism_match_one_process():
    sd = sc.random_full_state_dict(CFG, seed=3)
    one = spawn(run_counts, {}, sd=sd, precision="fp4-qat")[0]
    assert one["tokens"] == 69 and set(one["total"]) == set(range(CFG.num_layers))
    for layout in ({"tp": 2}, {"ep": 2, "dp": 2}, {"tp": 2, "ep": 2, "etp": 1}):
        got = spawn(run_counts, layout, sd=sd, precision="fp4-qat")[0]
        pad = 1 if layout.get("tp") else 0  # the padding token copies the first token: counted too
        dp = layout.get("dp", 1)  # each data-parallel rank counts the whole batch here
        for layer, n in one["total"].items():
            assert got["total"][layer] * 69 == n * (69 + pad) * dp, (layout, layer)
            rate, want = got["rne"][layer] / got["total"][layer], one["rne"][layer] / n
            assert want > 1e-3 and abs(rate - want) < 0.05 * want, (layout, layer, rate, want)
    # following the guidance, the trainer's codes are the engine's everywhere: rows line up
    for layout in ({"tp": 2}, {"tp": 2, "ep": 2, "etp": 1}):
        got = spawn(run_counts, layout, sd=sd, precision="trace")[0]
        assert all(got["actual"][L] == 0 < got["rne"][L] for L in got["total"]), (layout, got)
