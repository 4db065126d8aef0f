"""Compile the Triton kernels for a CUDA target without a GPU (ahead of time, through ptxas).

    python -m aspire_bench.kernels.triton_compile_check [--arch 90] [--quick] [--resources]

The interpreter (tests/kernels/test_kernels.py) checks what the kernels compute, not that they compile
for a GPU. This records TritonAttention's launches over sample mixed batches on the CPU and compiles
each distinct one (kernel x constexprs x arg types) with Triton's bundled ptxas; --resources prints
registers/spills (ptxas -v). Run without TRITON_INTERPRET (it needs the compiled-kernel objects).
Exit status 1 if any launch fails to compile. More: docs/kernels.md, "Compiling for a GPU without one".
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

_DT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
       torch.int64: "i64"}


class _Recorder:
    """Stands in for a JITFunction: kernel[grid](*args) records (signature, constexprs, num_warps)."""

    def __init__(self, fn, launches: dict):
        self.fn = fn
        self.launches = launches

    def __getitem__(self, grid):
        def call(*args, num_warps=4, **kw):
            sig, consts = {}, {}
            for i, (name, p) in enumerate(zip(self.fn.arg_names, self.fn.params)):
                v = args[i] if i < len(args) else kw[name]
                if p.is_constexpr:
                    sig[name], consts[name] = "constexpr", v
                elif isinstance(v, torch.Tensor):
                    sig[name] = "*" + _DT[v.dtype]
                elif isinstance(v, bool):
                    sig[name] = "i1"
                elif isinstance(v, int):
                    sig[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
                elif isinstance(v, float):
                    sig[name] = "fp32"
                else:
                    raise TypeError(f"{self.fn.__name__}: cannot type argument {name}={v!r}")
            key = (self.fn.__name__, tuple(sorted(sig.items())), tuple(sorted((k, repr(c)) for k, c in consts.items())),
                   num_warps)
            self.launches.setdefault(key, (self.fn, sig, consts, num_warps))
        return call


def record_launches(quick: bool = False) -> dict:
    from . import triton_attention as ta
    from . import triton_backend as tb
    from . import triton_common as tc
    from . import triton_scores as ts
    from .base import PAGE_MAX_SUM, TOKEN_MEAN, AttentionMeta, RowMeta

    if type(ta._attn_fwd).__name__ != "JITFunction":
        raise SystemExit("triton_compile_check: unset TRITON_INTERPRET (the kernels are interpreted here)")
    launches: dict = {}
    saved = {}
    for mod, names in ((ta, ("_attn_fwd", "_attn_combine")), (ts, ("_scores", "_score_lse"))):
        for n in names:
            saved[(mod, n)] = getattr(mod, n)
            setattr(mod, n, _Recorder(getattr(mod, n), launches))
    saved[(tc, "interpreting")] = tc.interpreting
    tc.interpreting = lambda: True  # let the backend run its host side on CPU tensors
    try:
        # decode (full, sparse), verify (full, sparse), a capturing prefill chunk; both reductions
        specs = [(1, 3000, False, TOKEN_MEAN), (9, 2000, False, PAGE_MAX_SUM), (1, 2000, True, None),
                 (17, 100, True, None), (40, 100, False, TOKEN_MEAN)]
        shapes = [(torch.bfloat16, 32, 8)] if quick else \
            [(dt, hq, hkv) for dt in (torch.float16, torch.bfloat16, torch.float32)
             for hq, hkv in ((32, 8), (16, 16), (28, 4))]
        for dtype, hq, hkv in shapes:
            for min_chunk in ((256,) if quick else (256, 1 << 30)):
                rows, q0, base = [], 0, 0
                for n, start, sparse, cap in specs:
                    r = RowMeta(q_start=q0, n=n, base=base, start=start)
                    if sparse:
                        pos = torch.cat((torch.arange(0, start, 3), torch.arange(start, start + n)))
                        r.sparse, r.sparse_pos = [pos + base], [pos]
                    if cap:
                        r.capture_layers, r.capture_queries, r.capture_reduce = frozenset({0}), (0, -1), cap
                    rows.append(r)
                    q0 += n
                    base += start + n
                k = torch.zeros(hkv, base + 1, 128, dtype=dtype)
                q = torch.zeros(q0, hq, 128, dtype=dtype)
                meta = AttentionMeta(rows, q0, 16, 128 ** -0.5)
                tb.TritonAttention(min_chunk=min_chunk, target_programs=1 << 20).attend(0, q, k, k, meta)
    finally:
        for (mod, n), v in saved.items():
            setattr(mod, n, v)
    return launches


def compile_all(launches: dict, arch: int, resources: bool = False) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    failures = 0
    for fn, sig, consts, num_warps in launches.values():
        t = time.time()
        label = f"{fn.__name__} {', '.join(f'{k}={v}' for k, v in consts.items())} warps={num_warps}"
        try:
            c = triton.compile(ASTSource(fn, sig, consts), target=target, options={"num_warps": num_warps})
        except Exception as e:  # noqa: BLE001 - report every failing variant, then fail
            failures += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e)[:1500]}")
            continue
        extra = f" | {_ptxas_usage(c.asm['ptx'], arch)}" if resources else ""
        print(f"ok   {label} ({time.time() - t:.1f}s){extra}")
    return failures


def _ptxas_usage(ptx: str, arch: int) -> str:
    from triton.backends.nvidia import compiler as nv
    ptxas = nv.get_ptxas(arch).path if hasattr(nv, "get_ptxas") else str(Path(nv.__file__).parent / "bin" / "ptxas")
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.ptx"
        p.write_text(ptx)
        sm = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        r = subprocess.run([ptxas, "-v", f"--gpu-name={sm}", str(p), "-o", str(Path(d) / "k.o")],
                           capture_output=True, text=True, check=False)
    lines = [ln.split("info    : ")[-1] for ln in r.stderr.splitlines() if "registers" in ln or "spill" in ln]
    return "; ".join(lines) or r.stderr.strip()[:200]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80 A100, 90 H100/H200)")
    ap.add_argument("--quick", action="store_true", help="bf16, one GQA shape, split-K only")
    ap.add_argument("--resources", action="store_true", help="registers and spills per variant (ptxas -v)")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this compiles the kernels for a GPU", file=sys.stderr)
        return 2
    launches = record_launches(args.quick)
    print(f"{len(launches)} distinct launches, compiling for sm_{args.arch}")
    t0 = time.time()
    failures = compile_all(launches, args.arch, args.resources)
    print(f"{len(launches) - failures}/{len(launches)} compiled in {time.time() - t0:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
