"""The CI regression gate: compare runs with a baseline JSON on noise-robust figures.

Only figures that survive a change of machine are compared: speedup over the AR run measured in the
same group (a ratio, never raw seconds), acceptance, bound share, exactness parity and task score.
Repeats (same config hash in one group) are reduced to their median before comparing. Exit status:
0 pass, 1 regression, 2 usage error. `--spread` reports the run-to-run spread of the speedups over
several groups of one sweep: what the speedup tolerance must cover. Format and rules: docs/gate.md.
"""
from __future__ import annotations

import json
import math
import sqlite3
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from aspire_bench.atomic import write_text
from aspire_bench.errors import UserError
from aspire_bench.harness import figures
from aspire_bench.harness.records import RunRecord, platform_summary
from aspire_bench.harness.store import DEFAULT_PATH, Store
from aspire_bench.harness.tables import examples

FORMAT = "aspire-bench-gate-baseline"
VERSION = 1
# Relative drops (fraction of the baseline) for ratios, an absolute drop for the task score.
# What does not move with the machine (acceptance, accepted length) is held tightly; bound share (a
# speedup over what the step costs allow) a little looser; the speedup itself by its run-to-run spread.
DEFAULT_TOLERANCES = {"speedup": 0.15, "mean_accepted_len": 0.05, "draft_acceptance_rate": 0.05,
                      "bound_share": 0.10, "score_mean": 0.05}
RELATIVE = ("speedup", "mean_accepted_len", "draft_acceptance_rate", "bound_share")
# Config entries that, besides model/task/context/decoder, tell two baseline entries apart.
KEY_FIELDS = ("batch_size", "dtype", "temperature", "max_new_tokens")
# Parity counts that break exactness (near-ties are benign numerics and allowed).
PARITY_BREAKS = ("parity_mismatch", "parity_length")
PARITY_FIELDS = ("parity_n", "parity_identical_pct", "parity_near_tie", "parity_mismatch", "parity_length")

PASS, FAIL = 0, 1
USAGE = 2
# What an entry is held to; an entry with none of them set would compare nothing.
METRICS = (*RELATIVE, "score_mean", *PARITY_FIELDS)


def entry_key(config: Mapping) -> str:
    """`model · task · context · decoder(settings)` [+ batch size, dtype, ...]: stable across machines."""
    key = " · ".join((*figures.cell(config), figures.decoder_label(config)))
    extra = [f"{k}={config[k]}" for k in KEY_FIELDS if config.get(k) is not None]
    return key + (f" [{', '.join(extra)}]" if extra else "")


@dataclass
class Entry:
    """One decoder configuration's figures: medians over repeats, worst case for parity."""

    key: str
    decoder: str
    values: dict
    runs: list[int] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # errors of failed runs


def measure(selected: Sequence[RunRecord], context: Sequence[RunRecord]) -> dict[str, Entry]:
    """Entries of the selected runs; `context` holds every run of their groups (the AR references)."""
    refs = figures.ar_references(list({r.run_id: r for r in [*context, *selected]}.values()))
    by_key: dict[str, list[RunRecord]] = defaultdict(list)
    for r in selected:
        by_key[entry_key(r.config)].append(r)
    out = {}
    for key, runs in by_key.items():
        ok = [r for r in runs if r.status == "ok"]
        summaries = [figures.summarize(reps, refs) for reps in figures.repeat_sets(ok).values()]
        values = {name: figures.median(s.get(name) for s in summaries) for name in (*RELATIVE, "score_mean")}
        values.update(_worst_parity(ok))
        out[key] = Entry(key, figures.decoder_name(runs[0].config), values, sorted(r.run_id for r in runs),
                         sorted({str(r.group) for r in runs}),
                         [f"run {r.run_id} failed: {r.error}" for r in runs if r.status != "ok"])
    return out


