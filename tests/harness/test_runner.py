"""`aspire-bench run` end to end: tasks in, decoders, figures, the store."""
from __future__ import annotations

import json
import sqlite3

import pytest
from click.testing import CliRunner

from aspire_bench.cli import main
from aspire_bench.harness.runner import RunConfig, run
from aspire_bench.harness.store import Store
from aspire_bench.kernels import get_backend


def test_run_api_stores_a_complete_record(random_tiny, tmp_path):
    db = tmp_path / "r.db"
    res = run(RunConfig(model=str(random_tiny), decoder="aspire", decoder_args={"min_pages": 2}, task="needle",
                        context_len="1k", limit=3, batch_size=2, max_new_tokens=12, parity=True, repeat=2),
              store=str(db), show_progress=False)
    a = res.aggregates
    assert res.run_id is not None and a["n_requests"] == 3
    assert a["parity_identical_pct"] == 100.0  # greedy speculative == AR
    assert a["decode_tok_s_min"] <= a["decode_tok_s_median"] <= a["decode_tok_s_max"]
    assert a["repeats"] == 2 and a["mean_accepted_len"] >= 1.0
    with Store(db) as st:
        rec = st.get_run(res.run_id)
    assert rec.config["decoder"] == "aspire" and rec.config["decoder_args"] == {"min_pages": 2}
    assert rec.info["policy"] == "adaptive" and rec.env["attention_backend"] == get_backend("auto", "cpu").name
    assert len(rec.requests) == 3 and all(len(r.output_ids) == 12 for r in rec.requests)
    assert all(r.prompt_len == 1024 for r in rec.requests)
    assert all(r.score is not None for r in rec.requests)
    # the scheduler's view of each verification reaches the store (replayable runs)
    assert all(r.schedule and all(set(v) == {"alpha", "c", "gamma"} for v in r.schedule)
               and [v["gamma"] for v in r.schedule] == r.draft_lengths and r.extra == {} for r in rec.requests)


def test_cli_run_prints_summary_and_stores(random_tiny, tmp_path):
    db = tmp_path / "c.db"
    r = CliRunner().invoke(main, ["run", "--model", str(random_tiny), "--decoder", "magicdec",
                                  "--decoder-arg", "budget=64", "--task", "kv-retrieval", "--context-len", "1k",
                                  "--limit", "2", "--batch-size", "2", "--max-new-tokens", "8", "--store", str(db)])
    assert r.exit_code == 0, r.output
    assert "magicdec" in r.output and "stored run 1" in r.output
    n = sqlite3.connect(db).execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    assert n == 1


@pytest.mark.parametrize("args, message", [
    (["--task", "nope"], "unknown task 'nope'"),
    (["--decoder", "nope"], "unknown decoder 'nope'"),
    (["--decoder", "aspire", "--decoder-arg", "bogus=1"], "bogus"),
    (["--task", "needle", "--context-len", "64k"], "maximum context of 8192"),
    (["--model", "/no/such/dir"], "does not exist"),
    (["--task", "aime24"], "--data PATH"),
])
def test_cli_run_bad_inputs_are_one_line_errors(random_tiny, tmp_path, args, message):
    base = ["run", "--model", str(random_tiny), "--limit", "1", "--max-new-tokens", "4",
            "--store", str(tmp_path / "x.db")]
    if "--model" in args:
        base = base[:1] + base[3:]
    r = CliRunner().invoke(main, base + args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x.db").exists() or sqlite3.connect(tmp_path / "x.db").execute(
        "SELECT COUNT(*) FROM runs").fetchone()[0] == 0


def test_generate_command_writes_rows(random_tiny, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "def f(x):\n    return"}) + "\n"
                       + json.dumps({"id": "b", "input_ids": [5, 6, 7]}) + "\n")
    out = tmp_path / "o.jsonl"
    for dec in ("ar", "vegas"):
        r = CliRunner().invoke(main, ["generate", "--model", str(random_tiny), "--decoder", dec, "--prompts",
                                      str(prompts), "--out", str(out), "--max-new-tokens", "6"])
        assert r.exit_code == 0, r.output
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert [x["id"] for x in rows] == ["a", "b"]
        assert all(len(x["output_ids"]) <= 6 and x["finish_reason"] in ("eos", "length") for x in rows)
        assert isinstance(rows[0]["text"], str)


