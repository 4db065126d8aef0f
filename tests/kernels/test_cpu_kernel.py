"""The compiled CPU attention backend against the torch reference, on random inputs.

Seeds are fixed; ASPIRE_BENCH_FUZZ=1 draws new inputs on each run (the seed is in every failure
message). The cases cover decode, verify, sparse and
prefill rows side by side, every head-dim code path of the kernel (16, 32, 64, 128 and a generic
multiple of 16), GQA ratios 1..8, key counts that are not multiples of the kernel's 64-key block, and
captured scores with both reductions, odd page sizes and repeated query indices.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import random
import shlex
import shutil
import subprocess
import warnings
from pathlib import Path

import kernel_cases
import pytest
import torch
from kernel_cases import capture_at_layer0, make_batch, rel_err
from seeds import seed_for

from aspire_bench.errors import ConfigError
from aspire_bench.kernels import cpu_attention, cpu_build, get_backend
from aspire_bench.kernels.base import PAGE_MAX_SUM, TOKEN_MEAN
from aspire_bench.kernels.cpu_attention import CpuAttention, KernelBuildError

try:
    cpu_build.compiler()
except KernelBuildError as e:  # pragma: no cover
    pytest.skip(f"no C++ compiler ({e}): the CPU kernel is untested here", allow_module_level=True)

RTOL = 3e-6  # fp32: the kernel's online softmax and exp2 polynomial against torch's softmax
SEED = seed_for(__name__)  # fixed; fresh under ASPIRE_BENCH_FUZZ=1 (tests/seeds.py)

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


@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2), (3, 1), (8, 2)])
def test_every_query_count_in_one_call(hq, hkv):
    # Verify rows of 1..17 tokens (G x n queries per KV head, odd counts included: the kernel takes
    # them in groups of 4 and one group of the rest), full and sparse, beside decode rows, with key
    # counts around the 64-key block and page-run edges (prefixes that end inside a page).
    seed = SEED + 31 * hq + hkv
    rng = random.Random(seed)
    specs = []
    for n in range(1, 18):
        specs.append((n, rng.choice([0, 1, 15, 16, 17, 63, 64, 65]) + rng.randrange(0, 300), None))
        specs.append((n, rng.randrange(1, 400), rng.choice([0.2, 0.5, 1.0])))
    specs += [(1, 5, None), (1, 129, 0.4)]
    q, k, v, rows = make_batch(specs, hq, hkv, 32, torch.float32, seed=seed)
    (ref, _), (out, _) = run_both(q, k, v, rows, 32)
    assert rel_err(out, ref) <= RTOL, f"seed {seed}"


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_split_into_chunks_merge_exactly(threads):
    # Few long rows: the kernel splits each (row, KV head) into key chunks, one work item each, and
    # merges their partial softmaxes (with Hkv = 1: 2 chunks of the first row at 1 thread, 7 at 3).
    # Captured scores come from every chunk and the merged log-sum-exp.
    seed = SEED + 11 * threads
    q, k, v, rows = make_batch([(1, 8000, None), (6, 5000, None), (2, 40, 0.5)], 4, 1, 32, torch.float32,
                               seed=seed)
    capture_at_layer0(rows[0], (0,), PAGE_MAX_SUM)
    capture_at_layer0(rows[1], (0, 3, -1), TOKEN_MEAN)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        (ref, ref_caps), (out, caps) = run_both(q, k, v, rows, 32)
    finally:
        torch.set_num_threads(before)
    assert rel_err(out, ref) <= RTOL, f"seed {seed}"
    assert sorted(caps) == [0, 1]
    for i in (0, 1):
        assert rel_err(caps[i], ref_caps[i]) <= 1e-5, f"seed {seed}, row {i}"


@pytest.mark.parametrize("hq,hkv,reduce,queries,page_size", [
    (4, 4, PAGE_MAX_SUM, (0, -1), 16), (8, 2, TOKEN_MEAN, (0, 16), 16), (8, 1, PAGE_MAX_SUM, (3,), 12),
    (8, 2, PAGE_MAX_SUM, (0, 5, 16, 16), 5), (4, 1, TOKEN_MEAN, (0,), 16), (4, 2, PAGE_MAX_SUM, (0,), 16),
    (4, 2, PAGE_MAX_SUM, (0, -1), 32)])
def test_scores_match_reference(hq, hkv, reduce, queries, page_size):
    # Captures on a verify row (causal: early queries see fewer keys) and on a decode row longer than
    # the score kernel's 1024-key chunk, next to a sparse row that does not capture.
    # Page sizes that are multiples of the kernel's vector (16, 32) sum each vector of keys into its
    # page at once; others (5, 12) go key by key.
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


def test_layers_with_their_own_views_of_one_size_share_the_row_layout():
    """Vegas: a view per layer, all of one size: one row layout, a plan (key indices) per layer,
    each layer still equal to the reference."""
    L = 3
    q, k, v, rows = make_batch([(1, 80, 0.5), (1, 60, 0.5), (3, 20, None)], 4, 2, 16, torch.float32, layers=L,
                               seed=SEED)
    gen = torch.Generator().manual_seed(SEED)
    for r in rows[:2]:  # per layer a different subset of the same size as layer 0's
        n_keys = r.sparse[0].numel() - r.n
        for layer in range(1, L):
            prefix = torch.randperm(r.start, generator=gen)[:n_keys].sort().values
            r.sparse_pos[layer] = torch.cat((prefix, torch.arange(r.start, r.start + r.n)))
            r.sparse[layer] = r.sparse_pos[layer] + r.base
    meta, backend = kernel_cases.meta_of(rows, 16), CpuAttention()
    for layer in range(L):
        out, _ = backend.attend(layer, q, k, v, meta)
        ref, _ = kernel_cases.TorchAttention().attend(layer, q, k, v, kernel_cases.meta_of(rows, 16))
        assert rel_err(out, ref) <= RTOL
    assert len(meta.backend_cache["cpu_layouts"]) == 1 and len(meta.backend_cache["cpu_plans"]) == L


def test_other_dtypes_and_head_dims_use_the_reference():
    for dtype, d in ((torch.float16, 32), (torch.float32, 24)):
        q, k, v, rows = make_batch([(1, 40, None), (3, 30, 0.5)], 4, 2, d, dtype, seed=SEED)
        (ref, _), (out, _) = run_both(q, k, v, rows, d)
        assert torch.equal(out, ref)


def bf16_builds() -> list[tuple[int, bool]]:
    """(vector width, bf16 dot products) of every build of the kernel this machine can run: its own,
    the other width on AVX-512, and the widening code where its own build uses bf16 dot products."""
    own = (cpu_attention.vector_width(), cpu_attention.bf16_dot())
    builds = [own]
    if "avx512f" in cpu_build.cpu_flags():
        builds.append(({8: 16, 16: 8}[own[0]], own[1]))
    if own[1]:
        builds.append((own[0], False))
    return builds


def check_bf16_rows(backend, q, k, v, rows, d, kernel_rows: int, captured, seed) -> None:
    """A bf16 pool's rows under its contract (docs/kernels.md): the queries rounded to bf16, the
    scores exact products summed in fp32, the probabilities rounded to bf16 for P·V (each by at most
    2^-8 of itself: 8 significant bits, to nearest), the rest in fp32. So against the fp32 reference on
    the rounded queries each output may move by 2^-8 of sum_j p_j |v_j| (the reference with |V|); the
    captured scores (fp32) match it as tightly as an fp32 pool's, and not the unrounded queries'.
    q: fp32 queries (as the compiled dense path hands them over); k, v bf16; the first kernel_rows
    query tokens are the kernel's (rows after them go to the reference)."""
    ref = kernel_cases.TorchAttention()
    qr = q.to(torch.bfloat16).float()
    want, want_caps = ref.attend(0, qr, k.float(), v.float(), kernel_cases.meta_of(rows, d))
    spread, _ = ref.attend(0, qr, k.float(), v.float().abs(), kernel_cases.meta_of(rows, d))
    _, unrounded_caps = ref.attend(0, q, k.float(), v.float(), kernel_cases.meta_of(rows, d))
    meta = kernel_cases.meta_of(rows, d)
    out, caps = backend.attend(0, q, k, v, meta)
    assert meta.backend_cache.get("cpu_plans"), "the bf16 pool went to the reference, not the kernel"
    assert out.dtype == torch.float32 and out.shape == q.shape
    got, want, spread = out[:kernel_rows], want[:kernel_rows], spread[:kernel_rows]
    bound = spread * 2 ** -8 + want.abs().max() * 1e-5
    assert (got - want).abs().le(bound).all(), f"seed {seed}"
    assert sorted(caps) == sorted(captured)
    for i in captured:
        assert rel_err(caps[i], want_caps[i]) <= 1e-5, f"seed {seed}, row {i}"
        assert rel_err(caps[i], unrounded_caps[i]) > 1e-4, f"seed {seed}, row {i}: the queries were not rounded"


