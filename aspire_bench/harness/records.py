"""A run record: what one run measured, in a form the store, JSONL files and reports share."""
from __future__ import annotations

import hashlib
import importlib.metadata
import itertools
import json
import math
import os
import platform
import subprocess
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import aspire_bench
from aspire_bench.decoders.base import GenerationOutput, ParityMargins
from aspire_bench.harness import metrics
from aspire_bench.harness.parity import Parity, RunParity
from aspire_bench.kernels.cpu_build import cpu_flags, cpuinfo

if TYPE_CHECKING:
    import torch

# Config keys that say where or how a run is filed, not what was measured: left out of the hash so
# the same measurement filed elsewhere still matches.
NON_IDENTITY_KEYS = frozenset({"store", "store_path", "out", "output_dir", "tag", "sweep", "group", "verbose"})


class RunInfo(TypedDict, total=False):
    """The named sections of RunRecord.info: measurements kept with a run, not decoder settings (every
    other key of info is what the decoder reported, GenerationOutput.info). Written through
    RunRecord.set_section or from_output's `info`, read through RunRecord.section: a name not listed
    here is refused, so a misspelt section fails where it is written or read."""
    decode_samples: list  # from_output: [request id, repeat, tokens, decode seconds] per request per repeat
    tuning: dict  # runner: the tuned row's grid results and the settings chosen (harness/tuning.py)
    verifications: list  # bench: [drafted, accepted] of every verification of every repeat
    rounds: list  # bench: per round its repeat, slice, requests, decoder order and machine probe
    adjacent_calibration: dict  # bench: the calibration round after the traced repeat (Calibration.to_json)
    interleaved_calibration: dict  # bench: all the cell's calibration rounds pooled (Calibration.to_json)
    step_costs: dict  # bench: the cell's step costs, c per draft kind and v by draft length
    recall: dict  # diagnose recall: its rows and requests
    heterogeneity: dict  # diagnose heterogeneity: per request and summary


INFO_SECTIONS = frozenset(RunInfo.__annotations__)


def info_section(name: str) -> str:
    """`name`, when it is a section of a run's info (RunInfo); ValueError otherwise."""
    if name not in INFO_SECTIONS:
        raise ValueError(f"{name!r} is not a section of a run's info (records.RunInfo): one of "
                         f"{', '.join(sorted(INFO_SECTIONS))}")
    return name


def info_sections(info: Mapping) -> dict:
    """`info` as a dict, every key checked to be a section (info_section)."""
    return {info_section(k): v for k, v in info.items()}


# Column order of one step row in StepRecord.rows.
# What a stored run is: measured by running a decoder, predicted by `aspire-bench simulate`, or a
# measurement about a model rather than a decoder (`aspire-bench diagnose`).
RUN_KINDS = ("measured", "simulated", "diagnostic")
# kv_sparse, kv_captured, kv_layered and kv_topk came later: rows stored before them have the first seven,
# eight or nine columns (read them with row_kv_sparse, row_kv_captured and row_kv_shaped)
ROW_COLUMNS = ("request", "kind", "n_tokens", "committed", "drafted", "accepted", "kv_read", "kv_sparse",
               "kv_captured", "kv_layered", "kv_topk")


def row_kv_sparse(row) -> int:
    """A stored row's KV read scattered through a sparse view (engine.scattered_positions); 0 for a
    row stored before the column existed."""
    return row[7] if len(row) > 7 else 0


def row_kv_captured(row) -> int:
    """A stored row's KV positions whose scores it captured (ForwardOutput.kv_captured); 0 for a row
    stored before the column existed (such a run is priced without the capture's cost)."""
    return row[8] if len(row) > 8 else 0


def row_kv_shaped(row) -> tuple[int, int]:
    """A stored row's (kv_layered, kv_topk) (RowTrace); (0, 0) for a row stored before the columns
    existed (such a run's Vegas-shaped work is priced by the generic terms)."""
    return (row[9], row[10]) if len(row) > 10 else (0, 0)


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def config_hash(config: Mapping) -> str:
    """sha256 of the canonical JSON of the config without NON_IDENTITY_KEYS (top level)."""
    identity = {k: v for k, v in config.items() if k not in NON_IDENTITY_KEYS}
    return hashlib.sha256(canonical_json(identity).encode()).hexdigest()


