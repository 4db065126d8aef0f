"""The simulator: acceptance replay, step-cost arithmetic, and replays of real decoder traces.

The replay is checked on a fake clock: a real run (random tiny model, sampling) whose steps are
re-timed to follow a cost model exactly must be simulated, with that cost model, to the same steps,
the same verifications and the same decode tok/s. No timings of this machine are asserted."""
from __future__ import annotations

import json
import random
import sqlite3
from dataclasses import replace

import pytest
from click.testing import CliRunner

from aspire_bench.cli import main
from aspire_bench.decoders.scheduler import CostModel, fit_cost_model
from aspire_bench.harness import metrics
from aspire_bench.harness.records import RunRecord, StepRecord
from aspire_bench.harness.runner import RunConfig, run
from aspire_bench.harness.store import Store
from aspire_bench.simulator.acceptance import (
    ParametricAcceptance,
    ReplayAcceptance,
    parse_alpha,
    token_stream,
)
from aspire_bench.simulator.costs import CalibratedCost, Hardware, ModelShape, Roofline
from aspire_bench.simulator.policies import SimPolicy
from aspire_bench.simulator.replay import SimRequest, simulate
from aspire_bench.simulator.source import simulate_stored

COST = CostModel(beta0=2e-3, beta_tok=1e-4, beta_attn=1e-6, beta_qk=1e-8, source="calibration:test",
                 beta_sparse=5e-7, beta_capture=3e-7)


def test_token_stream_gives_back_the_recorded_outcomes_at_the_recorded_lengths():
    recorded = [(3, 1), (2, 2), (0, 0), (4, 0), (1, 1)]
    acc = ReplayAcceptance({"r": token_stream(recorded)})
    assert [(d, acc.accept("r", d)) for d, _ in recorded] == recorded


def test_replay_consumes_the_stream_whatever_the_draft_lengths():
    acc = ReplayAcceptance({"r": token_stream([(3, 3), (2, 0)])})  # stream: T T T F
    assert acc.accept("r", 2) == 2  # T T
    assert acc.accept("r", 4) == 1  # T F: stops at the reject, which is consumed
    assert acc.accept("r", 1) == 1  # cyclic: back to the first T


def test_parametric_acceptance_interpolates_alpha_by_context():
    table = parse_alpha("aspire=0.5,magicdec=1")
    assert table == {"aspire": [(0.0, 0.5)], "magicdec": [(0.0, 1.0)]}
    acc = ParametricAcceptance({"aspire": [(1000, 0.9), (3000, 0.5)]}, "aspire")
    assert acc.alpha(2000) == pytest.approx(0.7)
    assert acc.alpha(10) == 0.9 and acc.alpha(99999) == 0.5
    assert ParametricAcceptance(table, "magicdec").accept("x", 5) == 5
    draws = [ParametricAcceptance({"*": [(0, 0.5)]}, "vegas", seed=s).accept("x", 1) for s in range(2000)]
    assert 0.45 < sum(draws) / len(draws) < 0.55


def test_ar_on_a_known_cost_model_by_hand():
    """Two requests, batch 2, 3 output tokens, no prefill cost: the first token is free, then two
    decode steps of 2 rows, each reading its request's prompt and committed tokens."""
    reqs = [SimRequest("a", 100, 3), SimRequest("b", 200, 3)]
    out = simulate(reqs, SimPolicy("ar"), None, CalibratedCost(COST), 2)
    step1 = COST.step_time(2, 101 + 201, 101 + 201)
    step2 = COST.step_time(2, 102 + 202, 102 + 202)
    assert [s.wall for s in out.steps] == pytest.approx([step1, step2])
    assert metrics.decode_tok_s(out) == pytest.approx(4 / (step1 + step2))


