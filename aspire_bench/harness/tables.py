"""Terminal summary tables of run records (rich)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .records import RunRecord

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


def percentile_columns(qs) -> list[tuple]:
    """TPOT and ITL at each requested percentile, in ms."""
    return [(f"{name} p{q:g} ms", f"{key}_p{q:g}_s", 1000, "{:.1f}") for name, key in (("TPOT", "tpot"), ("ITL", "itl"))
            for q in qs]


def summary_table(records: list[RunRecord], title: str = "aspire-bench", percentiles=(50, 90, 99)) -> Table:
    """One row per run; speedup is over the AR run of the same group and context, when there is one."""
    ar = {(r.group, r.config.get("context_len")): r.aggregates.get("decode_tok_s")
          for r in records if r.config.get("decoder") == "ar"}
    t = Table(title=title)
    columns = COLUMNS + percentile_columns(percentiles) + TAIL_COLUMNS
    for label in ("decoder", "context", "speedup vs AR", *(c[0] for c in columns)):
        t.add_column(label, justify="left" if label in ("decoder", "context") else "right")
    for r in records:
        a = r.aggregates
        base = ar.get((r.group, r.config.get("context_len")))
        speed = f"{a['decode_tok_s'] / base:.2f}x" if base and a.get("decode_tok_s") else "—"
        cells = ["—" if a.get(name) is None else fmt.format(a[name] * scale) for _, name, scale, fmt in columns]
        t.add_row(str(r.config.get("decoder")), str(r.config.get("context_len") or "—"), speed, *cells)
    return t


def print_summary(records: list[RunRecord], title: str = "aspire-bench", percentiles=(50, 90, 99)) -> None:
    Console().print(summary_table(records, title, percentiles))
