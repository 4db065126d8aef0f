"""The CI files agree: the sample workflow and this repository's CI run exactly ci/gate_sweep.yaml, whose
cells are the baseline's entries, and the documented tolerances are the baseline's."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from aspire_bench.gate import entry_key
from aspire_bench.harness.sweep import load_sweep

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "ci"


def _workflow_sweep() -> Path:
    wf = yaml.safe_load((CI / "github-workflow.yml").read_text())
    commands = [step["run"] for job in wf["jobs"].values() for step in job["steps"] if "run" in step]
    sweeps = [line for c in commands for line in c.splitlines() if line.strip().startswith("aspire-bench sweep")]
    assert len(sweeps) == 1, sweeps
    arg = shlex.split(sweeps[0])[2]
    return ROOT / (wf["env"]["SWEEP"] if arg == "$SWEEP" else arg)


def test_the_workflow_runs_exactly_the_gate_sweep():
    assert _workflow_sweep() == CI / "gate_sweep.yaml"
    assert "ci/gate_sweep.yaml" in (ROOT / ".ci" / "run").read_text()


def test_the_gate_sweep_produces_the_baselines_keys():
    baseline = json.loads((CI / "baseline.json").read_text())
    cells = load_sweep(_workflow_sweep()).cells
    assert {entry_key(c.config.identity()) for c in cells} == {e["key"] for e in baseline["entries"]}


def test_documented_tolerances_are_the_baselines():
    tol = json.loads((CI / "baseline.json").read_text())["tolerances"]
    readme = (CI / "README.md").read_text()
    assert f"at most {tol['speedup']:.0%}" in readme
    assert tol["mean_accepted_len"] == tol["draft_acceptance_rate"]
    assert f"acceptance at most {tol['draft_acceptance_rate']:.0%}" in readme
    assert f"score at most {tol['score_mean']:g}" in readme
    from aspire_bench.gate import DEFAULT_TOLERANCES
    gate_doc = (ROOT / "docs" / "gate.md").read_text()
    assert re.search(rf"{DEFAULT_TOLERANCES['speedup']:.0%}", gate_doc)
