"""`aspire-bench bench`: decoders side by side on the same requests, in one process.

Per (context, batch size, sampling) cell: one group; every decoder runs the same requests with a
warm-up and R measured repeats (median stored), each request generating exactly max_new_tokens
(EOS ignored, as throughput benchmarks do, so every decoder does the same work under sampling too).
The engine's prefix cache prefills each prompt once for all decoders (decode throughput excludes
prefill anyway; TTFT is therefore not meaningful here).
Greedy runs get parity against the cell's AR run; every run gets the bytes it read per generated
token and the bandwidth that achieved, against this machine's read bandwidth measured in the run.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch

from . import metrics, records
from .runner import RunConfig, load_engine, run
from .store import save_record

DECODERS = ("ar", "magicdec", "vegas", "aspire", "aspire-fixed", "aspire-fsm", "aspire-norefresh")
BASELINES = ("magicdec", "vegas")
# Named sampling settings: greedy is the parity setting, "paper" the ASPIRE paper's sampling setting.
SAMPLINGS = {"greedy": (0.0, 0, 1.0), "paper": (0.7, 50, 0.9)}


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


def add_parity(rec: records.RunRecord, ar: records.RunRecord) -> None:
    ar_by_id = {r.id: r for r in ar.requests}
    items = []
    for r in rec.requests:
        a = ar_by_id[r.id]
        p = metrics.parity(r.output_ids, a.output_ids, a.extra.get("margins"))
        r.parity = {**p.__dict__, "identical": p.identical}
        items.append(p)
    rec.aggregates.update(metrics.summarize_parity(items))


@dataclass
class BenchRow:
    context: str
    batch_size: int
    sampling: str
    record: records.RunRecord


def bench(model: str = "tiny", task: str = "code-completion", contexts=("4k", "16k", "32k"), batch_sizes=(1, 8),
          decoders=DECODERS, repeat: int = 3, max_new_tokens: int = 128,
          samplings=(Sampling(*SAMPLINGS["greedy"]),), seed: int = 0, limit: int | None = None, store: str | None = None,
          dtype: str = "float32", device: str = "cpu", attention_backend: str = "auto",
          show_progress: bool = True) -> tuple[list[BenchRow], float]:
    engine = load_engine(model, dtype, device, attention_backend)
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
                    cell = replace(base, context_len=ctx, batch_size=bs, limit=limit or bs,
                                   temperature=smp.temperature, top_k=smp.top_k, top_p=smp.top_p)
                    rows += [BenchRow(ctx, bs, smp.name, rec) for rec in
                             _cell(engine, cell, decoders, store, show_progress, add_bandwidth)]
    finally:
        engine.prefix_cache = None
    return rows, bandwidth


def _cell(engine, cell: RunConfig, decoders, store: str | None, show_progress: bool,
          add_bandwidth) -> list[records.RunRecord]:
    """Every decoder on one cell's requests, as one group; parity against the cell's AR run under greedy."""
    group = records.new_group_id()
    ar, recs = None, []
    for dec in decoders:
        rec = run(replace(cell, decoder=dec), group=group, sweep="bench", engine=engine,
                  show_progress=show_progress).record
        if dec == "ar":
            ar = rec
        elif ar is not None and cell.temperature == 0:
            add_parity(rec, ar)
        add_bandwidth(rec)
        if store is not None:
            save_record(store, rec)  # a recovery JSONL beside the store if saving fails
        recs.append(rec)
    return recs


def bench_table(rows: list[BenchRow], bandwidth: float):
    from rich.table import Table
    t = Table(title=f"decoders side by side (memory read bandwidth {bandwidth / 1e9:.1f} GB/s)")
    for col in ("context", "batch", "sampling", "decoder", "decode tok/s (min-max)", "x AR", "x best baseline",
                "accepted len (req min-max)", "parity %", "distinct-4", "bytes/token", "achieved GB/s"):
        t.add_column(col, justify="left" if col in ("context", "sampling", "decoder") else "right")
    cells: dict[tuple, list[BenchRow]] = {}
    for r in rows:
        cells.setdefault((r.context, r.batch_size, r.sampling), []).append(r)
    for (ctx, bs, smp), rs in cells.items():
        speed = {r.record.config["decoder"]: r.record.aggregates.get("decode_tok_s_median") for r in rs}
        ar = speed.get("ar")
        base = max((speed[b] for b in BASELINES if speed.get(b)), default=None)
        for r in rs:
            a, dec = r.record.aggregates, r.record.config["decoder"]
            tok = a.get("decode_tok_s_median")
            d4 = a.get("distinct4_mean")
            collapsed = d4 is not None and d4 < metrics.COLLAPSE_THRESHOLD
            t.add_row(
                ctx, str(bs), smp, dec,
                f"{tok:,.1f} ({a['decode_tok_s_min']:,.0f}-{a['decode_tok_s_max']:,.0f})" if tok else "—",
                f"{tok / ar:.2f}" if tok and ar else "—",
                f"{tok / base:.2f}" if tok and base and dec not in BASELINES else "—",
                (f"{a['mean_accepted_len']:.2f} ({a['req_accepted_len_p0']:.1f}-{a['req_accepted_len_p100']:.1f})"
                 if a.get("req_accepted_len_p0") is not None else f"{a['mean_accepted_len']:.2f}")
                if a.get("mean_accepted_len") else "—",
                f"{a['parity_identical_pct']:.0f}" if a.get("parity_identical_pct") is not None else "—",
                (f"{d4:.2f}" + (" COLLAPSED" if collapsed else "")) if d4 is not None else "—",
                f"{a['bytes_per_token'] / 1e6:.1f} MB" if a.get("bytes_per_token") else "—",
                f"{a['achieved_bw_gbs']:.1f} ({a['achieved_bw_gbs'] / a['memory_bw_gbs']:.0%})"
                if a.get("achieved_bw_gbs") else "—",
            )
    return t
