"""Two versions of the compiled CPU attention kernel, timed side by side on the same rows.

    python bench/attention_ab.py --a OLD.cpp [--b NEW.cpp] --cases 1x16384s,4x16384 --threads 2
    python bench/attention_ab.py --a-width 16 --b-width 8 --threads 2     # one source, two vector widths

Each case is `NxCONTEXT`, with `s` for a sparse row (7% of the prefix's pages, ASPIRE's draft view)
instead of the full prefix, or `c` for a full row that also captures its page scores (ASPIRE's refresh
layer; the scores' largest difference counts in the outputs'): 8 rows of N query tokens, the bundled model's attention shape (4 query
heads, 2 KV heads, head dim 32, fp32). Calls alternate A/B and B/A; each reads one of 16 copies of the
KV pool in turn (huge pages, as the engine's), so, as in a forward, no call finds its keys in cache.
Prints per case the median time of each and the median of the per-pair ratios B/A with its quartiles,
and the largest difference between the two outputs. `--a` and `--b` default to the kernel in the tree,
`--a-width` and `--b-width` to the vector width this machine's build uses.
Machine-noise that moves both versions cancels in the ratio; run it alone.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from aspire_bench.engine.kv_cache import pool_tensor
from aspire_bench.kernels import cpu_attention, cpu_build
from aspire_bench.kernels.base import PAGE_MAX_SUM, AttentionMeta, RowMeta

HQ, HKV, D, ROWS, PAGE, COPIES = 4, 2, 32, 8, 16, 16


def backend(src: Path, width: int | None) -> cpu_attention.CpuAttention:
    """A backend whose kernel calls go to a build of `src` (built and cached like the shipped one), with
    vectors of `width` floats (None: this machine's choice, cpu_attention.vector_width_for)."""
    lib = cpu_attention._open(cpu_attention.build(cpu_build.compiler(), width=width, src=src))
    if width and lib.aspire_vector_width() != width:
        raise ValueError(f"this CPU has no AVX-512: its build of {src.name} uses vectors of "
                         f"{lib.aspire_vector_width()} floats, not {width}")
    return cpu_attention.CpuAttention(lib)


def add_source_args(ap: argparse.ArgumentParser) -> None:
    """--a and --b: the two kernel sources compared (default: the tree's)."""
    ap.add_argument("--a", type=Path, default=cpu_attention.SOURCE, help="the reference (default: the tree's)")
    ap.add_argument("--b", type=Path, default=cpu_attention.SOURCE, help="the candidate (default: the tree's)")


def sources_exist(*sources: Path) -> bool:
    """Whether the kernel sources (--a, --b) name files; if not, a one-line error on stderr."""
    for src in sources:
        if not src.is_file():
            print(f"error: no kernel source at {src}: pass a .cpp file", file=sys.stderr)
            return False
    return True


def add_case_args(ap: argparse.ArgumentParser) -> None:
    """The options of the A/B kernel scripts besides the two sources."""
    ap.add_argument("--cases", default="1x16384,1x16384s,2x16384,4x16384,7x16384")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)


def parse_cases(text: str, kinds: str) -> list[tuple[str, int, int, str]] | None:
    """(case, tokens per row, context, kind) per comma-separated `NxCONTEXT` with an optional kind
    suffix from `kinds` ("" for a full row); None after a one-line error on stderr naming a case that
    is not one."""
    cases = []
    for case in text.split(","):
        n, _, ctx = case.partition("x")
        kind = ctx[-1:] if ctx[-1:] and ctx[-1:] in kinds else ""
        if not (n.isdigit() and int(n) > 0 and ctx[:len(ctx) - len(kind)].isdigit()):
            examples = ", ".join(["2x16384", *(f"1x16384{k}" for k in kinds)])
            print(f"error: case {case!r} is not NxCONTEXT with an optional suffix {'/'.join(kinds)} (e.g. {examples})",
                  file=sys.stderr)
            return None
        cases.append((case, int(n), int(ctx[:len(ctx) - len(kind)]), kind))
    return cases


def case_rows(n: int, context: int, sparse: bool, gen: torch.Generator):
    """ROWS rows of n tokens after `context` keys, in disjoint slots of one pool; a sparse row keeps 7%
    of its prefix's pages (random ones, sorted) and its own tokens."""
    size = -(-(context + n) // PAGE) * PAGE
    rows = []
    for i in range(ROWS):
        r = RowMeta(q_start=i * n, n=n, base=i * size, start=context)
        if sparse:
            pages = -(-context // PAGE)
            keep = torch.randperm(pages, generator=gen)[:max(1, int(0.07 * pages))].sort().values
            pos = (keep[:, None] * PAGE + torch.arange(PAGE)).flatten()
            pos = torch.cat((pos[pos < context], torch.arange(context, context + n)))
            r.sparse, r.sparse_pos = [pos + r.base], [pos]
        rows.append(r)
    return rows, ROWS * size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_source_args(ap)
    for which in ("a", "b"):
        ap.add_argument(f"--{which}-width", type=int, choices=(8, 16),
                        help=f"floats per vector for {which.upper()} (default: this machine's; 16 needs AVX-512)")
    add_case_args(ap)
    args = ap.parse_args(argv)
    cases = parse_cases(args.cases, "sc") if sources_exist(args.a, args.b) else None
    if cases is None:
        return 2
    torch.set_num_threads(args.threads)
    try:
        a, b = backend(args.a, args.a_width), backend(args.b, args.b_width)
    except (cpu_build.KernelBuildError, ValueError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    width = cpu_attention.vector_width_for(cpu_build.cpuinfo())
    print(f"A = {args.a} ({args.a_width or width} floats per vector), B = {args.b} ({args.b_width or width}), "
          f"{args.threads} threads, {args.pairs} pairs per case")
    for case, n, ctx, kind in cases:
        rows, cap = case_rows(n, ctx, kind == "s", gen)
        for r in rows if kind == "c" else ():  # page scores of the row's last token, as ASPIRE's refresh layer
            r.capture_layers, r.capture_queries, r.capture_reduce = frozenset({0}), (-1,), PAGE_MAX_SUM
        q = torch.randn(ROWS * int(n), HQ, D, generator=gen)
        pools = []
        for _ in range(COPIES):
            k, v = pool_tensor((HKV, cap, D), torch.float32, "cpu"), pool_tensor((HKV, cap, D), torch.float32, "cpu")
            k.normal_(generator=gen)
            v.normal_(generator=gen)
            pools.append((k, v))
        meta = AttentionMeta(rows=rows, num_tokens=q.shape[0], page_size=PAGE, scale=D ** -0.5)
        (out_a, caps_a), (out_b, caps_b) = a.attend(0, q, *pools[0], meta), b.attend(0, q, *pools[0], meta)
        diff = max([(out_a - out_b).abs().max().item()] + [(caps_a[i] - caps_b[i]).abs().max().item() for i in caps_a])
        times: tuple[list, list] = ([], [])
        for i in range(args.pairs):
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                k, v = pools[(2 * i + which) % COPIES]
                t0 = time.perf_counter()
                (a, b)[which].attend(0, q, k, v, meta)
                times[which].append(time.perf_counter() - t0)
        ratios = [tb / ta for ta, tb in zip(*times)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"{case:>10}: A {statistics.median(times[0]) * 1e3:7.3f} ms  B {statistics.median(times[1]) * 1e3:7.3f} ms"
              f"  B/A {statistics.median(ratios):.3f} [{q1:.3f}, {q3:.3f}]  max |A-B| {diff:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
