"""MagicDec (arXiv 2408.11049): StreamingLLM self-speculation, fixed gamma, synchronous batch.

Deviation (documented in docs/decoders.md): the draft reads the shared cache through a
sink + window view at the original positions instead of a separately built small cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..engine import TokenView
from .loop import Decoder, Policy
from .selection import streaming_positions
from .sync import lockstep, record_gamma


@dataclass(frozen=True)
class MagicDecSettings:
    gamma: int = 3  # drafts per cycle
    budget: int = 256  # KV positions a draft reads: sinks + the most recent
    sinks: int = 16  # attention-sink positions always kept

    def __post_init__(self):
        if self.gamma < 0:
            raise ValueError("gamma must be >= 0")


class MagicDecPolicy(Policy):
    cycle = 0  # draft steps done in the current cycle

    def plan(self, seqs, batch):
        plan, self.cycle = lockstep(seqs, self.settings.gamma, self.cycle, self.view)
        return plan

    def view(self, seq, prefix_len):
        pos = streaming_positions(prefix_len, self.settings.sinks, self.settings.budget)
        return None if pos is None else TokenView(pos)

    def observe(self, seq, drafted, accepted):
        record_gamma(seq, drafted)


class MagicDecDecoder(Decoder):
    name = "magicdec"
    Settings = MagicDecSettings
    Policy = MagicDecPolicy
    description = "MagicDec: StreamingLLM self-speculation (sinks + recent window), fixed gamma, synchronous"
    baseline = True
    draft_kind = "window"
    tune_grid: ClassVar[dict[str, tuple]] = {"gamma": (1, 2, 3, 4)}
