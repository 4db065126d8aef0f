"""Speculative decoders: exact greedy parity with AR, rejection sampling, scheduler, selection, traces."""
from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from aspire_bench.decoders import Request, SamplingParams, get_decoder
from aspire_bench.decoders.base import DRAFT, PREFILL, VERIFY
from aspire_bench.decoders.sampler import accept_greedy, accept_sampling
from aspire_bench.decoders.scheduler import (
    DEFAULT_COST,
    CostModel,
    best_gamma,
    expected_tokens,
    fit_cost_model,
    update_alpha,
)
from aspire_bench.decoders.selection import (
    page_budget,
    random_pages,
    select_pages,
    streaming_positions,
    token_budget,
    top_tokens,
)
from aspire_bench.engine import Engine, load_model

# Small budgets so that drafts are really sparse at these prompt lengths.
SPARSE = {
    "magicdec": {"budget": 48, "sinks": 4},
    "vegas": {"min_tokens": 24, "ratio": 0.05},
    "aspire": {"min_pages": 2, "recent_pages": 1},
    "aspire-fixed": {"min_pages": 2, "recent_pages": 1},
    "aspire-fsm": {"min_pages": 2, "recent_pages": 1},
    "aspire-norefresh": {"min_pages": 2, "recent_pages": 1},
}


