"""AR decode tok/s and achieved memory bandwidth on a CPU, against the machine's measured read rate.

    python -m benchmarks.ar_bandwidth --contexts 4096,16384,32768 --batches 1,8 --steps 8 --repeats 5 --threads 1

Per (context, batch) cell: a random-init model of the bundled shape, its KV pool filled with random
values (a step's work does not depend on them; `--kv-fill prefill` prefills instead), and the AR
policy's step through the decoder loop. Each repeat runs the step clean (tok/s, bytes read / step
time), instrumented (time in attention, in matmuls, the rest) and with attention stubbed out (a
cross-check), back to back so load from other processes hits them alike. The read rate is a
`torch.sum` over 1 GiB, measured again in every repeat. On a shared machine use `--threads 1`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as torch_F

from aspire_bench.decoders.ar import ARPolicy
from aspire_bench.decoders.base import Request, SamplingParams
from aspire_bench.decoders.loop import run_step
from aspire_bench.decoders.sampler import Sampler
from aspire_bench.decoders.state import RequestState
from aspire_bench.engine import Engine, Row
from aspire_bench.engine import model as model_module
from aspire_bench.harness.records import cpu_model

GiB = 1 << 30
GOAL_FRACTION = 0.5  # the target: full-attention decode at >= 50% of the measured read bandwidth

TINY_SHAPE = {
    "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 16,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
}


# --- machine -----------------------------------------------------------------------------------

def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up (page faults, thread pool)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure_memory_bandwidth(repeats: int, big_bytes: int = GiB, small_bytes: int = 64 << 20) -> dict:
    """Read bandwidth (bytes/s) by torch.sum over fp32 tensors; copy counted as read + write."""
    big = torch.empty(big_bytes // 4).uniform_()
    dst = torch.empty_like(big)
    small = torch.empty(small_bytes // 4).uniform_()
    return {
        "read_sum_1GiB": big_bytes / _median_time(big.sum, repeats),
        "copy_1GiB": 2 * big_bytes / _median_time(lambda: dst.copy_(big), repeats),
        "read_sum_64MiB": small_bytes / _median_time(small.sum, repeats * 4),
    }


# --- model -------------------------------------------------------------------------------------

def build_engine(tmpdir: str, max_positions: int, seed: int, backend: str = "auto",
                 model: str | None = None) -> Engine:
    """A random-init model of the bundled shape, or the checkpoint `model` names (e.g. smollm2-135m)."""
    if model:
        return Engine.from_pretrained(model, attention_backend=backend)
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(max_position_embeddings=max_positions, eos_token_id=0, pad_token_id=0, **TINY_SHAPE)
    Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(tmpdir)
    return Engine.from_pretrained(tmpdir, attention_backend=backend)


# --- instrumentation ---------------------------------------------------------------------------

class Timers:
    def __init__(self):
        self.attn = 0.0
        self.linear = 0.0

    def reset(self):
        self.attn = self.linear = 0.0


class TimedBackend:
    """Wraps an attention backend; accumulates wall time spent in `attend` (CPU ops are synchronous)."""

    def __init__(self, inner, timers: Timers):
        self.inner, self.timers, self.name = inner, timers, inner.name

    def attend(self, *args, **kw):
        t0 = time.perf_counter()
        r = self.inner.attend(*args, **kw)
        self.timers.attn += time.perf_counter() - t0
        return r


class StubBackend:
    """Attention that does no work: zeros of the query's shape (the step is otherwise identical)."""

    name = "stub"

    def attend(self, layer, q, k_cache, v_cache, meta):
        return torch.zeros_like(q), {}


def timed_functional(timers: Timers):
    """A stand-in for torch.nn.functional inside the model module whose `linear` is timed."""
    ns = types.SimpleNamespace()

    def linear(*args, **kw):
        t0 = time.perf_counter()
        r = torch_F.linear(*args, **kw)
        timers.linear += time.perf_counter() - t0
        return r

    for name in dir(torch_F):
        if not name.startswith("__"):
            setattr(ns, name, getattr(torch_F, name))
    ns.linear = linear
    return ns


# --- one cell ----------------------------------------------------------------------------------

def fill_pool_random(engine: Engine, capacity: int, seed: int) -> None:
    """Reserve the KV pool once for the largest cell and fill all of it with random values."""
    engine.reserve(capacity)
    g = torch.Generator().manual_seed(seed)
    engine.cache.k.uniform_(-2.0, 2.0, generator=g)
    engine.cache.v.uniform_(-2.0, 2.0, generator=g)


def fill_kv(engine: Engine, slots, context: int, mode: str, chunk: int, seed: int) -> None:
    cache = engine.cache
    if mode == "random":  # the pool already holds random values (fill_pool_random)
        for s in slots:
            s.length = context
        return
    # mode == "prefill": one real chunked prefill, its KV copied to the other slots
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, engine.cfg.vocab_size, (context,), generator=g).tolist()
    first = slots[0]
    for start in range(0, context, chunk):
        engine.forward([Row(first, ids[start:start + chunk], start, logits="none")])
    for s in slots[1:]:
        cache.k[:, :, s.base:s.base + context] = cache.k[:, :, first.base:first.base + context]
        cache.v[:, :, s.base:s.base + context] = cache.v[:, :, first.base:first.base + context]
        s.length = context


