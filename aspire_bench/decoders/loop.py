"""The generation loop every decoder runs, and the policy contract that makes each method small.

The loop owns everything that must be the same for all methods so that their comparisons are fair:
admission (continuous batching, equal slots), chunked prefill, sampling, acceptance (greedy or
rejection sampling), commit rules (EOS, stop strings, max_new_tokens), KV rollback, slot release
and the step traces (each row's KV read as the engine reports it). A method is a `Policy`:

  policy.plan(seqs, batch) -> list[Plan]
      the rows of this step: which active sequences draft (with what view), verify or decode.
      Sequences left out sit the step out (a synchronous policy drafts only those still short
      of gamma). Synchronous (all draft, then all verify) versus per-request scheduling is the
      policy's own choice, made here.
  policy.observe(seq, drafted, accepted)
      after each verification of `seq` (its tokens are already committed and its KV rolled back).

and optional hooks with no-op defaults: `new_state()` (seq.state at admission), `admitted(seq)` (after
its prompt's prefill; returns the tokens of the policy's own prefill, e.g. a draft model's), `prefill_capture()`,
`scores(seq, scores)` (captured attention scores of a row after it was applied), `step_done(trace)`
and `info()` (run facts for GenerationOutput.info). A policy object lives for one run and holds that
run's state (cost model, cycle counters; `params`, the run's sampling settings); per-request state lives in
`Sequence.state`, so a policy
can be driven without an engine (a simulator calls plan/observe/should_verify on plain sequences).

A `Decoder` is settings (a frozen dataclass, `Settings`) plus the policy class; it keeps no state
between runs, so one decoder object can generate any number of times.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass

import torch

from ..engine import Capture, Engine, Row
from ..engine.batch import ForwardOutput, View
from ..errors import ConfigError
from ..kernels import cpu_sampling
from . import speculative
from .base import (
    DECODE,
    DRAFT,
    PREFILL,
    VERIFY,
    GenerationOutput,
    Request,
    RequestResult,
    RowTrace,
    SamplingParams,
    StepTrace,
)
from .common import logits_to_probs, sample_from, stack_rows
from .sequence import Sequence


@dataclass
class Plan:
    """One row of a step: a sequence and what it does (DECODE | DRAFT | VERIFY)."""
    seq: Sequence
    kind: str
    view: View | list[View] = None  # DRAFT: the sparse view of the prefix (None = full)
    full_layers: frozenset[int] = frozenset()  # DRAFT: layers that attend fully despite the view
    capture: Capture | None = None  # scores to capture (handed to policy.scores)


class Policy:
    """Defaults for the optional hooks; see the module docstring for the contract."""

    params: SamplingParams | None = None  # set by the loop for a run

    def __init__(self, settings, page_size: int, num_layers: int):
        self.settings, self.page_size, self.num_layers = settings, page_size, num_layers

    @classmethod
    def for_run(cls, settings, engine: Engine, batch_size: int, requests: Seq[Request] = ()) -> Policy:
        return cls(settings, engine.page_size, engine.cfg.num_layers)

    def new_state(self):
        return None

    def admitted(self, seq: Sequence) -> int:
        """After the prompt's prefill: the tokens of the policy's own prefill (0 = none)."""
        return 0

    def prefill_capture(self) -> Capture | None:
        """Scores to capture at the last prompt token (seeds a sparse draft view)."""
        return None

    def plan(self, seqs: list[Sequence], batch: int) -> list[Plan]:
        raise NotImplementedError

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        pass

    def scores(self, seq: Sequence, scores: dict[int, torch.Tensor]) -> None:
        pass

    def step_done(self, trace: StepTrace) -> None:
        pass

    def info(self) -> dict:
        return {}


# --- sampling, acceptance, commit: the same for every method -------------------------------------
def sample(seq: Sequence, logits: torch.Tensor, params: SamplingParams, probs: torch.Tensor | None = None) -> int:
    """One token from the row's last logits; `probs`: its distribution when already computed."""
    if params.greedy:
        tok = int(torch.argmax(logits))
        if logits.shape[-1] > 1:
            (v1, v2), (i1, i2) = (t.tolist() for t in torch.topk(logits, 2))
            seq.margins.append(v1 - v2)
            seq.runner_up.append(i2 if i2 != tok else i1)  # on an exact tie topk may list tok second
            seq.top_logit.append(v1)
        return tok
    return sample_from(logits_to_probs(logits, params) if probs is None else probs, seq.gen, seq.uniforms(1)[0])


