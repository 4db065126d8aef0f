"""Figures derived from decoder outputs. Pure functions: no timing, no I/O.

Every figure is defined in docs/metrics.md; keep the two in step.
"""
from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from aspire_bench.decoders.base import PREFILL, GenerationOutput, RequestResult, StepTrace
from aspire_bench.textstats import distinct_n

# Absolute top1-top2 logit gap (fp32 logits) under which a greedy divergence counts as benign
# numerics. See docs/metrics.md#exactness-parity for why 0.01.
NEAR_TIE_THRESHOLD = 0.01
# distinct-4 below this flags a request whose output collapsed into repetition.
COLLAPSE_THRESHOLD = 0.5


def percentile(values: Iterable[float], q: float) -> float | None:
    """q-th percentile (0..100), linear between closest ranks (numpy's default); None when empty."""
    xs = list(values)
    return float(np.percentile(xs, q)) if xs else None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_repeats(values: Sequence[float]) -> dict[str, float]:
    """min / median / max over the measured repeats of one figure (warm-up run already left out)."""
    if not values:
        raise ValueError("summarize_repeats needs at least one value")
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


# --- throughput -------------------------------------------------------------------------------


def decode_share(step: StepTrace) -> float:
    """Fraction of a step's wall time that counts as decode: its non-prefill tokens / all its tokens.

    A step without prefill rows is all decode; a mixed step (continuous batching) is split in
    proportion to tokens, the simplest rule that needs no per-row timing.
    """
    prefill = sum(r.n_tokens for r in step.rows if r.kind == PREFILL)
    if prefill == 0:
        return 1.0
    return (step.n_tokens - prefill) / step.n_tokens


def decode_wall_time(steps: Iterable[StepTrace]) -> float:
    return sum(s.wall * decode_share(s) for s in steps)


def generated_tokens(results: Iterable[RequestResult]) -> int:
    """Output tokens made by decoding: each request's first token comes from prefill, so it is left out."""
    return sum(max(len(r.output_ids) - 1, 0) for r in results)


def decode_tok_s(output: GenerationOutput) -> float | None:
    wall = decode_wall_time(output.steps)
    return generated_tokens(output.results) / wall if wall > 0 else None


def e2e_tok_s(output: GenerationOutput) -> float | None:
    wall = output.t_end - output.t_start
    return sum(len(r.output_ids) for r in output.results) / wall if wall > 0 else None


# --- latency ----------------------------------------------------------------------------------


@dataclass
class Latency:
    ttft_s: float  # first token - arrival (queueing included)
    ttft_prefill_s: float  # first token - this request's prefill start
    tpot_s: float | None  # (e2e - ttft) / (n - 1); None for a one-token output
    e2e_s: float  # last token - arrival
    itl_s: list[float]  # gaps between consecutive tokens; 0 inside one verification's commit


def request_latency(r: RequestResult) -> Latency | None:
    """None for a request that produced no token."""
    t = r.token_times
    if not t:
        return None
    ttft = t[0] - r.t_arrival
    e2e = t[-1] - r.t_arrival
    tpot = (e2e - ttft) / (len(t) - 1) if len(t) > 1 else None
    return Latency(ttft, t[0] - r.t_prefill_start, tpot, e2e, [b - a for a, b in itertools.pairwise(t)])


# --- acceptance -------------------------------------------------------------------------------


def accepted_lengths(r: RequestResult) -> list[int]:
    """Tokens committed per verification, the correction/bonus token included (a + 1).

    AR has no verifications: each decoded token is its own step of length 1.
    """
    if r.verifications:
        return [a + 1 for _, a in r.verifications]
    return [1] * max(len(r.output_ids) - 1, 0)


def draft_acceptance_rate(verifications: Sequence[tuple[int, int]]) -> float | None:
    """Σ accepted / Σ drafted; None when nothing was drafted (AR)."""
    drafted = sum(d for d, _ in verifications)
    return sum(a for _, a in verifications) / drafted if drafted else None


def acceptance_by_position(verifications: Sequence[tuple[int, int]]) -> list[float]:
    """rate[k] = P(draft position k accepted | the draft had >= k+1 tokens), k from 0."""
    longest = max((d for d, _ in verifications), default=0)
    rates = []
    for k in range(longest):
        reached = [a for d, a in verifications if d > k]
        rates.append(sum(1 for a in reached if a > k) / len(reached))
    return rates


# --- exactness parity -------------------------------------------------------------------------

IDENTICAL, NEAR_TIE, MISMATCH, LENGTH = "identical", "near-tie", "mismatch", "length"


@dataclass
class Parity:
    kind: str  # IDENTICAL | NEAR_TIE | MISMATCH | LENGTH
    first_divergence: int | None  # first position where the tokens differ (or the shorter length)
    margin: float | None  # AR's top1-top2 logit gap at first_divergence, when recorded
    matched: int  # length of the common prefix
    length: int  # max(len(spec), len(ar))

    @property
    def identical(self) -> bool:
        return self.kind == IDENTICAL


