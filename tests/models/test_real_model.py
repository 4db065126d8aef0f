"""On SmolLM2-135M (`aspire-bench models get smollm2-135m`), when it is in the cache: greedy AR through the
engine equals transformers' greedy generate token for token (fp32), and every decoder equals AR under greedy
with drafts sparse enough to be rejected."""
from __future__ import annotations

import pytest
import torch

from aspire_bench import corpus
from aspire_bench.decoders import Request, SamplingParams, get_decoder
from aspire_bench.engine import Engine
from aspire_bench.models import is_checkpoint, model_dir

NAME = "smollm2-135m"
pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not is_checkpoint(model_dir(NAME)),
                                 reason=f"{NAME} is not in the cache (aspire-bench models get {NAME})")]
# Small budgets: at these prompt lengths the drafts read a fraction of the prefix.
SPARSE = {"magicdec": {"budget": 64, "sinks": 4}, "vegas": {"min_tokens": 32, "ratio": 0.05},
          "aspire": {"min_pages": 2, "recent_pages": 1, "calibration": "none"}}  # no timing: parity needs none


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(NAME, dtype="float32", attention_backend="torch")


@pytest.fixture(scope="module")
def requests(engine):
    text = "".join(f.text for f in corpus.list_files("heldout")[:6])
    ids = engine.tokenizer.encode(text)
    return [Request(str(i), ids[i * 211: i * 211 + n], 32) for i, n in enumerate((300, 180, 420))]


def greedy(engine):
    return SamplingParams(eos_token_ids=tuple(engine.cfg.eos_token_ids))


@pytest.fixture(scope="module")
def ar(engine, requests):
    return get_decoder("ar").generate(engine, requests, greedy(engine), batch_size=3)


def test_greedy_ar_equals_transformers_generate(engine, requests, ar):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir(NAME)), dtype=torch.float32).eval()
    for req, res in zip(requests, ar.results):
        with torch.no_grad():
            out = hf.generate(torch.tensor([req.prompt_ids]), max_new_tokens=req.max_new_tokens, do_sample=False,
                              eos_token_id=list(engine.cfg.eos_token_ids), pad_token_id=0)
        assert res.output_ids == out[0, len(req.prompt_ids):].tolist(), f"request {req.id}"
    assert sum(len(r.output_ids) for r in ar.results) > 40  # the comparison covers real continuations


@pytest.mark.parametrize("name", list(SPARSE))
def test_every_decoder_equals_ar_under_greedy(engine, requests, ar, name):
    out = get_decoder(name, **SPARSE[name]).generate(engine, requests, greedy(engine), batch_size=3)
    assert [r.output_ids for r in out.results] == [r.output_ids for r in ar.results]
    assert sum(d > a for r in out.results for d, a in r.verifications) > 0  # drafts were really rejected