def check_bf16_pool(backend, seed, hq, hkv, d) -> None:
    """MIXED's rows over a bf16 pool (check_bf16_rows), with Vegas's and ASPIRE's captures."""
    q, k, v, rows = make_batch(MIXED, hq, hkv, d, torch.float32, seed=seed)
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    capture_at_layer0(rows[1], (0, -1), TOKEN_MEAN)  # Vegas's capture, on a verify row
    capture_at_layer0(rows[2], (0,), PAGE_MAX_SUM)  # ASPIRE's, on a sparse draft row (full at layer 0)
    rows[2].sparse, rows[2].sparse_pos = None, None
    # the last row, a prefill chunk, goes to the reference
    check_bf16_rows(backend, q, k, v, rows, d, sum(r.n for r in rows[:-1]), (1, 2), seed)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 2, 32), (8, 1, 128), (16, 2, 256), (6, 2, 48)])
def test_a_bf16_pool_matches_the_reference_on_every_build(hq, hkv, d):
    """Every build this machine can run (its own, the other vector width, the code without bf16 dot
    products) keeps a bf16 pool's contract; head dim 48 is not whole pairs of 16-float vectors, so a
    16-float build widens it even with bf16 dot products."""
    for width, dot in bf16_builds():
        lib = cpu_attention._open(cpu_attention.build(cpu_build.compiler(), width=width, bf16_dot=dot))
        assert (lib.aspire_vector_width(), bool(lib.aspire_bf16_dot())) == (width, dot)
        check_bf16_pool(CpuAttention(lib), SEED + 31 * hq + d + width, hq, hkv, d)