def test_roofline_arithmetic():
    shape = ModelShape("t", layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10,
                       tied=True, dtype="float32")
    hw = Hardware("h", memory_bw_gbs=1.0, tflops={"float32": 1e-3}, step_overhead_us=5.0)
    roof = Roofline(hw, shape)
    params = 2 * (8 * 4 * (2 * 2 + 2 * 1) + 3 * 8 * 16) + 10 * 8
    assert shape.weight_params == params
    assert shape.kv_bytes_per_position == 2 * 2 * 1 * 4 * 4
    rows = [("draft", 1, 100), ("verify", 3, 50)]
    nbytes = params * 4 + (100 + 50) * shape.kv_bytes_per_position  # each row reads its KV once
    flops = 2 * params * 4 + 4 * 2 * 4 * 2 * (100 + 150)
    assert roof.step_time(rows) == pytest.approx(max(nbytes / 1e9, flops / 1e9) + 5e-6)
    cpu = Roofline(replace(hw, overlap=False), shape)  # a CPU core reads and computes in turn
    assert cpu.step_time(rows) == pytest.approx(nbytes / 1e9 + flops / 1e9 + 5e-6)


def test_a_profile_says_whether_reads_and_arithmetic_overlap(tmp_path):
    from aspire_bench.errors import UserError
    profile = {"memory_bw_gbs": 40, "tflops": {"float32": 0.1}}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(profile))
    assert Hardware.load(str(path)).overlap  # the default: a GPU's
    path.write_text(json.dumps({**profile, "overlap": False}))
    assert not Hardware.load(str(path)).overlap
    path.write_text(json.dumps({**profile, "overlap": "no"}))
    with pytest.raises(UserError, match="overlap is 'no': write true .* or false"):
        Hardware.load(str(path))


def test_bundled_shapes_have_the_published_parameter_counts():
    # Non-embedding + LM head: Qwen3-1.7B ties its head to the embedding (1.7B in all), 8B does not (8.2B).
    small, big = ModelShape.load("qwen3-1.7b"), ModelShape.load("qwen3-8b")
    assert 1.65e9 < small.weight_params < 1.8e9
    assert 8.1e9 < big.weight_params + big.vocab * big.hidden < 8.3e9
    for name in ("h100", "h100-nvl", "h200", "a100"):
        assert Hardware.load(name).memory_bw_gbs > 1000


def test_aspire_defaults_come_from_the_decoder():
    s = SimPolicy("aspire", {"omega": 0.5, "decoder": "aspire", "gamma": None, "cost_model": {}}, COST, 16, 4).settings
    assert (s["alpha0"], s["d_max"], s["gamma_init"], s["omega"]) == (0.9, 16, 3, 0.5)
    assert SimPolicy("aspire-fsm", None, COST, 16, 4).settings["policy"] == "fsm"
    from aspire_bench.errors import UserError
    with pytest.raises(UserError, match="oracle"):
        SimPolicy("aspire-oracle", None, COST, 16, 4)
    with pytest.raises(UserError, match="'draft-model' is simulated only by replaying a stored run"):
        SimPolicy("draft-model", None, COST, 16, 4)


def retimed(record: RunRecord, cost: CalibratedCost, scattered=None) -> RunRecord:
    """The run as if each step had taken exactly the cost model's time, back to back; `scattered`:
    each step's rows' kv_sparse to price instead of the recorded ones."""
    t, steps, times = 0.0, [], {r.id: [] for r in record.requests}
    for i, s in enumerate(record.steps):
        sparse = [row[7] for row in s.rows] if scattered is None else scattered[i]
        t0, t = t, t + cost.step_time([(row[1], row[2], row[6], sp, row[8]) for row, sp in zip(s.rows, sparse)])
        steps.append(StepRecord(s.index, t0, t, s.n_tokens, s.rows))
        for row in s.rows:
            times[row[0]].extend([t] * row[3])
    rec = RunRecord.from_json(record.to_json())
    rec.steps = steps
    for r in rec.requests:
        r.token_times = times[r.id][:len(r.output_ids)]
    return rec


def as_output(rec: RunRecord):
    from aspire_bench.decoders.base import GenerationOutput, RequestResult, RowTrace, StepTrace
    return GenerationOutput(
        [RequestResult(r.id, r.output_ids, r.finish_reason, r.token_times) for r in rec.requests],
        [StepTrace(s.index, s.t_start, s.t_end, [RowTrace(*row) for row in s.rows]) for s in rec.steps],
        0.0, rec.steps[-1].t_end)


