"""Every metric on hand-built traces, expected values worked out by hand (docs/metrics.md)."""
import re
from pathlib import Path

import pytest

from aspire_bench.decoders.base import (
    DECODE,
    PREFILL,
    VERIFY,
    GenerationOutput,
    ParityMargins,
    RequestResult,
    RowTrace,
    StepTrace,
)
from aspire_bench.harness import metrics
from aspire_bench.harness.metrics import (
    acceptance_by_position,
    accepted_lengths,
    aggregate,
    counts_as_decode,
    decode_wall_time,
    decode_windows,
    draft_acceptance_rate,
    generated_tokens,
    percentile,
    request_latency,
    summarize_repeats,
)
from aspire_bench.harness.parity import compare
from aspire_bench.textstats import distinct_n

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def step(i, t0, t1, *rows):
    return StepTrace(i, t0, t1, [RowTrace(*r) for r in rows])


def spec_output():
    """Two requests. A: prefill alone in step 0; B's prefill shares step 1 with A's first verify."""
    steps = [
        step(0, 0.0, 1.0, ("A", PREFILL, 100, 1)),                      # all prefill: 0 s of decode
        step(1, 1.0, 1.5, ("B", PREFILL, 6, 1), ("A", VERIFY, 4, 4, 3, 3)),  # has a verify row: 0.5 s
        step(2, 1.5, 1.75, ("A", VERIFY, 4, 2, 3, 1), ("B", VERIFY, 3, 3, 2, 2)),   # 0.25 s
        step(3, 1.75, 2.0, ("A", VERIFY, 4, 1, 3, 0), ("B", VERIFY, 5, 3, 4, 2)),   # 0.25 s
    ]
    a = RequestResult("A", [1, 2, 3, 4, 5, 6, 7, 8], "length",
                      token_times=[1.0, 1.5, 1.5, 1.5, 1.5, 1.75, 1.75, 2.0],
                      t_arrival=0.0, t_prefill_start=0.0, verifications=[(3, 3), (3, 1), (3, 0)])
    b = RequestResult("B", [9, 9, 9, 9, 9, 9, 9], "eos",
                      token_times=[1.5, 1.75, 1.75, 1.75, 2.0, 2.0, 2.0],
                      t_arrival=0.0, t_prefill_start=1.0, verifications=[(2, 2), (4, 2)])
    return GenerationOutput([a, b], steps, t_start=0.0, t_end=2.5)


def test_decode_time_counts_steps_with_decode_rows_whole():
    out = spec_output()
    windows = decode_windows(out.results)
    assert windows == [(1.0, 2.0), (1.5, 2.0)]
    assert [counts_as_decode(s) for s in out.steps] == [False, True, True, True]
    assert decode_wall_time(out.steps, out.results) == pytest.approx(1.0)
    assert metrics.prefill_wall_time(out.steps) == pytest.approx(1.0)
    assert metrics.prefill_in_decode_time(out.steps, out.results) == 0.0


def test_request_decode_times_split_each_step_by_tokens_and_add_up():
    out = spec_output()
    t = metrics.request_decode_times(out)
    # A: all of step 1, 4/7 of step 2, 4/9 of step 3; B: 3/7 and 5/9.
    assert t["A"] == (7, pytest.approx(0.5 + 0.25 * 4 / 7 + 0.25 * 4 / 9))
    assert t["B"] == (6, pytest.approx(0.25 * 3 / 7 + 0.25 * 5 / 9))
    assert sum(sec for _, sec in t.values()) == pytest.approx(decode_wall_time(out.steps, out.results))


def interleaved_output():
    """X decodes one token per 10 ms step; between its steps, Y's prompt prefills in 100 ms chunks;
    Y's last chunk (its first token) comes after X finished."""
    steps, times, t = [], [0.0], 0.0
    for i in range(10):
        steps.append(step(2 * i, t, t + 0.1, ("Y", PREFILL, 1024, 0)))
        steps.append(step(2 * i + 1, t + 0.1, t + 0.11, ("X", DECODE, 1, 1)))
        t += 0.11
        times.append(t)
    steps.append(step(20, t, t + 0.1, ("Y", PREFILL, 1024, 1)))
    x = RequestResult("X", list(range(11)), "length", token_times=times, t_arrival=0.0, t_prefill_start=0.0)
    y = RequestResult("Y", [7], "length", token_times=[t + 0.1], t_arrival=0.0, t_prefill_start=0.0)
    return GenerationOutput([x, y], steps, 0.0, t + 0.1)


