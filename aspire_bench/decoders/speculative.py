"""Self-speculation written once for MagicDec, Vegas and ASPIRE: acceptance rules and lockstep plans.

A draft row feeds one token through a sparse view; a verify row feeds [last committed] + pending
with full attention, then greedy or rejection-sampling acceptance (here) commits a+1 tokens and the
loop (decoders/loop.py) rolls the KV back.
"""
from __future__ import annotations

import torch

from .base import SamplingParams
from .common import logits_to_probs, sample_from, sample_residual


def accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """(accepted count a, next token): longest prefix equal to the target argmax, then its argmax."""
    best = target_logits.argmax(-1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return a, best[a]


def accept_sampling(target_logits: torch.Tensor, drafts: list[int], qs: list[torch.Tensor],
                    params: SamplingParams, gen: torch.Generator | None,
                    p: torch.Tensor | None = None, us: list[float] | None = None) -> tuple[int, int]:
    """Leviathan et al. rejection sampling: accept x with prob min(1, p(x)/q(x)); on rejection
    sample from normalize(max(0, p - q)); if all are accepted, the bonus comes from p.
    `p`: the target distributions of target_logits when already computed; `us`: the len(drafts) + 1
    uniforms to use (one per draft tested, one for the token after), else drawn from gen."""
    p = logits_to_probs(target_logits, params) if p is None else p
    host = p.device.type == "cpu"
    pv = p.numpy() if host else p  # single values read through numpy: a torch index has a fixed cost each
    if us is None:  # every uniform the verification can use, in one call (see Sequence.uniforms)
        us = torch.rand(len(drafts) + 1, generator=gen, device=p.device).tolist()
    for j, (x, q) in enumerate(zip(drafts, qs)):
        if us[j] * float((q.numpy() if host else q)[x]) < float(pv[j, x]):  # u < p/q without dividing by a zero q
            continue
        return j, sample_residual(p[j], q, gen, us[j + 1])
    return len(drafts), sample_from(p[len(drafts)], gen, us[len(drafts)])
