"""Per-step cost of each kind of decoder row on the real engine, and the speedup those costs allow.

    python -m benchmarks.step_costs --shape tiny --contexts 16384,32768 --batch 8 --threads 2
    python -m benchmarks.step_costs --shape qwen3-1.7b --device cuda --backend triton --dtype bfloat16

Rows (B of one kind per forward): `weights` (no KV), `ar`, `aspire` (ASPIRE's draft view), `window`
(MagicDec's), `vegas` (with --vegas), `verify` (G + 1 tokens, also 2..G). Prints c = draft / AR,
v(gamma) = verify / AR, the CPU split into attention / matmuls / rest, and the best speedup
max_gamma E(a, gamma) / (gamma c + v(gamma)) at a range of acceptances a (docs/performance.md). The
measuring is aspire_bench/harness/step_costs.py, as `aspire-bench bench` uses it; the KV is random.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from aspire_bench.engine import Engine, load_model
from aspire_bench.engine import dense as dense_module
from aspire_bench.engine import model as model_module
from aspire_bench.engine.loading import random_model
from aspire_bench.harness.step_costs import KINDS, Cell, best_speedup, measure_cell, timed  # noqa: F401
from aspire_bench.tinymodel import TINY_DIR
from benchmarks.ar_bandwidth import TimedBackend, Timers, timed_functional

SHAPES = {
    "tiny": json.loads((TINY_DIR / "config.json").read_text()),  # the bundled model's shape
    "qwen3-1.7b": {  # Qwen/Qwen3-1.7B's config.json (shape only)
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 65536,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    },
}
ACCEPTANCES = (0.5, 0.6, 0.7, 0.8, 0.9)


def make_engine(shape: str, dtype: str, device: str, backend: str, seed: int, dense: str = "auto") -> Engine:
    # Named shapes get random weights: a step's work does not depend on them.
    model = random_model(SHAPES[shape], dtype, device, seed) if shape in SHAPES else load_model(shape, dtype, device)
    return Engine(model, None, backend, name=shape, dense_backend=dense)


def split(cell: Cell, kind: str, repeats: int) -> dict:
    """CPU only: time in attention and in matmuls of one step (median over repeats)."""
    engine, timers = cell.engine, Timers()
    real_backend, real_F, real_proj = engine.backend, model_module.F, dense_module.Proj.__call__

    def timed_proj(self, *args, **kw):  # the fused path's projections (engine/dense.py)
        t0 = time.perf_counter()
        r = real_proj(self, *args, **kw)
        timers.linear += time.perf_counter() - t0
        return r

    compiled = engine.model._compiled if engine.dense_backend == "cpp" else None

    def timed_call(fn):  # the compiled path's kernel calls: all of a layer's dense work, norms and RoPE included
        def call(*args):
            t0 = time.perf_counter()
            r = fn(*args)
            timers.linear += time.perf_counter() - t0
            return r
        return call

    engine.backend, model_module.F = TimedBackend(real_backend, timers), timed_functional(timers)
    dense_module.Proj.__call__ = timed_proj
    if compiled:
        real_kernels = compiled._layer_fn, compiled._head
        compiled._layer_fn, compiled._head = timed_call(compiled._layer_fn), timed_call(compiled._head)
    attn, lin = [], []
    try:
        cell.step(kind)
        for _ in range(repeats):
            timers.reset()
            cell.step(kind)
            attn.append(timers.attn)
            lin.append(timers.linear)
    finally:
        engine.backend, model_module.F, dense_module.Proj.__call__ = real_backend, real_F, real_proj
        if compiled:
            compiled._layer_fn, compiled._head = real_kernels
    return {"attention_ms": statistics.median(attn) * 1e3, "matmul_ms": statistics.median(lin) * 1e3}


def measure(engine: Engine, contexts, batch: int, gamma: int, repeats: int, seed: int, kinds=KINDS) -> list[dict]:
    cuda = engine.device.type == "cuda"
    out = []
    for C in contexts:
        def add_split(cell, res):  # CPU ops are synchronous, so wall-clock wrappers split a step honestly
            res["split"] = {}
            if cuda:
                return
            for kind in kinds:
                s = split(cell, kind, repeats)
                s["other_ms"] = res["ms"][kind] - s["attention_ms"] - s["matmul_ms"]
                res["split"][kind] = s
        res = measure_cell(engine, C, batch, gamma, repeats, seed, kinds, add_split)
        for kind in kinds:
            print(f"  {C:>6} x{batch} {kind:8s} {res['ms'][kind]:9.2f} ms", flush=True)
        res["bound"] = {str(a): dict(zip(("speedup", "gamma"), best_speedup(res["c_aspire"], res["v_by_gamma"], a)))
                        for a in ACCEPTANCES}
        out.append(res)
    return out


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table
    kinds = list(results[0]["ms"]) if results else list(KINDS)
    drafts = [k for k in ("aspire", "window", "vegas") if k in kinds]
    t = Table(title="step costs: ms per forward of B rows; c = draft / ar, v(g) = verify of g+1 tokens / ar")
    for col in ("context", *kinds, *(f"c {k}" for k in drafts), "v(1..G)"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(str(r["context"]), *(f"{r['ms'][k]:.1f}" for k in kinds), *(f"{r[f'c_{k}']:.3f}" for k in drafts),
                  " ".join(f"{v:.2f}" for g, v in sorted(r["v_by_gamma"].items()) if g))
    Console().print(t)
    t = Table(title="best speedup over AR these costs allow (gamma), per-token acceptance a")
    for col in ("context", *(f"a={a}" for a in ACCEPTANCES)):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(str(r["context"]), *(f"{r['bound'][str(a)]['speedup']:.2f} ({r['bound'][str(a)]['gamma']})"
                                       for a in ACCEPTANCES))
    Console().print(t)
    if results and results[0]["split"]:
        t = Table(title="where a step's time goes (ms): attention / matmuls / rest")
        t.add_column("context", justify="right")
        for k in kinds:
            t.add_column(k, justify="right")
        for r in results:
            t.add_row(str(r["context"]), *(
                f"{r['split'][k]['attention_ms']:.1f} / {r['split'][k]['matmul_ms']:.1f} / "
                f"{r['split'][k]['other_ms']:.1f}" for k in kinds))
        Console().print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny", help=f"{' | '.join(SHAPES)} | a checkpoint directory")
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gamma", type=int, default=6, help="longest draft a verify row checks (verify = gamma + 1)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto", help="attention backend: auto | cpu | torch | triton")
    ap.add_argument("--dense-backend", default="auto", help="dense part of a layer: auto | cpp | fused | eager")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall clock, or process CPU time (meaningful at --threads 1 on a shared machine)")
    ap.add_argument("--vegas", action="store_true", help="also time a Vegas-sized draft (c_vegas)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.clock == "cpu":  # every timer of this process (the harness's too) reads process CPU time
        time.perf_counter = time.process_time
    if a.threads:
        torch.set_num_threads(a.threads)
    engine = make_engine(a.shape, a.dtype, a.device, a.backend, a.seed, a.dense_backend)
    kinds = (*KINDS, "vegas") if a.vegas else KINDS
    results = measure(engine, [int(c) for c in a.contexts.split(",")], a.batch, a.gamma, a.repeats, a.seed, kinds)
    print_table(results)
    if a.json:
        meta = {"shape": a.shape, "dtype": a.dtype, "clock": a.clock, "device": a.device, "backend": engine.backend.name,
                "dense_backend": engine.dense_backend,
                "threads": torch.get_num_threads(), "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None}
        a.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
