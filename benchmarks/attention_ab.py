"""Two builds of the CPU attention kernel side by side on one layer's call over a bf16 pool.

    python -m benchmarks.attention_ab --threads 2                          # bf16 dot products vs widening
    python -m benchmarks.attention_ab --baseline-src OLD.cpp --threads 2   # vs another version of the source

B is this checkout's kernel as this machine builds it; A is the same source built without bf16 dot
products (AVX512_BF16), or --baseline-src (e.g. `git show REV:aspire_bench/kernels/csrc/cpu_attention.cpp
> OLD.cpp`, with the vec.h it includes copied beside it). The two are called alternately on the same
inputs (random, SmolLM2-135M's heads by default), so the machine's drifting speed falls on both; each
line is one row shape: its median B/A with the quartiles of the pairs, and the largest difference
between the two outputs. Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from aspire_bench.kernels import cpu_attention, cpu_build
from aspire_bench.kernels.base import AttentionMeta, RowMeta
from aspire_bench.kernels.cpu_attention import CpuAttention


def rows_of(tokens: int, keys: int, batch: int, sparse: float | None, page: int, g: torch.Generator):
    """`batch` rows of `tokens` queries after `keys` keys each, in disjoint slots; a sparse row keeps a
    random `sparse` share of its pages."""
    rows, size = [], keys + tokens
    for i in range(batch):
        r = RowMeta(q_start=i * tokens, n=tokens, base=i * size, start=keys)
        if sparse is not None:
            pages = -(-keys // page)
            keep = torch.randperm(pages, generator=g)[:max(1, int(sparse * pages))].sort().values
            pos = (keep[:, None] * page + torch.arange(page)).flatten()
            pos = torch.cat((pos[pos < keys], torch.arange(keys, keys + tokens)))
            r.sparse, r.sparse_pos = [pos + r.base], [pos]
        rows.append(r)
    return rows, batch * size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-src", type=Path, default=None, help="A: this kernel source (default: this "
                    "checkout's, built without bf16 dot products)")
    ap.add_argument("--keys", default="7168", help="comma-separated key counts per row")
    ap.add_argument("--tokens", default="1,2,3,4,5,7", help="comma-separated tokens per row (1: decode)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim (SmolLM2-135M's)")
    ap.add_argument("--sparse", type=float, default=0.1, help="also a one-token row keeping this share of "
                    "its pages (a draft row); 0: none")
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    cxx = cpu_build.compiler()
    base = (cpu_attention.build(cxx, src=a.baseline_src.resolve()) if a.baseline_src
            else cpu_attention.build(cxx, bf16_dot=False))
    A = CpuAttention(cpu_attention._open(base, older=a.baseline_src is not None))
    B = CpuAttention(cpu_attention.load_library())
    what = a.baseline_src or "this source without bf16 dot products"
    print(f"A = {what}, B = this source (bf16 dot products: {cpu_attention.bf16_dot()}, "
          f"{cpu_attention.vector_width()} floats per vector), {a.threads} threads, {a.pairs} pairs per case, "
          f"{a.batch} rows, heads {hq}/{hkv}, D {d}, bf16 pool")
    g = torch.Generator().manual_seed(0)
    cases = [(int(n), int(k), None) for k in a.keys.split(",") for n in a.tokens.split(",")]
    cases += [(1, int(k), a.sparse) for k in a.keys.split(",")] if a.sparse else []
    for n, keys, sparse in cases:
        rows, cap = rows_of(n, keys, a.batch, sparse, 16, g)
        q = torch.randn(a.batch * n, hq, d, generator=g)
        k = torch.randn(hkv, cap, d, generator=g).to(torch.bfloat16)
        v = torch.randn(hkv, cap, d, generator=g).to(torch.bfloat16)
        times, outs = {A: [], B: []}, {}
        for i in range(a.pairs + 4):
            for be in (A, B) if i % 2 else (B, A):
                meta = AttentionMeta(rows=rows, num_tokens=a.batch * n, page_size=16, scale=d ** -0.5)
                t0 = time.perf_counter()
                outs[be], _ = be.attend(0, q, k, v, meta)
                times[be].append(time.perf_counter() - t0)
        ta, tb = times[A][4:], times[B][4:]
        r = sorted(b / x for b, x in zip(tb, ta))
        label = f"{n}x{keys}{'s' if sparse else ''}"
        print(f"{label:>10}: A {statistics.median(ta) * 1e3:7.3f} ms  B {statistics.median(tb) * 1e3:7.3f} ms  "
              f"B/A {statistics.median(r):.3f} [{r[len(r) // 4]:.3f}, {r[3 * len(r) // 4]:.3f}]  "
              f"max |A-B| {(outs[A] - outs[B]).abs().max().item():.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
