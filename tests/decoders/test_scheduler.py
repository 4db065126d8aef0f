"""ASPIRE's scheduler and cost model: the zero-draft answer, the query x KV term, fit quality, and a
schedule that does not depend on wall-clock timing (calibration measured once, stored, replayed)."""
from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from aspire_bench.decoders import Request, SamplingParams, get_decoder
from aspire_bench.decoders.aspire import AspirePolicy, AspireSettings
from aspire_bench.decoders.base import RowTrace, StepTrace
from aspire_bench.decoders.calibration import (
    Calibration,
    calibration_context,
    calibration_path,
    cost_model_from,
    read_calibration,
    save_calibration,
)
from aspire_bench.decoders.scheduler import (
    MIN_R2,
    CostModel,
    best_gamma,
    best_gamma_priced,
    expected_tokens,
    fit_cost_model,
    fit_problem,
    multi_term,
    qk_term,
    update_alpha,
)
from aspire_bench.decoders.state import RequestState
from aspire_bench.engine import SCATTERED_HEAD, Engine, Row, load_model

SPARSE = {"min_pages": 2, "recent_pages": 1}


@pytest.fixture(scope="module")
def engine(checkpoints, tmp_path_factory):
    path, _ = checkpoints["qwen3"]
    return Engine(load_model(path), attention_backend="torch", prefill_chunk=256,
                  name=str(tmp_path_factory.mktemp("sched") / "model"))  # its own calibration key


def requests(seed=0, n=4, vocab=320):
    g = torch.Generator().manual_seed(seed)
    return [Request(str(i), torch.randint(0, vocab, (200 + 50 * i,), generator=g).tolist(), 24) for i in range(n)]


def test_zero_draft_verification_relaxes_alpha_or_freezes_it():
    assert update_alpha(0.3, 0, 0, 0.8) == 0.3  # frozen: the paper's text read literally
    assert update_alpha(0.3, 0, 0, 0.8, alpha0=0.9) == pytest.approx(0.8 * 0.3 + 0.2 * 0.9)
    assert update_alpha(0.3, 2, 4, 0.8, alpha0=0.9) == update_alpha(0.3, 2, 4, 0.8)  # d > 0: unchanged rule


def test_relaxed_request_drafts_again_frozen_one_never_does():
    c = 0.5  # alpha below c gives gamma = 0
    for zero_draft, expect_draft in (("relax", True), ("freeze", False)):
        policy = AspirePolicy(AspireSettings(zero_draft=zero_draft), page_size=16, num_layers=4)
        st = RequestState(0, Request("x", [1] * 10, 1000), None, None, out=[1], state=policy.new_state())
        sch = st.state
        sch.alpha, sch.verified = 0.2, True
        assert best_gamma(sch.alpha, c, 16) == 0
        drafted = False
        for _ in range(20):  # twenty zero-draft verifications in a row
            policy.observe(st, 0, 0)
            drafted |= best_gamma(sch.alpha, c, 16) > 0
        assert drafted is expect_draft


def test_qk_term_fitted_when_present_and_dropped_when_absent():
    g = torch.Generator().manual_seed(0)
    with_qk, without = [], []
    for _ in range(80):
        n = float(torch.randint(1, 100, (1,), generator=g))
        kv = float(torch.randint(100, 10**5, (1,), generator=g))
        qk = kv * float(torch.randint(1, 8, (1,), generator=g))
        noise = 1 + 0.01 * float(torch.randn((), generator=g))
        with_qk.append((n, kv, qk, (0.002 + 1e-4 * n + 3e-8 * kv + 2e-9 * qk) * noise))
        without.append((n, kv, qk, (0.002 + 1e-4 * n + 3e-8 * kv) * noise))
    m = fit_cost_model(with_qk)
    assert m.beta_qk == pytest.approx(2e-9, rel=0.2) and m.beta_attn == pytest.approx(3e-8, rel=0.2)
    assert fit_cost_model(with_qk, terms="paper").beta_qk == 0.0
    assert fit_cost_model(without).beta_qk == 0.0  # not significant: the paper's three terms
    assert fit_problem(m) is None


def test_cycle_prices_each_gamma_with_every_term_of_the_model():
    paper = CostModel(0.002, 1e-4, 3e-8)
    t_draft = 0.002 + 8e-4 + 8 * 1000 * 3e-8
    t_draft_p, t_verify_p = paper.cycle_prices(8, 1000, 16000, 6)
    assert t_draft_p == pytest.approx(t_draft)
    assert t_verify_p[4] == pytest.approx(0.002 + 40e-4 + 8 * 16000 * 3e-8)
    stepped = CostModel(0.002, 1e-4, 3e-8, 1e-9, qk_free=2, beta_multi=2e-8)
    t_draft_s, t_verify_s = stepped.cycle_prices(8, 1000, 16000, 6, draft_sparse=0)
    for g in range(7):  # the closed form is the step time of a batch of such rows
        assert t_verify_s[g] == pytest.approx(stepped.rows_time([(g + 1, 16000)] * 8))
    assert t_draft_s == pytest.approx(stepped.rows_time([(1, 1000)] * 8))
    # the step: verifying 2 drafts costs more over 1 than 3 over 2
    assert t_verify_s[2] - t_verify_s[1] > 2 * (t_verify_s[3] - t_verify_s[2])


