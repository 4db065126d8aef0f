"""Cost-model calibration: time real mixed steps over a grid of batch compositions, fit the betas.

The fit is what ASPIRE's scheduler uses for c_i (see scheduler.CostModel). A calibration is stored
per model / device / dtype / attention and dense backend / page size / batch size / version of the
engine's and kernels' code with its timing samples, so
that each variant of the cost model (with or without the query x KV term) is refitted from the same
samples, and a run can replay it exactly.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..atomic import write_text
from ..engine import PAGE_MAX_SUM, TOKEN_MEAN, Capture, Engine, LayerTokenView, PageView, Row, TokenView
from ..errors import ConfigError
from .base import DECODE, DRAFT, PAPER_SAMPLING, VERIFY
from .loop import shaped_reads
from .magicdec import MagicDecSettings
from .sampler import Sampler, logits_to_probs
from .scheduler import DEFAULT_COST, SHAPED_TERMS, CostModel, CostSample, fit_cost_model, fit_problem, qk_term
from .selection import (
    MIN_PAGES,
    PAGE_RATIO,
    RECENT_PAGES,
    page_budget,
    random_pages,
    random_tokens,
    select_pages,
    streaming_positions,
    token_budget,
    top_tokens,
)
from .state import RequestState
from .vegas import VegasSettings

# The shortest context a run's automatic calibration is timed at: shorter steps are mostly fixed cost,
# and the grid at 4k takes seconds.
CALIBRATION_CONTEXT = 4096
# The grid's window rows: MagicDec's default sink + window view (sinks, positions in all).
WINDOW = (MagicDecSettings.sinks, MagicDecSettings.budget)
# The grid's verify rows: these numbers of drafts (+ 1 tokens). Every count up to 4 because that is
# where decoders verify most and where a CPU kernel changes method (a step in the cost, not a slope).
DRAFTS = (1, 2, 3, 4, 8, 16)
# The grid's Vegas verifications (beta_topk): these numbers of drafts, around its default gamma.
VEGAS_DRAFTS = (2, 8)
# The grid's Vegas drafts (beta_layered): one step for each of these numbers of positions its views add
# to each layer's selection (those written since its verification), as across a cycle of drafts. Cheap
# steps, and several, since a draft's share of the step is small next to a timing's noise.
VEGAS_SINCE = (1, 3, 5)


# A calibration's coefficients (scheduler.CostModel): the three every fit has, and the terms a CPU adds.
REQUIRED_TERMS = ("beta0", "beta_tok", "beta_attn")
OPTIONAL_TERMS = ("beta_qk", "beta_sparse", "beta_multi", "beta_capture", *SHAPED_TERMS)
# What save_calibration adds to a calibration file: the engine it was timed on.
ENGINE_KEYS = ("model", "device", "dtype", "backend", "page_size")
# A calibration's own entries in its JSON beside the cost model's coefficients (written only when set).
_OPTIONAL = ("r2_train", "heldout_rel_err_median", "heldout_rel_err_max", "rounds", "batch_size", "context")


@dataclass(frozen=True)
class Calibration:
    """A fitted calibration (calibrate, pooled_calibration): the cost model fitted on all its timing
    samples, and how well it fits. Stored as JSON (to_json/from_json) in a calibration file and in a
    bench run's info (adjacent_calibration, interleaved_calibration)."""
    fit: CostModel | None  # None only for a file of samples alone (fitted when used: cost_model_from)
    samples: tuple[CostSample, ...] = ()
    batch_size: int | None = None
    context: int | None = None
    r2_train: float | None = None  # calibrate(): R^2 of the fit on the samples not held out
    heldout_rel_err_median: float | None = None  # calibrate(): the fit's relative error on the held-out steps
    heldout_rel_err_max: float | None = None
    rounds: int | None = None  # pooled_calibration() (and a bench run's adjacent round): rounds pooled
    timed_on: dict = field(default_factory=dict)  # save_calibration(): the ENGINE_KEYS of the engine

    @property
    def n_samples(self) -> int:
        return len(self.samples)

    def to_json(self) -> dict:
        """The file's layout: the fit's coefficients at the top level, then the calibration's entries."""
        own = {k: getattr(self, k) for k in _OPTIONAL if getattr(self, k) is not None}
        return {**(self.fit.to_dict() if self.fit is not None else {}), **own, "n_samples": self.n_samples,
                "samples": list(self.samples), **self.timed_on}

    @classmethod
    def from_json(cls, data: Mapping) -> Calibration:
        """A calibration as stored (to_json, or a dict calibrate() returned before this type existed);
        entries it does not know are ignored."""
        fit = (CostModel.from_dict(data, str(data.get("source", "calibration")))
               if all(k in data for k in REQUIRED_TERMS) else None)
        own = {k: data.get(k) for k in _OPTIONAL}
        return cls(fit, tuple(CostSample.of(s) for s in data.get("samples") or ()), **own,
                   timed_on={k: data[k] for k in ENGINE_KEYS if k in data})


