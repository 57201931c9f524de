"""Distributed checkpoints: saved under one layout, loaded under another, read back as full tensors.

Two spawns cover it all (each costs seconds per process): one process saves checkpoint A from
a random full state dict (sequential experts), loads it into a grouped-GEMM model and checks the
error paths; TP2 x EP2 x PP2 loads A into sequential-expert models and saves checkpoint B from
grouped-GEMM models. The parent reads A and B back with `iter_full_tensors`, without a process group.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_trace.checkpoint.dist import (
    full_tensor_names,
    iter_full_tensors,
    read_config,
)
from megatron_trace.megatron.spawn import spawn, world_size
from megatron_trace.model_config import PRESETS
from tests.support.ranks import skip_unless_gpus_for
from tests.support.scenarios import random_full_state_dict

CFG = PRESETS["tiny"]
PARALLEL = dict(tp=2, pp=2, ep=2, etp=1)


def _mismatches(model, full) -> list[str]:
    """Global names of this rank's parameters that are not bitwise this rank's slice of `full`."""
    from megatron_trace.megatron.weights import global_name, shard_of

    bad = []
    for local, param in model.state_dict().items():
        if not local.endswith("_extra_state"):
            name = global_name(local, model)
            want = shard_of(full[name], name)
            if param.dtype != want.dtype or not torch.equal(param, want):
                bad.append(name)
    return bad


def _built(full, grouped_gemm):
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.weights import load_full_state_dict

    model = build_model(CFG, "bf16", grouped_gemm=grouped_gemm)
    if full is not None:
        load_full_state_dict(model, full)
    return model


def _listing(directory) -> dict[str, int]:
    return {f: os.stat(os.path.join(directory, f)).st_mtime_ns for f in os.listdir(directory)}


def _errors(exc_type, fn, *args) -> str:
    """The message of the `exc_type` fn(*args) raises ('' if it raises none)."""
    try:
        fn(*args)
    except exc_type as e:
        return str(e)
    return ""


def _one_process(rank, *, full, a, empty):
    from megatron_trace.checkpoint.dist import load_model, save_model
    from megatron_trace.megatron.model import build_model

    theta = CFG.replace(rope_theta=1e6)  # not the presets' 1e4, nor Megatron's GPTModel default
    save_model(build_model(theta, "bf16"), theta, os.path.join(empty, "..", "theta"))
    model = _built(full, grouped_gemm=False)
    save_model(model, CFG, a)
    before = _listing(a)
    exists = _errors(FileExistsError, save_model, model, CFG, a)
    intact = _listing(a) == before and not [f for f in os.listdir(os.path.dirname(a)) if ".tmp-" in f]

    grouped = _built(None, grouped_gemm=True)
    load_model(grouped, a)
    other = build_model(CFG.replace(rms_norm_eps=1e-5), "bf16")
    return dict(exists=exists, intact=intact, grouped_mismatches=_mismatches(grouped, full),
                no_metadata=_errors(FileNotFoundError, load_model, grouped, empty),
                other_config=_errors(ValueError, load_model, other, a))


def _parallel(rank, *, full, a, b):
    from megatron_trace.checkpoint.dist import load_model, save_model

    save_model(_built(full, grouped_gemm=True), CFG, b)
    sequential = _built(None, grouped_gemm=False)
    load_model(sequential, a)
    return _mismatches(sequential, full)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    skip_unless_gpus_for(PARALLEL)
    root = tmp_path_factory.mktemp("ckpt")
    paths = dict(a=str(root / "a"), b=str(root / "b"), empty=str(root / "empty"))
    os.mkdir(paths["empty"])
    full = random_full_state_dict(CFG, seed=3)
    one = spawn(_one_process, {}, full=full, a=paths["a"], empty=paths["empty"])[0]
    parallel = spawn(_parallel, PARALLEL, full=full, a=paths["a"], b=paths["b"])
    return full, paths, one, parallel


def test_one_process_checkpoint_loads_bitwise_under_tp2_ep2_pp2_and_into_grouped_experts(run):
    _, _, one, parallel = run
    assert one["grouped_mismatches"] == []
    assert parallel == [[]] * world_size(PARALLEL)


@pytest.mark.parametrize("which", ["a", "b"])  # saved by one process, by TP2 x EP2 x PP2
def test_full_tensors_are_exactly_the_saved_full_state_dict(run, which):
    full, paths, _, _ = run
    got = dict(iter_full_tensors(paths[which]))
    assert sorted(got) == sorted(full)
    bad = [n for n in full if got[n].dtype != full[n].dtype or not torch.equal(got[n], full[n])]
    assert bad == []
    assert full_tensor_names(paths[which]) == {n: (tuple(t.shape), t.dtype) for n, t in full.items()}
    assert read_config(paths[which]) == CFG


def test_a_models_rope_theta_is_saved(run):
    _, paths, _, _ = run
    assert read_config(os.path.join(paths["empty"], "..", "theta")).rope_theta == 1e6


def test_iter_full_tensors_by_name(run):
    full, paths, _, _ = run
    names = ["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", "output_layer.weight"]
    got = list(iter_full_tensors(paths["b"], names))
    assert [n for n, _ in got] == names and all(torch.equal(t, full[n]) for n, t in got)
    with pytest.raises(KeyError, match="local_experts.4"):
        iter_full_tensors(paths["b"], ["decoder.layers.0.mlp.experts.local_experts.4.linear_fc2.weight"])


def test_errors(run):
    _, paths, one, _ = run
    assert "exists" in one["exists"] and one["intact"]
    assert paths["empty"] in one["no_metadata"]
    assert "rms_norm_eps" in one["other_config"]
    for fn in (iter_full_tensors, full_tensor_names, read_config):
        with pytest.raises(FileNotFoundError, match="empty"):
            fn(paths["empty"])
