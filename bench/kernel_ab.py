"""Two versions of the compiled CPU attention kernel, timed side by side in one C++ process.

    python bench/kernel_ab.py --a OLD.cpp [--b NEW.cpp] --cases 1x16384,2x16384,1x16384s --threads 2

The cases are attention_ab.py's (`NxCONTEXT`: 8 rows of N tokens after CONTEXT keys; `s`: a sparse
row keeping 7% of the prefix's pages) and so is the output: per case the median time of each, the
median per-pair ratio B/A with its quartiles, and the largest difference between the two outputs.
The difference is where the calls come from: bench/kernel_ab.cpp, with both sources compiled into it
(the compiler and flags of the shipped build, this machine's vector width), calls the kernels back to
back, each on the next of `--copies` copies of the KV pool, with no Python or torch between calls.
`--b read` makes B a plain read of the lines A's kernel reads: the ratio is then the share of A's time
the access pattern alone needs. Use it for changes of a few percent in the kernel itself;
attention_ab.py for what a call from the engine's backend sees, engine_ab.py for whole forwards. Run
it alone: the ratio cancels noise that moves both versions, not a neighbour.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_ab import add_case_args, add_source_args, parse_cases, sources_exist

from aspire_bench.kernels import cpu_attention, cpu_build

HARNESS = Path(__file__).with_name("kernel_ab.cpp")
PLAIN_READ = "read"  # --b read: B reads the lines A's kernel reads, and nothing else


def build(a: Path, b: Path | None, exe: Path) -> None:
    """Compile the harness with sources `a` and `b` (None: B a plain read) into `exe` (KernelBuildError on
    failure)."""
    cxx = cpu_build.compiler()
    flags = ["-O3", "-march=native", *cpu_attention.build_flags(), "-fopenmp", "-std=c++17"]
    version_b = f'-DSRC_B="{b.resolve()}"' if b else "-DPLAIN_READ_B"
    cmd = [cxx, *flags, f'-DSRC_A="{a.resolve()}"', version_b, str(HARNESS), "-o", str(exe)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        first = next((ln for ln in res.stderr.splitlines() if "error" in ln), res.stderr.strip()[:200])
        raise cpu_build.KernelBuildError(f"the A/B harness did not compile: {first}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_source_args(ap)
    add_case_args(ap)
    ap.add_argument("--copies", type=int, default=16, help="copies of the KV pool, read in turn (default 16: none cached)")
    args = ap.parse_args(argv)
    plain_read = str(args.b) == PLAIN_READ
    sources = [args.a] if plain_read else [args.a, args.b]
    cases = parse_cases(args.cases, "s") if sources_exist(*sources) else None
    if cases is None:
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "kernel_ab"
        try:
            build(args.a, None if plain_read else args.b, exe)
        except cpu_build.KernelBuildError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"A = {args.a}, B = {args.b} ({cpu_attention.vector_width_for(cpu_build.cpuinfo())} floats per "
              f"vector), {args.threads} threads, {args.pairs} pairs per case, {args.copies} copies of the pool")
        for case, n, ctx, kind in cases:
            out = subprocess.run([str(exe), str(n), str(ctx), str(int(kind == "s")), str(args.copies), str(args.pairs),
                                  str(args.threads), str(args.seed)], capture_output=True, text=True, check=True)
            ta, tb, mid, q1, q3, diff = (float(x) for x in out.stdout.split())
            print(f"{case:>10}: A {ta:7.3f} ms  B {tb:7.3f} ms  B/A {mid:.3f} [{q1:.3f}, {q3:.3f}]  "
                  + ("(B: plain read)" if plain_read else f"max |A-B| {diff:.1e}"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
