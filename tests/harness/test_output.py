"""Output for people and for pipes: table/markdown/json, whole tables when piped, progress on stderr,
pandas frames of the store and exports built on them."""
from __future__ import annotations

import io
import json

import pandas as pd
import pytest
from click.testing import CliRunner
from rich.table import Table
from test_store import make_record

import aspire_bench
from aspire_bench.harness import tables
from aspire_bench.harness.store import Store
from aspire_bench.harness.store_cli import COMMANDS
from aspire_bench.progress import TokenProgress

CMD = {c.name: c for c in COMMANDS}


def cli(*args, **env):
    from aspire_bench.cli import main
    return CliRunner(env=env).invoke(main, list(args))


@pytest.fixture()
def store(tmp_path):
    path = str(tmp_path / "r.db")
    with Store(path) as s:
        for i, dec in enumerate(("ar", "aspire", "magicdec")):
            rec = make_record(i, dec, tag="nightly", group="g1")
            rec.config.update(decoder=dec, decoder_args={"gamma": 3}, context_len="16k", batch_size=8,
                              temperature=0.0)
            rec.aggregates["decode_tok_s"] = 100.0 * (i + 1)
            s.save_run(rec)
    return path


def test_results_frame_one_row_per_run(store):
    df = aspire_bench.results(store)
    assert list(df["run_id"]) == [1, 2, 3] and list(df["decoder"]) == ["ar", "aspire", "magicdec"]
    assert list(df["decode_tok_s"]) == [100.0, 200.0, 300.0]
    assert set(df["context_len"]) == {"16k"} and list(df["seed"]) == [0, 1, 2]
    assert (df["decoder_args.gamma"] == 3).all()  # nested config flattened
    assert list(aspire_bench.results(store, decoder="aspire")["run_id"]) == [2]
    with pytest.raises(TypeError, match="colour"):
        aspire_bench.results(store, colour="red")


def test_request_results_frame(store):
    df = aspire_bench.request_results(store, group="g1")
    assert len(df) == 6 and list(df.columns[:5]) == ["run_id", "model", "task", "decoder", "group"]
    first = df[df["run_id"] == 1].set_index("request_id")
    assert first.loc["r0", "n_output"] == 4 and first.loc["r1", "n_output"] == 5
    assert first.loc["r0", "score"] == 1.0 and first.loc["r0", "batch_size"] == 8
    assert first.loc["r0", "parity_kind"] == "near-tie"


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_export_formats_round_trip(store, tmp_path, fmt):
    out = tmp_path / f"runs.{fmt}"
    r = CliRunner().invoke(CMD["export"], ["--store", store, "--format", fmt, "--out", str(out)])
    assert r.exit_code == 0, r.output
    back = {"csv": pd.read_csv, "parquet": pd.read_parquet,
            "jsonl": lambda p: pd.read_json(p, lines=True)}[fmt](out)
    assert list(back["decoder"]) == ["ar", "aspire", "magicdec"]
    assert list(back["decode_tok_s"]) == [100.0, 200.0, 300.0]
    req = tmp_path / f"req.{fmt}"
    r = CliRunner().invoke(CMD["export"], ["--store", store, "--format", fmt, "--requests", "--out", str(req),
                                           "--decoder", "ar"])
    assert r.exit_code == 0, r.output
    assert "2 requests" in r.output


def test_export_records_and_parquet_needs_a_file(store):
    r = CliRunner().invoke(CMD["export"], ["--store", store, "--format", "records"])
    assert r.exit_code == 0 and json.loads(r.output.splitlines()[0])["steps"]
    r = cli("export", "--store", store, "--format", "parquet")
    assert r.exit_code == 2 and "--out" in r.output


def test_piped_tables_print_whole_as_markdown(store):
    # CliRunner's stdout is not a terminal: the default is markdown, whatever the width.
    r = CliRunner(env={"COLUMNS": "40"}).invoke(CMD["runs"], ["--store", store])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    header = next(line for line in lines if line.startswith("| id |"))
    assert "| context | batch |" in header and "…" not in r.output
    assert any(line.startswith("| 2 |") and "| aspire |" in line and "| 16k | 8 |" in line for line in lines)
    wide = CliRunner(env={"COLUMNS": "40"}).invoke(CMD["runs"], ["--store", store, "--format", "table",
                                                               "--columns", "all"])
    assert "…" not in wide.output and "nightly" in wide.output and "16k" in wide.output
    assert "2.00x" in wide.output and "3.00x" in wide.output  # over the group's AR run


def test_json_format_parses(store):
    listed = json.loads(CliRunner().invoke(CMD["runs"], ["--store", store, "--format", "json"]).output)
    assert [x["decoder"] for x in listed] == ["ar", "aspire", "magicdec"]
    shown = json.loads(CliRunner().invoke(CMD["show"], ["2", "--store", store, "--format", "json"]).output)
    assert shown["run_id"] == 2 and len(shown["requests"]) == 2 and "steps" not in shown
    md = CliRunner().invoke(CMD["show"], ["2", "--store", store, "--format", "markdown"]).output
    assert "**aggregates**" in md and "| decode_tok_s | 200 |" in md


