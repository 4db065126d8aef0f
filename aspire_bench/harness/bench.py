"""`aspire-bench bench`: decoders side by side on the same requests, in one process.

Per (context, batch size, sampling) cell: one group; every decoder runs the same requests (at least
MIN_REQUESTS) with a warm-up and R measured repeats, repeat i with sampling seed seed + i and the
decoders in an order rotated by i, each request generating exactly max_new_tokens (EOS ignored, as
throughput benchmarks do, so every decoder does the same work under sampling too). Tunable baselines
get a second, tuned row (tuning.py). Ratios carry bootstrap intervals over requests x repeats; the
cell's step costs give each speculative row its bound share (docs/metrics.md). After every run of
every repeat a round of ASPIRE's calibration grid is timed; each run keeps, for the simulator, the
fit of the round timed right after its traced repeat and the fit of all the cell's rounds pooled.
The engine's prefix cache prefills each prompt once for all decoders (decode throughput excludes
prefill anyway; TTFT is therefore not meaningful here).
Greedy runs get parity against the cell's AR run; every run gets the bytes it read per generated
token and the bandwidth that achieved, against this machine's read bandwidth measured in the run.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field, replace

import torch

from ..decoders.base import PAPER_SAMPLING
from ..decoders.calibration import calibrate, pooled_calibration
from ..errors import ConfigError
from ..tasks.buckets import parse_bucket
from . import metrics, records
from .parity import check_tolerance, resolve_tolerance
from .runner import RunConfig, finish, load_engine, measure_repeat, prepare, traced_repeat
from .step_costs import DRAFT_KIND, measure_cell
from .store import save_record
from .tuning import TUNE_GRIDS

DECODERS = ("ar", "magicdec", "vegas", "ngram", "draft-model", "aspire", "aspire-fixed", "aspire-fsm", "aspire-norefresh")
BASELINES = ("magicdec", "vegas", "ngram", "draft-model")
# Named sampling settings: greedy is the parity setting, "paper" the ASPIRE paper's sampling setting.
SAMPLINGS = {"greedy": (0.0, 0, 1.0), "paper": (PAPER_SAMPLING.temperature, PAPER_SAMPLING.top_k, PAPER_SAMPLING.top_p)}
# Requests per cell by default: more than one batch, so continuous batching refills slots and the
# intervals sample prompts, not only timing noise.
MIN_REQUESTS = 16
STEP_COST_REPEATS = 3


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int
    top_p: float

    @property
    def name(self) -> str:
        for name, v in SAMPLINGS.items():
            if v == (self.temperature, self.top_k, self.top_p):
                return name
        return f"T{self.temperature:g}/k{self.top_k}/p{self.top_p:g}"


def parse_sampling(spec: str) -> Sampling:
    """`greedy`, `paper`, or `T:k:p` (e.g. `1.0:0:1.0`)."""
    spec = spec.strip()
    if spec in SAMPLINGS:
        return Sampling(*SAMPLINGS[spec])
    try:
        t, k, p = spec.split(":")
        return Sampling(float(t), int(k), float(p))
    except ValueError:
        raise ValueError(f"unknown sampling setting {spec!r}: use {', '.join(SAMPLINGS)} or "
                         f"temperature:top_k:top_p such as 0.7:50:0.9") from None


def memory_read_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes/s of a full read of a large fp32 tensor (`sum`), median of repeats."""
    x = torch.ones(nbytes // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def bytes_read(rec: records.RunRecord, weight_bytes: int, kv_bytes_per_position: int) -> float:
    """Weights + KV bytes read by the decode steps (steps without a prefill row)."""
    total = 0.0
    for step in rec.steps:
        if any(row[1] == "prefill" for row in step.rows):
            continue
        total += weight_bytes + sum(row[6] for row in step.rows) * kv_bytes_per_position
    return total


@dataclass
class BenchRow:
    context: str
    batch_size: int
    sampling: str
    record: records.RunRecord
    tuned: bool = False
    figures: dict = field(default_factory=dict)  # ratios, intervals, bound share (see derive_figures)

    @property
    def decoder(self) -> str:
        return self.record.config["decoder"]

    @property
    def given(self) -> dict:
        """The settings given with the decoder's name in --decoders (none: its defaults)."""
        return self.record.config.get("decoder_args") or {}

    @property
    def settings(self) -> dict:
        """The decoder settings actually used (tuned gamma included)."""
        return {k: v for k, v in self.record.info.items() if k not in records.INFO_NOT_SETTINGS}

    @property
    def label(self) -> str:
        g = self.settings.get("gamma")
        given = f"({', '.join(f'{k}={v}' for k, v in self.given.items())})" if self.given else ""  # as the leaderboard
        return self.decoder + given + (" tuned" if self.tuned else "") + (
            f" γ={g}" if g is not None and self.decoder in TUNE_GRIDS and "gamma" not in self.given else "")

    def to_json(self) -> dict:
        """One row of `bench --json` (the contract: docs/metrics.md#bench-json)."""
        return {"context": self.context, "batch_size": self.batch_size, "sampling": self.sampling,
                "decoder": self.decoder, "run_id": self.record.run_id, **self.record.aggregates,
                "settings": self.settings, "tuned": self.tuned, "n_requests": self.record.aggregates["n_requests"],
                **self.figures}


def bench(model: str = "tiny", task: str = "code-completion", contexts=("4k", "16k", "32k"), batch_sizes=(1, 8),
          decoders=DECODERS, repeat: int = 3, max_new_tokens: int = 128,
          samplings=(Sampling(*SAMPLINGS["greedy"]),), seed: int = 0, limit: int | None = None, store: str | None = None,
          dtype: str = "float32", device: str = "cpu", attention_backend: str = "auto",
          show_progress: bool = True, tune: bool = True, percentiles=metrics.DEFAULT_PERCENTILES,
          bound: bool = True, parity_tolerance: float | None = None,
          calibration_rounds: bool = True) -> tuple[list[BenchRow], float]:
    """limit: requests per cell (default max(MIN_REQUESTS, batch size)); tune: add a tuned row per baseline;
    bound: measure the step costs of each cell for bound_share; calibration_rounds: time a calibration
    round after every run and store the fits with their samples (info["adjacent_calibration"],
    info["interleaved_calibration"]: a fit of other terms can be made from the store)."""
    check_tolerance(parity_tolerance)
    if repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    engine = load_engine(model, dtype, device, attention_backend)
    tolerance = resolve_tolerance(parity_tolerance, engine.dtype)
    engine.prefix_cache = {}
    bandwidth = memory_read_bandwidth()
    c = engine.cfg
    kv_per_pos = 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.tensor([], dtype=engine.dtype).element_size()
    weights = engine.model.weight_bytes()

    def add_bandwidth(rec: records.RunRecord) -> None:
        total = bytes_read(rec, weights, kv_per_pos)
        a = rec.aggregates
        a["bytes_per_token"] = total / a["generated_tokens"] if a.get("generated_tokens") else None
        a["achieved_bw_gbs"] = total / a["decode_wall_s"] / 1e9 if a.get("decode_wall_s") else None
        a["memory_bw_gbs"] = bandwidth / 1e9

    base = RunConfig(model=model, task=task, max_new_tokens=max_new_tokens, seed=seed, repeat=repeat, dtype=dtype,
                     device=device, attention_backend=attention_backend, ignore_eos=True)
    rows: list[BenchRow] = []
    try:
        for ctx in contexts:
            for bs in batch_sizes:
                # Every setting of a cell reuses the prefix cache: each prompt is prefilled once.
                for smp in samplings:
                    cell = replace(base, context_len=ctx, batch_size=bs, limit=limit or max(MIN_REQUESTS, bs),
                                   temperature=smp.temperature, top_k=smp.top_k, top_p=smp.top_p)
                    cell_rows, interrupted = _cell(engine, cell, decoders, tune, show_progress, percentiles,
                                                   tolerance, calibration_rounds)
                    for r in cell_rows:
                        r.context, r.sampling = ctx, smp.name
                        add_bandwidth(r.record)
                    try:
                        costs = _step_costs(engine, cell, cell_rows) if bound and not interrupted else None
                    except KeyboardInterrupt as stop:  # the cell's runs are complete: keep them
                        costs, interrupted = None, stop
                    derive_figures(cell_rows, costs)
                    if store is not None:
                        for r in cell_rows:
                            save_record(store, r.record)  # a recovery JSONL beside the store if saving fails
                    rows += cell_rows
                    if interrupted:
                        kept = cell_rows[0].record.aggregates.get("repeats", 1)
                        print(f"interrupted: the {ctx} x {bs} {smp.name} cell kept the {kept} of {repeat} repeats "
                              "every decoder finished", file=sys.stderr)
                        raise interrupted
    except KeyboardInterrupt:
        where = f" in {store}" if store is not None else ""
        print(f"interrupted: {len(rows)} runs of the finished cells and repeats are stored{where}; the rest did "
              "not run", file=sys.stderr)
        raise
    finally:
        engine.prefix_cache = None
    return rows, bandwidth


def decoder_spec(d) -> tuple[str, tuple]:
    """A --decoders item, a name or (name, settings), as a hashable (name, sorted settings items)."""
    name, args = (d, {}) if isinstance(d, str) else d
    return name, tuple(sorted(args.items()))


def _entries(decoders, tune: bool) -> list[tuple[str, tuple, bool]]:
    """(decoder, settings, tuned) in run order: each tunable baseline's tuned row right after its
    untuned row, unless its settings fix gamma."""
    out = []
    for d in decoders:
        name, args = decoder_spec(d)
        out.append((name, args, False))
        if tune and name in TUNE_GRIDS and "gamma" not in dict(args):
            out.append((name, args, True))
    return out


def _cell(engine, cell: RunConfig, decoders, tune: bool, show_progress: bool, percentiles,
          tolerance: float, calibration_rounds: bool = True) -> list[BenchRow]:
    """Every decoder on one cell's requests, as one group. Repeat i runs the decoders in an order rotated
    by i (drift on a shared machine falls on each in turn) with sampling seed seed + i. Greedy rows get
    parity against the cell's AR run. Returns (rows, the KeyboardInterrupt that cut the repeats short
    or None): an interrupted cell keeps the whole rounds every decoder finished."""
    group = records.new_group_id()
    entries = _entries(decoders, tune)
    prepared = {e: prepare(replace(cell, decoder=e[0], decoder_args=dict(e[1]), tune=e[2]), engine, show_progress)
                for e in entries}
    outputs = {e: [] for e in entries}
    rounds: dict[tuple, dict] = {}  # (entry, repeat) -> the calibration round timed right after it
    try:
        for i in range(cell.repeat):
            k = i % len(entries)
            for e in entries[k:] + entries[:k]:
                outputs[e].append(measure_repeat(prepared[e], i, show_progress))
                if calibration_rounds:
                    rounds[e, i] = _calibration_round(engine, cell, seed=len(rounds))
    except KeyboardInterrupt as stop:
        # Keep the repeats every decoder finished (whole rounds, so the ratios stay side by side); the
        # caller stores them and stops.
        done = min(len(o) for o in outputs.values())
        if not done:
            raise
        for o in outputs.values():
            del o[done:]
        rounds = {key: r for key, r in rounds.items() if key[1] < done}
        interrupted = stop
    else:
        interrupted = None
    pooled = pooled_calibration(list(rounds.values()), source="interleaved calibration") if rounds else None
    # AR first: greedy rows get parity against the cell's AR run, in the record as it is built.
    records_of, ar = {}, None
    for e in sorted(entries, key=lambda e: e[0] != "ar"):
        prepared[e].info["verifications"] = [list(v) for o in outputs[e] for r in o.results for v in r.verifications]
        if rounds:
            after = rounds[e, traced_repeat(outputs[e])]  # calibrate() fitted its own samples already
            prepared[e].info["adjacent_calibration"] = {**after, "source": "adjacent calibration", "rounds": 1}
            prepared[e].info["interleaved_calibration"] = pooled
        greedy_ar = ar.requests if ar is not None and e[0] != "ar" and cell.temperature == 0 else None
        records_of[e] = finish(prepared[e], outputs[e], group=group, sweep="bench", show_progress=show_progress,
                               percentiles=percentiles, ar=greedy_ar, parity_tolerance=tolerance).record
        if e[0] == "ar" and ar is None:
            ar = records_of[e]
    rows = [BenchRow(cell.context_len, cell.batch_size, "", records_of[e], tuned=e[2]) for e in entries]
    return rows, interrupted


def _calibration_round(engine, cell: RunConfig, seed: int = 0) -> dict:
    """One timed round of ASPIRE's calibration grid (calibration.calibrate) at the cell's context: the
    same grid every round, so the rounds pool point by point; the seed changes the order its points
    are timed in (and which random pages a draft reads). At the cell's own context because a step's
    cost per KV position is not the same at every length on a CPU: 8 rows' KV of one layer fits the
    last-level cache at 4k and streams from memory at 16k, where a verification's arithmetic no
    longer hides under the read."""
    context = min(parse_bucket(cell.context_len)[0], engine.max_context - 16 - engine.page_size - 1)
    return calibrate(engine, cell.batch_size, context, repeats=1, seed=seed, warmup=False)


def _step_costs(engine, cell: RunConfig, rows: list[BenchRow]) -> dict | None:
    """c and v(d) at the cell's context and batch, for every draft length d some row verified."""
    drafted = [v[0] for r in rows for v in r.record.info.get("verifications", [])]
    kinds = {DRAFT_KIND[r.decoder] for r in rows if r.decoder in DRAFT_KIND}
    if not drafted or not kinds:
        return None
    context, _ = parse_bucket(cell.context_len)
    return measure_cell(engine, context, cell.batch_size, max(max(drafted), 1), STEP_COST_REPEATS,
                        kinds=("ar", "verify", *sorted(kinds)), gammas=set(drafted))


def derive_figures(rows: list[BenchRow], costs: dict | None) -> None:
    """speedup_vs_ar (+ _ci95), speedup_vs_best_baseline (+ _ci95) and bound_share per row of one cell.

    Ratios pool every request of every repeat: (Σ tokens / Σ decode seconds) of the row over the same
    of the reference; intervals resample (request, repeat) pairs (metrics.ratio_ci). The best baseline is
    the baseline row, tuned or at its default, with the highest speedup over AR on the measured
    requests: tuning picks gamma from short runs on other prompts, and where its pick measures
    slower than the default, the default is the stronger baseline."""
    samples = {id(r): _samples(r.record) for r in rows}
    ar = next((r for r in rows if r.decoder == "ar"), None)
    for r in rows:
        f = r.figures
        f["speedup_vs_ar"] = f["speedup_vs_ar_ci95"] = None
        if ar is not None:
            f["speedup_vs_ar"] = metrics.ratio(samples[id(r)], samples[id(ar)])
            f["speedup_vs_ar_ci95"] = _ci(samples[id(r)], samples[id(ar)])
    baselines = [r for r in rows if r.decoder in BASELINES]
    best = max(baselines, key=lambda r: metrics.ratio(samples[id(r)], samples[id(ar or r)]) or 0.0, default=None)
    for r in rows:
        f = r.figures
        spec = r.decoder != "ar"
        f["best_baseline"] = best.label if best is not None and spec else None
        f["speedup_vs_best_baseline"] = f["speedup_vs_best_baseline_ci95"] = None
        if spec and best is not None:
            f["speedup_vs_best_baseline"] = metrics.ratio(samples[id(r)], samples[id(best)])
            f["speedup_vs_best_baseline_ci95"] = _ci(samples[id(r)], samples[id(best)])
        f["allowed_speedup"] = f["bound_share"] = None
        # the cell's step costs are those of each decoder's default view: none for a row given settings
        if spec and costs is not None and r.decoder in DRAFT_KIND and not r.given:
            allowed = metrics.allowed_speedup([tuple(v) for v in r.record.info.get("verifications", [])],
                                              costs[f"c_{DRAFT_KIND[r.decoder]}"], costs["v_by_gamma"])
            f["allowed_speedup"] = allowed
            if allowed and f["speedup_vs_ar"] is not None:
                f["bound_share"] = f["speedup_vs_ar"] / allowed
        # Stored with the run too (flat numbers), so the leaderboard can show them.
        for k, v in f.items():
            if isinstance(v, (list, tuple)):
                r.record.aggregates[f"{k}_low"], r.record.aggregates[f"{k}_high"] = v
            elif v is None or isinstance(v, (int, float)):
                r.record.aggregates[k] = v
    if costs is not None:
        for r in rows:
            r.record.info["step_costs"] = costs


def _samples(rec: records.RunRecord) -> dict:
    return {(rid, i): (tok, sec) for rid, i, tok, sec in rec.info.get("decode_samples", [])}


def _ci(num: dict, den: dict) -> list[float] | None:
    ci = metrics.ratio_ci(num, den)
    return list(ci) if ci is not None else None


def _fmt_ratio(x, ci) -> str:
    if x is None:
        return "—"
    return f"{x:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{x:.2f}"


def _ms(a: dict, key: str) -> str:
    return f"{a[key] * 1e3:,.1f}" if a.get(key) is not None else "—"


def bench_table(rows: list[BenchRow], bandwidth: float):
    from rich.markup import escape
    from rich.table import Table
    t = Table(title=f"decoders side by side (memory read bandwidth {bandwidth / 1e9:.1f} GB/s); "
                    "[95% bootstrap interval over requests x repeats]")
    for col in ("context", "batch", "sampling", "decoder", "requests", "decode tok/s (repeat min-max)", "x AR",
                "x best baseline", "bound share", "accepted len (req min-max)", "TPOT p50 ms", "ITL p50 ms",
                "parity %", "distinct-4", "bytes/token", "achieved GB/s"):
        t.add_column(col, justify="left" if col in ("context", "sampling", "decoder") else "right")
    for r in rows:
        a, f = r.record.aggregates, r.figures
        tok = a.get("decode_tok_s_median")
        d4 = a.get("distinct4_mean")
        collapsed = d4 is not None and d4 < metrics.COLLAPSE_THRESHOLD
        t.add_row(
            r.context, str(r.batch_size), r.sampling, escape(r.label),
            f"{a['n_requests']}x{a.get('repeats', 1)}",
            f"{tok:,.1f} ({a['decode_tok_s_min']:,.1f}-{a['decode_tok_s_max']:,.1f})" if tok else "—",
            _fmt_ratio(f.get("speedup_vs_ar"), f.get("speedup_vs_ar_ci95")) if r.decoder != "ar" else "1",
            _fmt_ratio(f.get("speedup_vs_best_baseline"), f.get("speedup_vs_best_baseline_ci95")),
            f"{f['bound_share']:.0%} of {f['allowed_speedup']:.2f}x" if f.get("bound_share") is not None else "—",
            (f"{a['mean_accepted_len']:.2f} ({a['req_accepted_len_p0']:.1f}-{a['req_accepted_len_p100']:.1f})"
             if a.get("req_accepted_len_p0") is not None else f"{a['mean_accepted_len']:.2f}")
            if a.get("mean_accepted_len") else "—",
            _ms(a, "tpot_p50_s"), _ms(a, "itl_p50_s"),
            f"{a['parity_identical_pct']:.0f}" if a.get("parity_identical_pct") is not None else "—",
            (f"{d4:.2f}" + (" COLLAPSED" if collapsed else "")) if d4 is not None else "—",
            f"{a['bytes_per_token'] / 1e6:.1f} MB" if a.get("bytes_per_token") else "—",
            f"{a['achieved_bw_gbs']:.1f} ({a['achieved_bw_gbs'] / a['memory_bw_gbs']:.0%})"
            if a.get("achieved_bw_gbs") else "—",
        )
    return t
