"""Bad input and faults at every entry point, through the real CLI, each command in its own process (the
`cli` fixture): exit 2, one short error line, no traceback, and every file the command was pointed at
unchanged (by hash).

The inputs fail before any generation, so the module stays fast: the commands load at most the bundled
tiny model.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

import pytest

from aspire_bench.harness.records import RequestRow, RunRecord, config_hash
from aspire_bench.harness.store import Store
from aspire_bench.models.bundled import bundled_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ENV = {"python": "3.11", "cpu": "Test CPU"}


def snapshot(d: Path) -> dict[str, str]:
    """Every file under d by content hash (directories as markers): what a failed command must not touch.
    Left out: a WAL store's -shm (SQLite's shared-memory index, which every reader updates) and an
    empty -wal (a read-only reader of a WAL store cannot remove it on close); the database itself and
    any WAL content are compared."""
    out = {}
    for p in sorted(d.rglob("*")):
        if not (p.name.endswith("-shm") or (p.name.endswith("-wal") and p.stat().st_size == 0)):
            out[str(p.relative_to(d))] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def assert_refused(res: subprocess.CompletedProcess, *needles: str) -> None:
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    assert "Traceback" not in text, text
    errors = [line for line in res.stderr.splitlines() if line.lower().startswith("error")]
    assert len(errors) == 1 and len(res.stderr.splitlines()) <= 4, res.stderr  # click adds its usage lines
    for n in needles:
        assert n in errors[0], errors[0]


def record(tag: str | None = None, model: str = "tiny", group: str = "g1", **agg) -> RunRecord:
    config = {"decoder": "aspire", "model": model, "task": "needle", "context_len": "4k", "batch_size": 4}
    rows = [RequestRow(id="r0", prompt_len=5, output_ids=[1, 2], finish_reason="length", text="[bold]x")]
    return RunRecord(config=config, config_hash=config_hash(config), env=ENV, tag=tag, group=group,
                     requests=rows, aggregates={"decode_tok_s": 10.0, "mean_accepted_len": 3.0, **agg})


@pytest.fixture
def work(tmp_path):
    """A directory with a real store, a non-SQLite file, another application's database, a truncated
    store, and the prompt/baseline files the cases point at."""
    d = tmp_path / "w"
    d.mkdir()
    with Store(d / "store.db") as s:  # closing the last connection folds the WAL into the file
        s.save_run(record(tag="[/oops]", model="/m/[red]x"))
    (d / "notes.txt").write_text("not a database\n")
    with closing(sqlite3.connect(d / "other.db")) as c:
        c.execute("CREATE TABLE contacts (name TEXT)")
        c.execute("INSERT INTO contacts VALUES ('a')")
        c.commit()
    data = (d / "store.db").read_bytes()
    (d / "truncated.db").write_bytes(data[: len(data) // 3])
    (d / "half-page.db").write_bytes(data[:4096 + 1000])
    (d / "sub").mkdir()
    return d


# --- argument errors: refused before anything is imported or loaded ----------------------------------

ARG_CASES = [
    (["run", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["run", "--max-new-tokens", "-5"], "--max-new-tokens"),
    (["run", "--temperature", "-1"], "--temperature"),
    (["run", "--temperature", "nan"], "--temperature"),
    (["run", "--top-k", "-5"], "--top-k"),
    (["run", "--top-p", "0"], "--top-p"),
    (["run", "--top-p", "1.5"], "--top-p"),
    (["run", "--batch-size", "0"], "--batch-size"),
    (["run", "--limit", "0"], "--limit"),
    (["run", "--repeat", "0"], "--repeat"),
    (["run", "--seed", "-1"], "--seed"),
    (["run", "--context-len", "4q"], "bad context length"),
    (["run", "--dtype", "float8"], "--dtype"),
    (["bench", "--batch-sizes", "1,abc"], "--batch-sizes"),
    (["bench", "--contexts", "4k,zz"], "--contexts"),
    (["bench", "--sampling", "-1:0:1"], "--sampling"),
    (["bench", "--batch-size", "1,abc"], "--batch-size"),
    (["bench", "--context-len", "4k,zz"], "--context-len"),
    (["bench", "--context-len", "4k", "--contexts", "8k"], "--contexts is another spelling of --context-len"),
    (["bench", "--columns", "decode_tok"], "did you mean decode_tok_s"),
    (["run", "--columns", "speedup"], "did you mean speedup_vs_ar"),
    (["run", "--decoder", "magicdek"], "did you mean magicdec"),
    (["run", "--decoder", "magicdec", "--decoder-arg", "gama=3"], "did you mean gamma"),
    (["run", "--task", "neadle"], "did you mean needle"),
    (["simulate", "--context-len", "zz"], "--context-len"),
    (["simulate", "--batch-size", "0"], "--batch-size"),
    (["bench", "--json", "missing-dir/out.json"], "does not exist"),
    (["generate", "--prompts", "p.jsonl", "--out", "missing-dir/out.jsonl"], "does not exist"),
    (["generate", "--prompts", "p.jsonl", "--out", "store.db"], "refusing to overwrite"),
    (["generate", "--prompts", "p.jsonl", "--out", "sub"], "is a directory"),
    (["runs", "--limit", "0"], "--limit"),
    (["run", "--rope-scaling", "yarn"], "write TYPE:FACTOR"),
    (["run", "--rope-scaling", "yarn:1"], "above 1"),
    (["bench", "--rope-scaling", "ntk:2"], "unknown scaling type 'ntk'"),
    (["bench", "--rope-scaling", "yarn:x2"], "above 1"),
    (["bench", "--rope-scaling", "llama3:8"], "sweep file"),
]


# --- the store: reads never write, never trace back ---------------------------------------------------

STORE_CASES = [
    (["runs", "--store", "notes.txt"], "not a SQLite database"),
    (["runs", "--store", "other.db"], "not an aspire-bench results store"),
    (["runs", "--store", "sub"], "is a directory"),
    (["runs", "--store", "absent.db"], "no results store"),
    (["show", "1", "--store", "truncated.db"], "store"),
    (["export", "--store", "truncated.db"], "store"),
    (["runs", "--store", "half-page.db"], "truncated"),
    (["show", "7", "--store", "store.db"], "no run 7"),
    (["export", "--store", "store.db", "--out", "store.db"], "store itself"),
    (["export", "--store", "store.db", "--format", "csv", "--out", "other.db"], "refusing to overwrite"),
    (["run", "--store", "notes.txt", "--max-new-tokens", "1"], "not a SQLite database"),
    (["run", "--store", "other.db", "--max-new-tokens", "1"], "not an aspire-bench results store"),
    (["run", "--store", "sub", "--max-new-tokens", "1"], "is a directory"),
    (["run", "--task", "needle", "--data", "notes.txt"], "reads no --data"),
    (["run", "--decoder", "vegas", "--decoder-arg", "gamma=abc"], "gamma"),
    (["run", "--decoder", "aspire", "--decoder-arg", "refresh=maybe"], "refresh"),
    (["run", "--decoder-arg", "nokey"], "key=value"),
]


@pytest.mark.parametrize("args, needle", ARG_CASES + STORE_CASES, ids=[" ".join(a) for a, _ in ARG_CASES + STORE_CASES])
def test_bad_arguments_stores_and_settings_are_refused(cli, work, args, needle):
    before = snapshot(work)
    assert_refused(cli(*args, cwd=work), needle)
    assert snapshot(work) == before


def test_store_text_prints_literally_and_unknown_fields_are_kept(cli, work):
    with closing(sqlite3.connect(work / "store.db")) as c:  # a newer writer's request field
        c.execute("UPDATE requests SET data = json_set(data, '$.newer_field', 7)")
        c.commit()
    before = snapshot(work)
    listed = cli("runs", "--store", "store.db", "--columns", "all", cwd=work)
    shown = cli("show", "1", "--store", "store.db", cwd=work)
    exported = cli("export", "--store", "store.db", "--format", "records", cwd=work)
    for res in (listed, shown, exported):
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert "[/oops]" in listed.stdout and "/m/[red]x" in listed.stdout
    assert "[/oops]" in shown.stdout
    assert json.loads(exported.stdout)["requests"][0]["extra"]["newer_field"] == 7
    assert snapshot(work) == before  # reads never write (no tables, no WAL switch)


def test_reading_another_database_leaves_it_alone(cli, work):
    # The hash check of the cases above covers the file; this also checks no -wal/-shm files appear.
    cli("runs", "--store", "other.db", cwd=work)
    with closing(sqlite3.connect(work / "other.db")) as c:
        assert [r[0] for r in c.execute("SELECT name FROM sqlite_master")] == ["contacts"]
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


# --- sweep files -------------------------------------------------------------------------------------

SWEEPS = {  # more in tests/test_sweep.py and the fuzzing in tests/test_validation.py
    "batch_sizes: [abc]": "batch_sizes[0]",
    "repeats: many": "repeats",
    'parity: "false"': "parity",
    "sampling: {temperature: -1}": "temperature",
}


@pytest.mark.parametrize("line", list(SWEEPS))
def test_bad_sweep_values_are_refused(cli, work, line):
    (work / "s.yaml").write_text(f"models: [tiny]\ndecoders: [ar]\ntasks: [needle]\n{line}\n")
    before = snapshot(work)
    assert_refused(cli("sweep", "s.yaml", "--dry-run", cwd=work), SWEEPS[line])
    assert snapshot(work) == before


# --- gate: exit 2 for anything malformed or mismatched, 1 only for a regression --------------------------

def _baseline(entries) -> dict:
    return {"format": "aspire-bench-gate-baseline", "version": 1, "entries": entries}


GOOD_ENTRY = {"key": "tiny · needle · 4k · aspire [batch_size=4]", "mean_accepted_len": 3.0}
BASELINES = {
    "array": [GOOD_ENTRY],
    "string metric": _baseline([{**GOOD_ENTRY, "mean_accepted_len": "3"}]),
    "string tolerance": {**_baseline([GOOD_ENTRY]), "tolerances": {"speedup": "0.1"}},
    "entry without key": _baseline([{"mean_accepted_len": 3.0}]),
    "no entries": _baseline([]),
    "all metrics null": _baseline([{"key": GOOD_ENTRY["key"], "mean_accepted_len": None}]),
    "another model": _baseline([{**GOOD_ENTRY, "key": "other · needle · 4k · aspire"}]),
}


@pytest.mark.parametrize("name", list(BASELINES))
def test_gate_malformed_or_mismatched_baseline_exits_2(cli, work, name):
    (work / "b.json").write_text(json.dumps(BASELINES[name]))
    before = snapshot(work)
    assert_refused(cli("gate", "--baseline", "b.json", "--store", "store.db", "--allow-missing", cwd=work))
    assert snapshot(work) == before


def test_gate_bad_store_exits_2(cli, work):
    (work / "b.json").write_text(json.dumps(_baseline([GOOD_ENTRY])))
    for store in ("notes.txt", "other.db", "truncated.db", "sub"):
        assert_refused(cli("gate", "--baseline", "b.json", "--store", store, cwd=work))


# --- checkpoints and prompts (load the tiny model at most) -------------------------------------------------

def _broken_model(d: Path, how: str) -> Path:
    m = d / f"model-{how.replace(' ', '-')}"
    shutil.copytree(bundled_checkpoint("tiny"), m)
    cfg = json.loads((m / "config.json").read_text())
    if how == "truncated weights":
        data = (m / "model.safetensors").read_bytes()
        (m / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "missing key":
        del cfg["num_attention_heads"]
    elif how == "wrong shapes":
        cfg["intermediate_size"] += 8
    (m / "config.json").write_text(json.dumps(cfg))
    return m


@pytest.mark.parametrize("how, needle", [("truncated weights", "truncated or corrupt"),
                                         ("missing key", "num_attention_heads"),
                                         ("wrong shapes", "has shape")])
def test_broken_checkpoints_are_refused(cli, work, how, needle):
    model = _broken_model(work, how)
    (work / "p.jsonl").write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
    before = snapshot(work)
    assert_refused(cli("generate", "--model", model, "--prompts", "p.jsonl", "--out", "o.jsonl",
                       "--attention-backend", "torch", cwd=work), needle)
    assert snapshot(work) == before


@pytest.mark.parametrize("content, needle", [  # the reader's other cases: tests/test_validation.py
    ("", "no prompts"),
    ("\n   \n", "no prompts"),
    ('[1, 2]\n', "expected a JSON object"),
    ('"text"\n', "expected a JSON object"),
    ('{"input_ids": "12"}\n', "list of integer token ids"),
    ('{"input_ids": [1, 99999999]}\n', "outside the vocabulary"),
])
def test_bad_prompt_files_are_refused(cli, work, content, needle):
    (work / "p.jsonl").write_text(content)
    before = snapshot(work)
    assert_refused(cli("generate", "--prompts", "p.jsonl", "--out", "o.jsonl", "--attention-backend", "torch",
                       cwd=work), needle)
    assert snapshot(work) == before
