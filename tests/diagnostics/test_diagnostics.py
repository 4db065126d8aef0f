"""Diagnostics: recall against a brute-force computation on full attention matrices, the engine's
captured scores against transformers' attention probabilities, the CLI's JSON contract and errors,
and the store's kind."""
from __future__ import annotations

import json
import math

import pytest
import torch

from aspire_bench.diagnostics.recall import TOKENS, RecallAccumulator, RecallSpec

L, H, N = 3, 4, 70


def full_attention(seed: int = 0) -> torch.Tensor:
    """[L, H, N, N] causal softmax probabilities of random, fairly peaked q.K scores."""
    g = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(L, H, N, 8, generator=g, dtype=torch.float64)
    k = torch.randn(L, H, N, 8, generator=g, dtype=torch.float64)
    s = q @ k.transpose(-1, -2)
    s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1)


def brute_recall(p, heads, spec, t, predictor, layer, unit, k) -> float:
    """The definition, element by element: sets built by sorting Python lists."""
    red = p.amax(1) if heads == "max" else p.mean(1)  # [L, N, N]
    mean = p.mean(1)
    true = [float(x) for x in red[layer, t, :t]]
    total = sum(true)
    true = [x / total for x in true]
    name, _, arg = predictor.partition(":")
    if name == "window":
        if unit == TOKENS:
            chosen = set(range(t)) if k >= t else set(range(min(spec.sinks, k))) | set(range(t - (k - min(spec.sinks, k)), t))
        else:
            n_pages, s = math.ceil(t / spec.page_size), min(math.ceil(spec.sinks / spec.page_size), k)
            pages = set(range(n_pages)) if k >= n_pages else set(range(s)) | set(range(n_pages - (k - s), n_pages))
            chosen = {i for i in range(t) if i // spec.page_size in pages}
        return sum(true[i] for i in chosen)
    value = int(arg.split("=")[1]) if arg else None
    if name == "temporal":
        src = red[layer, t - value, :t - value + 1]
    elif name == "cross-layer":
        src = red[value, t, :t]
    elif name == "refresh":
        src = red[value, t - 1, :t]
    else:  # vegas: first and last query of the verification gamma tokens back
        f, last = t - 2 * spec.vegas_gamma, t - spec.vegas_gamma
        src = (mean[layer, f, :last + 1] + mean[layer, last, :last + 1]) / 2
    src = [float(x) for x in src]
    if unit == TOKENS:
        chosen = sorted(range(len(src)), key=lambda i: -src[i])[:k]
    else:
        ps = spec.page_size
        page_score = {}
        for i, x in enumerate(src):
            page_score[i // ps] = page_score.get(i // ps, 0.0) + x
        pages = set(sorted(page_score, key=lambda pg: -page_score[pg])[:k])
        chosen = [i for i in range(t) if i // ps in pages]
    return sum(true[i] for i in chosen)


@pytest.mark.parametrize("heads", ["max", "mean"])
def test_recall_matches_brute_force_on_full_attention(heads):
    p = full_attention()
    spec = RecallSpec(k_tokens=(1, 5, 20, 100), k_pages=(1, 3, 40), page_size=4, lags=(1, 3), sinks=2,
                      vegas_gamma=2)
    red = p.amax(1) if heads == "max" else p.mean(1)
    scores = {t: red[:, t, :t + 1].float() for t in range(N)}
    means = {t: p.mean(1)[:, t, :t + 1].float() for t in range(N)} if heads == "max" else None
    queries = [40, 53, 69]
    acc = RecallAccumulator(L, spec)
    for t in queries:
        acc.add_query(t, scores, means)
    rows = acc.rows()
    preds = {r["predictor"] for r in rows}
    assert preds == {"temporal:lag=1", "temporal:lag=3", "cross-layer:from=0", "cross-layer:from=1", "refresh:layer=0",
                     "refresh:layer=1", "refresh:layer=2", "window", "vegas"}
    checked = 0
    for r in rows:
        if r["layer"] == "mean":
            continue
        want = sum(brute_recall(p, heads, spec, t, r["predictor"], r["layer"], r["unit"], r["k"])
                   for t in queries) / len(queries)
        assert r["recall"] == pytest.approx(want, abs=1e-5), r
        assert r["n"] == len(queries)
        checked += 1
    # cross-layer from j is evaluated on the later layers only, refresh at j on every other layer
    layers = lambda pred: sorted(r["layer"] for r in rows if r["predictor"] == pred and r["unit"] == TOKENS
                                 and r["k"] == 1 and r["layer"] != "mean")
    assert layers("cross-layer:from=1") == [2] and layers("refresh:layer=1") == [0, 2] and layers("vegas") == [0, 1, 2]
    assert checked == sum(1 for r in rows if r["layer"] != "mean")
    for r in rows:
        assert 0.0 <= r["recall"] <= 1.0
        if r["layer"] == "mean":
            per = [x["recall"] for x in rows if x["layer"] != "mean" and
                   (x["predictor"], x["unit"], x["k"]) == (r["predictor"], r["unit"], r["k"])]
            assert r["recall"] == pytest.approx(sum(per) / len(per))
    # every key (k = 100 > context) or every page covers all the mass, except where the predictor
    # never saw the newest keys (temporal lags)
    full = [r for r in rows if r["k"] in (100, 40) and not r["predictor"].startswith(("temporal", "vegas"))]
    assert full and all(r["recall"] == pytest.approx(1.0) for r in full)
    lag3 = [r for r in rows if r["predictor"] == "temporal:lag=3" and r["unit"] == TOKENS and r["k"] == 100]
    assert all(r["recall"] < 1.0 for r in lag3)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_captured_scores_are_transformers_attention(checkpoints, backend):
    """Each captured position's scores at every layer are the max (and mean) over heads of the
    attention probabilities transformers computes with the full matrix."""
    from aspire_bench.diagnostics.capture import capture_scores, token_engine
    from aspire_bench.engine import Engine
    path, hf = checkpoints["llama"]  # GQA 4:1
    hf.set_attn_implementation("eager")
    ids = torch.randint(0, 320, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        att = hf(torch.tensor([ids]), output_attentions=True).attentions  # per layer [1, H, n, n]
    engine = Engine.from_pretrained(path, attention_backend=backend)
    assert engine.page_size > 1  # token_engine makes the one-token-page twin
    first = 30
    mx, mean = capture_scores(token_engine(engine), ids, first, "max", also_mean=True)
    assert sorted(mx) == sorted(mean) == list(range(first, len(ids)))
    for p in range(first, len(ids)):
        want = torch.stack([a[0, :, p, :p + 1] for a in att]).float()  # [L, H, p + 1]
        torch.testing.assert_close(mx[p], want.amax(1), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(mean[p], want.mean(1), atol=2e-5, rtol=1e-4)
    only_mean, none = capture_scores(token_engine(engine), ids, first, "mean", also_mean=True)
    assert none is None and torch.allclose(only_mean[first], mean[first])


# --- the commands ---------------------------------------------------------------------------------

def _invoke(args):
    from click.testing import CliRunner

    from aspire_bench.cli import main
    return CliRunner().invoke(main, args)


def test_recall_command_json_contract_and_store(random_tiny, tmp_path):
    from aspire_bench.harness.store import Store
    from aspire_bench.report.leaderboard import load_runs
    out, db = tmp_path / "recall.json", tmp_path / "s.db"
    res = _invoke(["diagnose", "recall", "--model", str(random_tiny), "--context-len", "512", "--requests", "1",
                   "--positions", "3", "--continuation", "greedy", "--k-tokens", "8,600", "--k-pages", "2",
                   "--page-size", "4", "--lags", "1,2", "--vegas-gamma", "2", "--json", str(out), "--store", str(db),
                   "--format", "json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())
    assert rows == json.loads(res.stdout)
    L = 4  # the random checkpoint's layers
    assert {r["predictor"] for r in rows} == {"temporal:lag=1", "temporal:lag=2", "window", "vegas",
                                               *(f"cross-layer:from={j}" for j in range(L - 1)),
                                               *(f"refresh:layer={j}" for j in range(L))}
    for r in rows:
        assert {"predictor", "layer", "k", "recall"} <= set(r)
        assert r["layer"] == "mean" or r["layer"] in range(L)
        assert 0.0 <= r["recall"] <= 1.0 and r["n"] == 3
        assert (r["unit"], r["k"]) in {("tokens", 8), ("tokens", 600), ("pages", 2)}
    # a budget beyond the context covers everything for predictors that see every prefix key
    assert all(r["recall"] == pytest.approx(1.0) for r in rows
               if r["k"] == 600 and r["predictor"].startswith(("cross-layer", "refresh", "window")))
    with Store(db, readonly=True) as st:
        runs = st.list_runs(kind="diagnostic")
        assert len(runs) == 1 and st.list_runs(kind="measured") == []
        rec = st.get_run(runs[0]["run_id"])
    assert rec.kind == "diagnostic" and rec.config["diagnostic"] == "recall"
    assert rec.info["recall"]["rows"] == rows
    assert rec.aggregates["recall:window:tokens@600"] == pytest.approx(1.0)
    assert load_runs(db) == []  # the leaderboard never ranks diagnostics


def test_heterogeneity_command(random_tiny, tmp_path):
    from aspire_bench.harness.store import Store
    out, db = tmp_path / "het.json", tmp_path / "s.db"
    res = _invoke(["diagnose", "heterogeneity", "--model", str(random_tiny), "--context-len", "512",
                   "--decoder", "magicdec", "--decoder-arg", "budget=64", "--draft-len", "3", "--requests", "3",
                   "--max-new-tokens", "10", "--json", str(out), "--store", str(db), "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["decoder"] == "magicdec" and data["draft_len"] == 3 and data["settings"] == {"budget": 64, "gamma": 3}
    assert len(data["requests"]) == 3
    with Store(db, readonly=True) as st:
        rec = st.get_run(st.list_runs(kind="diagnostic")[0]["run_id"])
    means = []
    for r, stored in zip(data["requests"], rec.requests):
        full = [a for d, a in stored.verifications if d == 3]  # the rounds that drafted all 3 tokens
        assert r["accepted"] == full and r["rounds"] == len(full) > 0
        assert r["mean"] == pytest.approx(sum(full) / len(full)) and r["min"] == min(full) and r["max"] == max(full)
        assert 0 <= r["min"] <= r["mean"] <= r["max"] <= 3
        means.append(r["mean"])
    s = data["summary"]
    assert s["n"] == 3 and s["min"] == min(means) and s["max"] == max(means)
    assert s["mean"] == pytest.approx(sum(means) / 3) and s["median"] == pytest.approx(sorted(means)[1])
    assert rec.kind == "diagnostic" and rec.config["diagnostic"] == "heterogeneity"
    assert rec.aggregates["accepted_len_mean"] == pytest.approx(s["mean"])


def test_distribution_quartiles():
    from aspire_bench.diagnostics.heterogeneity import distribution, fixed_draft_settings, request_stats
    d = distribution([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (d["min"], d["q1"], d["median"], d["q3"], d["max"], d["mean"]) == (1.0, 2.0, 3.0, 4.0, 5.0, 3.0)
    assert distribution([2.5])["q1"] == 2.5 and distribution([])["n"] == 0
    st = request_stats([(4, 1), (4, 3), (2, 2)], 4)  # the short last round is not a round of D
    assert st == {"rounds": 2, "mean": 2.0, "std": 1.0, "min": 1, "max": 3}
    assert fixed_draft_settings("aspire-fsm", 7)["policy"] == "fixed"
    assert fixed_draft_settings("vegas", 7) == {"gamma": 7}


@pytest.mark.parametrize("args, message", [
    (["recall", "--k-tokens", "0"], "--k-tokens"),
    (["recall", "--k-tokens", "none", "--k-pages", "none"], "at least one budget"),
    (["recall", "--predictors", "temporal,nope"], "unknown predictor 'nope'"),
    (["recall", "--heads", "min"], "--heads"),
    (["recall", "--lags", "none"], "temporal reuse needs at least one lag"),
    (["recall", "--context-len", "banana"], "--context-len"),
    (["heterogeneity", "--decoder", "ar"], "ar does not draft"),
    (["heterogeneity", "--draft-len", "0"], "--draft-len"),
    (["heterogeneity", "--decoder", "nope"], "unknown decoder 'nope'"),
    (["heterogeneity", "--decoder-arg", "gamma=4", "--decoder", "magicdec"], "set by --draft-len"),
    (["recall", "--store", "DIR"], "is a directory"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    args = [str(tmp_path) if a == "DIR" else a for a in args]
    if "--store" not in args:
        args = [*args, "--store", str(tmp_path / "s.db")]
    res = _invoke(["diagnose", *args])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert not (tmp_path / "s.db").exists()


# --- the report's diagnostics page -------------------------------------------------------------------

def _diagnostic_store(path):
    """A store with one measured-free recall run and one heterogeneity run, made by hand."""
    from aspire_bench.diagnostics.heterogeneity import distribution
    from aspire_bench.diagnostics.records import diagnostic_record
    from aspire_bench.harness.store import Store
    rows = []
    for unit, k in (("tokens", 256), ("pages", 32)):
        preds = {f"temporal:lag={g}": 0.9 - 0.1 * i for i, g in enumerate((1, 2, 4, 8, 16))}
        preds |= {f"cross-layer:from={j}": 0.5 + 0.1 * j for j in range(3)}
        preds |= {f"refresh:layer={j}": 0.6 + 0.05 * j for j in range(4)} | {"window": 0.3, "vegas": 0.7}
        for p, v in preds.items():
            rows += [{"predictor": p, "layer": 0, "unit": unit, "k": k, "recall": v, "n": 2},
                     {"predictor": p, "layer": "mean", "unit": unit, "k": k, "recall": v, "n": 2}]
    reqs = [{"id": f"r{i}", "prompt_len": 4096, "rounds": 3, "accepted": acc, "mean": sum(acc) / 3,
             "std": 1.0, "min": min(acc), "max": max(acc)} for i, acc in enumerate(([20, 18, 19], [2, 5, 3], [9, 0, 20]))]
    with Store(path) as st:
        st.save_run(diagnostic_record({"diagnostic": "recall", "model": "tiny", "task": "code-completion",
                                       "context_len": "4k", "heads": "max"}, {"recall": {"rows": rows}}, {}))
        st.save_run(diagnostic_record({"diagnostic": "heterogeneity", "model": "tiny", "decoder": "aspire",
                                       "draft_len": 20}, {"heterogeneity": {
                                           "requests": reqs, "summary": distribution([r["mean"] for r in reqs])}}, {}))


def test_diagnostics_page_in_headless_browser(tmp_path):
    from test_report import PLOT_MARKS, Browser, _chromium, _wait_for_plots

    from aspire_bench.report import write_report
    db = tmp_path / "s.db"
    _diagnostic_store(db)
    index = write_report(db, tmp_path / "lb")
    html = index.read_text()
    assert 'href="diagnostics.html"' in html and "No successful runs" in html  # diagnostics are never ranked
    b = Browser(_chromium(), tmp_path / "profile")
    try:
        b.viewport(1200)
        b.open((tmp_path / "lb" / "diagnostics.html").as_uri())
        _wait_for_plots(b)
        assert b.errors() == []
        marks = dict(b.eval(PLOT_MARKS))
        assert sorted(k.split("-")[0] for k in marks) == ["box", "hist", "lag", "layer"], marks
        assert all(n > 0 for n in marks.values()), marks
        names = dict(b.eval('Array.from(document.querySelectorAll("div.plotly-graph-div")).map(function(d){'
                            'return [d.id.split("-")[0], d.data.map(function(t){return t.name;})];})'))
        assert names["lag"] == ["temporal · 256 tokens", "refresh:layer=2 · 256 tokens", "temporal · 32 pages",
                                "refresh:layer=2 · 32 pages"]
        assert names["box"] == ["0", "1", "2"]
        text = b.eval('document.querySelector("table.heterogeneity").innerText')
        assert "19.00" in text and "3.33" in text  # the per-request means' max and min
        from test_report import ARTIFACTS
        ARTIFACTS.mkdir(exist_ok=True)
        b.screenshot(ARTIFACTS / "diagnostics.png")
        b.open((tmp_path / "lb" / "diagnostics-definitions.html").as_uri())
        assert b.errors() == [] and b.eval('!!document.getElementById("mass-recallk")')
    finally:
        b.close()
