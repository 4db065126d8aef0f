"""The stand-alone benchmark scripts under bench/: their arithmetic, and that they run end to end."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import attention_ab
import dense_forward
import draft_parts
import engine_ab
import host_work
import kernel_ab
import step_costs


def test_speedup_bound_matches_the_closed_form():
    # gamma = 0 is AR through the verify path: 1 token per verify step
    assert step_costs.best_speedup(0.5, {0: 1.0}, 0.0) == (1.0, 0)
    v = {g: 1.0 + 0.05 * g for g in range(9)}
    s, g = step_costs.best_speedup(0.1, v, 0.8)
    expected = max((1 - 0.8 ** (k + 1)) / 0.2 / (k * 0.1 + v[k]) for k in range(9))
    assert s == pytest.approx(expected) and 1 <= g <= 8
    # costlier drafts or verifies never allow more
    assert step_costs.best_speedup(0.3, v, 0.8)[0] < s
    assert step_costs.best_speedup(0.1, {k: x + 0.2 * k for k, x in v.items()}, 0.8)[0] < s


def test_dense_forward_times_each_dense_backend(tmp_path):
    out = tmp_path / "dense.json"
    assert dense_forward.main(["--tokens", "1,5", "--batch", "2", "--repeats", "1", "--dense", "cpp,eager",
                               "--attention-backend", "null", "--json", str(out)]) == 0
    ms = json.loads(out.read_text())["ms"]
    assert set(ms) == {"cpp", "eager"} and all(set(v) == {"1", "5"} and min(v.values()) > 0 for v in ms.values())


def test_attention_ab_times_two_builds_on_the_same_rows(capsys):
    from aspire_bench.kernels.cpu_attention import SOURCE
    assert attention_ab.main(["--a", str(SOURCE), "--cases", "1x64,3x80s,1x90c", "--pairs", "4", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0].strip() for ln in lines[1:]] == ["1x64", "3x80s", "1x90c"]
    assert all(ln.endswith("max |A-B| 0.0e+00") for ln in lines[1:])  # one source: identical outputs
    rows, cap = attention_ab.case_rows(3, 80, True, torch.Generator().manual_seed(0))
    assert all(r.sparse[0][-3:].tolist() == [r.base + 80 + i for i in range(3)] for r in rows)  # own tokens last
    assert all(r.base + r.start + r.n <= cap for r in rows)
    assert attention_ab.main(["--a", "no/such.cpp"]) == 2


def test_engine_ab_times_two_builds_in_whole_forwards(capsys):
    from aspire_bench.kernels.cpu_attention import SOURCE
    assert engine_ab.main(["--a", str(SOURCE), "--context", "1024", "--batch", "2", "--rounds", "2",
                           "--kinds", "ar,verify2,aspire,window", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0].strip() for ln in lines[1:]] == ["ar", "verify2", "aspire", "window"]
    assert all(ln.endswith("max |A-B| of the logits 0.0e+00") for ln in lines[1:])  # one source: the same logits
    assert engine_ab.main(["--b", "no/such.cpp"]) == 2
    assert engine_ab.main(["--kinds", "ar,verify9"]) == 2
    assert capsys.readouterr().err.count("error:") == 2


def test_kernel_ab_calls_both_builds_back_to_back(tmp_path, capsys):
    from aspire_bench.kernels.cpu_attention import SOURCE
    # B scores with a 1% larger scale: its outputs must differ from A's, so both versions really ran
    text = SOURCE.read_text()
    assert "scale * LOG2E;" in text
    other = tmp_path / "other.cpp"
    other.write_text(text.replace("scale * LOG2E;", "scale * LOG2E * 1.01f;"))
    assert kernel_ab.main(["--b", str(other), "--cases", "1x100,3x200s", "--pairs", "4", "--copies", "2",
                           "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0].strip() for ln in lines[1:]] == ["1x100", "3x200s"]
    assert all(1e-6 < float(ln.rsplit(" ", 1)[1]) < 1 for ln in lines[1:])
    # --b read: B is a plain read of the same lines; its line says so instead of an output difference
    assert kernel_ab.main(["--b", "read", "--cases", "1x100s", "--pairs", "2", "--copies", "1", "--threads", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("(B: plain read)")
    assert kernel_ab.main(["--cases", "2by64"]) == 2
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++")
    assert kernel_ab.main(["--a", str(broken), "--cases", "1x64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "is not NxCONTEXT" in err and "did not compile" in err


def test_attention_ab_compares_vector_widths(capsys):
    from aspire_bench.kernels import cpu_attention, cpu_build
    has_512 = "avx512f" in cpu_build.cpu_flags()
    code = attention_ab.main(["--a-width", "16", "--b-width", "8", "--cases", "2x100", "--pairs", "2", "--threads", "1"])
    out, err = capsys.readouterr()
    if not has_512:
        assert code == 2 and err.count("\n") == 1 and "not 16" in err
        return
    assert code == 0 and "(16 floats per vector), B = " in out and f"{cpu_attention.SOURCE} (8)" in out
    diff = float(out.splitlines()[1].rsplit(" ", 1)[1])
    assert 0 < diff < 1e-5  # other vectors, other rounding: close, not identical


def test_draft_parts_adds_one_part_of_a_draft_per_kind(tmp_path):
    from aspire_bench.harness.step_costs import Cell
    engine = step_costs.make_engine("tiny", "float32", "cpu", "torch", seed=0)
    cell = Cell(engine, 1024, 2, 0, 0)
    out = {k: engine.forward(draft_parts.part_rows(cell, k)) for k in draft_parts.KINDS}
    read, sparse = {k: o.kv_read for k, o in out.items()}, {k: o.kv_sparse for k, o in out.items()}
    assert read["weights"] == [1, 1] and read["ar"] == [1025, 1025]
    # the same pages, as one run or scattered: the same read, more of it at the head of a run
    assert read["contiguous"] == read["scattered"] and all(a < b for a, b in zip(sparse["contiguous"], sparse["scattered"]))
    assert all(s < f < 1025 for s, f in zip(read["scattered"], read["refresh"])) and read["draft"] == read["refresh"]
    assert [k for k, o in out.items() if o.captures] == ["draft"]  # only the draft keeps its page scores
    for slot in cell.slots:
        engine.free(slot)
    path = tmp_path / "parts.json"
    assert draft_parts.main(["--context", "1024", "--batch", "2", "--repeats", "2", "--threads", "1",
                             "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert set(res["ms"]) == set(draft_parts.KINDS) and min(res["ms"].values()) > 0
    assert sum(res["share_of_ar"].values()) == pytest.approx(res["c"])  # the parts add up to the draft step


def test_step_costs_measures_every_row_kind():
    engine = step_costs.make_engine("tiny", "float32", "cpu", "torch", seed=0)
    (r,) = step_costs.measure(engine, [512], batch=2, gamma=3, repeats=1, seed=0)
    assert set(r["ms"]) == set(step_costs.KINDS) and all(v > 0 for v in r["ms"].values())
    assert r["c_aspire"] == pytest.approx(r["ms"]["aspire"] / r["ms"]["ar"])
    assert set(r["split"]["ar"]) == {"attention_ms", "matmul_ms", "other_ms"}
    assert r["split"]["weights"]["matmul_ms"] > 0  # the compiled dense path's kernel calls are timed too
    from aspire_bench.kernels.cpu_dense import load_library
    assert engine.model._compiled._layer is load_library().aspire_dense_layer  # timing wrappers removed
    assert set(r["bound"]) == {str(a) for a in step_costs.ACCEPTANCES}
    assert sorted(r["v_by_gamma"]) == [0, 1, 2, 3] and r["v_by_gamma"][0] == 1.0


def test_step_costs_times_a_vegas_draft_when_asked(tmp_path, capsys):
    out = tmp_path / "costs.json"
    assert step_costs.main(["--contexts", "512", "--batch", "2", "--gamma", "2", "--repeats", "1", "--backend", "torch",
                            "--vegas", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert set(r["ms"]) == {*step_costs.KINDS, "vegas"} and r["c_vegas"] == pytest.approx(r["ms"]["vegas"] / r["ms"]["ar"])
    assert r["kv_positions_per_row"]["vegas"] == 256  # 5% of 512, at least 256
    assert set(r["split"]["vegas"]) == {"attention_ms", "matmul_ms", "other_ms"} and "vegas" in capsys.readouterr().out


def test_host_work_splits_a_runs_steps_by_section(tmp_path, capsys):
    out = tmp_path / "host.json"
    args = ["--threads", "1", "run", "--decoder", "aspire", "--context-len", "1k", "--limit", "2", "--batch-size", "2",
            "--max-new-tokens", "12", "--temperature", "0.7", "--top-k", "50", "--top-p", "0.9",
            "--store", str(tmp_path / "runs.db")]
    assert host_work.main(["--json", str(out), "--", *args]) == 0
    s = json.loads(out.read_text())
    assert s["steps"] > 0 and set(s["section_ms"]) == set(host_work.SECTIONS)
    assert s["step_ms"] == pytest.approx(s["forward_ms"] + s["outside_ms"])
    assert s["outside_ms"] == pytest.approx(sum(s["section_ms"].values()))
    assert all(s["section_ms"][k] > 0 for k in ("plan", "step_sampling", "verification"))  # sampled, speculative
    assert s["calls"]["plan"] == s["calls"]["step_sampling"] == s["steps"] and 0 < s["outside_share"] < 1
    from aspire_bench.kernels import cpu_sampling
    if cpu_sampling.load_library() is not None:  # all in the compiled call
        assert s["calls"]["distributions"] == s["calls"]["draft_draws"] == 0
    from aspire_bench.decoders import loop
    from aspire_bench.engine.engine import Engine
    assert loop.run_step.__name__ == "run_step" and Engine.forward.__name__ == "forward"  # timers removed
    assert "| plan |" in capsys.readouterr().out
    assert host_work.main([]) == 2  # no run to time: a one-line error


def test_host_work_times_pieces_cold_and_warm(tmp_path):
    out = tmp_path / "cold.json"
    assert host_work.main(["--cold", "--context", "512", "--batch", "2", "--rounds", "1", "--threads", "1",
                           "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "distributions of 15 rows" in res and all(r["cold_us"] > 0 and r["warm_us"] > 0 for r in res.values())


@pytest.mark.slow
def test_gpu_decoders_script_dry_run(tmp_path):
    """The GPU script's own code path on the CPU (compiled CPU backend, 1k): it must not first fail on a GPU."""
    out = tmp_path / "gpu"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_decoders.py"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    info = json.loads((out / "device.json").read_text())
    assert info["status"] == {"bench": "ok", "step_costs": "ok", "simulator": "ok"}
    pred = json.loads((out / "simulator_predictions.json").read_text())
    assert pred["profile"] == "cpu-measured"
    bench_rows = json.loads((out / "tiny_bench.json").read_text())
    # Every run through the roofline; through the calibration too when ASPIRE's fit was accepted (a fit
    # made under heavy load can be rejected, and then the script says so instead).
    by_costs = {k: {r["run_id"] for r in pred["runs"] if r["step_costs"] == k} for k in ("roofline", "calibration")}
    assert by_costs["roofline"] == {r["run_id"] for r in bench_rows}
    assert by_costs["calibration"] in (by_costs["roofline"], set())
    assert by_costs["calibration"] or "calibration replay skipped" in p.stdout
    assert all(r["simulated_decode_tok_s"] > 0 and r["measured_decode_tok_s"] > 0 for r in pred["runs"])
    assert {"ar", "verify", "aspire"} <= set(pred["step_costs"][0]["predicted_ms"])
    rows = bench_rows
    assert {(r["sampling"], r["decoder"]) for r in rows} == {
        (s, d) for s in ("greedy", "paper") for d in ("ar", "magicdec", "vegas", "aspire")}
    assert all(r["parity_identical_pct"] == 100.0 for r in rows if r["sampling"] == "greedy" and r["decoder"] != "ar")
