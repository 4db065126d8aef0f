"""`aspire-bench demo` end to end at a test's size: measured as bench measures it, the simulator's replay
beside it, and on the board one sentence per speculative decoder on what bounds it."""
from __future__ import annotations

import re

from aspire_bench.demo import demo
from aspire_bench.harness.store import Store


def test_demo_boards_say_what_bounds_each_decoder(random_tiny, tmp_path, capsys, monkeypatch):
    # The replay's calibration is timed beside the runs; on a busy test machine its fit may fail the
    # quality check, and the demo then says so instead of replaying (tested below). Here: the plumbing.
    from aspire_bench.simulator import source
    monkeypatch.setattr(source, "fit_problem", lambda model: None)
    db = tmp_path / "demo.db"
    index = demo(str(db), str(tmp_path / "lb"), models=[str(random_tiny)], contexts=["1k"], batch_sizes=[2],
                 tasks=[{"name": "needle", "limit": 4}], max_new_tokens=6)
    printed = capsys.readouterr().out
    out = " ".join(printed.split())
    # not a terminal (a CI log): the tables print as Markdown, every value whole
    assert "| context | batch |" in printed and "…" not in printed
    with Store(db, readonly=True) as st:
        measured = [st.get_run(s["run_id"]) for s in st.list_runs(kind="measured")]
        simulated = st.list_runs(kind="simulated")
    assert [r.config["decoder"] for r in measured] == ["ar", "magicdec", "vegas", "aspire"]
    assert {r.sweep for r in measured} == {"demo"} and len(simulated) == 4  # every run replayed
    assert all(r.aggregates["speedup_vs_ar_ci95_low"] is not None for r in measured)
    html = index.read_text()
    bounds = re.search(r'<div class="bounds">(.*?)</div>', html).group(1)
    items = re.findall(r"<li>(.*?)</li>", bounds)
    assert sorted(i.split(":")[0] for i in items) == ["aspire", "magicdec", "vegas"]
    for item in items:  # its own figures: speedup, acceptance, draft cost, bound share, the replay
        assert "× AR" in item and "of drafts accepted" in item and "a draft step costs" in item
        assert re.search(r"(reaches|measured) \d+% of the|allow [\d.]+× at best", item), item
        assert re.search(r"The simulator&#x27;s replay of this run predicts [\d.]+× \([+−-]\d+%\)", item), item
    assert "what bounds each decoder" in out and "the simulator's replay of these runs" in out


def test_demo_says_why_it_has_no_replay(random_tiny, tmp_path, capsys, monkeypatch):
    from aspire_bench.simulator import rows
    monkeypatch.setattr(rows, "stored_calibration", lambda store, record: None)
    demo(str(tmp_path / "d.db"), str(tmp_path / "lb"), models=[str(random_tiny)], contexts=["1k"], batch_sizes=[2],
         tasks=[{"name": "needle", "limit": 2}], max_new_tokens=4, decoders=["ar", "magicdec"])
    out = " ".join(capsys.readouterr().out.split())
    assert "no simulator replay: run 1 has no calibration in its group" in out
