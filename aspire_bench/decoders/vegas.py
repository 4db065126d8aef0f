"""Vegas (arXiv 2602.07223): verification-guided sparse attention, per layer, token granular.

At each verification the attention probabilities of the first and last verify query, averaged
over query heads, score every KV token in every layer; the draft view of a layer is that layer's
top-k tokens plus every token written since the verification. Fixed gamma, synchronous batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..engine import SCATTERED_HEAD, TOKEN_MEAN, Capture, LayerTokenView
from .base import DRAFT
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
        """Per-layer selection over [0, length), the KV that stays valid after the rollback. Without
        scores (a simulation has none) only the length is kept: draft_reads needs no more."""
        length = seq.context_len - 1
        k = token_budget(length, self.settings.ratio, self.settings.min_tokens)
        if k >= length or not scores:  # every token fits the budget: full attention, no selection to make
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

    def draft_reads(self, plan, prefix):
        """The top-k tokens taken as scattered, the tokens since the selection as one run: where selected
        tokens come together in long runs the engine counts fewer (an upper bound)."""
        length = plan.seq.state[0]
        k = token_budget(length, self.settings.ratio, self.settings.min_tokens)
        if k >= length:
            return prefix + 1, 0
        since = prefix - length
        return k + since + 1, k + min(since, SCATTERED_HEAD)

    def reads(self, plan):
        """As Policy.reads, a draft's scattered read counted as layered (a simulation has no view to tell)."""
        kv, scattered, captured, _, topk = super().reads(plan)
        return kv, scattered, captured, scattered if plan.kind == DRAFT else 0, topk

    def captured(self, plan, n, kv):
        return 0 if plan.capture is None else len({q % n for q in plan.capture.queries}) * kv  # every layer


class VegasDecoder(Decoder):
    name = "vegas"
    Settings = VegasSettings
    Policy = VegasPolicy
    description = "Vegas: verification-guided top-k token views per layer, fixed gamma, synchronous"
    baseline = True
    draft_kind = "vegas"
    tune_grid: ClassVar[dict[str, tuple]] = {"gamma": (1, 2, 3, 4, 6)}