@pytest.mark.parametrize("decoder,args", [("ar", {}), ("magicdec", {}), ("vegas", {"gamma": 3}),
                                          ("aspire", {"calibration": "none"}), ("aspire", {"calibration": "COST"}),
                                          ("aspire-fsm", {"calibration": "none"})])
def test_replay_of_a_real_trace_on_a_fake_clock_is_exact(random_tiny, decoder, args, tmp_path):
    if args.get("calibration") == "COST":  # a scheduler that prices scattered reads: its c moves with the
        path = tmp_path / "cost.json"     # share of its scattered bound the engine counted
        path.write_text(json.dumps({**COST.to_dict(), "r2": 0.99}))
        args = {"calibration": str(path)}
    record = run(RunConfig(model=str(random_tiny), decoder=decoder, decoder_args=args, task="needle",
                           context_len="1k", limit=3, batch_size=2, max_new_tokens=14, temperature=0.7, top_k=50,
                           top_p=0.9, warmup=False), show_progress=False).record
    cost = CalibratedCost(COST)
    expected = retimed(record, cost)
    out, assumptions = simulate_stored(record, cost)
    assert [[r[:3] for r in s.rows] for s in expected.steps] == \
           [[(w.request, w.kind, w.n_tokens) for w in s.rows] for s in out.steps]
    assert [[r[6] for r in s.rows] for s in expected.steps] == [[w.kv_read for w in s.rows] for s in out.steps]
    # the scores each row captured (ASPIRE's refresh layer, Vegas's every layer), as the engine counted them
    assert [[r[8] for r in s.rows] for s in expected.steps] == [[w.kv_captured for w in s.rows] for s in out.steps]
    assert (decoder in ("ar", "magicdec")) == (not any(r[8] for s in expected.steps for r in s.rows))
    # the scattered part: ASPIRE's drafts replay the engine's counts; without the scores, Vegas's is
    # an upper bound (selected positions may come together in long runs), exact for MagicDec's window
    measured = [r[7] for s in expected.steps for r in s.rows]
    replayed = [w.kv_sparse for s in out.steps for w in s.rows]
    assert all(m <= r for m, r in zip(measured, replayed))
    assert decoder == "vegas" or measured == replayed
    assert decoder == "ar" or any(replayed)
    assert [r.verifications for r in record.requests] == [r.verifications for r in out.results]
    # what each scheduler saw at each verification (ASPIRE: alpha, c, gamma; fixed-gamma: gamma)
    assert [r.schedule for r in record.requests] == [r.schedule for r in out.results]
    priced = retimed(record, cost, [[w.kv_sparse for w in s.rows] for s in out.steps])
    assert metrics.decode_tok_s(out) == pytest.approx(metrics.decode_tok_s(as_output(priced)), rel=1e-12)
    assert assumptions["acceptance"] == "replay"