def calibration_dir() -> Path:
    if os.environ.get("ASPIRE_BENCH_CALIBRATION_DIR"):
        return Path(os.environ["ASPIRE_BENCH_CALIBRATION_DIR"])
    from ..kernels.cpu_build import cache_dir
    return cache_dir() / "calibration"


@functools.lru_cache(maxsize=1)
def engine_code_hash() -> str:
    """A short hash of the code that sets a step's cost (the engine and the kernels, their C++ too) and
    of this module, which times it: a calibration timed before a change to either describes another
    machine, or another grid, and is not reused."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted([*(root / "engine").glob("*.py"), *(root / "kernels").rglob("*.py"),
                        *(root / "kernels").rglob("*.cpp"), *(root / "kernels").rglob("*.h"), Path(__file__).resolve()]):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:8]


def calibration_context(prompt_lens: Sequence[int], engine: Engine, d_max: int) -> int:
    """The context a run's automatic calibration is timed at: its requests' median prompt length to the
    nearest power of two, at least CALIBRATION_CONTEXT, at most what the engine holds with d_max drafts.

    Why not one context for all runs: on a CPU what a step costs per KV position, and what a
    verification's extra queries add to it, change with the length and with the machine's memory
    state; a fit timed at a shorter context can price a verification of several drafts like one of
    one, and the scheduler then drafts several where one pays best (docs/decoders.md)."""
    median = statistics.median(prompt_lens) if prompt_lens else CALIBRATION_CONTEXT
    nearest = 2 ** round(math.log2(max(1.0, median)))
    return min(max(CALIBRATION_CONTEXT, nearest), engine.max_context - d_max - engine.page_size - 1)


def calibration_key(engine: Engine, batch_size: int, context: int) -> str:
    safe = "".join(ch if ch.isalnum() else "_" for ch in str(engine.name))[-60:]
    dtype = str(engine.dtype).replace("torch.", "")
    # The attention and dense backends both set the step costs: a faster dense path is another machine.
    return (f"{safe}-{engine.device.type}-{dtype}-{engine.backend.name}-{engine.dense_backend}"
            f"-p{engine.page_size}-b{batch_size}-c{context}-{engine_code_hash()}")


def calibration_path(engine: Engine, batch_size: int, context: int) -> Path:
    return calibration_dir() / (calibration_key(engine, batch_size, context) + ".json")


def last_level_cache_bytes(device: torch.device) -> int:
    """The size of the device's last-level cache (a CPU's largest, a GPU's L2); 32 MiB when unknown."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or 32 << 20
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * unit)
        except ValueError:
            continue
    return max(sizes, default=32 << 20)