CONTRACT = ("settings", "tuned", "n_requests", "speedup_vs_ar", "speedup_vs_ar_ci95", "speedup_vs_best_baseline",
             "speedup_vs_best_baseline_ci95", "bound_share")


@pytest.mark.real_calibration
def test_bench_json_contract(random_tiny, tmp_path):
    """`aspire-bench bench` at tiny sizes: default and tuned baseline rows, intervals, bound share, the
    JSON keys of the contract; parity under greedy; the same work for every decoder."""
    out, res = tmp_path / "bench.json", tmp_path / "result.json"
    r = CliRunner().invoke(main, ["bench", "--model", str(random_tiny), "--task", "needle", "--context-len", "1k",
                                  "--batch-size", "2", "--limit", "4", "--decoders", "ar,magicdec,aspire",
                                  "--repeat", "2", "--sampling", "greedy", "--max-new-tokens", "6",
                                  "--store", str(tmp_path / "b.db"), "--json", str(out), "--save-result", str(res),
                                  "--percentiles", "50,99"],
                           env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())
    assert [(x["sampling"], x["decoder"], x["tuned"]) for x in rows] == [
        ("greedy", d, t) for d, t in (("ar", False), ("magicdec", False), ("magicdec", True), ("aspire", False))]
    for x in rows:
        assert set(CONTRACT) <= set(x), sorted(set(CONTRACT) - set(x))
        assert x["n_requests"] == 4 and x["output_tokens"] == 4 * 6  # EOS ignored: the same work
        lo, hi = x["speedup_vs_ar_ci95"]
        assert lo <= x["speedup_vs_ar"] <= hi
        assert x["decode_tok_s_min"] <= x["decode_tok_s_median"] <= x["decode_tok_s_max"]
        assert x["bytes_per_token"] > 0 and x["memory_bw_gbs"] > 0
        if x["decoder"] == "ar":
            assert x["speedup_vs_ar"] == pytest.approx(1.0) and x["speedup_vs_best_baseline"] is None
            assert x["bound_share"] is None
        else:
            lo, hi = x["speedup_vs_best_baseline_ci95"]
            assert lo <= x["speedup_vs_best_baseline"] <= hi
            assert x["bound_share"] > 0 and x["allowed_speedup"] > 0
    assert not any(k in x["settings"] for x in rows for k in ("adjacent_calibration", "interleaved_calibration"))
    default, tuned = rows[1], rows[2]
    assert default["settings"]["gamma"] == 3 and tuned["settings"]["gamma"] in (1, 2, 3, 4)
    # "x best baseline" is over the faster baseline row, tuned or default: that row's own ratio is exactly 1
    # (on a tie the first, the default row)
    best, other = (tuned, default) if tuned["speedup_vs_ar"] > default["speedup_vs_ar"] else (default, tuned)
    assert best["speedup_vs_best_baseline"] == pytest.approx(1.0) and other["speedup_vs_best_baseline"] <= 1.0 + 1e-9
    assert rows[3]["best_baseline"] == best["best_baseline"] and rows[3]["best_baseline"].startswith(
        "magicdec tuned" if best is tuned else "magicdec γ=3")
    assert all(x["parity_identical_pct"] == 100.0 for x in rows[1:])
    assert all("tpot_p99_s" in x and "tpot_p90_s" not in x for x in rows)  # --percentiles 50,99
    vllm = json.loads(res.read_text())
    assert len(vllm) == len(rows) and vllm[0]["completed"] == 4 and "p99_tpot_ms" in vllm[0]
    assert vllm[0]["total_output_tokens"] == 24 and vllm[0]["request_throughput"] > 0
    for col in ("× best baseline", "bound share", "tuned", "TPOT p50 ms"):
        assert col in r.output
    db = sqlite3.connect(tmp_path / "b.db")
    assert db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 4
    # a calibration round after every run of every repeat, pooled and stored with each run for the simulator
    from aspire_bench.harness.store import Store
    from aspire_bench.simulator.source import stored_calibration
    with Store(tmp_path / "b.db", readonly=True) as st:
        recs = [st.get_run(i) for i in range(1, 5)]
        cals = [rec.info["interleaved_calibration"] for rec in recs]
        assert all(c == cals[0] for c in cals) and cals[0]["rounds"] == 4 * 2 and cals[0]["context"] == 1024
        adjacent = [rec.info["adjacent_calibration"] for rec in recs]
        assert all(a["rounds"] == 1 and a["context"] == 1024 for a in adjacent)
        model = stored_calibration(st, recs[0])
        # Rounds: 4 requests at batch 2, 2 repeats -> 2 slices a repeat, 4 rounds, each probing the machine
        # and running every decoder on its slice in an order rotated round by round.
        rounds = recs[0].info["rounds"]
        assert all(rec.info["rounds"] == rounds for rec in recs) and len(rounds) == 4
        assert [(m["repeat"], m["slice"], len(m["requests"])) for m in rounds] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
        assert rounds[0]["requests"] + rounds[1]["requests"] == [r.id for r in recs[0].requests]
        orders = [m["order"] for m in rounds]
        assert orders[0] == ["ar", "magicdec", "magicdec tuned", "aspire"] and orders[1] == orders[0][1:] + orders[0][:1]
        assert all(m["mem_gbs"] > 0 and m["fma_gflops"] > 0 for m in rounds)
    for x in rows:
        assert 0 < x["memory_bw_gbs_min"] <= x["memory_bw_gbs_max"] and 0 < x["fma_gflops_min"] <= x["fma_gflops_max"]
    assert "4 rounds: memory " in " ".join(r.output.split())
    # each fit is stored with its samples: refitted from the store, the same coefficients
    from aspire_bench.decoders.scheduler import fit_cost_model
    for c in (cals[0], adjacent[0]):
        refit = fit_cost_model(c["samples"]).to_dict()
        assert all(c[k] == v for k, v in refit.items() if k != "source")
    # real timings on a busy test machine may misfit: then the pooled or the group's fit is used (the
    # choice itself is tested on fixed fits in tests/simulator)
    from aspire_bench.decoders.scheduler import CostModel, fit_problem
    if fit_problem(CostModel.from_dict(adjacent[0], "adjacent")) is None:
        assert model.source == "adjacent calibration" and model.beta_attn == adjacent[0]["beta_attn"]


