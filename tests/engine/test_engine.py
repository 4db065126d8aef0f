"""The engine against transformers' own forward on the same weights (fp32)."""
from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from aspire_bench.engine import PAGE_MAX_SUM, Capture, Engine, PageView, Row, TokenView, load_model
from aspire_bench.errors import CheckpointError, ConfigError

FAMILIES = ("qwen3", "qwen2", "llama")
TOL = 2e-4


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(params=[(f, d) for f in FAMILIES for d in ("cpp", "fused", "eager")], ids=lambda p: "-".join(p))
def family(request, checkpoints):
    """Each family through every dense path (engine/dense.py's compiled and fused ones, model.py's eager one)."""
    fam, dense = request.param
    path, hf = checkpoints[fam]
    eng = Engine(load_model(path), attention_backend="torch", prefill_chunk=24, dense_backend=dense)
    assert eng.dense_backend == dense
    eng.reserve(4096)
    return eng, hf


def test_prefill_matches_transformers(family):
    eng, hf = family
    ids = torch.randint(0, 320, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    slot = eng.alloc(128)
    out = eng.forward([Row(slot, ids, 0, logits="all")])
    torch.testing.assert_close(out.logits[0], hf_logits(hf, ids), atol=TOL, rtol=0)


def test_mixed_batch_steps_and_rollback(family):
    """Two requests of different lengths, chunked prefill, 1-token steps together, then a
    multi-token block after a rollback: every logit equals transformers on the full sequence."""
    eng, hf = family
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (50, 23)]
    slots = [eng.alloc(100), eng.alloc(100)]
    for s, ids in zip(slots, seqs):  # prefill in chunks of 24
        for a in range(0, len(ids), 24):
            eng.forward([Row(s, ids[a:a + 24], a, logits="none")])
    for _ in range(3):  # 1-token steps of both requests in one forward
        new = [int(torch.randint(0, 320, (1,), generator=g)) for _ in seqs]
        out = eng.forward([Row(s, [t], len(ids)) for s, t, ids in zip(slots, new, seqs)])
        for ids, t, lg in zip(seqs, new, out.logits):
            ids.append(t)
            torch.testing.assert_close(lg[0], hf_logits(hf, ids)[-1], atol=TOL, rtol=0)
    # roll request 0 back by 2 (as after rejected drafts) and verify a 5-token block beside a
    # 1-token step of request 1
    eng.rollback(slots[0], len(seqs[0]) - 2)
    seqs[0] = seqs[0][:-2]
    block = torch.randint(0, 320, (5,), generator=g).tolist()
    t1 = int(torch.randint(0, 320, (1,), generator=g))
    out = eng.forward([Row(slots[0], block, len(seqs[0]), logits="all"), Row(slots[1], [t1], len(seqs[1]))])
    torch.testing.assert_close(out.logits[0], hf_logits(hf, seqs[0] + block)[-5:], atol=TOL, rtol=0)
    torch.testing.assert_close(out.logits[1][0], hf_logits(hf, seqs[1] + [t1])[-1], atol=TOL, rtol=0)
    assert slots[0].length == len(seqs[0]) + 5


