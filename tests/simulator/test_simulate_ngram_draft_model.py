"""The simulator on the two decoders that draft without the target's forward: ngram (host work only,
its proposal lengths replayed from the run) and draft-model (its own model's forwards, counted as the
decoder runs them and priced with the draft's shape). No timings of this machine are asserted."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import make_checkpoint, train_tokenizer
from test_simulator import COST, as_output, retimed

from aspire_bench.cli import main
from aspire_bench.decoders.base import PREFILL
from aspire_bench.engine import Engine
from aspire_bench.errors import UserError
from aspire_bench.harness import metrics
from aspire_bench.harness.records import RunRecord
from aspire_bench.harness.runner import RunConfig, run
from aspire_bench.harness.store import Store
from aspire_bench.simulator.acceptance import ReplayAcceptance, token_stream
from aspire_bench.simulator.costs import CalibratedCost, Hardware, ModelShape, Roofline
from aspire_bench.simulator.policies import SimPolicy
from aspire_bench.simulator.replay import SimRequest, simulate
from aspire_bench.simulator.source import requests_of, simulate_stored

SAMPLING = {"temperature": 0.7, "top_k": 50, "top_p": 0.9}


@pytest.fixture(scope="module")
def drafts(random_tiny, tmp_path_factory):
    """Drafts for the random target (its vocabulary and tokenizer): 1 layer, and 3 layers twice as wide."""
    root = tmp_path_factory.mktemp("drafts")
    for name, over in (("small", {"num_hidden_layers": 1}),
                       ("big", {"num_hidden_layers": 3, "hidden_size": 128, "intermediate_size": 256})):
        make_checkpoint("qwen3", root / name, seed=3, vocab_size=768, max_position_embeddings=8192,
                        eos_token_id=0, **over)
        train_tokenizer().save_pretrained(str(root / name))
    return root


def stored_run(random_tiny, decoder, args, monkeypatch=None):
    """A run at 1k with the paper's sampling; with `monkeypatch`, also the rows of every forward of the
    draft model during its decode steps (tokens, KV read per row)."""
    seen = []
    if monkeypatch is not None:
        forward = Engine.forward

        def spy(self, rows):  # the draft's prefill asks for no logits, its drafts for the last
            if Path(self.name) == Path(args["draft_model"]) and all(r.logits == "last" for r in rows):
                seen.append([(r.n, r.start + r.n) for r in rows])
            return forward(self, rows)
        monkeypatch.setattr(Engine, "forward", spy)
    rec = run(RunConfig(model=str(random_tiny), decoder=decoder, decoder_args=args, task="needle", context_len="1k",
                        limit=3, batch_size=2, max_new_tokens=14, warmup=False, **SAMPLING), show_progress=False).record
    assert rec.status == "ok", rec.error
    return rec, seen


class Spy:
    """A step-cost model that records the rows it prices (tokens, KV read) and charges `cost` for them."""

    def __init__(self, cost):
        self.cost, self.calls = cost, []

    def step_time(self, rows):
        self.calls.append([(r[0], r[1], r[2]) for r in rows])
        return self.cost.step_time(rows)


def test_ngram_replays_its_recorded_proposals_and_its_drafts_cost_no_device_time(random_tiny):
    rec, _ = stored_run(random_tiny, "ngram", {"prompt_lookup_min": 1})
    lengths = [d for r in rec.requests for d, _ in r.verifications]
    assert any(lengths) and 0 in lengths  # matches and steps without one: both replayed
    for cost in (CalibratedCost(COST), Roofline(Hardware.load("h100"), ModelShape.load(str(random_tiny)))):
        out, assumptions = simulate_stored(rec, cost)
        assert [r.verifications for r in rec.requests] == [r.verifications for r in out.results]
        assert [[r[:3] for r in s.rows] for s in rec.steps] == \
               [[(w.request, w.kind, w.n_tokens) for w in s.rows] for s in out.steps]
        # host-only drafts: each step costs its target rows alone, nothing for the lookup
        expected = retimed(rec, cost)
        assert [s.t_end - s.t_start for s in expected.steps] == pytest.approx([s.wall for s in out.steps], rel=1e-12)
        assert "draft_model" not in assumptions
    assert SimPolicy("ngram", rec.info, recorded={}).own_model is None
    with pytest.raises(UserError, match="'ngram' is simulated only by replaying a stored run"):
        SimPolicy("ngram", None)


def test_draft_model_forwards_are_counted_as_the_decoder_runs_them(random_tiny, drafts, monkeypatch):
    rec, seen = stored_run(random_tiny, "draft-model", {"draft_model": str(drafts / "small"), "gamma": 3}, monkeypatch)
    assert rec.info["draft_model_used"] == str(drafts / "small") and seen
    draft = Roofline(Hardware.load("a100"), ModelShape.load(str(random_tiny))).for_model(
        ModelShape.load(str(drafts / "small")))
    spy, target = Spy(draft), CalibratedCost(COST)
    policy = SimPolicy("draft-model", rec.info, None, 16, 0, None,
                       {r.id: r.verifications for r in rec.requests})
    assert policy.own_model == drafts / "small"
    out = simulate(requests_of(rec), policy, ReplayAcceptance({r.id: token_stream(r.verifications)
                                                               for r in rec.requests}),
                   target, 2, own_cost=spy)
    assert [r.verifications for r in rec.requests] == [r.verifications for r in out.results]
    decode_forwards = [[(n, kv) for _, n, kv in call] for call in spy.calls if call[0][0] != PREFILL]
    assert decode_forwards == seen  # every draft forward: its rows' tokens and KV reads, in order
    own_prefill = [call for call in spy.calls if call[0][0] == PREFILL]
    assert [c[0][1] for c in own_prefill] == [r.prompt_len for r in rec.requests]
    # each step: the target's rows, plus the draft's forwards that ran inside it
    expected = metrics.decode_wall_time(as_output(retimed(rec, target)).steps) + sum(
        draft.step_time([("draft", n, kv) for n, kv in rows]) for rows in seen)
    assert metrics.decode_wall_time(out.steps) == pytest.approx(expected, rel=1e-12)


def test_draft_model_cost_grows_with_the_drafts_size_and_the_context(random_tiny, drafts):
    rec, _ = stored_run(random_tiny, "draft-model", {"draft_model": str(drafts / "small"), "gamma": 3})
    big = RunRecord.from_json(rec.to_json())
    big.info["draft_model_used"] = big.info["draft_model"] = str(drafts / "big")
    for cost in (CalibratedCost(COST), Roofline(Hardware.load("h100"), ModelShape.load(str(random_tiny)))):
        (small_out, small_a), (big_out, big_a) = simulate_stored(rec, cost), simulate_stored(big, cost)
        assert (small_a["draft_model"]["layers"], big_a["draft_model"]["layers"]) == (1, 3)
        assert metrics.decode_tok_s(big_out) < metrics.decode_tok_s(small_out)
        no_draft = metrics.decode_wall_time(as_output(retimed(rec, cost)).steps)
        small_draft = metrics.decode_wall_time(small_out.steps) - no_draft
        assert 0 < small_draft < metrics.decode_wall_time(big_out.steps) - no_draft
    # the same decoding at a longer context: each draft forward reads more of the draft's KV
    per_token = {}
    for context in (1000, 8000):
        policy = SimPolicy("draft-model", {"draft_model_used": str(drafts / "small"), "gamma": 3})
        spy = Spy(Roofline(Hardware.load("h100"), ModelShape.load(str(random_tiny))).for_model(
            ModelShape.load(str(drafts / "small"))))
        simulate([SimRequest("a", context, 40), SimRequest("b", context, 40)], policy,
                 ReplayAcceptance({"a": [True, False], "b": [True, True, False]}),
                 CalibratedCost(COST), 2, own_cost=spy)
        decode = [c for c in spy.calls if c[0][0] != PREFILL]
        per_token[context] = sum(spy.cost.step_time(c) for c in decode) / sum(len(c) for c in decode)
        assert all(kv > context for c in decode for _, _, kv in c)
    assert per_token[8000] > per_token[1000]


def test_calibration_scaled_to_the_draft_by_its_shape():
    target = ModelShape("t", layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=100,
                        tied=True, dtype="float32")
    draft = ModelShape("d", layers=1, hidden=64, heads=4, kv_heads=1, head_dim=16, intermediate=128, vocab=100,
                       tied=True, dtype="float32")
    scaled = CalibratedCost(COST).for_model(draft, lambda: target).model
    assert scaled.beta0 == pytest.approx(COST.beta0 / 4)
    assert scaled.beta_tok == pytest.approx(COST.beta_tok * draft.weight_params / target.weight_params)
    assert scaled.beta_attn == pytest.approx(COST.beta_attn / 8)  # a quarter of the layers, half the KV heads
    assert scaled.beta_qk == pytest.approx(COST.beta_qk / 4)
    assert CalibratedCost(COST).for_model(target, lambda: target).model.beta_attn == pytest.approx(COST.beta_attn)


def test_both_simulate_through_the_cli_beside_the_others_and_show_in_the_report(random_tiny, drafts, tmp_path):
    db = str(tmp_path / "r.db")
    runs = [("ar", {}), ("ngram", {"prompt_lookup_min": 1}), ("draft-model", {"draft_model": str(drafts / "small")})]
    with Store(db) as st:
        ids = [st.save_run(stored_run(random_tiny, d, a)[0]) for d, a in runs]
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps({**COST.to_dict(), "source": "calibration"}))
    runner = CliRunner()
    args = ["simulate", "--store", db, *(x for i in ids for x in ("--run", str(i)))]
    res = runner.invoke(main, [*args, "--calibration", str(calib), "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["decoder"]: r for r in json.loads(res.stdout)}
    assert set(rows) == {"ar", "ngram", "draft-model"}
    assert all(r["simulated_decode_tok_s"] > 0 and r["simulated_speedup_vs_ar"] for r in rows.values())
    assert rows["draft-model"]["assumptions"]["draft_model"]["layers"] == 1
    table = runner.invoke(main, [*args, "--hardware", "h100", "--no-save"])
    assert table.exit_code == 0, table.output
    assert "ngram" in table.output and "draft-model" in table.output and "draft model " in table.output
    # not in a parametric setting: one line
    bad = runner.invoke(main, ["simulate", "--no-save", "--store", db, "--hardware", "h100", "--model-shape",
                               "qwen3-1.7b", "--alpha", "0.9", "--decoders", "ar,ngram"])
    assert bad.exit_code == 2 and "pass --run RUN_ID" in bad.output and "Traceback" not in bad.output
    from aspire_bench.report import write_report
    out = tmp_path / "report"
    index = write_report(db, out).read_text()
    projected = (out / "projected.html").read_text()
    assert projected.count("<tr>") == 4 and "ngram" in projected and "draft-model" in projected
    assert "ngram" in index and "draft-model" in index  # the measured runs on the leaderboard
    # ... and in the gate: a baseline of the three, then the same runs against it
    base, picked = tmp_path / "base.json", [x for i in ids for x in ("--run", str(i))]
    up = runner.invoke(main, ["gate", "--store", db, *picked, "--baseline", str(base), "--update"])
    assert up.exit_code == 0, up.output
    assert {e["decoder"] for e in json.loads(base.read_text())["entries"]} == {"ar", "ngram", "draft-model"}
    again = runner.invoke(main, ["gate", "--store", db, *picked, "--baseline", str(base)])
    assert again.exit_code == 0, again.output
