"""Exactness parity (harness/parity.py): the classification rule, AR's record as the teacher-forced
reference, and a decoder whose logits are nudged at one position being caught as a mismatch."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from aspire_bench.cli import main
from aspire_bench.decoders import Request, SamplingParams, get_decoder
from aspire_bench.decoders.base import ParityMargins
from aspire_bench.decoders.sampler import Sampler
from aspire_bench.engine import Engine, Row, load_model
from aspire_bench.errors import ConfigError
from aspire_bench.harness.parity import (
    DEFAULT_TOLERANCE,
    compare,
    compare_runs,
    default_tolerance,
    resolve_tolerance,
    summarize,
)
from aspire_bench.harness.sweep import expand

# AR's record for outputs [1, 2, 3, 4]: at position 2 the runner-up is 9 with margin 0.004, top-1 logit 20.
AR = ParityMargins([5.0, 3.0, 0.004, 2.0], [7, 7, 9, 7], [20.0, 20.0, 20.0, 20.0])


def test_identical_and_length():
    same = compare([1, 2, 3], [1, 2, 3], AR, 1e-4)
    assert same.identical and same.first_divergence is None and same.matched == 3
    short = compare([1, 2, 3], [1, 2, 3, 4], AR, 1e-4)
    assert (short.kind, short.first_divergence, short.matched, short.length) == ("length", 3, 3, 4)


def test_near_tie_needs_the_runner_up_and_a_margin_under_the_scaled_threshold():
    # threshold = tolerance x max(1, |top-1 logit|) = 1e-3 x 20 = 0.02 > 0.004
    tie = compare([1, 2, 9, 4], [1, 2, 3, 4], AR, 1e-3)
    assert (tie.kind, tie.first_divergence, tie.margin, tie.runner_up) == ("near-tie", 2, 0.004, True)
    assert tie.threshold == pytest.approx(0.02) and not tie.identical
    # The same margin against a smaller logit scale: threshold 1e-3 x 2 = 0.002 < 0.004.
    assert compare([1, 2, 9, 4], [1, 2, 3, 4], replace(AR, top_logit=[2.0] * 4), 1e-3).kind == "mismatch"
    # A token that is not AR's runner-up is a mismatch however small the margin.
    third = compare([1, 2, 8, 4], [1, 2, 3, 4], AR, 1e-3)
    assert (third.kind, third.runner_up) == ("mismatch", False)
    # The old absolute rule (margin < 0.01) called this a near-tie; at the fp32 default it is a bug.
    assert compare([1, 2, 9, 4], [1, 2, 3, 4], AR, default_tolerance(torch.float32)).kind == "mismatch"
    # The runner-up at a clear margin (2.0 > 0.02) is a mismatch.
    assert compare([1, 2, 3, 7], [1, 2, 3, 4], AR, 1e-3).kind == "mismatch"
    # An exact tie is benign even at tolerance 0.
    assert compare([1, 2, 9], [1, 2, 3], replace(AR, margin=[5.0, 3.0, 0.0]), 0.0).kind == "near-tie"
    # Scale floor: |top-1| under 1 counts as 1.
    assert compare([1, 2, 9], [1, 2, 3], replace(AR, top_logit=[0.1] * 3), 1e-3).threshold == pytest.approx(1e-3)


@pytest.mark.parametrize("missing", ["margin", "runner_up", "top_logit"])
def test_an_unknown_record_cannot_excuse_a_divergence(missing):
    assert compare([1, 2, 9, 4], [1, 2, 3, 4], replace(AR, **{missing: []}), 1.0).kind == "mismatch"
    assert compare([1, 2, 9, 4], [1, 2, 3, 4], None, 1.0).kind == "mismatch"


def test_summary_counts():
    items = [compare([1, 2, 3], [1, 2, 3], None, 1e-3),            # 3 of 3
             compare([1, 2, 9, 4], [1, 2, 3, 4], AR, 1e-3),      # 2 of 4, near-tie
             compare([1, 2, 8, 4], [1, 2, 3, 4], AR, 1e-3),      # 2 of 4, mismatch
             compare([1, 2, 3], [1, 2, 3, 4], AR, 1e-3)]         # 3 of 4, length
    s = summarize(items)
    assert s["parity_n"] == 4 and s["parity_identical_pct"] == 25.0
    assert s["parity_identical_token_pct"] == pytest.approx(100 * 10 / 15)
    assert (s["parity_near_tie"], s["parity_mismatch"], s["parity_length"]) == (1, 1, 1)


def test_tolerance_defaults_by_dtype_and_bad_values():
    assert default_tolerance(torch.float32) == DEFAULT_TOLERANCE["float32"] == 1e-4
    assert default_tolerance("bfloat16") == 2 ** -6 and default_tolerance(torch.float16) == 2 ** -9
    assert resolve_tolerance(None, torch.bfloat16) == 2 ** -6 and resolve_tolerance(0.5, torch.float32) == 0.5
    for bad in (-1.0, float("nan"), float("inf"), "x"):
        with pytest.raises(ConfigError, match="parity tolerance"):
            resolve_tolerance(bad, torch.float32)


# --- on a model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(checkpoints):
    path, _ = checkpoints["qwen3"]
    return Engine(load_model(path), attention_backend="torch", prefill_chunk=128)


def requests(vocab=320):
    g = torch.Generator().manual_seed(1)
    return [Request(str(i), torch.randint(0, vocab, (n,), generator=g).tolist(), 24)
            for i, n in enumerate((260, 130, 400))]


@pytest.fixture(scope="module")
def ar_run(engine):
    return get_decoder("ar").generate(engine, requests(), SamplingParams(), batch_size=3)


def test_ar_record_is_the_teacher_forced_reference(engine, ar_run):
    """AR's record at position j equals one forward over prompt + output[:j]: since the two outputs agree
    up to the first divergence, AR's record there is teacher-forced on the speculative prefix."""
    r, req = ar_run.results[1], requests()[1]
    assert len(r.margins.margin) == len(r.margins.runner_up) == len(r.margins.top_logit) == len(r.output_ids)
    engine.reserve(1024)
    for j in (0, 5, len(r.output_ids) - 1):
        slot = engine.alloc(512)
        ids = req.prompt_ids + r.output_ids[:j]
        logits = engine.forward([Row(slot, ids, 0)]).logits[0][-1]
        engine.free(slot)
        (v1, v2), (i1, i2) = (t.tolist() for t in torch.topk(logits, 2))
        assert (i1, i2) == (r.output_ids[j], r.margins.runner_up[j])
        assert v1 == pytest.approx(r.margins.top_logit[j], abs=1e-4)
        assert v1 - v2 == pytest.approx(r.margins.margin[j], abs=1e-4)


