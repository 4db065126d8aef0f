"""CLI commands over the results store: `runs`, `show RUN_ID`, `export`. cli.py adds COMMANDS."""
from __future__ import annotations

import json
import math
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from aspire_bench.atomic import atomic_open
from aspire_bench.errors import UserError
from aspire_bench.harness.records import RUN_KINDS, RunRecord, read_jsonl
from aspire_bench.harness.store import DEFAULT_PATH, Store, check_output_path, check_store_file
from aspire_bench.harness.tables import (
    COLUMNS,
    DEFAULT_COLUMNS,
    choose_columns,
    columns_option,
    emit,
    examples,
    format_option,
    resolve_format,
    speedup_cell,
)

# Columns of the `runs` list besides the figures of tables.COLUMNS: (name, header, frame column).
RUN_COLUMNS = (("id", "id", "run_id"), ("created", "created", "created_at"), ("status", "status", "status"),
               ("kind", "kind", "kind"), ("decoder", "decoder", "decoder"), ("model", "model", "model"),
               ("task", "task", "task"), ("context", "context", "context_len"), ("batch", "batch", "batch_size"),
               ("sweep", "sweep/tag", None), ("group", "group", "group"))
# Per-request columns of `show`: (header, how to get it from a RequestRow).
REQUEST_COLUMNS = (
    ("id", lambda r: r.id),
    ("prompt", lambda r: r.prompt_len),
    ("out", lambda r: len(r.output_ids)),
    ("finish", lambda r: r.finish_reason),
    ("score", lambda r: r.score),
    ("ttft s", lambda r: r.figures.get("ttft_s")),
    ("tpot s", lambda r: r.figures.get("tpot_s")),
    ("acc len", lambda r: r.figures.get("mean_accepted_len")),
    ("dist4", lambda r: r.figures.get("distinct4")),
    ("parity", lambda r: (r.parity or {}).get("kind")),
)

def _store_from_env(ctx, param, value):
    """A store path set by $ASPIRE_BENCH_STORE is refused naming the variable, not an option never given."""
    from click.core import ParameterSource
    if ctx.get_parameter_source(param.name) == ParameterSource.ENVIRONMENT:
        try:
            check_store_file(Path(value))
        except UserError as e:
            raise UserError(f"ASPIRE_BENCH_STORE={value!r}: {str(e).replace(f'--store {value} ', '')}; fix or unset "
                            "the variable") from None
    return value


# The one --store of every command: a file path, ./aspire_results.db unless ASPIRE_BENCH_STORE says otherwise.
STORE_TYPE = click.Path(dir_okay=False)
store_option = click.option("--store", "store_path", default=DEFAULT_PATH, show_default=True, type=STORE_TYPE,
                            envvar="ASPIRE_BENCH_STORE", callback=_store_from_env,
                            help="SQLite results store (env: ASPIRE_BENCH_STORE).")


def _open(path: str) -> Store:
    # Read-only: a mistyped path leaves no empty store behind and another database is never altered.
    return Store(path, readonly=True)


def _fmt(value) -> str:
    """A cell's text; escaped, since store text (tags, model paths, errors) is printed literally."""
    if not _given(value):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return escape(str(value))


def filter_options(f):
    """--decoder/--model/--task/--sweep/--tag/--group/--kind: which stored runs a read command takes."""
    f = click.option("--kind", type=click.Choice(RUN_KINDS),
                     help="Only runs of this kind (measured, simulated by `simulate`, or `diagnose` results).")(f)
    for name, what in reversed([("decoder", "this decoder"), ("model", "this model"), ("task", "this task"),
                                ("sweep", "this sweep"), ("tag", "this tag"),
                                ("group", "runs of this group (measured side by side)")]):
        f = click.option(f"--{name}", help=f"Only {what}.")(f)
    return f


@click.command(epilog=examples("aspire-bench runs --decoder aspire --limit 10",
                               "aspire-bench runs --columns all --format markdown"))
