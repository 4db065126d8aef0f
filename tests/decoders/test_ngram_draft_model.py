"""The two decoders users reach for first: prompt lookup (ngram) and a separate draft model. The ngram
matching rule, greedy parity with AR, losslessness under sampling (a chi-square test that a broken
acceptance rule fails) and the draft model's checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_checkpoint
from test_decoder_quality import SAMPLED, check_distribution, rank_counts
from test_decoders import make_requests

from aspire_bench import corpus
from aspire_bench.decoders import Request, SamplingParams, get_decoder, sampler
from aspire_bench.decoders.base import DECODE, VERIFY
from aspire_bench.decoders.ngram import NgramPolicy, NgramSettings, lookup
from aspire_bench.decoders.state import RequestState
from aspire_bench.engine import Engine, load_model
from aspire_bench.errors import ConfigError


def tokens(*ids):
    return np.array(ids, dtype=np.int64)


# --- the ngram matching rule ----------------------------------------------------------------------

def test_lookup_takes_the_longest_suffix_and_its_earliest_occurrence():
    # the suffix [2, 3] occurs once before: the tokens after it, up to the end of the context
    assert lookup(tokens(1, 2, 3, 4, 2, 3), 3, 2, 4).tolist() == [4, 2, 3]
    # [1, 2] occurs twice before: the earliest one's continuation
    assert lookup(tokens(5, 1, 2, 9, 1, 2, 7, 1, 2), 3, 2, 2).tolist() == [9, 1]
    # [8, 1, 2] (3 tokens) beats the earlier 2-token match [1, 2] -> 7
    assert lookup(tokens(1, 2, 7, 8, 1, 2, 5, 8, 1, 2), 3, 2, 1).tolist() == [5]
    # ... unless prompt_lookup_max caps the length at 2: then the earliest [1, 2]
    assert lookup(tokens(1, 2, 7, 8, 1, 2, 5, 8, 1, 2), 2, 2, 1).tolist() == [7]


def test_lookup_respects_the_minimum_and_returns_nothing_without_a_match():
    assert lookup(tokens(4, 9, 3, 9), 3, 2, 3).tolist() == []  # only a 1-token match: under the minimum
    assert lookup(tokens(4, 9, 3, 9), 3, 1, 3).tolist() == [3, 9]  # a 1-token match counts at min 1
    assert lookup(tokens(1, 2, 3, 4), 3, 1, 3).tolist() == []  # the last token never occurred before
    assert lookup(tokens(7), 3, 1, 3).tolist() == []
    assert lookup(tokens(1, 2, 1, 2), 3, 2, 0).tolist() == []  # k = 0: nothing to propose


def test_lookup_matches_a_brute_force_search(seed):
    """Random token strings over a small alphabet (many matches): the vectorised search equals the rule
    written out naively."""
    rng = np.random.default_rng(seed)

    def naive(t, n_max, n_min, k):
        for n in range(min(n_max, len(t) - 1), n_min - 1, -1):
            suffix = list(t[len(t) - n:])
            for start in range(len(t) - n):
                if list(t[start:start + n]) == suffix:
                    return list(t[start + n:start + n + k])
        return []

    for _ in range(300):
        t = rng.integers(0, 4, rng.integers(1, 40))
        n_min = int(rng.integers(1, 4))
        n_max = int(rng.integers(n_min, 6))
        k = int(rng.integers(1, 6))
        assert lookup(t, n_max, n_min, k).tolist() == naive(t, n_max, n_min, k), (t.tolist(), n_max, n_min, k)


def test_ngram_plan_verifies_a_match_and_decodes_without_one():
    policy = NgramPolicy(NgramSettings(gamma=3, prompt_lookup_min=2), 16, 4)
    hit = RequestState(0, Request("a", [1, 2, 3, 4, 5, 1, 2], 10), None, None, out=[3])
    miss = RequestState(1, Request("b", [1, 2, 3, 4, 5, 6, 7], 10), None, None, out=[8])
    near_end = RequestState(2, Request("c", [1, 2, 3, 4, 1, 2], 3), None, None, out=[3, 4])
    plans = policy.plan([hit, miss, near_end], 3)
    assert [p.kind for p in plans] == [VERIFY, VERIFY, VERIFY]
    assert hit.pending == [4, 5, 1]  # gamma tokens after [1, 2, 3]
    # no match; one token left (nothing to draft): a verification of no drafts, i.e. an AR step
    assert miss.pending == [] and near_end.pending == []


# --- greedy parity --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(tmp_path_factory, checkpoints):
    """The random target, a 1-layer random draft (other weights) and a draft of another vocabulary."""
    root = tmp_path_factory.mktemp("drafts")
    make_checkpoint("qwen3", root / "draft", seed=1, num_hidden_layers=1)
    make_checkpoint("qwen3", root / "other_vocab", seed=2, num_hidden_layers=1, vocab_size=384)
    target, _ = checkpoints["qwen3"]
    return Engine(load_model(target), attention_backend="torch", prefill_chunk=128), root, target


@pytest.fixture(scope="module")
def ar_greedy(engines):
    return get_decoder("ar").generate(engines[0], make_requests(), SamplingParams(), batch_size=3)


def greedy_args(engines):
    _, root, target = engines
    return {"ngram": {"prompt_lookup_min": 1}, "draft-model": {"draft_model": str(root / "draft")},
            "draft-model-self": {"draft_model": str(target)}}


@pytest.mark.parametrize("which", ["ngram", "draft-model", "draft-model-self"])
def test_greedy_parity_with_ar(which, engines, ar_greedy):
    """7 requests of different prompt lengths and max_new_tokens, 3 slots: every token equals AR's."""
    name = which.removesuffix("-self")
    out = get_decoder(name, **greedy_args(engines)[which]).generate(engines[0], make_requests(), SamplingParams(), 3)
    for r, ref in zip(out.results, ar_greedy.results):
        assert r.output_ids == ref.output_ids, f"{which} diverged on request {r.id}"
        decoded = sum(row.committed for s in out.steps for row in s.rows if row.request == r.id and row.kind == DECODE)
        assert len(r.output_ids) == 1 + decoded + sum(a + 1 for _, a in r.verifications)
    v = [x for r in out.results for x in r.verifications]
    drafted, accepted = sum(d for d, _ in v), sum(a for _, a in v)
    assert drafted > 0 and accepted > 0
    if which == "draft-model-self":
        # the target drafting for itself: its KV rolled back and caught up right, every draft is accepted
        assert accepted == drafted


