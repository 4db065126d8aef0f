"""Project the ASPIRE paper's setting with the simulator, side by side with its published speedups.

    python -m benchmarks.project_paper --json out.json [--store projected.db] [--hardware h100-nvl]

Qwen3-1.7B and Qwen3-8B shapes (bf16) on a roofline of the paper's GPU, at the paper's three
long-context buckets (17k, 35k, 90k tokens) and batch 8, 16, 32, 64; ar, magicdec, vegas, aspire at
their defaults; acceptance from the paper's reported figures (aspire_bench/simulator/paper.py).
With --store the simulated runs are stored (kind 'simulated'): `aspire-bench report` shows them on
its "projected" page, never on the leaderboard.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from aspire_bench.simulator import paper
from aspire_bench.simulator.costs import Hardware, ModelShape, Roofline
from aspire_bench.simulator.rows import parametric_rows, save

SHAPES = ("qwen3-1.7b", "qwen3-8b")
BATCHES = (8, 16, 32, 64)
DECODERS = ("ar", "magicdec", "vegas", "aspire")


def project(hardware: str, batches=BATCHES, max_new: int = 256, requests_per_slot: int = 3):
    rows, recs = [], []
    table = paper.paper_alphas()
    for name in SHAPES:
        shape = ModelShape.load(name)
        cost = Roofline(Hardware.load(hardware), shape)
        for batch in batches:
            r, s = parametric_rows(DECODERS, cost, table, [c for _, c in paper.BUCKETS], [batch],
                                   requests_per_slot * batch, max_new, shape.name, shape.layers)
            for row in r:
                row["model_shape"], row["hardware"] = name, hardware
                row["paper_speedup_vs_ar"] = paper.paper_speedup(name, row["decoder"], row["context"])
            rows += r
            recs += s
    return rows, recs


def table(rows, batches=BATCHES) -> str:
    head = "| model | context | decoder | paper × AR | " + " | ".join(f"projected × AR, batch {b}" for b in batches) + " |"
    lines = [head, "|---|---|---|---:|" + "---:|" * len(batches)]
    labels = {c: label for label, c in paper.BUCKETS}
    for name in SHAPES:
        for _, ctx in paper.BUCKETS:
            for dec in DECODERS[1:]:
                cells = {r["batch_size"]: r for r in rows
                         if r["model_shape"] == name and r["context"] == ctx and r["decoder"] == dec}
                p = paper.paper_speedup(name, dec, ctx)
                lines.append(f"| {name} | {labels[ctx]} | {dec} | {p:.2f} | " + " | ".join(
                    f"{cells[b]['simulated_speedup_vs_ar']:.2f}" for b in batches) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="h100-nvl")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--store", default=None)
    a = ap.parse_args(argv)
    t0 = time.time()
    rows, recs = project(a.hardware, max_new=a.max_new_tokens)
    alphas = {k: round(v[0][1], 4) for k, v in paper.paper_alphas().items()}
    print(f"acceptance alpha per draft token (from the paper's reported rates): {alphas}\n")
    print(table(rows))
    print(f"\n{len(rows)} simulations in {time.time() - t0:.0f} s")
    if a.store:
        save(a.store, recs)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