def test_priced_rule_is_the_papers_where_a_verification_costs_the_same_whatever_gamma():
    for alpha in (0.1, 0.5, 0.8, 0.9, 0.99, 1.0):
        for c in (0.01, 0.05, 0.2, 0.5, 1.0):
            assert best_gamma_priced(alpha, c * 0.07, [0.07] * 17) == best_gamma(alpha, c, 16)


def test_priced_rule_is_the_bruteforce_argmax_and_sees_the_step(seed):
    gen = np.random.default_rng(seed)
    for _ in range(200):
        alpha, t_draft = float(gen.uniform(0, 1)), float(gen.uniform(0.001, 0.05))
        t_verify = list(np.cumsum(gen.uniform(0, 0.03, 17)) + 0.07)
        value = [expected_tokens(alpha, g) / (g * t_draft + t_verify[g]) for g in range(17)]
        assert best_gamma_priced(alpha, t_draft, t_verify) == max(range(17), key=lambda g: (value[g], -g))
    # a step at 2 tokens (1.06 -> 1.56 AR steps, then +0.12 per draft, a draft 0.25): with the slope
    # alone gamma grows past 1 at alpha 0.8; priced, one draft per verification until alpha ~0.9
    t_verify = [1.0, 1.06] + [1.56 + 0.12 * (g - 2) for g in range(2, 17)]
    slope_only = [1.0, 1.06] + [1.06 + 0.12 * (g - 1) for g in range(2, 17)]
    assert [best_gamma_priced(a, 0.25, t_verify) for a in (0.5, 0.7, 0.8)] == [1, 1, 1]
    assert best_gamma_priced(0.8, 0.25, slope_only) > 1 and best_gamma_priced(0.95, 0.25, t_verify) > 1


def _hinge_samples(free: int, seed: int, n_steps: int = 90, jump: float = 0.0, tokens=(1, 2, 5, 9, 17)):
    """Steps of 8 rows, drafts (1 token) and verifies (`tokens`) mixed, timed by a model whose
    first `free` queries of a row cost nothing beyond its KV read, and whose rows of more cost `jump`
    per KV position besides, with 1% noise."""
    gen = np.random.default_rng(seed)
    samples = []
    for _ in range(n_steps):
        rows = [(int(gen.choice(tokens)), int(gen.integers(1000, 17000))) for _ in range(8)]
        n, kv = sum(r[0] for r in rows), sum(r[1] for r in rows)
        t = 0.001 + 5e-5 * n + 2e-8 * kv + 3e-9 * qk_term(rows, free) + jump * multi_term(rows, free)
        samples.append((n, kv, qk_term(rows), t * (1 + 0.01 * gen.standard_normal()), rows))
    return samples


@pytest.mark.parametrize("free", [0, 3, 6])
def test_fit_finds_how_many_queries_ride_free_on_the_kv_read(free, seed):
    m = fit_cost_model(_hinge_samples(free, seed))
    assert m.qk_free == free, f"seed {seed}"
    assert m.beta_qk == pytest.approx(3e-9, rel=0.15) and m.beta_attn == pytest.approx(2e-8, rel=0.15)
    assert m.beta_multi == 0.0  # no step where the queries stop riding free: not significant
    again = CostModel.from_dict(json.loads(json.dumps(m.to_dict())), "replay")
    assert again.qk_free == free and again.rows_time([(5, 4000)]) == m.rows_time([(5, 4000)])


def test_fit_finds_a_step_where_the_queries_stop_riding_free(seed):
    """A kernel that changes method past 2 tokens per row: a step of 1.5e-8 per KV position (3/4 of a
    position's read), then a slope; the paper's terms and the slope alone misprice 3-token rows."""
    samples = _hinge_samples(2, seed, jump=1.5e-8, tokens=(1, 2, 3, 4, 5, 9, 17))  # the calibration's grid
    m = fit_cost_model(samples)
    assert m.qk_free == 2 and m.beta_multi == pytest.approx(1.5e-8, rel=0.15), f"seed {seed}"
    assert m.beta_qk == pytest.approx(3e-9, rel=0.15) and fit_problem(m) is None
    again = CostModel.from_dict(json.loads(json.dumps(m.to_dict())), "replay")
    rows = [(3, 16000), (1, 1000)]
    assert again.beta_multi == m.beta_multi and again.rows_time(rows) == m.rows_time(rows)
    assert m.rows_time(rows) - m.rows_time([(2, 16000), (1, 1000)]) == pytest.approx(
        m.beta_tok + 16000 * (m.beta_multi + m.beta_qk))
    assert fit_cost_model(samples, terms="paper").beta_multi == 0.0
    # the scheduler prices the step: a verification of 2 drafts dearer than with the slope alone
    slope = replace(m, beta_multi=0.0).cycle_prices(8, 1000, 16000, 4)[1]
    priced = m.cycle_prices(8, 1000, 16000, 4)[1]
    assert priced[:2] == pytest.approx(slope[:2]) and priced[2] == pytest.approx(slope[2] + 8 * 16000 * m.beta_multi)


