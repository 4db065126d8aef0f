"""Figures derived from decoder outputs. Pure functions: no timing, no I/O.

Every figure is defined in docs/metrics.md; keep the two in step.
"""
from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from aspire_bench.decoders.base import PREFILL, GenerationOutput, RequestResult, StepTrace
from aspire_bench.harness.parity import Parity
from aspire_bench.harness.parity import summarize as summarize_parity
from aspire_bench.textstats import distinct_n

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


def decode_windows(results: Iterable[RequestResult]) -> list[tuple[float, float]]:
    """Each request's decode window: from its first token to its last (requests with >= 2 tokens)."""
    return [(r.token_times[0], r.token_times[-1]) for r in results if len(r.token_times) > 1]


def counts_as_decode(step: StepTrace) -> bool:
    """A step is decode time when it carries a decode, draft or verify row; prefill-only steps never
    are, even when they run between other requests' decode steps (docs/metrics.md#throughput)."""
    return any(r.kind != PREFILL for r in step.rows)


def decode_wall_time(steps: Iterable[StepTrace], results: Iterable[RequestResult] = ()) -> float:
    """Seconds of the steps that decode (`results` is accepted for callers that pass it; unused)."""
    return sum(s.wall for s in steps if counts_as_decode(s))


def prefill_wall_time(steps: Iterable[StepTrace]) -> float:
    """Seconds of the prefill-only steps: the prefill time reported apart from decode time."""
    return sum(s.wall for s in steps if not counts_as_decode(s))


def prefill_in_decode_time(steps: Iterable[StepTrace], results: Iterable[RequestResult]) -> float:
    """The prefill-only steps run inside some request's decode window (refills stalling the others):
    reported apart, never part of decode wall."""
    windows = decode_windows(results)
    return sum(s.wall for s in steps if not counts_as_decode(s)
               and any(a <= s.t_start and s.t_end <= b for a, b in windows))


def request_decode_times(output: GenerationOutput) -> dict[str, tuple[int, float]]:
    """request id -> (generated tokens, decode seconds charged to it).

    A step with decode/draft/verify rows is split among those rows in proportion to the tokens each
    put through the forward; prefill-only steps are charged to no one. The charges add up to
    decode_wall_time, so the throughput of any subset of requests is (their tokens) / (their charged
    time). The bootstrap intervals resample these.
    """
    charged: dict[str, float] = {r.id: 0.0 for r in output.results}
    for s in output.steps:
        rows = [r for r in s.rows if r.kind != PREFILL]
        n = sum(r.n_tokens for r in rows)
        for r in rows:
            charged[r.request] = charged.get(r.request, 0.0) + s.wall * r.n_tokens / n
    return {r.id: (max(len(r.output_ids) - 1, 0), charged[r.id]) for r in output.results}


def generated_tokens(results: Iterable[RequestResult]) -> int:
    """Output tokens made by decoding: each request's first token comes from prefill, so it is left out."""
    return sum(max(len(r.output_ids) - 1, 0) for r in results)


def decode_tok_s(output: GenerationOutput) -> float | None:
    wall = decode_wall_time(output.steps, output.results)
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
    itl_s: list[float]  # one gap per step that committed >= 1 token (as vLLM: one per streamed chunk)


def request_latency(r: RequestResult) -> Latency | None:
    """None for a request that produced no token."""
    t = r.token_times
    if not t:
        return None
    ttft = t[0] - r.t_arrival
    e2e = t[-1] - r.t_arrival
    tpot = (e2e - ttft) / (len(t) - 1) if len(t) > 1 else None
    commits = [t[0]] + [b for a, b in itertools.pairwise(t) if b != a]  # tokens of one step share a time
    return Latency(ttft, t[0] - r.t_prefill_start, tpot, e2e, [b - a for a, b in itertools.pairwise(commits)])


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


DEFAULT_PERCENTILES = (50, 90, 99)


def check_percentiles(qs) -> None:
    """ConfigError unless qs is a non-empty sequence of distinct numbers in 0..100: checked before a run,
    so a bad one never throws a measurement away."""
    import math

    from aspire_bench.errors import ConfigError
    ok = isinstance(qs, (list, tuple)) and len(qs) > 0 and all(
        isinstance(q, (int, float)) and not isinstance(q, bool) and math.isfinite(q) and 0 <= q <= 100 for q in qs)
    if not ok:
        raise ConfigError(f"percentiles {qs!r} must be a non-empty list of numbers in 0..100, such as (50, 90, 99)")
    if len({float(q) for q in qs}) != len(qs):
        raise ConfigError(f"percentiles {qs!r} name one percentile twice: keep one")


def _percentiles(prefix: str, values: Sequence[float], qs: Sequence[float]) -> dict[str, float | None]:
    """Latency mean, median and quantiles named `{prefix}_mean_s`, `{prefix}_median_s`, `{prefix}_p{q}_s`."""
    out = {f"{prefix}_mean_s": _mean(values), f"{prefix}_median_s": percentile(values, 50)}
    out.update({f"{prefix}_p{q:g}_s": percentile(values, q) for q in qs})
    return out


