"""Per-step costs of each kind of decoder row, measured on the real engine: c and v(gamma).

A speculative decoder's speedup over AR is bounded by E[tokens per cycle] / (gamma * c + v(gamma)),
with c = draft step / AR step and v(gamma) = verify step of gamma + 1 tokens / AR step (v(0) = 1: a
1-token verify is an AR step). `measure_cell` times one forward over B rows of each kind at context C
(weights, ar, aspire, window, vegas, verify; host drafts cost 0; own: a draft model's AR step) on random
KV: values do not change a step's work, and a prefill would cost C tokens per row. A decoder's
`draft_kind` trait names the kind its draft rows resemble (c_<kind>); a kind not timed here has no c.
The kinds: docs/metrics.md, "The bound"; benchmarks/step_costs.py is the command-line front end.
"""
from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from ..decoders import decoder_class
from ..decoders.scheduler import expected_tokens
from ..decoders.selection import (
    MIN_PAGES,
    PAGE_RATIO,
    RECENT_PAGES,
    page_budget,
    random_pages,
    streaming_positions,
    token_budget,
)
from ..engine import Capture, Engine, PageView, Row, TokenView

KINDS = ("weights", "ar", "aspire", "window", "verify")
TIMED_DRAFTS = ("aspire", "window", "vegas")  # the draft rows a Cell builds (c_<kind>)