def _sparse_samples(beta_sparse: float, seed: int, n_steps: int = 90):
    """Steps of 8 rows, drafts through a view of a random part of their KV (some without one) and
    verifies mixed, timed with a query x KV term (3 queries free) and `beta_sparse`, 1% noise."""
    gen = np.random.default_rng(seed)
    samples = []
    for _ in range(n_steps):
        rows = []
        for _ in range(8):
            n, kv = int(gen.choice([1, 1, 5, 9])), int(gen.integers(1000, 17000))
            rows.append((n, kv, int(kv * gen.choice([0.0, 0.07, 0.25, 0.9])) if n == 1 else 0))
        n, kv = sum(r[0] for r in rows), sum(r[1] for r in rows)
        t = 0.001 + 5e-5 * n + 2e-8 * kv + 3e-9 * qk_term(rows, 3) + beta_sparse * sum(r[2] for r in rows)
        samples.append((n, kv, qk_term(rows), t * (1 + 0.01 * gen.standard_normal()), rows))
    return samples


def test_sparse_term_fitted_when_present_and_dropped_when_absent(seed):
    m = fit_cost_model(_sparse_samples(1.5e-8, seed))
    assert m.beta_sparse == pytest.approx(1.5e-8, rel=0.15), f"seed {seed}"
    assert m.beta_attn == pytest.approx(2e-8, rel=0.15) and m.qk_free == 3 and fit_problem(m) is None
    assert CostModel.from_dict(json.loads(json.dumps(m.to_dict())), "replay").beta_sparse == m.beta_sparse
    assert fit_cost_model(_sparse_samples(0.0, seed)).beta_sparse == 0.0  # a GPU's gathers: not significant
    assert fit_cost_model(_sparse_samples(1.5e-8, seed), terms="paper").beta_sparse == 0.0
    # the model prices a step's rows with their sparse part, and rows without one as before
    rows = [(1, 4000, 3000), (5, 16000, 0)]
    assert m.rows_time(rows) - m.rows_time([r[:2] for r in rows]) == pytest.approx(3000 * m.beta_sparse)


def _capture_samples(beta_capture: float, seed: int, n_steps: int = 90, layers: int = 16):
    """Steps of 8 rows as a calibration grid times them: decode rows (no capture), ASPIRE drafts through
    pages at 7% or 25% with the refresh layer read in full and its scores captured, verify rows capturing
    two queries' scores there; timed with `beta_capture` per captured position and 1% noise."""
    gen = np.random.default_rng(seed)
    samples = []
    for _ in range(n_steps):
        rows, ctx = [], int(gen.choice([4096, 16384]))
        for _ in range(8):
            kind = gen.choice(["decode", "draft", "verify"])
            if kind == "decode":
                rows.append((1, ctx, 0, 0))
            elif kind == "draft":
                ratio = float(gen.choice([0.07, 0.25]))
                kv = round(((layers - 1) * ratio * ctx + ctx) / layers)
                rows.append((1, kv, round((layers - 1) * ratio * ctx / layers), round(ctx / layers)))
            else:
                n = int(gen.choice([2, 4, 5]))
                rows.append((n, ctx + n, 0, round(2 * (ctx + n) / layers)))
        n, kv = sum(r[0] for r in rows), sum(r[1] for r in rows)
        t = (0.001 + 5e-5 * n + 2e-8 * kv + 1e-8 * sum(r[2] for r in rows)
             + beta_capture * sum(r[3] for r in rows))
        samples.append((n, kv, qk_term(rows), t * (1 + 0.01 * gen.standard_normal()), rows))
    return samples


def test_capture_term_fitted_when_present_and_dropped_when_absent(seed):
    m = fit_cost_model(_capture_samples(5e-8, seed))
    assert m.beta_capture == pytest.approx(5e-8, rel=0.25), f"seed {seed}"
    assert m.beta_attn == pytest.approx(2e-8, rel=0.15) and fit_problem(m) is None
    assert CostModel.from_dict(json.loads(json.dumps(m.to_dict())), "replay").beta_capture == m.beta_capture
    assert fit_cost_model(_capture_samples(0.0, seed)).beta_capture == 0.0  # not significant: left out
    assert fit_cost_model([(*s[:4], [r[:3] for r in s[4]]) for s in _capture_samples(5e-8, seed)]
                          ).beta_capture == 0.0  # rows stored before the count
    assert fit_cost_model(_capture_samples(5e-8, seed), terms="paper").beta_capture == 0.0
    rows = [(1, 2000, 1000, 1024), (4, 16004, 0, 2001)]
    assert m.rows_time(rows) - m.rows_time([r[:3] for r in rows]) == pytest.approx(3025 * m.beta_capture)