def test_bf16_rows_split_into_chunks_keep_the_contract():
    """Few long rows over a bf16 pool: the kernel splits them into key chunks and merges them, the
    dot-product build's accumulators put back in the order of the dims before the merge."""
    seed = SEED + 77
    q, k, v, rows = make_batch([(1, 8000, None), (6, 5000, None), (2, 40, 0.5)], 4, 1, 32, torch.float32,
                               seed=seed)
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    capture_at_layer0(rows[0], (0,), PAGE_MAX_SUM)
    capture_at_layer0(rows[1], (0, 3, -1), TOKEN_MEAN)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_bf16_rows(CpuAttention(), q, k, v, rows, 32, q.shape[0], (0, 1), seed)
    finally:
        torch.set_num_threads(before)


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


@pytest.fixture(scope="module")
def fresh_build(tmp_path_factory):
    """(a fresh cache, the library load_library built and loaded from it): the module's one real compile."""
    new = tmp_path_factory.mktemp("built") / "new"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASPIRE_BENCH_CACHE", str(new))
        mp.setattr(cpu_attention, "_lib", None)
        return new, loaded_path(cpu_attention.load_library())


@pytest.fixture(scope="module")
def built_library(fresh_build):
    """That library and its sidecar, copied into each cache test's fresh cache."""
    lib = fresh_build[1]
    return lib, lib.with_name(lib.name + ".sha256")


@pytest.fixture
def cache(monkeypatch, tmp_path, built_library):
    """A private kernel cache holding the built library and its sidecar; no library loaded yet.

    A rebuild here runs a stand-in compiler that writes a copy of the library built once (the real
    compile is slow): what these tests check is when the cache rebuilds and what it loads, and
    the copy is a real library that must still load and compute. It reports the real compiler's
    version, which is part of the cache key."""
    real = cpu_build.compiler()
    fake = tmp_path / "fake-cxx"
    fake.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {shlex.quote(shutil.which(real))} --version\n'
                    f'while [ $# -gt 1 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
                    f'cp {shlex.quote(str(built_library[0]))} "$out"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("ASPIRE_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_attention, "_lib", None)
    kernels = tmp_path / "kernels"
    kernels.mkdir(mode=0o700)
    for f in built_library:
        shutil.copy2(f, kernels / f.name)
    return kernels / built_library[0].name


def loaded_path(lib) -> Path:
    return Path(lib._name)


def assert_kernel_works(seed=SEED):
    q, k, v, rows = make_batch([(1, 70, None), (4, 90, 0.5)], 4, 2, 32, torch.float32, seed=seed)
    (ref, _), (out, _) = run_both(q, k, v, rows, 32)
    assert rel_err(out, ref) <= RTOL, f"seed {seed}"


def test_cached_library_is_reused(cache):
    mtime = cache.stat().st_mtime_ns
    assert cpu_attention.build(cpu_build.compiler()) == cache and cache.stat().st_mtime_ns == mtime
    assert loaded_path(cpu_attention.load_library()) == cache
    assert sorted(p.name for p in cache.parent.iterdir()) == [cache.name, cache.name + ".sha256"]  # no temporaries