def _time_step(engine: Engine, rows: list[Row], gen: torch.Generator, stand_in: torch.Tensor
               ) -> tuple[float, list[tuple[int, int, int, int, int]]]:
    """(seconds, each row's KV read, the part of it scattered through a sparse view, the positions whose
    scores it captured, as the engine reports them, and their Vegas-shaped parts, loop.shaped_reads). A
    step is timed as the decoding loop runs
    it: the forward pass, then the host work on its output, which is part of every step's cost: the
    run's Sampler on every row (under the paper's sampling setting: a draw for each one-token row,
    the rejection sampling of each verify row's drafts, against rows of `stand_in` as their draft
    distributions, so that some are rejected as in decoding), for each one-token row that captured
    page scores the next draft's page selection (ASPIRE's default budget), and for each row that captured
    token scores the top-k per layer of Vegas's default budget (VegasPolicy.scores)."""
    t0 = time.perf_counter()
    out = engine.forward(rows)
    us = torch.rand(sum(row.n for row in rows), generator=gen).tolist()  # in one call, as a request draws them
    states, first = [], 0
    for row in rows:
        drafts = list(row.tokens[1:])
        states.append((RequestState(0, None, row.slot, gen, pending=drafts, _uniforms=us[first:first + row.n],
                                    qs=[stand_in[j % len(stand_in)] for j in range(len(drafts))]),
                       VERIFY if drafts else DRAFT if row.view is not None else DECODE))
        first += row.n
    Sampler(PAPER_SAMPLING, engine.device, engine.cfg.vocab_size).step(states, out.logits)
    for i, row in enumerate(rows):
        if row.n == 1 and row.capture is not None:
            n_pages = -(-(row.start + 1) // engine.page_size)
            select_pages(out.captures.get(i, {}).get(row.capture.layers[0]), n_pages,
                         page_budget(n_pages, PAGE_RATIO, MIN_PAGES), RECENT_PAGES)
        elif row.capture is not None and row.capture.reduce == TOKEN_MEAN:
            scores, length = out.captures.get(i, {}), row.start
            k = token_budget(length, VegasSettings.ratio, VegasSettings.min_tokens)
            if scores and k < length:
                top_tokens(torch.stack([scores[li][:length] for li in row.capture.layers]), length, k)
    counts = zip(rows, out.kv_read, out.kv_sparse, out.kv_captured)
    return time.perf_counter() - t0, [(kv, sparse, captured, *shaped_reads(row.view, row.capture, sparse, captured))
                                      for row, kv, sparse, captured in counts]


def calibrate(engine: Engine, batch_size: int, context: int, drafts=DRAFTS, ratios=(0.07, 0.25, 1.0),
              repeats: int = 3, seed: int = 0, progress=None, warmup: bool = True,
              window: tuple[int, int] | None = WINDOW) -> Calibration:
    """The fit of all the samples, its R^2 on the samples not held out and relative error on the held-out
    ones, and the samples.

    Each sample is a CostSample (scheduler.py): a step's forward pass and host work (_time_step). Draft
    rows read pages scattered as a real draft's are, at the page `ratios` (a scattered position costs
    more than a contiguous one), and (unless `window` is None) a (sinks, positions) sink + window view.
    Steps are timed at context / 4 and context (at one length beta_qk and beta_tok are inseparable),
    page drafts and verify rows with and without the refresh layer's score capture (beta_capture), and
    Vegas's steps (VEGAS_DRAFTS; beta_layered, beta_topk). The grid and why: docs/decoders.md.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)  # the draws of the timed host work
    stand_in = logits_to_probs(torch.randn(16, engine.cfg.vocab_size, generator=gen) * 4, PAPER_SAMPLING)
    d_max = max(*drafts, *VEGAS_DRAFTS)
    engine.reserve(batch_size * (context + d_max + engine.page_size))
    # A step's time does not depend on what the KV holds: random values instead of a prefill keep a
    # calibration to seconds (the KV is read in full all the same). Only the slots' own positions:
    # the rest of the pool may be large and is not read.
    slots = []
    kgen = torch.Generator(engine.cache.k.device).manual_seed(seed)
    for _ in range(batch_size):
        slot = engine.alloc(context + d_max + 1)
        slot.length = context
        slots.append(slot)
        for pool in (engine.cache.k, engine.cache.v):
            pool[:, :, slot.base:slot.base + slot.capacity].uniform_(-2.0, 2.0, generator=kgen)
    r = engine.cfg.num_layers - 2
    lengths = sorted({min(context, max(engine.page_size, context // 4)), context})
    draft_views = [*ratios, *(["window"] if window else [])]  # page ratios, then the sink + window view
    grid = [(length, n_verify, d, kind) for length in lengths
            for n_verify in sorted({0, batch_size // 2, batch_size}) for d in drafts for kind in draft_views]
    # and drafts through the same pages and refresh layer that capture no scores, in steps of drafts only:
    # beside the capturing ones they give the capture's cost apart from the pages' (it follows the whole
    # prefix, theirs the page budget; in decoding every ASPIRE draft captures)
    grid += [(length, 0, d, ("uncaptured", x)) for length in lengths for d in drafts for x in ratios if x < 1]
    # A step of drafts only is the same step at every draft length, one of verifications only the same
    # under every draft view: each distinct step is timed once and its sample counted once per grid point
    # it stands for, so the fit weighs the kinds of step as the whole grid does (at half the timing).
    point_of = [(length, n_verify, d if n_verify else drafts[0], kind if n_verify < batch_size else draft_views[0])
                for length, n_verify, d, kind in grid]
    # and Vegas's steps, of all rows verifying (scores at every layer, then the top-k) or all drafting
    # through per-layer token views (its lockstep runs no other): priced apart (SHAPED_TERMS), once each
    vegas = [(length, n_verify, d, "vegas") for length in lengths  # d: a draft's VEGAS_SINCE
             for n_verify, d in [*((0, s) for s in VEGAS_SINCE), *((batch_size, d) for d in VEGAS_DRAFTS)]]
    grid += vegas
    point_of += vegas
    points = list(dict.fromkeys(point_of))
    steps = []  # (length, rows) per distinct step
    for length, n_verify, d, kind in points:
        # Verify rows capture the refresh layer's scores (ASPIRE's) at every other draft length, the other
        # way round at the other length, and none (MagicDec's) at the rest: both kinds occur in decoding,
        # and with every verify row capturing the capture's cost would move in step with the KV they read.
        verify_capture = (Capture((r,), (0, -1), PAGE_MAX_SUM)
                          if kind != "vegas" and (lengths.index(length) + drafts.index(d)) % 2 == 0 else None)
        uncaptured = isinstance(kind, tuple)
        ratio = kind[1] if uncaptured else kind
        n_pages = -(-length // engine.page_size)
        budget = n_pages if kind in ("window", "vegas") else page_budget(n_pages, ratio, 1)
        win = streaming_positions(length, *window) if kind == "window" else None
        k = token_budget(length - d, VegasSettings.ratio, VegasSettings.min_tokens)  # (Vegas's drafts)
        rows = []
        for j, slot in enumerate(slots):
            if kind == "vegas" and n_verify:
                rows.append(Row(slot, [rng.randrange(100)] * (d + 1), length, logits="all",
                                capture=Capture(tuple(range(engine.cfg.num_layers)), (0, -1), TOKEN_MEAN)))
            elif kind == "vegas":  # each layer's own top-k of the prefix, then the positions since
                since = torch.arange(length - d, length).expand(engine.cfg.num_layers, -1)
                sel = random_tokens(length - d, k, engine.cfg.num_layers, gen)
                rows.append(Row(slot, [rng.randrange(100)], length, view=LayerTokenView(torch.cat((sel, since), 1))))
            elif j < n_verify:
                rows.append(Row(slot, [rng.randrange(100)] * (d + 1), length, logits="all",
                                capture=verify_capture))
            elif win is not None:  # a window draft (MagicDec's): no refresh layer, no page scores
                rows.append(Row(slot, [rng.randrange(100)], length, view=TokenView(win)))
            elif budget < n_pages:
                # scattered over the slot, as a real draft's pages are (contiguous ones cost less per key)
                view = PageView(random_pages(n_pages, budget, RECENT_PAGES, gen))
                rows.append(Row(slot, [rng.randrange(100)], length, view=view,
                                full_layers=frozenset({r}),
                                capture=None if uncaptured else Capture((r,), (0,), PAGE_MAX_SUM)))
            else:  # a row reading its whole prefix is timed as a decode row: no refresh layer, no scores
                rows.append(Row(slot, [rng.randrange(100)], length))
        steps.append((length, rows))
    # Rounds over the whole grid in a fresh random order each, the first a warm-up: a drift in the
    # machine's speed while it runs (large on a shared VM) then lands on every grid point alike
    # instead of on the points timed last, and the median per point resists the rest. Each timed
    # step follows an untimed one of the same rows (its code paths and buffers warm), then a read of
    # twice the last-level cache: in decoding a step mostly follows one that streamed more KV than
    # the cache holds (every AR step, a verification, ASPIRE's steps, where some row verifies), so
    # it finds neither its KV nor the weights there. A step that itself streams more than the flush
    # would (its KV and the weights) needs none: its own untimed run left little of it cached.
    flush_bytes = 2 * last_level_cache_bytes(engine.device)
    flush = torch.empty(flush_bytes // 4, device=engine.device).fill_(1.0)
    weight_bytes, bytes_per_position = engine.model.weight_bytes(), engine.cache.bytes_per_position
    walls, reads = [[] for _ in steps], [None] * len(steps)
    first = 0 if warmup else 1
    for rnd in range(first, repeats + 1):
        order = list(range(len(steps)))
        rng.shuffle(order)
        for done, i in enumerate(order):
            length, rows = steps[i]
            for timed in (False, True):
                for slot in slots:
                    slot.length = length
                if timed and rnd and weight_bytes + sum(r[0] for r in reads[i]) * bytes_per_position < flush_bytes:
                    flush.sum().item()  # (not in the warm-up round: its times are not kept)
                wall, reads[i] = _time_step(engine, rows, gen, stand_in)
                for slot in slots:
                    engine.rollback(slot, length)
            if rnd:
                walls[i].append(wall)
            if progress:
                progress((rnd - first) * len(steps) + done + 1, (repeats + 1 - first) * len(steps))
    timed = []
    for (_, rows), row_reads, times in zip(steps, reads, walls):
        per_row = [(row.n, *counts) for row, counts in zip(rows, row_reads)]
        timed.append(CostSample(sum(row.n for row in rows), sum(r[1] for r in per_row), qk_term(per_row),
                                statistics.median(times), per_row))
    for slot in slots:
        engine.free(slot)
    index = {p: j for j, p in enumerate(points)}
    samples = [timed[index[p]] for p in point_of]  # in grid order, so that rounds pool point by point
    # Held out by distinct step: a copy of a fitted step would flatter the held-out error.
    order = list(range(len(points)))
    rng.shuffle(order)
    cut = max(3, int(0.8 * len(order)))
    held_points = {points[j] for j in order[cut:]}
    train = [s for p, s in zip(point_of, samples) if p not in held_points]
    held = [s for p, s in zip(point_of, samples) if p in held_points] or train
    model = fit_cost_model(train, source="calibration")
    rel = [abs(model.rows_time(s.rows) - s.seconds) / s.seconds for s in held]
    full = fit_cost_model(samples, source="calibration")
    return Calibration(full, tuple(samples), batch_size, context, r2_train=model.r2,
                       heldout_rel_err_median=sorted(rel)[len(rel) // 2], heldout_rel_err_max=max(rel))


def pooled_calibration(rounds: list[Calibration], source: str = "calibration") -> Calibration:
    """One calibration from several rounds of the same grid (calibrate() results, same batch size,
    context, drafts and ratios) taken at different times: each grid point's time is its median over
    the rounds, refitted. Interleaved with measured runs (the bench does this), the pooled fit sees
    the machine in the same states as the runs did."""
    if not rounds:
        raise ValueError("no calibration rounds to pool")
    n = rounds[0].n_samples
    grid = [s[:3] for s in rounds[0].samples]
    if any(r.n_samples != n or [s[:3] for s in r.samples] != grid for r in rounds):
        raise ValueError("calibration rounds of different grids cannot be pooled")
    samples = tuple(first._replace(seconds=statistics.median(r.samples[j].seconds for r in rounds))
                    for j, first in enumerate(rounds[0].samples))
    return Calibration(fit_cost_model(list(samples), source=source), samples, rounds[0].batch_size,
                       rounds[0].context, rounds=len(rounds))


def save_calibration(result: Calibration, engine: Engine, batch_size: int, out: Path | None = None) -> Path:
    """Written atomically (a temporary file renamed), so a reader never sees half a calibration. By
    default where a run at the calibration's context looks for it."""
    path = out or calibration_path(engine, batch_size, result.context)
    path.parent.mkdir(parents=True, exist_ok=True)
    timed_on = {"model": engine.name, "device": engine.device.type,
                "dtype": str(engine.dtype).replace("torch.", ""), "backend": engine.backend.name,
                "page_size": engine.page_size}
    write_text(path, json.dumps(replace(result, timed_on=timed_on).to_json(), indent=1))
    return path


def read_calibration(path: str | Path, what: str = "calibration file") -> Calibration:
    """A calibration file, checked as a gate baseline is: a JSON object whose coefficients are finite
    numbers >= 0 (the three main ones present, or samples alone), qk_free an integer >= 0, R^2 a finite
    number or null, and samples a list of timing samples of finite, non-negative numbers. ConfigError
    (one line) otherwise."""
    path = Path(path)
    fix = "run `aspire-bench calibrate` again or pass calibration=auto"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist: run `aspire-bench calibrate` or pass calibration=auto") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what} {path} is not a calibration (not readable JSON: {' '.join(str(e).split())}): {fix}") from None
    problem = calibration_problem(data)
    if problem:
        raise ConfigError(f"{what} {path} is not a calibration ({problem}): {fix}")
    try:
        return Calibration.from_json(data)
    except (ValueError, KeyError, TypeError) as e:  # e.g. a sample's rows that are not lists
        raise ConfigError(f"{what} {path} is not a calibration ({e}): {fix}") from None


