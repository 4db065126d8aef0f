"""The decoder loop and its policies: reusable decoders, per-request RequestState, pure scheduling
decisions, the replayable schedule and the engine-reported KV read."""
from __future__ import annotations

import copy

import pytest
import torch

from aspire_bench.decoders import Request, SamplingParams, get_decoder
from aspire_bench.decoders.aspire import AspirePolicy, AspireSettings
from aspire_bench.decoders.scheduler import CostModel, update_alpha
from aspire_bench.decoders.state import RequestState
from aspire_bench.engine import Engine, LayerTokenView, PageView, Row, TokenView
from aspire_bench.engine.loading import load_model

SPARSE = {"magicdec": {"budget": 64, "sinks": 4}, "vegas": {"min_tokens": 32},
          "aspire": {"min_pages": 2, "recent_pages": 1, "calibration": "none"}}


def requests(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Request(str(i), torch.randint(0, 320, (120 + 40 * i,), generator=g).tolist(), 10) for i in range(n)]


@pytest.fixture(scope="module")
def engine(checkpoints):
    path, _ = checkpoints["qwen3"]
    return Engine(load_model(path), attention_backend="torch", prefill_chunk=64)


@pytest.mark.parametrize("name", ["ar", *SPARSE])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=3)],
                         ids=["greedy", "sampled"])
def test_a_decoder_runs_twice_with_the_same_result(engine, name, params):
    dec = get_decoder(name, **SPARSE.get(name, {}))
    a, b = (dec.generate(engine, requests(), params, 2) for _ in range(2))
    assert [r.output_ids for r in a.results] == [r.output_ids for r in b.results]
    assert [r.verifications for r in a.results] == [r.verifications for r in b.results]
    assert [[(w.kind, w.kv_read) for w in s.rows] for s in a.steps] == \
        [[(w.kind, w.kv_read) for w in s.rows] for s in b.steps]
    assert a.info == b.info


@pytest.mark.parametrize("name", list(SPARSE))
def test_schedule_has_one_entry_per_verification_and_replays_alpha(engine, name):
    out = get_decoder(name, **SPARSE[name]).generate(engine, requests(), SamplingParams(), 2)
    for r in out.results:
        sched = r.schedule
        assert len(sched) == len(r.verifications) > 0
        assert [s["gamma"] for s in sched] == [d for d, _ in r.verifications]
        if name != "aspire":
            assert all(set(s) == {"gamma"} for s in sched)
            continue
        assert [s["gamma"] for s in sched] == r.draft_lengths
        alpha = AspireSettings().alpha0
        for s, (d, a) in zip(sched, r.verifications):  # alpha before each update, replayed from (d, a)
            assert s["alpha"] == pytest.approx(alpha) and s["c"] > 0
            alpha = update_alpha(alpha, a, d, 0.8, 0.9)
    ar = get_decoder("ar").generate(engine, requests(), SamplingParams(), 2)
    assert all(r.schedule is None and r.draft_lengths is None and r.margins for r in ar.results)


def test_sequence_state_is_the_policys_and_drafts_clear_after_verification(engine):
    seen = []
    dec = get_decoder("aspire", **SPARSE["aspire"])
    policy_cls = dec.Policy

    class Spy(policy_cls):
        def observe(self, seq, drafted, accepted):
            assert seq.pending == [] and seq.qs == []  # verified drafts are gone before observe
            seen.append((seq.index, drafted, accepted, seq.state.alpha))
            super().observe(seq, drafted, accepted)
            assert seq.state.verified

    dec.Policy = Spy  # this object only
    out = dec.generate(engine, requests(), SamplingParams(temperature=0.7, seed=1), 2)
    assert seen and sum(len(r.verifications) for r in out.results) == len(seen)
    assert get_decoder("aspire").Policy is policy_cls  # the class is untouched


