"""The measurement method end to end at tiny sizes: equal work, the same cell through bench and a sweep,
per-repeat seeds, tuning requests apart from measured ones, decode time with interleaved prefill.

Timing-dependent comparisons run on a fake clock that advances by a fixed cost per token of every
forward pass, so they test the method, not this machine's load."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from aspire_bench.decoders import loop
from aspire_bench.engine import Engine
from aspire_bench.harness.bench import SAMPLINGS, Sampling, bench
from aspire_bench.harness.runner import RunConfig, measure_repeat, prepare, run
from aspire_bench.harness.sweep import expand, run_sweep
from aspire_bench.harness.tuning import tuning_requests

PAPER = SAMPLINGS["paper"]


@pytest.fixture
def fake_clock(monkeypatch):
    """Decoders' clock reads a counter; each forward adds 1 ms + 0.1 ms per token + 1 us per KV position."""
    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: clock.t))
    forward = Engine.forward

    def timed_forward(self, rows):
        out = forward(self, rows)
        clock.t += 1e-3 + sum(1e-4 * r.n + 1e-6 * r.start for r in rows)
        return out
    monkeypatch.setattr(Engine, "forward", timed_forward)
    return clock


def test_bench_and_sweep_measure_the_same_cell_alike(random_tiny, tmp_path, fake_clock):
    # one round per repeat (rounds=1): each repeat runs all four requests in one batch run, as the sweep does
    rows, _ = bench(str(random_tiny), "needle", ["1k"], [2], ["ar", "magicdec"], repeat=2, max_new_tokens=6,
                    samplings=[Sampling(*PAPER)], seed=0, limit=4, tune=False, bound=False, show_progress=False,
                    rounds=1)
    t, k, p = PAPER
    sweep = expand({"models": [str(random_tiny)], "decoders": ["ar", "magicdec"],
                    "tasks": [{"name": "needle", "limit": 4}], "contexts": ["1k"], "batch_sizes": [2],
                    "max_new_tokens": [6], "sampling": [{"temperature": t, "top_k": k, "top_p": p}],
                    "prefix_cache": True})
    out = run_sweep(sweep, tmp_path / "s.db", show_progress=False)
    ar, spec = out.records
    assert ar.status == spec.status == "ok"
    # Equal work: every request of every decoder generated exactly max_new_tokens, in both.
    for rec in (ar, spec, *(r.record for r in rows)):
        assert {len(r.output_ids) for r in rec.requests} == {6}
    # The sweep's run is the bench's first repeat (same requests, seed, work and clock) ...
    for bench_row, sweep_rec in zip(rows, (ar, spec)):
        first = [s for s in bench_row.record.info["decode_samples"] if s[1] == 0]
        theirs = sweep_rec.info["decode_samples"]
        assert [s[:3] for s in first] == [s[:3] for s in theirs]
        assert [s[3] for s in first] == pytest.approx([s[3] for s in theirs])
    # ... so its speedup lies in the bench's interval.
    sweep_ratio = spec.aggregates["decode_tok_s"] / ar.aggregates["decode_tok_s"]
    lo, hi = rows[1].figures["speedup_vs_ar_ci95"]
    assert lo <= sweep_ratio <= hi


def test_sampled_run_does_equal_work_unless_opted_out(random_tiny):
    base = {"model": str(random_tiny), "task": "needle", "context_len": "1k", "limit": 2, "batch_size": 2,
            "max_new_tokens": 12, "temperature": 1.0, "seed": 1, "warmup": False}
    eos = 0  # random_tiny's EOS id
    equal = run(RunConfig(**base), show_progress=False).record
    assert all(len(r.output_ids) == 12 and r.finish_reason == "length" for r in equal.requests)
    unequal = run(RunConfig(**base, equal_work=False), show_progress=False).record
    assert all(len(r.output_ids) == 12 or r.output_ids[-1] == eos for r in unequal.requests)
    greedy = RunConfig(**{**base, "temperature": 0.0})
    assert RunConfig(**base).eos_ignored and not greedy.eos_ignored  # greedy: the same tokens, EOS kept
    from aspire_bench.harness.figures import unequal_work
    assert not unequal_work(equal) and unequal_work(unequal)


