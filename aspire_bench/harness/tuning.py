"""Tuned baselines: each baseline's draft length chosen on tuning requests kept apart from the measured ones.

Per run (one context, batch size and sampling setting): the task's samples after the measured ones
(other sample indices, so other prompts) form the tuning set, one batch of them (at least 2), each
generating min(max_new_tokens, TUNE_NEW_TOKENS) tokens under the run's sampling setting with another
seed. After a short warm-up the decoder's grid runs TUNE_ROUNDS times on that set, each round in a
fresh random order, so that a drift in the machine's speed (on a shared VM, memory bandwidth moves by
up to 1.5x within minutes) lands on every gamma alike; the gamma with the highest median decode
tok/s wins. Procedure and cost: docs/metrics.md#tuned-baselines.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import replace

from ..errors import ConfigError
from . import metrics
from .generation import build_requests, generate

TUNE_GRIDS = {"magicdec": (1, 2, 3, 4), "vegas": (1, 2, 3, 4, 6), "ngram": (2, 4, 6), "draft-model": (2, 3, 4, 5, 6)}
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


def tune(cfg, engine, measured, params, show_progress: bool = False) -> dict:
    """{"gamma": best, "decode_tok_s": {gamma: median tok/s over the rounds}, "rounds", "n_requests",
    "max_new_tokens"} for cfg.decoder."""
    grid = TUNE_GRIDS.get(cfg.decoder)
    if grid is None:
        raise ConfigError(f"{cfg.decoder} has no draft length to tune: tune only {', '.join(TUNE_GRIDS)}")
    reqs = tuning_requests(cfg, engine, measured)
    params = replace(params, seed=params.seed + TUNE_SEED_OFFSET)
    warm = [replace(r, max_new_tokens=min(4, r.max_new_tokens)) for r in reqs]
    generate(cfg.decoder, {**cfg.decoder_args, "gamma": grid[0]}, engine, warm, params, cfg.batch_size,
              "tuning warm-up", False)
    rng = random.Random(params.seed)
    runs = {g: [] for g in grid}
    for rnd in range(TUNE_ROUNDS):
        for g in rng.sample(grid, len(grid)):
            out = generate(cfg.decoder, {**cfg.decoder_args, "gamma": g}, engine, reqs, params, cfg.batch_size,
                            f"tuning {cfg.decoder} gamma={g} ({rnd + 1}/{TUNE_ROUNDS})", show_progress)
            runs[g].append(metrics.decode_tok_s(out) or 0.0)
    speed = {g: statistics.median(v) for g, v in runs.items()}
    best = max(grid, key=speed.get)  # first in the grid on a tie
    return {"gamma": best, "decode_tok_s": speed, "rounds": TUNE_ROUNDS, "n_requests": len(reqs),
            "max_new_tokens": reqs[0].max_new_tokens}
