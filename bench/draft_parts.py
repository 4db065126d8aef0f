"""What an ASPIRE draft step is made of, each part as a share of an AR step at the same context.

    python bench/draft_parts.py --context 16384 --batch 8 --repeats 20 --threads 2 [--json PATH]

Times forwards of `--batch` single-token rows over random KV, each kind adding one part of ASPIRE's
draft to the one before:

  weights       a token at position 0: the dense work and the step's fixed cost, no KV read
  contiguous    the draft's page budget (7% of the pages, at least 32) as one run, every layer
  scattered     the same number of pages as a real draft lays them (random older pages, 8 recent)
  refresh       + the refresh layer (num_layers - 2) reading the whole prefix
  draft         + its page scores captured there: ASPIRE's draft row as decoding runs it
  ar            the whole prefix at every layer (the AR step the shares are of)

Kinds are timed in a fresh random order every round, each after an untimed forward of the same rows
and a read of twice the last-level cache (as in decoding, the step finds neither its KV nor the weights
in cache); medians over the rounds. The parts are the differences of consecutive kinds. Run it alone.
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from aspire_bench.decoders.selection import MIN_PAGES, PAGE_RATIO, page_budget
from aspire_bench.engine import Engine, PageView, Row
from aspire_bench.engine.loading import random_model
from aspire_bench.harness.step_costs import Cell, timed_cold
from aspire_bench.tinymodel import TINY_DIR

KINDS = ("weights", "contiguous", "scattered", "refresh", "draft", "ar")
PARTS = {"weights": "weights and fixed cost", "contiguous": "pages read as one run",
         "scattered": "pages scattered (extra)", "refresh": "refresh layer's full read",
         "draft": "page scores captured"}


def part_rows(cell: Cell, kind: str) -> list[Row]:
    """One row of `kind` (KINDS) per slot of `cell`, the slots reset to the cell's context. weights, ar
    and draft are the step-cost kinds of that name (draft: Cell's "aspire", c_aspire's row)."""
    if kind in ("weights", "ar", "draft"):
        return cell.rows("aspire" if kind == "draft" else kind)
    n_pages = -(-cell.C // cell.engine.page_size)
    one_run = PageView(torch.arange(n_pages - page_budget(n_pages, PAGE_RATIO, MIN_PAGES), n_pages))
    full = frozenset({cell.refresh}) if kind == "refresh" else frozenset()
    for slot in cell.slots:
        slot.length = cell.C
    return [Row(slot, [5], cell.C, view=one_run if kind == "contiguous" else PageView(pages), full_layers=full)
            for slot, pages in zip(cell.slots, cell.pages)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the medians and parts here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = json.loads((TINY_DIR / "config.json").read_text())
    engine = Engine(random_model(cfg, "float32", "cpu", a.seed), None, "cpu")
    cell = Cell(engine, a.context, a.batch, 0, a.seed)  # random KV, one slot per row, a real draft's pages
    med, _ = timed_cold(engine, functools.partial(part_rows, cell), KINDS, a.repeats, random.Random(a.seed))
    ar = med["ar"]
    parts = {k: (med[k] - (med[KINDS[i - 1]] if i else 0.0)) / ar for i, k in enumerate(KINDS[:-1])}
    print(f"{a.batch} ASPIRE draft rows at {a.context}, {a.threads} threads, median of {a.repeats} cold steps; "
          f"AR step {ar * 1e3:.2f} ms")
    print("| part | ms | share of an AR step |")
    print("|---|---:|---:|")
    for k in KINDS[:-1]:
        print(f"| {PARTS[k]} | {parts[k] * ar * 1e3:.2f} | {parts[k]:.3f} |")
    print(f"| the draft step (c) | {med['draft'] * 1e3:.2f} | {med['draft'] / ar:.3f} |")
    if a.json:
        a.json.write_text(json.dumps({"context": a.context, "batch": a.batch, "threads": a.threads,
                                      "repeats": a.repeats, "ms": {k: v * 1e3 for k, v in med.items()},
                                      "share_of_ar": parts, "c": med["draft"] / ar}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