def test_all_pages_view_equals_full(checkpoints):
    path, _ = checkpoints["qwen3"]
    eng = Engine(load_model(path), attention_backend="torch")
    eng.reserve(512)
    ids = torch.randint(0, 320, (61,), generator=torch.Generator().manual_seed(3)).tolist()
    s = eng.alloc(80)
    eng.forward([Row(s, ids, 0, logits="none")])
    full = eng.forward([Row(s, [7, 8, 9], 61, logits="all")]).logits[0]
    pages = PageView(torch.arange(4))  # 61 positions = 4 pages (last one partial)
    sparse = eng.forward([Row(s, [7, 8, 9], 61, view=pages, logits="all")]).logits[0]
    tokens = eng.forward([Row(s, [7, 8, 9], 61, view=TokenView(torch.arange(61)), logits="all")]).logits[0]
    torch.testing.assert_close(sparse, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(tokens, full, atol=1e-5, rtol=0)
    # a real subset changes the result (the view is not ignored)
    sub = eng.forward([Row(s, [7, 8, 9], 61, view=PageView(torch.tensor([0, 3])), logits="all")]).logits[0]
    assert (sub - full).abs().max() > 1e-3


def test_forward_reports_each_rows_kv_read_and_its_scattered_part(checkpoints):
    """kv_read: positions attended per layer (view + own tokens); kv_sparse: those of the view at the
    head of its runs (the first SCATTERED_HEAD of each), counted here from the view's own description."""
    from aspire_bench.engine import SCATTERED_HEAD
    path, _ = checkpoints["qwen3"]
    eng = Engine(load_model(path), attention_backend="torch")
    eng.reserve(512)
    s = eng.alloc(300)
    eng.forward([Row(s, list(range(1, 201)), 0, logits="none")])  # 200 positions: pages 0..12, 12 partial
    sinks, window = torch.arange(4), torch.arange(200 - 2 * SCATTERED_HEAD - 8, 200)
    pages = torch.tensor([1, 3, 4, 5, 9, 12])  # page 12 holds positions 192..199 only
    out = eng.forward([Row(s, [5, 6], 200, view=TokenView(torch.cat((sinks, window))), logits="none"),
                       Row(s, [5, 6], 200, view=PageView(pages), logits="none")])
    assert out.kv_read == [4 + 2 * SCATTERED_HEAD + 8 + 2, 16 * 5 + 8 + 2]
    # the sinks are a short run, counted in full, the window a long one, counted for its head; the
    # pages' runs are 16, 48, 16 and 8 positions
    assert SCATTERED_HEAD <= 48
    assert out.kv_sparse == [4 + SCATTERED_HEAD, 16 + SCATTERED_HEAD + 16 + 8]
    assert out.kv_captured == [0, 0]  # neither captures scores


def test_forward_reports_the_positions_whose_scores_each_row_captured(checkpoints):
    """kv_captured: per captured query (distinct, -1 = the last), the positions read at each captured
    layer (a full layer: the whole prefix and the row's tokens), summed and divided by the layer count."""
    path, _ = checkpoints["qwen3"]
    eng = Engine(load_model(path), attention_backend="torch")
    L = eng.cfg.num_layers
    eng.reserve(512)
    s = eng.alloc(300)
    eng.forward([Row(s, list(range(1, 201)), 0, logits="none")])
    pages = PageView(torch.tensor([1, 3, 4, 12]))  # 16 * 3 + 8 positions
    r = L - 2
    out = eng.forward([
        Row(s, [5, 6, 7], 200, logits="none", capture=Capture((r,), (0, -1), PAGE_MAX_SUM)),  # a verify row
        Row(s, [5], 200, logits="none", capture=Capture((r,), (0, -1), PAGE_MAX_SUM)),  # one query twice
        Row(s, [5], 200, view=pages, full_layers=frozenset({r}), logits="none",  # ASPIRE's draft
            capture=Capture((r,), (0,), PAGE_MAX_SUM)),
        Row(s, [5, 6], 200, logits="none", capture=Capture(tuple(range(L)), (0, -1), PAGE_MAX_SUM)),  # Vegas's
    ])
    assert out.kv_captured == [round(2 * 203 / L), round(201 / L), round(201 / L), 2 * 202]


def test_sparse_page_view_equals_masked_dense_attention():
    """The backend's sparse path equals dense attention with unselected positions masked out."""
    from aspire_bench.kernels.base import AttentionMeta, RowMeta
    from aspire_bench.kernels.torch_ref import TorchAttention
    g = torch.Generator().manual_seed(4)
    hkv, grp, d, cap, ps = 2, 4, 16, 256, 16
    kc, vc = torch.randn(hkv, cap, d, generator=g), torch.randn(hkv, cap, d, generator=g)
    base, start, n = 32, 150, 3
    q = torch.randn(n, hkv * grp, d, generator=g)
    pages = torch.tensor([0, 2, 5, 9])  # page 9 is partial: positions 144..149 < start
    pos = (pages[:, None] * ps + torch.arange(ps)).flatten()
    pos = pos[pos < start]
    own = torch.arange(start, start + n)
    keys = torch.cat((pos, own))
    row = RowMeta(q_start=0, n=n, base=base, start=start, sparse=[keys + base], sparse_pos=[keys])
    out, _ = TorchAttention().attend(0, q, kc, vc, AttentionMeta([row], n, ps, d ** -0.5))
    # dense reference over [0, start+n) with a mask
    K, V = kc[:, base:base + start + n], vc[:, base:base + start + n]
    allowed = torch.zeros(n, start + n, dtype=torch.bool)
    allowed[:, pos] = True
    for i in range(n):
        allowed[i, start:start + i + 1] = True
    Kr, Vr = K.repeat_interleave(grp, 0), V.repeat_interleave(grp, 0)
    s = torch.einsum("nhd,hld->hnl", q, Kr) * d ** -0.5
    s = s.masked_fill(~allowed[None], float("-inf"))
    ref = torch.einsum("hnl,hld->nhd", s.softmax(-1), Vr)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_rope_parameters_dialect_equals_rope_scaling(checkpoints, tmp_path):
    """A 5.x-style config (rope_parameters) loads to the same model as the 4.x dialect."""
    path, _ = checkpoints["llama"]
    new = tmp_path / "llama5"
    shutil.copytree(path, new)
    cfg = json.loads((new / "config.json").read_text())
    rope = cfg.pop("rope_scaling", None) or cfg.get("rope_parameters")
    theta = cfg.pop("rope_theta", None) or rope.get("rope_theta")
    cfg["rope_parameters"] = {**rope, "rope_theta": theta}
    (new / "config.json").write_text(json.dumps(cfg))
    a, b = load_model(path), load_model(new)
    assert a.cfg.rope == b.cfg.rope and a.cfg.rope_theta == b.cfg.rope_theta == 500000.0
    assert a.cfg.rope["rope_type"] == "llama3"
    torch.testing.assert_close(a._inv_freq, b._inv_freq)


def test_bad_inputs_have_clear_messages(checkpoints, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(empty)
    path, _ = checkpoints["qwen3"]
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    shutil.copy(path / "config.json", noweights / "config.json")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_model(noweights)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (noweights / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPT2LMHeadModel'.*Qwen3ForCausalLM"):
        load_model(noweights)
    with pytest.raises(ConfigError, match="float16 is not supported on CPU"):
        load_model(path, dtype="float16")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            load_model(path, device="cuda")


def test_kv_cache_memory_check_names_bytes_and_knob(checkpoints):
    from aspire_bench.errors import OutOfMemoryBudget
    path, _ = checkpoints["qwen3"]
    eng = Engine(load_model(path), attention_backend="torch")
    with pytest.raises(OutOfMemoryBudget, match=r"GiB.*--batch-size"):
        eng.reserve(10**12)


def test_slots_are_reused_after_free(checkpoints):
    path, _ = checkpoints["qwen3"]
    eng = Engine(load_model(path), attention_backend="torch")
    cache = eng.reserve(320)
    a, b = eng.alloc(160), eng.alloc(160)
    assert (a.base, b.base) == (0, 160)
    eng.free(a)
    eng.free(b)
    assert eng.alloc(320).base == 0  # neighbours coalesced
    assert cache.capacity == 320


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_random_model_has_the_loaded_layout(checkpoints, family):
    """random_model (per-step costs of shapes without weights) builds what load_model builds from the
    same config.json: same fused tensors and shapes (qk-norm, qkv bias), and a forward that runs."""
    path = checkpoints[family][0]
    from aspire_bench.engine.loading import random_model
    loaded = load_model(path)
    rand = random_model(json.loads((path / "config.json").read_text()), seed=1)
    for a, b in zip(loaded.layers, rand.layers):
        for name in vars(a):
            ta, tb = getattr(a, name), getattr(b, name)
            assert (ta is None) == (tb is None), name
            if ta is not None:
                assert ta.shape == tb.shape and ta.dtype == tb.dtype, name
    assert rand.embed.shape == loaded.embed.shape
    eng = Engine(rand)
    eng.reserve(64)
    out = eng.forward([Row(eng.alloc(32), [1, 2, 3], 0, logits="all")])
    assert out.logits[0].shape == (3, rand.cfg.vocab_size) and torch.isfinite(out.logits[0]).all()


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("branch", ("onednn", "plain"))
def test_fused_dense_branches_match_transformers(checkpoints, monkeypatch, fam, branch):
    """The fused path's other branches against transformers: every projection through oneDNN (small
    ones otherwise go to MKL), or all through F.linear (a torch build without oneDNN: one warning);
    per-layer q/k tables (long forwards) in the second."""
    from aspire_bench.engine import dense
    path, hf = checkpoints[fam]
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    if branch == "onednn":
        monkeypatch.setattr(dense, "_SMALL", 0)
        monkeypatch.setattr(dense, "_SMALL_WEIGHT", 0)
        eng = Engine(load_model(path), attention_backend="cpu", dense_backend="fused")
        assert all(p.w is None for p in vars(eng.model._fused.layers[0]).values())
    else:
        monkeypatch.setattr(dense, "_TABLE_LIMIT", 0)
        monkeypatch.setattr(dense, "_warned", False)
        monkeypatch.setattr(dense, "onednn_available", lambda: False)
        with pytest.warns(UserWarning, match="no oneDNN"):
            eng = Engine(load_model(path), attention_backend="cpu", dense_backend="fused")
    eng.reserve(256)
    s = eng.alloc(64)
    out = eng.forward([Row(s, ids[:30], 0, logits="all")]).logits[0]
    torch.testing.assert_close(out, hf_logits(hf, ids[:30]), atol=TOL, rtol=0)
    out = eng.forward([Row(s, ids[30:], 30, logits="all")]).logits[0]  # decode-sized rows: the kernel's path
    torch.testing.assert_close(out, hf_logits(hf, ids)[30:], atol=TOL, rtol=0)


def test_dense_backend_choice(checkpoints, monkeypatch):
    path, _ = checkpoints["qwen3"]
    assert Engine(load_model(path), attention_backend="torch").dense_backend == "cpp"  # auto on a CPU, fp32
    assert Engine(load_model(path, "bfloat16"), attention_backend="torch").dense_backend == "cpp"  # bf16 too
    monkeypatch.setenv("ASPIRE_BENCH_DENSE", "eager")
    assert Engine(load_model(path), attention_backend="torch").dense_backend == "eager"
    with pytest.raises(ConfigError, match="unknown dense backend 'compiled'"):
        Engine(load_model(path), attention_backend="torch", dense_backend="compiled")
    with pytest.raises(ConfigError, match="the fused dense path runs fp32 on a CPU, not bfloat16"):
        Engine(load_model(path, "bfloat16"), attention_backend="torch", dense_backend="fused")
    # two engines on one model each keep their own path
    from aspire_bench.engine.dense import FusedDense
    model = load_model(path)
    fused, eager = (Engine(model, attention_backend="torch", dense_backend=d) for d in ("fused", "eager"))
    calls, real = [], FusedDense.forward
    monkeypatch.setattr(FusedDense, "forward", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    for eng, n_calls in ((eager, 0), (fused, 1)):
        eng.reserve(64)
        eng.forward([Row(eng.alloc(16), [1, 2, 3], 0)])
        assert len(calls) == n_calls


def test_dense_auto_without_a_compiler_falls_back_with_one_warning(checkpoints, monkeypatch):
    """No C++ compiler: auto runs the fused path after one warning; asking for cpp is a one-line error."""
    from aspire_bench.engine import model as model_module
    from aspire_bench.kernels import cpu_build, cpu_dense
    path, _ = checkpoints["qwen3"]
    monkeypatch.setattr(cpu_dense, "_lib", None)
    monkeypatch.setattr(model_module, "_warned_fallback", False)
    monkeypatch.delenv("ASPIRE_BENCH_DENSE", raising=False)

    def no_compiler():
        raise cpu_build.KernelBuildError("no compiler")
    monkeypatch.setattr(cpu_build, "compiler", no_compiler)
    with pytest.warns(UserWarning, match="(?s)needs a C\\+\\+ compiler.*falling back to the fused"):
        assert Engine(load_model(path), attention_backend="torch").dense_backend == "fused"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process, not once per model
        assert Engine(load_model(path), attention_backend="torch").dense_backend == "fused"
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler.*use dense backend fused"):
        Engine(load_model(path), attention_backend="torch", dense_backend="cpp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_pool_is_zeroed_independent_and_sized(dtype):
    # The pool is an anonymous private mapping on Linux CPUs (huge-page advice), a torch tensor elsewhere:
    # either way it starts at zero, the K and V pools share nothing and writes stay where they land.
    from aspire_bench.engine.kv_cache import KVCache
    cache = KVCache(2, 2, 16, 100, dtype, torch.device("cpu"))
    assert cache.k.shape == cache.v.shape == (2, 2, 112, 16) and cache.k.dtype == dtype
    assert not cache.k.any() and not cache.v.any()
    cache.k[1, 0, 5] = 1.5
    assert cache.k.sum().item() == 1.5 * 16 and not cache.v.any()
    assert cache.bytes_per_position == 2 * 2 * 2 * 16 * cache.k.element_size()


def test_scattered_positions_counts_the_head_of_every_run():
    from aspire_bench.engine import SCATTERED_HEAD, scattered_positions
    H = SCATTERED_HEAD
    long = torch.arange(100, 100 + 3 * H)  # a long run: its head only
    exact = torch.arange(1000, 1000 + H)  # a run of exactly the head: all of it
    short = torch.arange(300, 300 + H - 1)  # a shorter run: all of it
    singles = torch.tensor([5, 7, 9])
    assert scattered_positions(long) == H
    assert scattered_positions(exact) == H
    assert scattered_positions(short) == H - 1
    assert scattered_positions(torch.cat((singles, long, short, exact))) == 3 + H + H - 1 + H
    assert scattered_positions(torch.tensor([], dtype=torch.long)) == 0
    assert scattered_positions(torch.cat((singles, long, short)).numpy()) == 3 + H + H - 1
    # one row per layer: each layer's runs on their own, even where one layer ends where the next begins
    halves = torch.stack((torch.arange(0, H // 2), torch.arange(H // 2, H)))
    assert scattered_positions(halves) == H
    assert scattered_positions(torch.stack((long, long))) == 2 * H


def test_bf16_compiled_path_rounds_the_kv_it_writes_and_is_one_path():
    """bf16 on a CPU through the compiled dense path: fp32 arithmetic, the KV rounded to bf16 as it is
    written. The tiny checkpoint stores bf16 weights, so its fp32 and bf16 models hold the same values:
    the first layer's KV (written before any attention reads rounded KV) is the fp32 run's rounded,
    bit for bit; the logits stay nearer fp32's than the eager bf16 path's; and a decode row's logits are
    the same in a one-call forward as beside a prefill chunk (the per-layer path)."""
    ids = torch.randint(0, 1000, (260,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = {}
    for dtype, dense in (("float32", "cpp"), ("bfloat16", "cpp"), ("bfloat16", "eager")):
        eng = Engine(load_model("tiny", dtype), attention_backend="cpu", dense_backend=dense, prefill_chunk=64)
        eng.reserve(1024)
        assert eng.dense_backend == dense and eng.cache.k.dtype == getattr(torch, dtype)
        a, b = eng.alloc(300), eng.alloc(300)
        eng.forward([Row(a, ids[:200], 0, logits="none")])
        eng.forward([Row(b, ids[:100], 0, logits="none")])
        alone = eng.forward([Row(a, ids[200:201], 200, logits="all")]).logits[0]
        eng.rollback(a, 200)
        beside = eng.forward([Row(a, ids[200:201], 200, logits="all"), Row(b, ids[100:160], 100, logits="none")])
        kv0 = [pool[0, :, a.base:a.base + 201].clone() for pool in (eng.cache.k, eng.cache.v)]
        runs[dtype, dense] = alone, beside.logits[0], kv0
    fp32, bf16, eager = runs["float32", "cpp"], runs["bfloat16", "cpp"], runs["bfloat16", "eager"]
    for ours, theirs in zip(bf16[2], fp32[2]):
        assert torch.equal(ours, theirs.to(torch.bfloat16))
    assert bf16[0].dtype == torch.float32 and torch.equal(bf16[0], bf16[1])
    assert torch.equal(fp32[0], fp32[1])
    near, far = ((x[0] - fp32[0]).abs().max().item() for x in (bf16, eager))
    assert 0 < near < far / 2