def calibration_problem(data) -> str | None:
    """Why `data` (a parsed calibration file) is malformed, or None."""
    def number(v, minimum=0.0):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= minimum

    if not isinstance(data, dict):
        return f"a JSON object is expected, not {type(data).__name__}"
    samples_only = not any(k in data for k in REQUIRED_TERMS) and isinstance(data.get("samples"), list) and data["samples"]
    for k in (*REQUIRED_TERMS, *OPTIONAL_TERMS):
        if k not in data and (k in OPTIONAL_TERMS or samples_only):  # samples alone: fitted when read
            continue
        if not number(data.get(k)):
            return f"{k} must be a finite number >= 0, got {data.get(k)!r}"
    qk_free = data.get("qk_free", 0)
    if not (isinstance(qk_free, int) and not isinstance(qk_free, bool) and qk_free >= 0):
        return f"qk_free must be an integer >= 0, got {qk_free!r}"
    if data.get("r2") is not None and not number(data["r2"], -math.inf):
        return f"r2 must be a finite number or null, got {data['r2']!r}"
    samples = data.get("samples")
    if samples is not None:
        if not isinstance(samples, list):
            return "samples must be a list"
        for i, s in enumerate(samples):
            scalars = s[:4] if isinstance(s, list) else None
            if not isinstance(s, list) or len(s) < 3 or not all(
                    number(x) for x in scalars if not isinstance(x, list)):
                return f"samples[{i}] must be a list of finite numbers >= 0"
    return None


