"""Autoregressive baseline: every active request gets one token per step, full attention."""
from __future__ import annotations

from ..engine import Row
from .base import DECODE, RowTrace, StepTrace
from .common import BatchedDecoder


class ARDecoder(BatchedDecoder):
    name = "ar"

    def step(self, engine, active, params, clock):
        t0 = clock()
        rows = [Row(st.slot, [st.out[-1]], st.context_len - 1) for st in active]
        out = engine.forward(rows)
        toks = [self.sample(st, lg[-1], params) for st, lg in zip(active, out.logits)]
        t1 = clock()
        trace = StepTrace(0, t0, t1)
        for st, tok, row in zip(active, toks, rows):
            n = self.commit(st, [tok], t1, params.eos_token_ids)
            trace.rows.append(RowTrace(st.req.id, DECODE, 1, n, kv_read=row.start + 1))
        return trace
