"""GGUF files -> checkpoints: small files written by the gguf package's writer (random weights; a Llama with
llama.cpp's q/k row order and a tokenizer, a Qwen2 with biases and Q8_0 tensors), converted through the
user-facing loader; weights round-trip and the engine equals transformers on the converted checkpoint."""
from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import make_checkpoint, train_tokenizer
from gguf_fixtures import llama_cpp_rope_rows, write_gguf
from safetensors.torch import load_file

from aspire_bench.cli import main
from aspire_bench.engine import Engine, Row, load_model
from aspire_bench.engine.loading import resolve_model_path
from aspire_bench.errors import CheckpointError
from aspire_bench.models import resolve as resolve_mod  # the module
from aspire_bench.models.gguf_file import sha256_file

TOL = 2e-4


@pytest.fixture(autouse=True)
def model_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("ASPIRE_BENCH_MODELS", str(cache))
    return cache


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(GGUF path, the transformers model it was written from, its tokenizer)."""
    root = tmp_path_factory.mktemp("llama_gguf")
    tok = train_tokenizer(320)
    hf = make_checkpoint("llama", root / "hf", seed=3, vocab_size=len(tok), rope_scaling=None,
                         num_key_value_heads=2)
    write_gguf(root / "llama.gguf", hf, "llama", tokenizer=tok)
    return root / "llama.gguf", hf, tok


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2_gguf")
    hf = make_checkpoint("qwen2", root / "hf", seed=4)
    write_gguf(root / "qwen2.gguf", hf, "qwen2", quantise=("mlp.",))
    return root / "qwen2.gguf", hf


def engine_equals_transformers(path, ids):
    """Engine logits on the converted checkpoint against transformers' own load of it (both fp32)."""
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    eng = Engine(load_model(path), attention_backend="torch")
    eng.reserve(256)
    out = eng.forward([Row(eng.alloc(128), ids, 0, logits="all")]).logits[0]
    with torch.no_grad():
        torch.testing.assert_close(out, ref(torch.tensor([ids])).logits[0], atol=TOL, rtol=0)
    return out


def test_llama_round_trips_weights_tokenizer_and_provenance(llama):
    gguf_path, hf, tok = llama
    path = resolve_model_path(str(gguf_path))
    sd = load_file(str(path / "model.safetensors"))
    original = hf.state_dict()
    assert set(sd) == set(original)
    for name, t in original.items():  # F32 in the file, bf16 in the checkpoint: exactly the rounded originals
        assert sd[name].dtype == torch.bfloat16 and torch.equal(sd[name], t.to(torch.bfloat16)), name
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert "quantization_config" not in cfg
    prov = json.loads((path / "provenance.json").read_text())
    assert prov["gguf_sha256"] == sha256_file(gguf_path) and path.name == f"gguf-{prov['gguf_sha256'][:16]}"
    assert (prov["architecture"], prov["quantisation"], prov["licence"], prov["tokenizer"]) == (
        "llama", "F32", "apache-2.0", True)
    eng = Engine.from_pretrained(str(gguf_path), attention_backend="torch")
    text = "def area(r):\n    return 3.14159 * r * r\n"
    assert eng.tokenizer.encode(text) == tok.encode(text)
    assert "<|im_start|>" in eng.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_llama_engine_equals_transformers_and_the_original_model(llama):
    gguf_path, hf, _ = llama
    ids = torch.randint(0, hf.config.vocab_size, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    out = engine_equals_transformers(resolve_model_path(str(gguf_path)), ids)
    # the original model with its weights rounded as the checkpoint stores them
    rounded = type(hf)(hf.config).eval()
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in hf.state_dict().items()})
    with torch.no_grad():
        torch.testing.assert_close(out, rounded(torch.tensor([ids])).logits[0], atol=TOL, rtol=0)


def test_a_llama_file_without_llama_cpps_row_order_is_caught(llama, tmp_path):
    """The round trip above can fail: a file written in Hugging Face's q/k order (no permutation) converts
    to other q/k weights and other logits."""
    _, hf, _ = llama
    w = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(llama_cpp_rope_rows(w, hf.config.num_attention_heads), w)
    write_gguf(tmp_path / "plain.gguf", hf, "llama", permute=False)
    sd = load_file(str(resolve_model_path(str(tmp_path / "plain.gguf")) / "model.safetensors"))
    for x in "qk":
        name = f"model.layers.0.self_attn.{x}_proj.weight"
        assert not torch.equal(sd[name], hf.state_dict()[name].to(torch.bfloat16))
    name = "model.layers.0.self_attn.v_proj.weight"
    assert torch.equal(sd[name], hf.state_dict()[name].to(torch.bfloat16))