def test_ratio_intervals_take_the_wider_of_requests_and_rounds():
    """Two rounds, the machine twice as slow for the speculative decoder in the second: requests alone
    look tight within each round, the interval over rounds sees the drift and is the one kept."""
    from aspire_bench.harness.bench import _ci
    num = {(f"r{j}", 0): (10, 1.0 if j < 4 else 2.0) for j in range(8)}
    den = {(f"r{j}", 0): (10, 1.0 + 0.01 * j) for j in range(8)}
    blocks = {k: 0 if int(k[0][1:]) < 4 else 1 for k in num}
    from aspire_bench.harness import metrics
    by_request, by_round = metrics.ratio_ci(num, den), metrics.ratio_ci(num, den, blocks=blocks)
    assert by_round[1] - by_round[0] > by_request[1] - by_request[0]
    assert _ci(num, den, blocks) == list(by_round) and _ci(num, den) == list(by_request)
    one_block = {k: 0 for k in num}
    assert metrics.ratio_ci(num, den, blocks=one_block) is None and _ci(num, den, one_block) == list(by_request)


def test_bench_says_when_the_machine_state_moved_since_an_earlier_run_of_the_cell(tmp_path):
    from aspire_bench.harness.bench import BenchRow, state_notes
    from aspire_bench.harness.records import RunRecord, config_hash
    from aspire_bench.harness.store import Store
    config = {"decoder": "ar", "model": "tiny", "task": "needle", "context_len": "16k", "batch_size": 8}

    def rec(lo, hi):
        return RunRecord(config=config, config_hash=config_hash(config), env={}, group="g",
                         aggregates={"memory_bw_gbs_min": lo, "memory_bw_gbs_max": hi},
                         info={"rounds": [{"mem_gbs": lo}, {"mem_gbs": hi}]})
    with Store(tmp_path / "s.db") as st:
        st.save_run(rec(40.0, 43.0))
        inside = rec(41.0, 42.0)
        inside.run_id = st.save_run(inside)
        assert state_notes(st, [BenchRow("16k", 8, "paper", inside)]) == []
        slower = rec(27.0, 30.0)
        slower.run_id = st.save_run(slower)
        notes = state_notes(st, [BenchRow("16k", 8, "paper", slower)])
    assert len(notes) == 1 and "27.0-30.0 GB/s, run #1 of the same cell" in notes[0] and "40.0-43.0 GB/s" in notes[0]