def make_requests(seed=0, vocab=320):
    g = torch.Generator().manual_seed(seed)
    lengths = (300, 90, 450, 200, 610, 130, 520)
    return [Request(str(i), torch.randint(0, vocab, (n,), generator=g).tolist(), 12 + 5 * i)
            for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def random_engine(checkpoints):
    path, _ = checkpoints["qwen3"]
    return Engine(load_model(path), attention_backend="torch", prefill_chunk=128)


@pytest.fixture(scope="module")
def ar_reference(random_engine):
    return get_decoder("ar").generate(random_engine, make_requests(), SamplingParams(), batch_size=3)


@pytest.mark.parametrize("name", list(SPARSE))
def test_greedy_parity_with_ar(name, random_engine, ar_reference):
    """7 requests of different prompt lengths and max_new_tokens, 3 slots: refills and requests
    ending at different times; every token equals AR's."""
    out = get_decoder(name, **SPARSE[name]).generate(random_engine, make_requests(), SamplingParams(), 3)
    for r, ref in zip(out.results, ar_reference.results):
        assert r.output_ids == ref.output_ids, f"{name} diverged on request {r.id}"
        # trace invariant: every committed token after the first comes from a verification (a+1)
        assert len(r.output_ids) == 1 + sum(a + 1 for _, a in r.verifications)
    kinds = {row.kind for s in out.steps for row in s.rows}
    assert {PREFILL, DRAFT, VERIFY} <= kinds


def test_oracle_scheduler_is_exact_and_never_verifies_early(random_engine, ar_reference):
    reqs = make_requests()
    for r, ref in zip(reqs, ar_reference.results):
        r.reference_ids = ref.output_ids
    out = get_decoder("aspire-oracle", **SPARSE["aspire"]).generate(random_engine, reqs, SamplingParams(), 3)
    for r, ref in zip(out.results, ar_reference.results):
        assert r.output_ids == ref.output_ids
        # every verification but a request's last either hit d_max or rejected exactly its last draft
        for d, a in r.verifications[:-1]:
            assert a == d - 1 or d == 16


def test_aspire_mixes_draft_and_verify_rows_in_one_step(random_engine):
    out = get_decoder("aspire", **SPARSE["aspire"]).generate(random_engine, make_requests(), SamplingParams(), 4)
    assert any({r.kind for r in s.rows} == {DRAFT, VERIFY} for s in out.steps)
    assert all(r.draft_lengths for r in out.results)


def test_sparse_views_never_read_beyond_the_prefix(random_engine):
    """A spy backend: sparse keys are < the row start (plus the row's own tokens), and full rows
    never read past start + n."""
    from aspire_bench.kernels.torch_ref import TorchAttention
    seen = {"rows": 0}

    class Spy(TorchAttention):
        def attend(self, layer, q, k_cache, v_cache, meta):
            for row in meta.rows:
                if row.sparse and row.sparse[layer] is not None:
                    pos = row.sparse_pos[layer]
                    assert pos[:-row.n].numel() == 0 or int(pos[:-row.n].max()) < row.start
                    assert pos[-row.n:].tolist() == list(range(row.start, row.start + row.n))
                    seen["rows"] += 1
            return super().attend(layer, q, k_cache, v_cache, meta)

    random_engine.backend = Spy()
    try:
        for name in ("magicdec", "vegas", "aspire"):
            get_decoder(name, **SPARSE[name]).generate(random_engine, make_requests()[:3], SamplingParams(), 3)
    finally:
        random_engine.backend = TorchAttention()
    assert seen["rows"] > 0


@pytest.mark.parametrize("dtype,backend", [("float32", "torch"), ("bfloat16", "cpu")])
def test_bundled_tiny_model_parity(dtype, backend):
    """On the trained model (real acceptance < 1) every decoder reproduces AR greedy: in fp32 through the
    reference attention token for token; in bf16 through the compiled kernels (a bf16 KV pool) up to
    near-ties at bf16's parity tolerance, since a key's last fp32 bit can round it to another bf16."""
    from aspire_bench.harness.parity import NEAR_TIE, compare_runs, default_tolerance
    eng = Engine.from_pretrained("tiny", dtype, attention_backend=backend)  # fails (not skips) when it is missing
    text = Path(__file__).read_text()
    ids = eng.tokenizer.encode(text * 4)
    reqs = [Request(str(i), ids[i * 37: i * 37 + n], 24) for i, n in enumerate((700, 300, 900, 520, 640, 410))]
    ref = get_decoder("ar").generate(eng, reqs, SamplingParams(), 4)
    rejected = identical = 0
    for name, settings in SPARSE.items():
        out = get_decoder(name, **settings).generate(eng, reqs, SamplingParams(), 4)
        if dtype == "float32":
            assert [r.output_ids for r in out.results] == [r.output_ids for r in ref.results], name
        found = compare_runs(out.results, ref.results, default_tolerance(eng.dtype))
        assert all(p.identical or p.kind == NEAR_TIE for p in found.values()), (name, found)
        identical += sum(p.identical for p in found.values())
        rejected += sum(d > a for r in out.results for d, a in r.verifications)
    assert rejected > 0  # the drafts were really checked, not trivially all accepted
    assert identical >= 0.8 * len(reqs) * len(SPARSE)


def test_rejection_sampling_matches_target_distribution():
    """First committed token of a verification is distributed as the target p (chi-square)."""
    from scipy.stats import chisquare
    g = torch.Generator().manual_seed(0)
    V = 6
    target = torch.randn(2, V, generator=g) * 1.5
    draft_logits = torch.randn(V, generator=g) * 1.5
    params = SamplingParams(temperature=0.9, top_k=5)
    from aspire_bench.decoders.sampler import logits_to_probs
    q = logits_to_probs(draft_logits, params)
    p = logits_to_probs(target[0], params)
    n = 3000
    counts = torch.zeros(V)
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=g))
        a, nxt = accept_sampling(target, [x], [q], params, g)
        counts[x if a == 1 else nxt] += 1
    expected = (p * n).numpy()
    mask = expected > 0
    assert counts[~torch.tensor(mask)].sum() == 0  # top-k excluded tokens never appear
    assert chisquare(counts.numpy()[mask], expected[mask]).pvalue > 0.001


def test_sequence_uniforms_come_from_its_generator_in_blocks():
    from aspire_bench.decoders.state import UNIFORM_BLOCK, RequestState
    seq = RequestState(0, Request("r", [1, 2], 4), None, torch.Generator().manual_seed(5))
    got = seq.uniforms(3) + seq.uniforms(UNIFORM_BLOCK + 6) + seq.uniforms(1)
    ref = torch.Generator().manual_seed(5)
    want = torch.rand(UNIFORM_BLOCK, generator=ref).tolist() + torch.rand(UNIFORM_BLOCK, generator=ref).tolist()
    assert got == want[:len(got)] and len(got) == UNIFORM_BLOCK + 10  # in order, none skipped or repeated
    assert all(0.0 <= u < 1.0 for u in got)


