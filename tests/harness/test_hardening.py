"""Nothing lost, nothing doubled: the promises of docs/failures.md tried as a user or a CI job meets them
(faults mid-work, a full filesystem, odd paths, two processes at once, hostile files, environment
variables). Each command runs in its own process (the `cli` fixture: a fork of a server that imported
torch once) and is judged by exit status, one line of stderr, files unchanged by hash and stored run counts.
"""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
from forkcli import ROOT
from test_failures import assert_refused, record, snapshot

from aspire_bench.harness.store import Store


@pytest.fixture
def work(tmp_path):
    """A store of three runs (two groups, so the gate has AR references), a prompts file, a record
    export of the store and a sweep file of two one-token cells."""
    d = tmp_path / "w"
    d.mkdir()
    with Store(d / "store.db") as s:
        for dec, group in (("ar", "g1"), ("aspire", "g1"), ("ar", "g2")):
            rec = record(group=group)
            rec.config["decoder"] = dec
            s.save_run(rec)
    (d / "p.jsonl").write_text('{"id": "a", "prompt": "def f():"}\n')
    (d / "sweep.yaml").write_text("models: [tiny]\ndecoders: [ar, magicdec]\ntasks: [needle]\ncontexts: [1k]\n"
                                  "batch_sizes: [1]\nmax_new_tokens: [2]\nlimit: 1\nwarmup: false\n")
    return d


def runs_in(store: Path) -> int:
    if not store.exists():
        return 0
    with closing(sqlite3.connect(store)) as c:
        return c.execute("SELECT count(*) FROM runs").fetchone()[0]


def export_records(cli, d: Path, name: str = "recs.jsonl") -> Path:
    assert cli("export", "--format", "records", "--store", "store.db", "--out", name, cwd=d).returncode == 0
    return d / name


# --- 1. every file written atomically, never over an input, never deleting what it did not make ----------


def test_generate_never_writes_over_its_prompts_nor_an_earlier_partial(cli, work):
    before = snapshot(work)
    assert_refused(cli("generate", "--prompts", "p.jsonl", "--out", "p.jsonl", cwd=work), "--prompts file")
    os.link(work / "p.jsonl", work / "hard.jsonl")  # the same inode under another name
    assert_refused(cli("generate", "--prompts", "p.jsonl", "--out", "hard.jsonl", cwd=work), "--prompts file")
    (work / "hard.jsonl").unlink()
    assert snapshot(work) == before
    (work / "o.jsonl.partial").write_text('{"id": "a", "output_ids": [1]}\n')  # an interrupted run's rows
    before = snapshot(work)
    assert_refused(cli("generate", "--prompts", "p.jsonl", "--out", "o.jsonl", cwd=work), "o.jsonl.partial exists")
    assert snapshot(work) == before


def test_export_keeps_a_users_tmp_file_and_a_failed_write_leaves_no_trace(cli, work):
    (work / "results.csv.tmp").write_text("mine\n")
    (work / "results.csv").write_text("old\n")
    res = cli("export", "--format", "csv", "--store", "store.db", "--out", "results.csv", cwd=work)
    assert res.returncode == 0, res.stderr
    assert (work / "results.csv.tmp").read_text() == "mine\n"
    assert (work / "results.csv").read_text().count("\n") == 4  # header + 3 runs
    assert not [p for p in work.iterdir() if p.name.startswith(".results")]  # no temporary left behind
    before = snapshot(work)
    assert_refused(cli("bench", "--store", "new.db", "--json", "new.db", cwd=work), "--store file")
    assert_refused(cli("import", "store.db", "--store", "store.db", cwd=work), "the store itself")
    assert snapshot(work) == before


def test_generate_interrupted_says_where_its_rows_are(tmp_path):
    from aspire_bench.cli import _keep_partial
    partial = tmp_path / "o.jsonl.partial"
    with pytest.raises(KeyboardInterrupt, match=f"the 1 row\\(s\\) finished so far are in {partial}"), \
            _keep_partial(partial) as f:
        f.write("{}\n")
        f.rows += 1
        raise KeyboardInterrupt
    assert partial.read_text() == "{}\n"
    empty = tmp_path / "e.jsonl.partial"
    with pytest.raises(KeyboardInterrupt, match="no row had finished"), _keep_partial(empty):
        raise KeyboardInterrupt
    assert not empty.exists()  # ours and empty: removed