# --- losslessness under sampling -----------------------------------------------------------------

N_REQUESTS, N_TOKENS = 16, 64


def looping_requests():
    """64-token prompts that repeat a short random pattern, so that the ngram lookup often proposes."""
    g = torch.Generator().manual_seed(11)
    reqs = []
    for i in range(N_REQUESTS):
        pattern = torch.randint(0, 320, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        reqs.append(Request(str(i), (pattern * 64)[:64], N_TOKENS))
    return reqs


def sampled_run(engines, name):
    args = {"ngram": {"gamma": 2, "prompt_lookup_min": 1},
            "draft-model": {"gamma": 2, "draft_model": str(engines[1] / "draft")}}[name]
    reqs = looping_requests()
    return reqs, get_decoder(name, **args).generate(engines[0], reqs, SAMPLED, N_REQUESTS)


@pytest.fixture
def per_row_sampling(monkeypatch):
    """The per-row path (sampler.accept_sampling), so that a broken rule there takes effect."""
    monkeypatch.setattr(sampler, "compiled_applies", lambda *a: False)


@pytest.mark.parametrize("name", ["ngram", "draft-model"])
def test_sampled_tokens_follow_the_target(name, engines, per_row_sampling):
    """16 requests x 63 sampled tokens (temperature 0.3, top-k 4): every committed token is possible under
    the target and the ranks match the target's exact distribution (test_decoder_quality's check)."""
    reqs, out = sampled_run(engines, name)
    v = [x for r in out.results for x in r.verifications]
    drafted, accepted = sum(d for d, _ in v), sum(a for _, a in v)
    assert 0 < accepted < drafted  # drafts both accepted and rejected: every branch ran
    assert any(a == d > 0 for d, a in v)  # ... including bonus tokens after all drafts accepted
    check_distribution(*rank_counts(engines[0], reqs, out, SAMPLED))


def _always_accept(target_logits, drafts, qs, params, gen, p=None, us=None):
    """Broken: every draft accepted whatever its probability under the target."""
    from aspire_bench.decoders.sampler import logits_to_probs, sample_from
    p = logits_to_probs(target_logits, params) if p is None else p
    return len(drafts), sample_from(p[len(drafts)], gen)


def _accept_by_q(target_logits, drafts, qs, params, gen, p=None, us=None):
    """Broken: a draft accepted with probability q(x) instead of min(1, p(x)/q(x)), residual as before."""
    from aspire_bench.decoders.sampler import logits_to_probs, sample_from, sample_residual
    p = logits_to_probs(target_logits, params) if p is None else p
    for j, (x, q) in enumerate(zip(drafts, qs)):
        if float(torch.rand(1, generator=gen)) >= float(q[x]):
            return j, sample_residual(p[j], q, gen)
    return len(drafts), sample_from(p[len(drafts)], gen)


# (for ngram's point-mass q, accepting with probability q(x) is accepting always)
@pytest.mark.parametrize("name, broken", [("ngram", _always_accept), ("draft-model", _always_accept),
                                          ("draft-model", _accept_by_q)])
def test_the_check_rejects_a_broken_acceptance_rule(name, broken, engines, per_row_sampling, monkeypatch):
    monkeypatch.setattr(sampler, "accept_sampling", broken)
    reqs, out = sampled_run(engines, name)
    with pytest.raises(AssertionError, match="committed tokens"):
        check_distribution(*rank_counts(engines[0], reqs, out, SAMPLED))


# --- the draft model's checks -------------------------------------------------------------------

def test_draft_model_refusals(engines, tmp_path):
    engine, root, _ = engines
    reqs = make_requests()[:1]
    with pytest.raises(ConfigError, match="no default draft for this model"):
        get_decoder("draft-model").generate(engine, reqs, SamplingParams(), 1)
    with pytest.raises(ConfigError, match="vocabulary of 384 tokens"):
        get_decoder("draft-model", draft_model=str(root / "other_vocab")).generate(engine, reqs, SamplingParams(), 1)
    with pytest.raises(ConfigError, match="no such checkpoint directory"):
        get_decoder("draft-model", draft_model=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="gamma must be >= 1"):
        get_decoder("ngram", gamma=0)
    with pytest.raises(ConfigError, match="prompt_lookup_min <= prompt_lookup_max"):
        get_decoder("ngram", prompt_lookup_min=4, prompt_lookup_max=2)


def test_draft_prefill_is_a_prefill_step_and_drafts_run_inside_the_verify_step(engines):
    engine, root, _ = engines
    reqs = make_requests()[:2]
    out = get_decoder("draft-model", draft_model=str(root / "draft")).generate(engine, reqs, SamplingParams(), 2)
    prefill_tokens = {r.id: [row.n_tokens for s in out.steps for row in s.rows if row.request == r.id
                             and row.kind == "prefill"] for r in reqs}
    for r in reqs:  # the target's chunks, then the draft's whole prompt in one traced step
        assert sum(prefill_tokens[r.id][:-1]) == len(r.prompt_ids) == prefill_tokens[r.id][-1]
    assert VERIFY in {row.kind for s in out.steps for row in s.rows} <= {"prefill", VERIFY, DECODE}


# --- with the bundled model and the harness -------------------------------------------------------

def test_both_run_with_their_defaults_on_the_bundled_model():
    """`--decoder draft-model` needs no setting for the bundled model (its shipped draft); greedy output
    equals AR's for both, and the drafts are really checked."""
    engine = Engine.from_pretrained("tiny")
    text = "\n".join(f.text for f in corpus.list_files("heldout")[:3])
    ids = engine.tokenizer.encode(text)
    reqs = [Request(str(i), ids[i * 700: i * 700 + 300 + 100 * i], 8 + 2 * i) for i in range(3)]
    ar = get_decoder("ar").generate(engine, reqs, SamplingParams(), 2)
    for name in ("ngram", "draft-model"):
        out = get_decoder(name).generate(engine, reqs, SamplingParams(), 2)
        assert [r.output_ids for r in out.results] == [r.output_ids for r in ar.results], name
        assert sum(d for r in out.results for d, _ in r.verifications) > 0, name
    assert out.info["draft_model_used"] == "tiny-draft" and out.info["draft_layers"] == 2


def test_best_baseline_is_the_fastest_of_all_four_baselines():
    from aspire_bench.harness import records
    from aspire_bench.harness.bench import BenchRow, derive_figures

    def row(decoder, tok_s):  # 4 requests of 10 tokens, each in 10 / tok_s seconds
        rec = records.RunRecord({"decoder": decoder}, "h", {}, info={
            "decode_samples": [[str(i), 0, 10, 10 / tok_s] for i in range(4)]})
        return BenchRow("1k", 2, "greedy", rec)

    rows = [row("ar", 10), row("magicdec", 12), row("vegas", 11), row("ngram", 15), row("draft-model", 13),
            row("aspire", 18)]
    derive_figures(rows, None)
    assert {r.figures["best_baseline"] for r in rows[1:]} == {"ngram"}
    assert rows[-1].figures["speedup_vs_best_baseline"] == pytest.approx(18 / 15)
    rows[4] = row("draft-model", 16)
    derive_figures(rows, None)
    assert rows[-1].figures["best_baseline"] == "draft-model"


def test_step_costs_price_both_drafts_from_their_traits():
    """bench's step costs give ngram c = 0 (host_drafts) and draft-model the draft engine's own AR step
    over the target's (draft_engine), so both rows get a bound share; a row given settings does not
    make the step costs load anything."""
    from aspire_bench.decoders import trait
    from aspire_bench.decoders.draft_model import draft_engine
    from aspire_bench.harness import records
    from aspire_bench.harness.bench import BenchRow, _step_costs, derive_figures
    from aspire_bench.harness.runner import RunConfig

    engine = Engine.from_pretrained("tiny")
    assert trait("ngram", "host_drafts") and not trait("draft-model", "host_drafts")
    assert trait("ngram", "draft_engine")(engine) is None
    assert trait("draft-model", "draft_engine")(engine) is draft_engine("auto", engine)

    def row(decoder, verifications, settings=None):
        rec = records.RunRecord({"decoder": decoder, "decoder_args": settings or {}}, "h", {}, info={
            "decode_samples": [[str(i), 0, 10, 1.0] for i in range(2)], "verifications": verifications})
        return BenchRow("1k", 2, "greedy", rec)

    rows = [row("ar", []), row("ngram", [[2, 1], [0, 0]]), row("draft-model", [[3, 2], [3, 0]])]
    costs = _step_costs(engine, RunConfig(context_len="1k", batch_size=2), rows)
    assert costs["c_ngram"] == 0.0
    assert set(costs["ms"]) >= {"ar", "verify", "draft-model"}
    assert costs["c_draft-model"] == pytest.approx(costs["ms"]["draft-model"] / costs["ms"]["ar"])
    derive_figures(rows, costs)
    assert rows[1].figures["bound_share"] is not None and rows[2].figures["bound_share"] is not None
    assert rows[1].figures["allowed_speedup"] == pytest.approx(3 / (costs["v_by_gamma"][2] + 1.0))
