"""AR decoder: greedy equals transformers.generate; continuous batching; sampling; stopping."""
from __future__ import annotations

import torch

from aspire_bench.decoders import Request, SamplingParams, get_decoder
from aspire_bench.engine import Engine, load_model


def prompts(n, seed=0, lengths=(5, 40, 17, 33, 8, 26, 12)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def test_ar_greedy_equals_transformers_generate_with_refills(checkpoints):
    path, hf = checkpoints["qwen2"]
    eng = Engine(load_model(path), attention_backend="torch", prefill_chunk=16)
    ps = prompts(7)
    reqs = [Request(str(i), p, 6 + 2 * i) for i, p in enumerate(ps)]
    out = get_decoder("ar").generate(eng, reqs, SamplingParams(), batch_size=3)  # 7 requests, 3 slots
    for r, p, req in zip(out.results, ps, reqs):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=req.max_new_tokens, min_new_tokens=req.max_new_tokens,
                          do_sample=False)[0, len(p):].tolist()
        assert r.output_ids == ref
        assert r.finish_reason == "length" and len(r.token_times) == len(r.output_ids)
        assert len(r.margins.margin) == len(r.output_ids) and min(r.margins.margin) >= 0
    # never more than 3 requests in one decode step
    assert max(len(s.rows) for s in out.steps) == 3


def test_eos_and_stop_check(checkpoints):
    path, _ = checkpoints["qwen3"]
    eng = Engine(load_model(path), attention_backend="torch")
    p = prompts(1)[0]
    free = get_decoder("ar").generate(eng, [Request("a", p, 12)], SamplingParams(), 1).results[0].output_ids
    eos = free[4]
    out = get_decoder("ar").generate(eng, [Request("a", p, 12)], SamplingParams(eos_token_ids=(eos,)), 1)
    r = out.results[0]
    assert r.finish_reason == "eos" and r.output_ids == free[:free.index(eos) + 1]
    stop = Request("b", p, 12, stop_check=lambda ids: 3 if len(ids) >= 5 else None)
    r = get_decoder("ar").generate(eng, [stop], SamplingParams(), 1).results[0]
    assert r.finish_reason == "stop" and r.output_ids == free[:3]


def test_sampling_is_seeded_and_independent_of_batch_size(checkpoints):
    path, _ = checkpoints["qwen3"]
    eng = Engine(load_model(path), attention_backend="torch")
    reqs = [Request(str(i), p, 10) for i, p in enumerate(prompts(4))]
    sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=5)
    a = [r.output_ids for r in get_decoder("ar").generate(eng, reqs, sp, 4).results]
    b = [r.output_ids for r in get_decoder("ar").generate(eng, reqs, sp, 1).results]
    c = [r.output_ids for r in get_decoder("ar").generate(eng, reqs, SamplingParams(0.8, 50, 0.9, seed=6), 4).results]
    greedy = [r.output_ids for r in get_decoder("ar").generate(eng, reqs, SamplingParams(), 4).results]
    assert a == b and a != c and a != greedy


def test_logits_to_probs_top_k_top_p():
    from aspire_bench.decoders.sampler import logits_to_probs
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0, 0]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)
    # both: top-k first, then top-p on the survivors (0.5/0.95 + 0.3/0.95 reaches 0.8), rows batched
    p = logits_to_probs(torch.stack((logits, logits.flip(0))), SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0, 0], [0, 0, 0.375, 0.625]]))


def test_sample_from_matches_the_distribution_and_skips_zero_mass(seed):
    from aspire_bench.decoders.sampler import sample_from
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    g = torch.Generator().manual_seed(seed)
    counts = torch.bincount(torch.tensor([sample_from(probs, g) for _ in range(20000)]), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    # 20000 draws: the standard error of each frequency is <= 0.0036; 5 sigma
    assert (counts / 20000 - probs).abs().max() < 0.018