def new_group_id() -> str:
    """One id for the runs measured side by side in one invocation (speedups are taken within it)."""
    return uuid.uuid4().hex[:12]


@dataclass
class RequestRow:
    id: str
    prompt_len: int
    output_ids: list[int]
    finish_reason: str
    text: str | None = None
    score: float | None = None
    # Seconds since the run's generate() started (GenerationOutput.t_start).
    t_arrival: float = 0.0
    t_prefill_start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    verifications: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted)
    figures: dict = field(default_factory=dict)  # metrics.request_figures
    parity: dict | None = None  # metrics.Parity fields, for speculative runs compared with AR
    # RequestResult's typed fields (decoders/base.py)
    margins: ParityMargins | None = None
    schedule: list[dict] | None = None
    draft_lengths: list[int] | None = None
    extra: dict = field(default_factory=dict)  # RequestResult.extra, and fields a newer writer added

    @classmethod
    def from_json(cls, d: Mapping) -> RequestRow:
        """A stored row (a JSONL record's, the store's). Fields a newer writer added are kept in `extra`,
        unread; a row stored before the typed fields has them in `extra` (AR's `margins`, `runner_up`
        and `top_logit`, `schedule`, `draft_lengths`): read into them."""
        known, unknown = known_fields(cls, d)
        row = cls(**{**known, "verifications": [tuple(v) for v in known.get("verifications", [])]})
        if isinstance(row.extra, Mapping):  # else refused by record_problem
            row.extra = old = {**unknown, **row.extra}
            if row.margins is None and "margins" in old:
                row.margins = ParityMargins(old.pop("margins"), old.pop("runner_up", []),
                                            old.pop("top_logit", []))
            for k in ("schedule", "draft_lengths"):
                if getattr(row, k) is None and k in old:
                    setattr(row, k, old.pop(k))
        if isinstance(row.margins, Mapping):
            row.margins = ParityMargins(**known_fields(ParityMargins, row.margins)[0])
        return row


@dataclass
class StepRecord:
    index: int
    t_start: float  # seconds since generate() started
    t_end: float
    n_tokens: int
    rows: list[tuple] = field(default_factory=list)  # one tuple per row, columns ROW_COLUMNS


@dataclass
class RunRecord:
    config: dict
    config_hash: str
    env: dict
    status: str = "ok"  # "ok" | "failed"
    kind: str = "measured"  # one of RUN_KINDS; only measured runs are ranked (leaderboard, gate)
    error: str | None = None
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    sweep: str | None = None
    tag: str | None = None
    group: str | None = None
    info: dict = field(default_factory=dict)  # GenerationOutput.info (settings the decoder used) and RunInfo
    requests: list[RequestRow] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    aggregates: dict = field(default_factory=dict)
    run_id: int | None = None  # set by the store

    def to_json(self) -> dict:
        return asdict(self)

    def section(self, name: str, default: Any = None) -> Any:
        """A section of info (RunInfo), or `default` when the run has none."""
        return self.info.get(info_section(name), default)

    def set_section(self, name: str, value: Any) -> None:
        self.info[info_section(name)] = value

    @property
    def settings(self) -> dict:
        """info without its sections: what the decoder reported (the settings actually used)."""
        return {k: v for k, v in self.info.items() if k not in INFO_SECTIONS}

    @classmethod
    def from_json(cls, d: Mapping) -> RunRecord:
        """The record of a JSON object; fields a newer writer added are kept in `info`/`extra`, unread."""
        d, unknown = known_fields(cls, d)
        d["requests"] = [RequestRow.from_json(r) for r in d.get("requests", [])]
        d["steps"] = [StepRecord(**{**known_fields(StepRecord, s)[0], "rows": [tuple(x) for x in s["rows"]]})
                      for s in d.get("steps", [])]
        rec = cls(**d)
        for k, v in unknown.items():
            rec.info.setdefault(k, v)
        return rec