def test_bench_runs_decoders_with_their_own_settings_side_by_side(random_tiny, tmp_path):
    """`--decoders` items may carry settings in brackets: each is its own row of the cell (its own
    config, stored and labelled with them), a baseline given gamma gets no tuned row, and a row whose
    settings may change its view gets no bound share (the cell's step costs are the default views')."""
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(main, ["bench", "--model", str(random_tiny), "--task", "needle", "--contexts", "1k",
                                  "--batch-sizes", "2", "--limit", "2", "--repeat", "1", "--sampling", "greedy",
                                  "--max-new-tokens", "4", "--decoders",
                                  "ar,magicdec[budget=64],magicdec[gamma=2,budget=32],aspire,aspire[ratio=0.2]",
                                  "--store", str(tmp_path / "b.db"), "--json", str(out)], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())
    got = [(x["decoder"], x["settings"].get("budget"), x["settings"].get("ratio"), x["tuned"]) for x in rows]
    assert got == [("ar", None, None, False), ("magicdec", 64, None, False), ("magicdec", 64, None, True),
                   ("magicdec", 32, None, False), ("aspire", None, 0.07, False), ("aspire", None, 0.2, False)]
    assert rows[3]["settings"]["gamma"] == 2
    assert all(x["parity_identical_pct"] == 100.0 for x in rows[1:])
    assert rows[4]["bound_share"] is not None and all(rows[i]["bound_share"] is None for i in (1, 2, 3, 5))
    for label in ("magicdec(budget=64) γ=3", "magicdec(budget=64) tuned", "magicdec(budget=32, gamma=2)",
                  "aspire(ratio=0.2)"):
        assert label in r.output
    with Store(tmp_path / "b.db", readonly=True) as st:
        recs = [st.get_run(i) for i in range(1, 7)]
    assert [rec.config["decoder_args"] for rec in recs] == [{}, {"budget": 64}, {"budget": 64}, {"budget": 32, "gamma": 2},
                                                           {}, {"ratio": 0.2}]
    assert len({rec.group for rec in recs}) == 1 and recs[0].group  # one cell: one group


def test_an_interrupted_bench_keeps_the_repeats_every_decoder_finished(random_tiny, tmp_path, monkeypatch):
    """Ctrl-C (or a SIGTERM) during a cell's second round: the first round of every decoder is stored with
    its figures, the command says so on stderr and exits 130 without a traceback."""
    from aspire_bench.harness import bench as B
    real, calls = B._measure_slice, []

    def measure(p, i, part, show):
        calls.append(i)
        if i == 1 and len(calls) == 4:  # the second repeat's second run
            raise KeyboardInterrupt
        return real(p, i, part, show)

    monkeypatch.setattr(B, "_measure_slice", measure)
    db = tmp_path / "b.db"
    r = CliRunner().invoke(main, ["bench", "--model", str(random_tiny), "--task", "needle", "--contexts", "1k,2k",
                                  "--batch-sizes", "2", "--limit", "2", "--repeat", "3", "--sampling", "greedy",
                                  "--max-new-tokens", "4", "--decoders", "ar,magicdec", "--no-tune",
                                  "--store", str(db)])
    assert r.exit_code == 130 and "Traceback" not in r.output, r.output
    assert "kept the 1 of 3 repeats" in r.output and "2 runs of the finished cells and repeats are stored" in r.output
    with Store(db, readonly=True) as st:
        recs = [st.get_run(i) for i in (1, 2)]
        assert st.list_runs() and len(st.list_runs()) == 2  # the 2k cell never ran
    assert [rec.config["decoder"] for rec in recs] == ["ar", "magicdec"]
    assert all(rec.aggregates["repeats"] == 1 for rec in recs)
    assert recs[1].aggregates["speedup_vs_ar"] > 0 and recs[1].aggregates["bound_share"] is None  # no step costs