def test_scores_read_the_text_up_to_the_first_eos():
    from aspire_bench.harness.runner import _until_eos
    assert _until_eos([5, 6, 0, 7, 0], {0}) == [5, 6]
    assert _until_eos([5, 6], {0}) == [5, 6] and _until_eos([0], {0}) == []
    assert _until_eos([5, 0, 6], set()) == [5, 0, 6]  # EOS honoured in generation: nothing to cut


def test_repeats_sample_with_their_own_seed(random_tiny):
    p = prepare(RunConfig(model=str(random_tiny), task="needle", context_len="1k", limit=2, batch_size=2,
                          max_new_tokens=8, temperature=1.0, repeat=2), show_progress=False)
    a, b = (measure_repeat(p, i, False) for i in range(2))
    again = measure_repeat(p, 0, False)
    assert [r.output_ids for r in a.results] == [r.output_ids for r in again.results]  # seeded
    assert [r.output_ids for r in a.results] != [r.output_ids for r in b.results]  # seed + 1


def test_tuning_requests_are_apart_from_measured_ones(random_tiny):
    cfg = RunConfig(model=str(random_tiny), decoder="magicdec", task="needle", context_len="1k", limit=3,
                    batch_size=2, max_new_tokens=64)
    p = prepare(cfg, show_progress=False)
    tune = tuning_requests(cfg, p.engine, p.reqs)
    assert len(tune) == 2 and all(r.max_new_tokens == 32 for r in tune)
    assert not {tuple(r.prompt_ids) for r in tune} & {tuple(r.prompt_ids) for r in p.reqs}


def test_bench_prefix_cache_holds_one_set_of_prompts_at_a_time(random_tiny, monkeypatch):
    """The tuning prompts are dropped before the measured ones are prefilled, and an earlier cell's
    prompts before the next cell's: the cache never holds the KV of two sets (at 16k, 0.75 GB a prompt)."""
    held = []
    save = Engine.save_prefix

    def saving(self, slot, ids):
        save(self, slot, ids)
        held.append(len(self.prefix_cache))
    monkeypatch.setattr(Engine, "save_prefix", saving)
    rows, _ = bench(str(random_tiny), "needle", ["1k", "2k"], [2], ["ar", "magicdec"], repeat=1, max_new_tokens=4,
                    samplings=[Sampling(*PAPER)], limit=3, bound=False, show_progress=False, rounds=1,
                    calibration_rounds=False)
    assert [r.tuned for r in rows] == [False, False, True] * 2  # tuned on 2 prompts per cell, measured on 3
    assert held and max(held) == 3


def test_tuning_takes_the_median_of_rounds_in_fresh_orders(monkeypatch):
    """One disturbed tuning run (the machine slowed to half speed during it) does not decide: the grid
    runs in a fresh order per round and the median over the rounds wins. With one run per gamma in the
    grid's order, the fourth run is gamma 4's, and gamma 1 would win."""
    from aspire_bench.decoders import trait
    from aspire_bench.harness import tuning

    @dataclass
    class Req:
        max_new_tokens: int = 32

    @dataclass
    class Params:
        seed: int = 0

    order = []
    monkeypatch.setattr(tuning, "tuning_requests", lambda cfg, engine, measured: [Req()])
    monkeypatch.setattr(tuning, "generate", lambda decoder, args, engine, reqs, *a: order.append(args["gamma"]) or args["gamma"])
    runs = iter(range(100))
    monkeypatch.setattr(tuning.metrics, "decode_tok_s",
                        lambda g: (105.0 if g == 4 else 100.0) * (0.5 if next(runs) == 3 else 1.0))
    res = tuning.tune(SimpleNamespace(decoder="magicdec", decoder_args={}, batch_size=2), None, [], Params())
    grid = trait("magicdec", "tune_grid")["gamma"]
    rounds = [order[1 + i * len(grid):1 + (i + 1) * len(grid)] for i in range(tuning.TUNE_ROUNDS)]  # after the warm-up
    assert all(sorted(r) == list(grid) for r in rounds) and len({tuple(r) for r in rounds}) > 1
    assert res["settings"] == {"gamma": 4} and res["rounds"] == tuning.TUNE_ROUNDS
    assert res["decode_tok_s"]["gamma=4"] == 105.0


