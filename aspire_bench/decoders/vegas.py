"""Vegas (arXiv 2602.07223): verification-guided sparse attention, per layer, token granular.

At each verification the attention probabilities of the first and last verify query, averaged
over query heads, score every KV token in every layer; the draft view of a layer is that layer's
top-k tokens plus every token written since the verification. Fixed gamma, synchronous batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import TOKEN_MEAN, Capture, TokenView
from .loop import Decoder, Policy
from .selection import select_tokens, token_budget
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
    """seq.state: (length, per-layer selection over [0, length)) of the last verification."""
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
        seq.state = (length, [select_tokens(scores[li], length, k) for li in sorted(scores)])

    def view(self, seq, prefix_len):
        length, layers = seq.state
        if all(sel is None for sel in layers):
            return None
        since = torch.arange(length, prefix_len)  # every token written since that verification
        return [None if sel is None else TokenView(torch.cat((sel, since))) for sel in layers]

    def observe(self, seq, drafted, accepted):
        record_gamma(seq, drafted)


class VegasDecoder(Decoder):
    name = "vegas"
    Settings = VegasSettings
    Policy = VegasPolicy
