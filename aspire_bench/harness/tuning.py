"""Tuned rows: a decoder's settings (its `tune_grid` trait, e.g. a baseline's draft length) chosen on
tuning requests kept apart from the measured ones.

Per run (one context, batch size and sampling setting): the task's samples after the measured ones
(other sample indices, so other prompts) form the tuning set, one batch of them (at least 2), each
generating min(max_new_tokens, TUNE_NEW_TOKENS) tokens under the run's sampling setting with another
seed. After a short warm-up the decoder's grid runs TUNE_ROUNDS times on that set, each round in a
fresh random order, so that a drift in the machine's speed lands on every point alike; the point
of the grid (every combination of its settings' values) with the highest median decode tok/s wins. Procedure and cost: docs/metrics.md#tuned-baselines.
"""
from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import replace

from ..decoders import trait
from ..errors import ConfigError
from . import metrics
from .generation import build_requests, cached_prefix, generate

TUNE_NEW_TOKENS = 32
TUNE_ROUNDS = 3
TUNE_SEED_OFFSET = 10_000  # tuning draws never share a seed with a measured repeat


def tuning_requests(cfg, engine, measured) -> list:
    """Requests of the samples after the measured ones; none shares a prompt with a measured request."""
    n = max(cfg.batch_size, 2)
    _, _, reqs = build_requests(replace(cfg, limit=len(measured) + n), engine)
    seen = {tuple(r.prompt_ids) for r in measured}
    new = min(cfg.max_new_tokens or measured[0].max_new_tokens, TUNE_NEW_TOKENS)
    out = [replace(r, max_new_tokens=new, stop_check=measured[0].stop_check)
           for r in reqs if tuple(r.prompt_ids) not in seen][:n]
    if not out:
        raise ConfigError(f"task {cfg.task} has no samples left for tuning {cfg.decoder} at context "
                          f"{cfg.context_len!r}: use --no-tune or a smaller --limit")
    return out


def tuned_settings(decoder: str, given: dict) -> list[str]:
    """The settings a tuned row of `decoder` tunes: its tune_grid's, less those given with its name."""
    return [k for k in trait(decoder, "tune_grid") if k not in given]


def grid_points(decoder: str, given: dict) -> list[dict]:
    """Every combination of the tuned settings' values, in the grid's order; none when nothing is tuned."""
    grid = trait(decoder, "tune_grid")
    keys = tuned_settings(decoder, given)
    if not keys:
        return []
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def label(point: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in point.items())


def tune(cfg, engine, measured, params, show_progress: bool = False) -> dict:
    """{"settings": the best point, "decode_tok_s": {point label: median tok/s over the rounds}, "rounds",
    "n_requests", "max_new_tokens"} for cfg.decoder."""
    points = grid_points(cfg.decoder, cfg.decoder_args)
    if not points:
        raise ConfigError(f"{cfg.decoder} has no settings to tune (no tune_grid, or its settings are given): "
                          "drop --tune")
    reqs = tuning_requests(cfg, engine, measured)
    params = replace(params, seed=params.seed + TUNE_SEED_OFFSET)
    warm = [replace(r, max_new_tokens=min(4, r.max_new_tokens)) for r in reqs]
    # its progress shows while it prefills (minutes at 16k), not when every prompt is cached already
    show = show_progress and not all(engine.has_prefix(cached_prefix(r)) for r in reqs)
    generate(cfg.decoder, {**cfg.decoder_args, **points[0]}, engine, warm, params, cfg.batch_size,
             "tuning warm-up (prefill)", show)
    rng = random.Random(params.seed)
    runs = {label(p): [] for p in points}
    for rnd in range(TUNE_ROUNDS):
        for p in rng.sample(points, len(points)):
            out = generate(cfg.decoder, {**cfg.decoder_args, **p}, engine, reqs, params, cfg.batch_size,
                           f"tuning {cfg.decoder} {label(p)} ({rnd + 1}/{TUNE_ROUNDS})", show_progress)
            runs[label(p)].append(metrics.decode_tok_s(out) or 0.0)
    speed = {k: statistics.median(v) for k, v in runs.items()}
    best = max(points, key=lambda p: speed[label(p)])  # first in the grid on a tie
    return {"settings": best, "decode_tok_s": speed, "rounds": TUNE_ROUNDS, "n_requests": len(reqs),
            "max_new_tokens": reqs[0].max_new_tokens}
