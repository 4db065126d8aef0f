"""Records and the SQLite store: round trips, migrations, atomic and concurrent writes, export, CLI."""
import csv
import io
import json
import multiprocessing
import os
import signal
import sqlite3
import time

import pytest
from click.testing import CliRunner

from aspire_bench.decoders.base import (
    PREFILL,
    VERIFY,
    GenerationOutput,
    ParityMargins,
    RequestResult,
    RowTrace,
    StepTrace,
)
from aspire_bench.errors import UserError
from aspire_bench.harness import records, store
from aspire_bench.harness.parity import RunParity, compare
from aspire_bench.harness.records import RunRecord, config_hash, from_output
from aspire_bench.harness.store import Store
from aspire_bench.harness.store_cli import COMMANDS

TABLES = ("runs", "requests", "steps", "aggregates")
ENV = {"python": "3.11", "torch": "2.13", "device": "cpu", "gpu": None, "cpu": "test cpu"}


def make_record(i: int = 0, decoder: str = "aspire", **kw) -> RunRecord:
    t0 = 100.0
    steps = [StepTrace(0, t0, t0 + 1.0, [RowTrace("r0", PREFILL, 8, 1), RowTrace("r1", PREFILL, 8, 1)]),
             StepTrace(1, t0 + 1.0, t0 + 1.5, [RowTrace("r0", VERIFY, 4, 3, 3, 2, 8, 5, 2, 1, 2),
                                                RowTrace("r1", VERIFY, 4, 4, 3, 3, 8)])]
    results = [
        RequestResult("r0", [5, 6, 7, 8], "length", [t0 + 1.0, t0 + 1.5, t0 + 1.5, t0 + 1.5], t0, t0,
                      [(3, 2)], ParityMargins([1.0, 2.0, 0.5, 3.0], [0, 0, 0, 0], [5.0] * 4),
                      schedule=[{"alpha": 0.9, "c": 0.2, "gamma": 3}], draft_lengths=[3], extra={"plug_in": 1}),
        RequestResult("r1", [1, 2, 3, 4, 5], "eos", [t0 + 1.0] + [t0 + 1.5] * 4, t0, t0, [(3, 3)]),
    ]
    out = GenerationOutput(results, steps, t0, t0 + 2.0, info={"gamma": 3})
    config = {"decoder": {"name": decoder, "gamma": 3}, "model": "tiny", "task": "synthetic", "seed": i}
    return from_output(config, out, {"r0": 8, "r1": 8}, ENV, texts={"r0": "a b", "r1": "c"},
                       scores={"r0": 1.0, "r1": None},
                       parity=RunParity({"r0": compare([5, 6, 7, 8], [5, 6, 9, 8], ParityMargins(
                                                           [1.0, 2.0, 0.004, 3.0], [0, 0, 7, 0], [5.0] * 4), 1e-3),
                                         "r1": compare([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], None, 1e-3)}, 1e-3),
                       **kw)


def counts(path) -> dict:
    with sqlite3.connect(path) as c:
        return {t: c.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}


def without_id(rec: RunRecord) -> dict:
    return {k: v for k, v in rec.to_json().items() if k != "run_id"}


def test_config_hash_ignores_filing_keys_and_key_order():
    a = {"model": "m", "decoder": {"name": "ar"}, "seed": 0}
    assert config_hash(a) == config_hash({"seed": 0, "decoder": {"name": "ar"}, "model": "m", "store": "x.db",
                                          "tag": "t", "group": "g"})
    assert config_hash(a) != config_hash({**a, "seed": 1})


def test_round_trip(tmp_path):
    rec = make_record(group="g1", sweep="s", tag="t")
    with Store(tmp_path / "r.db") as s:
        run_id = s.save_run(rec)
        back = s.get_run(run_id)
    assert back.run_id == run_id == rec.run_id
    assert without_id(back) == without_id(rec)
    assert back.requests[0].verifications == [(3, 2)]
    assert back.requests[0].parity["kind"] == "near-tie"
    assert back.steps[1].rows[0] == ("r0", VERIFY, 4, 3, 3, 2, 8, 5, 2, 1, 2)
    assert records.row_kv_sparse(back.steps[1].rows[0]) == 5
    assert records.row_kv_sparse(back.steps[1].rows[0][:7]) == 0  # a row stored before the column
    assert records.row_kv_captured(back.steps[1].rows[0]) == 2
    assert records.row_kv_captured(back.steps[1].rows[0][:8]) == 0
    assert records.row_kv_shaped(back.steps[1].rows[0]) == (1, 2)
    assert records.row_kv_shaped(back.steps[1].rows[0][:9]) == (0, 0)  # stored before kv_layered, kv_topk
    assert isinstance(back.aggregates["n_requests"], int)
    assert back.aggregates["parity_near_tie"] == 1


