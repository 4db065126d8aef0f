"""Sweeps: a YAML file expands to cells (one RunConfig each); executors run them, the driver stores them.

Schema and semantics: docs/sweeps.md. Executors (`local` here, `ray` in ray_executor.py) only produce
RunRecords; `run_sweep` alone writes the store, so a Ray cluster needs no access to the store file.
What both executors share (a cell, running one) is in cells.py, so neither imports the other.
"""
from __future__ import annotations

import hashlib
import itertools
import sqlite3
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, StoreError, UserError, did_you_mean
from . import records
from .cells import Cell, Sweep, execute_cell, failed_record
from .parity import check_tolerance
from .records import RunRecord
from .runner import RunConfig
from .store import Store, write_recovery
from .tuning import tuned_settings

TOP_KEYS = {"name", "models", "decoders", "tasks", "contexts", "batch_sizes", "max_new_tokens", "sampling",
            "limit", "repeats", "parity", "parity_tolerance", "warmup", "prefix_cache", "dtype", "device",
            "attention_backend", "max_retries", "ray", "tune", "equal_work"}
MODEL_KEYS = {"path", "dtype", "device", "attention_backend", "rope_scaling", "rope_scaling_contexts"}
DECODER_KEYS = {"name", "args"}
TASK_KEYS = {"name", "data", "limit", "contexts", "max_new_tokens"}
SAMPLING_KEYS = {"temperature", "top_k", "top_p", "seed"}
RAY_KEYS = {"num_cpus", "num_gpus", "local_num_cpus"}
# Fields that tell the cells of one group apart: everything else is shared, so speedups over AR are
# taken between runs that differ only in how they decode.
NOT_IN_GROUP = ("decoder", "decoder_args", "tune")


# --- loading and expansion ---------------------------------------------------------------------


def load_sweep(path: str | Path) -> Sweep:
    from .schema import read_sweep_file
    return expand(read_sweep_file(path), default_name=Path(path).stem, where=str(path))


def expand(spec: dict, default_name: str = "sweep", where: str = "the sweep") -> Sweep:
    """The cells of a sweep spec (the parsed YAML), in execution order: model, task, context, batch size,
    max_new_tokens, sampling, then decoder innermost, so a model loads once and a group's decoders run
    back to back under the same machine conditions."""
    from .schema import check_sweep
    check_sweep(spec, where)  # types and ranges of every key (schema.SweepSpec)
    _check_keys(spec, TOP_KEYS, "the sweep")
    for key in ("models", "decoders", "tasks"):
        if not spec.get(key):
            raise ConfigError(f"the sweep needs a non-empty `{key}` list")
    name = str(spec.get("name") or default_name)
    base = {"dtype": spec.get("dtype", "float32"), "device": spec.get("device", "cpu"),
            "attention_backend": spec.get("attention_backend", "auto"), "repeat": int(spec.get("repeats", 1)),
            "parity": bool(spec.get("parity", False)), "warmup": bool(spec.get("warmup", True)),
            "prefix_cache": bool(spec.get("prefix_cache", False)),
            "parity_tolerance": check_tolerance(spec.get("parity_tolerance")),
            "equal_work": bool(spec.get("equal_work", True))}
    tune = bool(spec.get("tune", False))
    models = [_model(m) for m in _as_list(spec["models"])]
    decoders = [_decoder(d) for d in _as_list(spec["decoders"])]
    tasks = [_task(t, spec) for t in _as_list(spec["tasks"])]
    batch_sizes = [int(b) for b in _as_list(spec.get("batch_sizes", 8))]
    samplings = [_sampling(s) for s in _as_list(spec.get("sampling") or {})]
    if base["parity_tolerance"] is not None and not base["parity"]:
        raise ConfigError("`parity_tolerance` applies to the parity comparison: add `parity: true`")
    if base["parity"] and any(s["temperature"] != 0 for s in samplings):
        raise ConfigError("parity compares greedy outputs token for token: set `parity: false` or use "
                          "only `temperature: 0` sampling")

    cells, seen = [], {}
    for model in models:
        for task in tasks:
            combos = itertools.product(task["contexts"], batch_sizes, task["max_new_tokens"], samplings, decoders)
            for context, batch, max_new, sampling, (dec, dec_args) in combos:
                model_cfg = dict(model)
                scaled_contexts = model_cfg.pop("rope_scaling_contexts", None)
                if scaled_contexts is not None and context not in scaled_contexts:
                    model_cfg.pop("rope_scaling", None)
                cfg = RunConfig(**{**base, **model_cfg}, decoder=dec, decoder_args=dec_args, task=task["name"],
                                data=task["data"], limit=task["limit"], context_len=context, batch_size=batch,
                                max_new_tokens=max_new, tune=tune and bool(tuned_settings(dec, dec_args)), **sampling)
                cell = Cell(len(cells), cfg, _group_key(name, cfg))
                if cell.config_hash in seen:
                    raise ConfigError(f"the sweep lists the same cell twice ({cell.label()}): "
                                      "remove the duplicate model, decoder or setting")
                seen[cell.config_hash] = cell
                cells.append(cell)
    retries = int(spec.get("max_retries", 0))
    if retries < 0:
        raise ConfigError("max_retries must be >= 0")
    ray_opts = spec.get("ray") or {}
    _check_keys(ray_opts, RAY_KEYS, "`ray`")
    return Sweep(name, cells, retries, dict(ray_opts))


