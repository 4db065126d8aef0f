"""Static HTML leaderboards from the results store: `write_report(store_path, out_dir)`."""
from __future__ import annotations

from pathlib import Path


def write_report(store_path: str | Path, out_dir: str | Path) -> Path:
    """Write the report of every run in the store under out_dir; returns the index page's path."""
    # Imported here: plotly takes a while to import, and the gate (which shares harness/figures.py with the report) never needs it.
    from aspire_bench.report.build import write_report as write

    return write(store_path, out_dir)


__all__ = ["write_report"]
