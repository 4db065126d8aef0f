"""The Sampler: point-mass drafts keep the target's distribution, the compiled and torch paths take the
same decision, and a decoder's traits come from its class."""
from __future__ import annotations

import torch

from aspire_bench.decoders import Request, SamplingParams, decoder_names, trait
from aspire_bench.decoders.base import DRAFT, VERIFY
from aspire_bench.decoders.sampler import Sampler, compiled_applies, logits_to_probs
from aspire_bench.decoders.state import RequestState
from aspire_bench.kernels import cpu_sampling


def _state(seed: int) -> RequestState:
    return RequestState(0, Request("r", [1], 8), None, torch.Generator().manual_seed(seed))


def test_a_point_mass_draft_is_accepted_with_p_and_the_output_follows_p():
    """One proposed (point-mass) draft x: accepted with probability p(x), and the committed first token
    is distributed as p (a rejection draws from p without x), on both paths."""
    params = SamplingParams(temperature=1.0, top_k=5)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -9.0, -9.0, -9.0]] * 2)
    p = logits_to_probs(logits[0], params)
    for compiled in (False, True):
        if compiled and cpu_sampling.load_library() is None:
            continue
        sampler = Sampler(params, "cpu", 8)
        sampler.compiled = compiled
        n, gen = 4000, torch.Generator().manual_seed(int(compiled))
        seqs = [RequestState(i, Request("r", [1], 8), None, gen) for i in range(n)]
        for seq in seqs:
            seq.propose([1])
        picks = sampler.step([(seq, VERIFY) for seq in seqs], [logits] * n)  # one step of n verify rows
        counts, accepted = torch.zeros(8), sum(a for _, a in picks)
        for tok, a in picks:
            counts[1 if a else tok] += 1
        assert abs(accepted / n - float(p[1])) < 0.03
        torch.testing.assert_close(counts / n, p, atol=0.03, rtol=0)
        assert counts[5:].sum() == 0  # never outside the top-k


def test_the_compiled_choice_is_made_once_per_run():
    assert not compiled_applies(SamplingParams(), "cpu", 100)  # greedy
    assert not compiled_applies(SamplingParams(temperature=1.0), "cpu", 100)  # no top-k
    assert not compiled_applies(SamplingParams(temperature=1.0, top_k=100), "cpu", 100)  # top-k keeps all
    assert compiled_applies(SamplingParams(temperature=1.0, top_k=5), "cpu", 100) == (
        cpu_sampling.load_library() is not None)


def test_draft_rows_keep_their_distribution_for_the_verification():
    params = SamplingParams(temperature=0.7, top_k=4)
    seq = _state(0)
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(1))
    [(tok, _)] = Sampler(params, "cpu", 16).step([(seq, DRAFT)], [logits])
    assert len(seq.qs) == 1 and torch.equal(seq.qs[0], logits_to_probs(logits[-1], params)) and seq.qs[0][tok] > 0


def test_every_decoder_has_its_traits():
    for name in decoder_names():
        assert trait(name, "description")
        assert trait(name, "draft_kind") in (None, "window", "vegas", "aspire", "ngram", "draft-model")
    assert [n for n in decoder_names() if trait(n, "baseline")][:2] == ["magicdec", "vegas"]
    assert trait("aspire-fixed", "ablation") and not trait("aspire", "ablation")
    assert not trait("aspire-oracle", "simulated") and trait("aspire", "uses_cost_model")
    assert trait("magicdec", "tune_grid") == {"gamma": (1, 2, 3, 4)} and trait("ar", "tune_grid") == {}