def _vegas_samples(seed: int, layered: float = 4e-6, topk: float = 2.5e-7, layers: int = 30):
    """_capture_samples' grid (its steps without Vegas-shaped work), then Vegas's steps as calibrate() times
    them: at each length all rows drafting through per-layer views of 256 scattered tokens, and all
    verifying 2 or 8 drafts with two queries' token scores at every layer; Vegas's positions cost
    `layered` and `topk` each in place of beta_sparse (1e-8) and beta_capture (5e-8), 1% noise."""
    gen, samples = np.random.default_rng(seed + 1), _capture_samples(5e-8, seed, layers=layers)
    samples = [(*s[:4], [(*r, 0, 0) for r in s[4]]) for s in samples]
    for ctx in (1024, 4096):
        for rows in ([(1, 259, 258, 0, 258, 0)] * 8, *([(d + 1, ctx + d + 1, 0, 2 * (ctx + d + 1), 0,
                                                          2 * (ctx + d + 1))] * 8 for d in (2, 8))):
            n, kv = sum(r[0] for r in rows), sum(r[1] for r in rows)
            t = 0.001 + 5e-5 * n + 2e-8 * kv + sum(layered * r[4] + topk * r[5] for r in rows)
            samples.append((n, kv, qk_term(rows), t * (1 + 0.01 * gen.standard_normal()), rows))
    return samples


def test_vegas_terms_are_fitted_apart_without_moving_the_others(seed):
    """beta_layered and beta_topk come from the steps with Vegas-shaped work, after the other terms are
    fitted on the steps without it: those come out as a fit without Vegas's steps gives them."""
    samples = _vegas_samples(seed)
    m = fit_cost_model(samples)
    assert m.beta_layered == pytest.approx(4e-6, rel=0.1), f"seed {seed}"
    assert m.beta_topk == pytest.approx(2.5e-7, rel=0.1), f"seed {seed}"
    generic = fit_cost_model([s for s in samples if not any(r[4] or r[5] for r in s[4])])
    assert generic.beta_layered is None and generic.beta_topk is None
    assert replace(m, beta_layered=None, beta_topk=None) == generic
    assert fit_problem(m) is None and "beta_topk" in fit_problem(replace(m, beta_topk=-1e-9))
    # left out: priced by the generic terms, as a model fitted before the terms existed
    assert fit_cost_model(samples, without=("beta_layered", "beta_topk")) == generic
    assert fit_cost_model(samples, without=("beta_topk",)).beta_topk is None
    assert fit_cost_model(samples, terms="paper").beta_layered is None
    # a verify row capturing token scores: priced by beta_topk in place of beta_capture
    verify = [(7, 4103, 0, 8206, 0, 8206)]
    assert m.rows_time(verify) - generic.rows_time(verify) == pytest.approx(
        8206 * (m.beta_topk - m.beta_capture))
    assert CostModel.from_dict(json.loads(json.dumps(m.to_dict())), "replay") == replace(m, source="replay")


def test_a_cost_model_without_vegas_terms_prices_vegas_rows_as_before():
    """A model stored before beta_layered and beta_topk (no keys) prices rows with the two new counts as
    it priced their first four; its dict stays as it was."""
    old = {"beta0": 1e-3, "beta_tok": 1e-4, "beta_attn": 1e-8, "beta_qk": 0.0, "qk_free": 0,
           "beta_sparse": 5e-9, "beta_multi": 0.0, "beta_capture": 3e-8, "source": "x", "r2": 0.99}
    m = CostModel.from_dict(old, "x")
    assert m.beta_layered is None and m.beta_topk is None and m.to_dict() == old
    rows = [(1, 259, 258, 0, 258, 0), (7, 4103, 0, 8206, 0, 8206)]
    assert m.rows_time(rows) == m.rows_time([r[:4] for r in rows]) == pytest.approx(
        1e-3 + 8e-4 + 1e-8 * 4362 + 5e-9 * 258 + 3e-8 * 8206)


def test_cycle_prices_price_the_captured_scores_as_rows_time_does():
    """A draft row capturing the refresh layer's scores over the prefix; a verify row of gamma drafts its
    first and last query's (one query at gamma = 0)."""
    m = CostModel(0.002, 1e-4, 3e-8, 1e-9, qk_free=2, beta_sparse=1e-8, beta_multi=2e-9, beta_capture=4e-8)
    t_draft, t_verify = m.cycle_prices(8, 1000, 16000, 4, draft_sparse=300, draft_captured=1000,
                                       verify_captured=1000)
    assert t_draft == pytest.approx(m.rows_time([(1, 1000, 300, 1000)] * 8))
    for g in range(5):
        assert t_verify[g] == pytest.approx(m.rows_time([(g + 1, 16000, 0, 1000 * min(2, g + 1))] * 8))


def test_samples_without_rows_fit_a_plain_query_x_kv_term():
    old = [s[:4] for s in _hinge_samples(0, 1)]  # calibrations stored before rows were kept
    m = fit_cost_model(old)
    assert m.qk_free == 0 and m.beta_qk == pytest.approx(3e-9, rel=0.15)