def test_interleaved_prefill_is_reported_apart_not_counted_as_decode():
    out = interleaved_output()
    tpot = request_latency(out.results[0]).tpot_s
    assert tpot == pytest.approx(0.11)  # X's TPOT holds the stalls of Y's chunks
    # decode time is X's ten 10 ms steps only; Y's chunks inside X's window are reported apart
    assert decode_wall_time(out.steps, out.results) == pytest.approx(0.1)
    assert metrics.prefill_in_decode_time(out.steps, out.results) == pytest.approx(1.0)
    assert metrics.prefill_wall_time(out.steps) == pytest.approx(1.1)
    assert metrics.decode_tok_s(out) == pytest.approx(10 / 0.1)
    assert metrics.request_decode_times(out)["X"] == (10, pytest.approx(0.1))
    agg = metrics.aggregate(out)
    assert agg["prefill_wall_s"] == pytest.approx(1.1) and agg["prefill_in_decode_s"] == pytest.approx(1.0)


def test_decode_throughput_excludes_prefill_and_first_tokens():
    out = spec_output()
    assert generated_tokens(out.results) == 7 + 6
    assert metrics.decode_tok_s(out) == pytest.approx(13 / 1.0)
    assert metrics.e2e_tok_s(out) == pytest.approx(15 / 2.5)


def test_decode_throughput_none_without_decode_time():
    out = GenerationOutput([RequestResult("A", [5], "length", [1.0])],
                           [step(0, 0.0, 1.0, ("A", PREFILL, 10, 1))], 0.0, 1.0)
    assert metrics.decode_tok_s(out) is None
    assert generated_tokens(out.results) == 0


def test_percentile_is_linear_between_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_summarize_repeats():
    assert summarize_repeats([3.0, 1.0, 10.0, 2.0]) == {"min": 1.0, "median": 2.5, "max": 10.0}
    with pytest.raises(ValueError):
        summarize_repeats([])


def test_latency_with_queueing_one_gap_per_commit():
    lat = request_latency(spec_output().results[1])  # B: arrives at 0, prefill starts at 1.0
    assert lat.ttft_s == 1.5
    assert lat.ttft_prefill_s == 0.5
    assert lat.e2e_s == 2.0
    assert lat.tpot_s == pytest.approx((2.0 - 1.5) / 6)
    assert lat.itl_s == [0.25, 0.25]  # tokens committed together: one gap, as vLLM's one per chunk


def test_latency_edge_cases():
    assert request_latency(RequestResult("x", [], "eos")) is None
    one = request_latency(RequestResult("x", [3], "eos", token_times=[0.5], t_arrival=0.25))
    assert one.tpot_s is None and one.itl_s == [] and one.ttft_s == 0.25


def test_accepted_lengths_include_the_bonus_token():
    a, b = spec_output().results
    assert accepted_lengths(a) == [4, 2, 1]
    assert accepted_lengths(b) == [3, 3]
    # AR: one token per decode step, the first token being prefill's.
    assert accepted_lengths(RequestResult("ar", [1, 2, 3, 4, 5], "length")) == [1, 1, 1, 1]


def test_draft_acceptance_rate_and_per_position():
    v = [(3, 3), (3, 1), (3, 0), (2, 2), (4, 2)]
    assert draft_acceptance_rate(v) == pytest.approx(8 / 15)
    # k=0: 4 of 5 accepted; k=1: 3 of 5; k=2: only drafts of >=3 count (4), 1 accepted; k=3: 0 of 1.
    assert acceptance_by_position(v) == pytest.approx([0.8, 0.6, 0.25, 0.0])
    assert draft_acceptance_rate([]) is None
    assert acceptance_by_position([]) == []


def test_distinct_n():
    assert distinct_n([1, 2, 3, 4, 5], 4) == 1.0
    assert distinct_n([1, 1, 1, 1, 1, 1], 4) == pytest.approx(1 / 3)
    assert distinct_n([1, 2, 1, 2, 1, 2, 1], 4) == pytest.approx(2 / 4)
    assert distinct_n([1, 2, 3], 4) is None