@store_option
@filter_options
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="The newest N runs.")
@columns_option
@format_option
def runs(store_path, limit, columns, fmt, **filters):
    """List the stored runs."""
    from aspire_bench.harness.frames import results
    with _open(store_path) as store:
        frame = results(store, **filters).tail(limit)
    if resolve_format(fmt) == "json":
        emit([], fmt, data=json.loads(frame.to_json(orient="records")))
        return
    cells = {name: (head, lambda s, col=col: _fmt(s.get(col))) for name, head, col in RUN_COLUMNS}
    cells["created"] = ("created", lambda s: _fmt(str(s["created_at"])[:16].replace("T", " ")))
    cells["sweep"] = ("sweep/tag", lambda s: _fmt("/".join(str(x) for x in (s["sweep"], s["tag"]) if _given(x)) or None))
    # over the AR run of the same group, context and batch size when the run has no speedup of its own
    ar = {(s["group"], s.get("context_len"), s.get("batch_size")): s.get("decode_tok_s")
          for s in frame.to_dict("records") if s["decoder"] == "ar" and _given(s["group"])}
    cells["speedup_vs_ar"] = ("× AR", lambda s: "1" if s["decoder"] == "ar" and _given(s["group"]) else speedup_cell(
        {k: v for k, v in s.items() if _given(v)}, ar.get((s["group"], s.get("context_len"), s.get("batch_size")))))
    for key, head, scale, f in COLUMNS:
        cells[key] = (head, lambda s, key=key, scale=scale, f=f: f.format(s[key] * scale) if _given(s.get(key)) else "-")
    names = choose_columns(list(cells), columns, ("id", *DEFAULT_COLUMNS))
    table = Table(title=f"runs in {escape(str(store_path))}")
    table.key_columns = 1 if names[0] == "id" else 0
    for name in names:
        table.add_column(cells[name][0], justify="right" if name not in ("created", "status", "kind", "decoder",
                                                                          "model", "task", "context", "sweep",
                                                                          "group") else "left")
    for s in frame.to_dict("records"):
        table.add_row(*(cells[name][1](s) for name in names))
    emit(table, fmt)