def test_cli_simulate_contract_and_simulated_runs_stay_off_the_leaderboard(random_tiny, tmp_path):
    db = str(tmp_path / "r.db")
    for decoder, args in (("ar", {}), ("aspire", {"calibration": "none"})):
        rec = run(RunConfig(model=str(random_tiny), decoder=decoder, decoder_args=args, task="needle",
                            context_len="1k", limit=2, batch_size=2, max_new_tokens=8, warmup=False),
                  show_progress=False).record
        with Store(db) as st:
            st.save_run(rec)
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps({**COST.to_dict(), "source": "calibration"}))
    runner = CliRunner()
    res = runner.invoke(main, ["simulate", "--store", db, "--run", "1", "--run", "2", "--calibration", str(calib),
                               "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert [r["decoder"] for r in rows] == ["ar", "aspire"]
    with Store(db, readonly=True) as st:
        measured = [st.get_run(i).aggregates["decode_tok_s"] for i in (1, 2)]
        assert [r["measured_decode_tok_s"] for r in rows] == pytest.approx(measured)
        assert all(r["simulated_decode_tok_s"] > 0 for r in rows)
        sims = st.list_runs(kind="simulated")
        assert [s["run_id"] for s in sims] == [r["stored_run_id"] for r in rows]
    # a simulated run's own replay is not a measurement: measured is null
    res = runner.invoke(main, ["simulate", "--store", db, "--run", str(rows[0]["stored_run_id"]), "--calibration",
                               str(calib), "--json", "--no-save"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)[0]["measured_decode_tok_s"] is None
    from aspire_bench.report.leaderboard import load_runs
    assert {r.kind for r in load_runs(db)} == {"measured"}


@pytest.mark.parametrize("args,needle", [
    (["--hardware", "nope", "--model-shape", "qwen3-1.7b", "--alpha", "0.9"], "--hardware"),
    (["--hardware", "h100", "--model-shape", "nope", "--alpha", "0.9"], "--model-shape"),
    (["--hardware", "h100", "--model-shape", "qwen3-1.7b"], "--alpha"),
    (["--hardware", "h100", "--model-shape", "qwen3-1.7b", "--alpha", "1.5"], "between 0 and 1"),
    (["--hardware", "h100"], "--model-shape"),
    (["--model-shape", "qwen3-8b", "--alpha", "0.9"], "step costs"),
])
def test_bad_parametric_input_is_one_line(args, needle, tmp_path):
    res = CliRunner().invoke(main, ["simulate", "--no-save", "--store", str(tmp_path / "x.db"), *args])
    assert res.exit_code == 2
    assert needle in res.output and "Traceback" not in res.output


def test_parametric_roofline_projection_runs_and_aspire_gains_over_ar(tmp_path):
    res = CliRunner().invoke(main, ["simulate", "--store", str(tmp_path / "p.db"), "--hardware", "h100",
                                    "--model-shape", "qwen3-1.7b", "--context", "32k", "--batch", "8",
                                    "--alpha", "0.9", "--max-new-tokens", "64", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["decoder"]: r for r in json.loads(res.stdout)}
    assert set(rows) == {"ar", "magicdec", "vegas", "aspire"}
    assert rows["ar"]["simulated_speedup_vs_ar"] == 1.0
    assert rows["aspire"]["simulated_speedup_vs_ar"] > 1.0  # alpha 0.9 and a sparse draft at 32k must pay
    assert all(r["measured_decode_tok_s"] is None for r in rows.values())
    with Store(tmp_path / "p.db", readonly=True) as st:
        assert {s["kind"] for s in st.list_runs()} == {"simulated"}


def test_paper_alpha_inverts_the_expected_accepted_fraction():
    from aspire_bench.simulator import paper
    for rate, gamma in (*paper.REPORTED_ACCEPTANCE.values(), paper.CROSS_CHECK):
        a = paper.alpha_from_rate(rate, gamma)
        assert paper.expected_accepted(a, gamma) / gamma == pytest.approx(rate, abs=1e-9)
    assert paper.paper_speedup("qwen3-8b", "aspire", 35 * 1024) == 2.30
    assert paper.paper_speedup("qwen3-8b", "aspire", 1000) is None


def test_projected_page_lists_simulated_runs_with_the_papers_speedup(tmp_path):
    from aspire_bench.report import write_report
    db = tmp_path / "p.db"
    res = CliRunner().invoke(main, ["simulate", "--store", str(db), "--hardware", "h100-nvl", "--model-shape",
                                    "qwen3-8b", "--context", str(35 * 1024), "--batch", "8", "--alpha", "0.9",
                                    "--max-new-tokens", "32", "--decoders", "ar,aspire"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "report"
    index = write_report(db, out).read_text()
    projected = (out / "projected.html").read_text()
    assert "projected.html" in index and "aspire" not in index.split("projected.html")[1]
    assert projected.count("<tr>") == 3  # header + ar + aspire
    assert 'data-v="2.3"' in projected  # the paper's Qwen3-8B ASPIRE speedup at 30-40k


def test_vegas_steps_are_priced_by_their_own_terms(random_tiny):
    """A Vegas run records its drafts' scattered reads through per-layer views (kv_layered) and its rows'
    token scores at every layer (kv_topk); a cost model with beta_layered and beta_topk prices them in
    place of beta_sparse and beta_capture, in a replay and in a projection; one without them as before."""
    from aspire_bench.simulator.source import simulate_parametric
    record = run(RunConfig(model=str(random_tiny), decoder="vegas", decoder_args={"gamma": 3}, task="needle",
                           context_len="1k", limit=3, batch_size=2, max_new_tokens=14, warmup=False),
                 show_progress=False).record
    rows = [r for s in record.steps for r in s.rows]
    assert all(r[9] == (r[7] if r[1] == "draft" else 0) and r[10] == r[8] for r in rows)
    assert any(r[9] for r in rows) and any(r[10] for r in rows if r[1] == "verify")
    shaped = replace(COST, beta_layered=2e-6, beta_topk=1e-6)
    for out in (simulate_stored(record, CalibratedCost(COST))[0], simulate_parametric(
            "vegas", CalibratedCost(COST), parse_alpha("0.8"), 1000, 2, 3, 14, 16, 4, settings={"gamma": 3})[0]):
        assert any(w.kv_topk for s in out.steps for w in s.rows if w.kind == "verify")
        assert any(w.kv_layered for s in out.steps for w in s.rows if w.kind == "draft")
        for s in out.steps:
            priced = [(w.kind, w.n_tokens, w.kv_read, w.kv_sparse, w.kv_captured, w.kv_layered, w.kv_topk)
                      for w in s.rows]
            assert s.wall == pytest.approx(CalibratedCost(COST).step_time([r[:5] for r in priced]), rel=1e-12)
            layered, topk = sum(r[5] for r in priced), sum(r[6] for r in priced)
            assert CalibratedCost(shaped).step_time(priced) - s.wall == pytest.approx(
                layered * (2e-6 - 5e-7) + topk * (1e-6 - 3e-7), rel=1e-9, abs=1e-15)
    verify = [s for s in simulate_stored(record, CalibratedCost(shaped))[0].steps if s.rows[0].kind == "verify"]
    assert verify and all(s.wall == pytest.approx(CalibratedCost(shaped).step_time(
        [(w.kind, w.n_tokens, w.kv_read, w.kv_sparse, w.kv_captured, w.kv_layered, w.kv_topk) for w in s.rows]))
        for s in verify)


def test_validate_script_prints_every_measured_run(random_tiny, tmp_path, capsys):
    from benchmarks import validate_simulator
    db = str(tmp_path / "v.db")
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps({**COST.to_dict(), "source": "calibration"}))
    for decoder in ("ar", "magicdec"):
        rec = run(RunConfig(model=str(random_tiny), decoder=decoder, task="needle", context_len="1k", limit=2,
                            batch_size=2, max_new_tokens=6, warmup=False), show_progress=False).record
        with Store(db) as st:
            st.save_run(rec)
    rows = validate_simulator.validate(db, ["ar", "magicdec"], str(calib))
    assert [r["decoder"] for r in rows] == ["ar", "magicdec"]
    assert all(r["error"] == pytest.approx(r["simulated_decode_tok_s"] / r["measured_decode_tok_s"] - 1) for r in rows)
    assert validate_simulator.main(["--store", db, "--calibration", str(calib)]) == 0
    printed = capsys.readouterr().out
    assert "/2 runs within" in printed and printed.count("| needle") == 0 and printed.count("| 1k |") == 2
    # --steps: the model's error per kind of step, every stored step counted once
    steps = validate_simulator.step_kinds(db, ["ar"], str(calib))
    with Store(db, readonly=True) as st:
        stored = st.get_run(1).steps
    assert {r["step_kind"] for r in steps} == {"decode", "prefill"}
    assert sum(r["steps"] for r in steps) == len(stored)
    decode = next(r for r in steps if r["step_kind"] == "decode")
    assert decode["error"] == pytest.approx(decode["model_ms"] / decode["measured_ms"] - 1)
    decodes = [x for x in stored if {r[1] for r in x.rows} == {"decode"}]
    assert decode["steps"] == len(decodes)
    assert decode["model_ms"] == pytest.approx(
        1e3 * sum(COST.rows_time((r[2], r[6]) for r in x.rows) for x in decodes) / len(decodes))
    assert decode["measured_ms"] == pytest.approx(1e3 * sum(x.t_end - x.t_start for x in decodes) / len(decodes))
    assert validate_simulator.main(["--store", db, "--calibration", str(calib), "--steps"]) == 0
    assert "| step kind |" in capsys.readouterr().out
    # --without: each run's stored calibrations refitted from their samples without the terms named
    assert validate_simulator.main(["--store", db, "--without", "beta_capture"]) == 2  # none stored
    assert "error: run 1" in capsys.readouterr().err
    assert validate_simulator.main(["--store", db, "--projection", "--hardware", "calibrated"]) == 2
    assert "error: run 1 has no calibration" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        validate_simulator.main(["--store", db, "--without", "beta_nope"])
    gen, model = random.Random(0), CostModel(2e-3, 1e-4, 1e-6, beta_sparse=5e-7, beta_capture=3e-7)
    samples = []
    for _ in range(60):  # steps of one-token rows through views that capture or not, 1% noise
        kvs = [gen.randint(200, 2000) for _ in range(gen.randint(1, 3))]
        rows = [(1, kv, kv // 20 * gen.randint(0, 1), kv // 16 * gen.randint(0, 1)) for kv in kvs]
        samples.append((len(rows), sum(kvs), 0.0, model.rows_time(rows) * (1 + 0.01 * gen.gauss(0, 1)), rows))
    full = fit_cost_model(samples)
    assert full.beta_capture > 0
    con = sqlite3.connect(db)
    for (rid,) in con.execute("SELECT run_id FROM runs").fetchall():
        cal = {**full.to_dict(), "samples": samples, "source": "adjacent calibration"}
        info = json.loads(con.execute("SELECT info FROM runs WHERE run_id = ?", (rid,)).fetchone()[0])
        con.execute("UPDATE runs SET info = ? WHERE run_id = ?", (json.dumps({**info, "adjacent_calibration": cal}), rid))
    con.commit()
    con.close()
    stored, refit = validate_simulator.validate(db, ["ar"]), validate_simulator.validate(db, ["ar"], without=("beta_capture",))
    without = fit_cost_model(samples, without=("beta_capture",))
    assert without.beta_capture == 0 and without.beta_attn != full.beta_attn
    with Store(db, readonly=True) as st:
        rec = st.get_run(1)
    for rows, model in ((stored, full), (refit, without)):  # AR's steps priced by each fit
        sim = simulate_stored(rec, CalibratedCost(model))[0]
        assert rows[0]["simulated_decode_tok_s"] == pytest.approx(metrics.decode_tok_s(sim), rel=1e-12)
    assert stored[0]["simulated_decode_tok_s"] != refit[0]["simulated_decode_tok_s"]
    # --projection --hardware calibrated: the parametric projection priced with each run's own calibration
    from statistics import median

    from aspire_bench.simulator.source import num_layers_of, simulate_parametric
    projected = validate_simulator.validate(db, ["ar"], projection="calibrated")[0]
    c = rec.config
    alone, _ = simulate_parametric("ar", CalibratedCost(full), {}, int(median(r.prompt_len for r in rec.requests)),
                                   c["batch_size"], len(rec.requests), c["max_new_tokens"], 16,
                                   num_layers_of(c["model"]), settings=rec.info)
    assert projected["simulated_decode_tok_s"] == pytest.approx(metrics.decode_tok_s(alone), rel=1e-12)
    assert projected["simulated_decode_tok_s"] != validate_simulator.validate(
        db, ["ar"], projection="cpu-measured")[0]["simulated_decode_tok_s"]
    # ... and with --without, each run's calibration refitted without the terms named
    assert validate_simulator.validate(db, ["ar"], without=("beta_capture",), projection="calibrated")[0][
        "simulated_decode_tok_s"] == pytest.approx(refit[0]["simulated_decode_tok_s"], rel=0.2)
    with pytest.raises(SystemExit):
        validate_simulator.main(["--store", db, "--projection", "--without", "beta_topk"])  # a roofline's


def test_stored_run_roofline_defaults_to_the_runs_model_and_dtype(random_tiny, tmp_path):
    db = str(tmp_path / "r.db")
    rec = run(RunConfig(model=str(random_tiny), task="needle", context_len="1k", limit=2, batch_size=2,
                        max_new_tokens=6, warmup=False), show_progress=False).record
    with Store(db) as st:
        rid = st.save_run(rec)
    runner = CliRunner()
    own = runner.invoke(main, ["simulate", "--store", db, "--run", str(rid), "--hardware", "a100", "--json", "--no-save"])
    explicit = runner.invoke(main, ["simulate", "--store", db, "--run", str(rid), "--hardware", "a100", "--json",
                                    "--no-save", "--model-shape", str(random_tiny), "--dtype", "float32"])
    assert own.exit_code == explicit.exit_code == 0, own.output + explicit.output
    a, b = json.loads(own.stdout)[0], json.loads(explicit.stdout)[0]
    assert a["assumptions"]["model_shape"]["dtype"] == "float32"  # the run's dtype, not the checkpoint's
    assert a["simulated_decode_tok_s"] == b["simulated_decode_tok_s"]


def test_alpha_from_stored_runs_is_the_maximum_likelihood_estimate(random_tiny, tmp_path):
    from aspire_bench.simulator.acceptance import alpha_mle
    assert alpha_mle([(3, 3), (3, 1), (0, 0)]) == pytest.approx(4 / 5)  # 4 accepts, 1 early stop
    assert alpha_mle([(0, 0)]) is None
    db = str(tmp_path / "a.db")
    rec = run(RunConfig(model=str(random_tiny), decoder="magicdec", task="needle", context_len="1k", limit=2,
                        batch_size=2, max_new_tokens=8, temperature=0.7, top_k=50, top_p=0.9, warmup=False),
              show_progress=False).record
    with Store(db) as st:
        rid = st.save_run(rec)
    res = CliRunner().invoke(main, ["simulate", "--store", db, "--alpha-from-runs", str(rid), "--hardware", "a100",
                                    "--model-shape", "qwen3-1.7b", "--decoders", "magicdec", "--context", "1k",
                                    "--max-new-tokens", "8", "--json", "--no-save"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)[0]["assumptions"]["alpha_by_context"]
    assert got == [[pytest.approx(1024, abs=64), pytest.approx(alpha_mle([v for r in rec.requests
                                                                           for v in r.verifications]))]]
    bad = CliRunner().invoke(main, ["simulate", "--store", db, "--alpha-from-runs", str(rid), "--alpha", "0.5",
                                    "--hardware", "a100", "--model-shape", "qwen3-1.7b", "--no-save"])
    assert bad.exit_code == 2 and "pass one" in bad.output


def test_a_bench_run_is_priced_by_the_round_after_its_trace_unless_that_round_misfit():
    from aspire_bench.simulator.source import stored_calibration
    good = {**COST.to_dict(), "r2": 0.99, "source": "adjacent calibration"}
    pooled = {**COST.to_dict(), "beta_attn": 2e-6, "r2": 0.99, "source": "interleaved calibration"}
    rec = RunRecord(config={}, config_hash="x", env={},
                    info={"adjacent_calibration": good, "interleaved_calibration": pooled})
    assert stored_calibration(None, rec).source == "adjacent calibration"
    rec.info["adjacent_calibration"] = {**good, "r2": 0.25}  # a disturbance during its round
    model = stored_calibration(None, rec)
    assert model.source == "interleaved calibration" and model.beta_attn == 2e-6
    rec.info["interleaved_calibration"] = {**pooled, "r2": 0.5}
    assert stored_calibration(None, rec) is None  # no group to fall back to