def test_markdown_escapes_and_keeps_alignment():
    t = Table(title="[bold]t[/]")
    t.add_column("a")
    t.add_column("n", justify="right")
    t.add_row("x|y", "1.5")
    assert tables.to_markdown(t) == "**t**\n\n| a | n |\n| --- | ---: |\n| x\\|y | 1.5 |\n"


def test_summary_speedup_uses_the_groups_ar_run(store):
    with Store(store) as s:
        recs = [s.get_run(i) for i in (1, 2, 3)]
    t = tables.summary_table([recs[1]], baselines=[recs[0]])
    headers, rows = tables.table_data(t)
    assert rows[0][headers.index("× AR")] == "2.00x" and rows[0][headers.index("batch")] == "8"
    other = make_record(9, "aspire", group="elsewhere")
    assert tables.table_data(tables.summary_table([other], baselines=[recs[0]]))[1][0][3] == "—"


def test_progress_goes_to_stderr(capsys):
    with TokenProgress(10, "decoding") as bar:
        bar.advance(10)
    out, err = capsys.readouterr()
    assert out == "" and "decoding" in err


def test_progress_in_a_log_is_a_line_every_interval_and_one_at_the_end(capsys, monkeypatch):
    """Outside a terminal a redrawn bar shows only when finished: a long prefill would be silent."""
    from aspire_bench import progress
    now = [100.0]
    monkeypatch.setattr(progress, "_clock", lambda: now[0])
    with TokenProgress(16, "prefill") as bar:
        for t in (10, 20, 31, 40, 95):  # seconds since the start at which a request finishes
            now[0] = 100.0 + t
            bar.advance(1)
        now[0] = 100.0 + 130
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["prefill 3/16 0 tok/s 0:00:31", "prefill 5/16 0 tok/s 0:01:35", "prefill 5/16 0 tok/s 0:02:10"]
    with TokenProgress(4, "quiet", disable=True) as bar:
        bar.advance(4)
    assert capsys.readouterr().err == ""


def test_a_long_prefill_beats_the_progress_once_a_chunk(random_tiny):
    """A 32k prompt prefills for minutes before its first token: each chunk calls progress(0), so a
    log's bar (a line every interval) shows it alive; the tokens counted stay the tokens generated."""
    from aspire_bench.decoders import Request, SamplingParams, get_decoder
    from aspire_bench.engine import Engine
    engine = Engine.from_pretrained(str(random_tiny))
    engine.prefill_chunk = 64
    calls = []
    get_decoder("ar").generate(engine, [Request("r", list(range(5, 305)), 3)], SamplingParams(0.0, 0, 1.0, 0, ()), 1,
                               progress=calls.append)
    assert calls[:5] == [0, 0, 0, 0, 1]  # 300 tokens in 5 chunks: a beat after each of the first 4, then a token
    assert sum(calls) == 3 and 0 not in calls[5:]


