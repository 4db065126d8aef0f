"""The compiled CPU attention backend against the torch reference, on fresh random inputs.

Each run draws new inputs (the seed is in every failure message), covering decode, verify, sparse and
prefill rows side by side, every head-dim code path of the kernel (16, 32, 64, 128 and a generic
multiple of 16), GQA ratios 1..8, key counts that are not multiples of the kernel's 64-key block, and
captured scores with both reductions, odd page sizes and repeated query indices.
"""
from __future__ import annotations

import random
import shutil
import warnings

import kernel_cases
import pytest
import torch
from kernel_cases import capture_at_layer0, make_batch, rel_err

from aspire_bench.errors import ConfigError
from aspire_bench.kernels import cpu_attention, get_backend
from aspire_bench.kernels.base import PAGE_MAX_SUM, TOKEN_MEAN
from aspire_bench.kernels.cpu_attention import CpuAttention, KernelBuildError

try:
    cpu_attention._compiler()
except KernelBuildError as e:  # pragma: no cover
    pytest.skip(f"no C++ compiler ({e}): the CPU kernel is untested here", allow_module_level=True)

RTOL = 3e-6  # fp32: the kernel's online softmax and exp2 polynomial against torch's softmax
SEED = random.SystemRandom().randrange(2 ** 31)

# Decode and verify rows, full and sparse, a row of exactly one key block, a 31-query verify row
# (the kernel's longest) and a 40-query prefill chunk (the torch SDPA path, beside the kernel rows).
MIXED = [(1, 70, None), (17, 45, None), (1, 150, 0.3), (17, 101, 0.5), (1, 3, None), (5, 33, 0.6),
         (1, 63, None), (31, 200, None), (40, 10, None)]


def run_both(q, k, v, rows, d, layer=0, page_size=16):
    return kernel_cases.run_both(CpuAttention(), q, k, v, rows, d, layer, page_size)


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (4, 4, 16), (8, 2, 64), (8, 1, 128), (6, 2, 48),
                                      (16, 2, 256), (3, 1, 32)])
def test_attention_matches_reference(hq, hkv, d):
    seed = SEED + hq * 1000 + hkv * 100 + d
    q, k, v, rows = make_batch(MIXED, hq, hkv, d, torch.float32, seed=seed)
    (ref, _), (out, caps) = run_both(q, k, v, rows, d)
    assert caps == {}
    assert rel_err(out, ref) <= RTOL, f"seed {seed}"


def test_long_rows_span_many_blocks():
    seed = SEED + 1
    q, k, v, rows = make_batch([(1, 2000, None), (7, 1500, None), (1, 3000, 0.07)], 4, 2, 32, torch.float32,
                               seed=seed)
    (ref, _), (out, _) = run_both(q, k, v, rows, 32)
    assert rel_err(out, ref) <= RTOL, f"seed {seed}"


@pytest.mark.parametrize("hq,hkv,reduce,queries,page_size", [
    (4, 4, PAGE_MAX_SUM, (0, -1), 16), (8, 2, TOKEN_MEAN, (0, 16), 16), (8, 1, PAGE_MAX_SUM, (3,), 12),
    (8, 2, PAGE_MAX_SUM, (0, 5, 16, 16), 5), (4, 1, TOKEN_MEAN, (0,), 16), (4, 2, PAGE_MAX_SUM, (0,), 16)])
def test_scores_match_reference(hq, hkv, reduce, queries, page_size):
    # Captures on a verify row (causal: early queries see fewer keys) and on a decode row longer than
    # the score kernel's 1024-key chunk, next to a sparse row that does not capture.
    seed = SEED + hq * 10 + hkv + page_size
    q, k, v, rows = make_batch([(17, 150, None), (1, 1500, None), (1, 80, 0.5)], hq, hkv, 16,
                               torch.float32, page_size=page_size, seed=seed)
    capture_at_layer0(rows[0], queries, reduce)
    capture_at_layer0(rows[1], (0,), PAGE_MAX_SUM if reduce == TOKEN_MEAN else TOKEN_MEAN)
    (ref, ref_caps), (out, caps) = run_both(q, k, v, rows, 16, page_size=page_size)
    assert rel_err(out, ref) <= RTOL, f"seed {seed}"
    assert sorted(caps) == [0, 1]
    for i in (0, 1):
        assert caps[i].dtype == torch.float32 and caps[i].shape == ref_caps[i].shape
        assert rel_err(caps[i], ref_caps[i]) <= 1e-5, f"seed {seed}, row {i}"


def test_prefill_chunk_capture_goes_to_the_reference():
    seed = SEED + 7
    q, k, v, rows = make_batch([(40, 20, None), (1, 130, None)], 4, 2, 16, torch.float32, seed=seed)
    capture_at_layer0(rows[0], (-1,), TOKEN_MEAN)
    (ref, ref_caps), (out, caps) = run_both(q, k, v, rows, 16)
    assert rel_err(out, ref) <= RTOL
    assert sorted(caps) == [0] and rel_err(caps[0], ref_caps[0]) <= 1e-5


def test_plan_is_shared_by_layers_with_the_same_views():
    meta = kernel_cases.layers_sharing_a_plan(CpuAttention(), RTOL, seed=SEED)
    assert len(meta.backend_cache["cpu_plans"]) == 2


def test_other_dtypes_and_head_dims_use_the_reference():
    for dtype, d in ((torch.bfloat16, 32), (torch.float32, 24)):
        q, k, v, rows = make_batch([(1, 40, None), (3, 30, 0.5)], 4, 2, d, dtype, seed=SEED)
        (ref, _), (out, _) = run_both(q, k, v, rows, d)
        assert torch.equal(out, ref)


def test_capture_on_sparse_layer_is_refused():
    kernel_cases.refuses_capture_on_sparse_layer(CpuAttention())


def test_auto_picks_the_compiled_kernel_on_cpu():
    assert get_backend("auto", "cpu").name == "cpu"
    assert get_backend("cpu", "cpu").name == "cpu"


@pytest.fixture
def broken_compiler(monkeypatch, tmp_path):
    """A fresh kernel cache and a 'compiler' that always fails."""
    monkeypatch.setenv("ASPIRE_BENCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", shutil.which("false"))
    monkeypatch.setattr(cpu_attention, "_lib", None)


def test_build_failure_is_a_clear_error(broken_compiler):
    with pytest.raises(KernelBuildError, match="(?s)could not compile the CPU attention kernel.*--attention-backend torch"):
        get_backend("cpu", "cpu")
    assert issubclass(KernelBuildError, ConfigError)


def test_auto_falls_back_to_torch_when_the_kernel_does_not_build(broken_compiler):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert get_backend("auto", "cpu").name == "torch"
    assert any("falling back to the torch attention backend" in str(w.message) for w in caught)


def test_cached_library_is_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("ASPIRE_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_attention, "_lib", None)
    first = cpu_attention._build(cpu_attention._compiler())
    assert first.exists() and first.parent == tmp_path / "kernels"
    assert list(first.parent.iterdir()) == [first]  # no temporary left behind
    mtime = first.stat().st_mtime_ns
    assert cpu_attention._build(cpu_attention._compiler()) == first and first.stat().st_mtime_ns == mtime