def _group_key(name: str, cfg: RunConfig) -> str:
    shared = {k: v for k, v in cfg.identity().items() if k not in NOT_IN_GROUP}
    return hashlib.sha256(records.canonical_json({"sweep": name, **shared}).encode()).hexdigest()[:8]


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _check_keys(d, allowed: set, where: str) -> None:
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping, not {d!r}")
    unknown = set(d) - allowed
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)} in {where}; known: {sorted(allowed)}")


def _model(m) -> dict:
    if isinstance(m, str):
        return {"model": m}
    _check_keys(m, MODEL_KEYS, "a model entry")
    if "path" not in m:
        raise ConfigError(f"model entry {m!r} needs a `path`")
    out = {"model": str(m["path"]), **{k: m[k] for k in MODEL_KEYS - {"path"} if k in m}}
    if "rope_scaling_contexts" in out:
        if "rope_scaling" not in out:
            raise ConfigError(f"model {m['path']}: `rope_scaling_contexts` needs a `rope_scaling`")
        out["rope_scaling_contexts"] = [str(c) for c in _as_list(out["rope_scaling_contexts"])]
    if "rope_scaling" in out and not isinstance(out["rope_scaling"], dict):
        raise ConfigError(f"model {m['path']}: `rope_scaling` must be a mapping such as "
                          "{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}")
    return out