def test_info_lines_leave_json_stdout_clean(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdout", io.StringIO())  # not a terminal
    tables.info("stored run 1", "json")
    assert "stored run 1" in capsys.readouterr().err


def test_small_cli_things():
    from aspire_bench.cli import TokenCount
    assert TokenCount().convert("4k", None, None) == 4096 and TokenCount().convert("4096", None, None) == 4096
    r = cli("calibrate", "--context-len", "30-40k")
    assert r.exit_code == 2 and "one length" in r.output
    assert "Default: 128." in cli("generate", "--help").output
    assert "auto" in cli("run", "--help").output  # --dtype auto


def test_calibrate_saves_where_a_run_of_its_context_looks(random_tiny):
    """Without --out the fit goes to the cache under the key an aspire run of prompts that long uses."""
    from aspire_bench.decoders.calibration import calibration_context, calibration_path
    from aspire_bench.harness.runner import load_engine
    r = cli("calibrate", "--model", str(random_tiny), "--context-len", "4k", "--batch-size", "2", "--repeats", "1")
    assert r.exit_code == 0, r.output
    engine = load_engine(str(random_tiny), "float32", "cpu", "auto")
    path = calibration_path(engine, 2, calibration_context([4000, 4100], engine, 16))
    assert f"saved {path}" in r.output and json.loads(path.read_text())["context"] == 4096


@pytest.mark.real_calibration
def test_calibrate_reports_and_saves_every_term(random_tiny, tmp_path):
    out = tmp_path / "cal.json"
    r = cli("calibrate", "--model", str(random_tiny), "--context-len", "512", "--batch-size", "2",
            "--repeats", "1", "--out", str(out))
    assert r.exit_code == 0, r.output
    saved = json.loads(out.read_text())
    assert {"beta0", "beta_tok", "beta_attn", "beta_qk", "qk_free", "beta_sparse", "r2", "samples"} <= set(saved)
    assert "ns/KV position read" in r.output and "sparse" in r.output  # the term, or that it is not significant


def _whole_at(tables_, width: int) -> str:
    """The tables rendered for a terminal of `width` columns; asserts every cell's text appears whole."""
    from rich.console import Console
    buf = io.StringIO()
    tables.render(tables_, Console(file=buf, width=width, color_system=None))
    out = buf.getvalue()
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= width
    for t in tables_:
        if all(c.overflow != "fold" for c in t.columns):
            _, rows = tables.table_data(t)
            missing = {cell for row in rows for cell in row if cell not in out}
            assert not missing, (width, missing)
    return out


@pytest.mark.parametrize("width", [80, 100, 120])
def test_every_table_is_whole_at_terminal_widths(store, width, monkeypatch):
    """run/sweep (summary), bench, runs and show, compact and with every column: no value cut or wrapped."""
    from aspire_bench.harness import store_cli
    from aspire_bench.harness.bench import BenchRow, bench_table
    with Store(store) as s:
        recs = [s.get_run(i) for i in (1, 2, 3)]
    recs[1].aggregates.update(speedup_vs_ar=1.0512, speedup_vs_ar_ci95_low=0.981, speedup_vs_ar_ci95_high=1.1034,
                              prefill_in_decode_s=1.5, prefill_wall_s=3.25)
    recs[1].config["decoder"] = "aspire-norefresh"
    for columns in (None, "all"):
        _whole_at([tables.summary_table(recs, "code-completion on tiny", columns=columns)], width)
        rows = [BenchRow("16k", 8, "greedy", r) for r in recs]
        for r in recs:
            r.aggregates.update(decode_tok_s_median=1234.5, decode_tok_s_min=1200.25, decode_tok_s_max=1250.75,
                                req_accepted_len_p0=1.5, req_accepted_len_p100=4.25, n_requests=16, repeats=3)
        rows[1].figures.update(speedup_vs_ar=1.05, speedup_vs_ar_ci95=[0.98, 1.1], speedup_vs_best_baseline=0.97,
                               speedup_vs_best_baseline_ci95=[0.91, 1.02], bound_share=0.82, allowed_speedup=1.31)
        for r in recs:
            r.env["dtype"] = "float32"
        bench = bench_table(rows, 40e9, columns)
        _whole_at([bench], width)
        # the title names what ran: the model and the dtype it ran in, once for rows that share them
        assert " on tiny in float32 (" in bench.title, bench.title
        recs[0].env["dtype"] = "bfloat16"
        assert " on tiny in bfloat16, tiny in float32 (" in bench_table(rows, 40e9, columns).title
        shown = []

        def capture(t, fmt, data=None, shown=shown):
            shown.extend([t] if hasattr(t, "columns") else t)
        monkeypatch.setattr(store_cli, "emit", capture)
        for args in (["runs", "--store", store], ["show", "2", "--store", store]):
            r = CliRunner().invoke(CMD[args[0]], [*args[1:], *(["--columns", columns] if columns else [])])
            assert r.exit_code == 0, r.output
        out = _whole_at(shown, width)
        assert "aspire" in out and "16k" in out


def test_columns_choose_and_refuse_with_a_suggestion():
    assert tables.choose_columns(["a", "b", "c"], None, ("c", "a")) == ["a", "c"]
    assert tables.choose_columns(["a", "b", "c"], "all") == ["a", "b", "c"]
    assert tables.choose_columns(["decode_tok_s", "score_mean"], "score_mean,decode_tok_s") == ["score_mean", "decode_tok_s"]
    with pytest.raises(aspire_bench.errors.UserError, match="did you mean decode_tok_s"):
        tables.choose_columns(["decode_tok_s", "score_mean"], "decode_toks")


def test_python_api_reads_the_clis_default_store_and_speaks_python(store, monkeypatch, tmp_path):
    monkeypatch.setenv("ASPIRE_BENCH_STORE", store)
    assert list(aspire_bench.results()["run_id"]) == [1, 2, 3]  # the store the CLI would use
    with pytest.raises(aspire_bench.errors.StoreError) as e:
        aspire_bench.results(str(tmp_path / "none.db"))
    assert "store=PATH" in str(e.value) and "--store" not in str(e.value)
    with pytest.raises(aspire_bench.errors.ConfigError, match="did you mean context_len"):
        aspire_bench.run(contxt_len="4k", store=None)


def test_every_command_help_ends_with_examples_and_decoders_are_described():
    import click

    from aspire_bench.cli import main

    def walk(group, prefix):
        for name, cmd in group.commands.items():
            yield [*prefix, name]
            if isinstance(cmd, click.Group):
                yield from walk(cmd, [*prefix, name])
    for path in walk(main, []):
        if path[0] in ("lm-eval", "train-tiny"):  # their --help is the wrapped tool's own
            continue
        out = cli(*path, "--help").output
        assert "Examples:" in "\n".join(out.rstrip().splitlines()[-3:]), path  # one or two examples end it
        assert "9223372036854775807" not in out, path
    listed = cli("decoders").output.splitlines()
    assert any(line.startswith("aspire-fixed") and "[ablation]" in line for line in listed)
    assert any(line.startswith("ar ") and "autoregressive" in line for line in listed)
