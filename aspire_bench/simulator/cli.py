"""`aspire-bench simulate`: a stored run's trace, or a parametric setting, through the simulator."""
from __future__ import annotations

import json

import click
from rich.table import Table

from ..cli_types import (
    REQUESTS,
    SEED,
    TokenCount,
    csv_batch_sizes,
    csv_list,
    csv_positive_ints,
    examples,
    hidden_alias,
    merge_alias,
    new_output_path,
)
from ..errors import UserError
from ..harness.store import DEFAULT_PATH, Store
from ..harness.tables import emit, info

ASSUMPTIONS = (
    ("Step times come from the cost model alone: host time outside engine forwards (sampling, Python "
    "scheduling) is not modelled beyond what the model's fixed term absorbs."),
    ("Each decoder's scheduling is replayed with its own settings; ASPIRE decides with the cost model its "
    "run used (stored runs) or a calibration-like fit of the step-cost model (parametric)."),
)


def _contexts(ctx, param, value):
    if value is None:
        return None
    return [TokenCount().convert(x, param, ctx) for x in csv_list(ctx, param, value)]


def _batches(ctx, param, value):
    return None if value is None else csv_batch_sizes(ctx, param, value)


@click.command("simulate", epilog=examples(
    "aspire-bench simulate --run 6 --json -",
    "aspire-bench simulate --store results.db --acceptance-from 7,8,9 --tune --hardware h200 --model-shape qwen3-1.7b"))
@click.option("--store", "store_path", default=DEFAULT_PATH, show_default=True, envvar="ASPIRE_BENCH_STORE",
              type=click.Path(dir_okay=False),
              help="Results store: the runs to replay come from it, and simulated runs are saved to it.")
@click.option("--run", "run_ids", multiple=True, type=int, help="A stored run to replay (repeatable).")
@click.option("--group", default=None, help="Replay every successful measured run of this group.")
@click.option("--calibration", default=None, type=click.Path(dir_okay=False),
              help="Step costs from this calibration file (`aspire-bench calibrate --out`). Default for stored "
                   "runs: the calibration their group's ASPIRE run used.")
@click.option("--hardware", default=None,
              help="Step costs from a roofline of this hardware profile: h100, h100-nvl, h200, a100, cpu-measured "
                   "or a JSON file.")
@click.option("--model-shape", default=None,
              help="Model shape for the roofline: qwen3-1.7b, qwen3-8b, or a Hugging Face config.json (or its "
                   "folder). Default for stored runs: the run's model's config.json.")
@click.option("--dtype", default=None, type=click.Choice(["bfloat16", "float16", "float32"]),
              help="Weights and KV dtype for the roofline (default: the dtype a stored run ran in, else the "
                   "shape's torch_dtype).")
@click.option("--decoders", default=None, callback=lambda c, p, v: csv_list(c, p, v) if v else None,
              help="Parametric mode: the decoders to simulate (default: every built-in decoder that is not an "
                   "ablation and can be simulated without a stored run).")
@click.option("--context-len", "contexts", default=None, callback=_contexts,
              help="Parametric mode: prompt lengths, comma-separated (16k,32k).  [default: 16k]")
@hidden_alias("--context", "contexts_alias", callback=_contexts)
@click.option("--batch-size", "batches", default=None, callback=_batches,
              help="Parametric mode: batch sizes, comma-separated.  [default: 8]")
@hidden_alias("--batch", "batches_alias", callback=_batches)
@click.option("--alpha", default=None,
              help="Parametric mode: per-token acceptance: a number, kind=alpha pairs (aspire=0.95,magicdec=0.9) "
                   "or a JSON table {kind: [[context, alpha], ...]}.")
@click.option("--alpha-from-runs", default=None, callback=lambda c, p, v: csv_positive_ints(c, p, v) if v else None,
              help="Parametric mode: acceptance measured by these stored runs (comma-separated ids in --store): per "
                   "draft kind, the per-token alpha that best explains each run's verifications, by its context.")
@click.option("--acceptance-from", default=None, callback=lambda c, p, v: csv_list(c, p, v) if v else None,
              metavar="RUN_ID,...|GROUP",
              help="Parametric mode: acceptance measured per request by these stored runs of --store (or every "
                   "speculative run of a group): each simulated request replays a measured request's accepts "
                   "and rejects, per decoder and draft kind, so requests differ as measured.")