def test_qwen2_biases_and_q8_0_tensors(qwen2):
    gguf_path, hf = qwen2
    path = resolve_model_path(str(gguf_path))
    sd = load_file(str(path / "model.safetensors"))
    for name, t in hf.state_dict().items():
        want = t.to(torch.bfloat16)
        if "mlp." in name:  # Q8_0 in the file: the dequantised values, rounded
            q = gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType.Q8_0)
            want = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)).to(torch.bfloat16)
            assert not torch.equal(want, t.to(torch.bfloat16))  # the quantisation is visible
        assert torch.equal(sd[name], want), name
    assert any(n.endswith("q_proj.bias") for n in sd)
    prov = json.loads((path / "provenance.json").read_text())
    assert prov["quantisation"] == "Q8_0" and prov["tensor_types"]["Q8_0"] == 3 * hf.config.num_hidden_layers
    assert prov["tokenizer"] is False and not (path / "tokenizer.json").exists()
    assert Engine.from_pretrained(str(gguf_path)).tokenizer is None  # token-id prompts only
    ids = torch.randint(0, 320, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    engine_equals_transformers(path, ids)


def test_a_mistral_file_loads_as_the_llama_it_is(llama, tmp_path):
    """llama.cpp writes Mistral models (without a sliding window) as `llama`: the same network."""
    _, hf, _ = llama
    write_gguf(tmp_path / "m.gguf", hf, "llama", name="Mistral 7B Instruct v0.3 test")
    path = resolve_model_path(str(tmp_path / "m.gguf"))
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    engine_equals_transformers(path, list(range(5, 45)))


def test_conversion_is_cached_by_content(llama, tmp_path, monkeypatch):
    gguf_path, _, _ = llama
    first = resolve_model_path(str(gguf_path))

    def no_conversion(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(resolve_mod, "convert_gguf", no_conversion)
    assert resolve_model_path(str(gguf_path)) == first  # by (path, size, mtime)
    folder = tmp_path / "copy"
    folder.mkdir()
    shutil.copy(gguf_path, folder / "renamed.gguf")
    assert resolve_model_path(str(folder)) == first  # a folder holding one GGUF; the same content
    shutil.copy(gguf_path, folder / "second.gguf")
    with pytest.raises(CheckpointError, match="holds 2 GGUF files"):
        resolve_model_path(str(folder))


def test_unsupported_files_fail_in_one_line_before_any_work(tmp_path, model_cache, monkeypatch, qwen2):
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="GGUF architecture 'gpt2' is not supported: supported are llama"):
        resolve_model_path(str(tmp_path / "gpt2.gguf"))
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "gpt2.gguf").read_bytes()[:40])
    with pytest.raises(CheckpointError, match="cannot be read as a GGUF file"):
        resolve_model_path(str(tmp_path / "cut.gguf"))
    monkeypatch.setattr("aspire_bench.models.gguf_file.supported_tensor_types", lambda: {"F32", "F16"})
    with pytest.raises(CheckpointError, match="tensor type Q8_0 cannot be dequantised"):
        resolve_model_path(str(qwen2[0]))
    r = CliRunner().invoke(main, ["diagnose", "heterogeneity", "--model", str(tmp_path / "gpt2.gguf"),
                                  "--store", str(tmp_path / "s.db")])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "'gpt2' is not supported" in r.output, r.output
    assert not model_cache.exists()  # nothing was converted or written


def test_a_converted_bf16_checkpoint_runs_fp32_by_default_and_bf16_on_request(llama):
    """The checkpoint stores bf16; the engine runs it in fp32 unless asked, and in bf16 on the CPU through the
    compiled paths (fp32 arithmetic over bf16 weights and KV), where a sparse decoder still equals AR under greedy."""
    from aspire_bench.decoders import Request, SamplingParams, get_decoder
    gguf_path = str(llama[0])
    assert Engine.from_pretrained(gguf_path).dtype == torch.float32
    eng = Engine.from_pretrained(gguf_path, dtype="bfloat16")
    assert eng.dtype == torch.bfloat16 and eng.dense_backend == "cpp"
    g = torch.Generator().manual_seed(3)
    reqs = [Request(str(i), torch.randint(0, 320, (n,), generator=g).tolist(), 12) for i, n in enumerate((200, 90))]
    ar = get_decoder("ar").generate(eng, reqs, SamplingParams(), 2)
    out = get_decoder("magicdec", budget=32, sinks=4).generate(eng, reqs, SamplingParams(), 2)
    assert [r.output_ids for r in out.results] == [r.output_ids for r in ar.results]
    assert eng.cache.k.dtype == torch.bfloat16
