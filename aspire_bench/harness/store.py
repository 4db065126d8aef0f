"""The results store: run records in one SQLite file, safe for several writing processes.

Each run is written in one transaction, so a crash mid-write leaves no trace of it. WAL mode lets
readers run beside a writer; the busy timeout makes concurrent writers queue instead of failing.
"""
from __future__ import annotations

import csv
import json
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from aspire_bench.atomic import append_line, atomic_open, check_name
from aspire_bench.errors import StoreError, UserError
from aspire_bench.harness.records import (
    RequestRow,
    RunRecord,
    StepRecord,
    record_hash,
    record_problem,
)

DEFAULT_PATH = "./aspire_results.db"
BUSY_TIMEOUT_S = 60.0

# Columns of `runs` that list_runs can filter on (API name -> column; GROUP is an SQL keyword).
FILTERS = {"decoder": "decoder", "model": "model", "task": "task", "sweep": "sweep", "tag": "tag",
           "group": "grp", "config_hash": "config_hash", "status": "status", "kind": "kind"}

_V1 = (
    """CREATE TABLE runs (
        run_id INTEGER PRIMARY KEY AUTOINCREMENT,
        created_at TEXT NOT NULL,
        config_hash TEXT NOT NULL,
        status TEXT NOT NULL,
        error TEXT,
        sweep TEXT, tag TEXT, grp TEXT,
        decoder TEXT, model TEXT, task TEXT,
        config TEXT NOT NULL, env TEXT NOT NULL, info TEXT NOT NULL)""",
    "CREATE INDEX runs_config_hash ON runs(config_hash)",
    "CREATE INDEX runs_grp ON runs(grp)",
    # Queryable per-request figures as columns; everything else of the row in `data` (JSON).
    """CREATE TABLE requests (
        run_id INTEGER NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE,
        idx INTEGER NOT NULL,
        request_id TEXT NOT NULL,
        prompt_len INTEGER, n_output INTEGER, finish_reason TEXT, score REAL,
        ttft_s REAL, tpot_s REAL, mean_accepted_len REAL,
        parity_kind TEXT, parity_first_divergence INTEGER, parity_margin REAL,
        data TEXT NOT NULL,
        PRIMARY KEY (run_id, idx))""",
    # Steps are only ever read whole: one JSON document per run keeps them compact.
    """CREATE TABLE steps (
        run_id INTEGER PRIMARY KEY REFERENCES runs(run_id) ON DELETE CASCADE,
        n_steps INTEGER NOT NULL,
        data TEXT NOT NULL)""",
    # Scalars only (metrics.aggregate returns flat numbers), so the gate and reports can query them.
    # `value` has no declared type so counts come back as integers, not floats.
    """CREATE TABLE aggregates (
        run_id INTEGER NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE,
        name TEXT NOT NULL,
        value,
        PRIMARY KEY (run_id, name))""",
)

# v2: what a run is (records.RUN_KINDS): measured on this machine, simulated, or a diagnostic. Readers
# that rank decoders (leaderboard, gate) take measured runs only.
_V2 = ("ALTER TABLE runs ADD COLUMN kind TEXT NOT NULL DEFAULT 'measured'",
       "CREATE INDEX runs_kind ON runs(kind)")

# MIGRATIONS[i] takes the schema from version i to i+1; append, never edit a released one.
# Old stores upgrade on open.
MIGRATIONS: list[tuple[str, ...]] = [_V1, _V2]

def _json_ok(column: str, kind: str = "object") -> str:
    return f"CASE WHEN json_valid({column}) THEN json_type({column}) = '{kind}' ELSE 0 END"


# (table, query of (run_id, what)) for the stored JSON a run is rebuilt from.
_DAMAGE_QUERIES = (
    ("runs", "SELECT run_id, trim((CASE WHEN NOT " + _json_ok("config") + " THEN 'config ' ELSE '' END)"
             " || (CASE WHEN NOT " + _json_ok("env") + " THEN 'env ' ELSE '' END)"
             " || (CASE WHEN NOT " + _json_ok("info") + " THEN 'info' ELSE '' END)) FROM runs"
             " WHERE NOT (" + _json_ok("config") + " AND " + _json_ok("env") + " AND " + _json_ok("info") + ")"),
    ("requests", "SELECT DISTINCT run_id, 'data' FROM requests WHERE NOT " + _json_ok("data")),
    ("steps", "SELECT run_id, 'data' FROM steps WHERE NOT " + _json_ok("data", "array")),
)

