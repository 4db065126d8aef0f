"""Machinery shared by every decoder: continuous batching, chunked prefill, sampling, stopping.

A decoder subclasses `BatchedDecoder` and implements `step()`: one engine forward over the active
requests. Admission (prefill), commit rules (EOS, stop strings, max_new_tokens) and slot release
are the same for all decoders, so their comparisons are fair.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..engine import Capture, Engine, Row, Slot
from ..errors import ConfigError
from .base import PREFILL, GenerationOutput, Request, RequestResult, RowTrace, SamplingParams, StepTrace


@dataclass(eq=False)
class ReqState:
    index: int
    req: Request
    slot: Slot
    gen: torch.Generator | None
    out: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    finish: str | None = None
    t_prefill_start: float = 0.0
    verifications: list[tuple[int, int]] = field(default_factory=list)
    # Greedy only, per sampled token: AR's record for parity (harness/parity.py).
    margins: list[float] = field(default_factory=list)  # top-1 minus top-2 logit
    runner_up: list[int] = field(default_factory=list)  # the top-2 token
    top_logit: list[float] = field(default_factory=list)  # the top-1 logit (scales the near-tie threshold)
    extra: dict = field(default_factory=dict)  # decoder telemetry; keys starting "_" are working state

    @property
    def context_len(self) -> int:
        """Committed tokens whose KV is (or will be, for the last one) in the cache."""
        return len(self.req.prompt_ids) + len(self.out)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to the last dim; fp32 probabilities."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        # The k best logits come sorted, so top-p needs no sort of the whole vocabulary.
        vals, idx = torch.topk(logits, params.top_k, dim=-1)
        kept = _top_p(torch.softmax(vals, dim=-1), params.top_p)
        return torch.zeros_like(logits).scatter_(-1, idx, kept)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sp, si = torch.sort(probs, dim=-1, descending=True)
        probs = torch.zeros_like(probs).scatter_(-1, si, _top_p(sp, params.top_p))
    return probs


def _top_p(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of descending probabilities whose mass reaches top_p; renormalised."""
    if top_p >= 1.0:
        return sorted_probs
    drop = (sorted_probs.cumsum(-1) - sorted_probs) > top_p
    kept = sorted_probs.masked_fill(drop, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def sample_from(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One draw from a 1-D distribution by inverting its CDF (a tenth of torch.multinomial's cost)."""
    cdf = probs.cumsum(0)
    u = torch.rand(1, generator=gen, device=probs.device) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))  # the first i with cdf[i] > u: p[i] > 0
    if i >= probs.numel():  # u rounded up to the total: the last token with mass
        i = int(torch.nonzero(probs).max())
    return i


def _notify(st: ReqState) -> None:
    if st.req.on_finish is not None:
        st.req.on_finish(list(st.out), st.finish)


class BatchedDecoder:
    name = "base"

    def __init__(self, **settings):
        if settings:
            raise ConfigError(f"decoder {self.name!r} takes no setting(s) {', '.join(settings)}")

    # --- to override ---------------------------------------------------------------------------
    def settings(self) -> dict:
        return {}

    def step(self, engine: Engine, active: list[ReqState], params: SamplingParams, clock) -> StepTrace:
        raise NotImplementedError

    def prefill_capture(self, engine: Engine) -> Capture | None:
        """Scores to capture at the last prompt token (seeds a sparse draft view)."""
        return None

    def on_prefilled(self, engine: Engine, st: ReqState, scores: dict[int, torch.Tensor]) -> None:
        pass

    # --- shared --------------------------------------------------------------------------------
    def sample(self, st: ReqState, logits: torch.Tensor, params: SamplingParams) -> int:
        if params.greedy:
            tok = int(torch.argmax(logits))
            if logits.shape[-1] > 1:
                (v1, v2), (i1, i2) = (t.tolist() for t in torch.topk(logits, 2))
                st.margins.append(v1 - v2)
                st.runner_up.append(i2 if i2 != tok else i1)  # on an exact tie topk may list tok second
                st.top_logit.append(v1)
            return tok
        return sample_from(logits_to_probs(logits, params), st.gen)

    @staticmethod
    def commit(st: ReqState, tokens: Sequence[int], t: float, eos: tuple[int, ...]) -> int:
        """Append tokens until EOS, a stop string or max_new_tokens; returns how many were kept."""
        before = len(st.out)
        for tok in tokens:
            if st.finish:
                break
            st.out.append(int(tok))
            st.times.append(t)
            if tok in eos:
                st.finish = "eos"
            elif st.req.stop_check is not None and (cut := st.req.stop_check(st.out)) is not None:
                del st.out[cut:]
                del st.times[cut:]
                st.finish = "stop"
            elif len(st.out) >= st.req.max_new_tokens:
                st.finish = "length"
        return len(st.out) - before

    def _check(self, engine: Engine, requests: Sequence[Request]) -> None:
        for r in requests:
            need = len(r.prompt_ids) + r.max_new_tokens
            if not r.prompt_ids:
                raise ConfigError(f"request {r.id!r} has an empty prompt")
            vocab = engine.cfg.vocab_size
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab:  # never wrap around the embedding
                raise ConfigError(f"request {r.id!r} has a token id outside the vocabulary (0..{vocab - 1})")
            if r.max_new_tokens < 1:
                raise ConfigError(f"request {r.id!r}: max_new_tokens must be at least 1")
            if need > engine.max_context:
                raise ConfigError(
                    f"request {r.id!r} needs {len(r.prompt_ids)} prompt + {r.max_new_tokens} new tokens, more "
                    f"than the model's maximum context of {engine.max_context}: shorten the context "
                    "(--context-len) or lower --max-new-tokens")

    def _admit(self, engine: Engine, i: int, req: Request, params: SamplingParams, clock,
               steps: list[StepTrace]) -> ReqState:
        slot = engine.alloc(self._slot_size)
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=engine.device)
            gen.manual_seed(params.seed * 1_000_003 + i)  # per request: independent of batch order
        st = ReqState(index=i, req=req, slot=slot, gen=gen, t_prefill_start=clock())
        ids = req.prompt_ids
        capture = self.prefill_capture(engine)
        chunk = engine.prefill_chunk
        # A cached prompt prefix (all but the last token) is copied in; the last token always runs.
        # The last token also runs alone when scores are captured, so probabilities are only
        # materialised for one query (not a whole chunk x context).
        restored = len(ids) > 1 and engine.restore_prefix(slot, ids[:-1])
        if restored:
            bounds = [len(ids) - 1]
        else:
            bounds = list(range(0, len(ids) - (1 if capture else 0), chunk)) + ([len(ids) - 1] if capture else [])
        out = None
        for b, start in enumerate(bounds):
            end = bounds[b + 1] if b + 1 < len(bounds) else len(ids)
            last = end == len(ids)
            t0 = clock()
            row = Row(slot, ids[start:end], start, logits="last" if last else "none",
                      capture=Capture(capture.layers, (end - start - 1,), capture.reduce) if last and capture
                      else None)
            out = engine.forward([row])
            tok = self.sample(st, out.logits[0][-1], params) if last else None
            t1 = clock()
            committed = self.commit(st, [tok], t1, params.eos_token_ids) if last else 0
            steps.append(StepTrace(len(steps), t0, t1, [RowTrace(req.id, PREFILL, end - start, committed,
                                                               kv_read=end)]))
        if not restored and len(ids) > 1:
            engine.save_prefix(slot, ids[:-1])
        if capture:
            self.on_prefilled(engine, st, out.captures.get(0, {}))
        return st

    def generate(self, engine: Engine, requests: Sequence[Request], params: SamplingParams,
                 batch_size: int, progress: Callable[[int], None] | None = None) -> GenerationOutput:
        if batch_size < 1:
            raise ConfigError("--batch-size must be at least 1")
        self._check(engine, requests)
        # Equal slots of the longest request's size: any freed slot fits any waiting request, so
        # continuous batching never fragments the pool.
        ps = engine.page_size
        self._slot_size = -(-max(len(r.prompt_ids) + r.max_new_tokens for r in requests) // ps) * ps
        engine.reserve(self._slot_size * min(batch_size, len(requests)))
        clock = time.perf_counter
        t_start = clock()
        waiting = deque(enumerate(requests))
        active: list[ReqState] = []
        done: dict[int, ReqState] = {}
        steps: list[StepTrace] = []
        while waiting or active:
            while waiting and len(active) < batch_size:
                i, req = waiting.popleft()
                st = self._admit(engine, i, req, params, clock, steps)
                if progress:
                    progress(len(st.out))
                if st.finish:
                    done[i] = st
                    engine.free(st.slot)
                    _notify(st)
                else:
                    active.append(st)
            if not active:
                continue
            before = sum(len(s.out) for s in active)
            trace = self.step(engine, active, params, clock)
            trace.index = len(steps)
            steps.append(trace)
            if progress:
                progress(sum(len(s.out) for s in active) - before)
            for st in [s for s in active if s.finish]:
                active.remove(st)
                engine.free(st.slot)
                done[st.index] = st
                _notify(st)
        results = []
        for i, req in enumerate(requests):
            st = done[i]
            extra = {k: v for k, v in st.extra.items() if not k.startswith("_")}  # "_x": working state
            if st.margins:
                extra["margins"] = st.margins[:len(st.out)]
                extra["runner_up"] = st.runner_up[:len(st.out)]
                extra["top_logit"] = st.top_logit[:len(st.out)]
            results.append(RequestResult(
                id=req.id, output_ids=st.out, finish_reason=st.finish, token_times=st.times,
                t_arrival=t_start, t_prefill_start=st.t_prefill_start, verifications=st.verifications,
                extra=extra))
        return GenerationOutput(results, steps, t_start, clock(),
                                info={"decoder": self.name, **self.settings()})
