"""Every metric on hand-built traces, expected values worked out by hand (docs/metrics.md)."""
import re
from pathlib import Path

import pytest

from aspire_bench.decoders.base import (
    DECODE,
    PREFILL,
    VERIFY,
    GenerationOutput,
    RequestResult,
    RowTrace,
    StepTrace,
)
from aspire_bench.harness import metrics
from aspire_bench.harness.metrics import (
    acceptance_by_position,
    accepted_lengths,
    aggregate,
    decode_share,
    decode_wall_time,
    draft_acceptance_rate,
    generated_tokens,
    percentile,
    request_latency,
    summarize_repeats,
)
from aspire_bench.harness.parity import compare
from aspire_bench.textstats import distinct_n

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def step(i, t0, t1, *rows):
    return StepTrace(i, t0, t1, [RowTrace(*r) for r in rows])


def spec_output():
    """Two requests. A: prefill alone in step 0; B's prefill shares step 1 with A's first verify."""
    steps = [
        step(0, 0.0, 1.0, ("A", PREFILL, 100, 1)),                      # all prefill: 0 s of decode
        step(1, 1.0, 1.5, ("B", PREFILL, 6, 1), ("A", VERIFY, 4, 4, 3, 3)),  # 4/10 of 0.5 s = 0.2 s
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


def test_decode_share_splits_mixed_steps_by_tokens():
    out = spec_output()
    assert [decode_share(s) for s in out.steps] == [0.0, 0.4, 1.0, 1.0]
    assert decode_wall_time(out.steps) == pytest.approx(0.7)


def test_decode_throughput_excludes_prefill_and_first_tokens():
    out = spec_output()
    assert generated_tokens(out.results) == 7 + 6
    assert metrics.decode_tok_s(out) == pytest.approx(13 / 0.7)
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


def test_latency_with_queueing_and_zero_gaps():
    lat = request_latency(spec_output().results[1])  # B: arrives at 0, prefill starts at 1.0
    assert lat.ttft_s == 1.5
    assert lat.ttft_prefill_s == 0.5
    assert lat.e2e_s == 2.0
    assert lat.tpot_s == pytest.approx((2.0 - 1.5) / 6)
    assert lat.itl_s == [0.25, 0.0, 0.0, 0.25, 0.0, 0.0]


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
    near_tie_at_6 = {"margins": [1.0] * 6 + [0.002], "runner_up": [0] * 6 + [9], "top_logit": [10.0] * 7}
    par = {"A": compare([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8], {}, 1e-3),
           "B": compare([9] * 7, [9] * 6 + [8], near_tie_at_6, 1e-3)}
    agg = aggregate(out, scores=scores, parity=par)
    assert agg["n_requests"] == 2 and agg["output_tokens"] == 15 and agg["generated_tokens"] == 13
    assert agg["decode_wall_s"] == pytest.approx(0.7)
    assert agg["decode_tok_s"] == pytest.approx(13 / 0.7)
    assert agg["ttft_p50_s"] == pytest.approx(1.25)  # TTFTs 1.0 and 1.5
    assert agg["ttft_prefill_p50_s"] == pytest.approx(0.75)  # 1.0 and 0.5
    # 13 gaps: A = .5 0 0 0 .25 0 .25, B = .25 0 0 .25 0 0 -> 8 zeros.
    assert agg["itl_zero_frac"] == pytest.approx(8 / 13)
    assert agg["itl_p50_s"] == 0.0
    assert agg["itl_p90_s"] == pytest.approx(0.25)
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
    names = set(aggregate(spec_output(), scores={"A": 1.0}, parity={"A": compare([1], [1], {}, 1e-3)}))
    missing = {n for n in names if n not in documented and re.sub(r"\d+$", "{k}", n) not in documented}
    assert not missing, f"not in docs/metrics.md: {sorted(missing)}"