def _worst_parity(runs: Sequence[RunRecord]) -> dict:
    """Exactness is not noise: one repeat with a mismatch is a failure, so take the worst repeat."""
    with_parity = [r.aggregates for r in runs if r.aggregates.get("parity_n") is not None]
    if not with_parity:
        return {}
    worst = max(with_parity, key=lambda a: (sum(a.get(k) or 0 for k in PARITY_BREAKS), -(a.get("parity_identical_pct") or 0)))
    return {k: worst.get(k) for k in PARITY_FIELDS}


# --- comparison -------------------------------------------------------------------------------


@dataclass
class Check:
    key: str
    check: str
    baseline: float | None
    now: float | None
    limit: str
    ok: bool
    message: str = ""


def _f(v) -> str:
    return "—" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))


def compare(baseline: Mapping, entries: Mapping[str, Entry], tolerances: Mapping[str, float],
            allow_missing: bool = False) -> list[Check]:
    checks: list[Check] = []
    base_entries = {e["key"]: e for e in baseline.get("entries", [])}
    for key, base in base_entries.items():
        now = entries.get(key)
        if now is None:
            checks.append(Check(key, "present", None, None, "measured", allow_missing,
                                "" if allow_missing else f"{key}: in the baseline but not measured"))
            continue
        for err in now.failed:
            checks.append(Check(key, "run status", None, None, "ok", False, f"{key}: {err}"))
        for name in RELATIVE:
            if name == "speedup" and now.decoder == figures.AR:
                continue  # AR is the reference: 1.0 by definition
            checks.append(_relative(key, name, base.get(name), now.values.get(name), tolerances[name]))
        checks.append(_score(key, base.get("score_mean"), now.values.get("score_mean"), tolerances["score_mean"]))
        checks.append(_parity(key, base, now.values))
    for key in entries.keys() - base_entries.keys():
        checks.append(Check(key, "present", None, None, "—", not entries[key].failed,
                            "; ".join(entries[key].failed) or ""))
    return [c for c in checks if c is not None]


def _relative(key: str, name: str, base: float | None, now: float | None, tol: float) -> Check | None:
    if base is None:
        return None  # nothing to hold it to (e.g. AR's draft acceptance)
    floor = base * (1 - tol)
    limit = f"≥ {floor:.4g} (−{tol:.0%})"
    if now is None:
        why = "no AR run in the same group" if name == "speedup" else "not measured"
        return Check(key, name, base, None, limit, False, f"{key}: {name} cannot be checked: {why}")
    ok = now >= floor
    msg = "" if ok else (f"{key}: {name} dropped {1 - now / base:.1%} to {now:.4g} (baseline {base:.4g}, "
                         f"allowed −{tol:.0%})")
    return Check(key, name, base, now, limit, ok, msg)


def _score(key: str, base: float | None, now: float | None, tol: float) -> Check | None:
    if base is None:
        return None
    limit = f"≥ {base - tol:.4g} (−{tol:g})"
    if now is None:
        return Check(key, "score_mean", base, None, limit, False, f"{key}: score_mean cannot be checked: not measured")
    ok = now >= base - tol - 1e-12
    msg = "" if ok else f"{key}: score_mean dropped {base - now:.4g} to {now:.4g} (baseline {base:.4g}, allowed −{tol:g})"
    return Check(key, "score_mean", base, now, limit, ok, msg)


def _parity(key: str, base: Mapping, now: Mapping) -> Check | None:
    """Exactness: every compared request identical to AR, near-ties excepted. Absolute, not vs baseline."""
    if now.get("parity_n") is None:
        if base.get("parity_n") is None:
            return None
        return Check(key, "parity", base.get("parity_identical_pct"), None, "100% (near-ties excepted)", False,
                     f"{key}: parity cannot be checked: no AR comparison recorded")
    broken = {k: now.get(k) or 0 for k in PARITY_BREAKS}
    ok = not any(broken.values())
    msg = "" if ok else (f"{key}: parity broken: {broken['parity_mismatch']} mismatch, {broken['parity_length']} length "
                         f"of {now['parity_n']} requests ({_f(now.get('parity_identical_pct'))}% identical, "
                         f"{now.get('parity_near_tie') or 0} near-tie)")
    return Check(key, "parity", base.get("parity_identical_pct"), now.get("parity_identical_pct"),
                 "100% (near-ties excepted)", ok, msg)