def test_a_bench_interrupted_while_measuring_step_costs_keeps_the_whole_cell(random_tiny, tmp_path, monkeypatch):
    from aspire_bench.harness import bench as B

    def stop(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(B, "_step_costs", stop)
    db = tmp_path / "b.db"
    with pytest.raises(KeyboardInterrupt):
        B.bench(str(random_tiny), "needle", ["1k"], [2], ["ar", "magicdec"], repeat=2, max_new_tokens=4,
                samplings=[B.Sampling(0.0, 0, 1.0)], limit=2, tune=False, store=str(db), show_progress=False,
                calibration_rounds=False)
    with Store(db, readonly=True) as st:
        recs = [st.get_run(s["run_id"]) for s in st.list_runs()]
    assert len(recs) == 2 and all(rec.aggregates["repeats"] == 2 for rec in recs)
    assert all(rec.aggregates.get("bound_share") is None for rec in recs)


@pytest.mark.parametrize("spec, message", [
    ("ar,aspire[ratio=0.1", "unbalanced brackets"),
    ("aspire]", "unbalanced brackets"),
    ("aspire[ratio]", "is not of the form key=value"),
    ("aspire[ratio=0.1],aspire[ratio=0.1]", "is given twice"),
    ("magicdec[budget=64]x", "is not a decoder name"),
    ("aspire[ratio=7]", "ratio"),
    ("aspire[nonsense=1]", "nonsense"),
])
def test_bench_refuses_a_bad_decoder_spec_in_one_line(random_tiny, spec, message):
    r = CliRunner().invoke(main, ["bench", "--model", str(random_tiny), "--decoders", spec])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output, r.output


def test_bench_rejects_unknown_sampling(random_tiny):
    r = CliRunner().invoke(main, ["bench", "--model", str(random_tiny), "--sampling", "hot"])
    assert r.exit_code != 0 and "unknown sampling setting 'hot'" in r.output


def test_prefix_cache_gives_identical_outputs(random_tiny):
    from aspire_bench.decoders import Request, SamplingParams, get_decoder
    from aspire_bench.engine import Engine
    eng = Engine.from_pretrained(str(random_tiny), attention_backend="torch")
    reqs = [Request(str(i), list(range(5 + i, 300 + 7 * i)), 8) for i in range(3)]
    plain = get_decoder("vegas", min_tokens=16).generate(eng, reqs, SamplingParams(), 2)
    eng.prefix_cache = {}
    first = get_decoder("vegas", min_tokens=16).generate(eng, reqs, SamplingParams(), 2)
    second = get_decoder("vegas", min_tokens=16).generate(eng, reqs, SamplingParams(), 2)
    assert [r.output_ids for r in first.results] == [r.output_ids for r in plain.results]
    assert [r.output_ids for r in second.results] == [r.output_ids for r in plain.results]
    prefill_tokens = [row.n_tokens for s in second.steps for row in s.rows if row.kind == "prefill"]
    assert prefill_tokens == [1, 1, 1]  # only the last prompt token ran: the rest came from the cache


def test_warm_up_shows_the_prefill_unless_every_prompt_is_cached(monkeypatch):
    """A 32k prefill of a cell's prompts is minutes of work: the warm-up that does it shows progress;
    once the prefix cache holds every prompt (the other decoders of a bench cell) it stays quiet."""
    from types import SimpleNamespace

    from aspire_bench.decoders.base import Request
    from aspire_bench.harness import runner
    shown = []
    monkeypatch.setattr(runner, "generate", lambda *a: shown.append((a[6], a[7])))
    reqs = [Request(f"r{i}", [1, 2, i + 3], 8) for i in range(3)]
    cache = {}
    engine = SimpleNamespace(prefix_cache=cache, has_prefix=lambda ids: tuple(ids) in cache)
    p = SimpleNamespace(reqs=reqs, cfg=SimpleNamespace(batch_size=2), engine=engine, decoder="ar", params=None)
    runner.warm_up(p, show_progress=True)
    assert shown == [("warm-up (prefill)", True), ("prefill", True)]
    cache.update({tuple(r.prompt_ids[:-1]): None for r in reqs})
    shown.clear()
    runner.warm_up(p, show_progress=True)
    assert shown == [("warm-up (prefill)", False), ("prefill", False)]
    shown.clear()
    runner.warm_up(p)  # a caller that shows no progress
    assert [s for _, s in shown] == [False, False]


def test_bench_keeps_the_calibration_round_after_each_runs_traced_repeat(random_tiny, monkeypatch):
    """Round k of the cell prices every KV position at k x 1e-8 s: a run's adjacent fit names the round
    timed right after one of its own repeats, the pooled fit the median over all of them."""
    from aspire_bench.harness import bench as B
    made = []

    def fake_round(engine, cell, seed=0):
        made.append(len(made) + 1)
        k = made[-1]
        samples = [(n, kv, 0.0, 1e-3 + 1e-5 * n + k * 1e-8 * kv, [(n, kv, 0)])
                   for n in (1, 4, 16) for kv in (1e3, 1e4, 1e5)]
        # what calibrate() returns: the fit of its samples, and the samples
        from aspire_bench.decoders.calibration import Calibration
        from aspire_bench.decoders.scheduler import CostSample, fit_cost_model
        return Calibration(fit_cost_model(samples, source="calibration"), tuple(map(CostSample.of, samples)), 2, 1024)

    monkeypatch.setattr(B, "_calibration_round", fake_round)
    rows, _ = B.bench(str(random_tiny), "needle", ["1k"], [2], ["ar", "magicdec"], repeat=2, max_new_tokens=4,
                      samplings=[B.Sampling(0.0, 0, 1.0)], limit=2, tune=False, bound=False, show_progress=False)
    assert made == [1, 2, 3, 4]  # one round after every run of every repeat
    # repeat 0 runs ar then magicdec (rounds 1, 2), repeat 1 the order rotated (magicdec 3, ar 4)
    after = {"ar": (1, 4), "magicdec": (2, 3)}
    for row in rows:
        k = row.record.info["adjacent_calibration"]["beta_attn"] / 1e-8
        assert min(abs(k - r) for r in after[row.decoder]) < 1e-6, (row.decoder, k)
        assert row.record.info["interleaved_calibration"]["beta_attn"] == pytest.approx(2.5e-8)


def test_bench_calibration_rounds_run_at_the_cells_context(random_tiny, monkeypatch):
    """A cell's calibration round times the grid at the cell's own context (a step's cost per KV
    position differs between lengths whose KV fits the cache and lengths whose KV streams), capped by
    what the engine can hold."""
    from aspire_bench.harness import bench as B
    from aspire_bench.harness.runner import load_engine
    seen = []
    monkeypatch.setattr(B, "calibrate", lambda engine, batch, context, **kw: seen.append((batch, context)) or {})
    engine = load_engine(str(random_tiny), "float32", "cpu", "auto")
    for ctx in ("1k", "4k", "64k"):
        B._calibration_round(engine, RunConfig(model=str(random_tiny), context_len=ctx, batch_size=2))
    cap = engine.max_context - 16 - engine.page_size - 1
    assert seen == [(2, 1024), (2, 4096), (2, cap)] and cap < 64 * 1024
