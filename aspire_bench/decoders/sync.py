"""Synchronous self-speculation (MagicDec, Vegas): every active request drafts gamma tokens in
lockstep, then one batched verification of all of them. A plan helper, not a base class."""
from __future__ import annotations

from collections.abc import Callable

from ..engine import Capture
from ..engine.batch import View
from .base import DRAFT, VERIFY
from .loop import Plan
from .state import RequestState


def lockstep(seqs: list[RequestState], gamma: int, cycle: int, view: Callable[[RequestState, int], View | list[View]],
             capture: Capture | None = None) -> tuple[list[Plan], int]:
    """(this step's plan, the next cycle count). Draft steps while `cycle` < gamma for the sequences
    still short of gamma drafts (never past max_new_tokens); then every sequence verifies.
    `view(seq, prefix_len)` is the draft view of a prefix [0, prefix_len)."""
    drafting = [s for s in seqs if cycle < gamma and len(s.pending) < min(gamma, s.max_drafts)]
    if drafting:
        return [Plan(s, DRAFT, view(s, s.context_len - 1 + len(s.pending))) for s in drafting], cycle + 1
    return [Plan(s, VERIFY, capture=capture) for s in seqs], 0


def record_gamma(seq: RequestState, drafted: int) -> None:
    """A fixed-gamma policy's view of a verification, for replay (RequestResult.schedule)."""
    seq.schedule.append({"gamma": drafted})
