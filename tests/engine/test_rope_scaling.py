"""Rope scaling (YaRN, dynamic NTK) and Mistral without a sliding window: greedy tokens equal
transformers.generate past the original context, on small random models, through both dense paths
(engine/dense.py's fused one, whose RoPE tables are built once per forward, and model.py's eager one)."""
from __future__ import annotations

import pytest
import torch
from conftest import make_checkpoint

from aspire_bench.decoders import Request, SamplingParams, get_decoder
from aspire_bench.engine import Engine, load_model
from aspire_bench.errors import CheckpointError

ORIGINAL = 48  # the original context; every request below decodes well past it


DENSE = ["fused", "eager"]


def _greedy_matches(path, hf, prompt_lens=(20, 40), new=40, past=True, dense="auto"):
    eng = Engine(load_model(path), attention_backend="torch", prefill_chunk=16, dense_backend=dense)
    assert dense == "auto" or eng.dense_backend == dense
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(0, 320, (n,), generator=g).tolist() for n in prompt_lens]
    out = get_decoder("ar").generate(eng, [Request(str(i), p, new) for i, p in enumerate(ps)], SamplingParams(), 2)
    for r, p in zip(out.results, ps):
        assert not past or len(p) + new > ORIGINAL + 10
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=new, min_new_tokens=new, do_sample=False)[0, len(p):].tolist()
        assert r.output_ids == ref
    return eng


@pytest.mark.parametrize("dense", DENSE)
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_yarn_equals_transformers_past_the_original_context(family, dense, tmp_path):
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    hf = make_checkpoint(family, tmp_path, seed=5, rope_scaling=rope, max_position_embeddings=ORIGINAL)
    eng = _greedy_matches(tmp_path, hf, dense=dense)
    assert eng.max_context == 4 * ORIGINAL
    assert eng.model._cos[0, 0] != 1.0  # YaRN's attention factor scales cos and sin


@pytest.mark.parametrize("dense", DENSE)
def test_dynamic_ntk_equals_transformers_past_the_original_context(dense, tmp_path):
    hf = make_checkpoint("qwen2", tmp_path, seed=6, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                         max_position_embeddings=ORIGINAL)
    eng = _greedy_matches(tmp_path, hf, prompt_lens=(20, 30), dense=dense)
    assert eng.max_context == 2 * ORIGINAL


def test_mistral_without_sliding_window_is_a_llama(tmp_path):
    import transformers as tf
    from conftest import COMMON
    torch.manual_seed(0)
    hf = tf.MistralForCausalLM(tf.MistralConfig(**{**COMMON, "sliding_window": None})).eval()
    hf.save_pretrained(str(tmp_path / "m"))
    _greedy_matches(tmp_path / "m", hf, prompt_lens=(9, 17), new=12, past=False)
    windowed = tf.MistralForCausalLM(tf.MistralConfig(**{**COMMON, "sliding_window": 64}))
    windowed.save_pretrained(str(tmp_path / "w"))
    with pytest.raises(CheckpointError, match="sliding_window=64"):
        load_model(tmp_path / "w")


def test_unknown_rope_types_keep_their_refusal(tmp_path):
    make_checkpoint("llama", tmp_path, rope_scaling={"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0] * 8,
                                                     "long_factor": [1.0] * 8, "original_max_position_embeddings": 64})
    with pytest.raises(CheckpointError, match="unsupported rope type 'longrope'"):
        load_model(tmp_path)


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                                   "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
                                  {"rope_type": "dynamic", "factor": 2.0}])
def test_rotations_equal_transformers_token_by_token(rope, tmp_path):
    """cos/sin of each position, as transformers computes them when decoding that position alone (for
    dynamic NTK: the base of the length at that step), before and past the original context."""
    hf = make_checkpoint("qwen2", tmp_path, rope_scaling=rope, max_position_embeddings=ORIGINAL)
    ours = load_model(tmp_path)
    x = torch.zeros(1, 1, 16)
    for p in range(3 * ORIGINAL):
        cos, sin = hf.model.rotary_emb(x, torch.tensor([[p]]))
        c, s = ours._rope_tables(torch.tensor([p]))
        torch.testing.assert_close(c, cos[0], atol=2e-5, rtol=0)  # fp32 angles of up to ~150 rad
        torch.testing.assert_close(s, sin[0], atol=2e-5, rtol=0)  # fp32 angles of up to ~150 rad
    default = make_checkpoint("qwen2", tmp_path / "plain", max_position_embeddings=ORIGINAL)
    plain = default.model.rotary_emb(x, torch.tensor([[2 * ORIGINAL]]))[0]
    assert (plain - ours._rope_tables(torch.tensor([2 * ORIGINAL]))[0]).abs().max() > 1e-3  # scaling changed it


def test_a_linear_override_extends_the_checkpoints_context(tmp_path):
    """An override's factor scales the checkpoint's max_position_embeddings (as YaRN's default does);
    config.json's own linear entry comes with max_position_embeddings already scaled, so it is kept."""
    from aspire_bench.engine.loading import read_config
    make_checkpoint("qwen2", tmp_path / "plain", max_position_embeddings=ORIGINAL)
    linear = read_config(tmp_path / "plain", {"rope_type": "linear", "factor": 2.0})
    assert linear.max_context == 2 * ORIGINAL and linear.rope["original_max_position_embeddings"] == ORIGINAL
    assert read_config(tmp_path / "plain", {"rope_type": "yarn", "factor": 2.0}).max_context == 2 * ORIGINAL
    assert read_config(tmp_path / "plain").max_context == ORIGINAL
    make_checkpoint("qwen2", tmp_path / "own", rope_scaling={"rope_type": "linear", "factor": 2.0},
                    max_position_embeddings=2 * ORIGINAL)
    assert read_config(tmp_path / "own").max_context == 2 * ORIGINAL
