"""Sampling shared by every decoder: temperature, top-k, top-p and one draw from a distribution."""
from __future__ import annotations

import numpy as np
import torch

from ..kernels.cpu_sampling import draw, top_k_probs
from .base import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to the last dim; fp32 probabilities."""
    if params.top_k and params.top_k < logits.shape[-1]:
        # fp32 on a CPU: one compiled call for all rows (the torch ops below are a per-step cost there)
        fast = top_k_probs(logits, params.temperature, params.top_k, params.top_p)
        if fast is not None:
            return fast
        # The k best logits come sorted, so top-p needs no sort of the whole vocabulary.
        scaled = logits.float() / params.temperature
        vals, idx = torch.topk(scaled, params.top_k, dim=-1)
        kept = _top_p(torch.softmax(vals, dim=-1), params.top_p)
        return torch.zeros_like(scaled).scatter_(-1, idx, kept)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p over the whole vocabulary, mostly without sorting it: once a row's k most likely tokens
    hold more than top_p of the mass, none past them is in its nucleus, so its k best, sorted, give
    exactly what a full sort gives. k = 64, then 512 for the rows still short, then the whole
    vocabulary. Each row takes its own path, so a row's result does not depend on the rest of the
    batch. (On a CPU a full sort of the vocabulary costs many times a small top-k.)"""
    flat = probs.reshape(-1, probs.shape[-1])
    out, vocab = torch.zeros_like(flat), flat.shape[-1]
    todo = torch.arange(flat.shape[0], device=flat.device)
    for k in (64, 512, vocab):
        k = min(k, vocab)
        sp, si = _best(flat[todo], k)
        done = sp.sum(-1) > top_p if k < vocab else torch.ones_like(todo, dtype=torch.bool)
        out[todo[done]] = flat.new_zeros(int(done.sum()), vocab).scatter_(-1, si[done], _top_p(sp[done], top_p))
        todo = todo[~done]
        if not len(todo):
            break
    return out.view_as(probs)


def _best(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row, descending, and their indices. On a CPU beyond small k numpy
    partitions and sorts the part (torch.sort and a large torch.topk are several times slower)."""
    if x.device.type != "cpu" or k <= 64:
        return torch.topk(x, k, dim=-1)
    a = -x.numpy()
    idx = np.argpartition(a, k - 1, axis=-1)[:, :k] if k < a.shape[-1] else np.broadcast_to(np.arange(k), a.shape)
    idx = np.take_along_axis(idx, np.argsort(np.take_along_axis(a, idx, -1), axis=-1), -1)
    si = torch.from_numpy(np.ascontiguousarray(idx))
    return x.gather(-1, si), si


def _top_p(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of descending probabilities whose mass reaches top_p; renormalised."""
    if top_p >= 1.0:
        return sorted_probs
    drop = (sorted_probs.cumsum(-1) - sorted_probs) > top_p
    kept = sorted_probs.masked_fill(drop, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def sample_from(probs: torch.Tensor, gen: torch.Generator | None, u: float | None = None) -> int:
    """One draw from a 1-D distribution by inverting its CDF (a tenth of torch.multinomial's cost; on a
    CPU the compiled draw, the same index at a quarter of the torch ops' cost). `u`: the uniform in
    [0, 1) to use, else one from gen."""
    u = torch.rand(1, generator=gen, device=probs.device) if u is None else u
    i = draw(probs, u)
    return i if i is not None else _inverse_cdf(probs, u)


def sample_residual(p: torch.Tensor, q: torch.Tensor, gen: torch.Generator | None, u: float | None = None) -> int:
    """One draw from normalize(max(0, p - q)), or from p where that has no mass (p <= q everywhere):
    rejection sampling's correction. One uniform either way (`u`, else one from gen)."""
    u = torch.rand(1, generator=gen, device=p.device) if u is None else u
    i = draw(p, u, q)
    if i is None:  # the torch ops
        resid = (p - q).clamp_min(0)
        return _inverse_cdf(resid if bool(resid.any()) else p, u)
    return i if i >= 0 else draw(p, u)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor | float) -> int:
    """The torch definition of the draw: the CDF of the (unnormalised) probs, u scaled to its total."""
    cdf = probs.cumsum(0)
    i = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True))  # the first i with cdf[i] > u: p[i] > 0
    if i >= probs.numel():  # u rounded up to the total: the last token with mass
        i = int(torch.nonzero(probs).max())
    return i


def stack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) of 2-D rows, without the copy when they already are consecutive rows of one
    tensor (the engine's logits are split from one, and a step usually takes all of them)."""
    first, nbytes = parts[0], 0
    for x in parts:
        if not x.is_contiguous() or x.data_ptr() != first.data_ptr() + nbytes:
            return torch.cat(parts)
        nbytes += x.numel() * x.element_size()
    return first.as_strided((sum(len(x) for x in parts), first.shape[-1]), (first.shape[-1], 1))
