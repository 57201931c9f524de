"""The SGLang guidance capturer's two ways in: eager forwards file their rows by KV slot at once;
decode CUDA graphs stage them on the device in token order and `file_staged` files the real
tokens' rows after each replay. Both must leave the same rows in the host buffers: checked on
the CPU by staging as a graph's warm-up does, and on a GPU through a real torch.cuda.graph
(capture, then replays with new inputs: nothing in the recording path may sync with the host).
"""

from __future__ import annotations

import pytest
import torch

from sglang_rollout.sglang import capture
from trace_kernels.fp4 import quantize

K, CAPACITY, TOP_K = 64, 40, 2


@pytest.fixture(autouse=True)
def clean_capturer():
    yield
    capture.configure(())
    capture._taken.clear()


def _record_step(x_TK: torch.Tensor, h_TK: torch.Tensor) -> None:
    """What trace_fp4's sites do in one forward: qkv rows (one per token) and fc2 rows (TOP_K per
    token) arriving sorted by expert, with `order` giving each row's token-major index. No
    finiteness check, as in the sites' own quantization: it syncs with the host, which graph
    capture refuses."""
    q = quantize(x_TK, "nvfp4", scale="row", check_finite=False)
    capture.record(0, "qkv", x_TK, q.rounding())
    weight = torch.arange(1, TOP_K + 1, device=h_TK.device).repeat(h_TK.shape[0])[:, None]
    rows = h_TK.repeat_interleave(TOP_K, 0) * weight
    order = torch.arange(rows.shape[0], device=rows.device).flip(0)  # sorted by "expert": reversed here
    sorted_rows = rows[order]
    q_rows = quantize(sorted_rows, "nvfp4", scale="row", check_finite=False)
    capture.record(0, "fc2", sorted_rows, q_rows.rounding(), order=order)


def _rows(rid: str, slots: torch.Tensor) -> dict:
    capture.collect(rid, slots)
    return capture._taken.pop(rid)


@pytest.mark.parametrize("sparse", [None, {"tau": 0.25, "scale_coding": "near"}])
def test_a_staged_decode_graph_files_the_rows_an_eager_forward_files(sparse):
    """Rows staged by a graph of 8 tokens (5 real + 3 padding, written twice as warm-up and a
    replay would), filed after the step, equal the same 5 tokens recorded eagerly, for a plain
    site and one whose rows come in another order, in the dense and the sparse coding."""
    gen = torch.Generator().manual_seed(0)
    x, h = torch.randn(8, K, generator=gen), torch.randn(8, K, generator=gen)
    slots = torch.tensor([3, 17, 9, 30, 4])
    pairs = [(0, "qkv"), (0, "fc2")]
    policy = [*pairs, (0, "q_up")]  # as configure_from_env: every site named, the model records those it has

    capture.configure(policy, sparse)
    with capture.forward(slots, CAPACITY):
        _record_step(x[:5], h[:5])
    eager = _rows("trace/eager", slots)

    capture.configure(policy, sparse)
    with capture.graph_capture(8, 16):
        _record_step(torch.randn(8, K, generator=gen), torch.randn(8, K, generator=gen))  # warm-up: other values
        _record_step(x, h)  # the replay's
    with capture.forward(slots, CAPACITY):
        capture.file_staged()
    staged = _rows("trace/graph", slots)

    assert eager.keys() == staged.keys() == set(pairs)
    for key in pairs:
        assert len(eager[key]) == (3 if sparse is None else 5)
        for a, b in zip(eager[key], staged[key], strict=True):
            assert torch.equal(a, b), key
    # fc2's rows are filed token-major: token t's first slot holds the bits of h[t] * 1
    want = quantize(h[:5], "nvfp4", scale="row").rounding()[0]
    assert torch.equal(eager[(0, "fc2")][0].reshape(5, TOP_K, -1)[:, 0], want)