_WARNED: set[tuple[Path, tuple[int, ...]]] = set()

# Test seam: called inside save_run's transaction after the runs row is written.
_mid_write_hook: Callable[[], None] | None = None


SQLITE_MAGIC = b"SQLite format 3\x00"
# Tables every aspire-bench store has; a database without them is another application's.
STORE_TABLES = {"schema_version", "runs", "requests", "steps", "aggregates"}


def schema_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT version FROM schema_version").fetchone()
    return row[0] if row else 0


def is_sqlite_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return False


class Store:
    """readonly=True (the reading commands): the file must already be an aspire-bench store; it is
    opened with SQLite's read-only mode, so nothing (tables, WAL mode) is ever written to it."""

    def __init__(self, path: str | Path = DEFAULT_PATH, readonly: bool = False):
        self.path = Path(path)
        self.readonly = readonly
        self._damaged: dict[int, str] | None = None
        _check_store_file(self.path, must_exist=readonly)
        try:
            if readonly:
                self.conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True,
                                            timeout=BUSY_TIMEOUT_S, isolation_level=None)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE) rather than implicit.
                self.conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            self.conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            self._check_tables()
            if not readonly:
                self._enable_wal()
                self.conn.execute("PRAGMA foreign_keys = ON")
                self._migrate()
        except (sqlite3.Error, OSError) as e:
            raise StoreError(f"cannot open the results store {self.path} ({e}): pass --store with an "
                             "aspire-bench store or a new file in a writable directory") from None

    def _enable_wal(self) -> None:
        # Switching a new file to WAL needs an exclusive lock, and SQLite answers "database is locked" at
        # once instead of waiting on busy_timeout when another process opens it at the same moment.
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                self.conn.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _check_tables(self) -> None:
        tables = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if self.readonly or tables:
            if not STORE_TABLES <= tables:
                raise StoreError(f"{self.path} is a SQLite database but not an aspire-bench results store "
                                 "(it lacks the runs tables): pass --store with a results store")
            current = schema_version(self.conn)
            if current > len(MIGRATIONS):
                raise StoreError(f"{self.path} has schema v{current}, newer than this aspire-bench "
                                 f"(v{len(MIGRATIONS)}): upgrade aspire-bench to read it")

    def close(self) -> None:
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        # IMMEDIATE takes the write lock up front, so two writers queue on busy_timeout instead of
        # one failing when it upgrades a read lock.
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def _migrate(self) -> None:
        with self._transaction() as c:
            c.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            current = schema_version(c)
            for statements in MIGRATIONS[current:]:
                for sql in statements:
                    c.execute(sql)
            c.execute("DELETE FROM schema_version")
            c.execute("INSERT INTO schema_version VALUES (?)", (len(MIGRATIONS),))

    # --- write ------------------------------------------------------------------------------

    def save_run(self, record: RunRecord) -> int:
        """Write the whole record in one transaction; returns its run_id (also set on the record)."""
        check_record(record)
        with self._transaction() as c:
            run_id = self._insert(c, record)
        record.run_id = run_id
        return run_id

    def import_runs(self, recs: list[RunRecord], where: str = "the file") -> tuple[list[int], int]:
        """All of `recs` in one transaction (all or none), each checked first; a record whose content is
        already stored (record_hash) is skipped. Returns (the new run ids, how many were skipped)."""
        for i, rec in enumerate(recs, 1):
            check_record(rec, f"{where}: record {i}")
        ids, skipped = [], 0
        with self._transaction() as c:
            seen: dict[str, set[str]] = {}  # config hash -> content hashes stored (and imported so far)
            for rec in recs:
                if rec.config_hash not in seen:
                    seen[rec.config_hash] = {record_hash(self.get_run(s["run_id"])) for s in
                                             self.list_runs(config_hash=rec.config_hash)}
                h = record_hash(rec)
                if h in seen[rec.config_hash]:
                    skipped += 1
                    continue
                seen[rec.config_hash].add(h)
                ids.append(self._insert(c, rec))
        return ids, skipped

    def _insert(self, c: sqlite3.Connection, record: RunRecord) -> int:
        run_id = c.execute(
            "INSERT INTO runs (created_at, config_hash, status, error, sweep, tag, grp, decoder, model, task,"
            " config, env, info, kind) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (record.created_at, record.config_hash, record.status, record.error, record.sweep, record.tag,
             record.group, *(_config_name(record.config, k) for k in ("decoder", "model", "task")),
             _dumps(record.config), _dumps(record.env), _dumps(record.info), record.kind),
        ).lastrowid
        if _mid_write_hook is not None:
            _mid_write_hook()
        c.executemany(
            "INSERT INTO requests VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            [_request_row(run_id, i, r) for i, r in enumerate(record.requests)],
        )
        c.execute("INSERT INTO steps VALUES (?,?,?)",
                  (run_id, len(record.steps), _dumps([_step_list(s) for s in record.steps])))
        c.executemany("INSERT INTO aggregates VALUES (?,?,?)",
                      [(run_id, k, v) for k, v in record.aggregates.items()])
        return run_id

    # --- read -------------------------------------------------------------------------------

    def damaged(self) -> dict[int, str]:
        """Runs whose stored JSON cannot be read (a row cut short by a fault or edited by hand): run id ->
        what is wrong. Read commands skip them (warning once); `aspire-bench check` lists them."""
        if self._damaged is None:
            found: dict[int, list[str]] = {}
            for table, sql in _DAMAGE_QUERIES:
                for run_id, what in self.conn.execute(sql):
                    found.setdefault(run_id, []).append(f"{table} {what}")
            self._damaged = {i: ", ".join(w) + " not valid JSON" for i, w in sorted(found.items())}
        return self._damaged

    def readable_sql(self, column: str = "run_id") -> str:
        """An SQL condition leaving the damaged runs out, with one warning naming them."""
        bad = self.damaged()
        if not bad:
            return "1"
        if (self.path.resolve(), tuple(bad)) not in _WARNED:  # once per process, however often it is opened
            _WARNED.add((self.path.resolve(), tuple(bad)))
            ids = ", ".join(map(str, bad))
            print(f"warning: skipping run{'s' if len(bad) > 1 else ''} {ids} of {self.path}: stored JSON cannot be "
                  f"read ({next(iter(bad.values()))}); `aspire-bench check --store {self.path}` lists damaged runs",
                  file=sys.stderr)
        return f"{column} NOT IN ({', '.join(map(str, bad))})"

    def get_run(self, run_id: int) -> RunRecord:
        row = self.conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise UserError(f"no run {run_id} in {self.path}: `aspire-bench runs --store {self.path}` lists them")
        if run_id in self.damaged():
            raise StoreError(f"run {run_id} in {self.path} is damaged ({self.damaged()[run_id]}): "
                             f"`aspire-bench check --store {self.path}` lists damaged runs")
        run = dict(zip(_columns(self.conn, "runs"), row))
        requests = [
            _request_from_db(request_id, prompt_len, finish_reason, score, json.loads(data))
            for request_id, prompt_len, finish_reason, score, data in self.conn.execute(
                "SELECT request_id, prompt_len, finish_reason, score, data FROM requests WHERE run_id = ?"
                " ORDER BY idx", (run_id,))
        ]
        steps_row = self.conn.execute("SELECT data FROM steps WHERE run_id = ?", (run_id,)).fetchone()
        return RunRecord(
            run_id=run["run_id"], created_at=run["created_at"], config_hash=run["config_hash"],
            status=run["status"], error=run["error"], sweep=run["sweep"], tag=run["tag"], group=run["grp"],
            kind=run.get("kind", "measured"), config=json.loads(run["config"]), env=json.loads(run["env"]), info=json.loads(run["info"]),
            requests=requests, steps=[_step_from_list(s) for s in json.loads(steps_row[0])] if steps_row else [],
            aggregates=self._aggregates(run_id),
        )

    def _aggregates(self, run_id: int) -> dict:
        return dict(self.conn.execute(
            "SELECT name, value FROM aggregates WHERE run_id = ? ORDER BY rowid", (run_id,)))

    def list_runs(self, limit: int | None = None, **filters: str) -> list[dict]:
        """Run summaries (runs columns + aggregates), oldest first; filters are FILTERS keys, matched exactly."""
        unknown = set(filters) - set(FILTERS)
        if unknown:
            raise TypeError(f"unknown filter(s) {sorted(unknown)}; known: {sorted(FILTERS)}")
        kind = self.kind_sql()
        where = [(f"{FILTERS[k] if k != 'kind' else kind} = ?", v) for k, v in filters.items() if v is not None]
        where.append((self.readable_sql(), None))
        sql = (f"SELECT run_id, created_at, status, error, decoder, model, task, sweep, tag, grp, config_hash,"
               f" {kind} AS kind FROM runs WHERE " + " AND ".join(w for w, _ in where) + " ORDER BY run_id")
        params = [v for _, v in where if v is not None]
        if limit is not None:
            # The newest `limit` runs, still listed oldest first.
            sql = f"SELECT * FROM ({sql} DESC LIMIT ?) ORDER BY run_id"
            params.append(limit)
        cur = self.conn.execute(sql, params)
        names = ["group" if d[0] == "grp" else d[0] for d in cur.description]
        return [{**dict(zip(names, row)), "aggregates": self._aggregates(row[0])} for row in cur.fetchall()]

    def kind_sql(self, table: str = "") -> str:
        """The SQL for a run's kind: a v1 store opened read-only is never upgraded, and its runs are
        all measured ones."""
        return f"{table}kind" if "kind" in _columns(self.conn, "runs") else "'measured'"

    def export(self, format: str = "jsonl", path: str | Path | TextIO = "-", **filters: str) -> int:
        """Write the runs matching `filters`: jsonl = whole records, csv = one row per run with its
        aggregates as columns. path "-" is stdout. Returns the number of runs written."""
        if format not in ("jsonl", "csv"):
            raise UserError(f"unknown export format {format!r}: use jsonl or csv")
        summaries = self.list_runs(**filters)
        with _open_out(path) as out:
            if format == "jsonl":
                for s in summaries:
                    out.write(json.dumps(self.get_run(s["run_id"]).to_json(), default=str) + "\n")
            else:
                _write_csv(out, summaries)
        return len(summaries)


