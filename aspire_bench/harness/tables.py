"""Tables for people and for pipes: every command builds a rich Table, `emit` renders it.

On a terminal a table is drawn with rich, no cell ever cut: a table wider than the terminal is drawn
in parts, each repeating the row's key columns (decoder, context, ...). When stdout is a pipe or a
file (CI logs, `| tee`) it is written whole as Markdown. Tables show a compact set of columns by
default; `--columns all` or a comma list of column names chooses others. `--format json` prints
the command's data instead, and progress always goes to stderr, so stdout holds only the result.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

import click
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import UserError, did_you_mean
from .records import RunRecord

FORMATS = ("table", "markdown", "json")

format_option = click.option(
    "--format", "fmt", type=click.Choice(FORMATS), default=None,
    help="table (drawn for a terminal), markdown, or json. Default: table on a terminal, markdown when "
         "stdout is a pipe or a file.")

columns_option = click.option(
    "--columns", default=None, metavar="all|LIST",
    help="Table columns: all, or a comma list of names (an unknown name lists them all). Default: "
         "decoder, context, batch, x AR, decode tok/s, accepted len, acceptance, TPOT p50, parity, score.")

# (column name = aggregate name, header, scale, format)
COLUMNS = [
    ("decode_tok_s", "decode tok/s", 1, "{:,.1f}"),
    ("mean_accepted_len", "accepted len", 1, "{:.2f}"),
    ("draft_acceptance_rate", "acceptance", 1, "{:.1%}"),
    ("tpot_median_s", "TPOT p50 ms", 1000, "{:.1f}"),
    ("parity_identical_pct", "parity %", 1, "{:.1f}"),
    ("score_mean", "score", 1, "{:.3f}"),
    ("e2e_tok_s", "output tok/s", 1, "{:,.1f}"),
    ("total_token_throughput", "total tok/s", 1, "{:,.1f}"),
    ("request_throughput", "req/s", 1, "{:.3f}"),
    ("prefill_wall_s", "prefill s", 1, "{:,.2f}"),
    ("prefill_in_decode_s", "prefill in decode s", 1, "{:,.2f}"),
    ("ttft_mean_s", "TTFT mean ms", 1000, "{:,.1f}"),
    ("tpot_mean_s", "TPOT mean ms", 1000, "{:.1f}"),
    ("itl_mean_s", "ITL mean ms", 1000, "{:.1f}"),
    ("e2e_mean_s", "E2E mean ms", 1000, "{:,.1f}"),
    ("distinct4_mean", "distinct-4", 1, "{:.2f}"),
]
# The compact view: what fits a terminal of 100 columns.
DEFAULT_COLUMNS = ("decoder", "context", "batch", "speedup_vs_ar", "decode_tok_s", "mean_accepted_len",
                   "draft_acceptance_rate", "tpot_median_s", "parity_identical_pct", "score_mean")


def choose_columns(available, spec: str | None, default=DEFAULT_COLUMNS) -> list[str]:
    """The column names a `--columns` value picks from `available` (in `available`'s order for the
    default and `all`, in the given order for a list); an unknown name is a UserError."""
    if not spec:
        return [c for c in available if c in default]
    if spec.strip() == "all":
        return list(available)
    names = [c.strip() for c in spec.split(",") if c.strip()]
    for c in names:
        if c not in available:
            raise UserError(f"--columns: no column {c!r}{did_you_mean(c, available)}; the columns are: "
                            f"{', '.join(available)}")
    return names or list(default)


def examples(*lines: str) -> str:
    """A command's --help epilog: its examples, one command line each (kept as written)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


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
        render(tables, console)


def render(tables: Iterable[Table], console: Console) -> None:
    """Print each table in parts that fit the console's width, so no value is ever cut."""
    for t in tables:
        for part in fit(t, console):
            console.print(part)


def _whole(t: Table) -> list[int]:
    """Each column at least as wide as its longest cell and its header's longest word: a value is never
    wrapped or cut, a header may wrap between words. Folding columns (long free text) are left free to
    wrap. Returns those widths (0 for a folding column)."""
    widths = []
    for c in t.columns:
        if c.overflow == "fold":
            widths.append(0)
            continue
        c.width = max([cell_len(_plain(v)) for v in c.cells] + [cell_len(w) for w in _plain(c.header).split()] + [1])
        widths.append(c.width)
    return widths


def _fits(t: Table, console: Console) -> bool:
    # a box border and a space each side per column, one border at the end
    return sum(_whole(t)) + 3 * len(t.columns) + 1 <= console.width


