"""The simulated run: continuous batching on a simulated clock, as decoders/common.py runs it.

Requests are admitted in order while fewer than `batch` are active; an admitted request runs its
prefill rows (each a step of its own) and commits its first token. Then, step after step, the
policy gives each active request a row; the step costs the cost model's time for those rows; a
verification of d drafts accepts what the acceptance model says and commits a + 1 tokens. The
result is a GenerationOutput with simulated times, so every figure (decode tok/s, TPOT, ...) comes
from harness/metrics.py exactly as for a measured run.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..decoders.base import DECODE as K_DECODE
from ..decoders.base import DRAFT as K_DRAFT
from ..decoders.base import PREFILL, VERIFY, GenerationOutput, RequestResult, RowTrace, StepTrace
from .policies import DRAFT, SimState


@dataclass
class SimRequest:
    id: str
    prompt_len: int
    max_new: int  # output tokens, the first one from prefill
    prefill: list[tuple[int, int]] = field(default_factory=list)  # (tokens, KV read) per chunk; [] = free


def simulate(requests, policy, acceptance, cost, batch: int, info: dict | None = None) -> GenerationOutput:
    t = 0.0
    steps: list[StepTrace] = []
    waiting = deque(requests)
    active: list[SimState] = []
    done: dict[str, SimState] = {}

    def commit(st: SimState, n: int, when: float) -> int:
        n = min(n, st.max_new - st.out)
        st.out += n
        st.times.extend([when] * n)
        return n

    while waiting or active:
        while waiting and len(active) < batch:
            req = waiting.popleft()
            st = SimState(req.id, req.prompt_len, req.max_new)
            for i, (n, kv) in enumerate(req.prefill):
                t0, t = t, t + cost.step_time([(PREFILL, n, kv)])
                last = i == len(req.prefill) - 1
                steps.append(StepTrace(len(steps), t0, t, [RowTrace(req.id, PREFILL, n, commit(st, 1, t) if last
                                                                    else 0, kv_read=kv)]))
            if not req.prefill:
                commit(st, 1, t)
            st.sel_len = st.context_len - 1
            (done.__setitem__(st.id, st) if st.out >= st.max_new else active.append(st))
        if not active:
            continue
        plan = policy.plan(active, len(active))
        rows = [(st, r) for st, r in zip(active, plan) if r is not None]
        t0, t = t, t + cost.step_time([r for _, r in rows])
        trace = StepTrace(len(steps), t0, t)
        for st, (kind, n, kv) in rows:
            if kind == DRAFT:
                st.pending += 1
                trace.rows.append(RowTrace(st.id, K_DRAFT, 1, 0, kv_read=kv))
            elif kind == VERIFY:
                d = st.pending
                a = acceptance.accept(st.id, d, st.context_len + d)
                st.pending = 0
                c = commit(st, a + 1, t)
                st.verifications.append((d, a))
                policy.observe(st, d, a)
                trace.rows.append(RowTrace(st.id, VERIFY, n, c, drafted=d, accepted=a, kv_read=kv))
            else:
                trace.rows.append(RowTrace(st.id, K_DECODE, 1, commit(st, 1, t), kv_read=kv))
        steps.append(trace)
        for st in [s for s in active if s.out >= s.max_new]:
            active.remove(st)
            done[st.id] = st
    results = []
    for req in requests:
        st = done[req.id]
        extra = {"schedule": st.schedule} if st.schedule else {}
        results.append(RequestResult(req.id, [0] * st.out, "length", st.times, 0.0, 0.0, st.verifications, extra))
    return GenerationOutput(results, steps, 0.0, t, info=dict(info or {}))
