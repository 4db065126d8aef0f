"""The generation loop every decoder runs, and the policy contract that makes each method small.

The loop owns what must be the same for every method so that their comparisons are fair: admission,
chunked prefill, sampling and acceptance (the run's Sampler), commit rules, KV rollback, slot release
and the step traces. A method is a `Policy`: `plan(seqs, batch)` gives a step's rows, `observe` follows
each verification, optional hooks default to no-ops. A policy holds one run's state and a request's
lives in `RequestState.state`, so the simulator can drive a policy without an engine. A `Decoder` is
frozen settings, a policy class and traits, with no state between runs. The contract in full:
docs/adding-a-decoder.md; the loop's rules: docs/decoders.md."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch

from ..engine import TOKEN_MEAN, Capture, Engine, LayerTokenView, Row, TokenView, scattered_positions
from ..engine.batch import View
from ..errors import ConfigError
from .base import (
    DECODE,
    DRAFT,
    PREFILL,
    VERIFY,
    GenerationOutput,
    ParityMargins,
    Request,
    RequestResult,
    RowTrace,
    SamplingParams,
    StepTrace,
)
from .sampler import Sampler
from .scheduler import CostModel
from .state import RequestState


@dataclass
class Plan:
    """One row of a step: a sequence and what it does (DECODE | DRAFT | VERIFY)."""
    seq: RequestState
    kind: str
    view: View | list[View] = None  # DRAFT: the sparse view of the prefix (None = full)
    full_layers: frozenset[int] = frozenset()  # DRAFT: layers that attend fully despite the view
    capture: Capture | None = None  # scores to capture (handed to policy.scores)


class Policy:
    """Defaults for the optional hooks; the contract: docs/adding-a-decoder.md."""

    params: SamplingParams | None = None  # set by the loop for a run

    def __init__(self, settings, page_size: int, num_layers: int, cost: CostModel | None = None):
        """cost: the step-cost model of the run, for a policy that decides with one (else unused)."""
        self.settings, self.page_size, self.num_layers, self.cost = settings, page_size, num_layers, cost

    @classmethod
    def prepare(cls, settings, engine: Engine, batch_size: int, requests: Sequence[Request]) -> None:
        """Before a run's first generate (Decoder.prepare): nothing by default."""

    @classmethod
    def for_run(cls, settings, engine: Engine, batch_size: int, requests: Sequence[Request] = ()) -> Policy:
        return cls(settings, engine.page_size, engine.cfg.num_layers)

    # A replay (the simulator) of a stored run: each request's recorded verifications (drafted, accepted),
    # for a policy whose drafts come from the text, which a replay does not have (None otherwise).
    recorded: dict[str, list[tuple[int, int]]] | None = None

    @classmethod
    def for_simulation(cls, settings, page_size: int, num_layers: int, cost: CostModel | None = None,
                       stored: dict | None = None, recorded: dict | None = None) -> Policy:
        """The policy driven without an engine (the simulator). `stored`: the replayed run's info (its
        settings and what its policy reported); `recorded`: its requests' verifications. Both None
        for a parametric setting."""
        policy = cls(settings, page_size, num_layers, cost)
        policy.recorded = recorded
        return policy

    def new_state(self):
        return None

    def admitted(self, seq: RequestState) -> int:
        """After the prompt's prefill: the tokens of the policy's own prefill (0 = none)."""
        return 0

    def prefill_capture(self) -> Capture | None:
        """Scores to capture at the last prompt token (seeds a sparse draft view)."""
        return None

    def plan(self, seqs: list[RequestState], batch: int) -> list[Plan]:
        raise NotImplementedError

    def observe(self, seq: RequestState, drafted: int, accepted: int) -> None:
        pass

    def scores(self, seq: RequestState, scores: dict[int, torch.Tensor]) -> None:
        pass

    def step_done(self, trace: StepTrace) -> None:
        pass

    def info(self) -> dict:
        return {}

    def own_model(self) -> Path | None:
        """The checkpoint of a model the policy runs forwards of itself (a draft model); None when its
        drafts are target forwards or need no forward at all."""
        return None

    def own_forwards(self) -> list[list[tuple[int, int]]]:
        """Driven without an engine: the forwards of `own_model` that this step's plan ran before the
        target's, each its rows (tokens, KV positions read per layer). The simulator prices them with
        that model's shape."""
        return []

    # --- what a planned row reads, without running it (the simulator prices rows with these) ---------
    def reads(self, plan: Plan) -> tuple[int, int, int, int, int]:
        """(KV positions read per layer, of which scattered through a sparse view, positions whose
        scores it captures, kv_layered, kv_topk) of a planned row, as the engine and the loop count them
        (ForwardOutput, shaped_reads)."""
        seq = plan.seq
        n = len(seq.pending) + 1 if plan.kind == VERIFY else 1
        prefix = seq.context_len - 1 + (0 if plan.kind == VERIFY else len(seq.pending))
        kv, scattered = self.draft_reads(plan, prefix) if plan.kind == DRAFT else (prefix + n, 0)
        captured = self.captured(plan, n, prefix + n)
        return kv, scattered, captured, *shaped_reads(plan.view, plan.capture, scattered, captured)

    def draft_reads(self, plan: Plan, prefix: int) -> tuple[int, int]:
        """(KV read, of which scattered) of a draft row over `prefix` positions, its own token included:
        full without a view, a TokenView's positions; a policy with other views overrides this."""
        if plan.view is None:
            return prefix + 1, 0
        if isinstance(plan.view, TokenView):
            return len(plan.view.positions) + 1, scattered_positions(plan.view.positions)
        raise NotImplementedError(f"{type(self).__name__}.draft_reads: a {type(plan.view).__name__} draft")

    def captured(self, plan: Plan, n: int, kv: int) -> int:
        """Positions whose scores a row of n tokens over kv positions captures, per layer (mean)."""
        c = plan.capture
        if c is None:
            return 0
        queries = len({q % n for q in c.queries})
        return round(queries * kv * len(c.layers) / self.num_layers)


