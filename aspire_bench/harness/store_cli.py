"""CLI commands over the results store: `runs`, `show RUN_ID`, `export`. cli.py adds COMMANDS."""
from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aspire_bench.errors import UserError
from aspire_bench.harness.records import RunRecord, read_jsonl
from aspire_bench.harness.store import DEFAULT_PATH, Store, check_output_path

# Aggregates shown in the `runs` list, the headline figure of each kind: (header, aggregate name).
LIST_FIGURES = (("tok/s", "decode_tok_s"), ("acc len", "mean_accepted_len"), ("parity %", "parity_identical_pct"),
                ("score", "score_mean"))
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

store_option = click.option("--store", "store_path", default=DEFAULT_PATH, show_default=True,
                            envvar="ASPIRE_BENCH_STORE", help="SQLite results store.")


def _open(path: str) -> Store:
    # Read-only: a mistyped path leaves no empty store behind and another database is never altered.
    return Store(path, readonly=True)


def _fmt(value) -> str:
    """A cell's text; escaped, since store text (tags, model paths, errors) is printed literally."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return escape(str(value))


@click.command()
@store_option
@click.option("--decoder", help="Only this decoder.")
@click.option("--model", help="Only this model.")
@click.option("--task", help="Only this task.")
@click.option("--sweep", help="Only this sweep.")
@click.option("--tag", help="Only this tag.")
@click.option("--group", help="Only runs of this group (measured side by side).")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="The newest N runs.")
def runs(store_path, limit, **filters):
    """List the stored runs."""
    with _open(store_path) as store:
        summaries = store.list_runs(limit=limit, **filters)
    table = Table(title=f"runs in {escape(str(store_path))}")
    for header in ("id", "created", "status", "decoder", "model", "task", "sweep/tag", "group"):
        table.add_column(header, overflow="fold")
    for header, _ in LIST_FIGURES:
        table.add_column(header, justify="right")
    for s in summaries:
        label = "/".join(x for x in (s["sweep"], s["tag"]) if x)
        table.add_row(str(s["run_id"]), _fmt(str(s["created_at"])[:16].replace("T", " ")), _fmt(s["status"]),
                      _fmt(s["decoder"]), _fmt(s["model"]), _fmt(s["task"]), _fmt(label or None), _fmt(s["group"]),
                      *(_fmt(s["aggregates"].get(name)) for _, name in LIST_FIGURES))
    Console().print(table)


@click.command()
@click.argument("run_id", type=int)
@store_option
def show(run_id, store_path):
    """Show one run: config, environment, aggregates and its requests."""
    with _open(store_path) as store:
        rec = store.get_run(run_id)
    console = Console()
    console.print(f"[bold]run {rec.run_id}[/] {_fmt(rec.created_at)}  status={_fmt(rec.status)}  "
                  f"config_hash={_fmt(rec.config_hash[:12])}  group={_fmt(rec.group)}  sweep={_fmt(rec.sweep)}  "
                  f"tag={_fmt(rec.tag)}")
    if rec.error:
        console.print(f"[red]error:[/] {_fmt(rec.error)}")
    console.print(_mapping_table("config", rec.config))
    console.print(_mapping_table("environment", rec.env))
    console.print(_mapping_table("aggregates", rec.aggregates))
    console.print(_requests_table(rec))


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


@click.command()
@store_option
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default="jsonl", show_default=True,
              help="jsonl: whole run records; csv: one row per run with its aggregates.")
@click.option("--out", default="-", show_default=True, help="Output file; - is stdout.")
def export(store_path, fmt, out):
    """Export the stored runs."""
    if out != "-":
        if Path(out).exists() and Path(out).resolve() == Path(store_path).resolve():
            raise UserError(f"--out {out} is the store itself: refusing to overwrite it")
        check_output_path(Path(out))
    with _open(store_path) as store:
        n = store.export(fmt, out)
    if out != "-":
        click.echo(f"{n} runs -> {out}", err=True)


@click.command("import")
@click.argument("jsonl", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@store_option
def import_command(jsonl, store_path):
    """Add run records from JSONL (`export`'s format, or a recovery file) to a store."""
    try:
        with open(jsonl) as f:
            recs = read_jsonl(f)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise UserError(f"{jsonl} is not a JSONL file of run records ({type(e).__name__}: {e})") from None
    with Store(store_path) as store:
        ids = [store.save_run(r) for r in recs]
    click.echo(f"imported {len(ids)} run(s) into {store_path}" + (f": ids {ids[0]}..{ids[-1]}" if ids else ""))


COMMANDS = [runs, show, export, import_command]
