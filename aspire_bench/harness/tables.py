"""Tables for people and for pipes: every command builds a rich Table, `emit` renders it.

On a terminal a table is drawn with rich; when stdout is a pipe or a file (CI logs, `| tee`) it is
written whole as Markdown, never cut to the terminal's width. `--format json` prints the command's
data instead, and progress always goes to stderr, so stdout holds only the result.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .records import RunRecord

FORMATS = ("table", "markdown", "json")

format_option = click.option(
    "--format", "fmt", type=click.Choice(FORMATS), default=None,
    help="table (drawn for a terminal), markdown, or json. Default: table on a terminal, markdown when "
         "stdout is a pipe or a file.")

# (column, aggregate name, scale, format)
COLUMNS = [
    ("decode tok/s", "decode_tok_s", 1, "{:,.1f}"),
    ("output tok/s", "e2e_tok_s", 1, "{:,.1f}"),
    ("total tok/s", "total_token_throughput", 1, "{:,.1f}"),
    ("req/s", "request_throughput", 1, "{:.3f}"),
    ("accepted len", "mean_accepted_len", 1, "{:.2f}"),
    ("draft acc.", "draft_acceptance_rate", 1, "{:.1%}"),
    ("TTFT mean ms", "ttft_mean_s", 1000, "{:,.1f}"),
    ("TPOT mean ms", "tpot_mean_s", 1000, "{:.1f}"),
    ("TPOT median ms", "tpot_median_s", 1000, "{:.1f}"),
    ("ITL mean ms", "itl_mean_s", 1000, "{:.1f}"),
    ("E2E mean ms", "e2e_mean_s", 1000, "{:,.1f}"),
]
TAIL_COLUMNS = [
    ("score", "score_mean", 1, "{:.3f}"),
    ("distinct-4", "distinct4_mean", 1, "{:.2f}"),
    ("parity %", "parity_identical_pct", 1, "{:.1f}"),
]


def resolve_format(fmt: str | None, stream=None) -> str:
    stream = stream or sys.stdout
    return fmt or ("table" if stream.isatty() else "markdown")


def info(message: str, fmt: str | None) -> None:
    """A status line ("stored run 3 in ..."): stdout beside tables, stderr beside JSON so stdout parses."""
    click.echo(message, err=resolve_format(fmt) == "json")


def _plain(cell) -> str:
    if isinstance(cell, Text):
        return cell.plain
    return Text.from_markup(str(cell)).plain if isinstance(cell, str) else str(cell)


def table_data(table: Table) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of a rich Table, as plain text."""
    headers = [_plain(c.header) for c in table.columns]
    columns = [[_plain(v) for v in c.cells] for c in table.columns]
    return headers, [list(r) for r in zip(*columns)] if columns else []


def to_markdown(table: Table) -> str:
    """A GitHub-flavoured Markdown table (title as a bold line above it); cells are never truncated."""
    headers, rows = table_data(table)

    def line(cells):
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    align = ["---:" if c.justify == "right" else "---" for c in table.columns]
    out = [f"**{_plain(table.title)}**", ""] if table.title else []
    if headers and table.show_header:
        out += [line(headers), line(align)]
    elif headers:  # a key/value table without header: Markdown needs one
        out += [line([""] * len(headers)), line(align)]
    out += [line(r) for r in rows]
    return "\n".join(out) + "\n"


def emit(tables: Table | Iterable[Table], fmt: str | None, data=None) -> None:
    """Print tables as `fmt` says (None: table on a terminal, markdown otherwise); for json print
    `data` (default: each table's rows as objects keyed by header)."""
    tables = [tables] if isinstance(tables, Table) else list(tables)
    fmt = resolve_format(fmt)
    if fmt == "json":
        if data is None:
            data = []
            for t in tables:
                headers, rows = table_data(t)
                data.append({"title": _plain(t.title or ""), "rows": [dict(zip(headers, r)) for r in rows]})
        click.echo(json.dumps(data, indent=1, default=str))
    elif fmt == "markdown":
        click.echo("\n".join(to_markdown(t) for t in tables), nl=False)
    else:
        # Not a terminal but a table asked for: wide enough that nothing is cut.
        console = Console() if sys.stdout.isatty() else Console(width=10_000, soft_wrap=True)
        for t in tables:
            console.print(t)


