"""Shared fixtures: random-init tiny checkpoints of each supported family, saved as HF directories
and loaded back through the user-facing loader; and the seeds every test's random inputs come from.

Seeds are fixed, so a run is reproducible: each test starts with torch, numpy and `random` seeded
from its own name, and the `seed` fixture gives a test that builds its own generators the same
number. `ASPIRE_BENCH_FUZZ=1` (or `=N` for a chosen base) draws fresh seeds instead, so repeated
runs search new random inputs; the base is printed in the header and a failing test's report
names its seed, so `ASPIRE_BENCH_FUZZ=<base>` replays it.
"""
from __future__ import annotations

import importlib
import os
import random
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# ASPIRE's calibrations made by the tests (on toy models, under test load) stay out of the user's cache.
os.environ.setdefault("ASPIRE_BENCH_CALIBRATION_DIR", tempfile.mkdtemp(prefix="aspire-bench-calibration-"))

import numpy as np
import pytest
import torch

torch.set_num_threads(2)

from seeds import FUZZ_BASE, seed_for


def pytest_report_header(config):
    return (f"random inputs: fuzz mode, base seed {FUZZ_BASE} (replay: ASPIRE_BENCH_FUZZ={FUZZ_BASE})"
            if FUZZ_BASE else "random inputs: fixed seeds (ASPIRE_BENCH_FUZZ=1 draws fresh ones)")


@pytest.fixture
def seed(request) -> int:
    """This test's seed: fixed (from the test's name), or fresh in fuzz mode."""
    s = seed_for(request.node.nodeid)
    request.node.user_properties.append(("seed", s))
    return s


@pytest.fixture(autouse=True)
def _seeded(seed):
    """Global RNGs seeded per test, so no test depends on which ran before it."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


# What ASPIRE's automatic calibration gives in tests: a cost model of a CPU-like machine (verification
# dearer per draft, scattered pages dearer than a stream), so that a run's schedule does not depend on
# a fit timed under whatever else the machine runs. Tests marked `real_calibration` time the machine.
FIXED_CALIBRATION = {"beta0": 2e-3, "beta_tok": 1e-4, "beta_attn": 3e-8, "beta_qk": 1e-9, "r2": 0.99, "qk_free": 1,
                     "beta_sparse": 1e-8, "beta_multi": 0.0, "beta_capture": 5e-9}


@pytest.fixture(autouse=True)
def _fixed_calibration(request, monkeypatch, tmp_path_factory):
    from aspire_bench.decoders import calibration
    from aspire_bench.decoders.scheduler import CostModel, fit_cost_model
    if request.node.get_closest_marker("real_calibration"):
        # a directory of its own: a fixed calibration stored by another test is not a timing
        monkeypatch.setenv("ASPIRE_BENCH_CALIBRATION_DIR", str(tmp_path_factory.mktemp("calibration")))
        return

    def fixed(engine, batch_size, context, **kw):
        fit = CostModel.from_dict(FIXED_CALIBRATION, "calibration")
        return calibration.Calibration(fit, (), batch_size, context, r2_train=fit.r2, heldout_rel_err_median=0.0,
                                       heldout_rel_err_max=0.0)

    def fixed_round(engine, batch_size, context, **kw):  # bench's rounds keep samples: a grid priced by it
        samples = fixed_samples(batch_size, context)
        return calibration.Calibration(fit_cost_model(samples, source="calibration"), tuple(samples), batch_size,
                                       context)
    # the module, imported before calibrate is patched: imported first under the patch, it would bind the
    # sample-less stand-in as its own `calibrate`, which monkeypatch then restores after every test
    bench = importlib.import_module("aspire_bench.harness.bench")
    monkeypatch.setattr(calibration, "calibrate", fixed)
    monkeypatch.setattr(bench, "calibrate", fixed_round)


def fixed_samples(batch: int, context: int) -> list:
    """A calibration grid (decode, draft, draft capturing, verify rows at two lengths) priced by
    FIXED_CALIBRATION, each step off by up to 2% so that the fit has residuals, as a timing would."""
    from aspire_bench.decoders.scheduler import CostModel, CostSample, qk_term
    model, samples = CostModel.from_dict(FIXED_CALIBRATION, "fixed"), []
    for length in (context // 4, context):
        sparse = max(512, length // 14)
        kinds = [[(1, length, 0, 0)], [(1, sparse, sparse, 0)], [(1, sparse, sparse, length)]]
        kinds += [[(g + 1, length, 0, 0)] for g in (1, 2, 3, 4, 8, 16)]
        for i, rows in enumerate(kinds):
            per_row = rows * batch
            wobble = 1 + 0.01 * ((i * 7 + length) % 5 - 2)
            samples.append(CostSample(sum(r[0] for r in per_row), sum(r[1] for r in per_row), qk_term(per_row),
                                      model.rows_time(per_row) * wobble, per_row))
    return samples


@pytest.fixture(scope="session")
def cli():
    """The real CLI, each command in a fresh process forked from one that imported it once
    (tests/forkcli.py): `cli(*args, cwd=..., env=..., close_stdout=...)` -> CompletedProcess."""
    from forkcli import ForkCLI
    server = ForkCLI()
    yield server
    server.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seeds = [v for k, v in item.user_properties if k == "seed"]
    if report.failed and seeds:
        report.sections.append(("random inputs", f"seed {seeds[0]} (fuzz base {FUZZ_BASE})"))

COMMON = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}


def make_checkpoint(family: str, path, seed: int = 0, **over):
    import transformers as tf
    torch.manual_seed(seed)
    if family == "qwen3":
        cfg = tf.Qwen3Config(**{**COMMON, "head_dim": 16, "rope_theta": 10000.0, "tie_word_embeddings": True,
                                **over})
        model = tf.Qwen3ForCausalLM(cfg)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**{**COMMON, "rope_theta": 10000.0, "tie_word_embeddings": False, **over})
        model = tf.Qwen2ForCausalLM(cfg)
    elif family == "llama":
        cfg = tf.LlamaConfig(**{**COMMON, "num_key_value_heads": 1, "rope_theta": 500000.0,
                                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                                **over})
        model = tf.LlamaForCausalLM(cfg)
    else:
        raise ValueError(family)
    with torch.no_grad():  # random-init biases are zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.eval().save_pretrained(str(path))
    return model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{family: (path, transformers model)} for qwen3, qwen2 (qkv bias), llama (GQA 4:1, llama3 rope)."""
    root = tmp_path_factory.mktemp("ckpt")
    return {f: (root / f, make_checkpoint(f, root / f)) for f in ("qwen3", "qwen2", "llama")}


def train_tokenizer(vocab_size: int = 768):
    """A small byte-level BPE trained on stdlib text, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from aspire_bench import corpus
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f.text for f in corpus.list_files("train")[:40]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def random_tiny(tmp_path_factory):
    """A random-init Qwen3 checkpoint with a real tokenizer: runs tasks end to end through the
    user-facing loader (its outputs are meaningless; acceptance needs the trained tiny model)."""
    path = tmp_path_factory.mktemp("random_tiny")
    make_checkpoint("qwen3", path, vocab_size=768, max_position_embeddings=8192, eos_token_id=0)
    train_tokenizer().save_pretrained(str(path))
    return path