def test_accept_greedy():
    logits = torch.eye(5)[[1, 2, 3, 4]]  # argmax 1, 2, 3, 4
    assert accept_greedy(logits, [1, 2, 0]) == (2, 3)
    assert accept_greedy(logits, [1, 2, 3]) == (3, 4)  # all accepted: bonus
    assert accept_greedy(logits[:1], []) == (0, 1)


def test_scheduler_gamma_is_bruteforce_argmax():
    for alpha in (0.1, 0.5, 0.8, 0.9, 0.99, 1.0):
        for c in (0.01, 0.05, 0.2, 0.5, 1.0):
            vals = [(1 - alpha ** (g + 1)) / (1 - alpha) if alpha < 1 else g + 1 for g in range(17)]
            brute = max(range(17), key=lambda g: (vals[g] / (1 + c * g), -g))
            assert best_gamma(alpha, c, 16) == brute
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert best_gamma(1.0, 0.01, 16) == 16


def test_scheduler_ema_update():
    assert update_alpha(0.9, 3, 3) == pytest.approx(0.8 * 0.9 + 0.2 * 1.0)
    assert update_alpha(0.9, 1, 4) == pytest.approx(0.8 * 0.9 + 0.2 * 0.5)  # 1 / min(2, 4)
    assert update_alpha(0.9, 0, 4) == pytest.approx(0.72)
    assert update_alpha(0.5, 0, 0) == 0.5


def test_aspire_forced_verify_and_warmup():
    from aspire_bench.decoders.aspire import AspirePolicy, AspireSettings
    from aspire_bench.decoders.state import RequestState
    policy = AspirePolicy(AspireSettings(), page_size=16, num_layers=4, cost=CostModel(0, 0, 1.0))
    reqs = make_requests()
    st = RequestState(0, Request("x", reqs[0].prompt_ids, 100), None, None, out=[1], state=policy.new_state())
    st.pending.extend([5, 5])  # warm-up: fewer than gamma_init drafts before the first verify -> draft
    assert not policy.should_verify(st, 1)
    st.pending.extend([5] * 14)  # d = d_max = 16 -> verify
    assert policy.should_verify(st, 1)
    st2 = RequestState(1, Request("y", reqs[0].prompt_ids, 3), None, None, out=[1], state=policy.new_state())
    assert policy.should_verify(st2, 1) is False
    st2.pending.append(4)  # max_new 3: after 1 output, at most 1 draft
    assert policy.should_verify(st2, 1)


def test_aspire_decides_with_a_cost_model_that_prices_steps_at_nothing():
    from aspire_bench.decoders.aspire import AspirePolicy, AspireSettings
    from aspire_bench.decoders.state import RequestState
    reqs = make_requests()
    for terms in ("auto", "paper"):  # a hand-written calibration of zeros: decides, no division by zero
        policy = AspirePolicy(AspireSettings(cost_terms=terms), page_size=16, num_layers=4, cost=CostModel(0, 0, 0))
        st = RequestState(0, Request("x", reqs[0].prompt_ids, 100), None, None, out=[1], state=policy.new_state())
        st.state.verified = True
        st.pending.append(5)
        assert policy.should_verify(st, 1) in (True, False) and policy.cost_ratio(st, 1) == 1.0


def test_cost_model_fit_recovers_coefficients():
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(64):
        n, kv = float(torch.randint(1, 100, (1,), generator=g)), float(torch.randint(100, 10**5, (1,), generator=g))
        samples.append((n, kv, 0.002 + 1e-4 * n + 3e-8 * kv))
    m = fit_cost_model(samples)
    assert m.beta0 == pytest.approx(0.002, rel=1e-3) and m.beta_attn == pytest.approx(3e-8, rel=1e-3)
    assert m.r2 == pytest.approx(1.0)
    t_draft, t_verify = m.cycle_prices(batch=8, draft_kv=1000, context=16000, d_max=4)
    assert t_draft / t_verify[4] == pytest.approx((0.002 + 8e-4 + 8 * 1000 * 3e-8) / (0.002 + 40e-4 + 8 * 16000 * 3e-8))


