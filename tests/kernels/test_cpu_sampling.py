"""The compiled top-k sampling distributions (kernels/cpu_sampling.py) against their torch definition,
on fresh random logits of many shapes, and the fallback where the kernel is unavailable."""
from __future__ import annotations

import pytest
import torch

from aspire_bench.decoders.base import SamplingParams
from aspire_bench.decoders.sampler import _top_p, logits_to_probs
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
    zeros = torch.full((1, 64), -1.0)
    zeros[0, [5, 9, 20]], zeros[0, [7, 30]] = -0.0, 0.0  # -0 equals +0: a tie, kept by lowest id
    assert torch.nonzero(cpu_sampling.top_k_probs(zeros, 1.0, 3, 1.0)[0]).flatten().tolist() == [5, 7, 9]


@pytest.mark.parametrize("vocab", [4096, 37])
def test_nan_logits_are_never_kept(vocab, seed):
    """NaN logits (also where the threshold's strided sample reads) get no mass; the rest is the
    definition over the numbers, with -inf entries among them."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, vocab, generator=g) * 3
    stride = vocab // 256 if vocab >= 1024 else 1
    logits[0, ::max(stride, 3)] = float("nan")  # every sampled position (a third of a short row's)
    logits[1, torch.randperm(vocab, generator=g)[:vocab // 3]] = float("nan")
    logits[2, ::2] = -float("inf")
    logits[2, 1::4] = float("nan")
    logits[3, :] = float("nan")
    logits[3, 5] = 1.0  # one number among NaNs
    got = cpu_sampling.top_k_probs(logits, 0.7, 10, 0.9)
    nan = logits.isnan()
    assert not got[nan].any() and torch.isfinite(got).all()
    want = reference(torch.where(nan, -float("inf"), logits), 0.7, 10, 0.9)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert got[3].nonzero().flatten().tolist() == [5]


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


def draw_reference(p: torch.Tensor, u: float, q: torch.Tensor | None = None) -> int:
    """The draw's definition in torch ops: the running sums of the mass (torch.cumsum: double inside,
    fp32 out), u scaled to their total in fp32, the first sum above it, else the last index with mass;
    -1 without mass."""
    mass = p if q is None else (p - q).clamp_min(0)
    if not bool(mass.any()):
        return -1
    cdf = mass.cumsum(0)
    i = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float32) * cdf[-1], right=True))
    return i if i < p.numel() else int(torch.nonzero(mass).max())


@pytest.mark.parametrize("vocab,top_k", [(4096, 50), (4096, 4096), (37, 5)])
def test_draw_picks_the_definitions_index(vocab, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.7, top_k=top_k if top_k < vocab else 0, top_p=0.9)
    probs = logits_to_probs(torch.randn(16, vocab, generator=g) * 4, params)
    # uniforms anywhere in [0, 1), the largest float32 below 1 (rounds up to the total) and 0
    us = [*torch.rand(64, generator=g).tolist(), float(torch.tensor(1.0).nextafter(torch.tensor(0.0))), 0.0]
    for r in range(16):
        p, q = probs[r], probs[(r + 1) % 16]
        for u in us:
            assert cpu_sampling.draw(p, u) == draw_reference(p, u)
            assert cpu_sampling.draw(p, u, q) == draw_reference(p, u, q)
    # one likely token and a long flat tail: the running sums must keep double precision to land where
    # torch's do (summed in fp32 they drift by several positions in the tail)
    tail = torch.full((vocab,), 0.01 / (vocab - 1))
    tail[0] = 0.99
    for u in torch.linspace(0.991, 0.9999, 50).tolist():
        assert cpu_sampling.draw(tail, u) == draw_reference(tail, u)
    assert cpu_sampling.draw(probs[0], 0.5, probs[0]) == -1  # p - p has no mass
    assert cpu_sampling.draw(probs[:, 0], 0.5) is None  # a strided column: the torch ops
    assert cpu_sampling.draw(probs[0].double(), 0.5) is None


def test_draws_fall_back_to_the_same_indices(monkeypatch, seed):
    """sample_from and sample_residual give the same index with the kernel and without it (one uniform
    each), and a residual without mass draws from p."""
    from aspire_bench.decoders.sampler import sample_from, sample_residual
    g = torch.Generator().manual_seed(seed)
    probs = logits_to_probs(torch.randn(8, 4096, generator=g) * 4, SamplingParams(0.7, 50, 0.9))
    pairs = [(probs[r], probs[(r + 3) % 8]) for r in range(8)] + [(probs[0], probs[0])]

    def draws():
        gen = torch.Generator().manual_seed(seed)
        given = [(sample_from(p, None, u), sample_residual(p, q, None, u)) for p, q in pairs for u in (0.0, 0.37, 0.999)]
        return [(sample_from(p, gen), sample_residual(p, q, gen)) for p, q in pairs for _ in range(20)] + given

    fast = draws()
    monkeypatch.setattr(cpu_sampling, "_lib", None)
    monkeypatch.setattr(cpu_sampling, "load_library", lambda: None)
    assert cpu_sampling.draw(probs[0], 0.5) is None  # the torch ops from here
    assert draws() == fast
    assert all(probs[0][i] > 0 for i in (b for _, b in fast[160:180]))  # the last pair, p - p: drawn from p


def test_page_selection_matches_the_numpy_definition(seed, monkeypatch):
    """ASPIRE's compiled page selection against selection.py's numpy path, on fresh random scores: fewer
    or more scores than older pages, none, ties (keep the lower page), NaN (never chosen over a number)."""
    from aspire_bench.decoders import selection
    g = torch.Generator().manual_seed(seed)
    cases = []
    for num_pages in (3, 40, 1025):
        for budget in {1, 2, num_pages // 3 + 1, num_pages - 1} - {0}:
            for n_scored in (0, num_pages // 2, num_pages - 2, num_pages + 5):
                if budget >= num_pages:
                    continue
                s = torch.rand(n_scored, generator=g)
                if n_scored > 4:
                    s[torch.randint(0, n_scored, (n_scored // 4,), generator=g)] = 0.5  # ties
                    s[1] = float("nan")
                cases.append((None if n_scored == 0 and budget % 2 else s, num_pages, budget, min(8, budget)))
    fast = [selection.select_pages(*c) for c in cases]
    assert all(f is not None and f.dtype == torch.int64 for f in fast)
    monkeypatch.setattr(selection, "compiled_select_pages", lambda *a: None)
    slow = [selection.select_pages(*c) for c in cases]
    for (scores, num_pages, budget, recent), f, s in zip(cases, fast, slow):
        assert f.tolist() == s.tolist(), (num_pages, budget, recent)
        assert len(f) == budget and f.tolist() == sorted(set(f.tolist()))
        assert f[-recent:].tolist() == list(range(num_pages - recent, num_pages))
    tied = torch.tensor([0.5, 0.2, 0.5, 0.5, 0.1, 0.0])
    assert selection.select_pages(tied, 6, 3, 1).tolist() == [0, 2, 5]  # of the three 0.5s: pages 0 and 2
    nan = torch.tensor([0.3, float("nan"), 0.1, 0.2, 0.0])
    assert selection.select_pages(nan, 5, 3, 1).tolist() == [0, 3, 4]  # NaN below every number
    assert cpu_sampling.select_pages(tied.double(), 6, 3, 1) is None  # not fp32: the numpy path


@pytest.mark.parametrize("top_k,top_p", [(50, 0.9), (5, 1.0)])
def test_a_steps_sampling_in_one_call_matches_the_per_row_path(top_k, top_p, seed):
    """sample_step against logits_to_probs, sample_from and accept_sampling with the same uniforms, on
    fresh random rows of every kind in one call: decode / draft rows, verify rows of 0 to 6 drafts, with
    draft distributions unrelated to the target's (rejections, residual draws) and drafts the target
    gives no mass (certain rejection, once with a residual without mass)."""
    from aspire_bench.decoders.sampler import accept_sampling, sample_from
    params = SamplingParams(0.7, top_k, top_p)
    g = torch.Generator().manual_seed(seed)
    vocab = 500
    lens = [1, 3, 1, 7, 2, 1, 4]
    logits = torch.randn(sum(lens), vocab, generator=g) * torch.rand(sum(lens), 1, generator=g) * 8
    unrelated = torch.randn(sum(lens), vocab, generator=g) * 3
    drafts, qs, row = [], [], 0
    for n in lens:
        for j in range(n - 1):  # a draft distribution near the target's (mostly accepted) or unrelated to it
            near = logits[row + j] + 0.3 * torch.randn(vocab, generator=g)
            q = logits_to_probs(near if j % 2 == 0 else unrelated[row + j], params)
            drafts.append(int(torch.multinomial(q, 1, generator=g)))
            qs.append(q)
        row += n
    drafts[-1] = int(torch.argmin(logits[-2]))  # outside the target's top-k: rejected whatever u
    # row 3 (6 drafts) drafts from the target itself (q = p): accepted whatever u, but for its last
    # draft, which the target gives no mass: rejected, and with q = p the residual has no mass either,
    # so the token comes from p
    target = logits_to_probs(logits, params)
    r3, d3 = 3, lens[3] - 1
    first_row, first_draft = sum(lens[:r3]), sum(n - 1 for n in lens[:r3])
    for j in range(d3):
        qs[first_draft + j] = target[first_row + j]
        drafts[first_draft + j] = int(torch.argmax(logits[first_row + j]) if j < d3 - 1
                                      else torch.argmin(logits[first_row + j]))
    us = torch.rand(sum(lens), generator=g).tolist()
    assert cpu_sampling.step_applies(logits, top_k)
    probs, tokens, accepted = cpu_sampling.sample_step(logits, lens, drafts, qs, us, 0.7, top_k, top_p)
    assert torch.equal(probs, logits_to_probs(logits, params))
    row = x = 0
    for r, n in enumerate(lens):
        p, u = probs[row:row + n], us[row:row + n]
        if n == 1:
            assert (tokens[r], accepted[r]) == (sample_from(p[0], None, u[0]), 0)
        else:
            a, nxt = accept_sampling(logits[row:row + n], drafts[x:x + n - 1], qs[x:x + n - 1], params, None, p, u)
            assert (accepted[r], tokens[r]) == (a, nxt)
        row, x = row + n, x + n - 1
    assert accepted[-1] < lens[-1] - 1 and 0 < sum(accepted) < sum(lens) - len(lens)
    assert accepted[r3] == d3 - 1 and target[first_row + d3 - 1, tokens[r3]] > 0
    with pytest.raises(ValueError, match="rows"):
        cpu_sampling.sample_step(logits, lens, drafts[:-1], qs[:-1], us, 0.7, top_k, top_p)
    assert not cpu_sampling.step_applies(logits.double(), top_k) and not cpu_sampling.step_applies(logits, 0)