def cost_model_from(calibration: Calibration, source: str, terms: str = "auto") -> CostModel:
    """The cost model of a stored calibration: refitted from its samples (terms: see
    fit_cost_model), or its coefficients as stored when it has no samples."""
    if calibration.samples:
        return fit_cost_model(list(calibration.samples), source=source, terms=terms)
    model = replace(calibration.fit, source=source)
    return model if terms == "auto" else CostModel(model.beta0, model.beta_tok, model.beta_attn, 0.0, source, model.r2)


def ensure_calibration(engine: Engine, batch_size: int, prompt_lens: Sequence[int], d_max: int) -> Path:
    """The path of this machine's stored calibration for a run (calibration_context of its prompt
    lengths), timed and stored first when there is none (the runner does this before the warm-up)."""
    context = calibration_context(prompt_lens, engine, d_max)
    path = calibration_path(engine, batch_size, context)
    if not path.exists():
        # seconds to a minute before the run's first token: say why, on stderr (stdout holds results)
        print(f"aspire: timing this machine's step costs at {context} tokens, batch {batch_size} "
              f"(once; stored in {path})", file=sys.stderr, flush=True)
        # the median of 3 timings per grid point, as `aspire-bench calibrate` takes: one disturbed timing
        # does not move it (the median of 2 is their mean, which it moves by half)
        save_calibration(calibrate(engine, batch_size, context, repeats=3), engine, batch_size, path)
    return path