@click.option("--tune/--no-tune", default=False, show_default=True,
              help="Parametric mode: simulate each decoder with a tuning grid (its tune_grid) at "
                   "every point of it and keep the fastest, as bench's tuned rows.")
@click.option("--requests", "n_requests", default=None, type=REQUESTS,
              help="Parametric mode: requests per cell (default 4 x batch).")
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(min=2),
              help="Parametric mode: output tokens per request.")
@click.option("--seed", default=0, show_default=True, type=SEED)
@click.option("--save/--no-save", default=True, show_default=True,
              help="Store the results as runs of kind 'simulated' (never ranked on the leaderboard).")
@click.option("--json", "json_out", is_flag=False, flag_value="-", default=None, metavar="PATH", callback=new_output_path,
              help="Write the rows as a JSON list to PATH; - (or --json alone) prints them instead of the table.")
def simulate_command(store_path, run_ids, group, calibration, hardware, model_shape, dtype, decoders, contexts,
                     contexts_alias, batches, batches_alias, alpha, alpha_from_runs, acceptance_from, tune,
                     n_requests, max_new_tokens, seed, save, json_out):
    """Predict decode throughput by replaying decoders' scheduling with a step-cost model.

    With --run/--group: the stored runs' own traces (requests, acceptance outcomes, settings) replayed
    with this machine's calibration (or a roofline). Without: a parametric setting (--model-shape,
    --hardware or --calibration, --context-len, --batch-size, --alpha)."""
    from ..decoders import BUILTIN, trait
    contexts = merge_alias(contexts, contexts_alias, [16 * 1024], "--context-len", "--context")
    batches = merge_alias(batches, batches_alias, [8], "--batch-size", "--batch")
    from .rows import parametric_rows, stored_rows
    from .rows import save as save_records
    stored = bool(run_ids or group)
    if stored and (acceptance_from or tune):
        raise UserError("--acceptance-from and --tune set up a parametric simulation: a stored run replays its "
                        "own acceptance and settings; leave out --run/--group or those options")
    if hardware is None and model_shape and stored:
        raise UserError("--model-shape needs --hardware (it shapes the roofline): add --hardware")
    roofline = None
    if hardware and (model_shape or not stored):
        roofline = _roofline(hardware, model_shape, dtype)
    elif hardware:  # each stored run's own model and dtype
        roofline = _run_roofline(hardware, dtype)
    if stored:
        with Store(store_path, readonly=True) as store:
            ids = list(run_ids)
            if group:
                found = [s["run_id"] for s in store.list_runs(group=group, kind="measured") if s["status"] == "ok"]
                if not found:
                    raise UserError(f"no successful measured runs in group {group!r}: `aspire-bench runs` lists groups")
                ids += found
            rows, recs = stored_rows(store, ids, calibration, roofline)
    else:
        from .acceptance import parse_alpha
        from .costs import CalibratedCost, ModelShape
        from .source import calibration_file
        if not model_shape:
            raise UserError("a parametric simulation needs --model-shape (qwen3-1.7b, qwen3-8b or a config.json); "
                            "to replay a stored run pass --run RUN_ID")
        if roofline is None and not calibration:
            raise UserError("a parametric simulation needs step costs: pass --hardware PROFILE or --calibration FILE")
        shape = ModelShape.load(model_shape, dtype)
        decoders = decoders or [d for d in BUILTIN if not trait(d, "ablation") and trait(d, "simulated") is True]
        cost = roofline or CalibratedCost(calibration_file(calibration))
        if sum(map(bool, (alpha, alpha_from_runs, acceptance_from))) > 1:
            raise UserError("--alpha, --alpha-from-runs and --acceptance-from each give the acceptance: pass one")
        if acceptance_from:
            from .source import measured_acceptance
            with Store(store_path, readonly=True) as store:
                table = measured_acceptance(store, acceptance_from)
        elif alpha_from_runs:
            from .source import measured_alphas
            with Store(store_path, readonly=True) as store:
                table = measured_alphas(store, alpha_from_runs)
        else:
            table = parse_alpha(alpha) if any(trait(d, "draft_kind") for d in decoders) else {}
        rows, recs = parametric_rows(decoders, cost, table, contexts, batches, n_requests, max_new_tokens,
                                     shape.name, shape.layers, seed=seed, tune=tune)
    if save:
        for row, rid in zip(rows, save_records(store_path, recs)):
            row["stored_run_id"] = rid
    as_json = json_out == "-"
    fmt = "json" if as_json else None
    if json_out is not None and not as_json:
        from ..atomic import write_text
        write_text(json_out, json.dumps(rows, indent=1, default=str))
    if as_json:
        click.echo(json.dumps(rows, indent=1, default=str))
    else:
        emit(_table(rows), fmt)
        for line in _assumption_lines(rows):
            click.echo(f"- {line}")
    if save:
        info(f"stored {len(recs)} simulated run(s) in {store_path} (kind 'simulated')", fmt)