def check_record(rec: RunRecord, where: str = "the run record") -> None:
    problem = record_problem(rec)
    if problem:
        raise StoreError(f"{where} does not fit the store's schema: {problem}")


# --- row conversions --------------------------------------------------------------------------


def _dumps(obj) -> str:
    return json.dumps(obj, default=str)


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]


def _config_name(config: dict, key: str) -> str | None:
    """config[key] as a short name: a settings dict is named by its "name" entry."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("name")
    return None if value is None else str(value)


def _request_row(run_id: int, idx: int, r: RequestRow) -> tuple:
    parity = r.parity or {}
    # The columns are copies for querying; `data` alone rebuilds the row.
    data = {k: v for k, v in asdict(r).items() if k not in ("id", "prompt_len", "finish_reason", "score")}
    return (run_id, idx, r.id, r.prompt_len, len(r.output_ids), r.finish_reason, r.score,
            r.figures.get("ttft_s"), r.figures.get("tpot_s"), r.figures.get("mean_accepted_len"),
            parity.get("kind"), parity.get("first_divergence"), parity.get("margin"), _dumps(data))


def _request_from_db(request_id: str, prompt_len: int, finish_reason: str, score: float | None,
                     data: dict) -> RequestRow:
    # a newer writer's fields kept in extra, not interpreted; an older layout read (RequestRow.from_json)
    return RequestRow.from_json({**data, "id": request_id, "prompt_len": prompt_len,
                                 "finish_reason": finish_reason, "score": score})


def _step_list(s: StepRecord) -> list:
    return [s.index, s.t_start, s.t_end, s.n_tokens, [list(r) for r in s.rows]]


def _step_from_list(x: list) -> StepRecord:
    return StepRecord(x[0], x[1], x[2], x[3], [tuple(r) for r in x[4]])  # later columns (newer writer) ignored


@contextmanager
def _open_out(path: str | Path | TextIO) -> Iterator[TextIO]:
    if path == "-":
        yield sys.stdout
    elif isinstance(path, (str, Path)):
        check_output_path(Path(path))
        # Written beside and renamed: a failed export never leaves a half-written file in its place.
        with atomic_open(path, "w", newline="") as f:
            yield f
    else:
        yield path


# --- paths checked before any compute ----------------------------------------------------------


def _check_store_file(path: Path, must_exist: bool) -> None:
    if path.is_dir():
        raise StoreError(f"--store {path} is a directory: pass a file, e.g. {path / 'aspire_results.db'}")
    if path.exists() and not path.is_file():  # /dev/null, a FIFO: SQLite would put a journal beside it
        raise StoreError(f"--store {path} is not a regular file: pass a results store or a new file name")
    # SQLite makes STORE-journal beside it, and a save that fails writes STORE.recovery.jsonl
    check_name(path, "--store", companion=".recovery.jsonl")
    if not path.exists():
        if must_exist:
            raise StoreError(f"no results store at {path}: run a benchmark first or pass --store PATH")
        return
    size = path.stat().st_size
    if size and not is_sqlite_file(path):
        raise StoreError(f"{path} is not a SQLite database (nor an aspire-bench results store): "
                         "pass --store with a results store or a new file name")
    if size and _truncated(path, size):
        raise StoreError(f"{path} is truncated (shorter than its header says): restore the store from a backup "
                         "or pass another --store")


def check_store_file(path: Path) -> None:
    """What a store path must be before anything opens it: not a directory or a device, a name with room
    for SQLite's companions, and an existing file a SQLite database that is not truncated."""
    _check_store_file(path, must_exist=False)


