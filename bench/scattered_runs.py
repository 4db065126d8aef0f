"""What a draft's page set costs by how its pages lie: the measurement behind engine.SCATTERED_HEAD.

    python bench/scattered_runs.py --context 16384 --runs 1,2,4,8,16 --repeats 30 --threads 2

Times a forward of `--batch` ASPIRE draft rows (the page budget's older pages, then the 8 most recent
ones; the refresh layer full, its page scores captured) whose older pages come in runs of exactly k
consecutive pages, the same number of pages for every k, over random KV. Kinds are timed in a fresh
random order every round, each after an untimed forward of the same rows and a read of twice the
last-level cache (as in decoding, the step finds neither its KV nor the weights in cache). Prints per
k the median time, its excess over the longest runs as a share of the single pages' excess, and
that share as the engine's count of scattered positions has it (kv_sparse, the first SCATTERED_HEAD
positions of every run). Run it alone.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from aspire_bench.decoders.selection import MIN_PAGES, PAGE_RATIO, RECENT_PAGES, page_budget
from aspire_bench.engine import PAGE_MAX_SUM, Capture, Engine, PageView, Row
from aspire_bench.engine.loading import random_model
from aspire_bench.harness.step_costs import Cell, timed_cold
from aspire_bench.tinymodel import TINY_DIR


def pages_in_runs(n_pages: int, older: int, k: int, rng: random.Random) -> torch.Tensor:
    """`older` pages in runs of k (at random places, apart) before the RECENT_PAGES most recent."""
    blocks = (n_pages - RECENT_PAGES) // (k + 1)  # a run and a gap, so that runs never touch
    starts = sorted(rng.sample(range(blocks), older // k))
    pages = [s * (k + 1) + j for s in starts for j in range(k)]
    return torch.tensor(pages + list(range(n_pages - RECENT_PAGES, n_pages)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--runs", default="1,2,4,8,16", help="run lengths in pages; each must divide the budget's older pages")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = json.loads((TINY_DIR / "config.json").read_text())
    engine = Engine(random_model(cfg, "float32", "cpu", a.seed), None, "cpu")
    refresh = cfg["num_hidden_layers"] - 2
    n_pages = a.context // engine.page_size
    older = page_budget(n_pages, PAGE_RATIO, MIN_PAGES) - RECENT_PAGES
    ks = [int(k) for k in a.runs.split(",")]
    if any(older % k for k in ks):
        print(f"error: every run length must divide the {older} older pages of the budget at {a.context}", file=sys.stderr)
        return 2
    slots = Cell(engine, a.context, a.batch, 0, a.seed).slots  # random KV, one slot per row
    rng = random.Random(a.seed)

    def rows(k: int) -> list[Row]:
        return [Row(s, [5], a.context, view=PageView(pages_in_runs(n_pages, older, k, rng)),
                    full_layers=frozenset({refresh}), capture=Capture((refresh,), (0,), PAGE_MAX_SUM)) for s in slots]

    med, outs = timed_cold(engine, rows, ks, a.repeats, rng)
    sparse = {k: statistics.mean(out.kv_sparse) for k, out in outs.items()}
    lo, hi = ks[0], ks[-1]
    print(f"{a.batch} draft rows at {a.context}: {older} older pages in runs of k, {RECENT_PAGES} recent; "
          f"{a.threads} threads, median of {a.repeats}")
    print(f"| run of k pages | ms | excess over k = {hi}, share of k = {lo}'s | as kv_sparse counts it | kv_sparse per row |")
    print("|---:|---:|---:|---:|---:|")
    for k in ks:
        measured = (med[k] - med[hi]) / (med[lo] - med[hi]) if med[lo] != med[hi] else float("nan")
        counted = (sparse[k] - sparse[hi]) / (sparse[lo] - sparse[hi]) if sparse[lo] != sparse[hi] else float("nan")
        print(f"| {k} | {med[k] * 1e3:.2f} | {measured:.2f} | {counted:.2f} | {sparse[k]:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
