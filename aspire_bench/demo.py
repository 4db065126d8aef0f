"""`aspire-bench demo`: the packaged demo sweep (AR, MagicDec, Vegas, ASPIRE side by side on the
bundled model), its summary in the terminal, and a leaderboard."""
from __future__ import annotations

from pathlib import Path

import yaml

from .harness.sweep import expand, run_sweep
from .harness.tables import print_sweep_summary

DEMO_SWEEP = Path(__file__).parent / "sweeps" / "demo.yaml"
# the same on a real pretrained model (`aspire-bench models get smollm2-135m`)
DEMO_REAL_SWEEP = Path(__file__).parent / "sweeps" / "demo-real.yaml"


def demo(store: str = "aspire_results.db", out: str = "leaderboards/demo", sweep_file: Path = DEMO_SWEEP,
         **overrides) -> Path:
    """Overrides replace top-level keys of the demo sweep (e.g. contexts=["4k"], max_new_tokens=32)."""
    from .engine.loading import resolve_model_path
    from .report import write_report
    spec = {**yaml.safe_load(sweep_file.read_text()), **overrides}
    sweep = expand(spec, sweep_file.stem)
    for model in sorted({c.config.model for c in sweep.cells}):
        resolve_model_path(model)  # a model not at hand stops the demo here, in one line, not in every cell
    outcome = run_sweep(sweep, store)
    print_sweep_summary(outcome.records, sweep.name)
    if outcome.failed:
        raise RuntimeError(f"{len(outcome.failed)} demo cell(s) failed: {outcome.failed[0].error}")
    return write_report(store, out)