def test_a_graph_that_staged_nothing_and_a_graph_too_large_are_refused():
    capture.configure([(1, "qkv")])
    with capture.forward(torch.tensor([1, 2]), CAPACITY), pytest.raises(RuntimeError, match="recorded no rows"):
        capture.file_staged()
    with pytest.raises(ValueError, match="decode graph of 9 tokens"), capture.graph_capture(9, 8):
        pass
    with capture.graph_capture(4, 8), pytest.raises(ValueError, match="7 rows for 4 tokens"):
        capture.record(1, "qkv", torch.zeros(7, K), quantize(torch.ones(7, K), "nvfp4", scale="row").rounding())


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="torch.cuda.graph needs a GPU (the CPU test above stages the same way)")
@pytest.mark.parametrize("sparse", [None, {"tau": 0.25, "scale_coding": "lsb"}, {"tau": 0.25, "scale_coding": "near"}])
def test_recording_inside_a_real_cuda_graph_files_what_eager_recording_files(sparse):
    """Record inside torch.cuda.graph's capture (any host sync or pageable host-to-device copy
    there raises), replay with new inputs, file: the rows are those of an eager forward on
    those inputs, in the dense coding and both sparse ones."""
    pairs = [(0, "qkv"), (0, "fc2")]
    slots = torch.tensor([5, 6, 7, 1, 2, 3])
    inputs = [(torch.randn(8, K, device="cuda"), torch.randn(8, K, device="cuda")) for _ in range(2)]
    eager = []
    for x_in, h_in in inputs:
        capture.configure(pairs, sparse)
        with capture.forward(slots.cuda(), CAPACITY):
            _record_step(x_in[:6], h_in[:6])
        eager.append(_rows("trace/eager", slots))

    capture.configure(pairs, sparse)
    x, h = torch.zeros(8, K, device="cuda"), torch.zeros(8, K, device="cuda")
    with capture.graph_capture(8, 8):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _record_step(x.normal_(), h.normal_())  # warm-up, as SGLang's capture does
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _record_step(x, h)
    for (x_in, h_in), want in zip(inputs, eager, strict=True):
        x.copy_(x_in), h.copy_(h_in)
        graph.replay()
        with capture.forward(slots.cuda(), CAPACITY):
            capture.file_staged()
        staged = _rows("trace/graph", slots)
        for key in pairs:
            for a, b in zip(want[key], staged[key], strict=True):
                assert torch.equal(a, b), key


def test_the_one_host_copy_gives_back_every_part_whatever_its_size_and_dtype():
    """Parts of odd byte counts before float32 / float64 ones (each starts aligned in the copy)."""
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randint(0, 256, (3, 3), generator=gen, dtype=torch.uint8), torch.randn(5, generator=gen),
             torch.randint(0, 256, (1,), generator=gen, dtype=torch.uint8), torch.randn(2, 3, generator=gen).double(),
             torch.zeros(0, 4, dtype=torch.uint8)]
    back = capture._to_host(parts)
    assert [(b.dtype, b.shape) for b in back] == [(p.dtype, p.shape) for p in parts]
    assert all(torch.equal(a, b) for a, b in zip(parts, back, strict=True))


def test_an_eager_forward_files_its_rows_when_it_ends_and_none_when_it_fails():
    gen = torch.Generator().manual_seed(4)
    x, h = torch.randn(3, K, generator=gen), torch.randn(3, K, generator=gen)
    slots = torch.tensor([7, 2, 11])
    capture.configure([(0, "qkv"), (0, "fc2")])
    with pytest.raises(RuntimeError, match="a later layer failed"), capture.forward(slots, CAPACITY):
        _record_step(x, h)
        raise RuntimeError("a later layer failed")
    assert not capture._buffers and not capture._pending  # nothing half-filed
    with capture.forward(slots, CAPACITY):
        _record_step(x, h)
        assert not capture._buffers  # not before the forward ends
    rows = _rows("trace/eager", slots)
    want = quantize(x, "nvfp4", scale="row").rounding()
    assert all(torch.equal(a, b) for a, b in zip(rows[(0, "qkv")], want, strict=True))


def test_an_eager_forward_files_early_once_its_rows_pass_the_byte_limit(monkeypatch):
    """Rows held past PENDING_BYTES are filed at once (a bound on the device memory they hold);
    what is filed is the same."""
    gen = torch.Generator().manual_seed(5)
    x, h = torch.randn(3, K, generator=gen), torch.randn(3, K, generator=gen)
    slots = torch.tensor([7, 2, 11])
    capture.configure([(0, "qkv"), (0, "fc2")])
    with capture.forward(slots, CAPACITY):
        _record_step(x, h)
    want = _rows("trace/eager", slots)
    capture.configure([(0, "qkv"), (0, "fc2")])
    monkeypatch.setattr(capture, "PENDING_BYTES", 1)
    with capture.forward(slots, CAPACITY):
        _record_step(x, h)
        assert capture._buffers and not capture._pending  # filed as they came
    got = _rows("trace/eager", slots)
    assert all(torch.equal(a, b) for key in want for a, b in zip(want[key], got[key], strict=True))
