"""A job's ranks and GPUs (`rl.job_layout`): engine ranks of dist.engine_tp GPUs each, after the
trainer ranks' GPUs, on one node (torchrun) and on engine nodes (SLURM); bad combinations
refused at start with the settings named."""

import pytest

from megatron_trace.config import load_config
from megatron_trace.rl.job_layout import (
    check_engine_settings,
    check_local_gpus,
    engine_instances,
    job_shape,
    rank_gpus,
)
from megatron_trace.rl.plan import engine_kv_blocks, gpu_counts, kv_blocks


def _gpus_by_node(tasks_per_node, trainers, engine_tp):
    """{(node, local GPU): rank} for every rank, laid out as srun / torchrun number them."""
    used, rank = {}, 0
    for node, tasks in enumerate(tasks_per_node):
        for local in range(tasks):
            for gpu in rank_gpus(rank, local, trainers, engine_tp if rank >= trainers else 1):
                assert (node, gpu) not in used, f"GPU {gpu} of node {node}: ranks {used[(node, gpu)]} and {rank}"
                used[(node, gpu)] = rank
            rank += 1
    return used


def test_one_node_trainers_first_then_engines_of_engine_tp_gpus():
    # launch/local.sh: TRAINERS=2 ENGINES=2 with dist.engine_tp=3 on 8 GPUs
    assert [rank_gpus(r, r, 2, 3) for r in (2, 3)] == [[2, 3, 4], [5, 6, 7]]
    assert [rank_gpus(r, r, 2, 1) for r in range(2)] == [[0], [1]]
    used = _gpus_by_node([4], 2, 3)
    assert sorted(used) == [(0, g) for g in range(8)]  # every GPU once, none twice
    cfg = load_config(None, ["rollout.backend=sglang", "dist.engine_ranks=2", "dist.engine_tp=3",
                             "cluster.gpus_per_node=8"])
    shape = job_shape(cfg)
    assert (shape.trainers, shape.engine_ranks, shape.engine_gpus, shape.tasks_per_node) == (2, 2, 6, (4,))
    assert gpu_counts(cfg) == (2, 6) and engine_instances(cfg) == 2


def test_engine_nodes_run_gpus_per_node_over_engine_tp_engine_ranks():
    cfg = load_config(None, ["rollout.backend=sglang", "dist.engine_tp=4", "cluster.nodes=3",
                             "cluster.engine_nodes=2", "cluster.gpus_per_node=8"])
    shape = job_shape(cfg)
    assert (shape.trainers, shape.engine_ranks, shape.tasks_per_node, shape.uniform) == (8, 4, (8, 2, 2), False)
    used = _gpus_by_node(shape.tasks_per_node, 8, 4)
    assert sorted(used) == [(n, g) for n in range(3) for g in range(8)]
    assert [used[(1, 0)], used[(1, 4)], used[(2, 0)], used[(2, 7)]] == [8, 9, 10, 11]
    assert gpu_counts(cfg) == (8, 16) and engine_instances(cfg) == 4
    # each engine holds its share of the step: 16 groups over 4 engines
    assert engine_kv_blocks(cfg) == kv_blocks(4, 8, 16, 5)
    # the same engine GPUs as TP2 engines: 8 of them
    assert engine_instances(cfg, 2) == 8 and engine_kv_blocks(cfg, 2) == kv_blocks(2, 8, 16, 5)


@pytest.mark.parametrize("sets, message", [
    (["cluster.nodes=2", "cluster.engine_nodes=1", "dist.engine_tp=3"],
     "cluster.gpus_per_node=8 does not divide into engines of dist.engine_tp=3 GPUs"),
    (["cluster.nodes=2", "cluster.engine_nodes=1", "dist.engine_tp=2", "dist.engine_ranks=8"],
     r"dist.engine_ranks=8 disagrees with cluster.engine_nodes x gpus_per_node / dist.engine_tp = 1 x 8 / 2 = 4"),
    (["dist.engine_ranks=2", "dist.engine_tp=4"], r"dist.engine_ranks x dist.engine_tp = 2 x 4 engine GPUs leave no "
                                                  "trainer GPU"),
    (["dist.engine_ranks=1", "rollout.sglang={base_gpu_id: 3}"], r"rollout.sglang: \['base_gpu_id'\]"),
])
def test_bad_engine_layouts_are_refused_naming_the_settings(sets, message):
    cfg = load_config(None, ["rollout.backend=sglang", *sets])
    with pytest.raises(ValueError, match=message):
        check_engine_settings(cfg)
        gpu_counts(cfg)


def test_an_engine_of_several_gpus_needs_them_on_its_node():
    check_local_gpus([2, 3], 4, 2, is_engine=True)
    check_local_gpus([4], 4, 1, is_engine=True)  # one-GPU engines may share a GPU (the built-in engine's small runs)
    with pytest.raises(ValueError, match="dist.engine_tp=2: this engine rank's engine needs GPUs 3-4 of this node"):
        check_local_gpus([3, 4], 4, 2, is_engine=True)


def test_train_refuses_a_bad_engine_layout_at_start(tmp_path):
    """`trace-rl train` stops before any work, naming the settings."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    for sets, message in ((["rollout.backend=sglang", "cluster.nodes=2", "cluster.engine_nodes=1",
                            "dist.engine_tp=3"], "dist.engine_tp=3"),
                          (["dist.engine_tp=2"], "dist.engine_tp > 1: the built-in engine runs on one GPU")):
        run = subprocess.run([sys.executable, "-m", "megatron_trace.cli", "train",
                              *[a for s in [*sets, f"output_dir={tmp_path}"] for a in ("--set", s)]],
                             cwd=root, capture_output=True, text=True, timeout=300)
        assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]
        assert not (tmp_path / "checkpoints").exists()
