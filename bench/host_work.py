"""The host work of a decode step: where a step's time outside the engine's forward goes.

Two measurements:

    python bench/host_work.py [--json PATH] -- --threads 2 run --decoder aspire --context-len 16k \\
        --limit 8 --batch-size 8 --max-new-tokens 96 --temperature 0.7 --top-k 50 --top-p 0.9

runs `aspire-bench` with the arguments after `--` and splits every decode step's wall time into the
engine's forward and the host work around it, by section: the policy's plan, the step's compiled
sampling (distributions, draws and acceptance of every row in one call, where it applies), else the
per-row path's sampling distributions (one batched call) and draft draws, verification (acceptance
unless compiled, KV rollback, commit), the
policy's bookkeeping (observe, scores, step_done) and the rest of the loop (row building, traces).
Timers wrap each section (a few microseconds per call, ~0.3 ms per step at 16k x 8 after a forward), so
the total is above an unwrapped run's; `--total-only` times the forward and the whole step alone.

    python bench/host_work.py --cold [--context 16384 --batch 8]

times pieces of that host work (page selection, the distributions of 15 rows, uniforms, draws) right
after an AR step over `batch` rows of `context` random keys, and again at once (warm): after a step
that streams its KV through the caches, host code and data come back from memory.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

SECTIONS = ("plan", "step_sampling", "distributions", "draft_draws", "verification", "bookkeeping", "rest")


class StepTimers:
    """Wall-clock time per section of the decoding loop's steps (decoders/loop.py), installed by patching."""

    def __init__(self, sections: bool = True):
        """sections=False: the forward and the step only (no per-section timers, nothing added)."""
        self.sectioned = sections
        self.t = defaultdict(float)
        self.calls = Counter()
        self.steps = 0
        self._in_step = False
        self._undo = []
        self._timed_policies = set()  # ids of the policies whose methods are wrapped

    def _wrap(self, owner, name: str, key: str):
        real = getattr(owner, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                if self._in_step:
                    self.t[key] += time.perf_counter() - t0
                    self.calls[key] += 1
        setattr(owner, name, timed)
        self._undo.append((owner, name, real))

    def install(self):
        from aspire_bench.decoders import loop
        from aspire_bench.engine import engine
        self._wrap(engine.Engine, "forward", "forward")
        if self.sectioned:
            self._sections()
        real_step = loop.run_step

        def step(engine_, policy, *a, **k):
            if self.sectioned and id(policy) not in self._timed_policies:  # its methods, once per instance
                for name, key in (("plan", "plan"), ("observe", "bookkeeping"), ("scores", "bookkeeping"),
                                  ("step_done", "bookkeeping")):
                    self._wrap(policy, name, key)
                self._timed_policies.add(id(policy))
            self._in_step = True
            t0 = time.perf_counter()
            try:
                return real_step(engine_, policy, *a, **k)
            finally:
                self.t["step"] += time.perf_counter() - t0
                self.steps += 1
                self._in_step = False
        loop.run_step = step
        self._undo.append((loop, "run_step", real_step))
        return self

    def _sections(self):
        from aspire_bench.decoders import loop
        from aspire_bench.decoders.sampler import Sampler
        self._wrap(Sampler, "_step_compiled", "step_sampling")
        self._wrap(Sampler, "_batch_probs", "distributions")
        self._wrap(Sampler, "draft", "draft_draws")
        self._wrap(Sampler, "sample", "draft_draws")  # an AR row's draw (DECODE)
        self._wrap(Sampler, "verify", "verification")
        self._wrap(loop, "finish_verify", "verification")

    def uninstall(self):
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)
        self._undo.clear()

    def summary(self) -> dict:
        n = max(self.steps, 1)
        outside = self.t["step"] - self.t["forward"]
        res = {"steps": self.steps, "step_ms": self.t["step"] / n * 1e3, "forward_ms": self.t["forward"] / n * 1e3,
               "outside_ms": outside / n * 1e3, "outside_share": outside / self.t["step"] if self.t["step"] else 0.0}
        if self.sectioned:
            ms = {k: self.t[k] / n * 1e3 for k in SECTIONS[:-1]}
            ms["rest"] = outside / n * 1e3 - sum(ms.values())
            res.update(section_ms=ms, calls={k: self.calls[k] for k in SECTIONS[:-1]})
        return res