# --- baseline file ----------------------------------------------------------------------------


def read_baseline(path: Path) -> dict:
    """The baseline, checked against its schema (gate_schema.Baseline): anything malformed is a
    UserError (exit 2), never a comparison that silently checks less."""
    from .gate_schema import check_baseline
    if path.is_dir():
        raise UserError(f"--baseline {path} is a directory: pass the baseline JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"no baseline at {path}: make one with `aspire-bench gate --baseline {path} --update`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise UserError(f"{path} is not an aspire-bench gate baseline v{VERSION} (see docs/gate.md)")
    check_baseline(data, str(path), tuple(DEFAULT_TOLERANCES), METRICS)
    return data


def make_baseline(entries: Mapping[str, Entry], runs: Sequence[RunRecord], tolerances: Mapping[str, float],
                  store_path: Path) -> dict:
    envs = [r.env for r in runs]
    return {
        "format": FORMAT, "version": VERSION,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": {"store": str(store_path), "groups": sorted({str(r.group) for r in runs}),
                   "runs": sorted(r.run_id for r in runs)},
        # For people reading the file: where the numbers came from. Never compared.
        "env": {"device": sorted({platform_summary(e) for e in envs}),
                **{k: v for k in ("aspire_bench", "torch", "git_rev")
                   if (v := sorted({str(e[k]) for e in envs if e.get(k)}))}},
        "tolerances": dict(tolerances),
        "entries": [{"key": e.key, "decoder": e.decoder, "runs": e.runs, "groups": e.groups,
                     **{k: _clean(v) for k, v in e.values.items()}} for e in sorted(entries.values(), key=lambda e: e.key)],
    }


def _clean(v):
    return None if isinstance(v, float) and math.isnan(v) else v


# --- selection --------------------------------------------------------------------------------


def select_runs(store: Store, run_ids: Sequence[int], group: str | None) -> tuple[list[RunRecord], list[RunRecord]]:
    """(selected runs, every run of their groups). Default: the newest group in the store."""
    if run_ids:
        selected = [store.get_run(i) for i in run_ids]
    else:
        if group is None:
            grouped = [s for s in store.list_runs(kind="measured") if s["group"] is not None]
            if not grouped:
                raise UserError(f"no grouped runs in {store.path}: pass --run RUN_ID or --group GROUP")
            group = grouped[-1]["group"]
        selected = [store.get_run(s["run_id"]) for s in store.list_runs(group=group, kind="measured")]
        if not selected:
            raise UserError(f"no runs of group {group!r} in {store.path}")
    context = [store.get_run(s["run_id"]) for g in {r.group for r in selected if r.group is not None}
               for s in store.list_runs(group=g, kind="measured")]
    return selected, context


# --- run-to-run spread ----------------------------------------------------------------------------

# The suggested speedup tolerance is this multiple of the largest drop of one group's speedup below
# the median of the groups: a few runs rarely show the worst case.
SPREAD_MARGIN = 1.5
# A tolerance at or above this lets a decoder 25% slower in its steps pass (its speedup falls by 20%).
SPREAD_LIMIT = 0.20


def speedup_spread(store: Store) -> dict[str, list[float]]:
    """Per entry key, its speedup in each group of the store (a sweep run several times, one group each)."""
    groups = list(dict.fromkeys(s["group"] for s in store.list_runs(kind="measured") if s["group"] is not None))
    out: dict[str, list[float]] = defaultdict(list)
    for g in groups:
        selected, context = select_runs(store, (), g)
        for key, e in measure(selected, context).items():
            if e.decoder != figures.AR and e.values.get("speedup") is not None:
                out[key].append(e.values["speedup"])
    return dict(out)


