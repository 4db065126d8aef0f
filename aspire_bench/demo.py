"""`aspire-bench demo`: the packaged demo sweep (AR, MagicDec, Vegas, ASPIRE side by side on the
bundled model), its summary in the terminal, and a leaderboard."""
from __future__ import annotations

from pathlib import Path

import yaml

from .harness.sweep import expand, run_sweep
from .harness.tables import print_sweep_summary

DEMO_SWEEP = Path(__file__).parent / "sweeps" / "demo.yaml"


def demo(store: str = "aspire_results.db", out: str = "leaderboards/demo", **overrides) -> Path:
    """Overrides replace top-level keys of the demo sweep (e.g. contexts=["4k"], max_new_tokens=32)."""
    from .report import write_report
    spec = {**yaml.safe_load(DEMO_SWEEP.read_text()), **overrides}
    sweep = expand(spec, "demo")
    outcome = run_sweep(sweep, store)
    print_sweep_summary(outcome.records, sweep.name)
    if outcome.failed:
        raise RuntimeError(f"{len(outcome.failed)} demo cell(s) failed: {outcome.failed[0].error}")
    return write_report(store, out)