def print_split(s: dict) -> None:
    print(f"{s['steps']} steps: {s['step_ms']:.2f} ms per step, forward {s['forward_ms']:.2f} ms, "
          f"outside {s['outside_ms']:.3f} ms ({100 * s['outside_share']:.1f}%)")
    if "section_ms" not in s:
        return
    print("| section | ms per step | calls |\n|---|---:|---:|")
    for k in SECTIONS:
        print(f"| {k} | {s['section_ms'][k]:.3f} | {s['calls'].get(k, '')} |")


def cold_warm(context: int, batch: int, rounds: int) -> dict:
    """Median µs of each piece right after an AR step (cold) and repeated at once (warm)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_costs import make_engine

    from aspire_bench.decoders.selection import MIN_PAGES, PAGE_RATIO, RECENT_PAGES, page_budget, select_pages
    from aspire_bench.harness.step_costs import Cell
    from aspire_bench.kernels.cpu_sampling import draw, top_k_probs
    engine = make_engine("tiny", "float32", "cpu", "auto", 0)
    cell = Cell(engine, context, batch, 3, 0)
    vocab = engine.cfg.vocab_size
    logits = torch.randn(15, vocab)  # a step's rows at 16k x 8: ~4 drafts and ~3 verifications of 4 tokens
    probs = top_k_probs(logits, 0.7, 50, 0.9)
    n_pages = -(-context // engine.page_size)
    budget = page_budget(n_pages, PAGE_RATIO, MIN_PAGES)
    scores = torch.rand(n_pages)
    gen = torch.Generator().manual_seed(0)
    pieces = {
        "select_pages x1": lambda: select_pages(scores, n_pages, budget, RECENT_PAGES),
        "select_pages x4": lambda: [select_pages(scores, n_pages, budget, RECENT_PAGES) for _ in range(4)],
        "distributions of 15 rows": lambda: top_k_probs(logits, 0.7, 50, 0.9),
        "8 uniforms": lambda: [torch.rand(1, generator=gen) for _ in range(8)],
        "8 draws": lambda: [draw(probs[i], 0.5) for i in range(8)],
        "nothing": lambda: None,
    }
    cold, warm = defaultdict(list), defaultdict(list)
    for r in range(rounds + 2):
        for name, fn in pieces.items():
            cell.step("ar")
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            fn()
            t2 = time.perf_counter()
            if r >= 2:  # the first rounds warm up builds and allocators
                cold[name].append(t1 - t0)
                warm[name].append(t2 - t1)
    cell.close()
    return {name: {"cold_us": statistics.median(cold[name]) * 1e6, "warm_us": statistics.median(warm[name]) * 1e6}
            for name in pieces}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cold", action="store_true", help="time host pieces right after an AR step and again warm")
    ap.add_argument("--total-only", action="store_true",
                    help="time only the forward and the whole step (no section timers: the share unperturbed)")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2, help="threads for --cold (a run takes aspire-bench's --threads)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(own)
    if a.cold:
        torch.set_num_threads(a.threads)
        res = cold_warm(a.context, a.batch, a.rounds)
        print(f"after an AR step at {a.context} x {a.batch}, {a.threads} threads (median of {a.rounds})")
        print("| piece | cold µs | warm µs | cold / warm |\n|---|---:|---:|---:|")
        for name, r in res.items():
            print(f"| {name} | {r['cold_us']:.1f} | {r['warm_us']:.1f} | {r['cold_us'] / max(r['warm_us'], 1e-9):.1f} |")
    else:
        if not run_args:
            print("error: give the aspire-bench arguments after --, e.g. -- --threads 2 run --decoder aspire "
                  "--context-len 16k --limit 8 --batch-size 8", file=sys.stderr)
            return 2
        from aspire_bench.cli import main as cli_main
        timers = StepTimers(sections=not a.total_only).install()
        try:
            cli_main.main(args=run_args, prog_name="aspire-bench")
            rc = 0
        except SystemExit as e:  # click's way of returning; bad arguments: its one-line error and 2
            rc = e.code if isinstance(e.code, int) else 1
        finally:
            timers.uninstall()
        if rc:
            return rc
        res = timers.summary()
        print_split(res)
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
