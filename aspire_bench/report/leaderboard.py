"""Leaderboards as data: one per (model, task, context bucket), one row per decoder configuration.

No HTML here: pages.py renders what this module computes, and the tests check its numbers directly.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from aspire_bench.harness import figures
from aspire_bench.harness.figures import cell
from aspire_bench.harness.records import NON_IDENTITY_KEYS, RunRecord, canonical_json
from aspire_bench.harness.store import Store


@dataclass
class Column:
    key: str  # what Row.value() looks up
    header: str
    better: str | None  # "high" | "low" | None (no best marked)
    fmt: str  # format spec of the value
    anchor: str  # section of metrics.html that defines it
    tip: str  # one-line definition, shown on hover
    # Raw timings compare only within one group (one machine, one invocation): no best is marked
    # when a board mixes groups.
    raw: bool = False


COLUMNS = (
    Column("decode_tok_s", "decode tok/s", "high", ".1f", "throughput",
           "generated tokens / decode wall time (prefill excluded); median over repeats", raw=True),
    Column("speedup", "speedup vs AR", "high", ".2f", "throughput",
           "decode tok/s over the AR run's decode tok/s measured in the same group, [95% bootstrap interval]; "
           "'unequal work': sampled runs stopped at EOS; — without AR in the group"),
    Column("mean_accepted_len", "mean acc. len", "high", ".2f", "acceptance",
           "mean tokens committed per verification (accepted drafts + 1); AR: 1"),
    Column("draft_acceptance_rate", "draft acc. rate", "high", ".1%", "acceptance",
           "accepted drafts / drafted tokens over all verifications"),
    Column("parity_identical_pct", "parity", "high", ".1f", "exactness-parity",
           "% of requests identical to AR; near-ties (AR margin < threshold) and mismatches counted apart"),
    Column("tpot_p50_s", "TPOT p50 ms", "low", ".1f", "latency-per-request-then-quantiles-over-requests",
           "median over requests of (e2e − TTFT)/(n − 1)", raw=True),
    Column("tpot_p99_s", "TPOT p99 ms", "low", ".1f", "latency-per-request-then-quantiles-over-requests",
           "99th percentile over requests of (e2e − TTFT)/(n − 1)", raw=True),
    Column("score_mean", "task score", "high", ".3f", "output-quality", "mean task score over scored requests"),
    Column("distinct4_mean", "distinct-4", "high", ".3f", "output-quality",
           "mean over requests of distinct 4-grams / 4-grams of the output ids"),
)
# Shown in milliseconds.
MILLIS = frozenset({"tpot_p50_s", "tpot_p99_s"})


@dataclass
class Row:
    label: str  # decoder + settings (+ the config entries that tell this row from the others)
    decoder: str
    config_hash: str
    group: str | None
    runs: list[RunRecord]  # the repeats in that group, run order
    summary: dict  # figures.summarize: medians over repeats + speedup
    setup: str = ""  # config entries (other than the decoder) that differ between this board's rows

    @property
    def run(self) -> RunRecord:
        """The representative run (first repeat): its requests feed the per-request plots."""
        return self.runs[0]

    def value(self, key: str):
        return self.summary.get(key)


@dataclass
class Board:
    model: str
    task: str
    context: str
    rows: list[Row] = field(default_factory=list)

    @property
    def title(self) -> str:
        return f"{self.model} · {self.task} · {self.context}"

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in f"{self.model}-{self.task}-{self.context}").strip("-")


@dataclass
class Leaderboards:
    boards: list[Board]
    runs: list[RunRecord]  # every run in the store, failed ones included


def load_runs(store_path: str | Path, kind: str = "measured") -> list[RunRecord]:
    with Store(store_path, readonly=True) as store:  # a report never writes to the store
        return [store.get_run(s["run_id"]) for s in store.list_runs(kind=kind) if s["status"] == "ok"
                or kind == "measured"]


def build(runs: list[RunRecord]) -> Leaderboards:
    """Group runs into boards; each config hash shows its newest group's repeats."""
    refs = figures.ar_references(runs)
    sets = figures.repeat_sets(runs)
    latest: dict[str, tuple[str | None, str]] = {}  # config hash -> key of its newest repeat set
    for key, reps in sets.items():
        prev = latest.get(key[1])
        if prev is None or reps[-1].run_id > sets[prev][-1].run_id:
            latest[key[1]] = key
    by_cell: dict[tuple, list[Row]] = defaultdict(list)
    for key in latest.values():
        reps = sets[key]
        first = reps[0]
        by_cell[cell(first.config)].append(Row(
            label=figures.decoder_label(first.config), decoder=figures.decoder_name(first.config),
            config_hash=first.config_hash, group=first.group, runs=reps, summary=figures.summarize(reps, refs)))
    boards = []
    for (model, task, context), rows in by_cell.items():
        _set_setups(rows)
        # AR first (the reference), then by speedup, then by name: a stable default order.
        rows.sort(key=lambda r: (r.decoder != figures.AR, -(r.value("speedup") or 0.0), r.label, r.setup))
        boards.append(Board(model, task, context, rows))
    # Contexts in length order ("4k" before "16k"), by what the runs actually measured.
    boards.sort(key=lambda b: (b.model, b.task, context_length(b), b.context))
    return Leaderboards(boards, runs)


