"""MixedBatch: the rows of one engine forward pass.

Each row is one request's new tokens (1 for AR/draft, d+1 for verify, a chunk for prefill) at
absolute positions start..start+n-1. Their KV is written at those positions, and each new token
attends to the row's *view* of the prefix [0, start) plus the row's own tokens causally.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..kernels.base import PAGE_MAX_SUM, TOKEN_MEAN  # noqa: F401  (re-exported for decoders)
from .kv_cache import Slot

# What a row's tokens attend to in the prefix [0, start):
#   None                 -> every position (full attention, read in place)
#   PageView / TokenView -> a subset, gathered
#   LayerTokenView       -> a subset per layer, the same number of tokens in each (Vegas)
#   list of those        -> one view per layer; a None entry means full for that layer


@dataclass
class PageView:
    pages: torch.Tensor  # page ids within the slot (int64); positions >= start are ignored


@dataclass
class TokenView:
    positions: torch.Tensor  # positions within the slot (int64), each < start


@dataclass
class LayerTokenView:
    """A token subset per layer, as one tensor: resolved for all layers in a few tensor ops where a
    list of per-layer TokenViews costs a handful of ops per layer and row."""

    positions: torch.Tensor  # [num_layers, m] positions within the slot (int64), each < start


View = PageView | TokenView | LayerTokenView | None


@dataclass
class Capture:
    layers: Sequence[int]
    queries: Sequence[int]  # indices into the row's tokens; the scores are averaged over them
    reduce: str = PAGE_MAX_SUM


@dataclass
class Row:
    slot: Slot
    tokens: Sequence[int]
    start: int
    view: View | list[View] = None
    full_layers: frozenset[int] = frozenset()  # layers that attend fully despite a sparse view
    logits: str = "last"  # "all" | "last" | "none"
    capture: Capture | None = None

    @property
    def n(self) -> int:
        return len(self.tokens)

    def view_at(self, layer: int) -> View:
        if layer in self.full_layers:
            return None
        if isinstance(self.view, list):
            return self.view[layer]
        if isinstance(self.view, LayerTokenView):
            return TokenView(self.view.positions[layer])
        return self.view


@dataclass
class ForwardOutput:
    logits: list[torch.Tensor]  # per row: [n_selected, vocab] float32
    # per row index -> {layer: scores}; scores cover positions [0, start+n) (TOKEN_MEAN) or its pages
    captures: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    # per row: KV positions its last token attended, averaged over layers (rounded): the prefix
    # positions of its view (or the whole prefix at a full layer) plus the row's own tokens
    kv_read: list[int] = field(default_factory=list)
    # per row: the part of kv_read gathered through a sparse view at the head of its runs, the first
    # SCATTERED_HEAD positions of each (engine.scattered_positions; 0 for a row without a view): a
    # run's head costs more per position than the rest, which streams, and the cost model prices it apart
    kv_sparse: list[int] = field(default_factory=list)
    # per row: the KV positions whose attention scores it captured, summed over its captured queries
    # and layers and divided by the layer count (kv_read's unit): each captured score is written out and
    # reduced per page or token, work that follows the whole prefix (scores are captured at full layers)
    kv_captured: list[int] = field(default_factory=list)