def test_page_selection_and_budgets():
    assert page_budget(100, 0.07, 32) == 32 and page_budget(1000, 0.07, 32) == 70
    assert page_budget(1001, 0.07, 32) == math.ceil(70.07)
    scores = torch.tensor([0.1, 0.9, 0.05, 0.8, 0.0, 0.3, 0.2, 0.01])
    # budget 4 with 2 recent pages (6, 7) forced: top-2 of the rest are pages 1 and 3
    assert select_pages(scores, 8, 4, 2).tolist() == [1, 3, 6, 7]
    assert select_pages(scores, 8, 8, 2) is None  # budget covers everything: full view
    # more pages now than were scored: the new ones are recent
    assert select_pages(scores, 10, 4, 2).tolist() == [1, 3, 8, 9]
    assert token_budget(10000, 0.05, 256) == 500 and token_budget(1000, 0.05, 256) == 256
    assert token_budget(100, 0.05, 256) == 100
    assert top_tokens(torch.tensor([[0.5, 0.1, 0.9, 0.3], [0.0, 0.4, 0.2, 0.3]]), 4, 2).tolist() == [[0, 2], [1, 3]]
    assert top_tokens(torch.tensor([[0.5, 0.1, 0.7]]), 2, 2) is None  # only [0, length) counts: all of it
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(5, 300, generator=gen)  # fresh random scores: the set torch.topk picks, per layer
    got = top_tokens(scores, 257, 40)
    assert got.shape == (5, 40)
    for layer in range(5):
        assert got[layer].tolist() == sorted(torch.topk(scores[layer, :257], 40).indices.tolist())
    for budget in (5, 40, 200):  # timing's stand-in for select_pages: recent pages + random others
        pages = random_pages(40, budget, 3, torch.Generator().manual_seed(budget))
        assert len(pages) == min(budget, 40) and pages.tolist() == sorted(set(pages.tolist()))
        assert pages[-3:].tolist() == [37, 38, 39] and 0 <= int(pages.min())
    pos = streaming_positions(100, 4, 20)
    assert pos.tolist() == [0, 1, 2, 3] + list(range(84, 100))
    assert streaming_positions(20, 4, 20) is None


def test_page_scores_from_hand_made_attention_map():
    from aspire_bench.kernels.torch_ref import reduce_scores
    p = torch.zeros(2, 1, 8)  # 2 heads, 1 query, 8 positions, page size 4
    p[0, 0] = torch.tensor([0.5, 0, 0, 0, 0.25, 0.25, 0, 0])
    p[1, 0] = torch.tensor([0, 0, 0, 0, 0, 0, 0.5, 0.5])
    torch.testing.assert_close(reduce_scores(p, [0], "page_max_sum", 4), torch.tensor([0.5, 1.5]))
    torch.testing.assert_close(reduce_scores(p, [0], "token_mean", 4),
                               torch.tensor([0.25, 0, 0, 0, 0.125, 0.125, 0.25, 0.25]))


def test_unknown_decoder_and_setting_messages():
    from aspire_bench.errors import ConfigError
    with pytest.raises(ConfigError, match="unknown decoder 'nope'.*aspire"):
        get_decoder("nope")
    with pytest.raises(ConfigError, match="magicdec.*gama"):
        get_decoder("magicdec", gama=3)