def run_cell(engine: Engine, context: int, batch: int, steps: int, warmup: int, repeats: int,
             kv_fill: str, seed: int, probe: torch.Tensor) -> dict:
    ps = engine.page_size
    per_slot = -(-(context + warmup + steps + 1) // ps) * ps
    engine.reserve(batch * per_slot)
    slots = [engine.alloc(per_slot) for _ in range(batch)]
    fill_kv(engine, slots, context, kv_fill, engine.prefill_chunk, seed)
    policy = ARPolicy(None, engine.page_size, engine.cfg.num_layers)
    params = SamplingParams()  # greedy, as the benches run AR
    states = []
    for i, s in enumerate(slots):
        req = Request(id=f"r{i}", prompt_ids=[1] * context, max_new_tokens=1 << 30)
        # context_len = C + 1, so the step's row starts at position C: it attends to C + 1 positions
        states.append(RequestState(index=i, req=req, slot=s, gen=None, out=[1 + i]))
    clock = time.perf_counter

    def reset():
        for st in states:
            engine.rollback(st.slot, context)
            del st.out[1:], st.times[:], st.margins[:]

    def run(n: int) -> list[float]:
        ts = []
        for _ in range(n):
            t0 = clock()
            run_step(engine, policy, Sampler(params), states, clock)
            ts.append(clock() - t0)
        return ts

    timers = Timers()
    real_backend = engine.backend
    timed = TimedBackend(real_backend, timers)
    timed_F = timed_functional(timers)
    clean, instr, stub, attn, linear, read_bw = [], [], [], [], [], []
    try:
        reset()
        run(warmup)
        for _ in range(repeats):
            # the machine's read bandwidth right now (load from other processes drifts)
            read_bw.append(probe.numel() * probe.element_size() / _median_time(probe.sum, 3))
            reset()
            clean.append(statistics.median(run(steps)))
            # instrumented: per-step attention and matmul times
            reset()
            engine.backend, model_module.F = timed, timed_F
            per_attn, per_lin, per_step = [], [], []
            for _ in range(steps):
                timers.reset()
                t0 = clock()
                run_step(engine, policy, Sampler(params), states, clock)
                per_step.append(clock() - t0)
                per_attn.append(timers.attn)
                per_lin.append(timers.linear)
            engine.backend, model_module.F = real_backend, torch_F
            instr.append(statistics.median(per_step))
            attn.append(statistics.median(per_attn))
            linear.append(statistics.median(per_lin))
            # attention stubbed
            reset()
            engine.backend = StubBackend()
            stub.append(statistics.median(run(steps)))
            engine.backend = real_backend
    finally:
        engine.backend, model_module.F = real_backend, torch_F
        for s in slots:
            engine.free(s)

    med = statistics.median
    step = med(clean)
    t_instr, t_attn, t_lin = med(instr), med(attn), med(linear)
    t_rest = max(t_instr - t_attn - t_lin, 0.0)
    kv_pos = context + 1 + (steps - 1) / 2  # mean positions attended per row over a repeat
    kv_bytes = batch * kv_pos * engine.cache.bytes_per_position
    w_bytes = engine.model.weight_bytes()
    local_bw = med(read_bw)
    return {
        "read_Bps_during_cell": local_bw, "read_Bps_repeats": read_bw,
        "fraction_of_read_bw": (w_bytes + kv_bytes) / step / local_bw,
        "attn_fraction_of_read_bw": kv_bytes / t_attn / local_bw if t_attn > 0 else None,
        "best_repeat_fraction_of_read_bw": max((w_bytes + kv_bytes) / t / bw
                                               for t, bw in zip(clean, read_bw)),
        "context": context, "batch": batch, "steps": steps, "repeats": repeats, "kv_fill": kv_fill,
        "step_s": step, "step_s_repeats": clean, "attn_s_repeats": attn, "stub_step_s_repeats": stub,
        "tokens_per_s": batch / step,
        "instrumented_step_s": t_instr, "attn_s": t_attn, "linear_s": t_lin, "rest_s": t_rest,
        "stub_step_s": med(stub), "attn_by_stub_s": max(step - med(stub), 0.0),
        "weight_bytes": w_bytes, "kv_bytes": kv_bytes, "bytes_per_step": w_bytes + kv_bytes,
        "achieved_Bps": (w_bytes + kv_bytes) / step,
        "attn_only_Bps": kv_bytes / t_attn if t_attn > 0 else None,
    }


# --- main --------------------------------------------------------------------------------------

def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=parse_ints, default=parse_ints("4096,16384,32768"),
                    help="comma-separated KV lengths each row holds before the first timed step")
    ap.add_argument("--batches", type=parse_ints, default=parse_ints("1,8"),
                    help="comma-separated batch sizes (rows per decode step)")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per repeat and variant")
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps per cell")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per cell; figures are medians over them")
    ap.add_argument("--bw-repeats", type=int, default=9, help="repeats of the memory-bandwidth probes")
    ap.add_argument("--kv-fill", choices=("random", "prefill"), default="random")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="auto", help="attention backend: auto | cpu | torch")
    ap.add_argument("--model", default=None,
                    help="a checkpoint (tiny, a name from `aspire-bench models`, a directory) instead of "
                         "a random-init model of the bundled shape")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    from rich.console import Console
    from rich.table import Table
    con = Console(stderr=False, width=max(Console().width, 150))
    log = Console(stderr=True)

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(x) for x in [sys.executable.rsplit("/", 1)[-1]] + sys.argv),
        "cpu": cpu_model(), "nproc": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
        "dtype": "float32",
        "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "MKL_", "KMP_", "GOMP_"))},
    }
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    log.print(f"[dim]{info['cpu']}, {info['nproc']} CPUs, torch {info['torch']} "
              f"({info['torch_threads']} threads); measuring memory bandwidth...[/dim]")
    bw = measure_memory_bandwidth(a.bw_repeats)
    probe = torch.empty(GiB // 4).uniform_()
    read_bw = bw["read_sum_1GiB"]
    log.print(f"[dim]read (sum, 1 GiB) {read_bw / 1e9:.1f} GB/s; copy {bw['copy_1GiB'] / 1e9:.1f} GB/s; "
              f"read (sum, 64 MiB) {bw['read_sum_64MiB'] / 1e9:.1f} GB/s[/dim]")

    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(tmp, max(a.contexts) + a.warmup + a.steps + 64, a.seed, a.backend, a.model)
        info["attention_backend"] = engine.backend.name
        info["model"] = a.model or "random-init, bundled shape"
        ps = engine.page_size
        per_slot = -(-(max(a.contexts) + a.warmup + a.steps + 1) // ps) * ps
        if a.kv_fill == "random":
            fill_pool_random(engine, max(a.batches) * per_slot, a.seed)
        for c in a.contexts:
            for b in a.batches:
                t0 = time.perf_counter()
                cell = run_cell(engine, c, b, a.steps, a.warmup, a.repeats, a.kv_fill, a.seed, probe)
                cells.append(cell)
                log.print(f"[dim]ctx {c} batch {b}: {cell['tokens_per_s']:.1f} tok/s, "
                          f"{cell['achieved_Bps'] / 1e9:.2f} GB/s of "
                          f"{cell['read_Bps_during_cell'] / 1e9:.2f} "
                          f"({time.perf_counter() - t0:.0f} s)[/dim]")
    try:
        info["loadavg_end"] = os.getloadavg()
    except OSError:
        pass

    t = Table(title=f"AR decode on CPU: {info['cpu']} ({info['nproc']} CPUs, "
                    f"{info['torch_threads']} torch threads); "
                    f"read bandwidth = torch.sum over 1 GiB fp32, {read_bw / 1e9:.1f} GB/s at start")
    for col in ("ctx", "batch", "tok/s", "step ms", "attn ms", "matmul ms", "rest ms", "no-attn ms",
                "MB/step", "GB/s", "read GB/s", "% read", "best %", "attn GB/s", "attn %"):
        t.add_column(col, justify="right")
    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.2f}"

    for r in cells:
        t.add_row(str(r["context"]), str(r["batch"]), f"{r['tokens_per_s']:.1f}", ms(r["step_s"]),
                  ms(r["attn_s"]), ms(r["linear_s"]), ms(r["rest_s"]), ms(r["stub_step_s"]),
                  f"{r['bytes_per_step'] / 1e6:.1f}", f"{r['achieved_Bps'] / 1e9:.2f}",
                  f"{r['read_Bps_during_cell'] / 1e9:.2f}", f"{100 * r['fraction_of_read_bw']:.0f}%",
                  f"{100 * r['best_repeat_fraction_of_read_bw']:.0f}%",
                  f"{r['attn_only_Bps'] / 1e9:.2f}", f"{100 * r['attn_fraction_of_read_bw']:.0f}%")
    con.print(t)
    reached = [r for r in cells if r["fraction_of_read_bw"] >= GOAL_FRACTION]
    con.print(f"goal (decode >= {GOAL_FRACTION:.0%} of read bandwidth): reached in {len(reached)} of "
              f"{len(cells)} cells" + (": " + ", ".join(f"ctx {r['context']} batch {r['batch']}"
                                                          for r in reached) if reached else ""))
    con.print("[dim]Medians over repeats of per-repeat median step times. attn/matmul/rest: the instrumented "
              "run (attend and F.linear timed); no-attn: attention stubbed. read GB/s: torch.sum over 1 GiB "
              "measured within each repeat of the cell; % read = GB/s / read GB/s; best %: the best repeat; "
              "attn GB/s: KV bytes / time in attend. On a shared machine these are noisy.[/dim]")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"info": info, "memory_bandwidth_Bps": bw,
                                      "goal_fraction": GOAL_FRACTION,
                                      "cells": cells}, indent=2))
        log.print(f"[dim]wrote {a.json}[/dim]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
