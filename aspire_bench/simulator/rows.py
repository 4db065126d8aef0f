"""The simulator's results: one row per simulated decoder, with the measured figures beside them.

`simulate --json` prints these rows (keys `decoder`, `simulated_decode_tok_s`, `measured_decode_tok_s`
and the others below); benchmarks/validate_simulator.py and benchmarks/gpu_decoders.py build them the same way.
"""
from __future__ import annotations

from functools import partial

from ..errors import UserError
from ..harness import records
from .costs import CalibratedCost
from .source import (
    calibration_file,
    simulate_parametric,
    simulate_stored,
    stored_calibration,
    to_record,
)


def _gamma(settings: dict):
    """The fixed draft length, None for an adaptive scheduler (or AR)."""
    return settings.get("gamma") if settings.get("policy", "fixed") == "fixed" else None


def _tpot(agg: dict):
    return agg.get("tpot_p50_s")


def stored_cost(store, record, calibration: str | None, cost=None):
    """The step-cost model for a stored run: `cost` when given (a roofline, or a function of the run
    that gives a step-cost model), else --calibration, else the calibration the run's group used."""
    if cost is not None:
        return cost(record) if callable(cost) else cost
    if calibration:
        return CalibratedCost(calibration_file(calibration))
    model = stored_calibration(store, record)
    if model is None:
        raise UserError(f"run {record.run_id} has no calibration in its group (no ASPIRE run with a "
                        "calibrated cost model): pass --calibration FILE (`aspire-bench calibrate --out FILE`)")
    return CalibratedCost(model)


def stored_rows(store, run_ids, calibration: str | None = None, cost=None) -> tuple[list[dict], list]:
    """(rows, simulated run records) for stored runs; speedups over the AR run of the same group
    when it is among them."""
    rows, recs = [], []
    for rid in run_ids:
        record = store.get_run(int(rid))
        if record.status != "ok":
            raise UserError(f"run {rid} failed ({record.error}): simulate a run that finished")
        out, assumptions = simulate_stored(record, stored_cost(store, record, calibration, cost))
        sim = to_record(out, {**record.config, "_prompt_lens": [r.prompt_len for r in record.requests]},
                        assumptions, record.env, group=None)
        recs.append(sim)
        measured = dict(record.aggregates) if record.kind == "measured" else {}
        # the run's figure over its repeats (a single repeat carries the machine's drift of the moment)
        measured["decode_tok_s"] = measured.get("decode_tok_s_median", measured.get("decode_tok_s"))
        rows.append({
            "decoder": record.config.get("decoder"), "run_id": record.run_id, "group": record.group,
            "context": record.config.get("context_len"), "batch_size": record.config.get("batch_size"),
            "temperature": record.config.get("temperature"), "gamma": _gamma(record.info),
            "simulated_decode_tok_s": sim.aggregates.get("decode_tok_s"),
            "measured_decode_tok_s": measured.get("decode_tok_s"),
            "simulated_tpot_p50_s": _tpot(sim.aggregates), "measured_tpot_p50_s": _tpot(measured),
            "simulated_mean_accepted_len": sim.aggregates.get("mean_accepted_len"),
            "measured_mean_accepted_len": measured.get("mean_accepted_len"),
            "assumptions": assumptions,
        })
    speedups(rows, key=lambda r: (r["group"], r["context"], r["batch_size"], r["temperature"]))
    return rows, recs


def parametric_rows(decoders, cost, table, contexts, batches, n_requests: int | None, max_new: int,
                    shape_name: str, num_layers: int, page_size: int = 16, seed: int = 0,
                    tune: bool = False) -> tuple[list[dict], list]:
    """tune: a decoder with a tune_grid is simulated at every point of it and its row is the fastest
    point's (as bench's tuned row); `tuned` holds every point's simulated tok/s."""
    rows, recs = [], []
    for context in contexts:
        for batch in batches:
            n = n_requests or 4 * batch
            for name in decoders:
                out, assumptions, tuned = _best(name, tune, partial(
                    simulate_parametric, name, cost, table, context, batch, n, max_new, page_size, num_layers, seed))
                config = {"model": shape_name, "decoder": name, "task": "parametric", "context_len": context,
                          "batch_size": batch, "max_new_tokens": max_new, "seed": seed, "_prompt_lens": [context] * n}
                sim = to_record(out, config, assumptions, {"simulated": True})
                recs.append(sim)
                rows.append({
                    "decoder": name, "run_id": None, "context": context, "batch_size": batch,
                    "gamma": _gamma(out.info), "tuned": tuned,
                    "simulated_decode_tok_s": sim.aggregates.get("decode_tok_s"), "measured_decode_tok_s": None,
                    "simulated_tpot_p50_s": _tpot(sim.aggregates), "measured_tpot_p50_s": None,
                    "simulated_mean_accepted_len": sim.aggregates.get("mean_accepted_len"),
                    "measured_mean_accepted_len": None, "assumptions": assumptions,
                })
    speedups(rows, key=lambda r: (r["context"], r["batch_size"]))
    return rows, recs


def _best(name: str, tune: bool, run) -> tuple:
    """(output, assumptions, tuned) of `run(settings=...)` at the decoder's defaults, or with `tune` at the
    point of its tune_grid with the highest simulated decode tok/s (the first on a tie)."""
    from ..harness.metrics import decode_tok_s
    from ..harness.tuning import grid_points, label
    points = grid_points(name, {}) if tune else []
    if not points:
        return (*run(), None)
    outs = [(p, run(settings=p)) for p in points]
    speed = {label(p): decode_tok_s(o[0]) or 0.0 for p, o in outs}
    best, (out, assumptions) = max(outs, key=lambda po: speed[label(po[0])])
    return out, assumptions, {"settings": best, "decode_tok_s": speed}


def speedups(rows: list[dict], key) -> None:
    """speedup over the AR row of the same cell (null without one)."""
    ar = {key(r): r for r in rows if r["decoder"] == "ar"}
    for r in rows:
        ref = ar.get(key(r))
        for which in ("simulated", "measured"):
            num, den = r[f"{which}_decode_tok_s"], ref and ref[f"{which}_decode_tok_s"]
            r[f"{which}_speedup_vs_ar"] = num / den if num and den else None


def save(store_path: str, recs: list) -> list[int]:
    """Store simulated records under one new group (their speedups are taken within it)."""
    from ..harness.store import save_record
    group = records.new_group_id()
    ids = []
    for rec in recs:
        rec.group = group
        ids.append(save_record(store_path, rec))
    return ids
