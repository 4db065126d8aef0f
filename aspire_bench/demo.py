"""`aspire-bench demo`: the four decoders side by side on the bundled model, ending in a leaderboard."""
from __future__ import annotations

from pathlib import Path

from .harness.records import new_group_id
from .harness.runner import RunConfig, run
from .harness.tables import print_summary

DECODERS = ("ar", "magicdec", "vegas", "aspire")
CONTEXTS = ("4k", "16k")


def demo(store: str = "aspire_results.db", out: str = "leaderboards/demo", contexts=CONTEXTS,
         decoders=DECODERS, limit: int = 4, batch_size: int = 4, max_new_tokens: int = 64) -> Path:
    """Greedy with parity, so every speculative row also shows exactness against AR."""
    from .report import write_report
    group = new_group_id()
    records = []
    for ctx in contexts:
        for dec in decoders:
            cfg = RunConfig(model="tiny", decoder=dec, task="code-completion", context_len=ctx, limit=limit,
                            batch_size=batch_size, max_new_tokens=max_new_tokens, parity=dec != "ar")
            records.append(run(cfg, store=store, group=group, sweep="demo").record)
    print_summary(records, title="demo: code-completion on the bundled tiny model (greedy, fp32, CPU)")
    return write_report(store, out)