def run_cost_model(calibration: str, cost_terms: str, d_max: int, engine: Engine, batch_size: int,
                   prompt_lens: Sequence[int] = ()) -> CostModel:
    """The cost model of a run, fixed for the whole run unless calibration=online.

    none: the fixed default. auto: this machine's stored calibration for the same model, device,
    dtype, backend, page size, batch size and context (calibration_context of the run's prompt
    lengths), measured once now (and stored) when there is none.
    FILE: that calibration, replayed. online: the default, refitted from the run's own steps.
    A fit that fails the quality check is rejected with a warning for the default.
    """
    if calibration == "none":  # reproducible by construction, as a regression gate needs
        return replace(DEFAULT_COST, source="none")
    if calibration == "online":
        return DEFAULT_COST
    if calibration == "auto":
        path = ensure_calibration(engine, batch_size, prompt_lens, d_max)
    else:
        path = Path(calibration)
    source = f"calibration:{path.name}"
    stored = read_calibration(path)
    try:
        model = cost_model_from(stored, source)  # the best fit: how well the timings are explained
        paper = cost_model_from(stored, source, terms="paper") if cost_terms == "paper" else None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"calibration file {path} is not a calibration ({e}): "
                          "run `aspire-bench calibrate` again or delete the file") from e
    # Checked on the full fit: the paper's three terms misfit a CPU by construction (verification
    # cost grows with the drafts), and that misfit is what cost_terms=paper exists to show. Its terms
    # cannot be negative where the full fit's are not (a non-negative fit, or the same stored terms).
    problem = fit_problem(model)
    if problem:
        warnings.warn(f"aspire: calibration {path} rejected ({problem}); using the default cost model. "
                      "Re-run `aspire-bench calibrate` on an idle machine.", stacklevel=3)
        return replace(DEFAULT_COST, source=f"default (rejected {path.name}: {problem})")
    return model if paper is None else paper
