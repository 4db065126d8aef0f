"""Simulations of a stored run (its own trace) or of a parametric setting, as run records.

A stored run gives the requests (prompt lengths, output lengths, prefill rows), the acceptance
(its verifications, replayed token by token) and the decoder's settings (its `info`, including the
cost model ASPIRE's scheduler used). The step-cost model is this machine's calibration unless a
roofline is asked for. A parametric setting gives the same from flags.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from ..decoders import trait
from ..decoders.base import DRAFT
from ..decoders.scheduler import CostModel, fit_problem
from ..errors import UserError
from ..harness import records
from .acceptance import MeasuredAcceptance, ParametricAcceptance, ReplayAcceptance, token_stream
from .costs import DTYPE_BYTES, ModelShape
from .policies import SimPolicy, acceptance_keys, lineage
from .replay import SimRequest, simulate

# Aggregates about the output text: a simulation has no text.
TEXT_AGGREGATES = ("distinct4_mean", "distinct4_min", "repetition_collapse_n", "score_n", "score_mean")
CALIBRATION_SOURCES = ("calibration", "calibration:")


def stored_calibration(store, record: records.RunRecord) -> CostModel | None:
    """This machine's calibration for the run: for a bench run, the calibration round timed right
    after its traced repeat (the machine as the trace saw it; this VM's memory speed moves within
    minutes), or when that round's fit fails the quality check (a disturbance during its second)
    all the cell's rounds pooled; else the cost model of the group's ASPIRE run (its own first),
    when it came from a calibration with all its terms."""
    for key in ("adjacent_calibration", "interleaved_calibration"):
        cm = record.section(key)
        model = CostModel.from_dict(cm, str(cm.get("source", key.replace("_", " ")))) if cm else None
        if model is not None and fit_problem(model) is None:
            return model
    cands = [record]
    if record.group:
        cands += [store.get_run(s["run_id"]) for s in store.list_runs(group=record.group)
                  if s["run_id"] != record.run_id]
    for rec in cands:
        cm = rec.info.get("cost_model")
        if cm and str(cm.get("source", "")).startswith(CALIBRATION_SOURCES) and rec.info.get("cost_terms") != "paper":
            return CostModel.from_dict(cm, str(cm["source"]))
    return None


def calibration_file(path: str) -> CostModel:
    from ..decoders.calibration import cost_model_from, read_calibration
    p = Path(path)
    calibration = read_calibration(p, "--calibration")
    try:
        return cost_model_from(calibration, f"calibration:{p.name}")
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--calibration {path} is not a calibration ({e}): run `aspire-bench calibrate --out "
                        f"{path}`") from None


def model_config_path(model: str) -> Path:
    from ..engine.loading import resolve_model_path
    try:
        return resolve_model_path(model) / "config.json"
    except UserError as e:
        raise UserError(f"the run's model {model!r} is not on this machine ({e}): pass --model-shape with its "
                        "config.json") from None


def num_layers_of(model: str) -> int:
    from ..engine.loading import read_config, resolve_model_path
    try:
        return read_config(resolve_model_path(model)).num_layers
    except Exception as e:  # noqa: BLE001 — any unreadable checkpoint is the same user error
        raise UserError(f"the run's model {model!r} cannot be read for its layer count ({e}): simulate on the "
                        "machine that has the checkpoint") from None


def requests_of(record: records.RunRecord) -> list[SimRequest]:
    """The run's requests with their prefill rows; a prefill row that reads no KV of the target is the
    policy's own model's prefill (the loop records a draft model's so)."""
    prefill, own = defaultdict(list), defaultdict(list)
    for step in record.steps:
        for row in step.rows:
            if row[1] == "prefill" and int(row[6]) == 0:
                own[row[0]].append(int(row[2]))
            elif row[1] == "prefill":
                prefill[row[0]].append((int(row[2]), int(row[6]), records.row_kv_captured(row),
                                        records.row_kv_shaped(row)[1]))
    return [SimRequest(r.id, r.prompt_len, len(r.output_ids), prefill.get(r.id, []), own.get(r.id, []))
            for r in record.requests]


def run_shape(record: records.RunRecord, dtype: str | None = None) -> ModelShape:
    """The shape of the run's model, in `dtype` (default: the dtype it ran in)."""
    dtype = dtype or record.config.get("dtype")
    return ModelShape.load(str(model_config_path(record.config["model"])), dtype if dtype in DTYPE_BYTES else None)


def own_cost(policy: SimPolicy, cost, record: records.RunRecord) -> tuple:
    """(the step-cost model of the policy's own model's forwards, its assumptions): `cost` for a draft
    model's shape; (None, {}) for a policy without a model of its own."""
    if policy.own_model is None:
        return None, {}
    shape = ModelShape.load(str(policy.own_model))
    priced = cost.for_model(shape, lambda: run_shape(record))
    return priced, {"draft_model": {"checkpoint": str(policy.own_model), **asdict(shape)},
                    "draft_step_costs": priced.describe()}


def simulate_stored(record: records.RunRecord, cost) -> tuple:
    """(GenerationOutput, assumptions) of the run's own trace replayed through its decoder's
    scheduling with the step-cost model `cost`."""
    name = record.config.get("decoder")
    batch = record.config.get("batch_size")
    if not isinstance(batch, int) or not record.requests:
        raise UserError(f"run {record.run_id} has no batch size or no requests: it cannot be replayed")
    layers, sched_cost = 0, None
    if trait(name, "uses_cost_model"):
        layers = num_layers_of(record.config["model"])
        cm = record.info.get("cost_model")  # the cost model the run's scheduler decided with
        sched_cost = (CostModel.from_dict(cm, str(cm.get("source"))) if cm else
                      cost.scheduler_model(batch, max(r.prompt_len for r in record.requests)))
    drafts = defaultdict(list)  # per request, the scattered positions each of its draft rows read
    for step in record.steps:
        for row in step.rows:
            if row[1] == DRAFT:
                drafts[row[0]].append(records.row_kv_sparse(row))
    recorded = {r.id: [tuple(v) for v in r.verifications] for r in record.requests}
    policy = SimPolicy(name, record.info, sched_cost, int(record.config.get("page_size", 16)), layers, drafts,
                       recorded)
    acceptance = ReplayAcceptance({r.id: token_stream(r.verifications) for r in record.requests})
    reqs = requests_of(record)
    drafter, drafter_assumptions = own_cost(policy, cost, record)
    out = simulate(reqs, policy, acceptance, cost, batch, info=policy.settings, own_cost=drafter)
    assumptions = {
        "source_run": record.run_id, **cost.describe(), **acceptance.describe(), **drafter_assumptions,
        "scheduler_cost_model": sched_cost.to_dict() if sched_cost else None,
        "requests": "the run's own: prompt and output lengths, prefill rows (costed by the model)",
        "not_modelled": "host time outside engine forwards (sampling, scheduling, Python) beyond what the "
                        "cost model's fit absorbs; timing noise",
    }
    return out, assumptions


def measured_alphas(store, run_ids) -> dict[str, list[tuple[float, float]]]:
    """An acceptance table from stored runs: per draft kind, (median prompt length, the per-token
    alpha that best explains the run's verifications) for each run."""
    from statistics import median

    from .acceptance import alpha_mle
    table: dict[str, list[tuple[float, float]]] = {}
    for rid in run_ids:
        rec = store.get_run(int(rid))
        name = rec.config.get("decoder")
        alpha = alpha_mle([v for r in rec.requests for v in r.verifications])
        if alpha is None:
            raise UserError(f"run {rid} ({name}) has no verifications to estimate an acceptance from: pass runs "
                            "of a speculative decoder")
        kind = lineage(name)[-1]  # an ablation's acceptance stands for its base decoder's
        table.setdefault(kind, []).append((float(median(r.prompt_len for r in rec.requests)), alpha))
    return table


def measured_acceptance(store, sources) -> MeasuredAcceptance:
    """Per-request acceptance of stored runs (`sources`: run ids, or groups standing for their successful
    measured runs of speculative decoders), keyed by each run's decoder and, but for an ablation, its
    draft kind. Runs of one decoder pool their requests."""
    ids: list[int] = []
    for src in sources:
        # a group first: a group id (12 hex digits) may be all digits
        found = [r["run_id"] for r in store.list_runs(group=str(src), kind="measured")
                 if r["status"] == "ok" and trait(r["decoder"], "draft_kind")]
        if found:
            ids += found
        elif str(src).isdigit():
            ids.append(int(src))
        else:
            raise UserError(f"--acceptance-from {src}: no run id, nor a group with successful measured runs of a "
                            "speculative decoder: `aspire-bench runs` lists them")
    streams: dict[str, list[list[bool]]] = {}
    runs: dict[str, list[int]] = {}
    contexts: dict[str, list[int]] = {}
    for rid in dict.fromkeys(ids):
        rec = store.get_run(rid)
        name = rec.config.get("decoder")
        got = [token_stream(r.verifications) for r in rec.requests]
        got = [x for x in got if x]
        if rec.status != "ok" or not got:
            why = "failed" if rec.status != "ok" else "has no verifications"
            raise UserError(f"--acceptance-from: run {rid} ({name}) {why}: pass finished runs of a speculative "
                            "decoder (magicdec, vegas, aspire, ...)")
        keys = [name] if trait(name, "ablation") else list(dict.fromkeys([name, trait(name, "draft_kind")]))
        for key in keys:
            streams.setdefault(key, []).extend(got)
            runs.setdefault(key, []).append(rid)
            contexts.setdefault(key, []).extend(r.prompt_len for r in rec.requests)
    return MeasuredAcceptance(streams, runs, contexts)


def acceptance_model(table, name: str, request_ids: list[str], seed: int):
    """A decoder's acceptance in a parametric simulation: measured per request, or an alpha table."""
    if isinstance(table, MeasuredAcceptance):
        return table.model(acceptance_keys(name), request_ids)
    return ParametricAcceptance(table, acceptance_keys(name), seed)


def parametric_requests(context: int, batch: int, n_requests: int, max_new: int) -> list[SimRequest]:
    """Requests of one prompt length, already prefilled (prefill costs nothing: the paper's decode
    throughput excludes it, and with all prompts equal no prefill stalls a decode window)."""
    return [SimRequest(f"sim-{i}", context, max_new) for i in range(n_requests)]


def simulate_parametric(name: str, cost, table: dict, context: int, batch: int, n_requests: int,
                        max_new: int, page_size: int = 16, num_layers: int = 0, seed: int = 0,
                        scheduler_cost: CostModel | None = None, settings: dict | None = None) -> tuple:
    """table: an alpha table, or a MeasuredAcceptance; settings: the decoder's, beside its defaults."""
    # ASPIRE decides with what a calibration on this hardware at this cell's batch and context would fit
    policy = SimPolicy(name, None, scheduler_cost or (cost.scheduler_model(batch, context)
                                                  if trait(name, "uses_cost_model") else None),
                       page_size, num_layers, settings=settings)
    reqs = parametric_requests(context, batch, n_requests, max_new)
    acceptance = None if policy.draft_kind is None else acceptance_model(table, name, [r.id for r in reqs], seed)
    out = simulate(reqs, policy, acceptance, cost, batch, info=policy.settings)
    assumptions = {
        **cost.describe(), **(acceptance.describe() if acceptance else {"acceptance": None}),
        "scheduler_cost_model": policy.scheduler_cost.to_dict() if policy.scheduler_cost else None,
        "requests": f"{n_requests} requests of {context} prompt tokens, {max_new} output tokens each (equal "
                    "work), admitted as slots free; prefill not costed",
        "not_modelled": "prefill; host-side scheduling and sampling; kernel efficiency beyond the profile's "
                        "efficiency factors; acceptance correlated across tokens",
    }
    return out, assumptions


def to_record(out, config: dict, assumptions: dict, env: dict, group: str | None = None) -> records.RunRecord:
    prompt_lens = {r.id: p for r, p in zip(out.results, config.pop("_prompt_lens"))}
    rec = records.from_output({**config, "simulated": assumptions}, out, prompt_lens, env, group=group,
                              tag="simulated")
    rec.kind = "simulated"
    for k in TEXT_AGGREGATES:
        rec.aggregates.pop(k, None)
    return rec