def test_should_verify_is_pure_and_needs_no_engine():
    policy = AspirePolicy(AspireSettings(), page_size=16, num_layers=4, cost=CostModel(1.0, 0.05, 1 / 1024))
    seq = RequestState(0, Request("x", [1] * 3000, 100), None, None, out=[1], state=policy.new_state())
    seq.state.verified, seq.state.alpha = True, 0.95
    seq.pending.extend([4] * 3)
    before = copy.deepcopy((seq.pending, seq.state, seq.schedule, seq.extra))
    answers = {policy.should_verify(seq, 8) for _ in range(3)}
    assert len(answers) == 1 and copy.deepcopy((seq.pending, seq.state, seq.schedule, seq.extra)) == before
    # a longer context makes verification dearer relative to a draft: never verify sooner there
    assert policy.should_verify(seq, 8, context_len=200) >= policy.should_verify(seq, 8, context_len=60000)
    seq.state.alpha = 0.0  # nothing is accepted: verify at once
    assert policy.should_verify(seq, 8)


def test_engine_reports_the_kv_positions_each_row_read(engine):
    L, ps = engine.cfg.num_layers, engine.page_size
    engine.reserve(1024)
    s = engine.alloc(256)
    engine.forward([Row(s, list(range(1, 62)), 0, logits="none")])  # 61 positions: 3 full pages + 13
    pages = torch.tensor([0, 3])  # page 3 holds positions 48..60 (< start 61) only
    tokens = TokenView(torch.tensor([0, 5, 9, 40]))
    per_layer = [tokens if i % 2 else None for i in range(L)]
    rows = [Row(s, [7, 8, 9], 61, logits="all"),  # full: the prefix + its own 3 tokens
            Row(s, [7], 61, view=PageView(pages)),
            Row(s, [7], 61, view=per_layer),  # Vegas: a view per layer, None = full
            Row(s, [7], 61, view=PageView(pages), full_layers=frozenset({L - 2}))]  # ASPIRE's refresh row
    reported, sparse = [], []
    for row in rows:  # one row per forward: each writes the same positions
        out = engine.forward([row])
        reported.append(out.kv_read[0])
        sparse.append(out.kv_sparse[0])
        engine.rollback(s, 61)
    page_read = len({p for p in range(61) if p // ps in (0, 3)}) + 1
    assert page_read == ps + 13 + 1
    per_layer_true = [4 + 1 if i % 2 else 61 + 1 for i in range(L)]
    refresh_true = [61 + 1 if i == L - 2 else page_read for i in range(L)]
    assert reported == [64, page_read, round(sum(per_layer_true) / L), round(sum(refresh_true) / L)]
    # the part read scattered through a view (each run's first SCATTERED_HEAD positions, the row's own tokens
    # not counted): none for the full row, the view's layers' share for the others
    scattered = page_read - 1  # two runs: one page, and 13 positions of another
    assert sparse == [0, scattered, round(4 * (L // 2) / L), round((L - 1) * scattered / L)]


def test_layer_token_view_equals_a_list_of_per_layer_views(engine):
    """Vegas's one-tensor view gives the same logits and KV read as one TokenView per layer."""
    L = engine.cfg.num_layers
    engine.reserve(1024)
    s = engine.alloc(256)
    engine.forward([Row(s, list(range(1, 62)), 0, logits="none")])
    gen = torch.Generator().manual_seed(0)
    positions = torch.stack([torch.randperm(61, generator=gen)[:9].sort().values for _ in range(L)])
    outs = []
    for view in (LayerTokenView(positions), [TokenView(p) for p in positions]):
        out = engine.forward([Row(s, [7], 61, view=view)])
        outs.append((out.logits[0], out.kv_read[0]))
        engine.rollback(s, 61)
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1] == 9 + 1
    with pytest.raises(ValueError, match="one row of positions per layer"):
        engine.forward([Row(s, [7], 61, view=LayerTokenView(positions[:2]))])


def test_step_traces_carry_the_engines_figure(engine, monkeypatch):
    reads = []
    forward = engine.forward

    def spy(rows):
        out = forward(rows)
        reads.append(list(zip(out.kv_read, out.kv_sparse)))
        return out

    monkeypatch.setattr(engine, "forward", spy)
    out = get_decoder("vegas", **SPARSE["vegas"]).generate(engine, requests(), SamplingParams(), 2)
    assert reads == [[(w.kv_read, w.kv_sparse) for w in s.rows] for s in out.steps]
    assert any(w.kv_sparse for s in out.steps for w in s.rows)  # its drafts read through views


@pytest.mark.parametrize("top_k,top_p", [(50, 0.9), (0, 0.9), (0, 1.0)])
def test_batched_sampling_distributions_equal_one_call_per_row(top_k, top_p):
    """The loop computes every row's distributions in one call (the last position of a one-token row,
    every position of a verify row): the same values, bit for bit, as a call per row (so batching
    never changes what a seed samples)."""
    from aspire_bench.decoders.sampler import Sampler, logits_to_probs
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
    gen = torch.Generator().manual_seed(7)
    logits = [torch.randn(n, 300, generator=gen) * 4 for n in (1, 4, 1, 1)]  # the 4-token row verifies
    rows = [(None, kind) for kind in ("draft", "verify", "decode", "draft")]
    probs = Sampler(params)._batch_probs(rows, logits)
    assert sorted(probs) == [0, 1, 2, 3]
    for i, q in probs.items():
        assert torch.equal(q, logits_to_probs(logits[i] if i == 1 else logits[i][-1], params))
    assert Sampler(SamplingParams())._batch_probs(rows, logits) == {}  # greedy: no distributions


def _nucleus_by_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by sorting the whole vocabulary: the definition the fast path must match."""
    sp, si = torch.sort(probs, dim=-1, descending=True)
    drop = (sp.cumsum(-1) - sp) > top_p
    kept = sp.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, si, kept / kept.sum(-1, keepdim=True))


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat (the nucleus is most of the vocabulary) to peaked
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_without_a_full_sort_matches_the_sorted_definition(scale, top_p, seed):
    from aspire_bench.decoders.sampler import logits_to_probs
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 1000, generator=gen) * scale
    logits[0] *= 20  # one peaked row next to the others: the batch's top-k grows for the flat ones
    got = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    want = _nucleus_by_sort(torch.softmax(logits, -1), top_p)
    assert torch.equal(got > 0, want > 0), f"seed {seed}: the nucleus differs"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    for i in range(6):  # and one row alone gives the same values as in the batch
        assert torch.equal(logits_to_probs(logits[i], SamplingParams(temperature=1.0, top_p=top_p)), got[i])


@pytest.mark.parametrize("name", ["ar", *SPARSE])
def test_a_steps_compiled_sampling_samples_what_the_per_row_path_does(engine, name, monkeypatch):
    """Under sampling with top-k on a CPU the Sampler samples and verifies a whole step in one compiled
    call; with the per-row path instead (sample, draft, verify) a seed gives the same outputs,
    verifications and row kinds."""
    from aspire_bench.decoders import sampler
    from aspire_bench.kernels import cpu_sampling
    if cpu_sampling.load_library() is None:
        pytest.skip("no C++ compiler: the per-row path is the only one")
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3)
    dec = get_decoder(name, **SPARSE.get(name, {}))
    calls = []
    real = sampler.Sampler._step_compiled
    monkeypatch.setattr(sampler.Sampler, "_step_compiled", lambda *a: calls.append(real(*a)) or calls[-1])
    fast = dec.generate(engine, requests(), params, 2)
    assert len(calls) == sum(1 for s in fast.steps if s.rows[0].kind != "prefill")  # every step took it
    monkeypatch.setattr(sampler, "compiled_applies", lambda *a: False)
    slow = dec.generate(engine, requests(), params, 2)
    assert [r.output_ids for r in fast.results] == [r.output_ids for r in slow.results]
    assert [r.verifications for r in fast.results] == [r.verifications for r in slow.results]
    assert [[w.kind for w in s.rows] for s in fast.steps] == [[w.kind for w in s.rows] for s in slow.steps]
    if name != "ar":
        assert any(a < d for r in fast.results for d, a in r.verifications)  # rejections were exercised
