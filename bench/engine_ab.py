"""Two versions of the compiled CPU attention kernel, timed side by side in whole decode forwards.

    python bench/engine_ab.py --b NEW.cpp [--a OLD.cpp] --context 16384 --batch 8 --threads 2

Where `bench/attention_ab.py` times one layer's kernel call from Python, this times the engine's
forward of a whole step (every layer, the dense part, the logits) with either build of the kernel,
on the step-cost rows of `bench/step_costs.py` (`ar`: one token per row over the whole prefix;
`verifyN`: N drafts and the row's token; `aspire`: ASPIRE's draft row; `window`: MagicDec's). Each
round times every (kind, version) once, in a fresh random order, each forward after an untimed one
of the same rows and a read of twice the last-level cache (as in decoding, neither KV nor weights in
cache). Prints per kind the median time of each version, the median of the per-round ratios B/A with
its quartiles, and the largest difference between their logits. Machine noise that moves both
cancels in the ratio; run it alone.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_ab import add_source_args, backend, sources_exist
from step_costs import make_engine

from aspire_bench.harness.step_costs import Cell, timed_cold_rounds

# the kinds and the drafts each verifies (None: not a verification)
KINDS = {"ar": None, "aspire": None, "window": None, **{f"verify{g}": g for g in range(1, 7)}}


def kind_rows(cell: Cell, kind: str):
    return cell.rows("verify", KINDS[kind]) if KINDS[kind] else cell.rows(kind)


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_source_args(ap)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kinds", default="ar,verify1,verify2,verify3,verify6,aspire,window")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not sources_exist(args.a, args.b):
        return 2
    kinds = args.kinds.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        print(f"error: unknown kind {bad[0]!r}: use ar, aspire, window or verify1 ... verify6", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    engine = make_engine("tiny", "float32", "cpu", "cpu", args.seed, "cpp")
    versions = {"A": backend(args.a, None), "B": backend(args.b, None)}
    cell = Cell(engine, args.context, args.batch, 6, args.seed)

    def rows_of(kind_version):
        kind, version = kind_version
        engine.backend = versions[version]
        return kind_rows(cell, kind)

    times, outs = timed_cold_rounds(engine, rows_of, [(k, v) for k in kinds for v in versions], args.rounds,
                                    random.Random(args.seed))
    print(f"A = {args.a}, B = {args.b}, {args.context} keys x {args.batch} rows, {args.threads} threads, "
          f"{args.rounds} rounds")
    for kind in kinds:
        ta, tb = times[kind, "A"], times[kind, "B"]
        lo, mid, hi = quartiles([b / a for a, b in zip(ta, tb)])
        diff = max((x - y).abs().max().item() for x, y in zip(outs[kind, "A"].logits, outs[kind, "B"].logits))
        print(f"{kind:>8}: A {statistics.median(ta) * 1e3:7.2f} ms  B {statistics.median(tb) * 1e3:7.2f} ms  "
              f"B/A {mid:.3f} [{lo:.3f}, {hi:.3f}]  max |A-B| of the logits {diff:.1e}")
    cell.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
