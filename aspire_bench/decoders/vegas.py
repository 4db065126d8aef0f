"""Vegas (arXiv 2602.07223): verification-guided sparse attention, per layer, token granular.

At each verification the attention probabilities of the first and last verify query, averaged
over query heads, score every KV token in every layer; the draft view of a layer is that layer's
top-k tokens plus every token written since the verification. Fixed gamma, synchronous batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import TOKEN_MEAN, Capture, LayerTokenView
from .loop import Decoder, Policy
from .selection import token_budget, top_tokens
from .sync import lockstep, record_gamma


@dataclass(frozen=True)
class VegasSettings:
    gamma: int = 6  # drafts per cycle
    ratio: float = 0.05  # share of the KV tokens a draft reads per layer
    min_tokens: int = 256  # ... but at least this many

    def __post_init__(self):
        if self.gamma < 0:
            raise ValueError("gamma must be >= 0")


class VegasPolicy(Policy):
    """seq.state: (length, the last verification's selection over [0, length): [layers, k] or None)."""
    cycle = 0

    def _capture(self, queries):
        return Capture(tuple(range(self.num_layers)), queries, TOKEN_MEAN)

    def prefill_capture(self):
        return self._capture((0,))  # the row holds only the last prompt token

    def plan(self, seqs, batch):
        plan, self.cycle = lockstep(seqs, self.settings.gamma, self.cycle, self.view,
                                    self._capture((0, -1)))  # first and last verify query
        return plan

    def scores(self, seq, scores):
        """Per-layer selection over [0, length), the KV that stays valid after the rollback."""
        length = seq.context_len - 1
        k = token_budget(length, self.settings.ratio, self.settings.min_tokens)
        if k >= length:  # every token fits the budget: full attention, no selection to make
            seq.state = (length, None)
            return
        stacked = torch.stack([scores[li][:length] for li in range(self.num_layers)])
        seq.state = (length, top_tokens(stacked, length, k))

    def view(self, seq, prefix_len):
        length, sel = seq.state
        if sel is None:
            return None
        since = torch.arange(length, prefix_len).expand(sel.shape[0], -1)  # written since that verification
        return LayerTokenView(torch.cat((sel, since), dim=1))

    def observe(self, seq, drafted, accepted):
        record_gamma(seq, drafted)


class VegasDecoder(Decoder):
    name = "vegas"
    Settings = VegasSettings
    Policy = VegasPolicy