def test_failed_run_round_trip(tmp_path):
    rec = records.failed({"decoder": "vegas"}, ENV, "OutOfMemoryBudget: too long")
    with Store(tmp_path / "r.db") as s:
        back = s.get_run(s.save_run(rec))
        assert s.list_runs(status="failed")[0]["decoder"] == "vegas"
    assert (back.status, back.error, back.requests, back.steps) == ("failed", "OutOfMemoryBudget: too long", [], [])


def test_jsonl_round_trip():
    recs = [make_record(0), make_record(1)]
    buf = io.StringIO()
    assert records.write_jsonl(recs, buf) == 2
    back = records.read_jsonl(io.StringIO(buf.getvalue()))
    assert [r.to_json() for r in back] == [r.to_json() for r in recs]


def legacy_layout(row: dict) -> dict:
    """A request row as written before its typed fields: AR's parity record, the schedule and the draft
    lengths in `extra`, under the keys they had there."""
    row = dict(row)
    margins, extra = row.pop("margins"), dict(row.pop("extra"))
    if margins:
        extra.update(margins=margins["margin"], runner_up=margins["runner_up"], top_logit=margins["top_logit"])
    for k in ("schedule", "draft_lengths"):
        if (v := row.pop(k)) is not None:
            extra[k] = v
    return {**row, "extra": extra}


def test_rows_of_the_layout_before_typed_fields_read_into_them(tmp_path):
    """Stores and JSONL files written when a request's parity record, schedule and draft lengths lived in
    its `extra` read them into the typed fields: nothing is lost, and extra keeps only the rest."""
    rec = make_record()
    r0 = rec.requests[0]
    assert r0.margins.margin == [1.0, 2.0, 0.5, 3.0] and r0.draft_lengths == [3] and r0.extra == {"plug_in": 1}
    old = rec.to_json()
    old["requests"] = [legacy_layout(r) for r in old["requests"]]
    assert old["requests"][0]["extra"]["runner_up"] == [0, 0, 0, 0] and old["requests"][1]["extra"] == {}
    back = RunRecord.from_json(json.loads(json.dumps(old)))
    assert back.to_json() == rec.to_json()
    with Store(tmp_path / "r.db") as s:
        run_id = s.save_run(rec)
    with sqlite3.connect(tmp_path / "r.db") as c:
        stored = dict(c.execute("SELECT idx, data FROM requests WHERE run_id = ?", (run_id,)).fetchall())
        new = json.loads(stored[0])  # written in the typed layout
        assert new["margins"]["runner_up"] == [0, 0, 0, 0] and new["schedule"] and new["extra"] == {"plug_in": 1}
        for idx, data in stored.items():
            c.execute("UPDATE requests SET data = ? WHERE run_id = ? AND idx = ?",
                      (json.dumps(legacy_layout(json.loads(data))), run_id, idx))
    with Store(tmp_path / "r.db", readonly=True) as s:
        back = s.get_run(run_id)
    assert without_id(back) == without_id(rec)
    assert back.requests[1].margins is None and back.requests[1].extra == {}


def test_info_sections_are_named_and_a_misspelt_one_is_refused(tmp_path):
    """A run's info holds the decoder's settings and named sections (records.RunInfo): a section is
    written and read by a name that must be one, so a misspelling fails instead of filing a setting."""
    rec = make_record(info={"tuning": {"settings": {"gamma": 2}}})
    rec.set_section("step_costs", {"c_aspire": 0.3})
    assert rec.section("step_costs") == {"c_aspire": 0.3} and rec.section("rounds", []) == []
    assert rec.settings == {"gamma": 3}  # what the decoder reported: the sections left out
    with Store(tmp_path / "r.db") as s:  # stored as before: sections are top-level keys of info
        back = s.get_run(s.save_run(rec))
    assert back.info == {"gamma": 3, "tuning": {"settings": {"gamma": 2}}, "step_costs": {"c_aspire": 0.3}}
    for misspelt in (lambda: rec.set_section("step_cost", {}), lambda: rec.section("round", []),
                     lambda: make_record(info={"tunning": {}})):
        with pytest.raises(ValueError, match="'(step_cost|round|tunning)' is not a section of a run's info"):
            misspelt()