def aggregate(
    output: GenerationOutput,
    scores: Mapping[str, float | None] | None = None,
    parity: Mapping[str, Parity] | None = None,
    prompt_lens: Mapping[str, int] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
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
    duration = output.t_end - output.t_start
    output_tokens = sum(len(r.output_ids) for r in results)
    input_tokens = sum(prompt_lens.get(r.id, 0) for r in results) if prompt_lens else None

    out: dict[str, float | int | None] = {
        "n_requests": len(results),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "generated_tokens": generated_tokens(results),
        "n_steps": len(output.steps),
        "total_wall_s": duration,
        "decode_wall_s": decode_wall_time(output.steps, results),
        "prefill_wall_s": prefill_wall_time(output.steps),
        "prefill_in_decode_s": prefill_in_decode_time(output.steps, results),
        "decode_tok_s": decode_tok_s(output),
        "e2e_tok_s": e2e_tok_s(output),
        "request_throughput": len(results) / duration if duration > 0 else None,
        "total_token_throughput": (input_tokens + output_tokens) / duration
        if duration > 0 and input_tokens is not None else None,
    }
    out.update(_percentiles("ttft", [lat.ttft_s for lat in lats], percentiles))
    out.update(_percentiles("ttft_prefill", [lat.ttft_prefill_s for lat in lats], percentiles))
    out.update(_percentiles("tpot", [lat.tpot_s for lat in lats if lat.tpot_s is not None], percentiles))
    out.update(_percentiles("itl", gaps, percentiles))
    out.update(_percentiles("e2e", [lat.e2e_s for lat in lats], percentiles))

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


# --- intervals --------------------------------------------------------------------------------

Sample = tuple[int, float]  # (generated tokens, charged decode seconds) of one request in one repeat


def ratio_ci(num: Mapping, den: Mapping, n_boot: int = 2000, seed: int = 0,
             level: float = 0.95, blocks: Mapping | None = None) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of (tokens/time of `num`) / (tokens/time of `den`).

    num and den map the same keys, (request id, repeat), to Samples: one resample draws len(keys)
    keys with replacement, the same keys for both (paired: a hard prompt is hard for both decoders),
    and recomputes each side's total tokens / total time. blocks (key -> block, e.g. the round in
    time that measured it): resample whole blocks instead, so the interval sees what moves between
    blocks (the machine's state). None when the keys differ or are too few (fewer than 2 blocks).
    """
    keys = sorted(num, key=str)
    if len(keys) < 2 or set(keys) != set(den):
        return None
    groups: dict = {}
    for k in keys:
        groups.setdefault(blocks.get(k, k) if blocks is not None else k, []).append(k)
    if len(groups) < 2:
        return None
    # per unit (a key or a block): summed (tokens, seconds) of each side
    units = []
    for members in groups.values():
        units.append((sum(num[k][0] for k in members), sum(num[k][1] for k in members),
                      sum(den[k][0] for k in members), sum(den[k][1] for k in members)))
    rng = random.Random(seed)
    ratios = []
    for _ in range(n_boot):
        idx = [rng.randrange(len(units)) for _ in units]
        at, as_ = sum(units[i][0] for i in idx), sum(units[i][1] for i in idx)
        bt, bs = sum(units[i][2] for i in idx), sum(units[i][3] for i in idx)
        if as_ > 0 and bs > 0 and bt > 0:
            ratios.append((at / as_) / (bt / bs))
    if not ratios:
        return None
    tail = 100 * (1 - level) / 2
    return percentile(ratios, tail), percentile(ratios, 100 - tail)


def ratio(num: Mapping, den: Mapping) -> float | None:
    """(Σ tokens / Σ time of num) / (Σ tokens / Σ time of den): the point estimate ratio_ci brackets."""
    nt, ns = sum(x[0] for x in num.values()), sum(x[1] for x in num.values())
    dt, ds = sum(x[0] for x in den.values()), sum(x[1] for x in den.values())
    return (nt / ns) / (dt / ds) if ns > 0 and ds > 0 and dt > 0 else None


# --- the bound step costs allow ---------------------------------------------------------------


def allowed_speedup(verifications: Sequence[tuple[int, int]], c: float, v_by_gamma: Mapping[int, float]) -> float | None:
    """Speedup over AR that the measured step costs allow at the acceptance actually realised:
    Σ (a_i + 1) / Σ (d_i c + v(d_i)) over the run's verifications (d drafted, a accepted), costs in
    units of one AR step of the same batch and context. v(d) beyond the measured drafts is
    extrapolated linearly from the last two measured points. None without verifications."""
    if not verifications:
        return None
    gs = sorted(v_by_gamma)

    def v(d: int) -> float:
        if d in v_by_gamma:
            return v_by_gamma[d]
        g1, g2 = gs[-2], gs[-1]
        return v_by_gamma[g2] + (d - g2) * (v_by_gamma[g2] - v_by_gamma[g1]) / (g2 - g1)

    cost = sum(d * c + v(d) for d, _ in verifications)
    return sum(a + 1 for _, a in verifications) / cost if cost > 0 else None
