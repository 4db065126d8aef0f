"""`--rope-scaling TYPE:FACTOR` on run and bench: the value reaches the engine and every stored run's
config, bench's JSON rows carry it, a scaled cell is marked, and running past the trained length is said
once on stderr. Bad values are refused in one line (tests/harness/test_failures.py)."""
from __future__ import annotations

import json
import shutil

import click
import pytest
from click.testing import CliRunner

from aspire_bench.cli import main
from aspire_bench.cli_types import rope_scaling
from aspire_bench.harness.store import Store

TRAINED = 512  # the copy's max_position_embeddings: a 1k context runs past it


@pytest.fixture(scope="module")
def short_trained(random_tiny, tmp_path_factory):
    """random_tiny with max_position_embeddings 512: as a model trained on 512 positions."""
    path = tmp_path_factory.mktemp("short") / "m"
    shutil.copytree(random_tiny, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = TRAINED
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture
def engines(monkeypatch):
    """The engines run and bench load, as loaded."""
    from aspire_bench.harness import bench, runner
    seen = []

    def spy(load):
        def wrapped(*a, **kw):
            seen.append(load(*a, **kw))
            return seen[-1]
        return wrapped
    monkeypatch.setattr(runner, "load_engine", spy(runner.load_engine))
    monkeypatch.setattr(bench, "load_engine", spy(bench.load_engine))
    return seen


@pytest.mark.parametrize("value, expected", [
    ("yarn:2", {"rope_type": "yarn", "factor": 2.0}),
    (" YaRN : 4 ", {"rope_type": "yarn", "factor": 4.0}),
    ("linear:1.5", {"rope_type": "linear", "factor": 1.5}),
    ("dynamic:2", {"rope_type": "dynamic", "factor": 2.0}),
    ("none", None),
    (None, None),
])
def test_values_read_as_config_jsons_rope_scaling(value, expected):
    assert rope_scaling(None, None, value) == expected


@pytest.mark.parametrize("value, needle", [
    ("yarn", "write TYPE:FACTOR"), ("ntk:2", "unknown scaling type 'ntk'"), ("yarn:1", "above 1"),
    ("yarn:0.5", "above 1"), ("yarn:two", "above 1"), ("yarn:nan", "above 1"), ("linear:inf", "above 1"),
    ("llama3:8", "sweep file"), (":2", "unknown scaling type ''"),
])
def test_bad_values_name_the_problem_and_the_fix(value, needle):
    with pytest.raises(click.BadParameter, match=needle):
        rope_scaling(None, None, value)


def test_run_passes_the_scaling_to_the_engine_and_the_stored_config(short_trained, tmp_path, engines):
    db = tmp_path / "r.db"
    r = CliRunner().invoke(main, ["run", "--model", str(short_trained), "--task", "needle", "--context-len", "1k",
                                  "--limit", "1", "--batch-size", "1", "--max-new-tokens", "4",
                                  "--rope-scaling", "linear:4", "--store", str(db)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    (engine,) = {id(e): e for e in engines}.values()
    assert engine.cfg.rope == {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": TRAINED}
    assert engine.max_context == 4 * TRAINED
    assert r.stderr.count("beyond the model's trained") == 1
    assert "note: 1k runs beyond the model's trained 512 positions: linear ×4" in r.stderr
    assert "linear×4" in r.stdout  # the summary's title
    with Store(db, readonly=True) as st:
        rec = st.get_run(1)
    assert rec.config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_bench_passes_the_scaling_to_the_engine_rows_and_json(short_trained, tmp_path, engines):
    db, out = tmp_path / "b.db", tmp_path / "rows.json"
    r = CliRunner().invoke(main, ["bench", "--model", str(short_trained), "--task", "needle", "--context-len", "1k",
                                  "--batch-size", "1", "--decoders", "ar", "--sampling", "greedy", "--limit", "1",
                                  "--repeat", "1", "--max-new-tokens", "4", "--no-tune", "--no-bound",
                                  "--no-calibration-rounds", "--rope-scaling", "yarn:4", "--store", str(db),
                                  "--json", str(out), "--format", "markdown"])
    assert r.exit_code == 0, r.output
    (engine,) = {id(e): e for e in engines}.values()
    assert engine.cfg.rope["rope_type"] == "yarn" and engine.cfg.rope["factor"] == 4.0
    assert engine.max_context == 4 * TRAINED
    assert r.stderr.count("beyond the model's trained") == 1
    assert "note: 1k runs beyond the model's trained 512 positions: YaRN ×4" in r.stderr
    assert "| 1k yarn×4 |" in r.stdout  # the cell's context in the table
    (row,) = json.loads(out.read_text())
    assert row["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0} and row["context"] == "1k"
    assert row["model"] == str(short_trained) and row["dtype"] == "float32"
    with Store(db, readonly=True) as st:
        rec = st.get_run(row["run_id"])
    assert rec.config["rope_scaling"] == row["rope_scaling"]


def test_bench_rows_without_scaling_carry_null(random_tiny, tmp_path):
    out = tmp_path / "rows.json"
    r = CliRunner().invoke(main, ["bench", "--model", str(random_tiny), "--task", "needle", "--context-len", "1k",
                                  "--batch-size", "1", "--decoders", "ar", "--sampling", "greedy", "--limit", "1",
                                  "--repeat", "1", "--max-new-tokens", "4", "--no-tune", "--no-bound",
                                  "--no-calibration-rounds", "--store", str(tmp_path / "b.db"), "--json", str(out),
                                  "--format", "markdown", "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(out.read_text())
    assert "rope_scaling" in row and row["rope_scaling"] is None
    assert row["model"] == str(random_tiny) and row["dtype"] == "bfloat16"  # a bf16 file says so, not just its name
    assert "beyond the model's trained" not in r.stderr and "| 1k |" in r.stdout


@pytest.mark.parametrize("scaling, fix", [(None, "or another model"), ("linear:1.5", "a larger rope scaling factor")])
def test_a_context_past_the_scaled_length_is_refused_with_its_fix(short_trained, tmp_path, scaling, fix):
    args = ["run", "--model", str(short_trained), "--task", "needle", "--context-len", "1k", "--limit", "1",
            "--max-new-tokens", "4", "--store", str(tmp_path / "r.db")]
    r = CliRunner().invoke(main, args + (["--rope-scaling", scaling] if scaling else []))
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert fix in r.stderr and f"maximum context of {768 if scaling else TRAINED}" in r.stderr
    assert "beyond the model's trained" not in r.stderr  # the refusal says it all
