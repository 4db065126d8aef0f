"""Token-exact prompts: prefix + body (filler units with a few "special" units inserted) + suffix.

Pieces are encoded separately and their ids concatenated, so the length is exact by construction
(the ids are the prompt; decoding and re-encoding them need not round-trip). The tokenizer's leading
special tokens (e.g. BOS) come first and count in the length.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from aspire_bench.errors import UserError

from .base import special_prefix
from .buckets import parse_bucket


def encode_plain(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def take_units(tokenizer, stream: Iterator[str], budget: int, batch: int = 256):
    """Whole units from `stream` while they fit in `budget` tokens; returns (units' ids, next unit's
    ids) — the first unit that did not fit, for callers that fill the remainder with part of it."""
    units, used = [], 0
    while True:
        texts = [next(stream) for _ in range(batch)]
        for ids in encode_plain(tokenizer, texts):
            if used + len(ids) > budget:
                return units, ids
            units.append(ids)
            used += len(ids)


def build_exact(tokenizer, n_tokens: int, *, prefix: str, suffix: str, stream: Iterator[str],
                specials: list[tuple[float, str]], remainder: str = "trim", what: str = "task") -> dict:
    """Exactly `n_tokens` ids. Filler units from `stream` are taken whole while they fit; each special
    (depth in 0..1, text) is inserted between units at that relative depth (never before the first).
    The remainder smaller than one unit is filled by `remainder`: "trim" = the first tokens of the
    next filler unit, "newline" = repeated newline tokens (for structured filler a cut unit would break).
    Returns {"ids", "special_token_offsets"} (offset of each special, in the order given)."""
    head = special_prefix(tokenizer)
    pre, suf = encode_plain(tokenizer, [prefix, suffix])
    spec_ids = encode_plain(tokenizer, [t for _, t in specials])
    budget = n_tokens - len(head) - len(pre) - len(suf) - sum(map(len, spec_ids))
    if budget < 1:
        raise UserError(f"{what}: {n_tokens} tokens is too short for its prompt; use a longer context")
    units, nxt = take_units(tokenizer, stream, budget)
    if not units:
        raise UserError(f"{what}: {n_tokens} tokens is too short for its prompt; use a longer context")
    rest = budget - sum(map(len, units))
    if remainder == "trim":
        tail = nxt[:rest]
    elif remainder == "newline":
        tail = encode_plain(tokenizer, ["\n"])[0][-1:] * rest
    else:
        raise ValueError(remainder)
    # Specials go between units; back to front so earlier indices stay valid.
    where = [min(len(units), max(1, round(d * len(units)))) for d, _ in specials]
    body: list[tuple[list[int], int | None]] = [(u, None) for u in units]
    for k in sorted(range(len(specials)), key=lambda k: (where[k], k), reverse=True):
        body.insert(where[k], (spec_ids[k], k))
    ids, offsets = list(head) + pre, [0] * len(specials)
    for piece, k in body:
        if k is not None:
            offsets[k] = len(ids)
        ids.extend(piece)
    ids.extend(tail)
    ids.extend(suf)
    assert len(ids) == n_tokens, (len(ids), n_tokens)
    return {"ids": ids, "special_token_offsets": offsets}


def sample_lengths(context_len: str, n: int, rng_for: Callable[[int], object],
                   max_length: int | None = None) -> list[int]:
    """One length per sample: the bucket's size, or for a window a seeded uniform draw in it."""
    lo, hi = parse_bucket(context_len)
    check_max_length(hi, max_length, context_len)
    return [lo if lo == hi else rng_for(i).randint(lo, hi) for i in range(n)]


def check_max_length(n_tokens: int, max_length: int | None, context_len) -> None:
    """Exact-length prompts are never truncated: a context beyond the model's limit is an error."""
    if max_length is not None and n_tokens > max_length:
        raise UserError(f"context length {context_len} ({n_tokens} tokens) exceeds max_length {max_length}")
