"""The results store as pandas DataFrames, for analysis and export.

`results`: one row per run — the run's identity (run_id, created_at, status, group, ...), its config
flattened (decoder settings as `decoder_args.NAME`) and its aggregates as columns.
`request_results`: one row per request — the run's identity and main settings, then the request's figures.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from .store import DEFAULT_PATH, FILTERS, Store

# The store's run columns (decoder, model, task as short names); the config's own keys follow them.
RUN_COLUMNS = ["run_id", "created_at", "status", "error", "sweep", "tag", "group", "config_hash", "decoder",
               "model", "task", "kind"]
# Run settings repeated on each request row (after run_id, model, task, decoder, group), so a request
# frame groups without a merge.
REQUEST_CONTEXT = ["context_len", "batch_size", "temperature"]
REQUEST_COLUMNS = ["request_id", "prompt_len", "n_output", "finish_reason", "score", "ttft_s", "tpot_s",
                   "mean_accepted_len", "parity_kind", "parity_first_divergence", "parity_margin"]


def _where(store: Store, filters: dict) -> tuple[str, list]:
    unknown = set(filters) - set(FILTERS)
    if unknown:
        raise TypeError(f"unknown filter(s) {sorted(unknown)}; known: {sorted(FILTERS)}")
    parts = [(f"{store.kind_sql('r.') if k == 'kind' else 'r.' + FILTERS[k]} = ?", v)
             for k, v in filters.items() if v is not None]
    parts.append((store.readable_sql("r.run_id"), None))  # damaged rows skipped, with one warning
    return " WHERE " + " AND ".join(p for p, _ in parts), [v for _, v in parts if v is not None]


def _runs(store: Store, filters: dict) -> pd.DataFrame:
    where, params = _where(store, filters)
    sql = ("SELECT r.run_id, r.created_at, r.status, r.error, r.sweep, r.tag, r.grp AS \"group\", r.config_hash,"
           f" r.decoder, r.model, r.task, {store.kind_sql('r.')} AS kind, r.config FROM runs r{where} ORDER BY r.run_id")
    return pd.read_sql_query(sql, store.conn, params=params)


def _open(store) -> tuple[Store, bool]:
    if isinstance(store, Store):
        return store, False
    # Read-only: a missing path or another application's database is refused, never created or altered.
    return Store(store, readonly=True), True


def results(store: str | Path | Store = DEFAULT_PATH, **filters) -> pd.DataFrame:
    """One row per run (oldest first): identity, flattened config, aggregates. Filters as `runs`'s
    (decoder, model, task, sweep, tag, group, config_hash, status, kind), matched exactly."""
    st, owned = _open(store)
    try:
        runs = _runs(st, filters)
        ids = runs["run_id"].tolist()
        aggs = pd.read_sql_query("SELECT run_id, name, value FROM aggregates", st.conn)
    finally:
        if owned:
            st.close()
    config = pd.json_normalize([json.loads(c) for c in runs.pop("config")], sep=".")
    config.index = runs.index
    config = config.drop(columns=[c for c in config.columns if c in RUN_COLUMNS])
    wide = aggs[aggs["run_id"].isin(ids)].pivot(index="run_id", columns="name", values="value")
    # An aggregate named like a config field keeps both, the aggregate prefixed.
    wide = wide.rename(columns={c: f"agg.{c}" for c in wide.columns if c in config.columns})
    wide = wide.reindex(ids).reset_index(drop=True)
    wide.columns.name = None
    wide.index = runs.index
    return pd.concat([runs, config, wide], axis=1)


def request_results(store: str | Path | Store = DEFAULT_PATH, **filters) -> pd.DataFrame:
    """One row per request of each run: run_id, the run's main settings (REQUEST_CONTEXT), then the
    request's figures (prompt and output lengths, score, TTFT, TPOT, accepted length, parity)."""
    st, owned = _open(store)
    try:
        runs = _runs(st, filters)
        where, params = _where(st, filters)
        reqs = pd.read_sql_query(
            f"SELECT q.run_id, q.idx, {', '.join('q.' + c for c in REQUEST_COLUMNS)} FROM requests q"
            f" JOIN runs r ON r.run_id = q.run_id{where} ORDER BY q.run_id, q.idx", st.conn, params=params)
    finally:
        if owned:
            st.close()
    configs = [json.loads(c) for c in runs["config"]]
    settings = runs[["run_id", "model", "task", "decoder", "group"]].copy()
    for k in REQUEST_CONTEXT:
        if k not in settings:
            settings[k] = [c.get(k) for c in configs]
    return settings.merge(reqs, on="run_id").drop(columns="idx")


def write_frame(frame: pd.DataFrame, fmt: str, out) -> None:
    """csv, jsonl (one JSON object per row) or parquet (needs pyarrow) to a path or a text stream
    (parquet: paths only)."""
    if fmt == "csv":
        frame.to_csv(out, index=False)
    elif fmt == "jsonl":
        frame.to_json(out, orient="records", lines=True)
    elif fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ImportError("parquet export needs pyarrow: pip install 'aspire-bench[parquet]'") from None
        # Mixed-type object columns (e.g. a decoder setting that is a number in one run and text in
        # another) are written as text; parquet columns have one type.
        frame = frame.copy()
        for c in frame.columns[frame.dtypes == object]:
            kinds = {type(v) for v in frame[c].dropna()}
            if len(kinds) > 1 or kinds & {list, dict}:
                frame[c] = frame[c].map(lambda v: None if v is None else json.dumps(v) if isinstance(
                    v, (list, dict)) else str(v))
        frame.to_parquet(out, index=False)
    else:
        raise ValueError(f"unknown format {fmt!r}: use csv, jsonl or parquet")
