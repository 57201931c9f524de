"""The engine's RowStore against plain per-sequence lists: interleaved prefill chunks and decode
steps of many sequences (more than its initial slots, so its buffers grow), keys of one and of
several rows per token, parted (bits, scales, g) rows and BF16 rows; slots reused after a take."""

import random

import pytest
import torch

from sglang_rollout.engine.row_store import RowStore
from sglang_rollout.engine.sequence import Sequence

PER = {(0, "qkv"): 1, (0, "k"): 2, (1, "fc2"): 4, "experts": 1}


def _rows(key, n, g):
    r = PER[key] * n
    if key == (0, "qkv"):  # the fused kernel's parts
        return (torch.randint(0, 256, (r, 4), generator=g, dtype=torch.uint8),
                torch.randint(0, 256, (r, 2), generator=g, dtype=torch.uint8), torch.rand(r, generator=g))
    if key == "experts":
        return torch.randint(0, 32, (r, 3, 2), generator=g).to(torch.uint8)
    return torch.randn(r, 8, generator=g).to(torch.bfloat16)


def _cat(parts):
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts, strict=True))
    return torch.cat(parts)


def test_row_store_returns_each_sequences_rows_in_token_order():
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    store = RowStore(slot_tokens=12, rows_per_token=PER.__getitem__, slots=2)
    live = [Sequence(seq_id=f"s{i}", group_id="g", tokens=[], prompt_len=0) for i in range(9)]
    want = {s.seq_id: {k: [] for k in PER} for s in live}
    took = 0
    for _step in range(60):
        segs = [(s, min(rng.choice([1, 1, 3]), 12 - s.rows_stored))
                for s in rng.sample(live, rng.randint(1, len(live)))]
        rows = {}
        for key in PER:
            pieces = [_rows(key, n, g) for _, n in segs]
            for (s, _), p in zip(segs, pieces, strict=True):
                want[s.seq_id][key].append(p)
            rows[key] = _cat(pieces)
        store.write(rows, segs)
        # full sequences finish, others at random; new ones take their slots
        for done in [s for s in live if s.rows_stored == 12 or rng.random() < 0.1]:
            live.remove(done)
            got = store.take(done)
            assert done.row_slot == -1
            assert (got == {}) == (not want[done.seq_id]["experts"])  # never written: nothing stored
            for key in PER if got else ():
                ref = _cat(want[done.seq_id][key])
                if isinstance(ref, tuple):
                    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got[key], ref, strict=True))
                else:
                    assert got[key].dtype == ref.dtype and torch.equal(got[key], ref)
            took += 1
            new = Sequence(seq_id=f"n{took}", group_id="g", tokens=[], prompt_len=0)
            live.append(new)
            want[new.seq_id] = {k: [] for k in PER}
    assert took >= 5 and store.num_slots >= 8  # grew from 2 slots


def test_row_store_refuses_what_it_cannot_hold():
    store = RowStore(slot_tokens=4, rows_per_token=lambda key: 1)
    seq = Sequence(seq_id="a", group_id="g", tokens=[], prompt_len=0)
    store.write({"x": torch.zeros(3, 2)}, [(seq, 3)])
    with pytest.raises(RuntimeError, match="more than the 4"):
        store.write({"x": torch.zeros(2, 2)}, [(seq, 2)])
    with pytest.raises(RuntimeError, match="captures the same"):
        store.write({"y": torch.zeros(1, 2)}, [(seq, 1)])
