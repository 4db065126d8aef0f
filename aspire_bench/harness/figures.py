"""What a run is, as reports and the gate see it: its cell, its decoder label, and its speedup over AR.

Speedups are only ever taken between runs of one group (measured side by side in one invocation), and
repeats (same config hash in one group) are reduced to their median: raw seconds from different
invocations or machines are never compared.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import PurePath

from aspire_bench.harness.records import NON_IDENTITY_KEYS, RunRecord, canonical_json

AR = "ar"
# Where a config may name its context-length bucket, first match wins (top level, then inside a task dict).
CONTEXT_KEYS = ("context_len", "context", "context_bucket", "bucket")
# Where a config may keep decoder settings when "decoder" is a bare name.
DECODER_SETTINGS_KEYS = ("decoder_args", "decoder_settings")
NO_CONTEXT = "all"
# Runner settings that say how a run was measured, not what: an AR reference need not share them, and
# the leaderboard does not show them as a row's setup.
MEASUREMENT_KEYS = frozenset({"parity", "repeat", "warmup"})


def _name(value) -> str | None:
    """A config entry as a short name: a settings dict is named by its "name"."""
    if isinstance(value, dict):
        value = value.get("name")
    return None if value is None else str(value)


def decoder_name(config: Mapping) -> str:
    return _name(config.get("decoder")) or "?"


def decoder_settings(config: Mapping) -> dict:
    dec = config.get("decoder")
    if isinstance(dec, dict):
        return {k: v for k, v in dec.items() if k != "name"}
    for key in DECODER_SETTINGS_KEYS:
        if isinstance(config.get(key), dict):
            return dict(config[key])
    return {}


def decoder_label(config: Mapping) -> str:
    """`aspire(gamma=4, refresh=2)`; a bare name when the decoder has no settings."""
    settings = decoder_settings(config)
    name = decoder_name(config)
    if not settings:
        return name
    return f"{name}(" + ", ".join(f"{k}={_short(v)}" for k, v in sorted(settings.items())) + ")"


def _short(v) -> str:
    return canonical_json(v) if isinstance(v, (dict, list)) else str(v)


def model_name(config: Mapping) -> str:
    """A checkpoint path is named by its last component, so one model has one name on every machine."""
    name = _name(config.get("model")) or "?"
    return (PurePath(name).name or name) if ("/" in name or "\\" in name) else name


def task_name(config: Mapping) -> str:
    return _name(config.get("task")) or "?"


def context_bucket(config: Mapping) -> str:
    for where in (config, config.get("task") if isinstance(config.get("task"), dict) else {}):
        for key in CONTEXT_KEYS:
            if where.get(key) is not None:
                return str(where[key])
    return NO_CONTEXT


def cell(config: Mapping) -> tuple[str, str, str]:
    """(model, task, context bucket): one leaderboard."""
    return model_name(config), task_name(config), context_bucket(config)


def _without_decoder(config: Mapping) -> str:
    """The config with the decoder (and filing keys) left out: what an AR reference must share."""
    rest = {k: v for k, v in config.items() if k not in NON_IDENTITY_KEYS and k not in MEASUREMENT_KEYS
            and k not in ("decoder", "tune") and k not in DECODER_SETTINGS_KEYS}
    return canonical_json(rest)


def median(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def ar_references(runs: Sequence[RunRecord]) -> dict[int, list[RunRecord]]:
    """run_id -> the AR runs its speedup is measured against (possibly empty).

    The reference is the AR runs of the same group whose config equals the run's config apart from
    the decoder (same model, task, context, batch size, ...). When none matches exactly but the group
    holds AR runs of the same cell under exactly one config, those are used.
    """
    ar_by_group: dict[str | None, list[RunRecord]] = defaultdict(list)
    for r in runs:
        if r.status == "ok" and decoder_name(r.config) == AR and r.group is not None:
            ar_by_group[r.group].append(r)
    refs: dict[int, list[RunRecord]] = {}
    for r in runs:
        candidates = ar_by_group.get(r.group, []) if r.group is not None else []
        exact = [a for a in candidates if _without_decoder(a.config) == _without_decoder(r.config)]
        if not exact:
            same_cell = [a for a in candidates if cell(a.config) == cell(r.config)]
            if len({a.config_hash for a in same_cell}) == 1:
                exact = same_cell
        refs[r.run_id] = exact
    return refs


def speedup(run_tok_s: float | None, ar_runs: Sequence[RunRecord]) -> float | None:
    """decode tok/s over the median decode tok/s of the AR reference runs (repeats)."""
    ar = median(a.aggregates.get("decode_tok_s") for a in ar_runs)
    if run_tok_s is None or not ar:
        return None
    return run_tok_s / ar


def repeat_sets(runs: Iterable[RunRecord]) -> dict[tuple[str | None, str], list[RunRecord]]:
    """(group, config hash) -> its repeats, in run order. Only successful runs."""
    out: dict[tuple[str | None, str], list[RunRecord]] = defaultdict(list)
    for r in runs:
        if r.status == "ok":
            out[(r.group, r.config_hash)].append(r)
    return dict(out)


def summarize(repeats: Sequence[RunRecord], refs: Mapping[int, list[RunRecord]]) -> dict:
    """Medians over repeats of every aggregate, plus `speedup` (tok/s median over AR tok/s median) and
    `n_runs` (how many runs were reduced)."""
    names: dict[str, None] = {}
    for r in repeats:
        names.update(dict.fromkeys(r.aggregates))
    out = {n: median(r.aggregates.get(n) for r in repeats) for n in names}
    first = repeats[0]
    ar_runs = refs.get(first.run_id, [])
    out["speedup"] = speedup(out.get("decode_tok_s"), ar_runs)
    out["speedup_ci95"] = speedup_ci(first, ar_runs[0]) if ar_runs and first.run_id != ar_runs[0].run_id else None
    out["unequal_work"] = decoder_name(first.config) != AR and (unequal_work(first) or any(map(unequal_work, ar_runs)))
    out["n_runs"] = len(repeats)
    return out


def speedup_ci(run: RunRecord, ar: RunRecord) -> tuple[float, float] | None:
    """95% bootstrap interval of the run's speedup over AR, from both runs' per-request decode samples
    (docs/metrics.md#intervals); None for runs stored without them."""
    from aspire_bench.harness.metrics import ratio_ci

    def samples(r):
        return {(rid, i): (tok, sec) for rid, i, tok, sec in r.section("decode_samples", [])}
    num, den = samples(run), samples(ar)
    return ratio_ci(num, den) if num and den else None


def unequal_work(run: RunRecord) -> bool:
    """A sampled run that stopped requests at EOS: decoders of its group did different work."""
    c = run.config
    sampled = (c.get("temperature") or 0) > 0
    return sampled and not c.get("ignore_eos") and not c.get("equal_work")