def suggested_tolerance(spread: Mapping[str, list[float]]) -> float | None:
    drops = [1 - min(v) / figures.median(v) for v in spread.values() if len(v) > 1]
    return math.ceil(100 * SPREAD_MARGIN * max(drops)) / 100 if drops else None


def print_spread(spread: Mapping[str, list[float]], console: Console) -> None:
    table = Table(title="speedup over AR, run to run (one group per run)")
    for h in ("entry", "groups", "min", "median", "max", "largest drop below median"):
        table.add_column(h, overflow="fold")
    for key, v in sorted(spread.items()):
        med = figures.median(v)
        table.add_row(key, str(len(v)), f"{min(v):.3f}", f"{med:.3f}", f"{max(v):.3f}", f"{1 - min(v) / med:.1%}")
    console.print(table)
    tol = suggested_tolerance(spread)
    if tol is None:
        raise UserError("--spread needs at least two groups of the same sweep in the store: run the sweep again "
                        "into the same --store")
    click.echo(f"suggested speedup tolerance: {tol:.2f} ({SPREAD_MARGIN:g} x the largest drop below the median)")
    if tol >= SPREAD_LIMIT:
        click.echo(f"warning: at {tol:.2f} a decoder 25% slower in its steps passes the gate: make the runs less "
                   "noisy first (more requests or repeats in the sweep)")


# --- output -----------------------------------------------------------------------------------

HEADERS = ("entry", "check", "baseline", "now", "limit", "result")


def _rows(checks: Sequence[Check]) -> list[tuple[str, ...]]:
    return [(c.key, c.check, _f(c.baseline), _f(c.now), c.limit, "ok" if c.ok else "REGRESSION") for c in checks]


def print_table(checks: Sequence[Check], console: Console) -> None:
    table = Table(title="aspire-bench gate")
    for h in HEADERS:
        table.add_column(h, overflow="fold")
    for row, c in zip(_rows(checks), checks):
        table.add_row(*row[:-1], "[green]ok[/]" if c.ok else "[bold red]REGRESSION[/]")
    console.print(table)


def markdown(checks: Sequence[Check], verdict: str) -> str:
    lines = [f"### aspire-bench gate: {verdict}", "", "| " + " | ".join(HEADERS) + " |",
             "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in _rows(checks)]
    failures = [c.message for c in checks if not c.ok]
    if failures:
        lines += ["", *(f"- {m}" for m in failures)]
    return "\n".join(lines) + "\n"


def _tolerances(base: Mapping, overrides: Sequence[str]) -> dict[str, float]:
    tol = {**DEFAULT_TOLERANCES, **base}
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep or name not in DEFAULT_TOLERANCES:
            raise UserError(f"--tolerance {item!r}: use NAME=VALUE with NAME one of {', '.join(DEFAULT_TOLERANCES)}")
        try:
            tol[name] = float(value)
        except ValueError:
            raise UserError(f"--tolerance {item!r}: {value!r} is not a number") from None
        if not 0 <= tol[name] < math.inf:
            raise UserError(f"--tolerance {item!r}: a tolerance is a finite number >= 0")
    return tol


@click.command(epilog=examples("aspire-bench gate --baseline ci/baseline.json",
                               "aspire-bench gate --spread --store ci.db"))
@click.option("--baseline", "baseline_path", type=click.Path(path_type=Path),
              help="Baseline JSON (docs/gate.md); required unless --spread.")
@click.option("--store", "store_path", default=DEFAULT_PATH, show_default=True, envvar="ASPIRE_BENCH_STORE",
              type=click.Path(path_type=Path), help="SQLite results store.")
@click.option("--run", "run_ids", multiple=True, type=int, help="Gate these runs (repeatable).")
@click.option("--group", help="Gate every run of this group. Default: the newest group in the store.")
@click.option("--tolerance", "tolerances", multiple=True, metavar="NAME=VALUE",
              help=f"Override a tolerance ({', '.join(DEFAULT_TOLERANCES)}).")
@click.option("--allow-missing", is_flag=True, help="Baseline entries not measured now are not a failure.")
@click.option("--markdown", "markdown_path", type=click.Path(path_type=Path),
              help="Also append the table as markdown (e.g. $GITHUB_STEP_SUMMARY).")
@click.option("--update", is_flag=True, help="Write a new baseline from these runs instead of comparing.")
@click.option("--spread", is_flag=True,
              help="Print each entry's speedup over every group in the store and a speedup tolerance that covers "
                   "their spread (run the gate sweep several times into one store first).")
def gate(baseline_path, store_path, run_ids, group, tolerances, allow_missing, markdown_path, update, spread):
    """Fail (exit 1) when runs regress against a baseline: speedup vs AR, acceptance, parity, score."""
    # CI logs are not terminals: a wide table there beats one wrapped at rich's default 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        code = _gate(console, baseline_path, store_path, run_ids, group, tolerances, allow_missing, markdown_path,
                     update, spread)
    except (UserError, sqlite3.DatabaseError, OSError) as e:
        # Exit 2, not 1: a usage error, a damaged store or an unwritable file must never read as a regression.
        click.secho(f"error: {' '.join(str(e).split())}", fg="red", err=True)
        code = USAGE
    raise SystemExit(code)


