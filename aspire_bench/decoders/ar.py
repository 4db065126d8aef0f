"""Autoregressive baseline: every active request gets one token per step, full attention."""
from __future__ import annotations

from .base import DECODE
from .loop import Decoder, Plan, Policy


class ARPolicy(Policy):
    def plan(self, seqs, batch):
        return [Plan(s, DECODE) for s in seqs]


class ARDecoder(Decoder):
    name = "ar"
    Policy = ARPolicy
    description = "autoregressive: one token per request per step, full attention (the reference)"