def shaped_reads(view, capture: Capture | None, sparse: int, captured: int) -> tuple[int, int]:
    """(kv_layered, kv_topk) of a row (RowTrace): its scattered read when its view differs per layer, its
    captured positions when it captures per-token scores (Vegas's, whose top-k per layer follows)."""
    per_layer = isinstance(view, (list, LayerTokenView))
    return (sparse if per_layer else 0), (captured if capture is not None and capture.reduce == TOKEN_MEAN else 0)


# --- commit and one step: the same for every method ------------------------------------------------
def commit(seq: RequestState, tokens: Sequence[int], t: float, eos: tuple[int, ...]) -> int:
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


def finish_verify(engine, seq: RequestState, accepted: int, nxt: int, t: float,
                  eos: tuple[int, ...]) -> tuple[int, int, int]:
    """Roll the KV back to the exact prefix, commit the accepted drafts and the token after them:
    (drafted, accepted, committed)."""
    drafts = seq.pending
    engine.rollback(seq.slot, seq.context_len + accepted)  # last committed token + accepted drafts
    committed = commit(seq, drafts[:accepted] + [nxt], t, eos)
    seq.verifications.append((len(drafts), accepted))
    seq.pending, seq.qs = [], []
    return len(drafts), accepted, committed


def _row(p: Plan) -> Row:
    seq = p.seq
    if p.kind == VERIFY:
        return Row(seq.slot, [seq.out[-1]] + seq.pending, seq.context_len - 1, logits="all", capture=p.capture)
    token = seq.pending[-1] if seq.pending else seq.out[-1]
    return Row(seq.slot, [token], seq.context_len - 1 + len(seq.pending), view=p.view,
               full_layers=p.full_layers, capture=p.capture)


