"""GPU check and micro-benchmark of the Triton kernels: about 2 minutes on one H100 or H200 at the
default sizes (an estimate, derived in benchmarks/README.md); no sweep or tuning cell starts after
`--budget-s` from the start (the correctness checks come first, most of their time compiling).

    python -m benchmarks.gpu_kernels --out gpu_kernels.json            # Qwen3-8B attention shape, bf16
    python -m benchmarks.gpu_kernels --cpu-smoke --out /tmp/smoke.json # the same code on the CPU (tests)

Correctness against the torch backend (dtypes, GQA, decode and verify rows, sparse views, split-K,
captures, prefill, int64 offsets); copy bandwidth; attention bandwidth at 16k-100k, batch 8-32;
the capture pass's cost; the kernel's block/warps/stages tuning (--no-tune skips). Writes JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
RTOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # tf32-free fp32, see kernels.md
PAGE = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_kernels.json", help="JSON results file")
    ap.add_argument("--hq", type=int, default=32, help="query heads (Qwen3-8B: 32)")
    ap.add_argument("--hkv", type=int, default=8, help="KV heads (Qwen3-8B: 8)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--contexts", default="16384,32768,100000")
    ap.add_argument("--batches", default="8,16,32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="contexts 16k,100k and batches 8,32 only")
    ap.add_argument("--budget-s", type=float, default=540, help="stop starting new sweep cells after this")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--no-tune", action="store_true", help="skip the block/warps/stages comparison")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="exercise this script's plumbing on a CPU through the Triton interpreter, tiny shapes; "
                         "its numbers mean nothing")
    args = ap.parse_args()
    small = 1
    if args.cpu_smoke:
        import os
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
        args.contexts, args.batches, args.iters, args.quick = "200", "2", 1, False
        args.hq, args.hkv, args.head_dim, args.dtype = 8, 2, 32, "fp32"
        small = 50
    elif not torch.cuda.is_available():
        print("benchmarks/gpu_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False here). "
              "The kernels are tested on CPU by tests/kernels/test_kernels.py under TRITON_INTERPRET=1.",
              file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("triton is not installed: pip install 'aspire-bench[triton]'", file=sys.stderr)
        return 2

    from aspire_bench.kernels import flash_prefill

    t_start = time.time()
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    if args.cpu_smoke:
        from types import SimpleNamespace
        props = SimpleNamespace(name="cpu (triton interpreter smoke run)", multi_processor_count=1, total_memory=0)
    else:
        props = torch.cuda.get_device_properties(dev)
    report: dict = {
        "device": props.name, "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2 ** 30, 1),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "flash_attn": flash_prefill.flash_attn_varlen_func is not None, "python": platform.python_version(),
        "shape": {"hq": args.hq, "hkv": args.hkv, "head_dim": args.head_dim, "dtype": args.dtype, "page": PAGE},
    }
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}, flash-attn {'yes' if report['flash_attn'] else 'no'}")

    ok = True
    if not args.skip_checks:
        checks = run_checks(dev, small)
        report["checks"] = checks
        ok = all(c["ok"] for c in checks)
        for c in checks:
            print(f"check {'ok  ' if c['ok'] else 'FAIL'} {c['name']:<48} rel_err {c['rel_err']:.2e} "
                  f"(bound {c['bound']:.0e})")
        print(f"# checks: {sum(c['ok'] for c in checks)}/{len(checks)} passed, {time.time() - t_start:.0f}s")

    report["copy_gbps"] = copy_bandwidth(dev, 2 ** 31 // small)
    print(f"# device-to-device copy: {report['copy_gbps']:.0f} GB/s (read + write)")

    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    if args.quick:
        contexts = [contexts[0], contexts[-1]]
        batches = [batches[0], batches[-1]]
    report["sweep"], report["scores"] = sweep(dev, args, contexts, batches, t_start, report["copy_gbps"])
    if not args.no_tune:
        report["tune"] = tune(dev, args, contexts, batches, t_start)
    report["wall_s"] = round(time.time() - t_start, 1)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"# wrote {args.out} ({report['wall_s']}s)")
    return 0 if ok else 1


# --- inputs ---------------------------------------------------------------------------------------

def make_rows(specs, dev, hq, hkv, d, dtype, k=None, v=None, seed=0, base0=0, sparse_frac=None, min_pages=32,
              recent=8):
    """specs: [(n, start, sparse?)]; rows in disjoint slots from base0. Returns q, k, v, rows."""
    from aspire_bench.kernels.base import RowMeta
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows, q0, base = [], 0, base0
    for n, start, sparse in specs:
        r = RowMeta(q_start=q0, n=n, base=base, start=start)
        if sparse:
            pages = -(-start // PAGE)
            frac = sparse_frac if sparse_frac is not None else 0.3
            budget = min(pages, max(min(min_pages, pages), math.ceil(frac * pages)))
            n_recent = min(recent, budget)
            rest = torch.randperm(pages - n_recent, generator=g)[:budget - n_recent]
            keep = torch.cat((rest, torch.arange(pages - n_recent, pages))).sort().values
            pos = (keep[:, None] * PAGE + torch.arange(PAGE)).flatten()
            pos = torch.cat((pos[pos < start], torch.arange(start, start + n))).to(dev)
            r.sparse, r.sparse_pos = [pos + base], [pos]
        rows.append(r)
        q0 += n
        base += start + n + 3
    if k is None:
        k = torch.randn(hkv, base + 5, d, device=dev, dtype=dtype)
        v = torch.randn(hkv, base + 5, d, device=dev, dtype=dtype)
    q = torch.randn(q0, hq, d, device=dev, dtype=dtype)
    return q, k, v, rows


def meta_of(rows, d):
    from aspire_bench.kernels.base import AttentionMeta
    return AttentionMeta(rows=rows, num_tokens=sum(r.n for r in rows), page_size=PAGE, scale=d ** -0.5)


def rel_err(a, b) -> float:
    if torch.isnan(a).any():
        return float("inf")
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


# --- 1. correctness -------------------------------------------------------------------------------

def run_checks(dev, small: int = 1) -> list[dict]:
    """small > 1 shrinks contexts and skips the 2^31 pool (CPU smoke run)."""
    from aspire_bench.kernels import triton_common as tc
    from aspire_bench.kernels.base import PAGE_MAX_SUM, TOKEN_MEAN
    from aspire_bench.kernels.torch_ref import TorchAttention
    from aspire_bench.kernels.triton_backend import TritonAttention

    real_empty = tc.empty
    tc.empty = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    out = []

    def check(name, a, b, bound):
        e = rel_err(a, b)
        out.append({"name": name, "rel_err": e, "bound": bound, "ok": e <= bound})

    try:
        mixed = [(1, 3000, False), (17, 1500, False), (1, 5000, True), (17, 2500, True), (1, 7, False),
                 (5, 700, True), (40, 300, False)]  # the last: a prefill chunk (flash-attn / SDPA)
        mixed = [(n, max(n, start // small), sp) for n, start, sp in mixed]
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for hq, hkv in ((8, 8), (16, 4), (32, 4)):
                d = 128 if dtype != torch.float32 else 64
                if small > 1:
                    hq, hkv, d = hq // 4, hkv // 4, 32  # same GQA groups
                q, k, v, rows = make_rows(mixed, dev, hq, hkv, d, dtype, seed=hq)
                rows[1].capture_layers = frozenset({0})
                rows[1].capture_queries = (0, -1)
                rows[1].capture_reduce = PAGE_MAX_SUM
                rows[0].capture_layers = frozenset({0})
                rows[0].capture_queries = (0,)
                rows[0].capture_reduce = TOKEN_MEAN
                ref, ref_caps = TorchAttention().attend(0, q, k, v, meta_of(rows, d))
                for label, kw in (("split", {"min_chunk": 256 // small or 64, "target_programs": 1 << 20}),
                                  ("nosplit", {"min_chunk": 1 << 30})):
                    got, caps = TritonAttention(**kw).attend(0, q, k, v, meta_of(rows, d))
                    sync(dev)
                    name = f"attn {str(dtype)[6:]} G={hq // hkv} {label}"
                    check(name, got, ref, RTOL[dtype])
                    for i in (0, 1):
                        check(f"{name} scores row{i}", caps[i], ref_caps[i], RTOL[dtype])
        # A pool past 2^31 elements per layer: the row sits at the end, so int32 offsets would wrap.
        if small > 1:
            return out
        hkv, d, dtype = 8, 128, torch.bfloat16
        cap = (2 ** 31) // (hkv * d) + 70000
        k = torch.empty(hkv, cap, d, device=dev, dtype=dtype)
        v = torch.empty_like(k)
        base0 = cap - 60000
        q, _, _, rows = make_rows([(1, 20000, False), (9, 30000, True)], dev, 32, hkv, d, dtype, k=k, v=v,
                                  base0=base0, seed=1)
        k[:, base0:].normal_()
        v[:, base0:].normal_()
        ref, _ = TorchAttention().attend(0, q, k, v, meta_of(rows, d))
        got, _ = TritonAttention().attend(0, q, k, v, meta_of(rows, d))
        check("attn bf16 pool > 2^31 elements (int64 offsets)", got, ref, RTOL[dtype])
        del k, v
    finally:
        tc.empty = real_empty
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


# --- 2. copy bandwidth ----------------------------------------------------------------------------

def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters: int) -> float:
    """Median milliseconds of fn() over iters runs, after 3 warm-up runs (compiles, caches)."""
    if not torch.cuda.is_available():  # CPU smoke run: wall clock, one run
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(dev, nbytes: int) -> float:
    x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), 10)
    return 2 * nbytes / ms / 1e6


# --- 3./4. sweep ----------------------------------------------------------------------------------

def sweep(dev, args, contexts, batches, t_start, copy_gbps):
    from aspire_bench.kernels.triton_backend import TritonAttention

    hkv, d, dtype = args.hkv, args.head_dim, DTYPES[args.dtype]
    max_pos = max(batches) * (max(contexts) + 16)
    # One pool for every cell (allocation and fill once); cells use its prefix.
    k = torch.empty(hkv, max_pos, d, device=dev, dtype=dtype).normal_()
    v = torch.empty_like(k).normal_()
    backend = TritonAttention()
    rows_out, scores_out = [], []
    hdr = (f"{'ctx':>7} {'B':>3} {'view':>6} {'nq':>3} | {'kv MB':>8} {'triton ms':>9} {'GB/s':>7} "
           f"{'%copy':>6} {'splits':>6} {'plan ms':>7} | {'torch ms':>8}")
    print(hdr)
    print("-" * len(hdr))
    for ctx, B, view, nq in itertools.product(contexts, batches, ("full", "7%"), (1, 9)):
        if time.time() - t_start > args.budget_s:
            print(f"# stopped the sweep at the --budget-s limit ({args.budget_s:.0f}s); later cells not run")
            break
        rec, score = cell(dev, args, backend, k, v, ctx, B, view, nq, copy_gbps)
        rows_out.append(rec)
        print(f"{ctx:>7} {B:>3} {view:>6} {nq:>3} | {rec['kv_bytes'] / 1e6:>8.1f} {rec['triton_ms']:>9.3f} "
              f"{rec['gbps']:>7.0f} {100 * rec['frac_of_copy']:>5.0f}% {rec['splits']:>6} {rec['plan_ms']:>7.2f} "
              f"| {rec['torch_ms']:>8.3f}")
        if score is not None:
            scores_out.append(score)
    print()
    print(f"{'ctx':>7} {'B':>3} {'nq':>3} | {'score ms':>8} {'attn ms':>8} {'attn+lse':>8} {'score/attn':>10}")
    for s in scores_out:
        print(f"{s['context']:>7} {s['batch']:>3} {s['queries']:>3} | {s['score_ms']:>8.3f} {s['attn_ms']:>8.3f} "
              f"{s['attn_lse_ms']:>8.3f} {s['score_over_attn']:>10.2f}")
    return rows_out, scores_out


def cell(dev, args, backend, k, v, ctx, B, view, nq, copy_gbps):
    """One sweep cell: B rows of nq queries at context ctx, full or 7% page views, one layer."""
    from aspire_bench.kernels import triton_attention as ta
    from aspire_bench.kernels.base import PAGE_MAX_SUM
    from aspire_bench.kernels.torch_ref import TorchAttention
    from aspire_bench.kernels.triton_scores import ScoreRow, attention_scores

    hq, hkv, d = args.hq, args.hkv, args.head_dim
    esize = k.element_size()
    specs = [(nq, ctx - nq, view != "full")] * B
    q, _, _, rows = make_rows(specs, dev, hq, hkv, d, k.dtype, k=k, v=v, seed=ctx + B, sparse_frac=0.07)
    kv_keys = sum(r.start + r.n if not r.sparse else r.sparse[0].numel() for r in rows)
    kv_bytes = kv_keys * hkv * d * 2 * esize  # K and V rows the step must read
    meta = meta_of(rows, d)
    t0 = time.perf_counter()
    backend.attend(0, q, k, v, meta)  # builds the plan (host, once per forward)
    sync(dev)
    plan_ms = (time.perf_counter() - t0) * 1e3
    ms = timed(lambda: backend.attend(0, q, k, v, meta), args.iters)
    plan = next(p for key, p in meta.backend_cache.items() if key[0] == "plan")
    tms = timed(lambda: TorchAttention().attend(0, q, k, v, meta), max(3, args.iters // 4))
    gbps = kv_bytes / ms / 1e6
    rec = {"context": ctx, "batch": B, "view": view, "queries": nq, "kv_bytes": kv_bytes, "triton_ms": ms,
           "gbps": gbps, "frac_of_copy": gbps / copy_gbps, "splits": plan.num_splits, "plan_ms": plan_ms,
           "torch_ms": tms}
    if view != "full":
        return rec, None
    # 4. the score pass of this (full) layer: ASPIRE page scores of the first and last query per row.
    ws = meta.backend_cache.setdefault("workspace", {})
    _, lse = ta.paged_attention(q, k, v, plan, d ** -0.5, want_lse=True, workspace=ws)
    srows = [ScoreRow(r.q_start, r.start, r.base, r.start + r.n, (0, -1) if nq > 1 else (0,), PAGE_MAX_SUM)
             for r in rows]
    sms = timed(lambda: attention_scores(q, k, lse, srows, d ** -0.5, PAGE), args.iters)
    lms = timed(lambda: ta.paged_attention(q, k, v, plan, d ** -0.5, want_lse=True, workspace=ws), args.iters)
    score = {"context": ctx, "batch": B, "queries": nq, "score_ms": sms, "attn_ms": ms, "attn_lse_ms": lms,
             "score_over_attn": sms / ms}
    return rec, score


def tune(dev, args, contexts, batches, t_start):
    """5. The attention kernel's launch knobs on a few cells: key block, warps, pipeline stages."""
    from aspire_bench.kernels.triton_backend import TritonAttention

    hq, hkv, d, dtype = args.hq, args.hkv, args.head_dim, DTYPES[args.dtype]
    ctx = contexts[len(contexts) // 2]
    cells = [(min(batches), "full", 1), (max(batches), "full", 9), (max(batches), "7%", 1)]
    knobs = list(itertools.product((32, 64, 128), (4, 8), (None, 2)))
    max_pos = max(batches) * (ctx + 16)
    k = torch.empty(hkv, max_pos, d, device=dev, dtype=dtype).normal_()
    v = torch.empty_like(k).normal_()
    out = []
    print()
    print(f"# knobs at context {ctx}: ms per layer (block_n, warps, stages; '-' = Triton's default stages)")
    print(f"{'B':>3} {'view':>5} {'nq':>3} | " + " ".join(f"{f'{bn}/{w}/{st or chr(45)}':>8}" for bn, w, st in knobs))
    for B, view, nq in cells:
        if time.time() - t_start > args.budget_s:
            print(f"# stopped tuning at the --budget-s limit ({args.budget_s:.0f}s)")
            break
        q, _, _, rows = make_rows([(nq, ctx - nq, view != "full")] * B, dev, hq, hkv, d, dtype, k=k, v=v,
                                  seed=ctx + B, sparse_frac=0.07)
        times = []
        for bn, w, st in knobs:
            backend = TritonAttention(block_n=bn, num_warps=w, num_stages=st)
            meta = meta_of(rows, d)
            try:
                ms = timed(lambda b=backend, m=meta, qq=q: b.attend(0, qq, k, v, m), args.iters)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a big tile: report, go on
                ms = float("nan")
                print(f"# {bn}/{w}/{st}: {type(e).__name__}: {str(e)[:120]}")
            times.append(ms)
            out.append({"context": ctx, "batch": B, "view": view, "queries": nq, "block_n": bn, "num_warps": w,
                        "num_stages": st, "ms": ms})
        print(f"{B:>3} {view:>5} {nq:>3} | " + " ".join(f"{t:>8.3f}" for t in times))
    return out


if __name__ == "__main__":
    sys.exit(main())