def prompt_length(row: Row) -> int | None:
    """The context a row measured: the median prompt length of its requests."""
    lens = sorted(r.prompt_len for r in row.run.requests)
    return lens[len(lens) // 2] if lens else None


def context_length(board: Board) -> int:
    return min((n for n in map(prompt_length, board.rows) if n is not None), default=0)


def _flat(config: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = canonical_json(v)
    return out


# Config entries never shown as "setup": they name the board or the decoder already.
_NOT_SETUP = NON_IDENTITY_KEYS | figures.MEASUREMENT_KEYS | {"decoder", "model", "task", *figures.CONTEXT_KEYS, *figures.DECODER_SETTINGS_KEYS}


def setup_of(run: RunRecord) -> dict[str, str]:
    """The run's config entries other than its model, task, context and decoder, flattened."""
    return {k: v for k, v in _flat(run.config).items() if k.split(".")[0] not in _NOT_SETUP}


def name_setups(setups: list[dict[str, str]]) -> list[str]:
    """Per setup, `key=value, ...` of the entries that differ between them (all equal: "")."""
    keys = sorted({k for f in setups for k in f})
    varying = [k for k in keys if len({f.get(k) for f in setups}) > 1]
    return [", ".join(f"{k}={f.get(k, '—')}" for k in varying) for f in setups]


def _set_setups(rows: list[Row]) -> None:
    """Name the config entries that differ between rows, so two rows never look the same."""
    for row, setup in zip(rows, name_setups([setup_of(r.run) for r in rows])):
        row.setup = setup


def group_name(run: RunRecord) -> str:
    """A group as people name it: the sweep (or `bench`) that ran it and when, e.g. `demo 2026-12-04 14:05`."""
    return f"{run.sweep or run.tag or 'run'} {run.created_at[:16].replace('T', ' ')}"


def best_values(board: Board) -> dict[str, float]:
    """Per column with a direction, the best value among the board's rows (none on a one-row board:
    a single row is not "best" of anything)."""
    best = {}
    if len(board.rows) < 2:
        return best
    one_group = len({r.group for r in board.rows}) == 1
    for col in COLUMNS:
        values = [r.value(col.key) for r in board.rows if r.value(col.key) is not None]
        if col.better and values and (one_group or not col.raw):
            best[col.key] = max(values) if col.better == "high" else min(values)
    return best


# The simulator's stated error on a run's decode tok/s (docs/simulator.md, "Validation").
SIMULATOR_ERROR = 0.10
# Below this share of the speedup its acceptance and step costs allow, overhead bounds a decoder.
OVERHEAD_BOUND = 0.85
# Above 1 + this, a share says more about the step costs' moment than about the decoder.
OVER_BOUND = 0.05


def simulated_by_source(simulated: list[RunRecord]) -> dict[int, RunRecord]:
    """Simulated runs that replay a stored run, by the id of the run they replay (the newest replay)."""
    out = {}
    for r in simulated:
        src = (r.config.get("simulated") or {}).get("source_run")
        if isinstance(src, int):
            out[src] = r
    return out


def bound_sentence(row: Row, board: Board, simulated: dict[int, RunRecord]) -> str | None:
    """What bounds a speculative row here, in one sentence from its run's own figures: its speedup, the
    speedup its acceptance allows at the cell's measured step costs (bound share), the cost of a draft
    step, the acceptance; and the simulator's replay of the run beside the measurement, when stored."""
    a, speedup = row.run.aggregates, row.value("speedup")
    if row.decoder == figures.AR or speedup is None:
        return None
    rate, acc = row.value("draft_acceptance_rate"), row.value("mean_accepted_len")
    parts = [f"{speedup:.2f}× AR"]
    if rate is not None and acc is not None:
        parts.append(f"{rate:.0%} of drafts accepted, {acc:.2f} tokens per verification")
    c = (row.run.section("step_costs") or {}).get(f"c_{_draft_kind(row.decoder)}")
    if c is not None:
        parts.append(f"a draft step costs {c:.2f} of an AR step")
    allowed, share = a.get("allowed_speedup"), a.get("bound_share")
    if allowed is not None and share is not None:
        if share > 1 + OVER_BOUND:
            why = (f"it measured {share:.0%} of the {allowed:.2f}× its acceptance and step costs allow, more than "
                   "they allow: the step costs were timed in another state of the machine than the run")
        elif allowed <= 1.0:
            why = f"acceptance and draft cost bound it: they allow {allowed:.2f}× at best here"
        elif share < OVERHEAD_BOUND:
            why = (f"overhead bounds it: it reaches {share:.0%} of the {allowed:.2f}× its acceptance and step "
                   "costs allow (time outside the measured steps: host work, scheduling)")
        else:
            why = f"acceptance and draft cost bound it: it reaches {share:.0%} of the {allowed:.2f}× they allow"
    else:
        why = "no step costs measured for this run (bench measures them): its bound is not known"
    text = f"{row.label}: {why} ({'; '.join(parts)})."
    ar = next((r for r in board.rows if r.decoder == figures.AR and r.group == row.group), None)
    sim, sim_ar = simulated.get(row.run.run_id), simulated.get(ar.run.run_id) if ar else None
    if sim is not None and sim_ar is not None:
        num, den = sim.aggregates.get("decode_tok_s"), sim_ar.aggregates.get("decode_tok_s")
        if num and den:
            predicted = num / den
            err = predicted / speedup - 1
            text += f" The simulator's replay of this run predicts {predicted:.2f}× ({err:+.0%})"
            text += (", within its stated ±10%." if abs(err) <= SIMULATOR_ERROR else
                     ", outside its stated ±10%: it prices the steps with calibrations timed beside the runs and "
                     "leaves out host time beyond what their fit absorbs, so a machine that changed speed in "
                     "between, or host work that grew, moves the measurement and not the replay "
                     "(docs/simulator.md).")
    return text


def _draft_kind(decoder: str) -> str | None:
    """The decoder's draft kind; None for one not installed here (a stored run of another version)."""
    from aspire_bench.decoders import trait
    from aspire_bench.errors import ConfigError
    try:
        return trait(decoder, "draft_kind")
    except ConfigError:
        return None