def _truncated(path: Path, size: int) -> bool:
    """The SQLite header's page size and page count against the file's size (checked before SQLite
    opens it, so a damaged file is never given -wal/-shm companions)."""
    with open(path, "rb") as f:
        header = f.read(100)
    if len(header) < 100:
        return True
    page = int.from_bytes(header[16:18], "big")
    page = 65536 if page == 1 else page
    pages, counter, valid_for = (int.from_bytes(header[o:o + 4], "big") for o in (28, 24, 92))
    # The in-header page count is only trusted when written by SQLite >= 3.7.0 (counter matches).
    return size % page != 0 or (pages > 0 and counter == valid_for and size < pages * page)


def _creatable(d: Path) -> bool:
    """Whether a file could be made in directory d (made with its parents where missing)."""
    d = d.resolve()
    while not d.exists():
        d = d.parent
    return d.is_dir() and os.access(d, os.W_OK | os.X_OK)


def check_store_path(path: str | Path) -> None:
    """Fail now, not after hours of compute, when the run could not be saved to `path`: an existing
    file must be an aspire-bench store (opened and upgraded once); a new one needs a writable directory
    (nothing is created yet, so a run that fails later leaves no empty store behind)."""
    path = Path(path)
    _check_store_file(path, must_exist=False)
    if path.exists():
        with Store(path):
            pass
    elif not _creatable(path.parent):
        raise StoreError(f"cannot create the results store {path}: its directory is not writable")