def test_aggregate_spec_run():
    out = spec_output()
    scores = {"A": 1.0, "B": 0.0}
    near_tie_at_6 = ParityMargins([1.0] * 6 + [0.002], [0] * 6 + [9], [10.0] * 7)
    par = {"A": compare([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8], None, 1e-3),
           "B": compare([9] * 7, [9] * 6 + [8], near_tie_at_6, 1e-3)}
    agg = aggregate(out, scores=scores, parity=par, prompt_lens={"A": 100, "B": 6}, percentiles=(50, 90, 99.9))
    assert agg["n_requests"] == 2 and agg["output_tokens"] == 15 and agg["generated_tokens"] == 13
    assert agg["decode_wall_s"] == pytest.approx(1.0) and agg["prefill_in_decode_s"] == 0.0
    assert agg["decode_tok_s"] == pytest.approx(13 / 1.0)
    assert agg["request_throughput"] == pytest.approx(2 / 2.5)
    assert agg["total_token_throughput"] == pytest.approx((106 + 15) / 2.5)
    assert agg["ttft_mean_s"] == pytest.approx(1.25) and agg["ttft_median_s"] == pytest.approx(1.25)
    assert agg["e2e_p99.9_s"] == pytest.approx(2.0 + (2.0 - 2.0))
    assert agg["ttft_p50_s"] == pytest.approx(1.25)  # TTFTs 1.0 and 1.5
    assert agg["ttft_prefill_p50_s"] == pytest.approx(0.75)  # 1.0 and 0.5
    # One gap per commit: A = .5 .25 .25, B = .25 .25.
    assert agg["itl_mean_s"] == pytest.approx(1.5 / 5)
    assert agg["itl_p50_s"] == pytest.approx(0.25)
    assert agg["itl_p90_s"] == pytest.approx(0.25 + 0.25 * 0.6)
    assert agg["mean_accepted_len"] == pytest.approx(13 / 5)  # (4+2+1+3+3)/5
    assert agg["draft_acceptance_rate"] == pytest.approx(8 / 15)
    assert agg["accept_rate_pos0"] == pytest.approx(0.8) and agg["accept_rate_pos3"] == 0.0
    assert "accept_rate_pos4" not in agg
    # Per-request means: A 7/3, B 3.
    assert agg["req_accepted_len_p0"] == pytest.approx(7 / 3) and agg["req_accepted_len_p100"] == 3.0
    assert agg["req_accepted_len_p50"] == pytest.approx((7 / 3 + 3) / 2)
    assert agg["distinct4_min"] == pytest.approx(1 / 4)  # B: 4 four-grams, all (9,9,9,9)
    assert agg["repetition_collapse_n"] == 1
    assert agg["score_mean"] == 0.5 and agg["score_n"] == 2
    assert agg["parity_identical_pct"] == 50.0 and agg["parity_near_tie"] == 1
    assert all(v is None or isinstance(v, (int, float)) for v in agg.values())


def test_aggregate_ar_run_counts_one_token_per_step():
    steps = [step(0, 0.0, 1.0, ("A", PREFILL, 10, 1)),
             step(1, 1.0, 1.5, ("A", DECODE, 1, 1)),
             step(2, 1.5, 2.0, ("A", DECODE, 1, 1))]
    out = GenerationOutput([RequestResult("A", [1, 2, 3], "length", [1.0, 1.5, 2.0])], steps, 0.0, 2.0)
    agg = aggregate(out)
    assert agg["decode_tok_s"] == pytest.approx(2.0)
    assert agg["mean_accepted_len"] == 1.0
    assert agg["draft_acceptance_rate"] is None and agg["n_verifications"] == 0
    assert agg["score_mean"] is None and "parity_n" not in agg


def test_every_aggregate_name_is_documented():
    documented = set(re.findall(r"`([a-z0-9_{}]+)`", DOCS.read_text()))
    names = set(aggregate(spec_output(), scores={"A": 1.0}, parity={"A": compare([1], [1], None, 1e-3)}))
    missing = {n for n in names if n not in documented and re.sub(r"\d+$", "{k}", n) not in documented}
    assert not missing, f"not in docs/metrics.md: {sorted(missing)}"


def test_ratio_and_bootstrap_interval():
    ar = {(f"r{i}", 0): (10, 1.0 + 0.1 * i) for i in range(8)}
    same = dict(ar)
    assert metrics.ratio(same, ar) == pytest.approx(1.0)
    assert metrics.ratio_ci(same, ar) == (pytest.approx(1.0), pytest.approx(1.0))
    # Twice as fast on every request: exactly 2, interval [2, 2].
    fast = {k: (t, s / 2) for k, (t, s) in ar.items()}
    assert metrics.ratio(fast, ar) == pytest.approx(2.0)
    lo, hi = metrics.ratio_ci(fast, ar)
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    # Faster on some requests only: the interval brackets the point estimate and has width.
    mixed = {k: (t, s / (3 if i % 2 else 1)) for i, (k, (t, s)) in enumerate(ar.items())}
    r = metrics.ratio(mixed, ar)
    lo, hi = metrics.ratio_ci(mixed, ar)
    assert lo < r < hi and hi - lo > 0.1
    assert metrics.ratio_ci(mixed, {("x", 0): (1, 1.0)}) is None  # unpaired keys


def test_allowed_speedup_from_realised_verifications():
    # Two cycles: drafted 3 accepted 3 (4 tokens), drafted 3 accepted 0 (1 token); c = 0.2, v(3) = 1.5.
    v = {0: 1.0, 1: 1.1, 2: 1.3, 3: 1.5}
    assert metrics.allowed_speedup([(3, 3), (3, 0)], 0.2, v) == pytest.approx(5 / (2 * (0.6 + 1.5)))
    # A draft longer than measured: v extrapolated linearly (v(5) = 1.5 + 2 * 0.2).
    assert metrics.allowed_speedup([(5, 1)], 0.2, v) == pytest.approx(2 / (1.0 + 1.9))
    assert metrics.allowed_speedup([], 0.2, v) is None