@pytest.mark.real_calibration
def test_calibration_fit_is_saved_and_used_by_aspire(random_engine, tmp_path):
    from aspire_bench.decoders import calibration
    from aspire_bench.decoders.calibration import calibrate, save_calibration
    res = calibrate(random_engine, batch_size=2, context=256, drafts=(1, 4), ratios=(0.25, 1.0), repeats=1)
    # 2 lengths x 0, 1, 2 verify rows x 2 draft lengths x 3 views (25% pages, none, a sink + window), then
    # 2 lengths x 2 draft lengths of drafts only through 25% pages that capture no scores, then Vegas's:
    # 2 lengths x (drafts of each VEGAS_SINCE, verifications of each VEGAS_DRAFTS)
    n_vegas = 2 * (len(calibration.VEGAS_SINCE) + len(calibration.VEGAS_DRAFTS))
    assert res.n_samples == 2 * 3 * 2 * 3 + 2 * 2 + n_vegas and res.to_json()["n_samples"] == res.n_samples
    # a step of drafts only is the same at both draft lengths, one of verifications only under every view:
    # timed once, its sample in each grid point it stands for
    grid = res.samples
    for length in range(2):
        at = grid[length * 18:(length + 1) * 18]  # n_verify 0, 1, 2; draft lengths 1, 4; three views
        assert at[0:3] == at[3:6] and at[0] != at[1] != at[2]
        assert at[12] == at[13] == at[14] and at[15] == at[16] == at[17] and at[12] != at[15]
    # tokens, KV read, query x KV, seconds, each row's (tokens, KV read, of which through a view, scores
    # captured, of those Vegas-shaped: through per-layer views, token scores for a top-k)
    assert all(len(s) == 5 and sum(r[0] for r in s[4]) == s[0] and sum(r[1] for r in s[4]) == s[1]
               for s in res.samples)
    rows = [r for s in res.samples for r in s[4]]
    assert all(len(r) == 6 for r in rows)
    vegas, rows = [r for r in rows if r[4] or r[5]], [r[:4] for r in rows if not (r[4] or r[5])]
    assert all(0 <= sparse < kv for _, kv, sparse, _ in rows)
    assert {sparse > 0 for n, _, sparse, _ in rows if n == 1} == {True, False}  # 25% pages, and no view
    assert all(sparse == 0 for n, _, sparse, _ in rows if n > 1)  # verify rows read the prefix in full
    # Vegas's drafts: every scattered position through per-layer views, no scores; its verifications:
    # two queries' token scores at every layer, read in full; the grid's last samples
    L = random_engine.cfg.num_layers
    assert all(s[4][0][4] or s[4][0][5] for s in grid[-n_vegas:]) and len(vegas) == 2 * n_vegas
    assert {(n, layered == sparse > 0, cap, topk) for n, _, sparse, cap, layered, topk in vegas if n == 1} == {
        (1, True, 0, 0)}
    assert all(sparse == layered == 0 and topk == cap == 2 * kv and n - 1 in calibration.VEGAS_DRAFTS
               for n, kv, sparse, cap, layered, topk in vegas if n > 1)
    # drafts through pages capture the refresh layer's scores or not (the same pages: the grid's last
    # points), verify rows two queries' there or none, decode and window rows none
    assert {(n > 1, sparse > 0, cap > 0) for n, _, sparse, cap in rows} == {
        (True, False, True), (True, False, False), (False, True, True), (False, True, False), (False, False, False)}
    assert all(cap in (0, round(2 * kv / L)) for n, kv, _, cap in rows if n > 1)
    for length in range(2):  # the same draft step with and without the capture: only the count differs
        uncaptured, captured = grid[36 + 2 * length][4], grid[length * 18][4]
        assert [r[:3] for r in uncaptured] == [r[:3] for r in captured]
        assert all(r[3] == 0 for r in uncaptured) and all(r[3] > 0 for r in captured)
    # Timings on a loaded test machine may not fit well; what aspire does with a good fit is checked on
    # a calibration of the same form with exact step times.
    # Vegas's positions at costs of their own: a layered one 9e-9 (not 4e-9), a token score 5e-8 (not 2e-8)
    exact = tuple(s._replace(seconds=1e-3 + 1e-5 * s.tokens + 1e-8 * s.kv_read
                             + sum(4e-9 * (r[2] - r[4]) + 9e-9 * r[4] + 2e-8 * (r[3] - r[5]) + 5e-8 * r[5]
                                   for r in s.rows)) for s in res.samples)
    path = save_calibration(replace(res, samples=exact), random_engine, 2, tmp_path / "fit.json")
    dec = get_decoder("aspire", calibration=str(path), **SPARSE["aspire"])
    out = dec.generate(random_engine, make_requests()[:2], SamplingParams(), 2)
    assert out.info["cost_model"]["source"] == "calibration:fit.json"
    assert out.info["cost_model"]["beta_attn"] == pytest.approx(1e-8)
    assert out.info["cost_model"]["beta_sparse"] == pytest.approx(4e-9)
    assert out.info["cost_model"]["beta_capture"] == pytest.approx(2e-8)
    assert out.info["cost_model"]["beta_layered"] == pytest.approx(9e-9)
    assert out.info["cost_model"]["beta_topk"] == pytest.approx(5e-8)
    online = get_decoder("aspire", calibration="online", online_fit_every=4, **SPARSE["aspire"])
    out = online.generate(random_engine, make_requests()[:2], SamplingParams(), 2)
    assert out.info["cost_model"]["source"] in ("online", "default")
    fixed = get_decoder("aspire", calibration="none", online_fit_every=4, **SPARSE["aspire"])
    out = fixed.generate(random_engine, make_requests()[:2], SamplingParams(), 2)
    assert out.info["cost_model"] == {**DEFAULT_COST.to_dict(), "source": "none"}  # never refitted
    with pytest.raises(Exception, match="does not exist"):
        get_decoder("aspire", calibration=str(tmp_path / "none.json")).generate(
            random_engine, make_requests()[:1], SamplingParams(), 1)