def test_a_fit_of_no_samples_is_a_clear_error():
    # (it used to build a cost model of one coefficient and fail on a missing argument)
    with pytest.raises(ValueError, match="no timed steps"):
        fit_cost_model([])


def test_cycle_prices_with_free_queries():
    m = CostModel(0.002, 1e-4, 3e-8, 1e-9, qk_free=3)
    t_draft, t_verify = m.cycle_prices(8, 1000, 16000, 6)
    assert t_draft == pytest.approx(0.002 + 8e-4 + 8 * 1000 * 3e-8)  # one query per draft row: free
    # up to 2 drafts (3 tokens) no query x KV work; at 4 drafts (5 tokens) 2 queries per row pay
    assert t_verify[2] == pytest.approx(0.002 + 24e-4 + 8 * 16000 * 3e-8)
    assert t_verify[4] == pytest.approx(0.002 + 40e-4 + 8 * 16000 * 3e-8 + 2 * 1e-9 * 8 * 16000)


def test_fit_quality_check():
    assert "negative" in fit_problem(CostModel(-1e-3, 1e-4, 3e-8, r2=0.99))
    assert "R^2" in fit_problem(CostModel(1e-3, 1e-4, 3e-8, r2=MIN_R2 - 0.01))
    assert "beta_sparse" in fit_problem(CostModel(1e-3, 1e-4, 3e-8, r2=0.99, beta_sparse=-1e-9))
    assert "beta_capture" in fit_problem(CostModel(1e-3, 1e-4, 3e-8, r2=0.99, beta_capture=-1e-9))
    assert fit_problem(CostModel(1e-3, 1e-4, 3e-8, r2=0.97)) is None


@pytest.mark.real_calibration
def test_auto_calibration_is_measured_once_stored_and_replayed(engine):
    path = calibration_path(engine, 2, calibration_context([len(r.prompt_ids) for r in requests()], engine, 16))
    path.unlink(missing_ok=True)
    first = get_decoder("aspire", **SPARSE).generate(engine, requests(), SamplingParams(), 2)
    assert path.exists()
    stored = json.loads(path.read_text())
    assert len(stored["samples"]) == stored["n_samples"] > 0 and stored["backend"] == engine.backend.name
    assert f"-c{stored['context']}-" in path.name
    mtime = path.stat().st_mtime_ns
    second = get_decoder("aspire", **SPARSE).generate(engine, requests(), SamplingParams(), 2)
    assert path.stat().st_mtime_ns == mtime  # reused, not measured again
    assert first.info["cost_model"] == second.info["cost_model"]
    replay = get_decoder("aspire", calibration=str(path), **SPARSE).generate(engine, requests(), SamplingParams(), 2)
    assert {k: v for k, v in replay.info["cost_model"].items()} == first.info["cost_model"]
    paper = get_decoder("aspire-papercost", calibration=str(path), **SPARSE).generate(
        engine, requests(), SamplingParams(), 2)
    assert paper.info["cost_model"]["beta_qk"] == 0.0 and paper.info["cost_terms"] == "paper"


def test_poor_calibration_is_rejected_with_a_warning(engine, tmp_path):
    from aspire_bench.errors import ConfigError
    bad = tmp_path / "bad.json"  # a negative coefficient is a malformed file: refused when the decoder is built
    bad.write_text(json.dumps({"beta0": 1e-3, "beta_tok": -1e-4, "beta_attn": 1e-8, "r2": 0.99}))
    with pytest.raises(ConfigError, match="beta_tok must be a finite number >= 0"):
        get_decoder("aspire", calibration=str(bad), **SPARSE)
    noisy = tmp_path / "noisy.json"
    noisy.write_text(json.dumps({"beta0": 1e-3, "beta_tok": 1e-4, "beta_attn": 1e-8, "r2": -0.11}))
    with pytest.warns(UserWarning, match="R\\^2"):
        get_decoder("aspire", calibration=str(noisy), **SPARSE).generate(engine, requests(n=1), SamplingParams(), 1)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("[1, 2")
    with pytest.raises(ConfigError, match="not a calibration"):
        get_decoder("aspire", calibration=str(garbage)).generate(engine, requests(n=1), SamplingParams(), 1)


