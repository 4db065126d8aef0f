"""The diagnostics page: `aspire-bench diagnose` results (stored as kind `diagnostic`), never ranked."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from aspire_bench.harness.records import RunRecord
from aspire_bench.harness.store import Store
from aspire_bench.report import plots
from aspire_bench.report.html import cell, esc, mapping_table, page, table

PAGE = "diagnostics.html"
DEFINITIONS = "diagnostics-definitions.html"  # docs/diagnostics.md, when the docs are installed
# Config entries shown in a diagnostic's heading, in this order.
HEADING_KEYS = ("model", "task", "context_len", "decoder", "draft_len", "heads")


def load_diagnostics(store_path: str | Path) -> list[RunRecord]:
    with Store(store_path, readonly=True) as store:
        return [store.get_run(s["run_id"]) for s in store.list_runs(kind="diagnostic", status="ok")]


def _heading(run: RunRecord) -> str:
    c = run.config
    parts = [f"{k} {c[k]}" for k in HEADING_KEYS if c.get(k) is not None]
    return f"#{run.run_id} {c.get('diagnostic', '?')} · " + " · ".join(parts) + f" · {run.created_at}"


def _recall_section(run: RunRecord) -> str:
    rows = run.section("recall", {}).get("rows", [])
    means = plots.mean_recall_rows(rows)
    budgets = list(means)
    preds = list(dict.fromkeys(r["predictor"] for r in rows))
    body = [[cell(p)] + [cell(means[b].get(p), ".3f") for b in budgets] for p in preds]
    slug = f"d{run.run_id}"
    divs = [d for d in (plots.recall_vs_lag(rows, f"lag-{slug}"), plots.recall_vs_source_layer(rows, f"layer-{slug}"))
            if d]
    return (f"<div class=\"plots\">{''.join(divs)}</div>"
            "<p class=\"note\">mass recall@k, mean over layers; the per-layer figures are in the run's JSON "
            "(<code>aspire-bench export --kind diagnostic</code>)</p>"
            + table(["predictor", *(plots.budget_label(u, k) for u, k in budgets)], body, cls="recall"))


def _heterogeneity_section(run: RunRecord) -> str:
    het = run.section("heterogeneity", {})
    reqs, summary, d = het.get("requests", []), het.get("summary", {}), run.config.get("draft_len") or 0
    slug = f"d{run.run_id}"
    divs = [x for x in (plots.accepted_mean_histogram(reqs, d, f"hist-{slug}"),
                        plots.accepted_per_round_box(reqs, d, f"box-{slug}")) if x]
    keys = ("n", "min", "q1", "median", "q3", "max", "mean")
    summary_table = table(["requests" if k == "n" else k for k in keys],
                          [[cell(summary.get(k), ".2f" if k != "n" else "d") for k in keys]], sortable=False,
                          cls="heterogeneity")
    per = table(["request", "prompt", "rounds", "mean", "std", "min", "max"],
                ([cell(r["id"]), cell(r["prompt_len"]), cell(r["rounds"]), cell(r["mean"], ".2f"),
                  cell(r["std"], ".2f"), cell(r["min"]), cell(r["max"])] for r in reqs), cls="requests")
    return (f"<div class=\"plots\">{''.join(divs)}</div><p class=\"note\">accepted drafts per full round of "
            f"D = {d}; across requests, the distribution of the per-request means</p>{summary_table}"
            f"<details><summary>per request</summary>{per}</details>")


def render_diagnostics(runs: Sequence[RunRecord], meta: str, scripts: Sequence[str], with_definitions: bool) -> str:
    defs = f"<a href=\"{DEFINITIONS}\">Definitions</a>" if with_definitions else "Definitions"
    parts = [(f"<p class=\"note\">Measurements of a model rather than rankings of decoders: how well each "
              "sparse view predicts the true attention, and how much accepted draft lengths differ between "
              f"requests. {defs}: docs/diagnostics.md.</p>")]
    if not runs:
        parts.append("<p>No diagnostics in this store: run <code>aspire-bench diagnose recall</code> or "
                     "<code>aspire-bench diagnose heterogeneity</code>.</p>")
    for run in reversed(runs):  # newest first
        kind = run.config.get("diagnostic")
        section = {"recall": _recall_section, "heterogeneity": _heterogeneity_section}.get(kind)
        parts.append(f"<h2 id=\"diag-{run.run_id}\">{esc(_heading(run))}</h2>")
        parts.append(section(run) if section else mapping_table(run.info))
    return page("aspire-bench diagnostics", "".join(parts), meta=meta, scripts=scripts)


def diagnostics_link(runs: Sequence[RunRecord]) -> str:
    return (f"<p class=\"note\"><a href=\"{PAGE}\">Diagnostics</a>: {len(runs)} stored "
            "(attention recall of sparse views, heterogeneity of accepted lengths).</p>") if runs else ""
