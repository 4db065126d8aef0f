"""Measure this machine's roofline profile for the simulator (`simulate --hardware FILE`).

    python -m benchmarks.measure_hardware --out profile.json [--threads 2]

- memory_bw_gbs: a full read (`sum`) of a 512 MiB fp32 tensor.
- tflops.float32 / bfloat16: a 2048 x 2048 matrix product.
- step_overhead_us: one engine step of the bundled tiny model (1 token, 16 positions of context)
  minus what the roofline gives that step: the fixed cost of a forward pass (op dispatch, Python).
- overlap: false. A CPU core reads and computes in turn, so a step's time is the sum of its bytes'
  and its FLOPs' times (a GPU's profile takes the larger).
Each is the fastest of its repeats: on a shared machine other processes only ever slow a timing
down, so the minimum is the closest to what the machine can do. Efficiencies are 1: the figures are
what this machine achieves, not datasheet peaks. The profile records the load average at the time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch


def best_time(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_tflops(dtype: torch.dtype, n: int = 2048) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / best_time(lambda: a @ b) / 1e12


def read_bandwidth_gbs(nbytes: int = 1 << 29) -> float:
    x = torch.ones(nbytes // 4)
    return nbytes / best_time(x.sum) / 1e9


def step_overhead_us(profile: dict) -> float:
    from aspire_bench.engine import Row
    from aspire_bench.harness.runner import load_engine
    from aspire_bench.simulator.costs import TINY_SHAPE, Hardware, ModelShape, Roofline
    engine = load_engine("tiny", "float32", "cpu", "auto")
    engine.reserve(64)
    slot = engine.alloc(64)
    engine.forward([Row(slot, list(range(16)), 0)])
    t = best_time(lambda: (engine.forward([Row(slot, [1], 16)]), engine.rollback(slot, 16)), repeats=30)
    roof = Roofline(Hardware("m", profile["memory_bw_gbs"], profile["tflops"], overlap=profile["overlap"]),
                    ModelShape.load(TINY_SHAPE, "float32"))
    return max(0.0, t - roof.step_time([("decode", 1, 17)])) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from aspire_bench.harness.records import cpu_model
    profile = {"name": f"{cpu_model()} ({torch.get_num_threads()} threads, measured)",
               "memory_bw_gbs": read_bandwidth_gbs(),
               "tflops": {"float32": matmul_tflops(torch.float32), "bfloat16": matmul_tflops(torch.bfloat16)},
               "bw_efficiency": 1.0, "flops_efficiency": 1.0, "overlap": False}
    profile["step_overhead_us"] = step_overhead_us(profile)
    profile["_source"] = (f"benchmarks/measure_hardware.py on {datetime.date.today().isoformat()}, load average "
                          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (a shared machine reads lower)")
    a.out.write_text(json.dumps(profile, indent=1) + "\n")
    print(json.dumps(profile, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