def test_a_calibration_round_trips_its_file(engine, tmp_path):
    """save_calibration writes what read_calibration gives back, in the layout calibrate()'s dict had
    (coefficients at the top level): files of that layout, and hand-written ones of coefficients alone
    or of samples alone, keep loading."""
    from conftest import fixed_samples
    samples = fixed_samples(2, 1024)
    cal = Calibration(fit_cost_model(samples, source="calibration"), tuple(samples), 2, 1024, r2_train=0.97,
                      heldout_rel_err_median=0.01, heldout_rel_err_max=0.04)
    path = save_calibration(cal, engine, 2, tmp_path / "cal.json")
    back = read_calibration(path)
    assert back == replace(cal, timed_on=back.timed_on)
    assert json.loads(json.dumps(back.to_json())) == json.loads(path.read_text())
    assert back.timed_on == {"model": engine.name, "device": "cpu", "dtype": "float32",
                           "backend": engine.backend.name, "page_size": engine.page_size}
    stored = json.loads(path.read_text())
    assert stored["beta_attn"] == cal.fit.beta_attn and stored["n_samples"] == len(samples)
    assert stored["context"] == 1024 and "rounds" not in stored  # unset entries are not written
    # the cost model a run replays: refitted from the samples, under the source it is given
    assert cost_model_from(back, "calibration:cal.json") == replace(cal.fit, source="calibration:cal.json")
    only_terms = tmp_path / "terms.json"
    only_terms.write_text(json.dumps({"beta0": 1e-3, "beta_tok": 1e-4, "beta_attn": 1e-8, "r2": 0.99}))
    terms = read_calibration(only_terms)
    assert terms.samples == () and terms.context is None
    assert cost_model_from(terms, "x") == CostModel(1e-3, 1e-4, 1e-8, source="x", r2=0.99)
    only_samples = tmp_path / "samples.json"
    only_samples.write_text(json.dumps({"samples": stored["samples"]}))
    assert read_calibration(only_samples).fit is None
    assert cost_model_from(read_calibration(only_samples), "calibration") == cal.fit
    # a file written before Vegas's terms (rows of four counts, no beta_layered or beta_topk) prices a
    # Vegas verification as it did: its captured scores at beta_capture
    before = tmp_path / "before.json"
    before.write_text(json.dumps({**{k: v for k, v in stored.items() if k not in ("beta_layered", "beta_topk")},
                                  "samples": [[*s[:4], [list(r[:4]) for r in s[4]]] for s in stored["samples"]]}))
    old = cost_model_from(read_calibration(before), "calibration")
    assert old.beta_layered is None and old.beta_topk is None
    verify = [(7, 1030, 0, 2060, 0, 2060)]
    assert old.rows_time(verify) == old.rows_time([r[:4] for r in verify])
    assert replace(old, source="c") == replace(cost_model_from(back, "calibration"), source="c")
    assert CostModel.from_dict(json.loads(json.dumps(stored)), "file") == replace(cal.fit, source="file")


