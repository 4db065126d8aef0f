"""The shipped gate catches real regressions: the CI sweep (ci/gate_sweep.yaml, made small) runs through
the same commands .ci/run uses (`sweep`, then `gate --baseline`), held to the tolerances of the shipped
ci/baseline.json. A rerun passes; a decoder whose steps take 25% longer fails on its speedup, and one
whose drafts are accepted half as often fails on acceptance, with parity intact.

Every forward pass advances a fake clock by a fixed cost, so the figures repeat exactly: the test
checks the gate, not this machine's load."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from click.testing import CliRunner

from aspire_bench.cli import main
from aspire_bench.decoders import loop, sampler
from aspire_bench.decoders.magicdec import MagicDecPolicy
from aspire_bench.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
SLOW_DECODER = MagicDecPolicy  # the decoder the regressions are injected into


@pytest.fixture
def fake_clock(monkeypatch):
    """Each forward adds 1 ms + 0.1 ms per token + 1 us per KV position; `slowdown` scales the forwards
    of SLOW_DECODER's steps, `halve` cuts its accepted drafts to half (rounded down)."""
    clock = SimpleNamespace(t=0.0, slowdown=1.0, halve=False, current=None)
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: clock.t))
    forward, run_step, accept = Engine.forward, loop.run_step, sampler.accept_greedy

    def timed_forward(self, rows):
        out = forward(self, rows)
        scale = clock.slowdown if isinstance(clock.current, SLOW_DECODER) else 1.0
        clock.t += scale * (1e-3 + sum(1e-4 * r.n + 1e-6 * r.start for r in rows))
        return out

    def step(engine, policy, *args):
        clock.current = policy
        try:
            return run_step(engine, policy, *args)
        finally:
            clock.current = None

    def accept_greedy(logits, drafts):
        a, nxt = accept(logits, drafts)
        if clock.halve and isinstance(clock.current, SLOW_DECODER) and a > 0:
            # keep half the accepted drafts; the next token is then the draft AR would also have picked
            a, nxt = a // 2, drafts[a // 2]
        return a, nxt

    monkeypatch.setattr(Engine, "forward", timed_forward)
    monkeypatch.setattr(loop, "run_step", step)
    monkeypatch.setattr(sampler, "accept_greedy", accept_greedy)
    return clock


def ci_sweep(tmp_path: Path) -> Path:
    """ci/gate_sweep.yaml at a test's size (its decoders, sampling, parity and prefix cache kept)."""
    spec = yaml.safe_load((ROOT / "ci" / "gate_sweep.yaml").read_text())
    spec.update(contexts=["1k"], batch_sizes=[2], max_new_tokens=16, repeats=1,
                tasks=[{"name": "code-completion", "limit": 2}], decoders=["ar", "magicdec"])
    path = tmp_path / "gate_sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def sweep_and_gate(tmp_path: Path, name: str, baseline: Path, update: bool = False):
    db = tmp_path / f"{name}.db"
    res = CliRunner().invoke(main, ["--threads", "1", "sweep", str(ci_sweep(tmp_path)), "--store", str(db)])
    assert res.exit_code == 0, res.output
    args = ["gate", "--baseline", str(baseline), "--store", str(db)] + (["--update"] if update else [])
    return CliRunner().invoke(main, args)


def test_the_shipped_gate_fails_on_a_slower_decoder_and_on_halved_acceptance(tmp_path, fake_clock):
    shipped = json.loads((ROOT / "ci" / "baseline.json").read_text())["tolerances"]
    assert shipped["speedup"] < 0.2  # a 25% slower decoder's speedup falls by 20%
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"format": "aspire-bench-gate-baseline", "version": 1,
                                    "tolerances": shipped, "entries": [{"key": "placeholder", "speedup": 1.0}]}))
    made = sweep_and_gate(tmp_path, "base", baseline, update=True)  # --update keeps the shipped tolerances
    assert made.exit_code == 0, made.output
    assert json.loads(baseline.read_text())["tolerances"] == shipped

    again = sweep_and_gate(tmp_path, "again", baseline)
    assert again.exit_code == 0 and "gate: pass" in again.output, again.output

    fake_clock.slowdown = 1.25
    slow = sweep_and_gate(tmp_path, "slow", baseline)
    assert slow.exit_code == 1, slow.output
    assert "magicdec [" in slow.output and "speedup dropped" in slow.output and "gate: FAIL, 1 regression(s)" in slow.output

    fake_clock.slowdown, fake_clock.halve = 1.0, True
    halved = sweep_and_gate(tmp_path, "halved", baseline)
    assert halved.exit_code == 1, halved.output
    assert "draft_acceptance_rate dropped" in halved.output and "mean_accepted_len dropped" in halved.output
    assert "parity broken" not in halved.output  # the same tokens, accepted fewer at a time
