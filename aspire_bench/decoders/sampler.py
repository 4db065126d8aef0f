"""The Sampler: logits -> probabilities (temperature, top-k, top-p), draws from each request's own
stream, speculative acceptance (greedy, rejection sampling, point-mass drafts) and the token after the
accepted drafts, the same for every decoder. One choice per run (made in Sampler.__init__): a
step's sampling in one compiled call (kernels/cpu_sampling.py, top-k on fp32 CPU logits) or the torch
ops row by row; both give the same tokens, distributions and uniforms. Only this module of the
decoders imports the sampling kernels.
"""
from __future__ import annotations

import numpy as np
import torch

from ..kernels import cpu_sampling
from ..kernels.cpu_sampling import draw, top_k_probs
from .base import DRAFT, VERIFY, SamplingParams
from .state import RequestState


def compiled_applies(params: SamplingParams, device: torch.device | str, vocab: int) -> bool:
    """Whether a run's steps sample in one compiled call: top-k sampling on a CPU (the engine's logits
    are fp32) where the library is built."""
    return (not params.greedy and torch.device(device).type == "cpu" and 1 <= params.top_k < vocab
            and cpu_sampling.load_library() is not None)


class Sampler:
    """A run's sampling (its SamplingParams). `step` samples every row of an engine step; `sample`
    one token (a prompt's last). Draft distributions live on the request (RequestState.qs; None for a
    point-mass draft a deterministic drafter proposed, RequestState.propose)."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu", vocab: int = 0):
        self.params = params
        self.compiled = compiled_applies(params, device, vocab)

    def step(self, rows: list[tuple[RequestState, str]], logits: list[torch.Tensor]) -> list[tuple[int, int]]:
        """Per row (its request, DECODE | DRAFT | VERIFY) and its logits: (token, accepted drafts). A decode
        row's token; a draft row's draft (its distribution appended to seq.qs); a verify row's token
        after the accepted drafts, and their count."""
        if not rows:
            return []
        if self.compiled:
            return self._step_compiled(rows, logits)
        probs = self._batch_probs(rows, logits)
        out = []
        for i, ((seq, kind), lg) in enumerate(zip(rows, logits, strict=True)):
            if kind == VERIFY:
                out.append(self.verify(seq, lg, probs.get(i)))
            elif kind == DRAFT:
                out.append((self.draft(seq, lg[-1], probs.get(i)), 0))
            else:
                out.append((self.sample(seq, lg[-1], probs.get(i)), 0))
        return out

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.params)

    def sample(self, seq: RequestState, logits: torch.Tensor, probs: torch.Tensor | None = None) -> int:
        """One token from a row's last logits; greedy records AR's parity margins on the request."""
        if self.params.greedy:
            tok = int(torch.argmax(logits))
            if logits.shape[-1] > 1:
                (v1, v2), (i1, i2) = (t.tolist() for t in torch.topk(logits, 2))
                seq.margins.append(v1 - v2)
                seq.runner_up.append(i2 if i2 != tok else i1)  # on an exact tie topk may list tok second
                seq.top_logit.append(v1)
            return tok
        return sample_from(self.probs(logits) if probs is None else probs, seq.gen, seq.uniforms(1)[0])

    def draft(self, seq: RequestState, logits: torch.Tensor, q: torch.Tensor | None = None) -> int:
        """A draft token; under sampling its distribution q is kept for the verification."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        q = self.probs(logits) if q is None else q
        seq.qs.append(q)
        return sample_from(q, seq.gen, seq.uniforms(1)[0])

    def verify(self, seq: RequestState, logits: torch.Tensor, probs: torch.Tensor | None = None) -> tuple[int, int]:
        """(token after the accepted drafts, accepted count) of seq.pending against the target's logits."""
        if self.params.greedy:
            a, nxt = accept_greedy(logits, seq.pending)
        else:
            a, nxt = accept_sampling(logits, seq.pending, self._qs(seq, logits), self.params, seq.gen,
                                     probs, seq.uniforms(len(seq.pending) + 1))
        return nxt, a

    @staticmethod
    def _qs(seq: RequestState, logits: torch.Tensor) -> list[torch.Tensor]:
        """The drafts' distributions; a point-mass draft's as a one-hot row on the logits' device, so that
        rejection sampling accepts it with min(1, p(x)) and resamples from p without x."""
        qs = seq.qs + [None] * (len(seq.pending) - len(seq.qs))

        def one_hot(x: int) -> torch.Tensor:
            q = torch.zeros(logits.shape[-1], device=logits.device)
            q[x] = 1.0
            return q
        return [q if q is not None else one_hot(x) for x, q in zip(seq.pending, qs)]

    def _batch_probs(self, rows, logits) -> dict[int, torch.Tensor]:
        """Sampling distributions of every row of the step in one batched call: the last position of a
        one-token row (decode, draft) as [V], every position of a verify row as [n, V]. Per row the same
        values as a call of its own, at a fraction of the per-call cost."""
        if self.params.greedy:
            return {}
        parts = [lg if kind == VERIFY else lg[-1:] for (_, kind), lg in zip(rows, logits)]
        probs = self.probs(stack_rows(parts)).split([len(x) for x in parts])
        return {i: pr if kind == VERIFY else pr[0] for i, ((_, kind), pr) in enumerate(zip(rows, probs))}

    def _step_compiled(self, rows, logits) -> list[tuple[int, int]]:
        """Every row's sampling of the step in one compiled call (cpu_sampling.sample_step): the same
        tokens, distributions and uniforms as the per-row path, in one call instead of ~25 (each several
        times its warm cost right after a forward)."""
        p = self.params
        lens = [len(seq.pending) + 1 if kind == VERIFY else 1 for seq, kind in rows]
        stacked = stack_rows([lg if kind == VERIFY else lg[-1:] for (_, kind), lg in zip(rows, logits)])
        drafts, qs, us = [], [], []
        for (seq, _), n in zip(rows, lens):
            us += seq.uniforms(n)
            if n > 1:
                drafts += seq.pending
                qs += self._qs(seq, stacked)
        probs, tokens, accepted = cpu_sampling.sample_step(stacked, lens, drafts, qs, us, p.temperature, p.top_k,
                                                           p.top_p)
        dist = probs.unbind()  # every row's view in one call
        out, first = [], 0
        for (seq, kind), n, tok, a in zip(rows, lens, tokens, accepted):
            if kind == DRAFT:
                seq.qs.append(dist[first])
            out.append((tok, a))
            first += n
        return out



# --- distributions and draws ---------------------------------------------------------------------
def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to the last dim; fp32 probabilities."""
    if params.top_k and params.top_k < logits.shape[-1]:
        # fp32 on a CPU: one compiled call for all rows (the torch ops below are many small calls)
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
    batch. (A top-64 costs a small fraction of a full sort.)"""
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


# --- acceptance ----------------------------------------------------------------------------------
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
    pv = p.numpy() if host else p  # single values read through numpy: a torch index dispatches an op each
    if us is None:  # every uniform the verification can use, in one call (see RequestState.uniforms)
        us = torch.rand(len(drafts) + 1, generator=gen, device=p.device).tolist()
    for j, (x, q) in enumerate(zip(drafts, qs)):
        if us[j] * float((q.numpy() if host else q)[x]) < float(pv[j, x]):  # u < p/q without dividing by a zero q
            continue
        return j, sample_residual(p[j], q, gen, us[j + 1])
    return len(drafts), sample_from(p[len(drafts)], gen, us[len(drafts)])
