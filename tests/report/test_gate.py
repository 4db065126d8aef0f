"""The regression gate on hand-made runs: equal runs pass (on a 4x slower machine too), each kind of
regression fails with its message and exit 1, usage errors exit 2, --update writes the baseline."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from aspire_bench.gate import COMMANDS, entry_key
from aspire_bench.harness import records
from aspire_bench.harness.records import RunRecord, config_hash
from aspire_bench.harness.store import Store

gate = COMMANDS[0]
ENV = {"python": "3.11.2", "torch": "2.13.0", "aspire_bench": "0.1.0", "device": "cpu", "gpu": None, "cpu": "Test CPU"}
ASPIRE_KEY = "tiny · needle · 4k · aspire(gamma=4) [batch_size=4]"
GOOD = {"mean_accepted_len": 3.0, "draft_acceptance_rate": 0.6, "parity_n": 4, "parity_identical_pct": 100.0,
        "parity_near_tie": 0, "parity_mismatch": 0, "parity_length": 0, "score_mean": 0.5}


def run(decoder: str, tok_s: float, group: str, **aggregates) -> RunRecord:
    config = {"decoder": {"name": decoder, **({"gamma": 4} if decoder != "ar" else {})}, "model": "/ckpt/tiny",
              "task": "needle", "context_len": "4k", "batch_size": 4}
    base = {"mean_accepted_len": 1.0, "score_mean": 0.5} if decoder == "ar" else dict(GOOD)
    return RunRecord(config=config, config_hash=config_hash(config), env=ENV, group=group,
                     aggregates={"decode_tok_s": tok_s, **base, **aggregates})


def save(path, *recs: RunRecord) -> None:
    with Store(path) as s:
        for r in recs:
            s.save_run(r)


@pytest.fixture
def baseline(tmp_path):
    """A baseline from group "base": AR 10 tok/s, aspire 24 and 26 tok/s (repeats) -> speedup 2.5."""
    db, path = tmp_path / "base.db", tmp_path / "ci" / "baseline.json"
    save(db, run("ar", 10.0, "base"), run("aspire", 24.0, "base"), run("aspire", 26.0, "base"))
    res = CliRunner().invoke(gate, ["--baseline", str(path), "--store", str(db), "--update"])
    assert res.exit_code == 0, res.output
    return path


def gate_on(tmp_path, baseline, *recs, args=()):
    db = tmp_path / "new.db"
    save(db, *recs)
    md = tmp_path / "summary.md"
    res = CliRunner().invoke(gate, ["--baseline", str(baseline), "--store", str(db), "--markdown", str(md), *args])
    return res, (md.read_text() if md.exists() else "")


def test_update_writes_the_baseline(baseline):
    data = json.loads(baseline.read_text())
    assert data["format"] == "aspire-bench-gate-baseline" and data["version"] == 1
    entries = {e["key"]: e for e in data["entries"]}
    assert set(entries) == {ASPIRE_KEY, "tiny · needle · 4k · ar [batch_size=4]"}
    assert entries[ASPIRE_KEY]["speedup"] == pytest.approx(2.5)  # median 25 over AR 10, same group
    assert entries[ASPIRE_KEY]["runs"] == [2, 3] and entries[ASPIRE_KEY]["parity_mismatch"] == 0
    assert data["tolerances"]["speedup"] == 0.15
    assert entry_key(run("aspire", 1.0, "x").config) == ASPIRE_KEY  # a checkpoint path is named by its last part


def test_equal_runs_pass_on_a_slower_machine(tmp_path, baseline):
    # Everything 4x slower: raw tok/s differs, the within-group speedup does not.
    res, md = gate_on(tmp_path, baseline, run("ar", 2.5, "new"), run("aspire", 6.25, "new"))
    assert res.exit_code == 0, res.output
    assert "gate: pass" in res.output and "REGRESSION" not in res.output
    assert "### aspire-bench gate: pass" in md and f"| {ASPIRE_KEY} | speedup | 2.5 | 2.5 |" in md


def test_one_slow_repeat_is_noise(tmp_path, baseline):
    res, _ = gate_on(tmp_path, baseline, run("ar", 10.0, "new"), run("aspire", 25.0, "new"),
                     run("aspire", 12.0, "new"), run("aspire", 25.5, "new"))
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("aspire, ar_tok_s, message", [
    (run("aspire", 19.0, "new"), 10.0, f"{ASPIRE_KEY}: speedup dropped 24.0% to 1.9 (baseline 2.5, allowed −15%)"),
    (run("aspire", 25.0, "new", mean_accepted_len=2.4), 10.0,
     f"{ASPIRE_KEY}: mean_accepted_len dropped 20.0% to 2.4 (baseline 3, allowed −5%)"),
    (run("aspire", 25.0, "new", draft_acceptance_rate=0.45), 10.0,
     f"{ASPIRE_KEY}: draft_acceptance_rate dropped 25.0% to 0.45 (baseline 0.6, allowed −5%)"),
    (run("aspire", 25.0, "new", draft_acceptance_rate=0.56), 10.0,
     f"{ASPIRE_KEY}: draft_acceptance_rate dropped 6.7% to 0.56 (baseline 0.6, allowed −5%)"),
    (run("aspire", 25.0, "new", parity_identical_pct=75.0, parity_mismatch=1), 10.0,
     f"{ASPIRE_KEY}: parity broken: 1 mismatch, 0 length of 4 requests (75% identical, 0 near-tie)"),
    (run("aspire", 25.0, "new", parity_identical_pct=75.0, parity_length=1), 10.0,
     f"{ASPIRE_KEY}: parity broken: 0 mismatch, 1 length of 4 requests (75% identical, 0 near-tie)"),
    (run("aspire", 25.0, "new", score_mean=0.4), 10.0,
     f"{ASPIRE_KEY}: score_mean dropped 0.1 to 0.4 (baseline 0.5, allowed −0.05)"),
    (run("aspire", 25.0, "other"), 10.0, f"{ASPIRE_KEY}: speedup cannot be checked: no AR run in the same group"),
], ids=["speedup", "accepted-len", "acceptance", "acceptance-7pct", "parity-mismatch", "parity-length", "score", "no-ar"])
def test_each_regression_fails(tmp_path, baseline, aspire, ar_tok_s, message):
    res, md = gate_on(tmp_path, baseline, run("ar", ar_tok_s, "new"), aspire,
                      args=["--run", "1", "--run", "2"])
    assert res.exit_code == 1, res.output
    assert f"REGRESSION {message}" in res.output
    assert "gate: FAIL, 1 regression(s)" in res.output
    assert f"- {message}" in md and "FAIL" in md


def test_near_ties_are_not_a_regression(tmp_path, baseline):
    res, _ = gate_on(tmp_path, baseline, run("ar", 10.0, "new"),
                     run("aspire", 25.0, "new", parity_identical_pct=75.0, parity_near_tie=1))
    assert res.exit_code == 0, res.output


def test_parity_takes_the_worst_repeat(tmp_path, baseline):
    res, _ = gate_on(tmp_path, baseline, run("ar", 10.0, "new"), run("aspire", 25.0, "new"),
                     run("aspire", 25.0, "new", parity_identical_pct=75.0, parity_mismatch=1),
                     run("aspire", 25.0, "new"))
    assert res.exit_code == 1 and "parity broken: 1 mismatch" in res.output


def test_tolerance_override(tmp_path, baseline):
    args = ["--tolerance", "speedup=0.3"]
    res, _ = gate_on(tmp_path, baseline, run("ar", 10.0, "new"), run("aspire", 19.0, "new"), args=args)
    assert res.exit_code == 0, res.output


def test_missing_and_failed_runs(tmp_path, baseline):
    res, _ = gate_on(tmp_path, baseline, run("ar", 10.0, "new"))
    assert res.exit_code == 1 and f"REGRESSION {ASPIRE_KEY}: in the baseline but not measured" in res.output
    res, _ = gate_on(tmp_path, baseline, args=["--allow-missing"])
    assert res.exit_code == 0, res.output
    failed = records.failed(run("aspire", 0, "new2").config, ENV, "OutOfMemory", group="new2")
    res, _ = gate_on(tmp_path, baseline, run("ar", 10.0, "new2"), failed, args=["--group", "new2"])
    assert res.exit_code == 1 and "failed: OutOfMemory" in res.output


def test_usage_errors_exit_2(tmp_path, baseline):
    db = tmp_path / "new.db"
    save(db, run("ar", 10.0, "new"))
    res = CliRunner().invoke(gate, ["--baseline", str(tmp_path / "nope.json"), "--store", str(db)])
    assert res.exit_code == 2 and "no baseline at" in res.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"entries": []}')
    res = CliRunner().invoke(gate, ["--baseline", str(bad), "--store", str(db)])
    assert res.exit_code == 2 and "not an aspire-bench gate baseline" in res.output
    res = CliRunner().invoke(gate, ["--baseline", str(baseline), "--store", str(tmp_path / "none.db")])
    assert res.exit_code == 2 and "no results store" in res.output
    res = CliRunner().invoke(gate, ["--baseline", str(baseline), "--store", str(db), "--tolerance", "speed=1"])
    assert res.exit_code == 2 and "--tolerance" in res.output
    res = CliRunner().invoke(gate, ["--store", str(db)])
    assert res.exit_code == 2 and "missing --baseline PATH" in res.output


def test_bound_share_is_gated_where_the_baseline_has_it(tmp_path):
    db, path = tmp_path / "base.db", tmp_path / "b.json"
    save(db, run("ar", 10.0, "base"), run("aspire", 25.0, "base", bound_share=0.8))
    assert CliRunner().invoke(gate, ["--baseline", str(path), "--store", str(db), "--update"]).exit_code == 0
    assert json.loads(path.read_text())["entries"][1]["bound_share"] == 0.8
    ok, _ = gate_on(tmp_path, path, run("ar", 10.0, "new"), run("aspire", 25.0, "new", bound_share=0.75))
    assert ok.exit_code == 0, ok.output
    res, _ = gate_on(tmp_path, path, run("ar", 10.0, "new2"), run("aspire", 25.0, "new2", bound_share=0.7),
                     args=["--group", "new2"])
    assert res.exit_code == 1 and "bound_share dropped 12.5% to 0.7 (baseline 0.8, allowed −10%)" in res.output


def test_spread_suggests_a_speedup_tolerance(tmp_path):
    db = tmp_path / "s.db"
    save(db, *(r for g, t in (("a", 25.0), ("b", 24.0), ("c", 22.5)) for r in (run("ar", 10.0, g), run("aspire", t, g))))
    res = CliRunner().invoke(gate, ["--store", str(db), "--spread"])
    assert res.exit_code == 0, res.output
    # median 2.4, lowest 2.25: a 6.25% drop, x 1.5 -> 0.1 (rounded up to the next hundredth)
    assert "suggested speedup tolerance: 0.10" in res.output and "warning" not in res.output
    save(db, run("ar", 10.0, "d"), run("aspire", 15.0, "d"))
    res = CliRunner().invoke(gate, ["--store", str(db), "--spread"])
    assert "suggested speedup tolerance: 0.54" in res.output and "a decoder 25% slower in its steps passes" in res.output
    one = tmp_path / "one.db"
    save(one, run("ar", 10.0, "a"), run("aspire", 25.0, "a"))
    res = CliRunner().invoke(gate, ["--store", str(one), "--spread"])
    assert res.exit_code == 2 and "at least two groups" in res.output