def record_problem(rec: RunRecord) -> str | None:
    """Why a record does not fit the store's schema (checked on every save and on import), or None.
    Unknown fields are allowed (a newer writer's); the types the store and reports rely on are not."""
    number = (int, float, type(None))
    fields_ = [("config", rec.config, dict), ("env", rec.env, dict), ("info", rec.info, dict),
               ("aggregates", rec.aggregates, dict), ("requests", rec.requests, list), ("steps", rec.steps, list),
               ("created_at", rec.created_at, str), ("config_hash", rec.config_hash, str)]
    fields_ += [(k, getattr(rec, k), (str, type(None))) for k in ("error", "sweep", "tag", "group")]
    for name, value, kind in fields_:
        if not isinstance(value, kind):
            return f"{name} is {type(value).__name__}, not {_kinds(kind)}"
    if rec.status not in ("ok", "failed"):
        return f"status {rec.status!r} is not ok or failed"
    if rec.kind not in RUN_KINDS:
        return f"kind {rec.kind!r} is not one of {', '.join(RUN_KINDS)}"
    for k, v in rec.aggregates.items():
        if not isinstance(k, str) or not isinstance(v, number):
            return f"aggregate {k!r} is {type(v).__name__}, not a number"
    for i, r in enumerate(rec.requests):
        where = f"request {i}"
        if not isinstance(r, RequestRow) or not isinstance(r.id, str) or not isinstance(r.finish_reason, str):
            return f"{where} lacks a string id or finish_reason"
        if not (isinstance(r.prompt_len, int) and isinstance(r.output_ids, list)
                and all(isinstance(t, int) for t in r.output_ids)):
            return f"{where}: prompt_len must be an integer and output_ids a list of integers"
        if not isinstance(r.score, number) or not all(isinstance(t, (int, float)) for t in r.token_times):
            return f"{where}: score and token_times must be numbers"
        if not isinstance(r.figures, dict) or not isinstance(r.extra, dict) or not isinstance(r.parity, (dict, type(None))):
            return f"{where}: figures, extra and parity must be mappings"
        optional = type(None)
        if not (isinstance(r.margins, (ParityMargins, optional)) and isinstance(r.schedule, (list, optional))
                and isinstance(r.draft_lengths, (list, optional))):
            return f"{where}: margins must be AR's record and schedule and draft_lengths lists, or null"
    for i, s in enumerate(rec.steps):
        if not (isinstance(s.index, int) and isinstance(s.n_tokens, int) and isinstance(s.t_start, (int, float))
                and isinstance(s.t_end, (int, float)) and isinstance(s.rows, list)):
            return f"step {i} has fields of the wrong type"
    return None


def _kinds(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else {"dict": "a mapping", "list": "a list", "str": "a string"}
                       .get(k.__name__, k.__name__) for k in kinds)


def record_hash(rec: RunRecord) -> str:
    """The content of a record (every field but the store's run id): the same run imported twice is
    recognised and stored once."""
    d = {k: v for k, v in rec.to_json().items() if k != "run_id"}
    # as the store gives them back: NaN as NULL, booleans as integers
    d["aggregates"] = {k: None if isinstance(v, float) and math.isnan(v) else int(v) if isinstance(v, bool) else v
                       for k, v in d["aggregates"].items()}
    return hashlib.sha256(canonical_json(d).encode()).hexdigest()


