"""Write a whole report directory: index, run pages, definitions, and plotly.js once, for offline use."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from plotly.offline import get_plotlyjs

from aspire_bench.atomic import write_text
from aspire_bench.errors import UserError
from aspire_bench.harness import figures
from aspire_bench.report import definitions, diagnostics
from aspire_bench.report.html import page
from aspire_bench.report.leaderboard import build, load_runs, simulated_by_source
from aspire_bench.report.pages import PLOTLY_JS, header_meta, render_index, render_run
from aspire_bench.report.projected import render_projected


def write_report(store_path: str | Path, out_dir: str | Path) -> Path:
    """Read every run of the store and write the report under out_dir; returns index.html's path."""
    store_path, out = Path(store_path), Path(out_dir)
    if not store_path.exists():
        raise UserError(f"no results store at {store_path}: run a benchmark first or pass --store PATH")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory: give a directory for the pages")
    blocked = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise UserError(f"--out {out}: {blocked} is a file, not a directory: give another directory")
    runs = load_runs(store_path)
    lb = build(runs)
    now = datetime.now(timezone.utc)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    # The pages load plotly.js from this one local file: no CDN, and not 4.8 MB inlined into every page.
    _write(out / PLOTLY_JS, get_plotlyjs())
    meta = header_meta(runs, now)
    _write(out / "metrics.html", page("Metric definitions", _doc("metrics.md"), meta=meta))
    _write(out / "leaderboard.html", page("How to read the leaderboard", _doc("leaderboard.md"), meta=meta))
    sets = figures.repeat_sets(runs)
    for run in runs:
        _write(out / "runs" / f"run-{run.run_id}.html", render_run(run, sets.get((run.group, run.config_hash), ()), now))
    diags = diagnostics.load_diagnostics(store_path)
    if diags:  # their own page: a diagnostic measures a model, it ranks no decoder
        dmeta, docs = header_meta(diags, now), (definitions.DOCS / "diagnostics.md").exists()
        _write(out / diagnostics.PAGE, diagnostics.render_diagnostics(diags, dmeta, [PLOTLY_JS], docs))
        if docs:
            _write(out / diagnostics.DEFINITIONS, page("Diagnostics: definitions", _doc("diagnostics.md"), meta=dmeta))
    # Simulated runs: a page of their own, never mixed into the leaderboards.
    simulated = load_runs(store_path, kind="simulated")
    _write(out / "projected.html", render_projected(simulated, meta))
    index = out / "index.html"
    _write(index, render_index(lb, now, diagnostics.diagnostics_link(diags), simulated_by_source(simulated)))
    return index


def _doc(name: str) -> str:
    return f"<div class=\"doc\">{definitions.doc_body(name)}</div>"  # prose: left-aligned tables


def _write(path: Path, text: str) -> None:
    write_text(path, text)  # written beside and renamed: a browser never sees a half-written page
