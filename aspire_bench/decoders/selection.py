"""Sparse draft views: which KV pages / tokens a draft step reads. Pure functions, tested alone."""
from __future__ import annotations

import math

import numpy as np
import torch

from ..kernels.cpu_sampling import select_pages as compiled_select_pages


def streaming_positions(prefix_len: int, sinks: int, budget: int) -> torch.Tensor | None:
    """StreamingLLM view of [0, prefix_len): the first `sinks` positions plus the most recent ones,
    `budget` in all; None (= full) when the prefix fits the budget."""
    if prefix_len <= budget:
        return None
    recent = budget - sinks
    return torch.cat((torch.arange(sinks), torch.arange(prefix_len - recent, prefix_len)))


# ASPIRE's draft budget (the paper's): 7% of a request's pages, at least 32, the 8 most recent always.
PAGE_RATIO, MIN_PAGES, RECENT_PAGES = 0.07, 32, 8


def page_budget(num_pages: int, ratio: float, min_pages: int) -> int:
    """ASPIRE: k = max(k_min, ceil(ratio * P))."""
    return max(min_pages, math.ceil(ratio * num_pages))


def select_pages(scores: torch.Tensor | None, num_pages: int, budget: int, n_recent: int) -> torch.Tensor | None:
    """The `n_recent` last pages always, the rest of the budget to the top-scoring older pages
    (scores may cover fewer pages than exist: an unscored page scores -1, and such pages are recent
    anyway; a NaN score counts as -inf; ties keep the lower page), ascending. None = all pages."""
    if budget >= num_pages:
        return None
    n_recent = min(n_recent, budget)
    fast = compiled_select_pages(scores, num_pages, budget, n_recent)  # on a CPU: one call, see cpu_sampling
    if fast is not None:
        return fast
    older = num_pages - n_recent
    s = np.full(older, -1.0, dtype=np.float32)
    if scores is not None:
        m = min(older, scores.numel())
        s[:m] = scores[:m].float().cpu().numpy()
    top = np.sort(np.argsort(-np.nan_to_num(s, nan=-np.inf), kind="stable")[:budget - n_recent])
    return torch.from_numpy(np.concatenate((top, np.arange(older, num_pages))))


def random_pages(num_pages: int, budget: int, n_recent: int, gen: torch.Generator) -> torch.Tensor:
    """A page set shaped like select_pages' (the `n_recent` last pages and the rest of the budget
    elsewhere, ascending) with the others drawn at random: what timing needs, since a draft's reads
    scattered over the slot cost more per key than one contiguous run on a CPU."""
    budget = min(budget, num_pages)
    n_recent = min(n_recent, budget)
    older = torch.randperm(num_pages - n_recent, generator=gen)[:budget - n_recent]
    return torch.cat((older.sort().values, torch.arange(num_pages - n_recent, num_pages)))


def random_tokens(length: int, k: int, layers: int, gen: torch.Generator) -> torch.Tensor:
    """A selection shaped like top_tokens' ([layers, k] positions of [0, length), ascending per layer, a
    different set per layer) drawn at random: what timing a draft through Vegas's views needs."""
    k = min(k, length)
    return torch.stack([torch.randperm(length, generator=gen)[:k].sort().values for _ in range(layers)])


def token_budget(length: int, ratio: float, min_tokens: int) -> int:
    """Vegas: k = clamp(ceil(ratio * length), min_tokens, length)."""
    return min(length, max(min_tokens, math.ceil(ratio * length)))


def top_tokens(scores: torch.Tensor, length: int, k: int) -> torch.Tensor | None:
    """Per layer (a row of `scores`, [layers, >= length]), the k positions of [0, length) with the
    highest scores, ascending: [layers, k]. None (= all) when k covers them.

    One linear-time selection (numpy's introselect) for all layers at once, rather than a torch.topk
    per layer (a heap of k, and a call's fixed cost per layer). Ties at the
    k-th score may resolve differently from torch.topk; either set is a top-k."""
    if k >= length:
        return None
    s = scores[:, :length].float().cpu().numpy()
    idx = np.argpartition(s, length - k, axis=1)[:, length - k:]
    idx.sort(axis=1)
    return torch.from_numpy(idx)