def test_fresh_cache_is_private_and_records_the_hash(monkeypatch, fresh_build):
    new, lib = fresh_build
    assert lib.parent == new / "kernels"
    monkeypatch.setenv("ASPIRE_BENCH_CACHE", str(new))
    monkeypatch.setattr(cpu_attention, "_lib", None)
    assert loaded_path(cpu_attention.load_library()) == lib  # loaded again from that cache, for the check below
    assert lib.parent.stat().st_mode & 0o077 == 0
    assert lib.with_name(lib.name + ".sha256").read_text().strip() == hashlib.sha256(lib.read_bytes()).hexdigest()
    assert_kernel_works()


@pytest.mark.parametrize("edit", ["append", "flip", "no_sidecar", "bad_sidecar"])
def test_tampered_library_is_rebuilt(cache, edit):
    side = cache.with_name(cache.name + ".sha256")
    data = cache.read_bytes()
    if edit == "append":
        cache.write_bytes(data + b"\0")
    elif edit == "flip":
        cache.write_bytes(data[:1000] + bytes([data[1000] ^ 1]) + data[1001:])
    elif edit == "no_sidecar":
        side.unlink()
    else:
        side.write_text("0" * 64 + "\n")
    tampered, mtime = cache.read_bytes(), cache.stat().st_mtime_ns
    assert loaded_path(cpu_attention.load_library()) == cache
    assert cache.read_bytes() != tampered or edit in ("no_sidecar", "bad_sidecar")
    assert cache.stat().st_mtime_ns > mtime  # rebuilt, not just accepted
    assert side.read_text().strip() == hashlib.sha256(cache.read_bytes()).hexdigest()
    assert_kernel_works()


def test_corrupt_library_with_matching_hash_is_rebuilt(cache):
    # A library whose recorded hash matches but that does not load (e.g. written corrupt at build
    # time) is rebuilt once instead of raising OSError on every run.
    cache.write_bytes(b"not an ELF file")
    cache.with_name(cache.name + ".sha256").write_text(hashlib.sha256(b"not an ELF file").hexdigest())
    assert loaded_path(cpu_attention.load_library()) == cache
    assert cache.read_bytes().startswith(b"\x7fELF")
    assert_kernel_works()


def planted(cache) -> Path:
    """Replace the cached library by one that must never be loaded (its sidecar matches it)."""
    cache.write_bytes(b"planted")
    cache.with_name(cache.name + ".sha256").write_text(hashlib.sha256(b"planted").hexdigest())
    return cache


@pytest.mark.parametrize("how", ["group_writable_dir", "world_writable_dir", "other_owner", "writable_file"])
def test_untrusted_cache_is_not_used(cache, monkeypatch, how):
    planted(cache)
    if how == "group_writable_dir":
        cache.parent.chmod(0o770)
    elif how == "world_writable_dir":
        cache.parent.chmod(0o707)
    elif how == "other_owner":
        monkeypatch.setattr(cpu_build, "_uid", lambda: os.getuid() + 1)
    else:
        cache.chmod(0o666)
    if how == "writable_file":  # a trusted directory: the file is rebuilt in place
        lib = loaded_path(cpu_attention.load_library())
        assert lib == cache and cache.read_bytes() != b"planted" and cache.stat().st_mode & 0o022 == 0
    else:  # built and loaded from a private temporary directory, the cache left as it was
        with pytest.warns(UserWarning, match="not used; the CPU kernel is built in a private temporary"):
            lib = loaded_path(cpu_attention.load_library())
        assert lib.parent != cache.parent and not lib.exists()
        assert cache.read_bytes() == b"planted"
    assert_kernel_works()


