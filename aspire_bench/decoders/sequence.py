"""A request's working state while the loop (decoders/loop.py) generates for it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import Slot
from .base import Request


@dataclass(eq=False)
class Sequence:
    index: int  # position in the input requests
    req: Request
    slot: Slot | None
    gen: torch.Generator | None  # per-request sampling stream (None when greedy)
    out: list[int] = field(default_factory=list)  # committed output ids
    times: list[float] = field(default_factory=list)  # commit time of each output id
    finish: str | None = None  # "eos" | "stop" | "length" once finished
    t_prefill_start: float = 0.0
    verifications: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted)
    pending: list[int] = field(default_factory=list)  # drafts not yet verified
    qs: list[torch.Tensor] = field(default_factory=list)  # their draft distributions (sampling only)
    state: Any = None  # the policy's own per-request state
    # Greedy only, per sampled token: AR's record for parity (harness/parity.py).
    margins: list[float] = field(default_factory=list)  # top-1 minus top-2 logit
    runner_up: list[int] = field(default_factory=list)  # the top-2 token
    top_logit: list[float] = field(default_factory=list)  # the top-1 logit (scales the near-tie threshold)
    extra: dict = field(default_factory=dict)  # telemetry copied into RequestResult.extra

    @property
    def context_len(self) -> int:
        """Committed tokens whose KV is (or will be, for the last one) in the cache."""
        return len(self.req.prompt_ids) + len(self.out)

    @property
    def max_drafts(self) -> int:
        """A verification commits up to d+1 tokens: never draft past max_new_tokens."""
        return max(0, self.req.max_new_tokens - len(self.out) - 1)
