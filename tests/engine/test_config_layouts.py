"""config.json as transformers 4 writes it (`torch_dtype`, `rope_theta`, `rope_scaling`) and as transformers 5
writes it (`dtype`, `rope_parameters`, possibly per attention type): the same model either way."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from aspire_bench.engine import load_model
from aspire_bench.engine.config import ModelConfig
from aspire_bench.engine.loading import checkpoint_dtype

BASE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
YARN = {"factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0}
V4 = {**BASE, "torch_dtype": "bfloat16", "rope_theta": 1e6, "rope_scaling": {"type": "yarn", **YARN}}
V5 = {**BASE, "dtype": "bfloat16", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **YARN}}
V5_NESTED = {**BASE, "dtype": "bfloat16",
             "rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6, **YARN}}}
PLAIN_V4 = {**BASE, "torch_dtype": "float32", "rope_theta": 5e5, "rope_scaling": None}
PLAIN_V5 = {**BASE, "dtype": "float32", "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}


@pytest.mark.parametrize("layout", [V5, V5_NESTED], ids=["v5", "v5-per-attention-type"])
def test_v4_and_v5_layouts_parse_to_the_same_config(layout):
    a, b = ModelConfig.from_hf(V4), ModelConfig.from_hf(layout)
    assert a == b
    assert (b.rope_theta, b.rope["rope_type"], b.rope["factor"], b.max_context) == (1e6, "yarn", 4.0, 4096)


def test_plain_rope_in_both_layouts():
    a, b = ModelConfig.from_hf(PLAIN_V4), ModelConfig.from_hf(PLAIN_V5)
    assert a == b and a.rope == {"rope_type": "default"} and a.rope_theta == 5e5


@pytest.mark.parametrize("layout", [V4, V5], ids=["v4", "v5"])
def test_each_layout_loads_in_its_own_dtype_with_the_same_weights(checkpoints, tmp_path, layout):
    """A checkpoint whose config.json is written in one layout: `auto` reads its dtype key, and the model
    equals the one loaded from the other layout."""
    src, _ = checkpoints["qwen2"]
    loaded = {}
    for name, cfg in (("v4", V4), ("v5", V5)):
        d = tmp_path / name
        shutil.copytree(src, d)
        raw = json.loads((d / "config.json").read_text())
        for k in ("dtype", "torch_dtype", "rope_theta", "rope_scaling", "rope_parameters"):
            raw.pop(k, None)
        raw.update({k: v for k, v in cfg.items() if k not in BASE})
        (d / "config.json").write_text(json.dumps(raw))
        loaded[name] = d
    d = loaded["v4" if layout is V4 else "v5"]
    assert checkpoint_dtype(d) == "bfloat16"
    m = load_model(d, dtype="auto")
    assert m.dtype == torch.bfloat16 and m.cfg.rope["rope_type"] == "yarn"
    other = load_model(loaded["v5" if layout is V4 else "v4"], dtype="auto")
    assert m.cfg == other.cfg
    torch.testing.assert_close(m._inv_freq, other._inv_freq, atol=0, rtol=0)
