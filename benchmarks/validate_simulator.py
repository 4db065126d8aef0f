"""The simulator against measurement: every measured run of a store replayed with its own trace.

    python -m benchmarks.validate_simulator --store S [--calibration C.json] [--json out.json]
    python -m benchmarks.validate_simulator --store S --steps | --without beta_capture
    python -m benchmarks.validate_simulator --store S --projection [--hardware cpu-measured | calibrated]

Per run: measured and simulated decode tok/s and their error, and for speculative runs the ratio
over the group's AR run; a row passes within ±10% (ASPIRE's ratio within ±5%; docs/simulator.md).
Step costs: the run's stored calibration unless --calibration is given. `--steps` adds the cost
model's error per kind of step; `--without TERM` refits the stored calibrations without that term
(`--without beta_layered,beta_topk`: Vegas's steps priced as by a calibration made before those terms).
`--projection` checks the projection instead of the replay: each run becomes a parametric
simulation (its model's shape on the --hardware roofline, or with `--hardware calibrated` the step
costs its own machine timed in the run, and its context, batch, request count, output
length and settings) driven by the acceptance it measured per request, as `simulate --acceptance-from`
and benchmarks/project_paper.py project it. Nothing is written to the store.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from aspire_bench.decoders.scheduler import EXTRA_TERMS, SHAPED_TERMS, fit_cost_model
from aspire_bench.errors import UserError
from aspire_bench.harness.records import ROW_COLUMNS, row_kv_captured, row_kv_shaped, row_kv_sparse
from aspire_bench.harness.store import Store
from aspire_bench.simulator.rows import speedups, stored_cost, stored_rows

TOK_S_TOL, RATIO_TOL = 0.10, 0.05
CALIBRATED = "calibrated"  # --hardware: each run's stored calibration (the step costs its machine timed)


def refitted(store, without):
    """A function of a run giving its stored calibration refitted from its samples without the terms
    `without` (None when nothing is left out)."""
    if not without:
        return None

    def cost(record):
        info = dict(record.info)
        for key in ("adjacent_calibration", "interleaved_calibration"):
            cal = record.section(key)
            if cal:
                if not cal.get("samples"):
                    raise UserError(f"run {record.run_id} kept no calibration samples: --without needs a store "
                                    "made by `aspire-bench bench` since the samples are kept")
                kept = {k: v for k, v in cal.items() if k not in SHAPED_TERMS}  # absent from a fit without them
                info[key] = {**kept, **fit_cost_model(cal["samples"], without=without).to_dict(),
                             "source": cal.get("source", key)}
        return stored_cost(store, replace(record, info=info), None)
    return cost


def projected_rows(store, ids, hardware: str, without=()) -> list[dict]:
    """Rows as stored_rows gives them, each run simulated as a projection of its own setting: its
    model on the `hardware` roofline (or, for "calibrated", its own stored calibration, refitted
    without the terms `without` when given), the acceptance it measured per request, its settings."""
    from statistics import median

    from aspire_bench.harness.metrics import decode_tok_s
    from aspire_bench.simulator.costs import DTYPE_BYTES, Hardware, ModelShape, Roofline
    from aspire_bench.simulator.source import (
        measured_acceptance,
        model_config_path,
        num_layers_of,
        simulate_parametric,
    )
    hw, rows = None if hardware == CALIBRATED else Hardware.load(hardware), []
    for rid in ids:
        rec = store.get_run(rid)
        c = rec.config
        dtype = c.get("dtype") if c.get("dtype") in DTYPE_BYTES else None
        cost = ((refitted(store, without) or (lambda r: stored_cost(store, r, None)))(rec) if hw is None else
                Roofline(hw, ModelShape.load(str(model_config_path(c["model"])), dtype)))
        table = measured_acceptance(store, [rid]) if rec.requests and any(r.verifications for r in rec.requests) else {}
        context = int(median(r.prompt_len for r in rec.requests))
        out, _ = simulate_parametric(c["decoder"], cost, table, context, c["batch_size"], len(rec.requests),
                                     c["max_new_tokens"], int(c.get("page_size", 16)), num_layers_of(c["model"]),
                                     settings=rec.info)
        measured = rec.aggregates.get("decode_tok_s_median", rec.aggregates.get("decode_tok_s"))
        rows.append({"decoder": c["decoder"], "run_id": rid, "group": rec.group, "context": c.get("context_len"),
                     "batch_size": c["batch_size"], "temperature": c.get("temperature"),
                     "gamma": out.info.get("gamma") if out.info.get("policy", "fixed") == "fixed" else None,
                     "simulated_decode_tok_s": decode_tok_s(out), "measured_decode_tok_s": measured})
    speedups(rows, key=lambda r: (r["group"], r["context"], r["batch_size"], r["temperature"]))
    return rows


def validate(store_path: str, decoders, calibration: str | None = None, without=(),
             projection: str | None = None) -> list[dict]:
    """projection: a hardware profile to check the projection on instead of the replay."""
    with Store(store_path, readonly=True) as store:
        ids = [s["run_id"] for s in store.list_runs(kind="measured")
               if s["status"] == "ok" and s["decoder"] in decoders]
        if projection:
            rows = projected_rows(store, ids, projection, without)
        else:
            rows, _ = stored_rows(store, ids, calibration, refitted(store, without))
    for r in rows:
        m, s = r["measured_decode_tok_s"], r["simulated_decode_tok_s"]
        r["error"] = s / m - 1 if m and s else None
        mr, sr = r["measured_speedup_vs_ar"], r["simulated_speedup_vs_ar"]
        r["ratio_error"] = sr / mr - 1 if mr and sr and r["decoder"] != "ar" else None
        # The ratio criterion is ASPIRE's (its speedup is the figure that matters); other ratios are shown.
        r["ok"] = (r["error"] is not None and abs(r["error"]) <= TOK_S_TOL
                   and (r["ratio_error"] is None or not r["decoder"].startswith("aspire")
                        or abs(r["ratio_error"]) <= RATIO_TOL))
    return rows


def step_kinds(store_path: str, decoders, calibration: str | None = None, without=()) -> list[dict]:
    """Per run and kind of step: steps, measured and modelled mean ms, error of the model."""
    kind, n, kv = (ROW_COLUMNS.index(c) for c in ("kind", "n_tokens", "kv_read"))
    out = []
    with Store(store_path, readonly=True) as store:
        for s in store.list_runs(kind="measured"):
            if s["status"] != "ok" or s["decoder"] not in decoders:
                continue
            record = store.get_run(s["run_id"])
            cost = stored_cost(store, record, calibration, refitted(store, without))
            by_kind: dict[str, list[float]] = {}
            for step in record.steps:
                kinds = {r[kind] for r in step.rows}
                key = "prefill" if "prefill" in kinds else "+".join(sorted(kinds))
                acc = by_kind.setdefault(key, [0, 0.0, 0.0])
                acc[0] += 1
                acc[1] += step.t_end - step.t_start
                acc[2] += cost.step_time([(r[kind], r[n], r[kv], row_kv_sparse(r), row_kv_captured(r), *row_kv_shaped(r))
                                          for r in step.rows])
            for key, (count, measured, model) in sorted(by_kind.items()):
                out.append({"run_id": record.run_id, "decoder": s["decoder"], "context": record.config.get("context_len"),
                            "step_kind": key, "steps": count, "measured_ms": measured / count * 1e3,
                            "model_ms": model / count * 1e3, "error": model / measured - 1})
    return out


def step_table(rows: list[dict]) -> str:
    lines = ["| run | decoder | context | step kind | steps | measured ms | model ms | error |",
             "|---:|---|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['run_id']} | {r['decoder']} | {r['context']} | {r['step_kind']} | {r['steps']} "
              f"| {r['measured_ms']:.2f} | {r['model_ms']:.2f} | {r['error']:+.1%} |" for r in rows]
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)
    head = ("| decoder | γ | context | batch | sampling | run | measured tok/s | simulated tok/s | error "
            "| measured × AR | simulated × AR | ratio error | within ±10% / ±5% |")
    lines = [head, "|" + "---|" * 4 + "---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        sampling = "greedy" if not r["temperature"] else "paper" if r["temperature"] == 0.7 else r["temperature"]
        lines.append(f"| {r['decoder']} | {f(r['gamma'], 'd')} | {r['context']} | {r['batch_size']} | {sampling} "
                     f"| {r['run_id']} | {f(r['measured_decode_tok_s'], '.1f')} | {f(r['simulated_decode_tok_s'], '.1f')} "
                     f"| {f(r['error'], '+.1%')} | {f(r['measured_speedup_vs_ar'], '.3f')} "
                     f"| {f(r['simulated_speedup_vs_ar'], '.3f')} | {f(r['ratio_error'], '+.1%')} "
                     f"| {'yes' if r['ok'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--calibration", default=None, help="a calibration file (default: each run's stored one)")
    ap.add_argument("--decoders", default="ar,magicdec,aspire", help="comma-separated (default: %(default)s)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--steps", action="store_true", help="also the model's error per kind of step")
    ap.add_argument("--projection", action="store_true",
                    help="check the projection (parametric, measured acceptance, a roofline) instead of the replay")
    ap.add_argument("--hardware", default="cpu-measured",
                    help=f"the roofline of --projection, or {CALIBRATED!r}: each run's own stored calibration, the "
                         "step costs timed on its machine (default: %(default)s)")
    terms = EXTRA_TERMS + SHAPED_TERMS
    ap.add_argument("--without", default="", help=f"comma-separated terms to refit without ({', '.join(terms)})")
    a = ap.parse_args(argv)
    decoders = [d for d in a.decoders.split(",") if d]
    without = tuple(t for t in a.without.split(",") if t)
    if set(without) - set(terms):
        ap.error(f"--without takes {', '.join(terms)}, not {a.without!r}")
    if without and a.calibration:
        ap.error("--without refits each run's stored calibrations: leave out --calibration")
    if a.projection and (a.calibration or a.steps or (without and a.hardware != CALIBRATED)):
        ap.error("--projection prices every step with --hardware's roofline or each run's calibration: leave out "
                 f"--calibration and --steps (and --without but with --hardware {CALIBRATED})")
    try:
        rows = validate(a.store, decoders, a.calibration, without, a.hardware if a.projection else None)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    n_ok = sum(r["ok"] for r in rows)
    print(f"\n{n_ok}/{len(rows)} runs within ±{TOK_S_TOL:.0%} decode tok/s (and ASPIRE's ratio over AR "
          f"within ±{RATIO_TOL:.0%})")
    if a.steps:
        print("\n" + step_table(step_kinds(a.store, decoders, a.calibration, without)))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