def test_migration_from_empty_db_and_to_a_new_version(tmp_path, monkeypatch):
    path = tmp_path / "r.db"
    latest = len(store.MIGRATIONS)
    with Store(path) as s:
        assert store.schema_version(s.conn) == latest
        s.save_run(make_record())
    assert {t: n for t, n in counts(path).items() if t != "aggregates"} == {"runs": 1, "requests": 2, "steps": 1}
    # How a new version lands: one more entry in MIGRATIONS; an existing store upgrades on open, data kept.
    nxt = ("ALTER TABLE runs ADD COLUMN seed INTEGER", "UPDATE runs SET seed = json_extract(config, '$.seed')")
    monkeypatch.setattr(store, "MIGRATIONS", [*store.MIGRATIONS, nxt])
    with Store(path) as s:
        assert store.schema_version(s.conn) == latest + 1
        assert s.conn.execute("SELECT seed FROM runs").fetchall() == [(0,)]
        assert len(s.list_runs()) == 1
    monkeypatch.setattr(store, "MIGRATIONS", store.MIGRATIONS[:latest])
    with pytest.raises(UserError, match="newer"):
        Store(path)


def test_v1_store_reads_as_measured_runs_and_upgrades_to_run_kinds(tmp_path, monkeypatch):
    path = tmp_path / "v1.db"
    with Store(path) as s:  # a store as written before runs had a kind: v2 undone
        s.save_run(make_record())
        s.conn.execute("DROP INDEX runs_kind")
        s.conn.execute("ALTER TABLE runs DROP COLUMN kind")
        s.conn.execute("UPDATE schema_version SET version = 1")
    with Store(path, readonly=True) as s:  # read-only: never upgraded, still readable
        assert store.schema_version(s.conn) == 1
        assert [r["kind"] for r in s.list_runs()] == ["measured"]
        assert len(s.list_runs(kind="measured")) == 1 and s.list_runs(kind="simulated") == []
        assert s.get_run(1).kind == "measured"
    with Store(path) as s:  # a writing open upgrades it; other kinds are then stored and filtered
        assert store.schema_version(s.conn) == len(store.MIGRATIONS)
        sim = make_record(1)
        sim.kind = "simulated"
        s.save_run(sim)
        assert [r["kind"] for r in s.list_runs()] == ["measured", "simulated"]
        assert [r["run_id"] for r in s.list_runs(kind="simulated")] == [2]
        assert s.get_run(2).kind == "simulated"


def test_exception_mid_write_leaves_no_rows(tmp_path, monkeypatch):
    path = tmp_path / "r.db"

    def boom():
        raise RuntimeError("disk on fire")

    with Store(path) as s:
        monkeypatch.setattr(store, "_mid_write_hook", boom)
        with pytest.raises(RuntimeError):
            s.save_run(make_record())
        assert counts(path) == dict.fromkeys(TABLES, 0)
        monkeypatch.setattr(store, "_mid_write_hook", None)
        s.save_run(make_record())  # the store is still usable
    assert counts(path)["runs"] == 1


def _save_then_hang(path, flag):
    def hang():
        open(flag, "w").close()
        time.sleep(60)

    store._mid_write_hook = hang
    Store(path).save_run(make_record())


def test_killed_write_leaves_no_rows(tmp_path):
    path, flag = tmp_path / "r.db", tmp_path / "inside"
    Store(path).close()
    proc = multiprocessing.get_context("fork").Process(target=_save_then_hang, args=(path, flag))
    proc.start()
    deadline = time.monotonic() + 20
    while not flag.exists():
        assert time.monotonic() < deadline and proc.is_alive(), "writer never reached the hook"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    assert counts(path) == dict.fromkeys(TABLES, 0)
    with Store(path) as s:  # the dead writer's lock is gone
        s.save_run(make_record())
    assert counts(path)["runs"] == 1


