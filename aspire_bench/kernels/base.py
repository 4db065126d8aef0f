"""The attention-backend interface: what one layer's attention over a mixed batch needs.

Backend-neutral metadata, built once per forward by the engine and reused by every layer.
Positions here are *pool* positions (slot base already added), so a backend indexes the per-layer
cache tensors [kv_heads, capacity, head_dim] directly.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

TOKEN_MEAN = "token_mean"  # mean over query heads, per KV position (Vegas)
PAGE_MAX_SUM = "page_max_sum"  # max over query heads, summed per page (ASPIRE)

# Rows with at least this many queries (prefill chunks) go through SDPA / flash-attn, which are
# memory-frugal and compute-bound there; shorter ones (decode, draft, verify) through each backend's
# own path, which is faster for few queries.
SDPA_MIN_QUERIES = 32


@dataclass
class RowMeta:
    q_start: int  # offset of the row's first token in the flattened batch
    n: int  # tokens of the row (queries)
    base: int  # slot base in the pool
    start: int  # prefix length: the row's tokens sit at positions start..start+n-1 of the slot
    # Per layer: None = full attention over [0, start+n); else pool indices of the attended keys
    # (sparse prefix positions followed by the row's own n positions), and their slot positions.
    sparse: list[torch.Tensor | None] = field(default_factory=list)
    sparse_pos: list[torch.Tensor | None] = field(default_factory=list)
    capture_layers: frozenset[int] = frozenset()
    capture_queries: Sequence[int] = ()
    capture_reduce: str = PAGE_MAX_SUM

    def view(self, layer: int) -> torch.Tensor | None:
        """The row's sparse key indices at `layer`, None for full attention."""
        return self.sparse[layer] if self.sparse else None

    def captures_at(self, layer: int) -> bool:
        """Whether the row's attention scores are captured at `layer`; a capture at a sparse layer is
        refused, since its scores must cover every key (for every backend, here only)."""
        capture = layer in self.capture_layers
        if capture and self.view(layer) is not None:
            raise ValueError("attention scores can only be captured at a full-attention layer")
        return capture


@dataclass
class AttentionMeta:
    rows: list[RowMeta]
    num_tokens: int
    page_size: int
    scale: float
    backend_cache: dict = field(default_factory=dict)  # a backend's per-forward state, shared by layers


class AttentionBackend(Protocol):
    name: str

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMeta) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """q: [T, Hq, D] (already RoPE'd; the new K/V are already in the cache).
        Returns out [T, Hq, D] and {row index: scores} for rows capturing at this layer."""
        ...
