"""Triton kernels against the torch reference, on the CPU through Triton's interpreter.

TRITON_INTERPRET must be set before the kernels are defined (triton.jit picks interpreter or compiler
at decoration), so it is set here, at the top of the only test module that imports them; it stays set
for the session (the backend reads it to allow CPU tensors), which no other module depends on.
Shapes are tiny: the interpreter runs each program in Python.
Every output buffer of the Triton path is NaN-poisoned, so an element a kernel forgets to write shows.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover
    pytest.skip(f"triton is not importable ({e}); the Triton kernels are untested here", allow_module_level=True)

import kernel_cases
from kernel_cases import capture_at_layer0, make_batch, meta_of, rel_err

from aspire_bench.kernels import get_backend
from aspire_bench.kernels import triton_attention as ta
from aspire_bench.kernels import triton_common as tc
from aspire_bench.kernels.base import PAGE_MAX_SUM, TOKEN_MEAN
from aspire_bench.kernels.triton_backend import TritonAttention

if type(ta._attn_fwd).__name__ != "InterpretedFunction":  # pragma: no cover
    pytest.skip("the kernels were compiled for a GPU before this module set TRITON_INTERPRET=1 "
                "(imported by an earlier module?); run this file on its own", allow_module_level=True)

# Relative error bounds (max |diff| / max |ref|): a few ulps of the output dtype, accumulated over
# two matmuls; the reference itself rounds probabilities to the dtype before P@V.
RTOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(tc, "empty", nan_empty)


def run_both(q, k, v, rows, d, layer=0, page_size=16, **kw):
    return kernel_cases.run_both(TritonAttention(**kw), q, k, v, rows, d, layer, page_size)


# Ragged rows: decode (1 query) and verify (17 queries), full and sparse, contexts that are not a
# multiple of the key block (64) nor of the page size.
MIXED = [(1, 70, None), (17, 45, None), (1, 150, 0.3), (17, 101, 0.5), (1, 3, None), (5, 33, 0.6)]


@pytest.mark.parametrize("hq,hkv,dtype", [(4, 4, torch.float32), (8, 2, torch.float16), (8, 1, torch.bfloat16)])
@pytest.mark.parametrize("split", [False, True])
def test_attention_matches_reference(hq, hkv, dtype, split):
    d = 16 if dtype == torch.float32 else 32
    q, k, v, rows = make_batch(MIXED, hq, hkv, d, dtype, seed=hq + hkv)
    # split=True: chunks of 64 keys and enough splits to cover the longest row several times.
    kw = {"min_chunk": 64, "target_programs": 10 ** 6} if split else {"min_chunk": 10 ** 6}
    (ref, _), (out, caps) = run_both(q, k, v, rows, d, **kw)
    assert caps == {}
    assert out.dtype == dtype
    assert rel_err(out, ref) <= RTOL[dtype]


def test_split_plan_covers_ragged_rows():
    specs = [ta.RowSpec(0, 1, 200, 0, 201), ta.RowSpec(1, 17, 10, 300, 27)]
    plan = ta.plan_attention(specs, 18, 2, 4, "cpu", block_n=64, min_chunk=64, target_programs=10 ** 6)
    assert plan.num_splits == 4 and plan.chunk == 64
    assert plan.tok_nsplit.tolist() == [4] + [1] * 17
    assert [grp.block_q for grp in plan.groups] == [1, 32]


def test_head_dim_not_power_of_two_and_single_query_block():
    # D=24 pads to 32 in registers; a 17-query row with G=8 spans several query blocks (128 // 8 = 16).
    q, k, v, rows = make_batch([(17, 40, None), (1, 90, 0.4)], 8, 1, 24, torch.float32, seed=3)
    (ref, _), (out, _) = run_both(q, k, v, rows, 24, min_chunk=64, target_programs=10 ** 6)
    assert rel_err(out, ref) <= RTOL[torch.float32]


@pytest.mark.parametrize("hq,hkv,reduce,queries", [
    (4, 4, PAGE_MAX_SUM, (0, -1)), (8, 2, TOKEN_MEAN, (0, 16)), (8, 1, PAGE_MAX_SUM, (3,)),
    (8, 2, PAGE_MAX_SUM, (0, 5, 16, 16)), (4, 1, TOKEN_MEAN, (0,))])
def test_scores_match_reference(hq, hkv, reduce, queries):
    d = 16
    # Captures on a verify row (causal: early queries see fewer keys) and on a decode row, next to a
    # sparse row that does not capture; 150+17 keys = 10.4 pages, 3 key blocks.
    specs = [(17, 150, None), (1, 93, None), (1, 80, 0.5)]
    q, k, v, rows = make_batch(specs, hq, hkv, d, torch.float32, seed=hq * 3 + hkv)
    capture_at_layer0(rows[0], queries, reduce)
    capture_at_layer0(rows[1], (0,), PAGE_MAX_SUM if reduce == TOKEN_MEAN else TOKEN_MEAN)
    for kw in ({"min_chunk": 10 ** 6}, {"min_chunk": 64, "target_programs": 10 ** 6}):  # lse with and without splits
        (ref, ref_caps), (out, caps) = run_both(q, k, v, rows, d, **kw)
        assert rel_err(out, ref) <= RTOL[torch.float32]
        assert sorted(caps) == [0, 1]
        for i in (0, 1):
            assert caps[i].dtype == torch.float32
            assert rel_err(caps[i], ref_caps[i]) <= 1e-5


def test_scores_half_precision_and_odd_page_size():
    # Page size 12 is not a power of two: the kernel reduces per token, torch sums the pages.
    for dtype, ps in ((torch.float16, 12), (torch.bfloat16, 16)):
        q, k, v, rows = make_batch([(9, 61, None)], 8, 2, 32, dtype, page_size=ps, seed=7)
        capture_at_layer0(rows[0], (0, -1))
        (_, ref_caps), (_, caps) = run_both(q, k, v, rows, 32, page_size=ps)
        assert caps[0].shape == ref_caps[0].shape == (-(-70 // ps),)
        assert rel_err(caps[0], ref_caps[0]) <= RTOL[dtype]


def test_prefill_rows_use_sdpa_next_to_kernel_rows():
    # A 40-query prefill chunk (SDPA path, full), a 33-query sparse chunk (SDPA on gathered keys) and
    # two kernel rows; split-K on, so the combine kernel must leave the SDPA rows' tokens alone.
    # The 40-query chunk also captures (Vegas seeds its views from the last prefill query): its scores
    # run both passes in triton_scores, the decode row's reuse the attention kernel's lse.
    q, k, v, rows = make_batch([(40, 20, None), (1, 130, None), (33, 64, 0.5), (17, 9, None)],
                               4, 2, 16, torch.float32, seed=11)
    for i, queries, reduce in ((0, (-1, 0, 39), TOKEN_MEAN), (1, (0,), PAGE_MAX_SUM)):
        capture_at_layer0(rows[i], queries, reduce)
    (ref, ref_caps), (out, caps) = run_both(q, k, v, rows, 16, min_chunk=64, target_programs=10 ** 6)
    assert rel_err(out, ref) <= RTOL[torch.float32]
    assert sorted(caps) == [0, 1]
    for i in (0, 1):
        assert rel_err(caps[i], ref_caps[i]) <= 1e-5


def test_plan_is_shared_by_layers_with_the_same_views():
    meta = kernel_cases.layers_sharing_a_plan(TritonAttention(), RTOL[torch.float32])
    assert len([key for key in meta.backend_cache if key[0] == "plan"]) == 2


def test_capture_on_sparse_layer_is_refused():
    kernel_cases.refuses_capture_on_sparse_layer(TritonAttention())


def test_get_backend_returns_triton():
    assert get_backend("triton", "cpu").name == "triton"


def test_engine_mixed_forward_same_as_torch_backend(checkpoints):
    """The whole engine on a tiny Llama (GQA 4:1): chunked prefill (SDPA path and kernel path), a
    verify block capturing ASPIRE page scores at the refresh layer beside a sparse draft row with a
    full refresh layer and a Vegas per-layer token view; logits and captures equal the torch backend."""
    from aspire_bench.engine import Capture, Engine, PageView, Row, TokenView, load_model
    path, _ = checkpoints["llama"]
    model = load_model(path)
    engines = [Engine(model, attention_backend=b) for b in ("torch", "triton")]
    g = torch.Generator().manual_seed(9)
    ids = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (75, 52)]
    outs = []
    for eng in engines:
        eng.reserve(512)
        slots = [eng.alloc(120), eng.alloc(120)]
        res = []
        # request 0: a 40-token chunk (long: SDPA) then 35 more; request 1: one 20-token chunk + 32.
        layers = model.cfg.num_layers
        res.append(eng.forward([Row(slots[0], ids[0][:40], 0, logits="none",
                                    capture=Capture(layers=range(layers), queries=[-1], reduce=TOKEN_MEAN)),
                                Row(slots[1], ids[1][:20], 0, logits="last")]))
        res.append(eng.forward([Row(slots[0], ids[0][40:], 40, logits="last"),
                                Row(slots[1], ids[1][20:], 20, logits="all")]))
        vegas = [TokenView(torch.tensor([0, 3, 9, 30, 51])) if li % 2 else None for li in range(layers)]
        res.append(eng.forward([
            Row(slots[0], [5, 6, 7, 8, 9], 75, logits="all",
                capture=Capture(layers=[layers - 2], queries=[0, -1])),
            Row(slots[1], [11], 52, view=PageView(torch.tensor([0, 2])), full_layers=frozenset({layers - 2}),
                capture=Capture(layers=[layers - 2], queries=[0], reduce=TOKEN_MEAN)),
        ]))
        res.append(eng.forward([Row(slots[1], [12, 13, 14], 53, view=vegas, logits="all")]))
        outs.append(res)
    for ref, got in zip(*outs):
        for a, b in zip(ref.logits, got.logits):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
        assert ref.captures.keys() == got.captures.keys()
        for row in ref.captures:
            assert ref.captures[row].keys() == got.captures[row].keys()
            for li in ref.captures[row]:
                torch.testing.assert_close(got.captures[row][li], ref.captures[row][li], atol=1e-6, rtol=1e-5)
    assert outs[0][2].captures[0][model.cfg.num_layers - 2].shape == (-(-80 // 16),)


def test_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    from aspire_bench.errors import ConfigError
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, rows = make_batch([(1, 20, None)], 4, 2, 16, torch.float32)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        TritonAttention().attend(0, q, k, v, meta_of(rows, 16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the script would run its sweep")
def test_gpu_script_exits_clearly_without_cuda(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_kernels", "--out", str(tmp_path / "x.json")],
                       capture_output=True, text=True, timeout=120, check=False, cwd=root)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr
    assert not (tmp_path / "x.json").exists()


def test_capture_lse_equals_the_attention_kernels_lse():
    """Pass 1 run standalone (for prefill rows) gives the log-sum-exp the attention kernel gives."""
    from aspire_bench.kernels.triton_scores import ScoreRow, capture_lse
    q, k, v, rows = make_batch([(9, 100, None), (1, 70, None)], 8, 2, 16, torch.float32, seed=13)
    specs = [ta.RowSpec(r.q_start, r.n, r.start, r.base, r.start + r.n) for r in rows]
    plan = ta.plan_attention(specs, 10, 2, 4, "cpu", min_chunk=64, target_programs=10 ** 6)
    _, lse = ta.paged_attention(q, k, v, plan, 0.25, want_lse=True)
    srows = [ScoreRow(0, 100, rows[0].base, 109, (0, 4, -1), TOKEN_MEAN),
             ScoreRow(9, 70, rows[1].base, 71, (0,), PAGE_MAX_SUM)]
    mine = capture_lse(q, k, srows, 0.25)
    for t in (0, 4, 8, 9):
        torch.testing.assert_close(mine[t], lse[t], atol=1e-5, rtol=1e-6)
