"""The shipped checkpoints: compressed in the package, expanded once into the cache, byte for byte."""
from __future__ import annotations

import json
import lzma

import pytest
from safetensors.torch import load_file

from aspire_bench.engine import resolve_model_path
from aspire_bench.models import bundled
from aspire_bench.models.bundled import ASSETS, bundled_checkpoint, bundled_name


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASPIRE_BENCH_MODELS", str(tmp_path / "models"))
    bundled._expanded.cache_clear()
    yield tmp_path / "models"
    bundled._expanded.cache_clear()


@pytest.mark.parametrize("name", ["tiny", "tiny-draft"])
def test_expanded_once_into_the_cache_as_an_ordinary_checkpoint(cache, name):
    src = ASSETS / name
    out = bundled_checkpoint(name)
    assert out.parent == cache / "bundled" and out.name.startswith(f"{name}-")
    assert (out / "model.safetensors").read_bytes() == lzma.decompress((src / "model.safetensors.xz").read_bytes())
    assert (out / "tokenizer.json").read_bytes() == (ASSETS / "tiny" / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert not list(out.glob("*.xz"))
    weights = load_file(str(out / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape[0] == json.loads((src / "config.json").read_text())["vocab_size"]
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    bundled._expanded.cache_clear()  # a new process: finds the expanded copy, writes nothing
    assert bundled_checkpoint(name) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (cache / "bundled").iterdir()] == [out.name]  # no temporary folder left


def test_every_spelling_of_a_bundled_model_resolves_to_its_expanded_copy(cache):
    out = bundled_checkpoint("tiny")
    for spelling in ("tiny", str(ASSETS / "tiny"), str(out)):
        assert bundled_name(spelling) == "tiny"
        assert resolve_model_path(spelling) == out
    assert bundled_name(str(bundled_checkpoint("tiny-draft"))) == "tiny-draft"
    assert bundled_name(str(cache)) is None and bundled_name("smollm2-135m") is None


def test_a_folder_without_packed_files_is_used_as_it_is(tmp_path, monkeypatch, cache):
    trained = tmp_path / "assets" / "tiny"  # a freshly trained model copied in, not compressed yet
    trained.mkdir(parents=True)
    (trained / "config.json").write_text("{}")
    monkeypatch.setattr(bundled, "ASSETS", tmp_path / "assets")
    assert bundled_checkpoint("tiny") == trained


def test_a_missing_bundled_model_is_a_one_line_error(tmp_path, monkeypatch, cache):
    from aspire_bench.errors import CheckpointError
    monkeypatch.setattr(bundled, "ASSETS", tmp_path)
    with pytest.raises(CheckpointError, match="reinstall aspire-bench"):
        bundled_checkpoint("tiny")


def test_another_cache_gets_its_own_expanded_copy(cache, tmp_path, monkeypatch):
    first = bundled_checkpoint("tiny")
    monkeypatch.setenv("ASPIRE_BENCH_MODELS", str(tmp_path / "other"))
    second = bundled_checkpoint("tiny")  # within one process too: the cache folder is part of the key
    assert second.parent == tmp_path / "other" / "bundled" and second.name == first.name
    assert (second / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