def test_decode_tok_s_leaves_out_interleaved_prefill(random_tiny, fake_clock):
    """More requests than slots, of different lengths: a freed slot's prompt prefills while the other
    request decodes. Decode time is the decoding steps only; the refill is reported apart."""
    from aspire_bench.decoders import Request, SamplingParams, get_decoder
    from aspire_bench.harness.records import from_output
    engine = Engine.from_pretrained(str(random_tiny))
    reqs = [Request(f"r{i}", list(range(5 + i, 300 + i)), n) for i, n in enumerate((4, 12, 12, 12))]
    out = get_decoder("ar").generate(engine, reqs, SamplingParams(0.0, 0, 1.0, 0, ()), 2)
    a = from_output({}, out, {r.id: len(r.prompt_ids) for r in reqs}, {}).aggregates
    assert a["prefill_in_decode_s"] > 0  # the case: prefill steps interleaved with decoding
    walls = [(s.t_end - s.t_start, any(row.kind != "prefill" for row in s.rows)) for s in out.steps]
    assert a["decode_wall_s"] == pytest.approx(sum(w for w, dec in walls if dec))
    assert a["prefill_wall_s"] == pytest.approx(sum(w for w, dec in walls if not dec))
    assert a["prefill_in_decode_s"] < a["prefill_wall_s"]  # the first wave's prefill stalls no one
    assert a["decode_tok_s"] == pytest.approx(a["generated_tokens"] / a["decode_wall_s"])
    first = {r.id: r.token_times[0] for r in out.results}
    assert first["r0"] == first["r1"]  # admitted together: first tokens when the wave's prefill ends


def test_readme_run_and_demo_cell_account_decode_time_alike(random_tiny, tmp_path, fake_clock):
    """The README's `run` (no prefix cache, --parity) and the demo's sweep cell of the same settings
    (prefix cache, prompts prefilled in the warm-up) report decode tok/s within 15% on a fake clock."""
    cell = {"model": str(random_tiny), "decoder": "magicdec", "task": "needle", "context_len": "1k", "limit": 4,
            "batch_size": 4, "max_new_tokens": 16}
    readme = run(RunConfig(**cell, parity=True), show_progress=False).record.aggregates
    demo = expand({"models": [str(random_tiny)], "decoders": ["ar", "magicdec"],
                   "tasks": [{"name": "needle", "limit": 4}], "contexts": ["1k"], "batch_sizes": [4],
                   "max_new_tokens": 16, "sampling": {"temperature": 0}, "parity": True, "prefix_cache": True})
    ar, spec = run_sweep(demo, tmp_path / "d.db", show_progress=False).records
    theirs = spec.aggregates
    assert theirs["decode_tok_s"] == pytest.approx(readme["decode_tok_s"], rel=0.15)
    assert readme["prefill_in_decode_s"] == 0  # the batch was prefilled before its decode steps
    # --parity's AR run gives the speedup over AR, as the sweep's AR cell does
    assert readme["speedup_vs_ar"] == pytest.approx(theirs["decode_tok_s"] / ar.aggregates["decode_tok_s"], rel=0.15)
    lo, hi = readme["speedup_vs_ar_ci95_low"], readme["speedup_vs_ar_ci95_high"]
    assert lo <= readme["speedup_vs_ar"] <= hi


def test_leaderboard_shows_intervals_and_unequal_work(random_tiny, tmp_path):
    from aspire_bench.report import leaderboard
    from aspire_bench.report.pages import board_table
    base = {"model": str(random_tiny), "task": "needle", "context_len": "1k", "limit": 3, "batch_size": 3,
            "max_new_tokens": 8, "temperature": 1.0, "warmup": False}
    for equal, group in ((True, "eq"), (False, "uneq")):
        for dec in ("ar", "magicdec"):
            run(RunConfig(**base, decoder=dec, equal_work=equal), store=str(tmp_path / "r.db"),
                group=group, show_progress=False)
    lb = leaderboard.build(leaderboard.load_runs(tmp_path / "r.db"))
    rows = {(r.group, r.decoder): r for b in lb.boards for r in b.rows}
    eq, uneq = rows[("eq", "magicdec")], rows[("uneq", "magicdec")]
    lo, hi = eq.value("speedup_ci95")
    assert lo <= eq.value("speedup") * 1.0001 and eq.value("speedup") <= hi * 1.0001
    assert not eq.value("unequal_work") and uneq.value("unequal_work")
    html = "".join(board_table(b) for b in lb.boards)
    assert html.count("(unequal work)") == 1 and "[" in html
