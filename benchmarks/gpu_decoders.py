"""Decoders side by side on one CUDA GPU with the Triton backend: about 6 minutes on one H100 or H200
at the default sizes, under 10 even if every draft is rejected (an estimate, derived in
benchmarks/README.md); no new cell starts after `--budget-s`.

    python -m benchmarks.gpu_decoders --out gpu_decoders      # writes gpu_decoders/*.json and a store
    python -m benchmarks.gpu_decoders --out o --dry-run       # the same code on the CPU at 1k (tests)

1. `aspire-bench bench` on the bundled model (fp32): ar, magicdec, vegas, aspire at 16k and 32k, batch 8,
   one batch of requests x 128 tokens, 2 repeats, greedy and the paper's sampling; no tuned rows and no
   calibration rounds, which would not fit (`aspire-bench bench --device cuda` runs them). 2. `step_costs`
   on a random-init Qwen3-1.7B shape (bf16): costs only, never a speedup. 3. The simulator's prediction
   for the device beside the measurements. Whatever is measured when the budget is spent is written.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

# One batch of requests per cell, without tuned rows or calibration rounds: a cell then takes minutes on a
# GPU, where every step is bound by the host (benchmarks/README.md has the estimate).
REQUESTS = 8


def device_info() -> dict:
    if not torch.cuda.is_available():
        return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "gpu": None,
                "torch": torch.__version__}
    p = torch.cuda.get_device_properties(0)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda}


def part_tiny(out: Path, contexts, repeat: int, new_tokens: int, deadline: float, device: str,
              backend: str, limit: int = REQUESTS) -> list[dict]:
    from rich.console import Console

    from aspire_bench.harness.bench import SAMPLINGS, Sampling, bench, bench_table
    rows_all = []
    for ctx in contexts:  # one context per call, so a spent budget still leaves finished cells
        if time.time() > deadline:
            print(f"budget spent: skipping tiny-model cell {ctx}", flush=True)
            break
        rows, bw = bench("tiny", "code-completion", [ctx], [8], ["ar", "magicdec", "vegas", "aspire"], repeat, new_tokens,
                         [Sampling(*SAMPLINGS["greedy"]), Sampling(*SAMPLINGS["paper"])], 0, limit,
                         str(out / "gpu_decoders.db"), "float32", device, backend, show_progress=False,
                         tune=False, calibration_rounds=False)
        Console(width=200).print(bench_table(rows, bw))
        rows_all += [r.to_json() for r in rows]
        (out / "tiny_bench.json").write_text(json.dumps(rows_all, indent=1, default=str))
    return rows_all


def part_shape(out: Path, shape: str, contexts, repeats: int, deadline: float, dtype: str, device: str,
               backend: str) -> list[dict]:
    from benchmarks import step_costs
    engine = step_costs.make_engine(shape, dtype, device, backend, seed=0)
    results = []
    for C in contexts:
        if time.time() > deadline:
            print(f"budget spent: skipping {shape}-shape cell {C}", flush=True)
            break
        results += step_costs.measure(engine, [C], 8, 6, repeats, 0)
        (out / f"{shape}_step_costs.json").write_text(json.dumps(results, indent=1))
    step_costs.print_table(results)
    return results


def part_simulator(out: Path, gpu: str | None, shape: str, shape_dtype: str, shape_results: list[dict],
                   dry_run: bool) -> dict:
    from aspire_bench.errors import UserError
    from aspire_bench.harness.store import Store
    from aspire_bench.simulator.costs import (
        TINY_SHAPE,
        Hardware,
        ModelShape,
        Roofline,
        predicted_step_ms,
        profile_for,
    )
    from aspire_bench.simulator.rows import stored_rows
    profile = "cpu-measured" if dry_run else profile_for(gpu)
    if profile is None:
        return {"profile": None, "note": f"no bundled profile for {gpu!r}: add one and rerun the simulator"}
    hw = Hardware.load(profile)
    result = {"profile": profile, "hardware": hw.name, "runs": [], "step_costs": []}
    db = out / "gpu_decoders.db"
    if db.exists():
        with Store(db, readonly=True) as store:
            ids = [s["run_id"] for s in store.list_runs(kind="measured") if s["status"] == "ok"]
            roof = Roofline(hw, ModelShape.load(TINY_SHAPE, "float32"))
            rows, _ = stored_rows(store, ids, cost=roof)
            for r in rows:
                r["step_costs"] = "roofline"
            try:
                calibrated, _ = stored_rows(store, ids)
                for r in calibrated:
                    r["step_costs"] = "calibration"
                rows += calibrated
            except UserError as e:  # no calibration in a group: the roofline rows still stand
                print(f"simulator: calibration replay skipped ({e})", flush=True)
        result["runs"] = [{k: v for k, v in r.items() if k != "assumptions"} for r in rows]
    roof = Roofline(hw, ModelShape.load(TINY_SHAPE if shape == "tiny" else shape, shape_dtype))
    for cell in shape_results:
        pred = predicted_step_ms(roof, cell)
        result["step_costs"].append({"context": cell["context"], "batch": cell["batch"], "gamma": cell["gamma"],
                                     "measured_ms": {k: cell["ms"].get(k) for k in pred}, "predicted_ms": pred})
    (out / "simulator_predictions.json").write_text(json.dumps(result, indent=1, default=str))
    for r in result["runs"]:
        print(f"simulated {r['decoder']} {r['context']} ({r['step_costs']}): {r['simulated_decode_tok_s']:.1f} tok/s, "
              f"measured {r['measured_decode_tok_s']:.1f}", flush=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu_decoders"), help="folder for the JSON files and store")
    ap.add_argument("--quick", action="store_true", help="16k only, 1 repeat")
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting new cells after this")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU (the compiled CPU attention backend), 1k context, tiny shape for part 2: checks the script, "
                         "measures nothing")
    a = ap.parse_args(argv)
    if a.dry_run:
        device, backend, contexts, repeat, new_tokens, requests = "cpu", "cpu", ["1k"], 1, 12, 4
        shape, shape_dtype, shape_contexts = "tiny", "float32", [1024]
    else:
        device, backend = "cuda", "triton"
        contexts, repeat = (["16k"], 1) if a.quick else (["16k", "32k"], 2)
        new_tokens, requests = 128, REQUESTS
        shape, shape_dtype, shape_contexts = "qwen3-1.7b", "bfloat16", [16384] if a.quick else [16384, 32768]
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this script measures the Triton backend on a GPU (see benchmarks/step_costs.py "
              "and `aspire-bench bench` for the CPU)")
        return 1
    t0 = time.time()
    a.out.mkdir(parents=True, exist_ok=True)
    info = device_info()
    (a.out / "device.json").write_text(json.dumps(info, indent=1))
    print(info, flush=True)
    # The tiny model gets ~60% of the budget; the 1.7B shape's step costs need far less.
    tiny_deadline = t0 + 0.6 * a.budget_s
    status = {}
    try:
        part_tiny(a.out, contexts, repeat, new_tokens, tiny_deadline, device, backend, requests)
        status["bench"] = "ok"
    except Exception as e:  # noqa: BLE001 -- record and go on: part 2 does not depend on part 1
        status["bench"] = f"failed: {type(e).__name__}: {e}"
        print(status["bench"], flush=True)
    shape_results = []
    try:
        shape_results = part_shape(a.out, shape, shape_contexts, 3 if a.dry_run else 10, t0 + a.budget_s,
                                   shape_dtype, device, backend)
        status["step_costs"] = "ok"
    except Exception as e:  # noqa: BLE001 -- recorded in device.json; the next part still runs
        status["step_costs"] = f"failed: {type(e).__name__}: {e}"
        print(status["step_costs"], flush=True)
    try:  # seconds of CPU: runs after the budget too
        part_simulator(a.out, info.get("gpu"), shape, shape_dtype, shape_results, a.dry_run)
        status["simulator"] = "ok"
    except Exception as e:  # noqa: BLE001 -- recorded in device.json; the next part still runs
        status["simulator"] = f"failed: {type(e).__name__}: {e}"
        print(status["simulator"], flush=True)
    info.update(status=status, wall_s=round(time.time() - t0, 1))
    (a.out / "device.json").write_text(json.dumps(info, indent=1))
    print(f"done in {info['wall_s']} s: {status}")
    return 0 if all(v == "ok" for v in status.values()) else 2


if __name__ == "__main__":
    sys.exit(main())