@pytest.mark.parametrize("name", ["ar", "magicdec", "vegas", "aspire", "aspire-fsm"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_identical_invocations_give_identical_tokens(engine, name, temperature):
    settings = {"magicdec": {"budget": 48, "sinks": 4}, "vegas": {"min_tokens": 24, "ratio": 0.05}}.get(
        name, {} if name == "ar" else SPARSE)
    params = SamplingParams(temperature=temperature, top_k=50, top_p=0.9, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a rejected toy-model calibration is fine here: it is replayed too
        outs = [get_decoder(name, **settings).generate(engine, requests(seed=3), params, 3) for _ in range(2)]
    assert [r.output_ids for r in outs[0].results] == [r.output_ids for r in outs[1].results]
    assert [r.verifications for r in outs[0].results] == [r.verifications for r in outs[1].results]


def test_auto_calibration_is_timed_at_the_runs_prompt_length(engine, monkeypatch, capsys):
    """The run's prompts (200-350 tokens, median 275) set the calibration's context, 256, once the floor
    is below them; without them it would be the floor."""
    from aspire_bench.decoders import calibration
    monkeypatch.setattr(calibration, "CALIBRATION_CONTEXT", 128)
    path = calibration_path(engine, 2, 256)
    path.unlink(missing_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a toy model's fit may be rejected: where it was timed is the point
        out = get_decoder("aspire", **SPARSE).generate(engine, requests(), SamplingParams(), 2)
    assert json.loads(path.read_text())["context"] == 256
    assert path.name in out.info["cost_model"]["source"]
    assert not calibration_path(engine, 2, 128).exists()
    assert "timing this machine's step costs at 256 tokens, batch 2" in capsys.readouterr().err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_decoder("aspire", **SPARSE).generate(engine, requests(), SamplingParams(), 2)
    assert "timing" not in capsys.readouterr().err  # stored: said once


def test_a_run_is_calibrated_at_its_own_context():
    """The median prompt length to the nearest power of two, never below 4k (a step there is mostly
    fixed cost), never beyond what the engine holds with d_max drafts."""
    from types import SimpleNamespace
    tiny = SimpleNamespace(max_context=40960, page_size=16)
    assert calibration_context([300, 500, 2000], tiny, 16) == 4096
    assert calibration_context([16384] * 8, tiny, 16) == 16384
    assert calibration_context([12000, 13000, 30000], tiny, 16) == 16384  # the median's nearest: 2^13.7
    assert calibration_context([24000, 32768, 40000], tiny, 16) == 32768
    assert calibration_context([], tiny, 16) == 4096
    short = SimpleNamespace(max_context=32768, page_size=16)
    assert calibration_context([32768], short, 16) == 32768 - 16 - 16 - 1  # room for the drafts and a page
    assert calibration_context([100], SimpleNamespace(max_context=2048, page_size=16), 16) == 2048 - 33


def test_calibrations_live_in_the_kernel_cache_unless_told_otherwise(monkeypatch, tmp_path):
    """Without $ASPIRE_BENCH_CALIBRATION_DIR (the tests set it) calibrations go under the per-machine
    cache the kernels use: the path a user's first aspire run takes."""
    from aspire_bench.decoders.calibration import calibration_dir
    monkeypatch.delenv("ASPIRE_BENCH_CALIBRATION_DIR", raising=False)
    monkeypatch.setenv("ASPIRE_BENCH_CACHE", str(tmp_path))
    assert calibration_dir() == tmp_path / "calibration"
    monkeypatch.setenv("ASPIRE_BENCH_CALIBRATION_DIR", str(tmp_path / "elsewhere"))
    assert calibration_dir() == tmp_path / "elsewhere"


def test_a_calibration_belongs_to_one_attention_backend_and_one_dense_path(engine, monkeypatch):
    from aspire_bench.decoders.calibration import calibration_key
    key = calibration_key(engine, 8, 4096)
    assert engine.backend.name in key and engine.dense_backend in key and "-b8-c4096-" in key
    assert calibration_key(engine, 8, 16384) != key  # timed at another context: another fit
    monkeypatch.setattr(engine, "dense_backend", "eager" if engine.dense_backend != "eager" else "fused")
    assert calibration_key(engine, 8, 4096) != key  # step costs measured with another dense path are not reused


def test_a_calibration_belongs_to_one_version_of_the_engine_and_kernel_code(engine, tmp_path, monkeypatch):
    import shutil

    import aspire_bench
    from aspire_bench.decoders import calibration
    pkg = Path(aspire_bench.__file__).parent
    copy = tmp_path / "aspire_bench"
    for sub in ("engine", "kernels", "decoders"):
        shutil.copytree(pkg / sub, copy / sub, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(calibration, "__file__", str(copy / "decoders" / "calibration.py"))
    calibration.engine_code_hash.cache_clear()
    before = calibration.calibration_key(engine, 8, 4096)
    assert before == calibration.calibration_key(engine, 8, 4096)
    kernel = next((copy / "kernels").rglob("*.cpp"))
    kernel.write_text(kernel.read_text() + "\n// changed\n")
    calibration.engine_code_hash.cache_clear()
    assert calibration.calibration_key(engine, 8, 4096) != before  # timed with other kernels: recalibrated
    calibration.engine_code_hash.cache_clear()


def test_a_cost_term_that_would_fit_negative_is_held_at_zero():
    """Steps with almost no fixed cost and a little curvature: plain least squares puts the intercept
    below zero; the fit holds it at 0 and keeps the others non-negative, so the calibration is usable."""
    gen = np.random.default_rng(0)
    samples = []
    for _ in range(60):
        n, kv = float(gen.integers(8, 64)), float(gen.integers(10_000, 130_000))
        t = 2e-5 * n + 2e-7 * kv + 1e-12 * kv ** 2  # convex in the KV read: no fixed part
        samples.append((n, kv, 0.0, t * (1 + 0.01 * gen.standard_normal())))
    X = np.array([[1.0, n, kv] for n, kv, _, _ in samples])
    plain, *_ = np.linalg.lstsq(X, np.array([s[-1] for s in samples]), rcond=None)
    assert plain[0] < 0  # the case this is about
    fit = fit_cost_model(samples, terms="paper")
    assert fit.beta0 == 0.0 and fit.beta_tok >= 0 and fit.beta_attn > 0
    assert fit_problem(fit) is None
    exact = fit_cost_model([(n, kv, 0.0, 1e-3 + 2e-5 * n + 2e-7 * kv) for n, kv, _, _ in samples], terms="paper")
    assert exact.beta0 == pytest.approx(1e-3) and exact.beta_attn == pytest.approx(2e-7)  # unconstrained when >= 0


def prefilled(engine, policy) -> RequestState:
    """A request of 199 prompt tokens prefilled in a slot of its own (free it), its next token pending:
    the next step drafts or verifies over 199 positions."""
    req = requests(n=1)[0]
    engine.reserve(512)
    slot = engine.alloc(400)
    engine.forward([Row(slot, req.prompt_ids[:-1], 0, logits="none")])
    return RequestState(0, Request("x", req.prompt_ids[:-1], 24), slot, None, out=[req.prompt_ids[-1]],
                    state=policy.new_state())


@pytest.mark.parametrize("refresh", [True, False])
def test_the_cost_ratio_prices_the_draft_the_engine_runs(engine, refresh):
    """draft_kv is the KV read the engine reports for the draft row ASPIRE plans (refresh layer and
    the partly filled last page included), and c grows with it."""
    settings = AspireSettings(refresh=refresh, **SPARSE)
    policy = AspirePolicy(settings, engine.page_size, engine.cfg.num_layers)
    seq = prefilled(engine, policy)
    try:
        seq.state.scores = torch.rand(-(-seq.context_len // engine.page_size))
        (plan,) = policy.plan([seq], 1)
        assert plan.kind == "draft" and plan.view is not None  # 2 of 13 pages
        out = engine.forward([Row(seq.slot, [seq.out[-1]], seq.context_len - 1, view=plan.view,
                                  full_layers=plan.full_layers)])
        assert (out.kv_read[0], out.kv_sparse[0]) == policy.draft_kv(seq.context_len - 1)
    finally:
        engine.free(seq.slot)
    cheap = AspirePolicy(AspireSettings(refresh=False, **SPARSE), engine.page_size, engine.cfg.num_layers)
    assert (policy.cost_ratio(seq, 8) > cheap.cost_ratio(seq, 8)) is refresh
    # scattered pages priced dearer per position make the draft dearer; a budget of every page is no view
    scattered = AspirePolicy(settings, engine.page_size, engine.cfg.num_layers,
                             CostModel(2e-3, 1e-4, 1e-7, beta_sparse=1e-7))
    plain = AspirePolicy(settings, engine.page_size, engine.cfg.num_layers, CostModel(2e-3, 1e-4, 1e-7))
    assert scattered.cost_ratio(seq, 8) > plain.cost_ratio(seq, 8)
    whole = AspirePolicy(AspireSettings(refresh=refresh, ratio=1.0), engine.page_size, engine.cfg.num_layers)
    assert whole.draft_kv(seq.context_len - 1) == (seq.context_len, 0)


@pytest.mark.parametrize("side_by_side", [True, False])
def test_drafts_are_priced_at_the_scattered_share_the_engine_counted(engine, side_by_side):
    """draft_kv's bound takes every page of a draft's set as scattered (the recent one is a run of 16
    here); the policy counts what the engine read for its drafts and prices the next draft at that
    share of the bound: below 1 when the selected pages lie side by side (one run of 80 positions,
    of which its head counts), 1 when no two do."""
    settings = AspireSettings(min_pages=6, recent_pages=1)
    cost = CostModel(2e-3, 1e-4, 1e-7, beta_sparse=1e-7)
    policy = AspirePolicy(settings, engine.page_size, engine.cfg.num_layers, cost)
    seq = prefilled(engine, policy)
    try:
        seq.state.scores = torch.zeros(-(-seq.context_len // engine.page_size))
        seq.state.scores[[2, 3, 4, 5, 6] if side_by_side else [0, 2, 4, 6, 8]] = 1.0
        prefix, before = seq.context_len - 1, policy.cost_ratio(seq, 8)
        (plan,) = policy.plan([seq], 1)
        assert plan.kind == "draft" and plan.view.pages.tolist()[:5] == ([2, 3, 4, 5, 6] if side_by_side
                                                                        else [0, 2, 4, 6, 8])
        out = engine.forward([Row(seq.slot, [seq.out[-1]], prefix, view=plan.view, full_layers=plan.full_layers)])
    finally:
        engine.free(seq.slot)
    bound = policy.draft_kv(prefix, share=1.0)[1]
    assert policy.scattered_share == 1.0 and policy.draft_kv(prefix)[1] == bound  # nothing counted yet
    policy.step_done(StepTrace(0, 0.0, 1.0, [RowTrace("x", "draft", 1, kv_read=out.kv_read[0],
                                                      kv_sparse=out.kv_sparse[0])]))
    assert (policy.scattered_counted, policy.scattered_assumed) == (out.kv_sparse[0], bound)
    if side_by_side:  # the run's head and the recent page
        ps, L = engine.page_size, engine.cfg.num_layers
        recent = prefix - (-(-prefix // ps) - 1) * ps  # positions of the partly filled last page
        assert policy.scattered_counted == round((L - 1) * (SCATTERED_HEAD + recent) / L)  # (refresh layer: none)
        assert 0 < policy.scattered_share < 1
        assert policy.draft_kv(prefix)[1] < bound and policy.cost_ratio(seq, 8) < before
    else:
        assert policy.scattered_share == 1.0 and policy.cost_ratio(seq, 8) == before
    assert policy.info()["draft_scattered_share"] == round(policy.scattered_share, 4)


def test_papercost_uses_the_paper_fit_of_a_good_calibration_however_it_misfits(engine, tmp_path, seed):
    """A calibration explained well by the four-term model: aspire uses that, aspire-papercost the
    paper's three terms refitted from the same samples, although they explain the steps poorly (the
    point of the variant); neither falls back to the default."""
    samples = [list(s[:4]) + [list(map(list, s[4]))] for s in _hinge_samples(0, seed)]
    for s in samples:  # a strong query x KV term: the three terms miss it
        s[3] += 4e-8 * qk_term(s[4])
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"samples": samples}))
    assert fit_problem(fit_cost_model([tuple(s) for s in samples], terms="paper")) is not None  # R^2 < 0.9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        full = get_decoder("aspire", calibration=str(path), **SPARSE).generate(
            engine, requests(n=1), SamplingParams(), 1).info["cost_model"]
        paper = get_decoder("aspire-papercost", calibration=str(path), **SPARSE).generate(
            engine, requests(n=1), SamplingParams(), 1).info["cost_model"]
    assert full["source"] == paper["source"] == "calibration:cal.json"
    assert full["beta_qk"] > 0 and paper["beta_qk"] == 0.0 and paper["r2"] < MIN_R2 <= full["r2"]