def fit(t: Table, console: Console) -> list[Table]:
    """`t` as one table when it fits the console's width, else as parts of consecutive columns, each
    repeating the first `t.key_columns` columns (what names a row). A part too wide even so drops the
    key columns that are the same in every row, then others from the front. Folding columns (long
    free text) wrap inside their width instead."""
    if _fits(t, console) or len(t.columns) < 2:
        return [t]
    n_keys = getattr(t, "key_columns", 1)
    keys = list(range(n_keys))
    parts, current = [], []
    for i in range(n_keys, len(t.columns)):
        if current and not _fits(_subtable(t, [*keys, *current, i], False), console):
            parts.append(current)
            current = []
        current.append(i)
    parts.append(current)
    out = []
    for n, cols in enumerate(parts):
        shown = list(keys)
        constant = [k for k in keys if len({_plain(v) for v in t.columns[k].cells}) <= 1]
        drop = constant + [k for k in keys if k not in constant]
        while drop and not _fits(_subtable(t, [*shown, *cols], n > 0), console):
            shown.remove(drop.pop(0))
        part = _subtable(t, [*shown, *cols], n > 0)
        _whole(part)
        out.append(part)
    return out


def _subtable(t: Table, cols: list[int], continued: bool) -> Table:
    title = t.title if not continued else (f"{t.title} (continued)" if t.title else None)
    sub = Table(title=title, show_header=t.show_header, box=t.box)
    for i in cols:
        c = t.columns[i]
        sub.add_column(c.header, justify=c.justify, overflow=c.overflow, style=c.style)
    cells = [list(c.cells) for c in t.columns]
    for r in range(t.row_count):
        sub.add_row(*(cells[i][r] for i in cols))
    return sub


def percentile_columns(qs) -> list[tuple]:
    """TPOT and ITL at each requested percentile, in ms."""
    return [(f"{key}_p{q:g}_s", f"{name} p{q:g} ms", 1000, "{:.1f}") for name, key in (("TPOT", "tpot"), ("ITL", "itl"))
            for q in qs]


def speedup_cell(a: dict, base: float | None = None) -> str:
    """'SPEEDUPx [LOW, HIGH]': a stored speedup over AR with its interval, else over `base` tok/s."""
    x = a.get("speedup_vs_ar")
    if x is None and base and a.get("decode_tok_s"):
        x = a["decode_tok_s"] / base
    if x is None:
        return "—"
    lo, hi = a.get("speedup_vs_ar_ci95_low"), a.get("speedup_vs_ar_ci95_high")
    return f"{x:.2f}x [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else f"{x:.2f}x"


def summary_table(records: list[RunRecord], title: str = "aspire-bench",
                  baselines: Iterable[RunRecord] = (), percentiles=(50, 90, 99), columns: str | None = None) -> Table:
    """One row per run; speedup is the run's own (`run --parity`), else over the AR run of the same group,
    context and batch size when there is one among `records` or `baselines` (AR runs not shown, e.g.
    stored earlier in the group). `columns`: a --columns value (None: the compact view)."""
    ar = {_ar_key(r): r.aggregates.get("decode_tok_s") for r in (*baselines, *records)
          if r.config.get("decoder") == "ar" and r.group is not None}
    # TPOT p50 is the compact view's median column already
    figures = {c[0]: c for c in COLUMNS + percentile_columns(percentiles) if c[0] != "tpot_p50_s"}
    interleaved = any(r.aggregates.get("prefill_in_decode_s") for r in records)
    default = DEFAULT_COLUMNS + (("prefill_wall_s",) if interleaved else ())  # prefill apart where it interleaved
    cells = {
        "decoder": ("decoder", lambda r, a: Text(str(r.config.get("decoder")))),
        "context": ("context", lambda r, a: Text(str(r.config.get("context_len") or "—"))),
        "batch": ("batch", lambda r, a: str(r.config.get("batch_size", "—"))),
        "speedup_vs_ar": ("× AR", lambda r, a: speedup_cell(a, ar.get(_ar_key(r)))),
        **{k: (head, lambda r, a, k=k, scale=scale, f=f: "—" if a.get(k) is None else f.format(a[k] * scale))
           for k, (_, head, scale, f) in figures.items()},
    }
    names = choose_columns(list(cells), columns, default)
    t = Table(title=title)
    t.key_columns = sum(1 for c in names[:3] if c in ("decoder", "context", "batch"))
    for name in names:
        t.add_column(cells[name][0], justify="left" if name in ("decoder", "context") else "right")
    for r in records:
        # Text, not markup: config values come from the store and are shown literally.
        t.add_row(*(cells[name][1](r, r.aggregates) for name in names))
    return t


def _ar_key(r: RunRecord) -> tuple:
    return (r.group, r.config.get("context_len"), r.config.get("batch_size"))


def summary_json(records: list[RunRecord]) -> list[dict]:
    """The JSON form of summary tables: each run's id, group, config and aggregates."""
    return [{"run_id": r.run_id, "group": r.group, "status": r.status, "config": r.config,
             "aggregates": r.aggregates} for r in records]


def print_summary(records: list[RunRecord], title: str = "aspire-bench", fmt: str | None = None,
                  baselines: Iterable[RunRecord] = (), percentiles=(50, 90, 99), columns: str | None = None) -> None:
    emit(summary_table(records, title, baselines, percentiles, columns), fmt, data=summary_json(records))


def print_sweep_summary(recs: list[RunRecord], name: str, fmt: str | None = None, columns: str | None = None) -> None:
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
                                                  f"max_new {max_new or 'default'}, {sampling}, seed {seed}"),
                                 columns=columns))
    emit(out, fmt, data=summary_json(recs))