def percentile_columns(qs) -> list[tuple]:
    """TPOT and ITL at each requested percentile, in ms."""
    return [(f"{name} p{q:g} ms", f"{key}_p{q:g}_s", 1000, "{:.1f}") for name, key in (("TPOT", "tpot"), ("ITL", "itl"))
            for q in qs]


def summary_table(records: list[RunRecord], title: str = "aspire-bench",
                  baselines: Iterable[RunRecord] = (), percentiles=(50, 90, 99)) -> Table:
    """One row per run; speedup is over the AR run of the same group, context and batch size, when
    there is one among `records` or `baselines` (AR runs not shown, e.g. stored earlier in the group)."""
    ar = {_ar_key(r): r.aggregates.get("decode_tok_s") for r in (*baselines, *records)
          if r.config.get("decoder") == "ar" and r.group is not None}
    t = Table(title=title)
    columns = COLUMNS + percentile_columns(percentiles) + TAIL_COLUMNS
    for label in ("decoder", "context", "batch", "speedup vs AR", *(c[0] for c in columns)):
        t.add_column(label, justify="left" if label in ("decoder", "context") else "right")
    for r in records:
        a = r.aggregates
        base = ar.get(_ar_key(r))
        speed = f"{a['decode_tok_s'] / base:.2f}x" if base and a.get("decode_tok_s") else "—"
        cells = ["—" if a.get(name) is None else fmt.format(a[name] * scale) for _, name, scale, fmt in columns]
        # Text, not markup: config values come from the store and are shown literally.
        t.add_row(Text(str(r.config.get("decoder"))), Text(str(r.config.get("context_len") or "—")),
                  str(r.config.get("batch_size", "—")), speed, *cells)
    return t


def _ar_key(r: RunRecord) -> tuple:
    return (r.group, r.config.get("context_len"), r.config.get("batch_size"))


def summary_json(records: list[RunRecord]) -> list[dict]:
    """The JSON form of summary tables: each run's id, group, config and aggregates."""
    return [{"run_id": r.run_id, "group": r.group, "status": r.status, "config": r.config,
             "aggregates": r.aggregates} for r in records]


def print_summary(records: list[RunRecord], title: str = "aspire-bench", fmt: str | None = None,
                  baselines: Iterable[RunRecord] = (), percentiles=(50, 90, 99)) -> None:
    emit(summary_table(records, title, baselines, percentiles), fmt, data=summary_json(records))


def print_sweep_summary(recs: list[RunRecord], name: str, fmt: str | None = None) -> None:
    """One table per model, task, batch size and sampling (context and decoder are its rows); json: every
    run of the sweep, failed ones included."""
    tables: dict[tuple, list[RunRecord]] = {}
    for r in recs:
        if r.status == "ok":
            c = r.config
            key = (c["model"], c["task"], c["batch_size"], c["max_new_tokens"], c["temperature"], c["top_k"],
                   c["top_p"], c["seed"])
            tables.setdefault(key, []).append(r)
    from rich.markup import escape
    out = []
    for (model, task, batch, max_new, temp, top_k, top_p, seed), rs in tables.items():
        sampling = "greedy" if temp == 0 else f"T={temp} top-k={top_k} top-p={top_p}"
        # escaped: names from the sweep file are printed literally, never as markup
        out.append(summary_table(rs, title=escape(f"{name}: {task} on {Path(model).name}, batch {batch}, "
                                                  f"max_new {max_new or 'default'}, {sampling}, seed {seed}")))
    emit(out, fmt, data=summary_json(recs))
