"""`aspire-bench bench`: decoders side by side on the same requests, in one process.

Per (context, batch size, sampling) cell, one group: every decoder runs the same requests, each
generating exactly max_new_tokens (so every decoder does the same work), in a warm-up and R repeats.
A repeat runs in rounds that probe the machine and rotate the decoders' order, so that its drift falls
on every decoder alike; ratios carry bootstrap intervals over requests x repeats and over rounds.
Tuned baselines, step costs (bound share), calibration rounds, parity against AR and the bytes read
per token come with them. The prefix cache prefills each prompt once for all decoders (TTFT is not
meaningful here). How and why: docs/performance.md, "How bench measures"; docs/metrics.md.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field, replace

import torch

from ..decoders import BUILTIN, check_for_model, get_decoder, trait
from ..decoders.base import PAPER_SAMPLING, GenerationOutput
from ..decoders.calibration import Calibration, calibrate, pooled_calibration
from ..errors import ConfigError
from ..tasks.buckets import parse_bucket
from . import metrics, records, rope
from .generation import build_requests, cached_prefix, generate
from .parity import check_tolerance, resolve_tolerance
from .runner import RunConfig, finish, load_engine, prepare, traced_repeat, warm_up
from .step_costs import TIMED_DRAFTS, measure_cell
from .store import save_record
from .tuning import tuned_settings

# Named sampling settings: greedy is the parity setting, "paper" the ASPIRE paper's sampling setting.
SAMPLINGS = {"greedy": (0.0, 0, 1.0), "paper": (PAPER_SAMPLING.temperature, PAPER_SAMPLING.top_k, PAPER_SAMPLING.top_p)}
# Requests per cell by default: more than one batch, so continuous batching refills slots and the
# intervals sample prompts, not only timing noise.
MIN_REQUESTS = 16
STEP_COST_REPEATS = 3
# Rounds per cell (repeats x slices) where the requests allow slices of at least a batch.
MIN_ROUNDS = 6
# Seconds each probe of the machine's state (memory read, FMA) takes per round.
PROBE_S = 0.08


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


class MachineProbe:
    """Memory read bandwidth (GB/s, a full `sum` of a tensor well beyond the last-level cache) and FMA
    throughput (GFLOP/s, a 512 x 512 fp32 matmul), each the median rate over ~PROBE_S seconds of
    repeats: the machine's state at one moment, cheap enough for every round."""

    def __init__(self, nbytes: int = 1 << 27, n: int = 512):
        self.x = torch.ones(nbytes // 4)
        self.a, self.b, self.c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        self.nbytes, self.flops = nbytes, 2 * n ** 3

    def __call__(self, seconds: float = PROBE_S) -> dict:
        return {"mem_gbs": _rate(self.x.sum, self.nbytes, seconds) / 1e9,
                "fma_gflops": _rate(lambda: torch.mm(self.a, self.b, out=self.c), self.flops, seconds) / 1e9}


def _rate(fn, work: float, seconds: float) -> float:
    fn()
    rates, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(rates) < 3:
        t0 = time.perf_counter()
        fn()
        rates.append(work / (time.perf_counter() - t0))
    return statistics.median(rates)


def slices(n_requests: int, batch_size: int, repeat: int, rounds: int = MIN_ROUNDS) -> list[range]:
    """Contiguous slices of the requests for the rounds of one repeat: enough for `rounds` rounds over
    the repeats, each at least a batch (a slice smaller than a batch would measure another regime)."""
    k = max(1, min(n_requests // max(batch_size, 1), -(-rounds // repeat)))
    bounds = [round(j * n_requests / k) for j in range(k + 1)]
    return [range(bounds[j], bounds[j + 1]) for j in range(k)]


def state_range(rounds: list[dict], key: str) -> tuple[float, float] | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return (min(values), max(values)) if values else None


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
    def rope_scaling(self) -> dict | None:
        """The RoPE scaling that replaced the checkpoint's (None: its own)."""
        return self.record.config.get("rope_scaling")

    @property
    def dtype(self) -> str | None:
        """The dtype the model ran in (`--dtype auto` resolved; runs stored before it was recorded: as given)."""
        return self.record.env.get("dtype") or self.record.config.get("dtype")

    @property
    def given(self) -> dict:
        """The settings given with the decoder's name in --decoders (none: its defaults)."""
        return self.record.config.get("decoder_args") or {}

    @property
    def settings(self) -> dict:
        """The decoder settings actually used (tuned gamma included)."""
        return self.record.settings

    @property
    def label(self) -> str:
        given = f"({', '.join(f'{k}={v}' for k, v in self.given.items())})" if self.given else ""  # as the leaderboard
        tuned = [k for k in tuned_settings(self.decoder, self.given) if self.settings.get(k) is not None]
        shown = "".join(f" {'γ' if k == 'gamma' else k}={self.settings[k]}" for k in tuned)
        return self.decoder + given + (" tuned" if self.tuned else "") + shown

    def to_json(self) -> dict:
        """One row of `bench --json` (the contract: docs/metrics.md#bench-json)."""
        return {"model": self.record.config.get("model"), "dtype": self.dtype,
                "context": self.context, "rope_scaling": self.rope_scaling, "batch_size": self.batch_size,
                "sampling": self.sampling, "decoder": self.decoder, "run_id": self.record.run_id,
                **self.record.aggregates,
                "settings": self.settings, "tuned": self.tuned, "n_requests": self.record.aggregates["n_requests"],
                **self.figures}


def bench(model: str = "tiny", task: str = "code-completion", contexts=("4k", "16k", "32k"), batch_sizes=(1, 8),
          decoders=None, repeat: int = 3, max_new_tokens: int = 128,
          samplings=(Sampling(*SAMPLINGS["greedy"]),), seed: int = 0, limit: int | None = None, store: str | None = None,
          dtype: str = "float32", device: str = "cpu", attention_backend: str = "auto",
          show_progress: bool = True, tune: bool = True, percentiles=metrics.DEFAULT_PERCENTILES,
          bound: bool = True, parity_tolerance: float | None = None,
          calibration_rounds: bool = True, rounds: int = MIN_ROUNDS, name: str = "bench",
          rope_scaling: dict | None = None) -> tuple[list[BenchRow], float]:
    """decoders: names or (name, settings) (default: default_decoders()); limit: requests per cell (default
    max(MIN_REQUESTS, batch size)); tune: add a tuned row per decoder with a tune_grid;
    rounds: how many rounds (repeats x slices of the requests) each cell aims for (slices()); name: the
    runs' sweep name (what the leaderboard calls their group, e.g. "demo");
    bound: measure the step costs of each cell for bound_share; calibration_rounds: time a calibration
    round after every run and store the fits with their samples (info["adjacent_calibration"],
    info["interleaved_calibration"]: a fit of other terms can be made from the store); rope_scaling:
    replaces the checkpoint's (config.json's form, e.g. {"rope_type": "yarn", "factor": 2.0}), in every
    run's config."""
    check_tolerance(parity_tolerance)
    metrics.check_percentiles(percentiles)
    decoders = default_decoders() if decoders is None else decoders
    if repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    engine = load_engine(model, dtype, device, attention_backend, rope_scaling)
    for d in decoders:  # settings against the model (a layer index) before the first cell runs
        dname, args = decoder_spec(d)
        check_for_model(get_decoder(dname, **dict(args)), engine.cfg.num_layers)
    tolerance = resolve_tolerance(parity_tolerance, engine.dtype)
    engine.prefix_cache = {}
    bandwidth = memory_read_bandwidth()
    probe = MachineProbe()
    c = engine.cfg
    kv_per_pos = 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.tensor([], dtype=engine.dtype).element_size()
    weights = engine.model.weight_bytes()

    def add_bandwidth(rec: records.RunRecord) -> None:
        total = bytes_read(rec, weights, kv_per_pos)
        a = rec.aggregates
        a["bytes_per_token"] = total / a["generated_tokens"] if a.get("generated_tokens") else None
        a["achieved_bw_gbs"] = total / a["decode_wall_s"] / 1e9 if a.get("decode_wall_s") else None
        a["memory_bw_gbs"] = bandwidth / 1e9
        for key, agg in (("mem_gbs", "memory_bw_gbs"), ("fma_gflops", "fma_gflops")):
            lo_hi = state_range(rec.section("rounds", []), key)
            a[f"{agg}_min"], a[f"{agg}_max"] = lo_hi or (None, None)

    base = RunConfig(model=model, task=task, max_new_tokens=max_new_tokens, seed=seed, repeat=repeat, dtype=dtype,
                     device=device, attention_backend=attention_backend, ignore_eos=True,
                     rope_scaling=rope_scaling)
    rows: list[BenchRow] = []
    try:
        for ctx in contexts:
            for bs in batch_sizes:
                # Every setting of a cell reuses the prefix cache: each prompt is prefilled once.
                for smp in samplings:
                    cell = replace(base, context_len=ctx, batch_size=bs, limit=limit or max(MIN_REQUESTS, bs),
                                   temperature=smp.temperature, top_k=smp.top_k, top_p=smp.top_p)
                    cell_rows, interrupted = _cell(engine, cell, decoders, tune, show_progress, percentiles,
                                                   tolerance, calibration_rounds, probe, rounds, name)
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


def default_decoders() -> list[str]:
    """bench's decoders when none are named: every built-in decoder that is not an ablation."""
    return [name for name in BUILTIN if not trait(name, "ablation")]


def decoder_spec(d) -> tuple[str, tuple]:
    """A --decoders item, a name or (name, settings), as a hashable (name, sorted settings items)."""
    name, args = (d, {}) if isinstance(d, str) else d
    return name, tuple(sorted(args.items()))


def _entries(decoders, tune: bool) -> list[tuple[str, tuple, bool]]:
    """(decoder, settings, tuned) in run order: each tunable decoder's tuned row right after its
    untuned row, unless its settings fix every setting its grid tunes."""
    out = []
    for d in decoders:
        name, args = decoder_spec(d)
        out.append((name, args, False))
        if tune and tuned_settings(name, dict(args)):
            out.append((name, args, True))
    return out


def _cell(engine, cell: RunConfig, decoders, tune: bool, show_progress: bool, percentiles,
          tolerance: float, calibration_rounds: bool = True, probe=None, n_rounds: int = MIN_ROUNDS,
          name: str = "bench"):
    """Every decoder on one cell's requests, as one group, in rounds: repeat i (sampling seed seed + i)
    runs slice by slice; each slice is a round that probes the machine, then runs every decoder on the
    slice in an order rotated round by round. A repeat's slices make one output per decoder. Greedy
    rows get parity against the cell's AR run. Returns (rows, the KeyboardInterrupt that cut the
    repeats short or None): an interrupted cell keeps the whole repeats every decoder finished."""
    group = records.new_group_id()
    entries = _entries(decoders, tune)
    prepared = _prepared(engine, cell, entries, show_progress)
    reqs = prepared[entries[0]].reqs
    parts = slices(len(reqs), cell.batch_size, cell.repeat, n_rounds)
    outputs = {e: [] for e in entries}
    rounds: dict[tuple, Calibration] = {}  # (entry, repeat) -> the calibration round timed right after it
    machine: list[dict] = []  # one per round: the probe, the slice and the order the decoders ran in
    try:
        for i in range(cell.repeat):
            pieces = {e: [] for e in entries}
            for s, part in enumerate(parts):
                k = len(machine)
                order = entries[k % len(entries):] + entries[:k % len(entries)]
                state = probe() if probe is not None else {}
                machine.append({"round": k, "repeat": i, "slice": s, **state,
                                "requests": [reqs[j].id for j in part], "order": [_entry_label(e) for e in order]})
                for e in order:
                    pieces[e].append(_measure_slice(prepared[e], i, part, show_progress))
                    if calibration_rounds and s == len(parts) - 1:
                        rounds[e, i] = _calibration_round(engine, cell, seed=len(rounds))
            for e in entries:
                outputs[e].append(_joined(pieces[e]))
    except KeyboardInterrupt as stop:
        # Keep the repeats every decoder finished (whole repeats, so the ratios stay side by side); the
        # caller stores them and stops.
        done = min(len(o) for o in outputs.values())
        if not done:
            raise
        for o in outputs.values():
            del o[done:]
        rounds = {key: r for key, r in rounds.items() if key[1] < done}
        machine = [m for m in machine if m["repeat"] < done]
        interrupted = stop
    else:
        interrupted = None
    pooled = pooled_calibration(list(rounds.values()), source="interleaved calibration") if rounds else None
    # AR first: greedy rows get parity against the cell's AR run, in the record as it is built.
    records_of, ar = {}, None
    for e in sorted(entries, key=lambda e: e[0] != "ar"):
        prepared[e].info["verifications"] = [list(v) for o in outputs[e] for r in o.results for v in r.verifications]
        prepared[e].info["rounds"] = machine
        if rounds:
            after = rounds[e, traced_repeat(outputs[e])]  # calibrate() fitted its own samples already
            adjacent = replace(after, fit=replace(after.fit, source="adjacent calibration"), rounds=1)
            prepared[e].info["adjacent_calibration"] = adjacent.to_json()
            prepared[e].info["interleaved_calibration"] = pooled.to_json()
        greedy_ar = ar.requests if ar is not None and e[0] != "ar" and cell.temperature == 0 else None
        records_of[e] = finish(prepared[e], outputs[e], group=group, sweep=name, show_progress=show_progress,
                               percentiles=percentiles, ar=greedy_ar, parity_tolerance=tolerance).record
        if e[0] == "ar" and ar is None:
            ar = records_of[e]
    rows = [BenchRow(cell.context_len, cell.batch_size, "", records_of[e], tuned=e[2]) for e in entries]
    return rows, interrupted


def _prepared(engine, cell: RunConfig, entries: list, show_progress: bool) -> dict:
    """Each entry's prepared run, the prefix cache holding one set of prompts at a time (a 16k
    prompt's KV is 0.75 GB in fp32 on SmolLM2): the tuned entries first, on their tuning prompts; then
    only the cell's measured prompts (an earlier cell's are kept where this cell measures them too)."""
    _, _, reqs = build_requests(cell, engine)
    measured = {cached_prefix(r) for r in reqs}
    engine.keep_prefixes(measured)
    prepared = {}
    for e in sorted(entries, key=lambda e: not e[2]):
        prepared[e] = prepare(replace(cell, decoder=e[0], decoder_args=dict(e[1]), tune=e[2], warmup=False),
                              engine, show_progress)
    engine.keep_prefixes(measured)
    if cell.warmup:
        for e in entries:
            warm_up(prepared[e], show_progress)
    return {e: prepared[e] for e in entries}


def _entry_label(e: tuple) -> str:
    name, args, tuned = e
    return name + (f"({', '.join(f'{k}={v}' for k, v in args)})" if args else "") + (" tuned" if tuned else "")


def _measure_slice(p, i: int, part: range, show_progress: bool) -> GenerationOutput:
    """Repeat i (seed + i) of run p on the requests of one slice."""
    return generate(p.decoder, {}, p.engine, [p.reqs[j] for j in part], replace(p.params, seed=p.cfg.seed + i),
                    p.cfg.batch_size, f"{p.cfg.decoder} {i + 1}/{p.cfg.repeat}", show_progress)


def _joined(pieces: list[GenerationOutput]) -> GenerationOutput:
    """One repeat's slices as one output: their requests in order and their steps. Decode time is the
    sum of the steps' walls (metrics.decode_wall_time), so the other decoders' runs between slices
    count for nothing; the output spans the slices' own durations."""
    if len(pieces) == 1:
        return pieces[0]
    steps = [replace(st, index=n) for n, st in enumerate(st for o in pieces for st in o.steps)]
    t0 = pieces[0].t_start
    return GenerationOutput([r for o in pieces for r in o.results], steps, t0,
                            t0 + sum(o.t_end - o.t_start for o in pieces), info=pieces[-1].info)


def _calibration_round(engine, cell: RunConfig, seed: int = 0) -> Calibration:
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
    drafted = [v[0] for r in rows for v in r.record.section("verifications", [])]
    # each decoder's default view (a row given settings gets no bound share, see derive_figures)
    names = {r.decoder for r in rows if trait(r.decoder, "draft_kind") and not r.given}
    kinds = {trait(d, "draft_kind") for d in names} & set(TIMED_DRAFTS)
    host = {trait(d, "draft_kind") for d in names if trait(d, "host_drafts")}
    own = {trait(d, "draft_kind"): e for d in names if (e := trait(d, "draft_engine")(engine)) is not None}
    if not drafted or not (kinds or host or own):
        return None
    context, _ = parse_bucket(cell.context_len)
    return measure_cell(engine, context, cell.batch_size, max(max(drafted), 1), STEP_COST_REPEATS,
                        kinds=("ar", "verify", *sorted(kinds)), gammas=set(drafted), host=sorted(host), own=own)


def derive_figures(rows: list[BenchRow], costs: dict | None) -> None:
    """speedup_vs_ar (+ _ci95), speedup_vs_best_baseline (+ _ci95) and bound_share per row of one cell.

    Ratios pool every request of every repeat: (Σ tokens / Σ decode seconds) of the row over the same
    of the reference; intervals resample (request, repeat) pairs and, apart, whole rounds
    (metrics.ratio_ci), the wider kept. The best baseline is
    the baseline row, tuned or at its default, with the highest speedup over AR on the measured
    requests: tuning picks gamma from short runs on other prompts, and where its pick measures
    slower than the default, the default is the stronger baseline."""
    samples = {id(r): _samples(r.record) for r in rows}
    blocks = _blocks(rows[0].record) if rows else {}
    ar = next((r for r in rows if r.decoder == "ar"), None)
    for r in rows:
        f = r.figures
        f["speedup_vs_ar"] = f["speedup_vs_ar_ci95"] = None
        if ar is not None:
            f["speedup_vs_ar"] = metrics.ratio(samples[id(r)], samples[id(ar)])
            f["speedup_vs_ar_ci95"] = _ci(samples[id(r)], samples[id(ar)], blocks)
    baselines = [r for r in rows if trait(r.decoder, "baseline")]
    best = max(baselines, key=lambda r: metrics.ratio(samples[id(r)], samples[id(ar or r)]) or 0.0, default=None)
    for r in rows:
        f = r.figures
        spec = r.decoder != "ar"
        f["best_baseline"] = best.label if best is not None and spec else None
        f["speedup_vs_best_baseline"] = f["speedup_vs_best_baseline_ci95"] = None
        if spec and best is not None:
            f["speedup_vs_best_baseline"] = metrics.ratio(samples[id(r)], samples[id(best)])
            f["speedup_vs_best_baseline_ci95"] = _ci(samples[id(r)], samples[id(best)], blocks)
        f["allowed_speedup"] = f["bound_share"] = None
        # the cell's step costs are those of each decoder's default view: none for a row given settings
        kind = trait(r.decoder, "draft_kind")
        if spec and costs is not None and f"c_{kind}" in costs and not r.given:
            allowed = metrics.allowed_speedup([tuple(v) for v in r.record.section("verifications", [])],
                                              costs[f"c_{kind}"], costs["v_by_gamma"])
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
            r.record.set_section("step_costs", costs)


def _samples(rec: records.RunRecord) -> dict:
    return {(rid, i): (tok, sec) for rid, i, tok, sec in rec.section("decode_samples", [])}


def _blocks(rec: records.RunRecord) -> dict:
    """(request id, repeat) -> the round that measured it."""
    return {(rid, m["repeat"]): m["round"] for m in rec.section("rounds", []) for rid in m["requests"]}


def _ci(num: dict, den: dict, blocks: dict | None = None) -> list[float] | None:
    """The wider of the intervals over requests x repeats and over rounds (blocks in time): the first
    sees the prompts' spread, the second the machine's drift between rounds."""
    cis = [ci for ci in (metrics.ratio_ci(num, den), metrics.ratio_ci(num, den, blocks=blocks) if blocks else None)
           if ci is not None]
    return list(max(cis, key=lambda c: c[1] - c[0])) if cis else None


def _fmt_ratio(x, ci) -> str:
    if x is None:
        return "—"
    return f"{x:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{x:.2f}"


def _ms(a: dict, key: str) -> str:
    return f"{a[key] * 1e3:,.1f}" if a.get(key) is not None else "—"


def machine_state(rows: list[BenchRow]) -> str:
    """`; rounds: memory LOW-HIGH GB/s, FMA LOW-HIGH GFLOP/s`: the range the rounds' probes saw."""
    rounds = list({id(m): m for r in rows for m in r.record.section("rounds", [])}.values())
    mem, fma = state_range(rounds, "mem_gbs"), state_range(rounds, "fma_gflops")
    if mem is None or fma is None:
        return ""
    return (f"; {len(rounds)} rounds: memory {mem[0]:.1f}-{mem[1]:.1f} GB/s, "
            f"FMA {fma[0]:.0f}-{fma[1]:.0f} GFLOP/s")


def state_notes(store, rows: list[BenchRow]) -> list[str]:
    """A line per cell whose machine state (the rounds' memory bandwidth) lies outside the range an earlier
    stored run of the same cell and decoder saw: the two runs' intervals need not overlap."""
    notes = []
    for r in rows:
        now = state_range(r.record.section("rounds", []), "mem_gbs")
        if now is None or r.decoder != "ar":
            continue
        for s in store.list_runs(config_hash=r.record.config_hash):
            if s["run_id"] == r.record.run_id:
                continue
            lo, hi = s["aggregates"].get("memory_bw_gbs_min"), s["aggregates"].get("memory_bw_gbs_max")
            if lo is None or hi is None or (lo <= now[0] and now[1] <= hi):
                continue
            notes.append(f"machine state moved: the {r.context} x {r.batch_size} {r.sampling} cell's rounds read memory "
                         f"at {now[0]:.1f}-{now[1]:.1f} GB/s, run #{s['run_id']} of the same cell ({s['created_at'][:16]}) "
                         f"at {lo:.1f}-{hi:.1f} GB/s: their intervals need not overlap")
            break
    return notes


# The compact view of `bench`: the cell, the row, its ratios and what explains them.
BENCH_DEFAULT = ("context", "batch", "sampling", "decoder", "speedup_vs_ar", "speedup_vs_best_baseline",
                 "bound_share", "decode_tok_s", "mean_accepted_len", "draft_acceptance_rate", "tpot_p50_s", "parity_identical_pct",
                 "score_mean")


def bench_table(rows: list[BenchRow], bandwidth: float, columns: str | None = None):
    """The rows as a table; `columns`: a --columns value (None: BENCH_DEFAULT, the compact view)."""
    from rich.markup import escape
    from rich.table import Table

    from .tables import choose_columns

    def pct(a, key, f="{:.0f}"):
        return f.format(a[key]) if a.get(key) is not None else "—"

    def tok(r, a, f):
        x = a.get("decode_tok_s_median")
        return f"{x:,.1f} ({a['decode_tok_s_min']:,.1f}-{a['decode_tok_s_max']:,.1f})" if x else "—"

    def acc_len(r, a, f):
        if not a.get("mean_accepted_len"):
            return "—"
        if a.get("req_accepted_len_p0") is None:
            return f"{a['mean_accepted_len']:.2f}"
        return f"{a['mean_accepted_len']:.2f} ({a['req_accepted_len_p0']:.1f}-{a['req_accepted_len_p100']:.1f})"

    def d4(r, a, f):
        x = a.get("distinct4_mean")
        return (f"{x:.2f}" + (" COLLAPSED" if x < metrics.COLLAPSE_THRESHOLD else "")) if x is not None else "—"

    # name: (header, cell of (row, aggregates, figures))
    cells = {
        # a scaled cell says so ("16k yarn×2"): it may run past the model's trained length
        "context": ("context", lambda r, a, f: " ".join(filter(None, (r.context, rope.label(r.rope_scaling))))),
        "batch": ("batch", lambda r, a, f: str(r.batch_size)),
        "sampling": ("sampling", lambda r, a, f: r.sampling),
        "decoder": ("decoder", lambda r, a, f: escape(r.label)),
        "n_requests": ("requests", lambda r, a, f: f"{a['n_requests']}x{a.get('repeats', 1)}"),
        "speedup_vs_ar": ("× AR", lambda r, a, f: _fmt_ratio(f.get("speedup_vs_ar"), f.get("speedup_vs_ar_ci95"))
                          if r.decoder != "ar" else "1"),
        "speedup_vs_best_baseline": ("× best baseline", lambda r, a, f: _fmt_ratio(
            f.get("speedup_vs_best_baseline"), f.get("speedup_vs_best_baseline_ci95"))),
        "decode_tok_s": ("decode tok/s (repeat min-max)", tok),
        "bound_share": ("bound share", lambda r, a, f: f"{f['bound_share']:.0%} of {f['allowed_speedup']:.2f}x"
                        if f.get("bound_share") is not None else "—"),
        "mean_accepted_len": ("accepted len (req min-max)", acc_len),
        "draft_acceptance_rate": ("acceptance", lambda r, a, f: pct(a, "draft_acceptance_rate", "{:.1%}")),
        "tpot_p50_s": ("TPOT p50 ms", lambda r, a, f: _ms(a, "tpot_p50_s")),
        "itl_p50_s": ("ITL p50 ms", lambda r, a, f: _ms(a, "itl_p50_s")),
        "parity_identical_pct": ("parity %", lambda r, a, f: pct(a, "parity_identical_pct")),
        "score_mean": ("score", lambda r, a, f: pct(a, "score_mean", "{:.3f}")),
        "distinct4_mean": ("distinct-4", d4),
        "bytes_per_token": ("bytes/token", lambda r, a, f: f"{a['bytes_per_token'] / 1e6:.1f} MB"
                            if a.get("bytes_per_token") else "—"),
        "achieved_bw_gbs": ("achieved GB/s", lambda r, a, f: f"{a['achieved_bw_gbs']:.1f} "
                            f"({a['achieved_bw_gbs'] / a['memory_bw_gbs']:.0%})" if a.get("achieved_bw_gbs") else "—"),
    }
    names = choose_columns(list(cells), columns, BENCH_DEFAULT)
    runs_on = ", ".join(dict.fromkeys(" in ".join(filter(None, (str(r.record.config.get("model")), r.dtype)))
                                      for r in rows))
    t = Table(title=f"decoders side by side on {runs_on} (memory read bandwidth {bandwidth / 1e9:.1f} GB/s"
                    f"{machine_state(rows)}); "
                    "[95% bootstrap interval, the wider over requests x repeats and over rounds]")
    t.key_columns = sum(1 for c in names[:4] if c in ("context", "batch", "sampling", "decoder"))
    for name in names:
        t.add_column(cells[name][0], justify="left" if name in ("context", "sampling", "decoder") else "right")
    for r in rows:
        t.add_row(*(cells[name][1](r, r.record.aggregates, r.figures) for name in names))
    return t
