"""The tiny-model trainer, and the checkpoint shipped in aspire_bench/assets/tiny.

The checkpoint tests fail (not skip) when it is missing: it is part of the package.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from aspire_bench import corpus
from aspire_bench.models.bundled import bundled_checkpoint
from aspire_bench.textstats import distinct_n
from aspire_bench.tinymodel import TINY_DIR
from aspire_bench.tinymodel.train import TrainSettings, heldout_loss, heldout_prefix, train_tiny

# Held-out tokens differ slightly across CPython versions (the corpus is the installed stdlib) and
# fp32 sums differ across BLAS builds; a wrong or retrained checkpoint moves the loss far more.
LOSS_TOLERANCE = 0.05


def test_distinct_n():
    assert distinct_n(list(range(20))) == 1.0
    assert distinct_n([1, 2, 3, 4] * 10) == pytest.approx(4 / 37)
    assert distinct_n([1, 2], n=4) is None  # no 4-gram to judge
    assert distinct_n("abab", n=2) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        distinct_n([1, 2, 3], n=0)


def _small_settings() -> TrainSettings:
    return TrainSettings(short_len=64, long_lens=(128,), tokens_per_step=512, warmup_steps=3,
                         vocab_size=512, model={"num_hidden_layers": 2, "hidden_size": 64,
                                                "intermediate_size": 128})


def test_train_tiny_runs_and_learns(tmp_path):
    files = corpus.list_files("train")[:6]
    settings = _small_settings()
    record = train_tiny(tmp_path, max_steps=40, settings=settings, files=files, eval_tokens=0, log_every=100)
    assert record["steps"] == 40 and record["long_phase_from_step"] == 32
    assert record["final_train_loss"] < record["first_train_loss"] - 1.0
    assert record["corpus"] == {"name": "stdlib", "split": "train", "files": 6,
                                "sha256": corpus.content_hash(files), "heldout_packages": list(corpus.HELDOUT_PACKAGES)}
    saved = json.loads((tmp_path / "training.json").read_text())
    assert saved["tokens_seen"] == record["tokens_seen"] > 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert tok.decode(tok("def f(x):\n    return x\n")["input_ids"]) == "def f(x):\n    return x\n"


def test_eval_points_keep_loadable_snapshots(tmp_path):
    files = corpus.list_files("train")[:4]
    record = train_tiny(tmp_path, max_steps=8, settings=_small_settings(), files=files, eval_tokens=256,
                        log_every=100, eval_every=4)
    assert [p["step"] for p in record["curve"]] == [4, 8]
    from transformers import AutoModelForCausalLM
    snap = AutoModelForCausalLM.from_pretrained(tmp_path / "curve" / "step_8", dtype=torch.float32)
    final = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    # The last snapshot is the final model: snapshots never rounded the weights training went on with.
    for (name, a), b in zip(snap.state_dict().items(), final.state_dict().values()):
        assert torch.equal(a, b), name
    assert (tmp_path / "curve" / "step_4" / "tokenizer.json").is_file()


def test_a_new_shape_can_start_from_another_checkpoints_tokenizer(tmp_path, capsys):
    files = corpus.list_files("train")[:4]
    train_tiny(tmp_path / "a", max_steps=2, settings=_small_settings(), files=files, eval_tokens=0, log_every=100)
    wider = _small_settings()
    wider.model = wider.model | {"hidden_size": 96, "intermediate_size": 192}
    record = train_tiny(tmp_path / "b", max_steps=2, settings=wider, files=files, eval_tokens=0, log_every=100,
                        tokenizer_from=tmp_path / "a")
    assert record["tokenizer_from"] == str(tmp_path / "a") and record["continued_from"] is None
    from tokenizers import Tokenizer
    a, b = (Tokenizer.from_file(str(tmp_path / d / "tokenizer.json")) for d in ("a", "b"))
    assert a.get_vocab() == b.get_vocab()  # the same tokens, so losses in nats per token compare
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"]) == (96, 192)
    # 2 layers x 2 KV heads x 32 dims x (K, V) x 4 bytes
    assert "2 layers, hidden 96, MLP 192, 4 query / 2 KV heads of 32: KV 1.0 KiB per token" in capsys.readouterr().out


def test_python_corpus_adds_site_packages_but_never_heldout_code(monkeypatch):
    files = corpus.site_files(("click",))
    assert files and all(f.relpath.startswith("site/click/") and f.package == "site/click" for f in files)
    assert not any("/tests/" in f.relpath or "_vendor" in f.relpath for f in files)
    # A file whose text equals a held-out file's (a vendored copy) is dropped.
    some = files[0].text
    assert all(f.text != some for f in corpus.site_files(("click",), exclude_texts=frozenset({some})))
    monkeypatch.setattr(corpus, "SITE_PACKAGES", ("click",))
    monkeypatch.setattr(corpus, "site_files", lambda exclude_texts: [
        f for f in files if f.text not in exclude_texts])
    train = corpus.training_files("python")
    heldout = {f.text for f in corpus.list_files("heldout") if f.text.strip()}  # empty __init__.py files aside
    assert len(train) == len(corpus.list_files("train")) + len(files)
    assert not heldout.intersection(f.text for f in train)
    with pytest.raises(ValueError, match="unknown corpus"):
        corpus.training_files("web")


@pytest.fixture(scope="module")
def shipped():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bundled_checkpoint("tiny")  # the shipped files, expanded as every reader gets them
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    record = json.loads((TINY_DIR / "training.json").read_text())
    return tok, model, record


def test_interrupted_training_resumes_to_the_same_weights(tmp_path, monkeypatch):
    """A run killed after a checkpoint and started again ends exactly where an uninterrupted one does."""
    from aspire_bench.tinymodel import train

    files = corpus.list_files("train")[:4]
    kw = {"max_steps": 8, "files": files, "eval_tokens": 0, "log_every": 100, "checkpoint_every": 3,
          "eval_every": 4, "eval_contexts": (4096, 1024)}
    whole = train_tiny(tmp_path / "whole", settings=_small_settings(), **kw)

    real_save = train.save_checkpoint

    def save_then_die(path, state):
        real_save(path, state)
        if state["step"] == 6:
            raise KeyboardInterrupt  # as a kill right after the second checkpoint

    monkeypatch.setattr(train, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_tiny(tmp_path / "resumed", settings=_small_settings(), **kw)
    assert (tmp_path / "resumed" / train.CHECKPOINT).exists()
    resumed = train_tiny(tmp_path / "resumed", settings=_small_settings(), **kw)
    assert not (tmp_path / "resumed" / train.CHECKPOINT).exists()  # removed once the run is complete
    assert resumed["steps"] == whole["steps"] == 8
    assert resumed["final_train_loss"] == whole["final_train_loss"]
    assert [p["step"] for p in resumed["curve"]] == [4, 8]
    assert all(p["heldout_loss_4096"] > 0 and p["heldout_loss_1024"] > 0 for p in resumed["curve"])
    a = (tmp_path / "whole" / "model.safetensors").read_bytes()
    b = (tmp_path / "resumed" / "model.safetensors").read_bytes()
    assert a == b


def test_resume_refuses_other_settings(tmp_path, monkeypatch):
    from aspire_bench.tinymodel import train

    files = corpus.list_files("train")[:4]
    monkeypatch.setattr(train, "save_checkpoint",
                        lambda path, state: (torch.save(state, path), (_ for _ in ()).throw(KeyboardInterrupt)))
    with pytest.raises(KeyboardInterrupt):
        train_tiny(tmp_path, max_steps=4, settings=_small_settings(), files=files, eval_tokens=0,
                   checkpoint_every=2)
    from aspire_bench.errors import UserError
    with pytest.raises(UserError, match="other settings or seed"):
        train_tiny(tmp_path, max_steps=4, settings=_small_settings(), files=files, eval_tokens=0,
                   checkpoint_every=2, seed=1)


def test_shipped_checkpoint_shape(shipped):
    tok, model, record = shipped
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim) == ("qwen3", 16, 128, 4, 2, 32)
    assert c.tie_word_embeddings and c.max_position_embeddings == 40960 and c.vocab_size == 4096
    assert c.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    size = sum(p.stat().st_size for p in TINY_DIR.iterdir())
    assert size <= 20e6
    assert record["params"] == sum(p.numel() for p in model.parameters())


def test_shipped_heldout_loss_matches_record(shipped):
    tok, model, record = shipped
    recorded = record["heldout_loss"]
    loss = heldout_loss(model, tok.backend_tokenizer, 1024, recorded["eval_tokens"])
    assert abs(loss - recorded["1024"]) < LOSS_TOLERANCE, (loss, recorded["1024"])


def test_shipped_greedy_continuation_is_not_a_loop(shipped):
    tok, model, _ = shipped
    ids = torch.as_tensor(heldout_prefix(tok.backend_tokenizer, 4096), dtype=torch.long)[None]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128,
                             min_new_tokens=128, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == 128
    assert distinct_n(new, 4) >= 0.5, tok.decode(new)


def test_learning_curve_extrapolation_solves_its_fits():
    import math
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import learning_curve as lc
    # loss = 6 - 0.25 ln(tokens): reaches 3.9 at exp(8.4); acceptance = 1.9 - 0.25 loss: 0.88 at loss 4.08
    pts = [{"tokens_total": t, "heldout_loss_4096": 6 - 0.25 * math.log(t)} for t in (1e6, 2e6, 4e6, 8e6)]
    for p in pts:
        p["pages@16384"] = 1.9 - 0.25 * p["heldout_loss_4096"]
    assert lc.tokens_for_loss(pts, 3.9, 4) == pytest.approx(math.exp(8.4), rel=1e-6)
    assert lc.loss_for_acceptance(pts, "pages@16384", 0.88) == pytest.approx(4.08)
    flat = [{"tokens_total": t, "heldout_loss_4096": 4.2} for t in (1e6, 2e6)]
    assert lc.tokens_for_loss(flat, 3.9, 4) is None  # not improving: no extrapolation, never a made-up number
    assert lc.tokens_for_loss(pts[:1], 3.9, 4) is None


@pytest.mark.parametrize("args, message", [
    (["--long-lens", "4096,x"], "--long-lens takes comma-separated integers"),
    (["--eval-contexts", "4k"], "--eval-contexts takes comma-separated integers"),
    (["--eval-contexts", "4096,1"], "--eval-contexts entries must be at least 2 tokens"),
    (["--hidden-size", "0"], "--hidden-size, --intermediate-size and --layers must be positive"),
    (["--layers", "0"], "--hidden-size, --intermediate-size and --layers must be positive"),
    (["--keep-layers", "0,15"], "--keep-layers needs --init-from"),
    (["--init-from", str(TINY_DIR), "--keep-layers", "0,16"], "has layers 0..15"),
    (["--init-from", str(TINY_DIR), "--keep-layers", "a"], "--keep-layers takes comma-separated layer indices"),
    (["--init-from", str(TINY_DIR), "--intermediate-size", "768"], "--init-from continues a checkpoint"),
    (["--tokenizer-from", "."], "--tokenizer-from .: no tokenizer.json there"),
])
def test_train_tiny_refuses_bad_lists_in_one_line(tmp_path, capsys, args, message):
    from aspire_bench.tinymodel.train import main
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "out"), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any work


def test_keep_only_layers_keeps_those_layers_in_order(checkpoints):
    from transformers import Qwen3ForCausalLM

    from aspire_bench.tinymodel.train import keep_only_layers
    path, _ = checkpoints["qwen3"]
    model = Qwen3ForCausalLM.from_pretrained(str(path))
    first, last = model.model.layers[0], model.model.layers[3]
    keep_only_layers(model, (0, 3))
    assert list(model.model.layers) == [first, last] and model.config.num_hidden_layers == 2
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1]
    with torch.no_grad():  # the truncated model runs
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, model.config.vocab_size)


def test_shipped_draft_shares_the_bundled_models_vocabulary_and_width():
    draft = TINY_DIR.parent / "tiny-draft"
    cfg, target = (json.loads((d / "config.json").read_text()) for d in (draft, TINY_DIR))
    assert cfg["num_hidden_layers"] == 2
    assert all(cfg[k] == target[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "head_dim",
                                             "num_key_value_heads", "eos_token_id"))
    assert (draft / "tokenizer.json").read_bytes() == (TINY_DIR / "tokenizer.json").read_bytes()
    assert (draft / "model.safetensors.xz").stat().st_size < 2e6
