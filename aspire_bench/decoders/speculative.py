"""Self-speculation machinery written once for MagicDec, Vegas and ASPIRE.

Per request: `pending` draft tokens (and, when sampling, their draft distributions q). A draft row
feeds one token through a sparse view; a verify row feeds [last committed] + pending with full
attention, then greedy or rejection-sampling acceptance commits a+1 tokens and rolls the KV back.
"""
from __future__ import annotations

import torch

from ..engine import Capture, Row
from .base import DRAFT, VERIFY, RowTrace, SamplingParams
from .common import BatchedDecoder, ReqState, logits_to_probs, sample_from


def accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """(accepted count a, next token): longest prefix equal to the target argmax, then its argmax."""
    best = target_logits.argmax(-1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return a, best[a]


def accept_sampling(target_logits: torch.Tensor, drafts: list[int], qs: list[torch.Tensor],
                    params: SamplingParams, gen: torch.Generator | None) -> tuple[int, int]:
    """Leviathan et al. rejection sampling: accept x with prob min(1, p(x)/q(x)); on rejection
    sample from normalize(max(0, p - q)); if all are accepted, the bonus comes from p."""
    p = logits_to_probs(target_logits, params)
    for j, (x, q) in enumerate(zip(drafts, qs)):
        u = float(torch.rand((), generator=gen, device=p.device))
        if u * float(q[x]) < float(p[j, x]):  # u < p/q without dividing by a zero q
            continue
        resid = (p[j] - q).clamp_min(0)
        total = float(resid.sum())
        return j, sample_from(resid / total if total > 0 else p[j], gen)
    return len(drafts), sample_from(p[len(drafts)], gen)


class SpeculativeDecoder(BatchedDecoder):
    """Subclasses choose the view of each draft row and when to verify."""

    # --- per-request speculative state ---------------------------------------------------------
    @staticmethod
    def pending(st: ReqState) -> list[int]:
        return st.extra.setdefault("_pending", [])

    @staticmethod
    def max_drafts(st: ReqState) -> int:
        """A verification commits up to d+1 tokens: never draft past max_new_tokens."""
        return max(0, st.req.max_new_tokens - len(st.out) - 1)

    def draft_row(self, st: ReqState, view, full_layers=frozenset(), capture: Capture | None = None) -> Row:
        pend = self.pending(st)
        token = pend[-1] if pend else st.out[-1]
        return Row(st.slot, [token], st.context_len - 1 + len(pend), view=view, full_layers=full_layers,
                   capture=capture)

    def verify_row(self, st: ReqState, capture: Capture | None = None) -> Row:
        return Row(st.slot, [st.out[-1]] + self.pending(st), st.context_len - 1, logits="all", capture=capture)

    def take_draft(self, st: ReqState, logits: torch.Tensor, params: SamplingParams) -> None:
        if params.greedy:
            tok = int(torch.argmax(logits))
        else:
            q = logits_to_probs(logits, params)
            st.extra.setdefault("_q", []).append(q)
            tok = sample_from(q, st.gen)
        self.pending(st).append(tok)

    def finish_verify(self, engine, st: ReqState, logits: torch.Tensor, params: SamplingParams,
                      t: float) -> RowTrace:
        """Accept, roll the KV back to the exact prefix, commit a+1 tokens; returns the row trace."""
        drafts = self.pending(st)
        start = st.context_len - 1
        if params.greedy:
            a, nxt = accept_greedy(logits, drafts)
        else:
            a, nxt = accept_sampling(logits, drafts, st.extra.get("_q", []), params, st.gen)
        d = len(drafts)
        engine.rollback(st.slot, start + a + 1)  # last committed token + accepted drafts
        committed = self.commit(st, drafts[:a] + [nxt], t, params.eos_token_ids)
        st.verifications.append((d, a))
        st.extra["_pending"] = []
        st.extra["_q"] = []
        return RowTrace(st.req.id, VERIFY, d + 1, committed, drafted=d, accepted=a, kv_read=start + d + 1)

    @staticmethod
    def draft_trace(st: ReqState, kv_read: int) -> RowTrace:
        return RowTrace(st.req.id, DRAFT, 1, 0, kv_read=kv_read)
