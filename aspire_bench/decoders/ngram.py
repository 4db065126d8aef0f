"""Prompt lookup (n-gram) speculation, as vLLM's `ngram` method and Hugging Face's prompt lookup.

Each step every request proposes the up to gamma tokens that followed the earliest earlier occurrence
of its longest suffix (n from `prompt_lookup_max` down to `prompt_lookup_min`; vLLM's choice) and
verifies them in the step's mixed forward: no draft forward, and a request without a match verifies
no drafts (an AR step, recorded as a (0, 0) verification). The point-mass draft keeps sampling
lossless. A simulation replays a stored run's proposal lengths (`Policy.recorded`): the lookup is
host work, with no forward to price. Details: docs/decoders.md, "Prompt lookup (`ngram`)".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import VERIFY
from .loop import Decoder, Plan, Policy


@dataclass(frozen=True)
class NgramSettings:
    gamma: int = 4  # most tokens proposed per step (vLLM: num_speculative_tokens)
    prompt_lookup_max: int = 3  # longest suffix looked up
    prompt_lookup_min: int = 2  # shortest suffix that counts as a match

    def __post_init__(self):
        if self.gamma < 1:
            raise ValueError("gamma must be >= 1 (gamma=0 is AR: use --decoders ar)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")


def lookup(tokens: np.ndarray, n_max: int, n_min: int, k: int) -> np.ndarray:
    """Up to k tokens that followed the earliest occurrence of the longest suffix of `tokens` (its length
    n in [n_min, n_max]) that also occurs earlier; empty when none does. One vectorised pass over the
    tokens finds where the last token occurs, then each longer suffix only filters those candidates."""
    L = len(tokens)
    if L < n_min + 1 or k < 1:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])  # where an earlier occurrence ends
    best = ends if n_min <= 1 else None
    for j in range(1, min(n_max, L - 1)):  # extend every candidate by one more token to the left
        ends = ends[ends >= j]
        ends = ends[tokens[ends - j] == tokens[L - 1 - j]]
        if not len(ends):
            break
        if j + 1 >= n_min:
            best = ends
    if best is None or not len(best):
        return tokens[:0]
    start = int(best[0]) + 1  # the earliest occurrence: candidates come sorted
    return tokens[start:start + k]


class History:
    """A request's prompt + committed output as a numpy array, appended as tokens are committed."""

    def __init__(self, prompt: list[int], max_new: int):
        self.buf = np.empty(len(prompt) + max_new, dtype=np.int64)
        self.buf[:len(prompt)] = prompt
        self.n, self.prompt_len = len(prompt), len(prompt)

    def tokens(self, out: list[int]) -> np.ndarray:
        new = out[self.n - self.prompt_len:]
        self.buf[self.n:self.n + len(new)] = new
        self.n += len(new)
        return self.buf[:self.n]


class NgramPolicy(Policy):
    def plan(self, seqs, batch):
        s = self.settings
        plans = []
        for seq in seqs:
            k = min(s.gamma, seq.max_drafts)
            if self.recorded is not None:  # a replay has no tokens: the run's own proposal lengths, in order
                done = self.recorded.get(seq.req.id) or [(0, 0)]
                seq.propose([0] * min(k, done[len(seq.verifications) % len(done)][0]))
            else:
                if seq.state is None:
                    seq.state = History(seq.req.prompt_ids, seq.req.max_new_tokens)
                # point masses: under sampling the Sampler accepts each with min(1, p(x))
                seq.propose(lookup(seq.state.tokens(seq.out), s.prompt_lookup_max, s.prompt_lookup_min, k).tolist())
            # without a match, a verification of no drafts: one token with full attention, an AR step
            plans.append(Plan(seq, VERIFY))
        return plans

    def observe(self, seq, drafted, accepted):
        seq.schedule.append({"gamma": drafted})


class NgramDecoder(Decoder):
    name = "ngram"
    description = "prompt lookup: drafts what followed the longest earlier match of the last n tokens (vLLM ngram)"
    baseline = True
    ablation = False
    draft_kind = "ngram"
    host_drafts = True
    tune_grid: ClassVar[dict[str, tuple]] = {"gamma": (2, 4, 6), "prompt_lookup_max": (2, 3, 5)}
    simulated = "replay"  # its drafts come from the tokens: a replay takes their lengths from the run
    Settings = NgramSettings
    Policy = NgramPolicy
