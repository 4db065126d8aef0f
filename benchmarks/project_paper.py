"""Project the ASPIRE paper's setting with the simulator, side by side with its published speedups.

    python -m benchmarks.project_paper --json out.json [--store S] [--hardware h100-nvl]
    python -m benchmarks.project_paper --store bench.db --acceptance-from GROUP|RUN_ID,... --hardware h200

Qwen3-1.7B and Qwen3-8B shapes (bf16) on a roofline of the paper's GPU, at the paper's three
long-context buckets (17k, 35k, 90k tokens) and batch 8, 16, 32, 64 (--batch-size); ar, magicdec,
vegas, aspire, the baselines tuned over their gamma grid as bench tunes them (--no-tune: defaults).
Acceptance from the paper's reported figures (aspire_bench/simulator/paper.py) and, with
--acceptance-from, measured per request by stored runs of --store, in columns side by side.
With --store the simulated runs are stored there (kind 'simulated'): `aspire-bench report` shows
them on its "projected" page, never on the leaderboard.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from aspire_bench.errors import UserError
from aspire_bench.simulator import paper
from aspire_bench.simulator.costs import HARDWARE_DIR, Hardware, ModelShape, Roofline
from aspire_bench.simulator.rows import parametric_rows, save

SHAPES = ("qwen3-1.7b", "qwen3-8b")
BATCHES = (8, 16, 32, 64)
DECODERS = ("ar", "magicdec", "vegas", "aspire")


def overhead_source(hardware: str, overhead_us: float | None) -> str:
    """Where the per-step overhead comes from: the option, or the profile's own statement."""
    if overhead_us is not None:
        return "--step-overhead-us"
    path = HARDWARE_DIR / f"{hardware.lower()}.json"
    data = json.loads((path if path.exists() else Path(hardware)).read_text())
    return data.get("_step_overhead_source", "the profile's figure (no source given)")


def project(hardware: str, batches=BATCHES, max_new: int = 256, requests_per_slot: int = 3, measured=None,
            tune: bool = True, overhead_us: float | None = None):
    """Rows of the paper's setting, with the paper's alpha and, given `measured` (a MeasuredAcceptance),
    with it; each row's `acceptance_source` says which."""
    rows, recs = [], []
    hw = Hardware.load(hardware)
    if overhead_us is not None:
        hw = replace(hw, step_overhead_us=overhead_us)
    sources = {"paper": paper.paper_alphas(), **({"measured": measured} if measured else {})}
    for name in SHAPES:
        shape = ModelShape.load(name)
        cost = Roofline(hw, shape)
        for source, table in sources.items():
            for batch in batches:
                r, s = parametric_rows(DECODERS, cost, table, [c for _, c in paper.BUCKETS], [batch],
                                       requests_per_slot * batch, max_new, shape.name, shape.layers, tune=tune)
                for row in r:
                    row["model_shape"], row["hardware"], row["acceptance_source"] = name, hardware, source
                    row["step_overhead_us"] = hw.step_overhead_us
                    row["paper_speedup_vs_ar"] = paper.paper_speedup(name, row["decoder"], row["context"])
                rows += r
                recs += s
    return rows, recs


def table(rows, batches=BATCHES) -> str:
    sources = list(dict.fromkeys(r["acceptance_source"] for r in rows))
    head = "| model | context | decoder | paper × AR | " + " | ".join(
        f"{'paper α' if s == 'paper' else 'measured'}, batch {b}" for s in sources for b in batches) + " |"
    lines = [head, "|---|---|---|---:|" + "---:|" * len(batches) * len(sources)]
    labels = {c: label for label, c in paper.BUCKETS}

    def fmt(r):
        gamma = f" (γ{r['gamma']})" if r.get("tuned") and r.get("gamma") is not None else ""
        return f"{r['simulated_speedup_vs_ar']:.2f}{gamma}"
    for name in SHAPES:
        for _, ctx in paper.BUCKETS:
            for dec in DECODERS[1:]:
                cells = {(r["acceptance_source"], r["batch_size"]): r for r in rows
                         if r["model_shape"] == name and r["context"] == ctx and r["decoder"] == dec}
                p = paper.paper_speedup(name, dec, ctx)
                lines.append(f"| {name} | {labels[ctx]} | {dec} | {p:.2f} | " + " | ".join(
                    fmt(cells[(s, b)]) for s in sources for b in batches) + " |")
    return "\n".join(lines)


def acceptance_lines(rows) -> list[str]:
    out = []
    for r in rows:
        a = r["assumptions"]
        if a.get("acceptance") == "parametric":
            line = f"paper α: {a['draft_kind']} {a['alpha_by_context'][0][1]:.3f} per draft token"
        elif a.get("acceptance") == "measured":
            lo, hi = a["alpha_per_request_range"]
            line = (f"measured: {a['draft_kind']} from run(s) {','.join(map(str, a['source_runs']))} at "
                    f"{'/'.join(map(str, a['measured_contexts']))} tokens, {a['measured_requests']} requests, "
                    f"α {a['alpha_pooled']:.3f} pooled ({lo:.2f}-{hi:.2f} per request)")
        else:
            continue
        if line not in out:
            out.append(line)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="h100-nvl")
    ap.add_argument("--batch-size", default=",".join(map(str, BATCHES)), help="comma-separated (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--store", default=None, help="store the simulated runs here; --acceptance-from reads it")
    ap.add_argument("--acceptance-from", default=None, metavar="RUN_ID,...|GROUP",
                    help="also project with the acceptance these stored runs of --store measured per request")
    ap.add_argument("--no-tune", action="store_true", help="the baselines at their default gamma, untuned")
    ap.add_argument("--step-overhead-us", type=float, default=None,
                    help="per-step overhead of the roofline (default: the hardware profile's)")
    a = ap.parse_args(argv)
    t0 = time.time()
    try:
        batches = [int(b) for b in a.batch_size.split(",") if b]
        if not batches or min(batches) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--batch-size takes positive integers, comma-separated, not {a.batch_size!r}")
    try:
        measured = None
        if a.acceptance_from:
            if not a.store:
                raise UserError("--acceptance-from reads runs of --store: add --store STORE")
            from aspire_bench.harness.store import Store
            from aspire_bench.simulator.source import measured_acceptance
            with Store(a.store, readonly=True) as store:
                measured = measured_acceptance(store, [s for s in a.acceptance_from.split(",") if s])
        rows, recs = project(a.hardware, batches, a.max_new_tokens, measured=measured, tune=not a.no_tune,
                             overhead_us=a.step_overhead_us)
        source = overhead_source(a.hardware, a.step_overhead_us)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"per-step overhead: {rows[0]['step_overhead_us']:g} µs ({source})")
    print("baselines: " + ("tuned over their gamma grid (the best point shown as γN)" if not a.no_tune
                           else "at their default gamma"))
    print("acceptance per draft token: " + "; ".join(acceptance_lines(rows)) + "\n")
    print(table(rows, batches))
    print(f"\n{len(rows)} rows in {time.time() - t0:.0f} s")
    if a.store:
        save(a.store, recs)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
