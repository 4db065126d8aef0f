"""The "projected" page: runs predicted by `aspire-bench simulate`, apart from the leaderboard.

Simulated runs are never ranked with measured ones. This page lists them per simulation (group),
with each speedup over the AR run of the same simulation and cell, and the paper's published
speedup beside it where the cell is one of the paper's (Qwen3 shapes at its context buckets). The
acceptance column tells a projection with the paper's α from one with measured acceptance.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from aspire_bench.harness.records import RunRecord
from aspire_bench.report.html import cell, esc, page, table
from aspire_bench.simulator.paper import paper_speedup

HEADERS = ("model", "step costs", "context", "batch", "decoder", "acceptance", "simulated tok/s", "× AR",
           "paper × AR", "TPOT p50 ms", "mean accepted len", "source")


def _costs(sim: dict) -> str:
    if sim.get("cost_model") == "roofline":
        return f"roofline: {sim['hardware']['name']}"
    return f"calibration ({sim.get('source')})"


def _acceptance(sim: dict) -> str:
    if sim.get("acceptance") == "parametric":
        return "α " + ", ".join(f"{a:.3f}" for _, a in sim.get("alpha_by_context") or [])
    if sim.get("acceptance") == "measured":
        lo, hi = sim["alpha_per_request_range"]
        return (f"measured, run {', '.join(map(str, sim['source_runs']))}: α {sim['alpha_pooled']:.3f} "
                f"({lo:.2f}–{hi:.2f} per request)")
    return sim.get("acceptance") or "—"


def rows_of(runs: Sequence[RunRecord]) -> list[list[str]]:
    def key(r):  # one cell of one simulation: AR there is the reference
        return (r.group, r.config.get("model"), _costs(r.config.get("simulated") or {}), r.config.get("context_len"),
                r.config.get("batch_size"))
    cells = defaultdict(dict)  # cell -> decoder -> tok/s
    for r in runs:
        cells[key(r)][r.config.get("decoder")] = r.aggregates.get("decode_tok_s")
    out = []
    for r in runs:
        sim, c = r.config.get("simulated") or {}, r.config
        tok, ar = r.aggregates.get("decode_tok_s"), cells[key(r)].get("ar")
        shape = str(c.get("model"))
        tpot = r.aggregates.get("tpot_p50_s")
        out.append([cell(shape), cell(_costs(sim)), cell(c.get("context_len"), "d"), cell(c.get("batch_size"), "d"),
                    cell(c.get("decoder")), cell(_acceptance(sim)), cell(tok, ".1f"),
                    cell(tok / ar if tok and ar else None, ".2f"),
                    cell(paper_speedup(shape, c.get("decoder"), c.get("context_len")), ".2f"),
                    cell(tpot * 1e3 if tpot else None, ".2f"), cell(r.aggregates.get("mean_accepted_len"), ".2f"),
                    cell(f"run {sim['source_run']}" if sim.get("source_run") else "parametric")])
    return out


def render_projected(runs: Sequence[RunRecord], meta: str) -> str:
    intro = ("<p class=\"note\">Predictions of <code>aspire-bench simulate</code>, not measurements: each row "
             "replays a decoder's scheduling with a step-cost model (this machine's calibration, or a roofline "
             "of a hardware profile and a model shape) and an acceptance model. They are never ranked with "
             "measured runs. The assumptions of each simulation are stored with its runs "
             "(<code>aspire-bench show RUN_ID</code>).</p>")
    if not runs:
        return page("Projected (simulated) runs", intro + "<p>No simulated runs in this store.</p>", meta=meta)
    by_group = defaultdict(list)
    for r in runs:
        by_group[r.group].append(r)
    parts = [intro]
    for group, rs in by_group.items():
        parts.append(f"<h2>simulation {esc(group)} · {esc(rs[0].created_at)}</h2>")
        parts.append(table(HEADERS, rows_of(rs)))
    return page("Projected (simulated) runs", "".join(parts), meta=meta)