def _decoder(d) -> tuple[str, dict]:
    from ..decoders import decoder_names
    if isinstance(d, str):
        d = {"name": d}
    _check_keys(d, DECODER_KEYS, "a decoder entry")
    if d.get("name") not in decoder_names():
        raise ConfigError(f"unknown decoder {d.get('name')!r}{did_you_mean(d.get('name'), decoder_names())}: "
                          f"choose one of {', '.join(decoder_names())}")
    args = d.get("args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"decoder {d['name']}: `args` must be a mapping, not {args!r}")
    return d["name"], dict(args)  # the decoder checks the names, per cell: a bad one is a failed cell


def _task(t, spec: dict) -> dict:
    from ..tasks import get_task, parse_bucket
    if isinstance(t, str):
        t = {"name": t}
    _check_keys(t, TASK_KEYS, "a task entry")
    name = get_task(str(t.get("name"))).name  # unknown names fail before any cell runs
    # A task's own `contexts` / `max_new_tokens` replace the sweep's; null means none / the task default.
    contexts = [None if c is None else str(c) for c in _as_list(t["contexts"] if "contexts" in t
                                                                 else spec.get("contexts"))]
    for c in contexts:
        if c is not None:
            parse_bucket(c)
    max_new = _as_list(t["max_new_tokens"] if "max_new_tokens" in t else spec.get("max_new_tokens"))
    limit = t["limit"] if "limit" in t else spec.get("limit", 8)
    return {"name": name, "data": t.get("data"), "limit": None if limit is None else int(limit),
            "contexts": contexts, "max_new_tokens": [None if m is None else int(m) for m in max_new]}


def _sampling(s) -> dict:
    _check_keys(s, SAMPLING_KEYS, "a sampling entry")
    return {"temperature": float(s.get("temperature", 0.0)), "top_k": int(s.get("top_k", 0)),
            "top_p": float(s.get("top_p", 1.0)), "seed": int(s.get("seed", 0))}


# --- running one cell ------------------------------------------------------------------------


def run_local(cells: list[Cell], sweep: Sweep, invocation: str, on_done: Callable[[Cell, RunRecord], None],
              cell_fn: Callable[[dict, str, str], RunRecord] = execute_cell) -> None:
    """Cells in order in this process; runner.load_engine keeps the current model loaded between cells."""
    for cell in cells:
        config, group = cell.config.identity(), cell.group(invocation)
        for attempt in range(1, sweep.max_retries + 2):
            try:
                rec = cell_fn(config, sweep.name, group)
                break
            except Exception as e:  # noqa: BLE001 - one broken cell must not end the sweep
                rec = failed_record(config, sweep.name, group, e)
        rec.env.update(executor="local", attempts=attempt)
        on_done(cell, rec)


# --- the driver --------------------------------------------------------------------------------


@dataclass
class SweepOutcome:
    invocation: str
    records: list[RunRecord]  # one per cell, in cell order: new runs and, on resume, the stored ones
    ran: int
    skipped: int

    @property
    def failed(self) -> list[RunRecord]:
        return [r for r in self.records if r.status != "ok"]


def run_sweep(sweep: Sweep, store_path: str | Path, *, executor: str = "local", resume: bool = False,
              ray_address: str | None = None, show_progress: bool = True,
              cell_fn: Callable[[dict, str, str], RunRecord] = execute_cell) -> SweepOutcome:
    """Run the cells not yet stored (with resume) on the chosen executor; store every record here.
    cell_fn runs one cell (execute_cell; tests swap in failing ones)."""
    if executor not in ("local", "ray"):
        raise UserError(f"unknown executor {executor!r}: use local or ray")
    if executor == "ray":
        from .ray_executor import require_ray
        require_ray()  # before the store is created: a missing extra leaves nothing behind
    unsaved: list[tuple[Path | None, str]] = []
    with _sweep_lock(store_path, sweep.name), Store(store_path) as store:
        done = _stored_ok(store, sweep.cells) if resume else {}
        invocation = (_last_invocation(store, sweep.name) if resume else None) or records.new_group_id()
        todo = [c for c in sweep.cells if c.index not in done]
        results: dict[int, RunRecord] = {i: store.get_run(run_id) for i, run_id in done.items()}
        with _CellProgress(sweep.name, len(sweep.cells), len(done), disable=not show_progress) as bar:
            def on_done(cell: Cell, rec: RunRecord) -> None:
                try:
                    store.save_run(rec)
                except (sqlite3.Error, OSError) as e:  # keep the record, tell at the end
                    unsaved.append((write_recovery(store_path, rec), " ".join(str(e).split())))
                results[cell.index] = rec
                bar.advance(cell, rec)

            if executor == "local":
                run_local(todo, sweep, invocation, on_done, cell_fn)
            else:
                from .ray_executor import run_ray
                run_ray(todo, sweep, invocation, on_done, address=ray_address, cell_fn=cell_fn)
    if unsaved:
        where, why = unsaved[0]
        raise StoreError(f"{len(unsaved)} cell(s) could not be saved to {store_path} ({why}); their records are "
                         f"kept in {where}: `aspire-bench import {where} --store STORE` adds them to a store")
    return SweepOutcome(invocation, [results[c.index] for c in sweep.cells], len(todo), len(done))


@contextmanager
def _sweep_lock(store_path: str | Path, name: str):
    """One process at a time runs a sweep on a store: a second (a second --resume) waits, then finds the
    first one's cells stored and skips them, so no cell is run or stored twice."""
    import re
    import sys

    from ..atomic import file_lock
    p = Path(store_path)
    lock = p.with_name(f".{p.name[:100]}.sweep-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:80]}.lock")

    def waiting():
        print(f"waiting for another process running sweep {name} on {store_path} (lock {lock})", file=sys.stderr,
              flush=True)
    held = file_lock(lock, waiting)
    try:
        held.__enter__()
    except OSError as e:
        raise StoreError(f"cannot lock sweep {name} on {store_path} ({e}): check the directory's permissions") from None
    try:
        yield
    finally:
        held.__exit__(None, None, None)


def _stored_ok(store: Store, cells: Iterable[Cell]) -> dict[int, int]:
    """cell index -> run_id of its latest stored ok run (same config hash)."""
    out = {}
    for cell in cells:
        ok = [r["run_id"] for r in store.list_runs(config_hash=cell.config_hash, status="ok")]
        if ok:
            out[cell.index] = ok[-1]
    return out


def _last_invocation(store: Store, name: str) -> str | None:
    """The invocation id of this sweep's latest stored run: a resumed sweep joins its groups, so the AR
    run stored earlier is still the baseline of the speculative runs added now."""
    runs = store.list_runs(sweep=name, limit=1)
    group = runs[0]["group"] if runs else None
    return group.split("-", 1)[0] if group and "-" in group else None


class _CellProgress:
    """A cells-done bar (rich); the per-token bars of single runs stay off inside a sweep. Outside a
    terminal (a CI log), where a redrawn bar shows only once finished, a line per cell instead."""

    def __init__(self, name: str, total: int, done: int, disable: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

        from ..progress import stderr_bar
        self._p, self._lines = stderr_bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                          TextColumn("cells  {task.fields[failed]} failed  last: {task.fields[last]}"),
                                          TimeElapsedColumn(), disable=disable)
        self._task = self._p.add_task(f"sweep {name}", total=total, completed=done, failed=0, last="-")
        self._failed = 0

    def __enter__(self):
        self._p.__enter__()
        return self

    def __exit__(self, *exc):
        return self._p.__exit__(*exc)

    def advance(self, cell: Cell, rec: RunRecord) -> None:
        from ..progress import log_line
        self._failed += rec.status != "ok"
        self._p.update(self._task, advance=1, failed=self._failed, last=f"{cell.label()} [{rec.status}]")
        if self._lines:
            t = self._p.tasks[self._task]
            log_line(self._p, f"{t.description} {t.completed:g}/{t.total:g} cells  {self._failed} failed  "
                              f"last: {t.fields['last']}")
