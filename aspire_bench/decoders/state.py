"""A request's working state while the loop (decoders/loop.py) generates for it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import Slot
from .base import Request

UNIFORM_BLOCK = 64


@dataclass(eq=False)
class RequestState:
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
    qs: list[torch.Tensor | None] = field(default_factory=list)  # their draft distributions (sampling; None: a point mass)
    state: Any = None  # the policy's own per-request state
    # Greedy only, per sampled token: AR's record for parity (harness/parity.py).
    margins: list[float] = field(default_factory=list)  # top-1 minus top-2 logit
    runner_up: list[int] = field(default_factory=list)  # the top-2 token
    top_logit: list[float] = field(default_factory=list)  # the top-1 logit (scales the near-tie threshold)
    schedule: list[dict] = field(default_factory=list)  # RequestResult.schedule: the policy's observe appends
    draft_lengths: list[int] = field(default_factory=list)  # RequestResult.draft_lengths (ASPIRE)
    extra: dict = field(default_factory=dict)  # a plug-in's own data, copied into RequestResult.extra
    _uniforms: list[float] = field(default_factory=list, repr=False)  # drawn from gen, not yet used

    def uniforms(self, n: int) -> list[float]:
        """The next n uniforms in [0, 1) of the request's sampling stream, drawn from gen UNIFORM_BLOCK at
        a time: one torch.rand per block instead of one per draw (each call is slow on a CPU right after
        a forward, whose KV stream has evicted the caches; a device sync each on a GPU)."""
        while len(self._uniforms) < n:
            self._uniforms += torch.rand(UNIFORM_BLOCK, generator=self.gen, device=self.gen.device).tolist()
        out, self._uniforms = self._uniforms[:n], self._uniforms[n:]
        return out

    def propose(self, tokens: list[int]) -> None:
        """Drafts from a deterministic drafter (no forward, no distribution): point masses, which the
        Sampler's rejection sampling accepts with min(1, p(x))."""
        self.pending += tokens
        self.qs += [None] * len(tokens)

    @property
    def context_len(self) -> int:
        """Committed tokens whose KV is (or will be, for the last one) in the cache."""
        return len(self.req.prompt_ids) + len(self.out)

    @property
    def max_drafts(self) -> int:
        """A verification commits up to d+1 tokens: never draft past max_new_tokens."""
        return max(0, self.req.max_new_tokens - len(self.out) - 1)
