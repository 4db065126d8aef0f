"""MagicDec (arXiv 2408.11049): StreamingLLM self-speculation, fixed gamma, synchronous batch.

Deviation (documented in docs/decoders.md): the draft reads the shared cache through a
sink + window view at the original positions instead of a separately built small cache.
"""
from __future__ import annotations

from ..engine import TokenView
from .base import StepTrace
from .selection import streaming_positions
from .speculative import SpeculativeDecoder


class SyncSpeculativeDecoder(SpeculativeDecoder):
    """All active requests draft gamma tokens in lockstep, then one batched verification."""

    def __init__(self, gamma: int = 3, **rest):
        super().__init__(**rest)
        if gamma < 0:
            raise ValueError("gamma must be >= 0")
        self.gamma = gamma
        self._drafted = 0  # draft steps done in the current cycle

    def view(self, st, prefix_len: int):
        """(view for the draft row whose prefix is [0, prefix_len), KV positions it reads)."""
        raise NotImplementedError

    def verify_capture(self, engine):
        return None

    def on_verified(self, engine, st, scores) -> None:
        pass

    def step(self, engine, active, params, clock):
        t0 = clock()
        drafting = [st for st in active if self._drafted < self.gamma
                    and len(self.pending(st)) < min(self.gamma, self.max_drafts(st))]
        trace = StepTrace(0, t0, 0.0)
        if drafting:
            rows, reads = [], []
            for st in drafting:
                prefix = st.context_len - 1 + len(self.pending(st))
                view, n_read = self.view(st, prefix)
                rows.append(self.draft_row(st, view))
                reads.append(n_read + 1)
            out = engine.forward(rows)
            for st, lg in zip(drafting, out.logits):
                self.take_draft(st, lg[-1], params)
            self._drafted += 1
            trace.t_end = clock()
            trace.rows = [self.draft_trace(st, n) for st, n in zip(drafting, reads)]
            return trace
        cap = self.verify_capture(engine)
        rows = [self.verify_row(st, cap) for st in active]
        out = engine.forward(rows)
        t1 = clock()
        for i, (st, lg) in enumerate(zip(active, out.logits)):
            trace.rows.append(self.finish_verify(engine, st, lg, params, t1))
            if cap is not None:
                self.on_verified(engine, st, out.captures.get(i, {}))
        self._drafted = 0
        trace.t_end = clock()
        return trace


class MagicDecDecoder(SyncSpeculativeDecoder):
    name = "magicdec"

    def __init__(self, gamma: int = 3, budget: int = 256, sinks: int = 16):
        super().__init__(gamma=gamma)
        self.budget, self.sinks = budget, sinks

    def settings(self):
        return {"gamma": self.gamma, "budget": self.budget, "sinks": self.sinks}

    def view(self, st, prefix_len):
        pos = streaming_positions(prefix_len, self.sinks, self.budget)
        return (None, prefix_len) if pos is None else (TokenView(pos), int(pos.numel()))

