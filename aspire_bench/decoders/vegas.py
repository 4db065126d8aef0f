"""Vegas (arXiv 2602.07223): verification-guided sparse attention, per layer, token granular.

At each verification the attention probabilities of the first and last verify query, averaged
over query heads, score every KV token in every layer; the draft view of a layer is that layer's
top-k tokens plus every token written since the verification. Fixed gamma, synchronous batch.
"""
from __future__ import annotations

import torch

from ..engine import TOKEN_MEAN, Capture, TokenView
from .magicdec import SyncSpeculativeDecoder
from .selection import select_tokens, token_budget


class VegasDecoder(SyncSpeculativeDecoder):
    name = "vegas"

    def __init__(self, gamma: int = 6, ratio: float = 0.05, min_tokens: int = 256):
        super().__init__(gamma=gamma)
        self.ratio, self.min_tokens = ratio, min_tokens

    def settings(self):
        return {"gamma": self.gamma, "ratio": self.ratio, "min_tokens": self.min_tokens}

    def _capture(self, engine, queries):
        return Capture(tuple(range(engine.cfg.num_layers)), queries, TOKEN_MEAN)

    def prefill_capture(self, engine):
        return self._capture(engine, (0,))  # the row holds only the last prompt token

    def verify_capture(self, engine):
        return self._capture(engine, (0, -1))  # first and last verify query

    def on_prefilled(self, engine, st, scores):
        self._select(st, scores, st.context_len - 1)

    def on_verified(self, engine, st, scores):
        self._select(st, scores, st.context_len - 1)

    def _select(self, st, scores, length):
        """Per-layer selection over [0, length), the KV that stays valid after the rollback."""
        k = token_budget(length, self.ratio, self.min_tokens)
        layers = [select_tokens(scores[li], length, k) for li in sorted(scores)]
        st.extra["_sel"] = (length, layers)

    def view(self, st, prefix_len):
        length, layers = st.extra["_sel"]
        if all(sel is None for sel in layers):
            return None, prefix_len
        since = torch.arange(length, prefix_len)  # every token written since that verification
        views = [None if sel is None else TokenView(torch.cat((sel, since))) for sel in layers]
        sizes = [prefix_len if v is None else v.positions.numel() for v in views]
        return views, round(sum(sizes) / len(sizes))
