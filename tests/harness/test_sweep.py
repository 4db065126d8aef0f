"""Sweeps: expansion, resume, failed cells, retries, the local and Ray executors, the CLI."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from aspire_bench.cli import Main
from aspire_bench.errors import UserError
from aspire_bench.harness import records
from aspire_bench.harness.records import RunRecord
from aspire_bench.harness.store import Store
from aspire_bench.harness.sweep import expand, load_sweep, run_sweep
from aspire_bench.harness.sweep_cli import sweep as sweep_command

SWEEPS = Path(__file__).resolve().parents[2] / "sweeps"


def tiny_spec(model, **over) -> dict:
    """Cells that take about a second each on the random tiny model."""
    return {"name": "t", "models": [str(model)], "tasks": [{"name": "needle", "limit": 2}], "contexts": ["1k"],
            "decoders": ["ar", "vegas"], "batch_sizes": [2], "max_new_tokens": 6, "warmup": False, **over}


def fake_cell(config, sweep, group) -> RunRecord:
    return RunRecord(config, records.config_hash(config), {}, sweep=sweep, group=group)


def stored(db) -> list[RunRecord]:
    with Store(db) as st:
        return [st.get_run(r["run_id"]) for r in st.list_runs()]


def test_expansion_counts_order_and_groups():
    spec = {"name": "x", "models": ["m1", {"path": "m2", "dtype": "bfloat16"}],
            "tasks": ["needle", {"name": "aime25", "contexts": None, "max_new_tokens": 512, "limit": 3}],
            "contexts": ["1k", "30-40k"], "decoders": ["ar", {"name": "aspire", "args": {"min_pages": 16}}],
            "batch_sizes": [1, 4], "max_new_tokens": [8, None],
            "sampling": [{"temperature": 0}, {"temperature": 0.7, "top_k": 50, "top_p": 0.9}]}
    sw = expand(spec)
    # per model: needle 2 contexts x 2 batch x 2 max_new x 2 sampling x 2 decoders = 32,
    # aime25 (no context, its own max_new) 2 batch x 2 sampling x 2 decoders = 8
    assert len(sw.cells) == 2 * (32 + 8)
    cfgs = [c.config for c in sw.cells]
    assert [c.model for c in cfgs] == ["m1"] * 40 + ["m2"] * 40  # model outermost: loaded once
    assert [c.decoder for c in cfgs[:4]] == ["ar", "aspire", "ar", "aspire"]  # decoder innermost
    assert cfgs[1].decoder_args == {"min_pages": 16} and cfgs[40].dtype == "bfloat16"
    aime = [c for c in cfgs if c.task == "aime25"]
    assert {(c.context_len, c.max_new_tokens, c.limit) for c in aime} == {(None, 512, 3)}
    assert [c.index for c in sw.cells] == list(range(80))
    # groups: the cells that differ only in their decoder, and nothing else
    groups = {}
    for c in sw.cells:
        groups.setdefault(c.group_key, []).append(c.config.decoder)
    assert len(groups) == 40 and all(v == ["ar", "aspire"] for v in groups.values())
    # deterministic from the fields, the sweep name and the invocation id
    assert [c.group("inv") for c in expand(spec).cells] == [c.group("inv") for c in sw.cells]
    assert sw.cells[0].group("inv") != sw.cells[0].group("other")
    assert expand({**spec, "name": "y"}).cells[0].group_key != sw.cells[0].group_key
    assert len({c.config_hash for c in sw.cells}) == 80


@pytest.mark.parametrize("change, message", [
    ({"decoders": ["ar", "ar"]}, "decoders: 'ar' is listed twice"),
    ({"decoders": ["ar", {"name": "ar", "args": {}}]}, "same cell twice"),
    ({"contexts": ["1k"], "batch_size": [2]}, "batch_size: unknown key"),
    ({"decoders": ["nope"]}, "unknown decoder 'nope'"),
    ({"tasks": ["nope"]}, "unknown task 'nope'"),
    ({"contexts": ["4q"]}, "bad context length"),
    ({"parity": True, "sampling": {"temperature": 0.7}}, "parity compares greedy"),
    ({"models": []}, "models: Value should have at least 1 item"),
    ({"batch_sizes": ["abc"]}, "batch_sizes[0]: Input should be a valid integer"),
    ({"repeats": "many"}, "repeats: Input should be a valid integer"),
    ({"parity": "false"}, "parity: Input should be a valid boolean"),
    ({"max_new_tokens": 0}, "max_new_tokens[0]: Input should be greater than or equal to 1"),
    ({"sampling": {"top_p": 0}}, "sampling[0].top_p: Input should be greater than 0"),
])
def test_bad_sweep_files_fail_before_any_cell(change, message):
    with pytest.raises(UserError) as e:
        expand({**tiny_spec("m"), **change})
    assert message in str(e.value)


def test_resume_runs_only_the_missing_cells(random_tiny, tmp_path):
    db = tmp_path / "r.db"
    first = run_sweep(expand(tiny_spec(random_tiny)), db, show_progress=False)
    assert first.ran == 2 and not first.failed
    three = expand(tiny_spec(random_tiny, decoders=["ar", "vegas", {"name": "aspire", "args": {"min_pages": 2}}]))
    again = run_sweep(three, db, resume=True, show_progress=False)
    assert (again.ran, again.skipped) == (1, 2)
    runs = stored(db)
    assert len(runs) == 3 and runs[-1].config["decoder"] == "aspire"
    # the resumed cell joins the stored cells' group, so its speedup is over the AR run stored before
    assert again.invocation == first.invocation and len({r.group for r in runs}) == 1
    assert [r.run_id for r in again.records] == [r.run_id for r in runs]
    assert run_sweep(three, db, resume=True, show_progress=False).ran == 0
    # without --resume every cell runs again (a stand-in cell: the real ones ran above)
    assert run_sweep(three, db, show_progress=False, cell_fn=fake_cell).ran == 3 and len(stored(db)) == 6


def test_a_sweep_in_a_log_prints_a_line_per_cell(random_tiny, tmp_path, capsys):
    """stderr here is not a terminal (a CI log): a redrawn bar would show only when the sweep ends."""
    sw = expand(tiny_spec(random_tiny, decoders=["ar", "vegas", "aspire"]))
    run_sweep(sw, tmp_path / "p.db", cell_fn=fake_cell)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("sweep ")]
    assert [ln.split()[2] for ln in lines] == ["1/3", "2/3", "3/3"]
    assert all("0 failed" in ln and "[ok]" in ln for ln in lines), lines


def test_failed_cells_are_stored_and_the_sweep_goes_on(random_tiny, tmp_path):
    db = tmp_path / "f.db"
    spec = tiny_spec(random_tiny, contexts=["1k", "64k"], decoders=["ar", {"name": "aspire", "args": {"bogus": 1}}])
    (tmp_path / "f.yaml").write_text(yaml.safe_dump(spec))
    cli = Main(commands={"sweep": sweep_command})
    r = CliRunner().invoke(cli, ["sweep", str(tmp_path / "f.yaml"), "--store", str(db)])
    assert r.exit_code == 0, r.output
    runs = stored(db)
    assert [(x.config["decoder"], x.config["context_len"], x.status) for x in runs] == [
        ("ar", "1k", "ok"), ("aspire", "1k", "failed"), ("ar", "64k", "failed"), ("aspire", "64k", "failed")]
    assert "bogus" in runs[1].error and "maximum context of 8192" in runs[2].error
    assert runs[1].env["attempts"] == 1  # a config error is not retried
    assert "4 cells run, 0 already stored, 3 failed" in r.output
    assert "needle on random_tiny" in r.output  # the summary table


def test_local_retries_then_records_the_last_error(tmp_path):
    sw = expand({**tiny_spec("m"), "max_retries": 2})
    calls = []

    def flaky(config, sweep, group):  # the ar cell fails once, the vegas cell every time
        calls.append(config["decoder"])
        if config["decoder"] == "vegas" or calls.count("ar") == 1:
            raise RuntimeError(f"boom {len(calls)}")
        return fake_cell(config, sweep, group)

    out = run_sweep(sw, tmp_path / "l.db", cell_fn=flaky, show_progress=False)
    ok, bad = stored(tmp_path / "l.db")
    assert (ok.status, ok.env["attempts"]) == ("ok", 2)
    assert (bad.status, bad.env["attempts"], bad.error) == ("failed", 3, "RuntimeError: boom 5")
    assert out.failed[0].run_id == bad.run_id


def test_ray_missing_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(UserError, match=r"aspire-bench\[ray\]"):
        run_sweep(expand(tiny_spec("m")), tmp_path / "n.db", executor="ray")
    assert not (tmp_path / "n.db").exists()


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


def test_ray_executor_matches_local(local_ray, random_tiny, tmp_path):
    sw = expand(tiny_spec(random_tiny, decoders=["ar", {"name": "aspire", "args": {"min_pages": 2}}]))
    run_sweep(sw, tmp_path / "local.db", show_progress=False)
    out = run_sweep(sw, tmp_path / "ray.db", executor="ray", show_progress=False)
    assert out.ran == 2 and not out.failed
    local = {r.config_hash: r for r in stored(tmp_path / "local.db")}
    remote = {r.config_hash: r for r in stored(tmp_path / "ray.db")}
    assert set(local) == set(remote) == {c.config_hash for c in sw.cells}
    for h, rec in remote.items():
        assert [q.output_ids for q in rec.requests] == [q.output_ids for q in local[h].requests]
        assert rec.status == "ok" and rec.env["executor"] == "ray" and rec.env["attempts"] == 1
        assert rec.sweep == "t" and rec.group == sw.cells[0].group(out.invocation)
    assert local_ray.is_initialized()  # a Ray instance the driver did not start is left running


def test_ray_retries_and_records_failures(local_ray, tmp_path):
    marker = tmp_path / "tried"
    sw = expand({**tiny_spec("m"), "max_retries": 1})

    def flaky(config, sweep, group):  # runs on a Ray worker (pickled by value: defined in a test)
        if config["decoder"] == "vegas":
            raise RuntimeError("always")
        if not marker.exists():
            marker.write_text("1")
            raise RuntimeError("first try")
        return RunRecord(config, records.config_hash(config), {}, sweep=sweep, group=group)

    run_sweep(sw, tmp_path / "rr.db", executor="ray", cell_fn=flaky, show_progress=False)
    by_decoder = {r.config["decoder"]: r for r in stored(tmp_path / "rr.db")}
    assert (by_decoder["ar"].status, by_decoder["ar"].env["attempts"]) == ("ok", 2)
    bad = by_decoder["vegas"]
    assert (bad.status, bad.env["attempts"], bad.error) == ("failed", 2, "RuntimeError: always")


def test_shipped_sweep_files_expand():
    from aspire_bench.demo import DEMO_SWEEP
    demo = load_sweep(DEMO_SWEEP)
    contexts = {c.config.context_len for c in demo.cells}
    assert len(demo.cells) == 4 * len(contexts) and {c.config.model for c in demo.cells} == {"tiny"}
    assert {c.config.decoder for c in demo.cells} == {"ar", "magicdec", "vegas", "aspire"}
    # the regime where the bundled model's speculative decoders gain: 4k x 8, the paper's sampling
    assert {(c.config.context_len, c.config.batch_size) for c in demo.cells} == {("4k", 8)}
    assert {(c.config.temperature, c.config.top_k, c.config.top_p) for c in demo.cells} == {(0.7, 50, 0.9)}
    paper = load_sweep(SWEEPS / "aspire_paper.yaml")
    assert {(c.config.temperature, c.config.top_k, c.config.top_p) for c in paper.cells} == {(0.7, 50, 0.9)}
    assert {c.config.decoder for c in paper.cells} == {"ar", "magicdec", "vegas", "aspire"}
    yarn = {c.config.context_len for c in paper.cells if c.config.rope_scaling}
    assert yarn == {"80-100k"}
    for c in paper.cells:
        qwen_long = "Qwen3" in c.config.model and c.config.context_len == "80-100k"
        assert (c.config.rope_scaling or {}).get("rope_type") == ("yarn" if qwen_long else None)
    assert "rope_scaling" not in next(c for c in paper.cells if not c.config.rope_scaling).config.identity()


def test_a_cells_rope_scaling_reaches_the_engine():
    from aspire_bench.harness.runner import load_engine
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 40960}
    plain, scaled = load_engine("tiny", "float32", "cpu", "torch"), load_engine("tiny", "float32", "cpu", "torch", yarn)
    assert (plain.max_context, scaled.max_context) == (40960, 81920)
    assert scaled.cfg.rope["rope_type"] == "yarn" and plain.cfg.rope["rope_type"] == "default"