@pytest.mark.real_calibration
def test_calibration_times_window_drafts(random_engine):
    """The grid's window rows read MagicDec's sink + window view: a draft token, no refresh layer."""
    from aspire_bench.decoders import calibration
    from aspire_bench.decoders.calibration import calibrate
    kw = {"batch_size": 2, "context": 1024, "drafts": (1,), "ratios": (1.0,), "repeats": 1, "warmup": False}
    res = calibrate(random_engine, window=(4, 100), **kw)
    rows = [r for s in res.samples for r in s[4]]
    window = [r for r in rows if r[0] == 1 and r[1] < 256]
    # at both lengths (256, 1024): 100 positions of the prefix and the row's own token; of them the 4
    # sinks are scattered, and of the window (one run of 96) its head; no scores captured
    from aspire_bench.engine import SCATTERED_HEAD
    assert window and all(r[1:] == (101, 4 + SCATTERED_HEAD, 0, 0, 0) for r in window)
    vegas = 2 * (len(calibration.VEGAS_SINCE) + len(calibration.VEGAS_DRAFTS))  # with or without the window
    assert (calibrate(random_engine, window=None, **kw).n_samples - vegas) * 2 == res.n_samples - vegas


@pytest.mark.real_calibration
@pytest.mark.parametrize("compiled", [True, False], ids=["one-call", "per-row"])
def test_calibration_times_steps_cold_with_the_loops_host_work(random_engine, monkeypatch, compiled):
    """Each timed step comes right after a read of twice the last-level cache (as in decoding, after a
    step that streamed more KV than the cache holds), and includes the rejection sampling of every
    verify row's drafts, as the loop's step does: through the Sampler, in one compiled call for the
    step where the loop makes one, else row by row."""
    from aspire_bench.decoders import calibration, sampler
    from aspire_bench.kernels import cpu_sampling
    assert calibration.last_level_cache_bytes(torch.device("cpu")) >= 1 << 20
    if compiled and cpu_sampling.load_library() is None:
        pytest.skip("no C++ compiler: the per-row path only")
    if not compiled:
        monkeypatch.setattr(sampler, "compiled_applies", lambda *a: False)
    events = []
    real_accept, real_time, real_step = sampler.accept_sampling, calibration._time_step, cpu_sampling.sample_step
    real_sum = torch.Tensor.sum

    def accept(logits, drafts, qs, *a):
        events.append(("accept", len(drafts), logits.shape[0], len(qs)))
        return real_accept(logits, drafts, qs, *a)

    def sample_step(logits, lens, drafts, qs, *a):  # one event per verify row, as `accept` records them
        events.extend(("one call", n - 1, n, n - 1) for n in lens if n > 1)
        assert len(drafts) == len(qs) == sum(lens) - len(lens) and len(logits) == sum(lens)
        return real_step(logits, lens, drafts, qs, *a)

    def time_step(engine, rows, gen, stand_in):
        events.append(("step", [r.n for r in rows]))
        return real_time(engine, rows, gen, stand_in)

    def flush_sum(x, *a, **k):
        if x.numel() * x.element_size() == 2 * calibration.last_level_cache_bytes(x.device):
            events.append(("flush",))
        return real_sum(x, *a, **k)

    monkeypatch.setattr(sampler, "accept_sampling", accept)
    monkeypatch.setattr(cpu_sampling, "sample_step", sample_step)
    monkeypatch.setattr(calibration, "_time_step", time_step)
    monkeypatch.setattr(torch.Tensor, "sum", flush_sum)
    calibration.calibrate(random_engine, batch_size=2, context=256, drafts=(1, 3), ratios=(0.25,), repeats=1,
                          warmup=False, window=None)
    steps = [i for i, e in enumerate(events) if e[0] == "step"] + [len(events)]
    # every distinct step (2 lengths x: drafts only, capturing scores and not; 1 or 2 verify rows at each
    # draft length; Vegas's drafts and its verifications of each VEGAS_DRAFTS), an untimed run, then the timed one
    assert len(steps) - 1 == 2 * 2 * (2 + 2 + 2 + len(calibration.VEGAS_SINCE) + len(calibration.VEGAS_DRAFTS))
    for j in range(len(steps) - 1):
        flushes = [e for e in events[steps[j] + 1:steps[j + 1]] if e == ("flush",)]
        # the flush comes last before each timed step, and only there
        assert len(flushes) == (j % 2 == 0) and (j % 2 or events[steps[j + 1] - 1] == ("flush",))
    for i, end in itertools.pairwise(steps):
        accepts = [e for e in events[i + 1:end] if e[0] in ("accept", "one call")]
        assert {e[0] for e in accepts} <= {"one call" if compiled else "accept"}
        verify = [n for n in events[i][1] if n > 1]
        # one rejection sampling per verify row, of its n - 1 drafts, with a stand-in q for each
        assert [(d, n, q) for _, d, n, q in accepts] == [(n - 1, n, n - 1) for n in verify]
    # on a machine whose cache is smaller than what every step reads, no step needs the flush
    events.clear()
    monkeypatch.setattr(calibration, "last_level_cache_bytes", lambda device: 1024)
    calibration.calibrate(random_engine, batch_size=2, context=256, drafts=(1,), ratios=(0.25,), repeats=1,
                          warmup=False, window=None)
    assert events and ("flush",) not in events