def test_load_failure_is_a_clear_error_and_auto_warns_once(cache, monkeypatch):
    def broken(path):
        raise OSError(f"{path}: invalid ELF header")
    monkeypatch.setattr(cpu_attention, "_open", broken)
    with pytest.raises(KernelBuildError, match="could not be built and loaded .*invalid ELF header.*--attention-backend torch"):
        get_backend("cpu", "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert get_backend("auto", "cpu").name == "torch"
    assert len(caught) == 1 and "falling back to the torch attention backend" in str(caught[0].message)


def test_the_kernels_use_one_vector_per_register_and_runs_record_the_simd():
    """16 floats per vector where the CPU has AVX-512, 8 otherwise: a vector wider than the registers
    is split by the compiler and the kernels' register tiles spill (several times slower on an AVX2
    machine: docs/kernels.md).
    The attention kernel takes 8 on AVX-512 cores that split 512-bit operations (Zen 4)."""
    from aspire_bench.harness.records import capture_environment
    from aspire_bench.kernels import cpu_dense
    env = capture_environment()
    if env["cpu_simd"] is None:
        pytest.skip("no SIMD flags in /proc/cpuinfo on this machine")
    expected = 16 if env["cpu_simd"] == "avx512f" else 8
    assert cpu_attention.vector_width() == cpu_attention.vector_width_for(cpu_build.cpuinfo())
    assert cpu_attention.vector_width() in ((8, 16) if expected == 16 else (8,))
    assert cpu_dense.load_library().aspire_dense_vector_width() == expected


@pytest.mark.parametrize("source", sorted((Path(cpu_build.__file__).with_name("csrc")).glob("*.cpp")),
                         ids=lambda p: p.stem)
def test_every_kernel_compiles_with_the_fallback_flags(source, tmp_path):
    """The build tries -march=native, then plain flags (a compiler that refuses -march=native): code
    that needs the native ISA (an inline asm constraint naming AVX registers) must have a plain form.
    -O0 -c: the errors come from code generation, not the optimiser, at a fraction of -O3's time."""
    flags = [f for f in cpu_build._FLAG_SETS[-1] if not f.startswith("-O")]
    assert not any(f.startswith("-march") for f in flags)
    res = subprocess.run([cpu_build.compiler(), *flags, "-O0", "-fopenmp", "-fPIC", "-std=c++17", "-c", str(source),
                          "-o", str(tmp_path / "k.o")], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-2000:]


def test_a_changed_header_is_a_new_build(tmp_path):
    """The kernels share csrc/vec.h: the build's cache key covers the headers beside the source, so an
    edited header never loads a library built from the old one."""
    src, header = tmp_path / "k.cpp", tmp_path / "k.h"
    src.write_text('#include "k.h"\nextern "C" int answer() { return ANSWER; }\n')
    kernels = tmp_path / "kernels"
    kernels.mkdir(mode=0o700)
    answers = {}
    for value in (1, 2):
        header.write_text(f"#define ANSWER {value}\n")
        lib = cpu_build.build(cpu_build.compiler(), kernels, False, src=src, what="a test kernel")
        answers[lib.name] = ctypes.CDLL(str(lib)).answer()
    assert sorted(answers.values()) == [1, 2]


@pytest.mark.parametrize("vendor,family,flags,width", [
    ("AuthenticAMD", "25", "fpu sse2 avx2 avx512f avx512bw", 8),  # Zen 4: 512-bit operations in two halves
    ("AuthenticAMD", "25", "fpu sse2 avx2", 8),  # Zen 3
    ("AuthenticAMD", "26", "fpu sse2 avx2 avx512f avx512bw", 16),  # Zen 5
    ("GenuineIntel", "6", "fpu sse2 avx2 avx512f", 16),
    ("GenuineIntel", "6", "fpu sse2 avx2", 8),
    (None, None, None, 8)])  # no /proc/cpuinfo (or an ARM one: "Features", no flags)
def test_vector_width_follows_the_cores(vendor, family, flags, width):
    info = {k: v for k, v in (("vendor_id", vendor), ("cpu family", family), ("flags", flags)) if v}
    assert cpu_attention.vector_width_for(info) == width


@pytest.mark.skipif("avx512f" not in cpu_build.cpu_flags(),
                    reason="one vector width without AVX-512")
def test_both_vector_widths_match_the_reference():
    # An AVX-512 machine builds one width for its own runs; the other is tested here, so a Zen 4
    # still checks the 16-float code other AVX-512 machines run, and the other way round.
    width = {8: 16, 16: 8}[cpu_attention.vector_width()]
    lib = cpu_attention._open(cpu_attention.build(cpu_build.compiler(), width=width))
    assert lib.aspire_vector_width() == width
    backend = CpuAttention(lib)
    seed = SEED + 16 * width
    rng = random.Random(seed)
    specs = [(n, rng.randrange(1, 300), rng.choice([None, 0.3])) for n in range(1, 18)] + MIXED
    for hq, hkv, d in [(4, 2, 32), (8, 1, 128), (6, 2, 48)]:
        q, k, v, rows = make_batch(specs, hq, hkv, d, torch.float32, seed=seed)
        capture_at_layer0(rows[18], (0, -1), PAGE_MAX_SUM)  # MIXED's 17-token verify row (a full view)
        (ref, ref_caps), (out, caps) = kernel_cases.run_both(backend, q, k, v, rows, d, 0, 16)
        assert rel_err(out, ref) <= RTOL, f"seed {seed}, width {width}, shape {hq, hkv, d}"
        assert rel_err(caps[18], ref_caps[18]) <= 1e-5, f"seed {seed}, width {width}"
