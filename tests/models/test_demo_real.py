"""`aspire-bench demo --real` (make demo-real): its sweep, and the one line it prints without the model."""
from __future__ import annotations

from click.testing import CliRunner

from aspire_bench.cli import main
from aspire_bench.demo import DEMO_REAL_SWEEP
from aspire_bench.harness.sweep import load_sweep
from aspire_bench.tasks.buckets import parse_bucket


def test_the_real_demo_sweep_runs_every_decoder_within_the_models_context():
    sweep = load_sweep(DEMO_REAL_SWEEP)
    assert {c.config.model for c in sweep.cells} == {"smollm2-135m"}
    assert {c.config.decoder for c in sweep.cells} == {"ar", "magicdec", "vegas", "aspire"}
    assert all(c.config.parity and c.config.temperature == 0 for c in sweep.cells)
    longest = max(parse_bucket(c.config.context_len)[1] + c.config.max_new_tokens for c in sweep.cells)
    assert longest <= 8192  # SmolLM2's trained context


def test_demo_real_without_the_model_stops_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("ASPIRE_BENCH_MODELS", str(tmp_path / "empty"))
    r = CliRunner().invoke(main, ["demo", "--real", "--store", str(tmp_path / "d.db"), "--out", str(tmp_path / "b")])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "run `aspire-bench models get smollm2-135m`" in r.output
    assert not (tmp_path / "d.db").exists() and not (tmp_path / "b").exists()
