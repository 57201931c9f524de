"""Batched sampling: token frequencies against the float64 distribution, streams independent of
the batch, the Triton kernel against the torch path, log-probabilities, bad input."""

import math

import pytest
import torch

from megatron_trace.rollout import SamplingParams
from sglang_rollout.engine.sampler import sample_key, sample_rows
from tests.support.fp4 import triton_device
from trace_kernels.sampling import gumbel_argmax, sample_tempered

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])


def _reference(params: SamplingParams) -> torch.Tensor:
    """float64 probabilities of each token: softmax(logits / T), restricted to the top-k, then to
    the smallest set of the most likely tokens whose mass before each reaches below top-p."""
    p = torch.softmax(LOGITS.double() / params.temperature, -1)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order[: params.top_k or len(p)]] = True
    p = torch.where(keep, p, 0.0) / torch.where(keep, p, 0.0).sum()
    mass = 0.0
    for i in order.tolist():
        if keep[i] and mass >= params.top_p:
            keep[i] = False
        mass += float(p[i])
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
def test_token_frequencies_follow_the_distribution(params):
    n = 40000
    tokens, _ = sample_rows(LOGITS.expand(n, -1), params, [sample_key(1, f"s{i}") for i in range(n)], [0] * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).double() / n
    want = _reference(params)
    sigma = (want * (1 - want) / n).sqrt()
    assert torch.all((freq - want).abs() <= 5 * sigma + 1e-12), (freq, want)
    assert torch.all(freq[want == 0] == 0)


def test_a_rows_token_does_not_depend_on_its_batch_and_steps_differ():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=g)
    params = SamplingParams(temperature=1.0)
    keys, steps = [sample_key(3, f"g/{i}") for i in range(6)], [0, 5, 2, 9, 0, 1]
    together, _ = sample_rows(logits, params, keys, steps)
    alone = [sample_rows(logits[i:i + 1], params, keys[i:i + 1], steps[i:i + 1])[0][0] for i in range(6)]
    assert together == alone
    flat = torch.zeros(1, 500)  # uniform: the token is the stream's argmax of noise alone
    drawn = {sample_rows(flat, params, [keys[0]], [s])[0][0] for s in range(40)}
    assert len(drawn) > 30  # a new draw at every step


def test_triton_kernel_draws_the_torch_paths_tokens():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3000, generator=g) * 3
    x[3, ::2] = -float("inf")  # masked tokens never win
    keys = torch.tensor([sample_key(7, f"r{i}") for i in range(16)])
    steps = torch.arange(16) * 11
    want = gumbel_argmax(x, keys, steps, backend="torch")
    got = gumbel_argmax(x.to(triton_device()), keys, steps, backend="triton").cpu()  # the GPU, else the interpreter
    assert torch.equal(got, want)
    assert want[3] % 2 == 1


def _check_fused(logits: torch.Tensor, temperature: float, keys: torch.Tensor, steps: torch.Tensor,
                 device: str) -> None:
    """The fused kernel on `device` against the unfused torch path on the CPU (tokens bit for bit)
    and float64 log_softmax (log-probabilities)."""
    scaled = logits.float() / temperature
    want = gumbel_argmax(scaled, keys, steps, backend="torch")
    tokens, logps = sample_tempered(logits.to(device), temperature, keys, steps, backend="triton")
    assert torch.equal(tokens.cpu(), want)
    ref = torch.log_softmax(scaled.double(), -1).gather(-1, want[:, None])[:, 0]
    torch.testing.assert_close(logps.cpu().double(), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_kernel_draws_the_unfused_tokens_and_log_softmax(temperature):
    """Rows split over several programs (V over one loop block), bf16 logits as the model writes them."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 9000, generator=g) * 3).bfloat16()
    logits[1, 4100] = 40.0  # one token dominates row 1, in a split past the first
    keys = torch.tensor([sample_key(5, f"t{i}") for i in range(3)])
    steps = torch.tensor([0, 17, 3])
    _check_fused(logits, temperature, keys, steps, triton_device())
    nan = logits.clone()
    nan[2, 8999] = float("nan")
    _, logps = sample_tempered(nan.to(triton_device()), temperature, keys, steps, backend="triton")
    assert logps[:2].isfinite().all() and logps[2].isnan()


def test_fused_kernel_refuses_bad_input():
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sample_tempered(x, 0.0, torch.tensor([1, 2]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"keys and steps \[B\]"):
        sample_tempered(x, 1.0, torch.tensor([1]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="32-bit"):
        sample_tempered(x.to(triton_device()), 1.0, torch.tensor([1, -1]), torch.tensor([0, 0]), backend="triton")


def test_logprob_is_the_full_tempered_distributions_and_greedy_takes_the_max():
    params = SamplingParams(temperature=0.5, top_k=2)
    tokens, logps = sample_rows(LOGITS[None], params, [sample_key(0, "a")], [0])
    want = torch.log_softmax(LOGITS.double() / 0.5, -1)[tokens[0]]
    assert tokens[0] in (0, 1) and math.isclose(logps[0], float(want), rel_tol=1e-6)
    tokens, logps = sample_rows(LOGITS[None], SamplingParams(temperature=0), [0], [0])
    assert tokens == [0] and math.isclose(logps[0], float(torch.log_softmax(LOGITS.double(), -1)[0]), rel_tol=1e-6)


def test_nan_logits_are_refused_by_row():
    logits = torch.zeros(3, 10)
    logits[1, 4] = float("nan")
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0)):
        with pytest.raises(ValueError, match=r"rows \[1\] of the logits hold NaN"):
            sample_rows(logits, params, [1, 2, 3], [0, 0, 0])


def test_bad_streams_are_refused():
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="32-bit"):
        gumbel_argmax(x, torch.tensor([0, 2**32]), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"keys and steps \[B\]"):
        gumbel_argmax(x, torch.tensor([0]), torch.zeros(2, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernel_draws_the_cpu_tokens_at_a_full_vocabulary():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 151936, generator=g) * 2
    keys = torch.tensor([sample_key(11, f"q{i}") for i in range(64)])
    steps = torch.arange(64) * 37
    want = gumbel_argmax(x, keys, steps, backend="torch")
    assert torch.equal(gumbel_argmax(x.cuda(), keys, steps).cpu(), want)
    assert torch.equal(gumbel_argmax(x.cuda(), keys, steps, backend="torch").cpu(), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gpu_fused_kernel_at_a_full_vocabulary(temperature):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 151936, generator=g) * 2).bfloat16()
    keys = torch.tensor([sample_key(12, f"f{i}") for i in range(64)])
    _check_fused(logits, temperature, keys, torch.arange(64) * 41, "cuda")