def check_output_path(path: Path) -> None:
    """An output file that can be written and is not a database: never overwrite a results store."""
    if path.is_dir():
        raise StoreError(f"{path} is a directory: give a file name")
    if path.exists() and not path.is_file():  # written by renaming a new file over it: never a device
        raise StoreError(f"{path} is not a regular file: give a file name")
    check_name(path, str(path))
    if not path.parent.is_dir():
        raise StoreError(f"the directory of {path} does not exist: create it first")
    if path.exists() and is_sqlite_file(path):
        raise StoreError(f"{path} is a SQLite database (a results store?): refusing to overwrite it; "
                         "choose another output file")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise StoreError(f"{path} cannot be written: check its permissions or choose another file")


def recovery_path(store_path: str | Path) -> Path:
    p = Path(store_path)
    return p.with_name(p.name + ".recovery.jsonl")


def save_record(store_path: str | Path, record: RunRecord) -> int:
    """Save a finished run; if the store cannot take it, append the record to a recovery JSONL beside
    the store (else in the working directory) so the measurement is never lost, and say where."""
    try:
        with Store(store_path) as st:
            return st.save_run(record)
    except (UserError, sqlite3.Error, OSError) as e:
        why = " ".join(str(e).split())
    target = write_recovery(store_path, record)
    if target is None:
        raise StoreError(f"could not save the run to {store_path} ({why}) nor write a recovery file")
    raise StoreError(f"could not save the run to {store_path} ({why}); the record is kept in {target}: "
                     f"`aspire-bench import {target} --store STORE` adds it to a store")


def write_recovery(store_path: str | Path, record: RunRecord) -> Path | None:
    """Append the record to the recovery JSONL beside the store, else in the working directory;
    returns where, or None when neither could be written."""
    line = json.dumps(record.to_json(), default=str)
    for target in (recovery_path(store_path), Path.cwd() / recovery_path(store_path).name):
        try:
            append_line(target, line)  # the whole file rewritten and renamed: never a torn record
            return target
        except OSError:
            continue
    return None


def _write_csv(out: TextIO, summaries: list[dict]) -> None:
    base = [k for k in summaries[0] if k != "aggregates"] if summaries else []
    names: dict[str, None] = {}  # union of aggregate names, first-seen order
    for s in summaries:
        names.update(dict.fromkeys(s["aggregates"]))
    w = csv.writer(out)
    w.writerow(base + list(names))
    for s in summaries:
        w.writerow([s[k] for k in base] + [s["aggregates"].get(n) for n in names])
