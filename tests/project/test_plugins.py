"""Decoders and tasks from other packages, found through entry points (aspire_bench/plugins.py): the
example package in tests/fixtures is installed into a temporary directory and run through the CLI."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = Path(__file__).parents[1] / "fixtures" / "example_decoder_plugin"


def cli(*args, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    return subprocess.run([sys.executable, "-m", "aspire_bench.cli", *args], capture_output=True, text=True, check=False,
                          cwd=cwd, env=env, timeout=600)


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    """The example package installed (offline, without its dependencies) into a directory of its own."""
    tmp = tmp_path_factory.mktemp("plugin")
    src = shutil.copytree(EXAMPLE, tmp / "src")  # pip builds in the source tree: keep the fixture clean
    site = tmp / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(site), str(src)], capture_output=True, text=True, check=False,
                          timeout=300)
    assert res.returncode == 0, res.stderr
    assert (next(site.glob("aspire_example_decoder-*.dist-info")) / "entry_points.txt").exists()
    return site


def fake_dist(site: Path, name: str, entry_points: str) -> None:
    """A distribution's metadata alone (no code): enough for importlib.metadata to list its entry points."""
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_the_example_decoder_and_task_run_through_the_cli(example_site, tmp_path):
    """The example policy runs through run (lossless: greedy parity with AR is exact), bench (with the
    tuned row its tune_grid asks for), simulate (its stored trace replayed) and report."""
    listed = cli("decoders", site=example_site, cwd=tmp_path)
    [line] = [x for x in listed.stdout.splitlines() if x.split()[:1] == ["recent-draft"]]
    assert listed.returncode == 0 and "most recent tokens" in line
    tasks = cli("tasks", site=example_site, cwd=tmp_path)
    assert tasks.returncode == 0 and "count-on" in tasks.stdout
    store = str(tmp_path / "r.db")
    res = cli("run", "--decoder", "recent-draft", "--decoder-arg", "window=16", "--task", "count-on", "--limit", "2",
              "--batch-size", "2", "--max-new-tokens", "6", "--parity", "--store", store, "--format", "json",
              site=example_site, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    [rec] = json.loads(res.stdout)
    assert rec["status"] == "ok" and rec["config"]["decoder"] == "recent-draft" and rec["config"]["task"] == "count-on"
    a = rec["aggregates"]
    assert a["n_requests"] == 2 and a["generated_tokens"] > 0 and a["decode_tok_s"] > 0
    assert a["parity_n"] == 2 and a["parity_identical_pct"] == 100.0 and a["mean_accepted_len"] > 0
    bad = cli("run", "--decoder", "recent-draft", "--decoder-arg", "window=abc", "--task", "count-on", "--limit", "1",
              site=example_site, cwd=tmp_path)
    assert bad.returncode == 2 and "window" in bad.stderr and "Traceback" not in bad.stderr
    bench = cli("bench", "--task", "count-on", "--contexts", "1k", "--batch-sizes", "2", "--decoders",
                "ar,recent-draft", "--repeat", "1", "--max-new-tokens", "6", "--sampling", "greedy", "--limit", "2",
                "--no-bound", "--no-calibration-rounds", "--store", store, "--format", "json",
                site=example_site, cwd=tmp_path)
    assert bench.returncode == 0, bench.stderr
    rows = json.loads(bench.stdout)
    assert [(r["decoder"], r["tuned"]) for r in rows] == [("ar", False), ("recent-draft", False), ("recent-draft", True)]
    assert rows[2]["settings"]["gamma"] in (2, 4) and rows[1]["settings"]["gamma"] == 3
    sim = cli("simulate", "--store", store, "--run", str(rows[1]["run_id"]), "--hardware", "h100", "--json",
              site=example_site, cwd=tmp_path)
    assert sim.returncode == 0, sim.stderr
    [row] = json.loads(sim.stdout)
    assert row["decoder"] == "recent-draft" and row["stored_run_id"]
    rep = cli("report", "--store", store, "--out", str(tmp_path / "boards"), site=example_site, cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    assert "recent-draft" in "".join(p.read_text() for p in (tmp_path / "boards").rglob("*.html"))


def test_a_builtin_name_wins_and_a_broken_plugin_is_one_line(tmp_path):
    site = tmp_path / "site"
    fake_dist(site, "shadowing-plugin", "[aspire_bench.decoders]\nar = shadowing_plugin:AR\n\n"
                                        "[aspire_bench.tasks]\nneedle = shadowing_plugin:Needle\n")
    fake_dist(site, "broken-plugin", "[aspire_bench.decoders]\nbroken = broken_plugin.missing:Decoder\n")
    listed = cli("decoders", site=site, cwd=tmp_path)
    assert listed.returncode == 0 and "broken" in listed.stdout.split()
    warning = [line for line in listed.stderr.splitlines() if "shadowing-plugin" in line]
    assert len(warning) == 1 and "'ar'" in warning[0] and "built-in" in warning[0]
    run = cli("run", "--decoder", "broken", "--limit", "1", site=site, cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    [line] = [x for x in run.stderr.splitlines() if "broken-plugin" in x]
    assert "'broken'" in line and "ModuleNotFoundError" in line
    tasks = cli("tasks", site=site, cwd=tmp_path)
    assert tasks.returncode == 0 and any("shadowing-plugin" in x and "'needle'" in x for x in tasks.stderr.splitlines())


def test_the_guide_quotes_the_example_decoder_as_it_is_and_it_stays_short():
    """docs/adding-a-decoder.md shows decoder.py whole; the example is a policy of about 30 lines."""
    code = (EXAMPLE / "aspire_example_decoder" / "decoder.py").read_text()
    assert f"```python\n{code}```" in (REPO / "docs" / "adding-a-decoder.md").read_text()
    assert len(code.splitlines()) <= 32