def nudge(monkeypatch, index: int, position: int, by: float = 1e-3) -> dict:
    """Make the runner-up win by `by` in the verify logits at one output position of request number
    `index`: the smallest logit change that changes the token. Returns {"margin": the decoder's own margin
    there}."""
    seen = {}
    original = Sampler.verify

    def verify(self, st, logits, probs=None):  # greedy: no distributions
        j = position - len(st.out)
        if st.index == index and 0 <= j < logits.shape[0]:
            logits = logits.clone()
            (v1, v2), (_, i2) = (x.tolist() for x in torch.topk(logits[j], 2))
            logits[j, i2] = v1 + by
            seen["margin"] = v1 - v2
        return original(self, st, logits, probs)

    monkeypatch.setattr(Sampler, "verify", verify)
    return seen


def test_a_slightly_nudged_decoder_is_caught(engine, ar_run, monkeypatch):
    """The smallest margin above the fp32 threshold among AR's positions: flipping it moves two logits
    by less than that margin + 1e-3, and parity calls it a mismatch (not a near-tie)."""
    tol = default_tolerance(engine.dtype)
    i, pos, margin = min(((i, j, m) for i, r in enumerate(ar_run.results) for j, m in enumerate(r.margins.margin)
                            if j > 0 and m > tol * max(1.0, abs(r.margins.top_logit[j]))), key=lambda x: x[2])
    rid = ar_run.results[i].id
    seen = nudge(monkeypatch, i, pos)
    out = get_decoder("magicdec", budget=48, sinks=4).generate(engine, requests(), SamplingParams(), 3)
    found = compare_runs(out.results, ar_run.results, tol)
    assert seen["margin"] == pytest.approx(margin, abs=1e-4)  # the decoder saw AR's logits there
    p = found[rid]
    assert (p.kind, p.first_divergence, p.runner_up) == ("mismatch", pos, True)
    assert p.margin == margin and p.threshold < margin
    print(f"nudged margin {margin:.3g}, threshold {p.threshold:.3g}")
    assert all(found[r.id].identical for r in out.results if r.id != rid)
    # Only a tolerance that admits this margin excuses it.
    assert compare_runs(out.results, ar_run.results, 1.01 * margin / p.threshold * tol)[rid].kind == "near-tie"


def test_run_parity_tolerance_end_to_end(random_tiny, monkeypatch):
    """Through `run --parity`: the nudged output is a mismatch at the default tolerance and a near-tie
    under a tolerance that admits any margin; the tolerance used is recorded."""
    from aspire_bench.harness.runner import RunConfig, run
    cfg = RunConfig(model=str(random_tiny), decoder="magicdec", decoder_args={"budget": 64}, task="needle",
                    context_len="512", limit=2, batch_size=2, max_new_tokens=10, parity=True, warmup=False,
                    attention_backend="torch")
    nudge(monkeypatch, 0, 4)
    default = run(cfg, show_progress=False).aggregates
    assert default["parity_mismatch"] == 1 and default["parity_identical_pct"] == 50.0
    assert default["parity_tolerance"] == 1e-4
    loose = run(cfg, parity_tolerance=10.0, show_progress=False).aggregates
    assert loose["parity_near_tie"] == 1 and loose["parity_mismatch"] == 0 and loose["parity_tolerance"] == 10.0


@pytest.mark.parametrize("args, message", [
    (["run", "--parity-tolerance", "0.1"], "add --parity"),
    (["run", "--parity", "--parity-tolerance", "-1"], "must be a finite number >= 0"),
    (["bench", "--parity-tolerance", "-1"], "must be a finite number >= 0"),
])
def test_cli_parity_tolerance_errors(random_tiny, tmp_path, args, message):
    r = CliRunner().invoke(main, args + ["--model", str(random_tiny), "--store", str(tmp_path / "x.db")])
    assert r.exit_code == 2 and message in r.output, r.output


def test_sweep_parity_tolerance_key():
    spec = {"models": ["tiny"], "decoders": ["ar", "aspire"], "tasks": ["needle"], "parity": True,
            "parity_tolerance": 0.001}
    assert {c.config.parity_tolerance for c in expand(spec).cells} == {0.001}
    assert expand({**spec, "parity_tolerance": None}).cells[0].config.parity_tolerance is None
    with pytest.raises(ConfigError, match="add `parity: true`"):
        expand({**spec, "parity": False})
    with pytest.raises(ConfigError, match="finite number"):
        expand({**spec, "parity_tolerance": -0.5})