def run_step(engine: Engine, policy: Policy, sampler: Sampler, seqs: list[RequestState], clock) -> StepTrace:
    """One engine forward over the policy's plan for the active sequences, sampled and applied."""
    t0 = clock()
    plans = policy.plan(seqs, len(seqs))
    out = engine.forward([_row(p) for p in plans])
    picks = sampler.step([(p.seq, p.kind) for p in plans], out.logits)
    t1 = clock()
    eos = sampler.params.eos_token_ids
    trace = StepTrace(0, t0, t1)
    for i, (p, (tok, a)) in enumerate(zip(plans, picks, strict=True)):
        seq, reads = p.seq, {"kv_read": out.kv_read[i], "kv_sparse": out.kv_sparse[i], "kv_captured": out.kv_captured[i]}
        reads["kv_layered"], reads["kv_topk"] = shaped_reads(p.view, p.capture, out.kv_sparse[i], out.kv_captured[i])
        if p.kind == DECODE:
            rt = RowTrace(seq.req.id, DECODE, 1, commit(seq, [tok], t1, eos), **reads)
        elif p.kind == DRAFT:
            seq.pending.append(tok)
            rt = RowTrace(seq.req.id, DRAFT, 1, 0, **reads)
        else:
            d, a, n = finish_verify(engine, seq, a, tok, t1, eos)
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
    """Settings + a policy class, and the traits the harness, bench, step costs and simulator read
    (through decoders.trait, which gives a plug-in that sets none the defaults below)."""

    name = "base"
    Settings: type = NoSettings
    Policy: type = Policy
    needs_reference = False  # True: the harness runs AR first and sets Request.reference_ids
    description = ""  # one line: `aspire-bench decoders`
    baseline = False  # a published method the others are compared with ("x best baseline")
    ablation = False  # a variant of another decoder, run by name only (not in bench's default set)
    draft_kind: str | None = None  # the draft row step costs time and the simulator prices (None: no drafts)
    tune_grid: ClassVar[dict[str, tuple]] = {}  # bench's tuned row: settings -> values tried ({}: not tuned)
    # `aspire-bench simulate` can model it (its policy runs without an engine): True, "replay" (only a
    # stored run of it: its drafts need what the run recorded or used), False
    simulated: bool | str = True
    uses_cost_model = False  # its policy decides with the step-cost model (Policy.cost)
    host_drafts = False  # its drafts need no forward (a lookup on the host): step costs put c = 0

    @classmethod
    def draft_engine(cls, engine: Engine) -> Engine | None:
        """The engine whose one-token step is this decoder's draft step at its default settings, when
        that is not the target's (a separate draft model): step costs time it for c. None: the target's."""
        return None

    def __init__(self, **settings):
        self.config = self.Settings(**settings)

    def settings(self) -> dict:
        describe = getattr(self.config, "describe", None)
        return describe() if describe else asdict(self.config)

    def prepare(self, engine: Engine, batch_size: int, requests: Sequence[Request]) -> None:
        """Called by the runner before the warm-up: whatever the policy must measure or store before
        its runs (Policy.prepare), so that generate itself need not."""
        self.Policy.prepare(self.config, engine, batch_size, requests)

    def generate(self, engine: Engine, requests: Sequence[Request], params: SamplingParams,
                 batch_size: int, progress: Callable[[int], None] | None = None) -> GenerationOutput:
        if batch_size < 1:
            raise ConfigError("--batch-size must be at least 1")
        _check(engine, requests)
        policy = self.Policy.for_run(self.config, engine, batch_size, requests)
        sampler = Sampler(params, engine.device, engine.cfg.vocab_size)
        policy.params = params
        # Equal slots of the longest request's size: any freed slot fits any waiting request, so
        # continuous batching never fragments the pool.
        ps = engine.page_size
        slot_size = -(-max(len(r.prompt_ids) + r.max_new_tokens for r in requests) // ps) * ps
        engine.reserve(slot_size * min(batch_size, len(requests)))
        clock = time.perf_counter
        t_start = clock()
        waiting = deque(enumerate(requests))
        active: list[RequestState] = []
        done: dict[int, RequestState] = {}
        steps: list[StepTrace] = []
        while waiting or active:
            wave = []
            while waiting and len(active) < batch_size:
                i, req = waiting.popleft()
                seq = _admit(engine, policy, sampler, slot_size, i, req, clock, steps, progress)
                wave.append(seq)
                if progress:
                    progress(len(seq.out))
                if seq.finish:
                    done[i] = seq
                    engine.free(seq.slot)
                    _notify(seq)
                else:
                    active.append(seq)
            # The paper's setting: the requests admitted together are prefilled before their decode
            # steps, and their first tokens count from the end of that prefill, so no request's decode
            # window (TPOT, ITL) holds the prefill of the others admitted with it.
            if wave:  # only on steps that admitted requests: no clock read otherwise
                t_wave = clock()
                for seq in wave:
                    seq.times[:1] = [t_wave] if seq.times else []
            if not active:
                continue
            before = sum(len(s.out) for s in active)
            trace = run_step(engine, policy, sampler, active, clock)
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


def _result(seq: RequestState, t_start: float) -> RequestResult:
    n = len(seq.out)
    margins = ParityMargins(seq.margins[:n], seq.runner_up[:n], seq.top_logit[:n]) if seq.margins else None
    return RequestResult(id=seq.req.id, output_ids=seq.out, finish_reason=seq.finish, token_times=seq.times,
                         t_arrival=t_start, t_prefill_start=seq.t_prefill_start,
                         verifications=seq.verifications, margins=margins, schedule=seq.schedule or None,
                         draft_lengths=seq.draft_lengths or None, extra=dict(seq.extra))


def _notify(seq: RequestState) -> None:
    if seq.req.on_finish is not None:
        seq.req.on_finish(list(seq.out), seq.finish)


def _check(engine: Engine, requests: Sequence[Request]) -> None:
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


def _admit(engine: Engine, policy: Policy, sampler: Sampler, slot_size: int, i: int, req: Request,
           clock, steps: list[StepTrace], progress: Callable[[int], None] | None = None) -> RequestState:
    slot = engine.alloc(slot_size)
    gen, params = None, sampler.params
    if not params.greedy:
        gen = torch.Generator(device=engine.device)
        gen.manual_seed(params.seed * 1_000_003 + i)  # per request: independent of batch order
    seq = RequestState(index=i, req=req, slot=slot, gen=gen, t_prefill_start=clock(), state=policy.new_state())
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
        tok = sampler.sample(seq, out.logits[0][-1]) if last else None
        t1 = clock()
        committed = commit(seq, [tok], t1, params.eos_token_ids) if last else 0
        steps.append(StepTrace(len(steps), t0, t1, [RowTrace(req.id, PREFILL, end - start, committed,
                                                           kv_read=out.kv_read[0],
                                                           kv_captured=out.kv_captured[0],
                                                           kv_topk=shaped_reads(None, row.capture, 0,
                                                                                out.kv_captured[0])[1])]))
        if progress and not last:  # no token yet: a heartbeat, so a log shows a minutes-long prefill alive
            progress(0)
    if not restored and len(ids) > 1:
        engine.save_prefix(slot, ids[:-1])
    if capture:
        policy.scores(seq, out.captures.get(0, {}))
    t0 = clock()
    if not seq.finish and (n := policy.admitted(seq)):  # the policy's own prefill: a step of its own
        steps.append(StepTrace(len(steps), t0, clock(), [RowTrace(req.id, PREFILL, n, 0)]))
    return seq
