"""`aspire-bench demo`: AR, MagicDec, Vegas and ASPIRE side by side on the bundled model, in the regime
where its speculative decoders gain (sweeps/demo.yaml), measured as `bench` measures (rounds, tuned
step costs, intervals, bound share); the simulator's replay of the same runs beside the measurement;
one sentence per decoder on what bounds it; and a leaderboard."""
from __future__ import annotations

from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from .errors import UserError
from .harness.bench import Sampling, bench, bench_table
from .harness.tables import emit

DEMO_SWEEP = Path(__file__).parent / "sweeps" / "demo.yaml"
# the same on a real pretrained model (`aspire-bench models get smollm2-135m`)
DEMO_REAL_SWEEP = Path(__file__).parent / "sweeps" / "demo-real.yaml"


def bench_args(spec: dict) -> dict:
    """The demo sweep's keys as bench's arguments (the same file runs as a sweep too)."""
    task = spec["tasks"][0]
    task = task if isinstance(task, dict) else {"name": task}
    s = spec.get("sampling") or {}
    return {"model": spec["models"][0], "task": task["name"], "limit": task.get("limit"),
            "contexts": spec["contexts"], "batch_sizes": spec["batch_sizes"], "decoders": spec["decoders"],
            "repeat": spec.get("repeats", 1), "max_new_tokens": spec["max_new_tokens"],
            "samplings": [Sampling(float(s.get("temperature", 0.0)), int(s.get("top_k", 0)), float(s.get("top_p", 1.0)))]}


def demo(store: str = "aspire_results.db", out: str = "leaderboards/demo", sweep_file: Path = DEMO_SWEEP,
         **overrides) -> Path:
    """Overrides replace top-level keys of the demo sweep (e.g. contexts=["4k"], max_new_tokens=32)."""
    from .engine.loading import resolve_model_path
    from .harness.store import Store
    from .report import write_report
    from .report.leaderboard import bound_sentence, build, load_runs, simulated_by_source
    from .simulator.rows import save, stored_rows
    spec = {**yaml.safe_load(Path(sweep_file).read_text()), **overrides}
    for model in spec["models"]:
        resolve_model_path(model)  # a model not at hand stops the demo here, in one line
    rows, bandwidth = bench(**bench_args(spec), store=store, tune=False, name=spec.get("name", "demo"))
    console = Console()
    emit(bench_table(rows, bandwidth), None)  # fitted to a terminal, Markdown in a log: no value cut
    ids = [r.record.run_id for r in rows]
    try:
        with Store(store, readonly=True) as st:
            sim_rows, sims = stored_rows(st, ids)  # each run replayed with the calibration timed beside it
    except UserError as e:  # e.g. every calibration round beside the runs was disturbed (a poor fit)
        console.print(f"no simulator replay: {e}", highlight=False)
    else:
        save(store, sims)
        emit(replay_table(sim_rows), None)
    simulated = simulated_by_source(load_runs(store, kind="simulated"))
    for board in build([r for r in load_runs(store) if r.run_id in ids]).boards:
        console.print(f"[bold]{board.title}[/]: what bounds each decoder")
        for row in board.rows:
            text = bound_sentence(row, board, simulated)
            if text:
                console.print(f"- {text}", highlight=False)
    return write_report(store, out)


def replay_table(sim_rows: list[dict]) -> Table:
    t = Table(title="the simulator's replay of these runs beside the measurement (stated error: ±10% tok/s)")
    for col in ("context", "batch", "decoder", "measured × AR", "simulated × AR", "error"):
        t.add_column(col, justify="left" if col in ("context", "decoder") else "right")
    for r in sim_rows:
        m, s = r.get("measured_speedup_vs_ar"), r.get("simulated_speedup_vs_ar")
        t.add_row(str(r["context"]), str(r["batch_size"]), str(r["decoder"]), f"{m:.2f}" if m else "—",
                  f"{s:.2f}" if s else "—", f"{s / m - 1:+.0%}" if m and s else "—")
    return t
