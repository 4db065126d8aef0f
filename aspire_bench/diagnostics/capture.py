"""Teacher-forced attention capture: the true attention of chosen query positions at every layer,
through the engine's own score capture (one query, one forward, every layer; no attention matrix is
kept beyond one layer's row of scores)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..engine import PAGE_MAX_SUM, TOKEN_MEAN, Capture, Engine, Row
from ..errors import ConfigError

HEADS = ("max", "mean")


def token_engine(engine: Engine) -> Engine:
    """A twin of `engine` (same weights and attention backend) with pages of one token, so that its
    PAGE_MAX_SUM capture is the per-token max over heads (its TOKEN_MEAN capture is the mean)."""
    if engine.page_size == 1:
        return engine
    return Engine(engine.model, engine.tokenizer, engine.backend.name, page_size=1,
                  prefill_chunk=engine.prefill_chunk, name=engine.name, dense_backend=engine.dense_backend)


def capture_scores(engine: Engine, ids: Sequence[int], first: int, heads: str = "max", also_mean: bool = False,
                   progress: Callable[[int], None] | None = None):
    """Feed `ids` with full attention: ids[:first] as a chunked prefill, then one token at a time,
    capturing at every layer the attention of position p (p >= first) over keys 0..p.

    Returns ({p: [layers, p + 1]} reduced over heads by `heads`, and, when also_mean and heads is
    max, the same reduced by the mean over heads, else None). `engine` must have one-token pages
    (token_engine)."""
    if heads not in HEADS:
        raise ConfigError(f"unknown head reduction {heads!r}: choose one of {', '.join(HEADS)}")
    if engine.page_size != 1:
        raise ValueError("capture_scores needs an engine with one-token pages (token_engine)")
    if not 0 < first < len(ids):
        raise ValueError(f"first captured position {first} outside 1..{len(ids) - 1}")
    layers = tuple(range(engine.cfg.num_layers))
    engine.reserve(len(ids))
    slot = engine.alloc(len(ids))
    chunk = engine.prefill_chunk
    for start in range(0, first, chunk):
        engine.forward([Row(slot, list(ids[start:min(first, start + chunk)]), start, logits="none")])
    reductions = [PAGE_MAX_SUM if heads == "max" else TOKEN_MEAN]
    if also_mean and heads == "max":
        reductions.append(TOKEN_MEAN)
    out: list[dict[int, torch.Tensor]] = [{} for _ in reductions]
    for p in range(first, len(ids)):
        for r, red in enumerate(reductions):
            engine.rollback(slot, p)  # the second reduction rewrites the same token's KV
            res = engine.forward([Row(slot, [ids[p]], p, logits="none", capture=Capture(layers, (0,), red))])
            out[r][p] = torch.stack([res.captures[0][li][:p + 1] for li in layers]).float().cpu()
        if progress:
            progress(1)
    engine.free(slot)
    return out[0], (out[1] if len(out) > 1 else None)