def commit(seq: Sequence, tokens: Seq[int], t: float, eos: tuple[int, ...]) -> int:
    """Append tokens until EOS, a stop string or max_new_tokens; returns how many were kept."""
    before = len(seq.out)
    for tok in tokens:
        if seq.finish:
            break
        seq.out.append(int(tok))
        seq.times.append(t)
        if tok in eos:
            seq.finish = "eos"
        elif seq.req.stop_check is not None and (cut := seq.req.stop_check(seq.out)) is not None:
            del seq.out[cut:]
            del seq.times[cut:]
            seq.finish = "stop"
        elif len(seq.out) >= seq.req.max_new_tokens:
            seq.finish = "length"
    return len(seq.out) - before


def take_draft(seq: Sequence, logits: torch.Tensor, params: SamplingParams, q: torch.Tensor | None = None) -> None:
    """Sample a draft token and keep its distribution q for rejection sampling (`q`: already computed)."""
    if params.greedy:
        tok = int(torch.argmax(logits))
    else:
        q = logits_to_probs(logits, params) if q is None else q
        seq.qs.append(q)
        tok = sample_from(q, seq.gen, seq.uniforms(1)[0])
    seq.pending.append(tok)


def finish_verify(engine, seq: Sequence, logits: torch.Tensor, params: SamplingParams, t: float,
                  probs: torch.Tensor | None = None, picked: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """Accept, roll the KV back to the exact prefix, commit a+1 tokens: (drafted, accepted, committed).
    `probs`: the target distributions of logits when already computed; `picked`: (accepted, next token)
    when the acceptance is already done (the step's compiled sampling)."""
    drafts, start = seq.pending, seq.context_len - 1
    if picked is not None:
        a, nxt = picked
    elif params.greedy:
        a, nxt = speculative.accept_greedy(logits, drafts)
    else:
        a, nxt = speculative.accept_sampling(logits, drafts, seq.qs, params, seq.gen, probs,
                                             seq.uniforms(len(drafts) + 1))
    engine.rollback(seq.slot, start + a + 1)  # last committed token + accepted drafts
    committed = commit(seq, drafts[:a] + [nxt], t, params.eos_token_ids)
    seq.verifications.append((len(drafts), a))
    seq.pending, seq.qs = [], []
    return len(drafts), a, committed


# --- one step ------------------------------------------------------------------------------------
def _row(p: Plan) -> Row:
    seq = p.seq
    if p.kind == VERIFY:
        return Row(seq.slot, [seq.out[-1]] + seq.pending, seq.context_len - 1, logits="all", capture=p.capture)
    token = seq.pending[-1] if seq.pending else seq.out[-1]
    return Row(seq.slot, [token], seq.context_len - 1 + len(seq.pending), view=p.view,
               full_layers=p.full_layers, capture=p.capture)


def _batch_probs(plans: list[Plan], logits: list[torch.Tensor], params: SamplingParams) -> dict[int, torch.Tensor]:
    """Sampling distributions of every row of the step in one batched call: the last position of a
    one-token row (decode, draft) as [V], every position of a verify row as [n, V]. Per row the same
    values as a call of its own, at a fraction of the per-call cost."""
    if params.greedy or not plans:
        return {}
    parts = [lg if p.kind == VERIFY else lg[-1:] for p, lg in zip(plans, logits)]
    probs = logits_to_probs(stack_rows(parts), params).split([len(x) for x in parts])
    return {i: pr if p.kind == VERIFY else pr[0] for i, (p, pr) in enumerate(zip(plans, probs))}


def _sample_compiled(plans: list[Plan], out: ForwardOutput, params: SamplingParams
                     ) -> list[tuple[int, int, torch.Tensor | None]] | None:
    """Every row's sampling of the step in one compiled call (kernels/cpu_sampling.py sample_step), per
    row (token, accepted drafts, a draft row's distribution q): a decode row's token, a draft row's
    draft, a verify row's accepted count and the token after them. The same tokens, distributions and
    uniforms as the per-row path (sample, take_draft, finish_verify), in one call instead of ~25 (each
    several times its warm cost right after a forward). None where it does not apply (greedy, no
    top-k, not fp32 on a CPU, no compiler): the per-row path then samples."""
    if params.greedy or not plans:
        return None
    lens = [len(p.seq.pending) + 1 if p.kind == VERIFY else 1 for p in plans]
    stacked = stack_rows([lg if p.kind == VERIFY else lg[-1:] for p, lg in zip(plans, out.logits)])
    if not cpu_sampling.step_applies(stacked, params.top_k):
        return None
    drafts, qs, us = [], [], []
    for p, n in zip(plans, lens):
        us += p.seq.uniforms(n)
        if n > 1:
            drafts += p.seq.pending
            qs += p.seq.qs
    probs, tokens, accepted = cpu_sampling.sample_step(stacked, lens, drafts, qs, us, params.temperature,
                                                       params.top_k, params.top_p)
    rows = probs.unbind()  # every row's view in one call
    picks, first = [], 0
    for p, n, tok, a in zip(plans, lens, tokens, accepted):
        picks.append((tok, a, rows[first] if p.kind == DRAFT else None))
        first += n
    return picks


def run_step(engine: Engine, policy: Policy, seqs: list[Sequence], params: SamplingParams, clock) -> StepTrace:
    """One engine forward over the policy's plan for the active sequences, applied."""
    t0 = clock()
    plans = policy.plan(seqs, len(seqs))
    out = engine.forward([_row(p) for p in plans])
    picks = _sample_compiled(plans, out, params)
    if picks is None:  # the per-row path: decode rows sampled here, drafts and verifications below
        probs = _batch_probs(plans, out.logits, params)
        toks = {i: sample(p.seq, lg[-1], params, probs.get(i)) for i, (p, lg) in enumerate(zip(plans, out.logits))
                if p.kind == DECODE}
    t1 = clock()
    trace = StepTrace(0, t0, t1)
    for i, (p, lg) in enumerate(zip(plans, out.logits, strict=True)):
        seq, reads = p.seq, {"kv_read": out.kv_read[i], "kv_sparse": out.kv_sparse[i], "kv_captured": out.kv_captured[i]}
        if p.kind == DECODE:
            tok = toks[i] if picks is None else picks[i][0]
            rt = RowTrace(seq.req.id, DECODE, 1, commit(seq, [tok], t1, params.eos_token_ids), **reads)
        elif p.kind == DRAFT:
            if picks is None:
                take_draft(seq, lg[-1], params, probs.get(i))
            else:
                seq.pending.append(picks[i][0])
                seq.qs.append(picks[i][2])
            rt = RowTrace(seq.req.id, DRAFT, 1, 0, **reads)
        else:
            d, a, n = (finish_verify(engine, seq, lg, params, t1, probs.get(i)) if picks is None else
                       finish_verify(engine, seq, lg, params, t1, picked=(picks[i][1], picks[i][0])))
            policy.observe(seq, d, a)
            rt = RowTrace(seq.req.id, VERIFY, d + 1, n, drafted=d, accepted=a, **reads)
        trace.rows.append(rt)
        if p.capture is not None:
            policy.scores(seq, out.captures.get(i, {}))
    trace.t_end = clock()
    policy.step_done(trace)
    return trace


# --- the decoder ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class NoSettings:
    pass


class Decoder:
    """Settings + a policy class. Subclasses set `name`, `Settings` and `Policy`."""

    name = "base"
    Settings: type = NoSettings
    Policy: type = Policy
    needs_reference = False  # True: the harness runs AR first and sets Request.reference_ids

    def __init__(self, **settings):
        self.config = self.Settings(**settings)

    def settings(self) -> dict:
        describe = getattr(self.config, "describe", None)
        return describe() if describe else asdict(self.config)

    def generate(self, engine: Engine, requests: Seq[Request], params: SamplingParams,
                 batch_size: int, progress: Callable[[int], None] | None = None) -> GenerationOutput:
        if batch_size < 1:
            raise ConfigError("--batch-size must be at least 1")
        _check(engine, requests)
        policy = self.Policy.for_run(self.config, engine, batch_size, requests)
        policy.params = params
        # Equal slots of the longest request's size: any freed slot fits any waiting request, so
        # continuous batching never fragments the pool.
        ps = engine.page_size
        slot_size = -(-max(len(r.prompt_ids) + r.max_new_tokens for r in requests) // ps) * ps
        engine.reserve(slot_size * min(batch_size, len(requests)))
        clock = time.perf_counter
        t_start = clock()
        waiting = deque(enumerate(requests))
        active: list[Sequence] = []
        done: dict[int, Sequence] = {}
        steps: list[StepTrace] = []
        while waiting or active:
            while waiting and len(active) < batch_size:
                i, req = waiting.popleft()
                seq = _admit(engine, policy, slot_size, i, req, params, clock, steps)
                if progress:
                    progress(len(seq.out))
                if seq.finish:
                    done[i] = seq
                    engine.free(seq.slot)
                    _notify(seq)
                else:
                    active.append(seq)
            if not active:
                continue
            before = sum(len(s.out) for s in active)
            trace = run_step(engine, policy, active, params, clock)
            trace.index = len(steps)
            steps.append(trace)
            if progress:
                progress(sum(len(s.out) for s in active) - before)
            for seq in [s for s in active if s.finish]:
                active.remove(seq)
                engine.free(seq.slot)
                done[seq.index] = seq
                _notify(seq)
        results = [_result(done[i], t_start) for i in range(len(requests))]
        return GenerationOutput(results, steps, t_start, clock(),
                                info={"decoder": self.name, **self.settings(), **policy.info()})


def _result(seq: Sequence, t_start: float) -> RequestResult:
    extra = dict(seq.extra)
    if seq.margins:
        extra["margins"] = seq.margins[:len(seq.out)]
        extra["runner_up"] = seq.runner_up[:len(seq.out)]
        extra["top_logit"] = seq.top_logit[:len(seq.out)]
    return RequestResult(id=seq.req.id, output_ids=seq.out, finish_reason=seq.finish, token_times=seq.times,
                         t_arrival=t_start, t_prefill_start=seq.t_prefill_start,
                         verifications=seq.verifications, extra=extra)


def _notify(seq: Sequence) -> None:
    if seq.req.on_finish is not None:
        seq.req.on_finish(list(seq.out), seq.finish)


def _check(engine: Engine, requests: Seq[Request]) -> None:
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


def _admit(engine: Engine, policy: Policy, slot_size: int, i: int, req: Request, params: SamplingParams,
           clock, steps: list[StepTrace]) -> Sequence:
    slot = engine.alloc(slot_size)
    gen = None
    if not params.greedy:
        gen = torch.Generator(device=engine.device)
        gen.manual_seed(params.seed * 1_000_003 + i)  # per request: independent of batch order
    seq = Sequence(index=i, req=req, slot=slot, gen=gen, t_prefill_start=clock(), state=policy.new_state())
    ids = req.prompt_ids
    capture = policy.prefill_capture()
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
        tok = sample(seq, out.logits[0][-1], params) if last else None
        t1 = clock()
        committed = commit(seq, [tok], t1, params.eos_token_ids) if last else 0
        steps.append(StepTrace(len(steps), t0, t1, [RowTrace(req.id, PREFILL, end - start, committed,
                                                           kv_read=out.kv_read[0],
                                                           kv_captured=out.kv_captured[0])]))
    if not restored and len(ids) > 1:
        engine.save_prefix(slot, ids[:-1])
    if capture:
        policy.scores(seq, out.captures.get(0, {}))
    t0 = clock()
    if not seq.finish and (n := policy.admitted(seq)):  # the policy's own prefill: a step of its own
        steps.append(StepTrace(len(steps), t0, clock(), [RowTrace(req.id, PREFILL, n, 0)]))
    return seq
