"""The supported benchmark scripts under benchmarks/: their arithmetic, and that they run end to end."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import step_costs

ROOT = Path(__file__).resolve().parents[2]


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
    # every draft accepted: g + 1 tokens a cycle (the limit of the closed form, not a division by zero)
    assert step_costs.best_speedup(0.1, v, 1.0) == (pytest.approx(9 / (0.8 + v[8])), 8)
    assert step_costs.best_speedup(0.1, v, 1.0)[0] > step_costs.best_speedup(0.1, v, 0.999)[0]








def test_step_costs_measures_every_row_kind():
    engine = step_costs.make_engine("tiny", "float32", "cpu", "torch", seed=0)
    (r,) = step_costs.measure(engine, [512], batch=2, gamma=3, repeats=1, seed=0)
    assert set(r["ms"]) == set(step_costs.KINDS) and all(v > 0 for v in r["ms"].values())
    assert r["c_aspire"] == pytest.approx(r["ms"]["aspire"] / r["ms"]["ar"])
    assert set(r["split"]["ar"]) == {"attention_ms", "matmul_ms", "other_ms"}
    assert r["split"]["weights"]["matmul_ms"] > 0  # the compiled dense path's kernel calls are timed too
    from aspire_bench.kernels.cpu_dense import load_library
    lib = load_library()  # timing wrappers removed
    compiled = engine.model._compiled
    assert (compiled._layer_fn, compiled._head) == (lib.aspire_dense_layer, lib.aspire_dense_head)
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




@pytest.mark.slow
def test_gpu_decoders_script_dry_run(tmp_path):
    """The GPU script's own code path on the CPU (compiled CPU backend, 1k): it must not first fail on a GPU."""
    out = tmp_path / "gpu"
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_decoders", "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
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


@pytest.mark.slow
def test_gpu_kernels_script_cpu_smoke(tmp_path):
    """The GPU kernel script end to end on the CPU through Triton's interpreter at tiny shapes: its
    correctness checks, sweep, score cost and tuning all run, so the first GPU run does not fail on
    the script itself."""
    out = tmp_path / "kernels.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_kernels", "--cpu-smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["checks"] and all(c["ok"] for c in report["checks"])
    assert len(report["checks"]) >= 10 and report["shape"]["dtype"] == "fp32"
    assert {(r["view"], r["queries"]) for r in report["sweep"]} == {("full", 1), ("full", 9), ("7%", 1), ("7%", 9)}
    assert all(r["triton_ms"] > 0 and r["torch_ms"] > 0 for r in report["sweep"])
    assert {r["queries"] for r in report["scores"]} == {1, 9} and report["tune"]


def test_prefill_vs_transformers_times_both_on_one_prompt(tmp_path):
    from benchmarks import prefill_vs_transformers as pvt
    out = tmp_path / "prefill.json"
    assert pvt.main(["--model", "tiny", "--context", "300", "--repeats", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["context"] == 300 and len(r["engine_s"]) == len(r["transformers_s"]) == 2
    assert all(t > 0 for t in r["engine_s"] + r["transformers_s"])
    assert r["speed_ratio"] == pytest.approx(r["transformers_median_s"] / r["engine_median_s"])


def test_prefill_vs_transformers_engine_prefill_fills_the_kv_as_transformers_does():
    # the timed engine path is a real prefill: its last position's KV equals transformers' cache
    from transformers import AutoModelForCausalLM

    from aspire_bench.engine import Engine
    from aspire_bench.engine.loading import resolve_model_path
    from benchmarks import prefill_vs_transformers as pvt
    engine = Engine.from_pretrained("tiny", prefill_chunk=64)
    ids = torch.randint(1, engine.cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(1))
    engine.reserve(256)
    slot = engine.alloc(151)
    for start in range(0, 150, 64):
        engine.forward([pvt.Row(slot, ids[start:start + 64].tolist(), start, logits="none")])
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny"), dtype=torch.float32).eval()
    with torch.inference_mode():
        kv = hf(input_ids=ids[None], use_cache=True).past_key_values
    k_hf = kv.layers[0].keys[0] if hasattr(kv, "layers") else kv[0][0][0]
    k_ours = engine.cache.k[0, :, slot.base:slot.base + 150]
    assert torch.allclose(k_ours.float(), k_hf.float(), atol=1e-4)
    assert pvt.engine_prefill(engine, ids.tolist()) > 0


def test_ar_bandwidth_loads_a_named_checkpoint(tmp_path):

    from aspire_bench.engine import Engine
    from benchmarks import ar_bandwidth
    ours = ar_bandwidth.build_engine(str(tmp_path), 512, 0, "torch", model="tiny")
    bundled = Engine.from_pretrained("tiny")
    assert ours.model.weight_bytes() == bundled.model.weight_bytes()
    assert torch.equal(ours.model.lm_head, bundled.model.lm_head)


def test_measure_hardware_writes_a_cpu_profile_the_simulator_loads(tmp_path, monkeypatch):
    from functools import partial

    from aspire_bench.simulator.costs import Hardware
    from benchmarks import measure_hardware as mh
    monkeypatch.setattr(mh, "read_bandwidth_gbs", partial(mh.read_bandwidth_gbs, 1 << 22))  # small and quick
    monkeypatch.setattr(mh, "matmul_tflops", partial(mh.matmul_tflops, n=128))
    out = tmp_path / "cpu.json"
    assert mh.main(["--out", str(out)]) == 0
    hw = Hardware.load(str(out))
    assert not hw.overlap  # a CPU core reads and computes in turn
    assert hw.memory_bw_gbs > 0 and set(hw.tflops) == {"float32", "bfloat16"} and hw.step_overhead_us >= 0