class Cell:
    """B slots of C positions (random KV) and the rows of each kind."""

    def __init__(self, engine: Engine, context: int, batch: int, gamma: int, seed: int):
        """gamma: the longest draft a verify row checks (G)."""
        self.engine, self.C, self.gamma = engine, context, gamma
        ps = engine.page_size
        per_slot = -(-(context + gamma + 1) // ps) * ps
        engine.reserve(batch * per_slot)
        engine.cache.k.uniform_(-2.0, 2.0)
        engine.cache.v.uniform_(-2.0, 2.0)
        self.slots = [engine.alloc(per_slot) for _ in range(batch)]
        n_pages = -(-context // ps)
        budget, recent = page_budget(n_pages, PAGE_RATIO, MIN_PAGES), RECENT_PAGES
        g = torch.Generator().manual_seed(seed)
        self.pages = [random_pages(n_pages, budget, recent, g) for _ in self.slots]
        window = decoder_class("magicdec").Settings()  # the decoders' own defaults
        self.window = streaming_positions(context, window.sinks, window.budget)
        vegas = decoder_class("vegas").Settings()
        n_vegas = token_budget(context, vegas.ratio, vegas.min_tokens)
        self.vegas = torch.randperm(context, generator=g)[:n_vegas].sort().values
        self.refresh = engine.cfg.num_layers - 2
        self.kv_positions = {"weights": 0, "ar": context, "verify": context, "window": min(context, window.budget),
                             "vegas": n_vegas,
                             "aspire": budget * ps * (engine.cfg.num_layers - 1) / engine.cfg.num_layers
                             + context / engine.cfg.num_layers}

    def rows(self, kind: str, gamma: int | None = None) -> list[Row]:
        C, rs = self.C, []
        gamma = self.gamma if gamma is None else gamma
        for i, s in enumerate(self.slots):
            s.length = C
            if kind == "weights":
                rs.append(Row(s, [5], 0))
            elif kind == "ar":
                rs.append(Row(s, [5], C))
            elif kind == "verify":
                rs.append(Row(s, [5] * (gamma + 1), C, logits="all"))
            elif kind == "aspire":
                rs.append(Row(s, [5], C, view=PageView(self.pages[i]), full_layers=frozenset({self.refresh}),
                              capture=Capture([self.refresh], [-1])))
            elif kind == "window":
                rs.append(Row(s, [5], C, view=TokenView(self.window)))
            elif kind == "vegas":
                rs.append(Row(s, [5], C, view=TokenView(self.vegas)))
        return rs

    def step(self, kind: str, gamma: int | None = None) -> None:
        self.engine.forward(self.rows(kind, gamma))

    def close(self) -> None:
        for s in self.slots:
            self.engine.free(s)


def timed(fn, repeats: int, sync) -> float:
    """Median wall seconds of fn over repeats, after one untimed call."""
    return timed_interleaved({0: fn}, repeats, sync)[0]


def timed_interleaved(fns: dict, repeats: int, sync) -> dict:
    """Median wall seconds of each fn over repeats. The kinds take turns (one round of each per repeat),
    so a drift in the machine's speed during the measurement (on a shared VM, memory bandwidth moves
    within minutes) shifts every kind alike and the ratios between kinds stay put. Each
    timed call follows an untimed call of the same kind: the caches hold what a run of such steps
    leaves there (a decoder's draft steps come in runs), not what the previous kind left."""
    ts = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            fn()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts[key].append(time.perf_counter() - t0)
    return {key: statistics.median(v) for key, v in ts.items()}


def timed_cold_rounds(engine: Engine, rows_of, kinds, repeats: int, rng: random.Random) -> tuple[dict, dict]:
    """(wall seconds of each round's forward of rows_of(kind), in round order, and that kind's last timed
    output) per kind, as a decoding step meets its KV: rounds over the kinds in a fresh random order
    (the first a warm-up, not kept), each timed forward after an untimed one of the same rows and a
    read of twice the last-level cache, so that it finds neither its KV nor the weights in cache.
    Progress on stderr."""
    from ..decoders.calibration import last_level_cache_bytes
    flush = torch.empty(2 * last_level_cache_bytes(engine.device) // 4, device=engine.device).fill_(1.0)
    times, outs = {k: [] for k in kinds}, {}
    for rnd in range(repeats + 1):
        order = list(kinds)
        rng.shuffle(order)
        for kind in order:
            rows = rows_of(kind)
            for timed_now in (False, True):
                for r in rows:  # the forward moved each slot past the row's tokens
                    r.slot.length = r.start
                if timed_now:
                    flush.sum().item()
                t0 = time.perf_counter()
                out = engine.forward(rows)
                if timed_now and rnd:
                    times[kind].append(time.perf_counter() - t0)
                    outs[kind] = out
        print(f"round {rnd}/{repeats}", end="\r", file=sys.stderr, flush=True)
    return times, outs


def timed_cold(engine: Engine, rows_of, kinds, repeats: int, rng: random.Random) -> tuple[dict, dict]:
    """(median wall seconds of a forward of rows_of(kind), that kind's last timed output) per kind,
    timed as timed_cold_rounds does."""
    times, outs = timed_cold_rounds(engine, rows_of, kinds, repeats, rng)
    return {k: statistics.median(v) for k, v in times.items()}, outs


def best_speedup(c: float, v: dict[int, float], a: float) -> tuple[float, int]:
    """max over gamma of E[tokens per cycle] / (gamma c + v[gamma]), E = (1 - a^(g+1)) / (1 - a) (g + 1
    at a = 1: every draft accepted)."""
    return max((expected_tokens(a, g) / (g * c + vg), g) for g, vg in sorted(v.items()))


def sync_for(engine: Engine):
    return torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)


def measure_cell(engine: Engine, context: int, batch: int, gamma: int, repeats: int, seed: int = 0,
                 kinds=KINDS, cell_hook=None, gammas=None, host=(), own=None) -> dict:
    """ms per forward of each kind, c per draft kind (c_aspire, c_window, c_vegas) and v_by_gamma for
    one (context, batch): at 0..gamma, or at 0, the given gammas and gamma when gammas is given.
    host: draft kinds without a forward (c = 0); own: {draft kind: engine} timed as that engine's AR
    step. cell_hook(cell, res) runs before the slots are freed."""
    sync = sync_for(engine)
    cell, others = Cell(engine, context, batch, gamma, seed), {}
    try:
        for kind, e in (own or {}).items():
            others[kind] = Cell(e, context, batch, 0, seed)
        res = {"context": context, "batch": batch, "gamma": gamma, "ms": {}}
        todo = range(1, gamma) if gammas is None else sorted({g for g in gammas if 0 < g < gamma})
        fns = {kind: (lambda k=kind: cell.step(k)) for kind in kinds}
        fns.update({kind: (lambda c=c: c.step("ar")) for kind, c in others.items()})
        fns.update({("verify", g): (lambda g=g: cell.step("verify", g)) for g in todo})
        ms = {key: t * 1e3 for key, t in timed_interleaved(fns, repeats, sync).items()}
        res["ms"] = {kind: ms[kind] for kind in [*kinds, *others]}
        ar = res["ms"]["ar"]
        for kind in [*TIMED_DRAFTS, *others]:
            if kind in res["ms"]:
                res[f"c_{kind}"] = res["ms"][kind] / ar
        res.update({f"c_{kind}": 0.0 for kind in host})
        res["v"] = res["ms"]["verify"] / ar
        verify_ms = {g: ms[("verify", g)] for g in todo}
        verify_ms[gamma] = res["ms"]["verify"]
        res["v_by_gamma"] = {0: 1.0, **{g: t / ar for g, t in verify_ms.items()}}
        res["kv_positions_per_row"] = {k: v for k, v in cell.kv_positions.items() if k in kinds}
        if cell_hook is not None:
            cell_hook(cell, res)
        return res
    finally:
        cell.close()
        for c in others.values():
            c.close()