@pytest.mark.real_calibration
def test_calibration_rounds_pool_point_by_point(random_engine):
    from aspire_bench.decoders.calibration import calibrate, pooled_calibration
    kw = {"batch_size": 2, "context": 256, "drafts": (1, 4), "ratios": (0.25, 1.0), "repeats": 1, "warmup": False}
    rounds = [calibrate(random_engine, **kw) for _ in range(3)]
    assert all([s[:3] for s in r.samples] == [s[:3] for s in rounds[0].samples] for r in rounds)  # one grid
    # times as if the machine ran at three speeds: each point's pooled time is the middle one
    scaled = [replace(r, samples=tuple(s._replace(seconds=s.seconds * f) for s in r.samples))
              for r, f in zip(rounds, (1.0, 1.3, 0.8))]
    pooled = pooled_calibration(scaled)
    assert pooled.rounds == 3 and pooled.n_samples == rounds[0].n_samples
    for j, s in enumerate(pooled.samples):
        assert s.seconds == sorted(x.samples[j].seconds for x in scaled)[1]
    with pytest.raises(ValueError, match="different grids"):
        pooled_calibration([rounds[0], calibrate(random_engine, **{**kw, "drafts": (1,)})])
    with pytest.raises(ValueError, match="different grids"):  # as many points, another context
        pooled_calibration([rounds[0], calibrate(random_engine, **{**kw, "context": 512})])
    # a context shorter than a page (a bench cell may have one) still calibrates
    short = calibrate(random_engine, **{**kw, "context": 8})
    assert short.samples and all(s.kv_read > 0 for s in short.samples)