@pytest.fixture
def full_fs(tmp_path):
    """A 64 KiB tmpfs filled to the last block (root only), unmounted afterwards."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a full filesystem needs `mount -t tmpfs` as root; this machine runs the tests as a user")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=False,
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not allowed here ({res.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _fill(d: Path) -> None:
    fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 512):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def test_a_full_filesystem_never_truncates_a_baseline_or_an_export(cli, work, full_fs):
    baseline, out = full_fs / "baseline.json", full_fs / "results.jsonl"
    assert cli("gate", "--update", "--baseline", baseline, "--store", "store.db", "--group", "g1",
               cwd=work).returncode == 0
    out.write_text("previous export\n")
    _fill(full_fs)
    before = snapshot(full_fs)
    # the new baseline (made from all runs) is larger than the free space: the old one must survive whole
    res = cli("gate", "--update", "--baseline", baseline, "--store", "store.db", "--run", "1", "--run", "2",
              "--run", "3", cwd=work)
    assert_refused(res, "No space left")
    res = cli("export", "--format", "records", "--store", "store.db", "--out", out, cwd=work)
    assert res.returncode == 2 and "No space left" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert snapshot(full_fs) == before  # no truncated file, no temporary left behind
    json.loads(baseline.read_text())


# --- 2. every check before compute -------------------------------------------------------------------------


def test_store_paths_that_could_not_be_saved_to_are_refused_before_compute(cli, work):
    long = "a" * 250 + ".db"
    before = snapshot(work)
    assert_refused(cli("run", "--store", long, "--limit", "1", cwd=work), "file name is 253 bytes")
    res = cli("run", "--store", "/dev/null", "--limit", "1", cwd=work)
    assert_refused(res, "not a regular file")
    assert not Path("/dev/null-journal").exists()
    assert_refused(cli("runs", "--store", "/dev/null", cwd=work), "not a regular file")
    assert snapshot(work) == before


def test_sizes_are_bounded_with_the_bound_in_the_message(cli, work):
    before = snapshot(work)
    assert_refused(cli("run", "--limit", str(10**30), cwd=work), "100000")
    assert_refused(cli("simulate", "--batch", str(10**11), "--model-shape", "qwen3-1.7b", "--hardware", "h100",
                       "--no-save", cwd=work), "16,384")
    assert_refused(cli("bench", "--batch-sizes", "1,99999999", cwd=work), "16,384")
    assert snapshot(work) == before


def test_api_arguments_are_checked_before_the_measurement(tmp_path, monkeypatch):
    import aspire_bench
    from aspire_bench.errors import ConfigError
    from aspire_bench.harness import runner

    def never(*a, **k):
        raise AssertionError("the run started before its arguments were checked")
    monkeypatch.setattr(runner, "prepare", never)
    for bad in ((150,), (), (50, 50), ("p90",)):
        with pytest.raises(ConfigError, match="percentile"):
            aspire_bench.run(store=str(tmp_path / "s.db"), percentiles=bad)
    from aspire_bench.harness.schema import check_run_settings
    with pytest.raises(ConfigError, match="limit: Input should be less than or equal to 100000"):
        check_run_settings(runner.RunConfig(limit=10**30).identity())  # what prepare() checks first
    assert not (tmp_path / "s.db").exists()


# --- 3. idempotent and concurrent-safe ------------------------------------------------------------------------


def test_import_is_all_or_nothing_and_skips_what_is_stored(cli, work):
    recs = export_records(cli, work)
    res = cli("import", recs, "--store", "new.db", cwd=work)
    assert res.returncode == 0 and "imported 3 run(s)" in res.stdout, res.stderr
    res = cli("import", recs, "--store", "new.db", cwd=work)
    assert res.returncode == 0 and "imported 0 run(s)" in res.stdout and "skipped 3 already stored" in res.stdout
    assert runs_in(work / "new.db") == 3
    lines = recs.read_text().splitlines()
    bad = json.loads(lines[1])
    bad["aggregates"]["decode_tok_s"] = "fast"  # the wrong type, on the second record
    first = json.loads(lines[0])
    first["tag"] = "new"
    (work / "mixed.jsonl").write_text(json.dumps(first) + "\n" + json.dumps(bad) + "\n")
    (work / "cut.jsonl").write_text(json.dumps(first) + "\n" + lines[1][: len(lines[1]) // 2] + "\n")
    before = snapshot(work)
    assert_refused(cli("import", "mixed.jsonl", "--store", "new.db", cwd=work), "record 2", "aggregate 'decode_tok_s'",
                   "nothing was imported")
    assert_refused(cli("import", "cut.jsonl", "--store", "new.db", cwd=work), "cut.jsonl:2", "nothing was imported")
    assert runs_in(work / "new.db") == 3 and snapshot(work) == before


def test_duplicate_values_and_keys_are_refused(cli, work):
    before = snapshot(work)
    assert_refused(cli("bench", "--sampling", "greedy,0:0:1", "--store", "store.db", cwd=work), "twice")
    assert_refused(cli("bench", "--contexts", "1k,1k", cwd=work), "twice")
    (work / "dupkey.yaml").write_text((work / "sweep.yaml").read_text() + "limit: 2\n")
    (work / "duplist.yaml").write_text((work / "sweep.yaml").read_text().replace("[1]", "[1, 1]"))
    before = snapshot(work)
    assert_refused(cli("sweep", "dupkey.yaml", "--dry-run", cwd=work), "key 'limit' is given twice")
    assert_refused(cli("sweep", "duplist.yaml", "--dry-run", cwd=work), "batch_sizes", "listed twice")
    assert snapshot(work) == before and runs_in(work / "store.db") == 3


def test_two_concurrent_resumers_run_each_cell_once(work):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASPIRE_BENCH_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NO_COLOR="1",
               ASPIRE_BENCH_CALIBRATION_DIR=os.environ.get("ASPIRE_BENCH_CALIBRATION_DIR", str(work)))
    cmd = [sys.executable, "-m", "aspire_bench.cli", "--threads", "1", "sweep", "sweep.yaml", "--resume",
           "--store", "sw.db"]
    procs = [subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert runs_in(work / "sw.db") == 2  # two cells, each stored once
    with Store(work / "sw.db", readonly=True) as s:
        assert len({r["config_hash"] for r in s.list_runs()}) == 2
    assert not [p for p in work.iterdir() if p.name.endswith(".lock")]  # the lock file went with its maker


# --- 4. a damaged store degrades ------------------------------------------------------------------------------


def _damage(store: Path, run_id: int) -> None:
    with closing(sqlite3.connect(store)) as c:
        c.execute("UPDATE runs SET config = substr(config, 1, 20) WHERE run_id = ?", (run_id,))
        c.commit()


def test_read_commands_skip_a_damaged_row_with_one_warning(cli, work):
    _damage(work / "store.db", 2)
    before = snapshot(work)
    for args in (["runs"], ["export", "--format", "csv"], ["export", "--format", "records"]):
        res = cli(*args, "--store", "store.db", cwd=work)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.count("warning: skipping run 2 of store.db") == 1 and len(res.stderr.splitlines()) == 1
    assert len(cli("export", "--format", "records", "--store", "store.db", cwd=work).stdout.splitlines()) == 2
    assert_refused(cli("show", "2", "--store", "store.db", cwd=work), "run 2", "damaged")
    assert snapshot(work) == before
    res = cli("gate", "--update", "--baseline", "b.json", "--store", "store.db", cwd=work)
    assert res.returncode == 0 and res.stderr.count("skipping run 2") == 1, res.stdout + res.stderr
    res = cli("report", "--store", "store.db", "--out", "board", cwd=work)
    assert res.returncode == 0 and res.stderr.count("skipping run 2") == 1, res.stderr
    assert (work / "board" / "index.html").exists()


def test_check_lists_damaged_rows(cli, work):
    res = cli("check", "--store", "store.db", cwd=work)
    assert res.returncode == 0 and "3 runs, all readable" in res.stdout
    _damage(work / "store.db", 3)
    with closing(sqlite3.connect(work / "store.db")) as c:
        c.execute("UPDATE requests SET data = '{\"x\": ' WHERE run_id = 1")
        c.commit()
    res = cli("check", "--store", "store.db", cwd=work)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "run 1: requests data not valid JSON" in res.stdout and "run 3: runs config not valid JSON" in res.stdout
    assert "2 of 3 runs damaged" in res.stdout


# --- 5. settings range-checked where declared -----------------------------------------------------------------


def test_decoder_settings_are_range_checked(cli, work):
    (work / "empty.json").write_text("[]")
    (work / "nan.json").write_text('{"beta0": NaN, "beta_tok": 1e-4, "beta_attn": 1e-8, "r2": 0.9}')
    before = snapshot(work)
    base = ["run", "--task", "needle", "--context-len", "1k", "--limit", "1", "--store", "store.db",
            "--decoder", "aspire", "--decoder-arg"]
    assert_refused(cli(*base, "refresh_layer=99", cwd=work), "refresh_layer=99", "16 layers")
    assert_refused(cli(*base, f"d_max={2**70}", cwd=work), "d_max", "2147483647")
    assert_refused(cli(*base, "ratio=nan", cwd=work), "ratio", "finite")
    assert_refused(cli(*base, "calibration=empty.json", cwd=work), "empty.json is not a calibration")
    assert_refused(cli(*base, "calibration=nan.json", cwd=work), "beta0 must be a finite number")
    assert snapshot(work) == before and runs_in(work / "store.db") == 3


def test_train_tiny_validates_like_the_other_commands(cli, work):
    for args, needle in ((["--threads", "0"], "--threads 0"), (["--steps", "0"], "--steps 0"),
                         (["--steps", "-3"], "--steps -3"), (["--quick", "--steps", "5", "--checkpoint-every", "2"],
                                                           "--quick sets its own --checkpoint-every, --steps")):
        assert_refused(cli("train-tiny", "--out", "t", *args, cwd=work), needle)
    import torch
    (work / "t").mkdir()
    torch.save({"settings": {"max_steps": 3}, "seed": 0}, work / "t" / "checkpoint.pt")
    before = snapshot(work)
    assert_refused(cli("train-tiny", "--out", "t", "--steps", "10", "--checkpoint-every", "5", cwd=work),
                   "other settings or seed")
    assert snapshot(work) == before


# --- 6. messages name what the user set -------------------------------------------------------------------------


def test_environment_variables_are_named_with_their_values(cli, work):
    res = cli("runs", "--store", "store.db", cwd=work, env={"ASPIRE_BENCH_THREADS": "0"})
    assert_refused(res, "ASPIRE_BENCH_THREADS='0'")
    assert "--threads" not in res.stderr
    res = cli("run", "--task", "needle", "--context-len", "1k", "--limit", "1", "--store", "new.db", cwd=work,
              env={"ASPIRE_BENCH_DENSE": "turbo"})
    assert_refused(res, "ASPIRE_BENCH_DENSE='turbo'")
    assert not (work / "new.db").exists()


def test_generate_suggests_only_its_own_fixes_and_reads_u2028(cli, work):
    res = cli("generate", "--prompts", "p.jsonl", "--out", "o.jsonl", "--max-new-tokens", "41000", cwd=work)
    assert_refused(res, "--max-new-tokens", "maximum context")
    assert "--context-len" not in res.stderr and not (work / "o.jsonl.partial").exists()
    (work / "u.jsonl").write_text(json.dumps({"id": "a", "prompt": "x\u2028y = 1"}, ensure_ascii=False) + "\n",
                                  encoding="utf-8")
    res = cli("--threads", "1", "generate", "--prompts", "u.jsonl", "--out", "o.jsonl", "--max-new-tokens", "1",
              cwd=work)
    assert res.returncode == 0, res.stderr
    assert [json.loads(x)["id"] for x in (work / "o.jsonl").read_text().split("\n") if x] == ["a"]


def test_runs_with_stdout_closed_exits_quietly(cli, work):
    res = cli("runs", "--store", "store.db", cwd=work, close_stdout=True)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    before = snapshot(work)
    res = cli("export", "--store", "store.db", cwd=work, close_stdout=True)
    assert res.returncode == 0 and snapshot(work) == before  # the descriptor never became the store
