"""The dense part of a forward alone: B rows of n tokens at position 0 (no KV to read), per dense backend.

A weights-only forward is the per-step floor of every decoder: norms, RoPE, projections, MLP, LM head
and one attention call per layer over a single key. This times it with each dense backend on the
bundled model's shape (random weights: the work does not depend on them), median of --repeats.

Usage:
  OMP_NUM_THREADS=2 python bench/dense_forward.py --tokens 8,56 --threads 2 --repeats 200
  OMP_NUM_THREADS=1 python bench/dense_forward.py --threads 1 --clock cpu   # on a shared machine
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from aspire_bench.engine import Engine, Row
from aspire_bench.engine.loading import random_model
from aspire_bench.tinymodel import TINY_DIR


class NullAttention:
    """Attention that returns its queries: leaves only the dense work in a forward (--attention-backend null)."""
    name = "null"

    def attend(self, layer, q, k_cache, v_cache, meta):
        return q.clone(), {}


def time_forward(engine: Engine, tokens: int, batch: int, repeats: int, clock=time.perf_counter) -> float:
    """Median ms of one forward of `batch` rows sharing `tokens` tokens (as evenly as they split), by
    `clock` (wall, or process CPU time: at one thread, robust to other jobs on a shared machine)."""
    per = [tokens // batch + (i < tokens % batch) for i in range(batch)]
    per = [n for n in per if n]
    engine.reserve(len(per) * max(per) + 64 * len(per))
    slots = [engine.alloc(max(per) + 16) for _ in per]

    def step():
        rows = []
        for s, n in zip(slots, per):
            s.length = 0
            rows.append(Row(s, [5] * n, 0, logits="all" if n > 1 else "last"))
        engine.forward(rows)

    for _ in range(5):
        step()
    ts = []
    for _ in range(repeats):
        t0 = clock()
        step()
        ts.append(clock() - t0)
    for s in slots:
        engine.free(s)
    return statistics.median(ts) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="8,56", help="comma-separated token counts per forward")
    ap.add_argument("--batch", type=int, default=8, help="rows the tokens are split over")
    ap.add_argument("--dense", default="eager,fused,cpp", help="dense backends to time")
    ap.add_argument("--attention-backend", default="auto", help="auto | torch | cpu | null (no attention: "
                    "the dense work alone)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall clock, or process CPU time (meaningful at --threads 1 on a loaded machine)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = json.loads((TINY_DIR / "config.json").read_text())
    model = random_model(cfg, "float32", "cpu", 0)
    out = {}
    for dense in a.dense.split(","):
        null = a.attention_backend == "null"
        engine = Engine(model, None, "torch" if null else a.attention_backend, dense_backend=dense)
        if null:
            engine.backend = NullAttention()
        for n in (int(t) for t in a.tokens.split(",")):
            ms = time_forward(engine, n, a.batch, a.repeats, time.process_time if a.clock == "cpu" else time.perf_counter)
            out.setdefault(dense, {})[n] = ms
            print(f"{dense:6s} {n:4d} tokens  {ms:7.3f} ms", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"threads": torch.get_num_threads(), "clock": a.clock, "ms": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