def _given(value) -> bool:
    """Not None and not NaN (pandas fills absent values with NaN)."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


@click.command(epilog=examples("aspire-bench show 3", "aspire-bench show 3 --format json"))
@click.argument("run_id", type=int)
@store_option
@columns_option
@format_option
def show(run_id, store_path, columns, fmt):
    """Show one run: its summary row, config, environment, aggregates and its requests (json: the whole
    record but its step trace)."""
    from aspire_bench.harness.tables import summary_table
    with _open(store_path) as store:
        rec = store.get_run(run_id)
    run = {"run": rec.run_id, "created": rec.created_at, "status": rec.status, "kind": rec.kind,
           "config_hash": rec.config_hash,
           "group": rec.group, "sweep": rec.sweep, "tag": rec.tag, **({"error": rec.error} if rec.error else {})}
    data = {k: v for k, v in rec.to_json().items() if k != "steps"}
    # Every cell goes through _fmt (escaped): store text is shown literally, never as markup.
    head = [summary_table([rec], f"run {rec.run_id}", columns=columns)] if rec.status == "ok" else []
    emit([*head, _mapping_table(f"run {rec.run_id}", run), _mapping_table("config", rec.config),
          _mapping_table("environment", rec.env), _mapping_table("aggregates", rec.aggregates),
          _requests_table(rec)], fmt, data=data)


def _mapping_table(title: str, data: dict) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("name", style="bold")
    table.add_column("value", overflow="fold")
    for k, v in data.items():
        table.add_row(_fmt(k), _fmt(json.dumps(v, default=str)) if isinstance(v, (dict, list)) else _fmt(v))
    return table


def _requests_table(rec: RunRecord) -> Table:
    table = Table(title=f"{len(rec.requests)} requests")
    for header, _ in REQUEST_COLUMNS:
        table.add_column(header)
    for r in rec.requests:
        table.add_row(*(_fmt(get(r)) for _, get in REQUEST_COLUMNS))
    return table


@click.command(epilog=examples("aspire-bench export --format csv --out runs.csv",
                               "aspire-bench export --format records --decoder aspire > aspire.jsonl"))
@store_option
@click.option("--format", "fmt", type=click.Choice(["csv", "jsonl", "parquet", "records"]), default="jsonl",
              show_default=True, help="csv, jsonl, parquet (needs pyarrow): one row per run, its config "
              "flattened and its aggregates (aspire_bench.results); records: whole run records as JSONL "
              "(requests and step traces included).")
@click.option("--requests", "per_request", is_flag=True,
              help="One row per request instead of per run (aspire_bench.request_results).")
@click.option("--out", default="-", show_default=True, help="Output file; - is stdout (not for parquet).")
@filter_options
def export(store_path, fmt, per_request, out, **filters):
    """Export the stored runs (or their requests) for analysis elsewhere."""
    import sys

    from aspire_bench.harness.frames import request_results, results, write_frame
    if fmt == "parquet" and out == "-":
        raise UserError("parquet is binary: give a file with --out PATH")
    if fmt == "records" and per_request:
        raise UserError("--requests has the formats csv, jsonl and parquet: records are whole runs already")
    if out != "-":
        if Path(out).exists() and Path(out).resolve() == Path(store_path).resolve():
            raise UserError(f"--out {out} is the store itself: refusing to overwrite it")
        check_output_path(Path(out))  # never a directory or a SQLite file (another store)
    with _open(store_path) as store:
        if fmt == "records":
            n = store.export("jsonl", out, **filters)
        else:
            frame = (request_results if per_request else results)(store, **filters)
            try:
                if out == "-":
                    write_frame(frame, fmt, sys.stdout)
                else:  # written beside and renamed: a failed export never leaves a half-written file
                    with atomic_open(out, "wb" if fmt == "parquet" else "w", newline="") as f:
                        write_frame(frame, fmt, f)
            except ImportError as e:
                raise UserError(str(e)) from None
            n = len(frame)
    if out != "-":
        click.echo(f"{n} {'requests' if per_request else 'runs'} -> {out}", err=True)


@click.command("import", epilog=examples("aspire-bench import aspire.jsonl --store other.db"))
@click.argument("jsonl", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@store_option
def import_command(jsonl, store_path):
    """Add run records from JSONL (`export --format records`, or a recovery file) to a store."""
    from aspire_bench.atomic import same_file
    if Path(store_path).exists() and same_file(jsonl, store_path):
        raise UserError(f"{jsonl} is the store itself: pass the JSONL file to import")
    recs = []
    try:
        with open(jsonl, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):  # lines split at newlines only (a raw U+2028 is valid JSON)
                try:
                    recs += read_jsonl([line])
                except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError) as e:
                    raise UserError(f"{jsonl}:{n} is not a run record ({type(e).__name__}: {_one_line(e)}); "
                                    "nothing was imported") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{jsonl} is not UTF-8 text ({e.reason}); nothing was imported") from None
    with Store(store_path) as store:
        try:
            ids, skipped = store.import_runs(recs, str(jsonl))  # one transaction: all records or none
        except UserError as e:
            raise UserError(f"{e}; nothing was imported") from None
    click.echo(f"imported {len(ids)} run(s) into {store_path}" + (f": ids {ids[0]}..{ids[-1]}" if ids else "")
               + (f"; skipped {skipped} already stored" if skipped else ""))


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:200]


@click.command("check", epilog=examples("aspire-bench check", "aspire-bench check --store results.db"))
@store_option
def check_command(store_path):
    """Check a store: SQLite's own integrity check and every run's stored JSON. Lists the damaged runs
    (which read commands skip); exit 1 when there are any."""
    with _open(store_path) as store:
        problems = [f"database: {row[0]}" for row in store.conn.execute("PRAGMA quick_check") if row[0] != "ok"]
        bad = store.damaged()
        n = store.conn.execute("SELECT count(*) FROM runs").fetchone()[0]
    for run_id, what in bad.items():
        click.echo(f"run {run_id}: {what}")
    for p in problems:
        click.echo(p)
    if bad or problems:
        click.echo(f"{store_path}: {len(bad)} of {n} runs damaged" + (f", {len(problems)} database problem(s)"
                   if problems else "") + "; read commands skip damaged runs (export the others with "
                   "`aspire-bench export --format records` and import them into a new store)")
        raise SystemExit(1)
    click.echo(f"{store_path}: {n} runs, all readable")


COMMANDS = [runs, show, export, import_command, check_command]