def _roofline(hardware, model_shape, dtype):
    from .costs import Hardware, ModelShape, Roofline
    if not model_shape:
        raise UserError("--hardware needs --model-shape (qwen3-1.7b, qwen3-8b or a config.json)")
    return Roofline(Hardware.load(hardware), ModelShape.load(model_shape, dtype))


def _run_roofline(hardware, dtype):
    """A roofline per stored run: its model's config.json, in the dtype it ran (or --dtype)."""
    from .costs import Hardware, Roofline
    from .source import run_shape
    hw = Hardware.load(hardware)
    return lambda record: Roofline(hw, run_shape(record, dtype))


def _num(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def _table(rows) -> Table:
    t = Table(title="simulated decode throughput")
    for h in ("decoder", "run", "context", "batch", "γ", "simulated tok/s", "measured tok/s", "error",
              "sim × AR", "measured × AR", "sim TPOT p50 ms", "sim acc len"):
        t.add_column(h, justify="left" if h == "decoder" else "right")
    for r in rows:
        sim, meas = r["simulated_decode_tok_s"], r["measured_decode_tok_s"]
        err = f"{sim / meas - 1:+.1%}" if sim and meas else "-"
        tpot = r["simulated_tpot_p50_s"]
        t.add_row(r["decoder"], _num(r["run_id"], "d"), str(r["context"]), str(r["batch_size"]), _num(r["gamma"], "d"),
                  _num(sim), _num(meas), err, _num(r["simulated_speedup_vs_ar"], ".2f"),
                  _num(r["measured_speedup_vs_ar"], ".2f"), _num(tpot and tpot * 1e3, ".2f"),
                  _num(r["simulated_mean_accepted_len"], ".2f"))
    return t


def _assumption_lines(rows) -> list[str]:
    """The assumptions of the rows, each distinct one once: step costs, acceptance, requests."""
    lines = list(ASSUMPTIONS)
    for r in rows:
        a = r["assumptions"]
        costs = (f"step costs: roofline of {a['hardware']['name']} for {a['model_shape']['name']} "
                 f"({a['model_shape']['dtype']})" if a["cost_model"] == "roofline" else
                 f"step costs: calibration {a.get('source')}")
        if a["acceptance"] == "parametric":
            alphas = ", ".join(f"{a_:.3f} at {c:g}" if c else f"{a_:.3f}" for c, a_ in a["alpha_by_context"])
            acc = f"acceptance: {a['draft_kind']} drafts, per-token alpha {alphas}, independent per token"
        elif a["acceptance"] == "measured":
            acc = (f"acceptance: {a['draft_kind']} drafts, each request replays one of {a['measured_requests']} "
                   f"requests measured by run(s) {', '.join(map(str, a['source_runs']))} at "
                   f"{'/'.join(map(str, a['measured_contexts']))} prompt tokens (alpha {a['alpha_pooled']:.3f} "
                   f"pooled, {a['alpha_per_request_range'][0]:.2f}-{a['alpha_per_request_range'][1]:.2f} per "
                   "request), whatever the simulated context")
        elif a["acceptance"] == "replay":
            acc = "acceptance: the run's own verifications, replayed token by token"
        else:
            acc = None
        d = a.get("draft_model")
        draft = d and (f"draft model {d['checkpoint']} ({d['layers']} layers, width {d['hidden']}, {d['kv_heads']} KV "
                       "heads): each draft forward reads its weights and the request's KV in it, priced by "
                       + ("the same roofline" if a["cost_model"] == "roofline" else
                          "the calibration scaled to its size"))
        for line in (costs, acc, draft, f"requests: {a['requests']}", f"not modelled: {a['not_modelled']}"):
            if line and line not in lines:
                lines.append(line)
    return lines


COMMANDS = [simulate_command]
