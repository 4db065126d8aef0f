"""The compiled top-k sampling distributions (kernels/cpu_sampling.py) against their torch definition,
on fresh random logits of many shapes, and the fallback where the kernel is unavailable."""
from __future__ import annotations

import pytest
import torch

from aspire_bench.decoders.base import SamplingParams
from aspire_bench.decoders.common import _top_p, logits_to_probs
from aspire_bench.kernels import cpu_build, cpu_sampling
from aspire_bench.kernels.cpu_build import KernelBuildError

try:
    cpu_build.compiler()
except KernelBuildError as e:  # pragma: no cover
    pytest.skip(f"no C++ compiler ({e}): the sampling kernel is untested here", allow_module_level=True)


def reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The definition, in torch ops: temperature, the k largest, softmax over them, top-p, scatter."""
    vals, idx = torch.topk(logits / temperature, top_k, dim=-1)
    return torch.zeros_like(logits).scatter_(-1, idx, _top_p(torch.softmax(vals, dim=-1), top_p))


@pytest.mark.parametrize("vocab", [4096, 1000, 37])
@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (5, 0.9), (50, 0.9), (50, 1.0), (200, 0.5)])
def test_top_k_probs_match_the_definition(vocab, top_k, top_p, seed):
    g = torch.Generator().manual_seed(seed)
    top_k = min(top_k, vocab - 1)
    # flat to peaked rows in one batch: logit scales from 0.3 to 12
    scale = torch.logspace(-0.5, 1.1, 12)[:, None]
    logits = torch.randn(12, vocab, generator=g) * scale
    for temperature in (0.3, 0.7, 1.5):
        got = cpu_sampling.top_k_probs(logits, temperature, top_k, top_p)
        want = reference(logits, temperature, top_k, top_p)
        assert got is not None and got.shape == logits.shape
        assert torch.equal(got > 0, want > 0), "a different set of tokens kept"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got.sum(-1), torch.ones(12), rtol=1e-5, atol=1e-6)


def test_rows_do_not_depend_on_each_other_and_ties_keep_the_lowest_ids(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(9, 300, generator=g) * 3
    batch = cpu_sampling.top_k_probs(logits, 0.7, 20, 0.9)
    for r in range(9):
        assert torch.equal(cpu_sampling.top_k_probs(logits[r:r + 1], 0.7, 20, 0.9)[0], batch[r])
    tied = torch.zeros(1, 64)
    tied[0, 40:] = 1.0  # 24 equal maxima, top-3: the first three of them
    assert torch.nonzero(cpu_sampling.top_k_probs(tied, 1.0, 3, 1.0)[0]).flatten().tolist() == [40, 41, 42]


def test_masked_logits_and_fewer_finite_values_than_k():
    logits = torch.full((2, 100), -float("inf"))
    logits[0, [3, 7, 9]] = torch.tensor([1.0, 2.0, 0.5])  # 3 finite values, top-k 10
    logits[1] = torch.linspace(-5, 5, 100)
    logits[1, ::2] = -float("inf")
    got = cpu_sampling.top_k_probs(logits, 1.0, 10, 1.0)
    assert torch.nonzero(got[0]).flatten().tolist() == [3, 7, 9]
    torch.testing.assert_close(got[0, [3, 7, 9]], torch.softmax(torch.tensor([1.0, 2.0, 0.5]), 0))
    torch.testing.assert_close(got[1], reference(logits[1:], 1.0, 10, 1.0)[0])


def test_logits_to_probs_uses_it_on_cpu_fp32_and_falls_back_with_the_same_distribution(monkeypatch, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 500, generator=g) * 4
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9)
    fast = logits_to_probs(logits, params)
    assert torch.equal(fast, cpu_sampling.top_k_probs(logits, 0.7, 50, 0.9))
    monkeypatch.setattr(cpu_sampling, "load_library", lambda: None)  # no compiler: the torch ops
    torch.testing.assert_close(logits_to_probs(logits, params), fast, rtol=1e-5, atol=1e-7)
    assert cpu_sampling.top_k_probs(logits.double(), 0.7, 50, 0.9) is None  # other dtypes: torch