def parity(
    spec_ids: Sequence[int], ar_ids: Sequence[int], ar_margins: Sequence[float] | None,
    near_tie_threshold: float = NEAR_TIE_THRESHOLD,
) -> Parity:
    """Compare a greedy speculative output with the AR output of the same request.

    Only the first divergence matters: after it the two continue from different prefixes.
    """
    common = min(len(spec_ids), len(ar_ids))
    pos = next((i for i in range(common) if spec_ids[i] != ar_ids[i]), None)
    length = max(len(spec_ids), len(ar_ids))
    if pos is None:
        # Equal over the common length: a length difference is a stopping-rule difference, not numerics.
        kind = IDENTICAL if len(spec_ids) == len(ar_ids) else LENGTH
        return Parity(kind, None if kind == IDENTICAL else common, None, common, length)
    margin = ar_margins[pos] if ar_margins is not None and pos < len(ar_margins) else None
    # An unknown margin cannot excuse a divergence.
    kind = NEAR_TIE if margin is not None and margin < near_tie_threshold else MISMATCH
    return Parity(kind, pos, margin, pos, length)


def summarize_parity(items: Iterable[Parity]) -> dict[str, float | int | None]:
    items = list(items)
    length = sum(p.length for p in items)
    counts = {k: sum(1 for p in items if p.kind == k) for k in (IDENTICAL, NEAR_TIE, MISMATCH, LENGTH)}
    return {
        "parity_n": len(items),
        "parity_identical_pct": 100.0 * counts[IDENTICAL] / len(items) if items else None,
        "parity_identical_token_pct": 100.0 * sum(p.matched for p in items) / length if length else None,
        "parity_near_tie": counts[NEAR_TIE],
        "parity_mismatch": counts[MISMATCH],
        "parity_length": counts[LENGTH],
    }


# --- per request and per run ------------------------------------------------------------------


def request_figures(r: RequestResult) -> dict[str, float | None]:
    """The per-request figures stored with each request row."""
    lat = request_latency(r)
    lengths = accepted_lengths(r)
    return {
        "ttft_s": lat.ttft_s if lat else None,
        "ttft_prefill_s": lat.ttft_prefill_s if lat else None,
        "tpot_s": lat.tpot_s if lat else None,
        "e2e_s": lat.e2e_s if lat else None,
        "mean_accepted_len": _mean(lengths),
        "distinct4": distinct_n(r.output_ids, 4),
    }


def _percentiles(prefix: str, values: Sequence[float], qs: Sequence[int]) -> dict[str, float | None]:
    """Latency quantiles named `{prefix}_p{q}_s`."""
    return {f"{prefix}_p{q}_s": percentile(values, q) for q in qs}


def aggregate(
    output: GenerationOutput,
    scores: Mapping[str, float | None] | None = None,
    parity: Mapping[str, Parity] | None = None,
) -> dict[str, float | int | None]:
    """All run-level figures, flat name -> number (None where a figure does not apply).

    `scores` and `parity` are keyed by request id; requests missing from them are left out.
    """
    results = output.results
    lats = [lat for lat in map(request_latency, results) if lat is not None]
    gaps = [g for lat in lats for g in lat.itl_s]
    verifications = [v for r in results for v in r.verifications]
    lengths = [n for r in results for n in accepted_lengths(r)]
    per_request_len = [m for m in (_mean(accepted_lengths(r)) for r in results) if m is not None]
    distinct = [d for d in (distinct_n(r.output_ids, 4) for r in results) if d is not None]
    score_values = [s for s in (scores or {}).values() if s is not None]

    out: dict[str, float | int | None] = {
        "n_requests": len(results),
        "output_tokens": sum(len(r.output_ids) for r in results),
        "generated_tokens": generated_tokens(results),
        "n_steps": len(output.steps),
        "total_wall_s": output.t_end - output.t_start,
        "decode_wall_s": decode_wall_time(output.steps),
        "decode_tok_s": decode_tok_s(output),
        "e2e_tok_s": e2e_tok_s(output),
    }
    out.update(_percentiles("ttft", [lat.ttft_s for lat in lats], (50, 90, 99)))
    out.update(_percentiles("ttft_prefill", [lat.ttft_prefill_s for lat in lats], (50, 90, 99)))
    out["tpot_mean_s"] = _mean([lat.tpot_s for lat in lats if lat.tpot_s is not None])
    out.update(_percentiles("tpot", [lat.tpot_s for lat in lats if lat.tpot_s is not None], (50, 90, 99)))
    out.update(_percentiles("itl", gaps, (50, 90, 99)))
    out["itl_zero_frac"] = sum(1 for g in gaps if g == 0) / len(gaps) if gaps else None
    out.update(_percentiles("e2e", [lat.e2e_s for lat in lats], (50, 90, 99)))

    out["n_verifications"] = len(verifications)
    out["mean_accepted_len"] = _mean(lengths)
    out["draft_acceptance_rate"] = draft_acceptance_rate(verifications)
    for k, rate in enumerate(acceptance_by_position(verifications)):
        out[f"accept_rate_pos{k}"] = rate
    for q in (0, 10, 50, 90, 100):
        out[f"req_accepted_len_p{q}"] = percentile(per_request_len, q)

    out["distinct4_mean"] = _mean(distinct)
    out["distinct4_min"] = min(distinct, default=None)
    out["repetition_collapse_n"] = sum(1 for d in distinct if d < COLLAPSE_THRESHOLD)

    out["score_n"] = len(score_values)
    out["score_mean"] = _mean(score_values)
    if parity is not None:
        out.update(summarize_parity(parity.values()))
    return out