def _write_many(path, tag, start, n):
    start.wait()
    with Store(path) as s:
        for i in range(n):
            s.save_run(make_record(i, tag=tag))


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    path = tmp_path / "r.db"
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_write_many, args=(path, tag, start, 20)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    with Store(path) as s:
        runs = s.list_runs()
        assert len(runs) == 40 and len({r["run_id"] for r in runs}) == 40
        assert len(s.list_runs(tag="a")) == len(s.list_runs(tag="b")) == 20
        assert all(len(s.get_run(r["run_id"]).requests) == 2 for r in runs)


def test_list_filters_group_limit_and_config_hash(tmp_path):
    with Store(tmp_path / "r.db") as s:
        ar = s.save_run(make_record(0, decoder="ar", group="g1"))
        sp = s.save_run(make_record(0, decoder="aspire", group="g1"))
        other = s.save_run(make_record(1, decoder="ar", group="g2"))
        assert [r["run_id"] for r in s.list_runs(group="g1")] == [ar, sp]
        assert [r["run_id"] for r in s.list_runs(decoder="ar")] == [ar, other]
        assert [r["run_id"] for r in s.list_runs(limit=2)] == [sp, other]
        h = config_hash(make_record(1, decoder="ar").config)
        assert [r["run_id"] for r in s.list_runs(config_hash=h)] == [other]
        assert s.list_runs(group="g1")[1]["aggregates"]["mean_accepted_len"] == pytest.approx(3.5)
        with pytest.raises(TypeError):
            s.list_runs(colour="red")
        with pytest.raises(UserError):
            s.get_run(999)


def test_export_jsonl_and_csv(tmp_path):
    path = tmp_path / "r.db"
    with Store(path) as s:
        recs = [make_record(i, tag="x") for i in range(3)]
        for r in recs:
            s.save_run(r)
        assert s.export("jsonl", tmp_path / "out.jsonl") == 3
        assert s.export("csv", tmp_path / "out.csv") == 3
        with pytest.raises(UserError):
            s.export("xml", tmp_path / "out.xml")
    with open(tmp_path / "out.jsonl") as f:
        back = records.read_jsonl(f)
    assert [r.to_json() for r in back] == [r.to_json() for r in recs]
    with open(tmp_path / "out.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and rows[0]["tag"] == "x" and rows[0]["decoder"] == "aspire"
    assert float(rows[2]["decode_tok_s"]) == pytest.approx(recs[2].aggregates["decode_tok_s"])


def test_cli_runs_show_export(tmp_path):
    path = str(tmp_path / "r.db")
    with Store(path) as s:
        run_id = s.save_run(make_record(tag="nightly"))
    cmd = {c.name: c for c in COMMANDS}
    runner = CliRunner(env={"COLUMNS": "250"})
    listed = runner.invoke(cmd["runs"], ["--store", path, "--columns", "all"])
    assert listed.exit_code == 0, listed.output
    assert "aspire" in listed.output and "nightly" in listed.output
    shown = runner.invoke(cmd["show"], [str(run_id), "--store", path])
    assert shown.exit_code == 0, shown.output
    assert "decode_tok_s" in shown.output and "near-tie" in shown.output and "test cpu" in shown.output
    exported = runner.invoke(cmd["export"], ["--store", path, "--format", "jsonl"])
    assert exported.exit_code == 0
    assert json.loads(exported.output.splitlines()[0])["tag"] == "nightly"
    missing = runner.invoke(cmd["runs"], ["--store", str(tmp_path / "nope.db")])
    assert missing.exit_code != 0 and not (tmp_path / "nope.db").exists()


def test_only_measured_runs_reach_the_leaderboard(tmp_path):
    from aspire_bench.report.leaderboard import load_runs
    path = tmp_path / "r.db"
    with Store(path) as s:
        s.save_run(make_record(0))
        for i, kind in ((1, "simulated"), (2, "diagnostic")):
            rec = make_record(i)
            rec.kind = kind
            s.save_run(rec)
    assert [r.kind for r in load_runs(path)] == ["measured"]
