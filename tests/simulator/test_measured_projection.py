"""Projections driven by acceptance measured per request in stored runs, with tuned baselines.

A real magicdec run (random tiny model, sampling) gives measured per-request outcomes; copies of it
with every draft accepted, or none, must move the projection up and down. Tuning picks the grid's
fastest point, checked against each point simulated on its own. No timings are asserted."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from aspire_bench.cli import main
from aspire_bench.harness.runner import RunConfig, run
from aspire_bench.harness.store import Store
from aspire_bench.simulator.acceptance import MeasuredAcceptance, token_stream
from aspire_bench.simulator.costs import Hardware, ModelShape, Roofline
from aspire_bench.simulator.rows import parametric_rows
from aspire_bench.simulator.source import simulate_parametric

SHAPE = ["--hardware", "a100", "--model-shape", "qwen3-1.7b", "--context-len", "32k", "--batch-size", "4",
         "--max-new-tokens", "48", "--no-save", "--json"]


@pytest.fixture(scope="module")
def store(random_tiny, tmp_path_factory):
    """Runs 1-3: ar, magicdec, aspire on one cell; 4: run 2 with every draft accepted; 5: with none."""
    db = str(tmp_path_factory.mktemp("measured") / "m.db")
    common = {"model": str(random_tiny), "task": "needle", "context_len": "1k", "limit": 4, "batch_size": 2,
              "max_new_tokens": 12, "temperature": 0.7, "top_k": 50, "top_p": 0.9, "warmup": False}
    recs = [run(RunConfig(decoder=d, decoder_args=a, **common), show_progress=False).record
            for d, a in (("ar", {}), ("magicdec", {}), ("aspire", {"calibration": "none"}))]
    group = recs[0].group or "g-measured"
    with Store(db) as st:
        for rec in recs:
            rec.group = group
            st.save_run(rec)
        for accepted in (lambda d, a: d, lambda d, a: 0):
            reqs = [replace(r, verifications=[(d, accepted(d, a)) for d, a in r.verifications]) for r in recs[1].requests]
            st.save_run(replace(recs[1], requests=reqs, run_id=None, group=None))
    return db


def project(db, *args):
    res = CliRunner().invoke(main, ["simulate", "--store", db, *SHAPE, *args])
    assert res.exit_code == 0, res.output
    return {r["decoder"]: r for r in json.loads(res.stdout)}


def test_each_simulated_request_replays_one_measured_request():
    acc = MeasuredAcceptance({"window": [[True] * 4, [False]]}, {"window": [7]}, {"window": [1000, 1000]})
    model = acc.model(["magicdec", "window"], ["a", "b", "c"])
    assert [model.accept(r, 3) for r in ("a", "b", "c")] == [3, 0, 3]  # heterogeneous, cyclic over requests
    info = model.describe()
    assert info["acceptance"] == "measured" and info["source_runs"] == [7]
    assert info["alpha_per_request_range"] == [0.0, 1.0] and info["alpha_pooled"] == pytest.approx(0.8)


def test_measured_acceptance_drives_the_projection(store):
    with Store(store, readonly=True) as st:
        own = st.get_run(2)
    base = project(store, "--acceptance-from", "2", "--decoders", "ar,magicdec")
    high = project(store, "--acceptance-from", "4", "--decoders", "ar,magicdec")
    low = project(store, "--acceptance-from", "5", "--decoders", "ar,magicdec")
    a = base["magicdec"]["assumptions"]
    assert a["acceptance"] == "measured" and a["source_runs"] == [2]
    assert a["alpha_pooled"] == pytest.approx(
        token_stream([v for r in own.requests for v in r.verifications]).count(True)
        / len(token_stream([v for r in own.requests for v in r.verifications])))
    assert high["magicdec"]["assumptions"]["alpha_pooled"] == 1.0
    assert low["magicdec"]["assumptions"]["alpha_pooled"] == 0.0
    speed = [r["magicdec"]["simulated_speedup_vs_ar"] for r in (low, base, high)]
    assert speed[0] <= speed[1] <= speed[2] and speed[0] < speed[2]
    assert high["magicdec"]["simulated_mean_accepted_len"] > low["magicdec"]["simulated_mean_accepted_len"]
    # a group stands for its speculative runs: each decoder gets its own run's acceptance
    group = project(store, "--acceptance-from", own.group, "--decoders", "ar,magicdec,aspire")
    assert group["magicdec"]["assumptions"]["source_runs"] == [2]
    assert group["aspire"]["assumptions"]["source_runs"] == [3]


@pytest.mark.parametrize("args,needle", [
    (["--acceptance-from", "99"], "no run 99"),
    (["--acceptance-from", "1"], "has no verifications"),
    (["--acceptance-from", "2", "--decoders", "ar,vegas"], "no vegas acceptance"),
    (["--acceptance-from", "nogroup"], "--acceptance-from nogroup"),
    (["--acceptance-from", "2", "--alpha", "0.9"], "pass one"),
    (["--acceptance-from", "2", "--run", "2"], "parametric"),
])
def test_bad_measured_acceptance_is_one_line(store, args, needle):
    res = CliRunner().invoke(main, ["simulate", "--store", store, *SHAPE, *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize("alpha", [0.3, 1.0])
def test_tuning_keeps_the_fastest_point_of_the_grid(alpha):
    shape = ModelShape.load("qwen3-1.7b")
    cost = Roofline(Hardware.load("a100"), shape)
    table = {"*": [(0.0, alpha)]}
    (row,), _ = parametric_rows(["magicdec"], cost, table, [32768], [4], 8, 32, shape.name, shape.layers, tune=True)
    alone = {g: simulate_parametric("magicdec", cost, table, 32768, 4, 8, 32, 16, shape.layers,
                                    settings={"gamma": g})[0] for g in (1, 2, 3, 4)}
    from aspire_bench.harness.metrics import decode_tok_s
    speed = {g: decode_tok_s(o) for g, o in alone.items()}
    best = max(speed, key=speed.get)
    assert best != 3  # the default is not the best here: tuning must move off it
    assert row["gamma"] == best and row["tuned"]["settings"] == {"gamma": best}
    assert row["simulated_decode_tok_s"] == pytest.approx(speed[best])
    assert row["tuned"]["decode_tok_s"] == pytest.approx({f"gamma={g}": s for g, s in speed.items()})
    (untuned,), _ = parametric_rows(["magicdec"], cost, table, [32768], [4], 8, 32, shape.name, shape.layers)
    assert untuned["gamma"] == 3 and untuned["tuned"] is None
    assert untuned["simulated_decode_tok_s"] < row["simulated_decode_tok_s"]
    # a decoder with no tuning grid has no tuned point, with or without --tune
    (ar,), _ = parametric_rows(["ar"], cost, table, [32768], [4], 8, 32, shape.name, shape.layers, tune=True)
    assert ar["tuned"] is None


@pytest.mark.parametrize("name", ["ngram", "draft-model"])
def test_a_replay_only_decoder_is_refused_for_a_parametric_setting_with_settings(name):
    """Settings given to a parametric setting (as --tune gives them) are not a stored run to replay."""
    from aspire_bench.errors import UserError
    shape = ModelShape.load("qwen3-1.7b")
    cost = Roofline(Hardware.load("a100"), shape)
    with pytest.raises(UserError, match="simulated only by replaying a stored run"):
        simulate_parametric(name, cost, {"*": [(0.0, 0.5)]}, 32768, 4, 8, 32, 16, shape.layers,
                            settings={"gamma": 2})


def test_paper_projection_shows_paper_and_measured_acceptance_side_by_side(store, capsys, tmp_path):
    from benchmarks import project_paper
    out = tmp_path / "p.json"
    assert project_paper.main(["--store", store, "--acceptance-from", "2,3,4", "--batch-size", "4",
                               "--max-new-tokens", "8", "--json", str(out)]) == 2
    assert "no vegas acceptance" in capsys.readouterr().err  # vegas is projected: a vegas run is needed
    with Store(store) as st:  # a vegas "measurement": run 2's outcomes under vegas's name
        rec = st.get_run(2)
        st.save_run(replace(rec, run_id=None, group=None, config={**rec.config, "decoder": "vegas"}))
    assert project_paper.main(["--store", store, "--acceptance-from", "2,3,6", "--batch-size", "4",
                               "--max-new-tokens", "8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per-step overhead: 30 µs (assumed, not measured" in printed
    assert "| paper α, batch 4 | measured, batch 4 |" in printed and "tuned over their gamma grid" in printed
    rows = json.loads(out.read_text())
    assert {r["acceptance_source"] for r in rows} == {"paper", "measured"}
    tuned = [r for r in rows if r["decoder"] in ("magicdec", "vegas")]
    assert tuned and all(r["tuned"] and r["simulated_decode_tok_s"] == pytest.approx(max(r["tuned"]["decode_tok_s"]
                                                                                      .values())) for r in tuned)
    from aspire_bench.report import write_report
    write_report(store, tmp_path / "report")
    page = (tmp_path / "report" / "projected.html").read_text()
    assert "measured, run 2:" in page and "α 0.951" in page  # both acceptances on the projected page


def test_validate_projection_prints_predicted_and_measured(store, capsys):
    from benchmarks import validate_simulator
    rows = validate_simulator.validate(store, ["ar", "magicdec", "aspire"], projection="cpu-measured")
    first = [r for r in rows if r["run_id"] in (1, 2, 3)]
    assert [r["decoder"] for r in first] == ["ar", "magicdec", "aspire"]
    for r in first:
        assert r["simulated_decode_tok_s"] > 0 and r["measured_decode_tok_s"] > 0
        assert r["error"] == pytest.approx(r["simulated_decode_tok_s"] / r["measured_decode_tok_s"] - 1)
    asp = first[2]
    assert asp["ratio_error"] == pytest.approx(asp["simulated_speedup_vs_ar"] / asp["measured_speedup_vs_ar"] - 1)
    assert validate_simulator.main(["--store", store, "--projection", "--decoders", "ar,aspire"]) == 0
    assert "| aspire |" in capsys.readouterr().out