def _gate(console, baseline_path, store_path, run_ids, group, tol_overrides, allow_missing, markdown_path, update,
          spread=False):
    if run_ids and group:
        raise UserError("give --run or --group, not both")
    if baseline_path is None and not spread:
        raise UserError("missing --baseline PATH: the baseline JSON to compare with (or --update to write it)")
    if not store_path.exists():
        raise UserError(f"no results store at {store_path}: run a benchmark first or pass --store PATH")
    if spread:
        with Store(store_path, readonly=True) as store:
            print_spread(speedup_spread(store), console)
        return PASS
    with Store(store_path, readonly=True) as store:  # the gate only reads the store
        selected, context = select_runs(store, run_ids, group)
    entries = measure(selected, context)
    if update:
        failed = [m for e in entries.values() for m in e.failed]
        if failed:
            raise UserError("not writing a baseline from failed runs: " + "; ".join(failed))
        old = read_baseline(baseline_path).get("tolerances", {}) if baseline_path.exists() else {}
        data = make_baseline(entries, selected, _tolerances(old, tol_overrides), store_path)
        baseline_path.parent.mkdir(parents=True, exist_ok=True)
        write_text(baseline_path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        console.print(f"wrote baseline {baseline_path}: {len(entries)} entries from runs "
                      f"{', '.join(map(str, data['source']['runs']))}")
        return PASS
    baseline = read_baseline(baseline_path)
    groups = sorted({str(r.group) for r in selected})
    click.echo(f"gating {len(selected)} run(s) of group(s) {', '.join(groups)} against {baseline_path} "
               f"(made {baseline.get('created_at', '?')} from group(s) "
               f"{', '.join(baseline.get('source', {}).get('groups', [])) or '?'})")
    checks = compare(baseline, entries, _tolerances(baseline.get("tolerances", {}), tol_overrides), allow_missing)
    if not any(c.check != "present" for c in checks):
        # Presence alone is not a pass: e.g. a baseline of another model under --allow-missing.
        raise UserError(f"nothing was compared: none of the {len(selected)} run(s) matches an entry of "
                        f"{baseline_path} (baseline keys: {', '.join(sorted(e['key'] for e in baseline['entries']))})"
                        "; gate the runs the baseline was made from or rebuild it with --update")
    failures = [c for c in checks if not c.ok]
    verdict = f"FAIL, {len(failures)} regression(s)" if failures else f"pass ({len(checks)} checks)"
    print_table(checks, console)
    # Plain lines as well as the table: greppable in CI logs and never wrapped.
    for c in failures:
        click.echo(f"REGRESSION {c.message}")
    click.echo(f"gate: {verdict}")
    if markdown_path:
        with open(markdown_path, "a") as f:
            f.write(markdown(checks, verdict))
    return FAIL if failures else PASS


COMMANDS = [gate]