def known_fields(cls, d: Mapping) -> tuple[dict, dict]:
    """(the entries of d that are fields of dataclass cls, the others)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}, {k: v for k, v in d.items() if k not in names}


def from_output(
    config: Mapping, output: GenerationOutput, prompt_lens: Mapping[str, int], env: Mapping, *,
    texts: Mapping[str, str] | None = None, scores: Mapping[str, float | None] | None = None,
    parity: RunParity | None = None, repeats: Sequence[GenerationOutput] | None = None,
    info: Mapping | None = None, backend: str | None = None, dtype: torch.dtype | str | None = None,
    sweep: str | None = None, tag: str | None = None,
    group: str | None = None, percentiles=metrics.DEFAULT_PERCENTILES,
) -> RunRecord:
    """The record of a finished run, the one builder of run, bench, sweep and the lm-eval model.

    output: the run (with repeats, the repeat that is stored); aggregates by metrics.aggregate.
    parity: parity.against_ar's comparison (per-request rows, the parity figures and the tolerance).
    repeats: every measured repeat, for the repeat spread of decode_tok_s and the decode_samples section.
    info: sections (RunInfo: a name that is not one is refused) kept with the decoder's own
    GenerationOutput.info; backend, dtype: the attention backend that ran and the model's dtype (a
    torch.dtype or its name), stored in env."""
    t0 = output.t_start
    found = parity.requests if parity is not None else {}
    requests = [
        RequestRow(
            id=r.id, prompt_len=prompt_lens[r.id], output_ids=list(r.output_ids),
            finish_reason=r.finish_reason, text=(texts or {}).get(r.id), score=(scores or {}).get(r.id),
            t_arrival=r.t_arrival - t0, t_prefill_start=r.t_prefill_start - t0,
            token_times=[t - t0 for t in r.token_times], verifications=[tuple(v) for v in r.verifications],
            figures=metrics.request_figures(r),
            parity=_parity_dict(found[r.id]) if r.id in found else None, margins=r.margins,
            schedule=r.schedule, draft_lengths=r.draft_lengths, extra=dict(r.extra),
        )
        for r in output.results
    ]
    steps = [
        StepRecord(s.index, s.t_start - t0, s.t_end - t0, s.n_tokens,
                   [(w.request, w.kind, w.n_tokens, w.committed, w.drafted, w.accepted, w.kv_read, w.kv_sparse,
                     w.kv_captured, w.kv_layered, w.kv_topk)
                    for w in s.rows])
        for s in output.steps
    ]
    aggregates = metrics.aggregate(output, scores=scores, parity=found if parity is not None else None,
                                   prompt_lens=prompt_lens, percentiles=percentiles)
    if repeats is not None:
        rates = [metrics.decode_tok_s(o) or 0.0 for o in repeats]
        aggregates.update({f"decode_tok_s_{k}": v for k, v in metrics.summarize_repeats(rates).items()})
        aggregates["repeats"] = len(repeats)
    if parity is not None:
        aggregates["parity_tolerance"] = parity.tolerance
    run_info = {**output.info, **info_sections(info or {})}
    if repeats is not None:
        run_info[info_section("decode_samples")] = decode_samples(repeats)
    env = dict(env)
    if backend is not None:
        env["attention_backend"] = backend
    if dtype is not None:
        env["dtype"] = str(dtype).removeprefix("torch.")
    return RunRecord(
        config=dict(config), config_hash=config_hash(config), env=env, sweep=sweep, tag=tag, group=group,
        info=run_info, requests=requests, steps=steps, aggregates=aggregates,
    )


def decode_samples(outputs: Sequence[GenerationOutput]) -> list[list]:
    """[request id, repeat, generated tokens, charged decode seconds] per request per repeat."""
    return [[rid, i, tok, sec] for i, o in enumerate(outputs)
            for rid, (tok, sec) in metrics.request_decode_times(o).items()]


def failed(config: Mapping, env: Mapping, error: str, *, sweep: str | None = None, tag: str | None = None,
           group: str | None = None) -> RunRecord:
    """The record of a run that raised: kept so a sweep shows which cells failed and why."""
    return RunRecord(config=dict(config), config_hash=config_hash(config), env=dict(env), status="failed",
                     error=error, sweep=sweep, tag=tag, group=group)


def _parity_dict(p: Parity) -> dict:
    return {**asdict(p), "identical": p.identical}


# --- environment ------------------------------------------------------------------------------


def capture_environment() -> dict:
    """Versions, hardware and code revision, so a number can be traced to what produced it."""
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "aspire_bench": aspire_bench.__version__,
        "cpu": cpu_model(),
        **cpu_details(),
        "cpu_count": os.cpu_count(),
        **_torch_info(),
        "transformers": _version("transformers"),
    }
    env.update(_git_revision(Path(aspire_bench.__file__).resolve().parent.parent))
    return env


def _version(dist: str) -> str | None:
    # Package metadata, not an import: importing transformers alone takes seconds.
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_info() -> dict:
    try:
        import torch
    except ImportError:
        return {"torch": None, "device": None, "gpu": None, "cuda": None}
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    # CPU timings depend on the thread count and OpenMP's wait policy as much as on the code.
    omp = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "MKL_NUM"))}
    return {"torch": torch.__version__, "device": "cuda" if gpu else "cpu", "gpu": gpu, "cuda": torch.version.cuda,
            "torch_threads": torch.get_num_threads(), "omp_env": omp}


def cpu_model() -> str:
    return cpuinfo().get("model name") or platform.processor() or platform.machine()


SIMD_FLAGS = ("avx512f", "avx2", "asimd")  # the widest a machine has, in /proc/cpuinfo's flags


def cpu_details() -> dict:
    """CPU family and model numbers, the widest SIMD extension and whether it has bf16 dot products
    (AVX512_BF16): machines sold under one model name ("AMD EPYC") differ in all three, and the compiled
    kernels' speed follows the SIMD width (and, for a bf16 model's attention, the bf16 dot products)."""
    info = cpuinfo()
    flags = cpu_flags(info)
    return {"cpu_family_model": f"{info['cpu family']}/{info['model']}" if "cpu family" in info else None,
            "cpu_simd": next((f for f in SIMD_FLAGS if f in flags), None),
            "cpu_bf16_dot": "avx512_bf16" in flags if flags else None}


def _git_revision(repo: Path) -> dict:
    """HEAD and whether tracked files differ from it; empty when not a git checkout."""
    # GIT_OPTIONAL_LOCKS=0: never take the index lock (another process may be committing).
    git_env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10,
                              check=True, env=git_env).stdout.strip()

    try:
        return {"git_rev": git("rev-parse", "HEAD"),
                "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {}


# --- JSONL ------------------------------------------------------------------------------------


def write_jsonl(records: Iterable[RunRecord], stream) -> int:
    """One record per line; returns how many were written."""
    n = 0
    for rec in records:
        stream.write(json.dumps(rec.to_json(), default=str) + "\n")
        n += 1
    return n


def read_jsonl(stream) -> list[RunRecord]:
    """One record per line (lines split at newline only: a raw U+2028 inside a string is valid JSON)."""
    return [RunRecord.from_json(json.loads(line)) for line in stream if line.strip()]


def platform_summary(env: Mapping) -> str:
    """One line for tables: GPU name, else CPU model."""
    return env.get("gpu") or env.get("cpu") or "?"



def vllm_result(record: RunRecord, percentiles=metrics.DEFAULT_PERCENTILES) -> dict:
    """A run as vLLM's `bench serve --save-result` JSON names it (times in ms; docs/metrics.md#vllm)."""
    a = record.aggregates
    out = {
        "date": record.created_at, "backend": "aspire-bench", "model_id": record.config.get("model"),
        "decoder": record.config.get("decoder"), "settings": record.settings,
        "num_prompts": a.get("n_requests"), "max_concurrency": record.config.get("batch_size"),
        "duration": a.get("total_wall_s"), "completed": a.get("n_requests"),
        "total_input_tokens": a.get("input_tokens"), "total_output_tokens": a.get("output_tokens"),
        "request_throughput": a.get("request_throughput"), "output_throughput": a.get("e2e_tok_s"),
        "total_token_throughput": a.get("total_token_throughput"),
        "decode_throughput": a.get("decode_tok_s"),
        "input_lens": [r.prompt_len for r in record.requests],
        "output_lens": [len(r.output_ids) for r in record.requests],
        "ttfts": [r.figures.get("ttft_s") for r in record.requests],
        "itls": [[b - a_ for a_, b in itertools.pairwise(_commit_times(r.token_times))] for r in record.requests],
        "generated_texts": [r.text for r in record.requests],
        "errors": ["" for _ in record.requests],
    }
    for ours, theirs in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2e", "e2el")):
        for stat in ("mean", "median"):
            v = a.get(f"{ours}_{stat}_s")
            out[f"{stat}_{theirs}_ms"] = v * 1e3 if v is not None else None
        for q in percentiles:
            v = a.get(f"{ours}_p{q:g}_s")
            out[f"p{q:g}_{theirs}_ms"] = v * 1e3 if v is not None else None
    return out


def _commit_times(times: list[float]) -> list[float]:
    return [t for i, t in enumerate(times) if i == 0 or t != times[i - 1]]
