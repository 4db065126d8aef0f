"""The simulated run: continuous batching on a simulated clock, as decoders/loop.py runs it.

Requests are admitted in order while fewer than `batch` are active; an admitted request runs its
prefill rows (each a step of its own) and commits its first token. Then, step after step, the
policy gives each active request a row; the step costs the cost model's time for those rows (plus,
for a draft model, its own forwards' time by its own cost model); a verification of d drafts
accepts what the acceptance model says and commits a + 1 tokens. The result is a GenerationOutput with simulated times, so every figure (decode tok/s, TPOT, ...) comes
from harness/metrics.py exactly as for a measured run.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..decoders.base import DECODE as K_DECODE
from ..decoders.base import DRAFT as K_DRAFT
from ..decoders.base import PREFILL, VERIFY, GenerationOutput, RequestResult, RowTrace, StepTrace
from .policies import DRAFT


@dataclass
class SimRequest:
    id: str
    prompt_len: int
    max_new: int  # output tokens, the first one from prefill
    # (tokens, KV read, positions whose scores it captured[, of which for a top-k]) per chunk; [] = free
    prefill: list[tuple] = field(default_factory=list)
    # tokens of each prefill step of the policy's own model (a draft model's) after the target's
    own_prefill: list[int] = field(default_factory=list)


def simulate(requests, policy, acceptance, cost, batch: int, info: dict | None = None,
             own_cost=None) -> GenerationOutput:
    """`own_cost`: the step-cost model of the policy's own model (a draft model), for a policy with one."""
    if policy.own_model is not None and own_cost is None:
        raise ValueError(f"the policy runs forwards of {policy.own_model}: pass their step-cost model (own_cost)")
    t = 0.0
    steps: list[StepTrace] = []
    waiting = deque(enumerate(requests))
    active: list = []
    done: dict[str, object] = {}

    def commit(seq, n: int, when: float) -> int:
        n = min(n, seq.req.max_new_tokens - len(seq.out))
        seq.out.extend([0] * n)
        seq.times.extend([when] * n)
        return n

    def finished(seq) -> bool:
        return len(seq.out) >= seq.req.max_new_tokens

    while waiting or active:
        while waiting and len(active) < batch:
            i, req = waiting.popleft()
            seq = policy.new_sequence(i, req.id, req.prompt_len, req.max_new)
            for j, (n, kv, captured, *topk) in enumerate(req.prefill):
                topk = topk[0] if topk else 0
                t0, t = t, t + cost.step_time([(PREFILL, n, kv, 0, captured, 0, topk)])
                last = j == len(req.prefill) - 1
                steps.append(StepTrace(len(steps), t0, t, [RowTrace(req.id, PREFILL, n, commit(seq, 1, t) if last
                                                                    else 0, kv_read=kv, kv_captured=captured,
                                                                    kv_topk=topk)]))
            if not req.prefill:
                commit(seq, 1, t)
            for n in req.own_prefill:  # the prompt as one row reading its n positions (not decode time)
                t0, t = t, t + own_cost.step_time([(PREFILL, n, n, 0, 0)])
                steps.append(StepTrace(len(steps), t0, t, [RowTrace(req.id, PREFILL, n, 0)]))
            policy.admitted(seq)
            (done.__setitem__(req.id, seq) if finished(seq) else active.append(seq))
        if not active:
            continue
        rows = policy.plan(active, len(active))  # the requests left out sit the step out
        # a draft model's forwards run inside the step, before the target's
        own = sum(own_cost.step_time(fw) for fw in policy.own_forwards()) if own_cost else 0.0
        t0, t = t, t + own + cost.step_time([r for _, r in rows])
        trace = StepTrace(len(steps), t0, t)
        for seq, (kind, n, kv, sparse, captured, layered, topk) in rows:
            reads = {"kv_read": kv, "kv_sparse": sparse, "kv_captured": captured, "kv_layered": layered,
                     "kv_topk": topk}
            rid = seq.req.id
            if kind == DRAFT:
                seq.pending.append(0)
                trace.rows.append(RowTrace(rid, K_DRAFT, 1, 0, **reads))
            elif kind == VERIFY:
                d = len(seq.pending)
                a = acceptance.accept(rid, d, seq.context_len + d)
                seq.pending = []
                c = commit(seq, a + 1, t)
                seq.verifications.append((d, a))
                policy.observe(seq, d, a)
                trace.rows.append(RowTrace(rid, VERIFY, n, c, drafted=d, accepted=a, **reads))
            else:
                trace.rows.append(RowTrace(rid, K_DECODE, 1, commit(seq, 1, t), **reads))
        steps.append(trace)
        policy.step_done(trace)
        for seq in [s for s in active if finished(s)]:
            active.remove(seq)
            done[seq.req.id] = seq
    results = []
    for req in requests:
        seq = done[req.id]
        results.append(RequestResult(req.id, seq.out, "length", seq.times, 0.0, 0.0, seq.verifications,
                                     schedule=seq.schedule or None, draft_lengths=seq.draft_lengths or None,
                                     extra=dict(seq.extra)))
    return GenerationOutput(results, steps, 0.0, t, info=dict(info or {}))
