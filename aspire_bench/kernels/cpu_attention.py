"""Compiled CPU attention backend: one fused C++ call per layer for every decode, draft and verify row.

The torch reference's many small ops per row and layer are dominated by dispatch on a CPU.
`csrc/cpu_attention.cpp` runs one OpenMP work item per (row, KV head) that reads each key and value
once for every query of the group, with an online softmax; captured scores reuse the attention
call's log-sum-exp, so they cost a pass over K only. It covers fp32 and bf16 KV pools (widened on
load) with a head dim a multiple of 16 up to 256; prefill chunks and other dtypes go to torch. The
library is built on first use with the system C++ compiler into a per-user cache and loaded only if
its content hash matches the one recorded at build time (docs/kernels.md).
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from . import cpu_build
from .base import PAGE_MAX_SUM, SDPA_MIN_QUERIES, TOKEN_MEAN, AttentionMeta
from .cpu_build import KernelBuildError  # noqa: F401  (raised by load_library; importers take it from here)
from .torch_ref import TorchAttention

SOURCE = Path(__file__).with_name("csrc") / "cpu_attention.cpp"
_SCORE_ROW = 64  # a captured token's score row is padded to a multiple of this (the kernel's ROW_PAD)
_lib = None
_lock = threading.Lock()


_WHAT, _HINT = "the CPU attention kernel", "use --attention-backend torch"


def vector_width_for(info: dict[str, str]) -> int:
    """Floats per SIMD vector for the kernel on the CPU that /proc/cpuinfo's fields `info` describe: 16
    where the cores have AVX-512, except AMD's Zen 4 (family 25 with AVX-512), which runs each 512-bit
    operation as two 256-bit halves: there vectors of 8 verify several tokens faster, and draft and
    decode rows take as long either way (docs/kernels.md). 8 on every other CPU (AVX2; two registers each elsewhere)."""
    if "avx512f" not in cpu_build.cpu_flags(info):
        return 8
    zen4 = info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"
    return 8 if zen4 else 16


def build_flags(width: int | None = None, bf16_dot: bool = True) -> tuple[str, ...]:
    """The compiler flags beyond cpu_build's defaults: vectors of `width` floats (default: this machine's,
    vector_width_for; a build for a CPU without AVX-512 takes 8 whatever is asked); bf16_dot False: a
    bf16 pool's scores and P·V by widening to fp32 even where the CPU has bf16 dot products (the
    tests check that code on such a CPU too)."""
    return (f"-DASPIRE_VL={width or vector_width_for(cpu_build.cpuinfo())}",
            *(() if bf16_dot else ("-DASPIRE_BF16_DOT=0",)))


def build(cxx: str, kernels: Path | None = None, force: bool = False, width: int | None = None,
          src: Path = SOURCE, bf16_dot: bool = True) -> Path:
    """The path of a trusted, verified build of this kernel, or of another version of its source `src`
    (cpu_build.build), with build_flags(width, bf16_dot)."""
    what = _WHAT if src == SOURCE else f"the attention kernel {src}"
    return cpu_build.build(cxx, kernels, force, src=src, what=what, hint=_HINT,
                           extra_flags=build_flags(width, bf16_dot))


def _open(path: Path, older: bool = False) -> ctypes.CDLL:
    """The library at `path`, its entry points typed (a missing one: AttributeError, and load_library
    rebuilds). older: a build of an earlier version of the source (a benchmark's baseline), which may
    lack the entry points added since: only the attention and score calls are required."""
    lib = ctypes.CDLL(str(path))
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    for attention in (lib.aspire_attention, lib.aspire_attention_bf16):
        attention.argtypes = [p, p, p, p, p, p, p, i64, p, i64, i64, i64, i64, f32, i32]
        attention.restype = ctypes.c_int
    lib.aspire_reduce_scores.argtypes = [p, p, p, i64, p, i64, p, i64, i32]
    lib.aspire_reduce_scores.restype = ctypes.c_int
    if not older:
        lib.aspire_vector_width.restype = lib.aspire_bf16_dot.restype = ctypes.c_int
    return lib


def vector_width() -> int:
    """Floats per SIMD vector of this machine's build (vector_width_for)."""
    return int(load_library().aspire_vector_width())


def bf16_dot() -> bool:
    """Whether this machine's build computes a bf16 pool's attention with bf16 dot products (AVX512_BF16)."""
    return bool(load_library().aspire_bf16_dot())


def load_library() -> ctypes.CDLL:
    """Build (once per machine and source version) and load the kernel library. A library that fails
    to load (corrupt, or missing a symbol) is rebuilt once; if that fails too, a KernelBuildError."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = cpu_build.load(cpu_build.compiler(), _open, src=SOURCE, what=_WHAT, hint=_HINT,
                                  extra_flags=build_flags())
    return _lib


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _int64(values) -> torch.Tensor:
    # through numpy: torch.tensor of a nested list is slow, and this runs several times per forward
    return torch.from_numpy(np.array(values, dtype=np.int64))


@dataclass
class _LayerPlan:
    rows: torch.Tensor  # [R, 8] kernel rows (layout in csrc/cpu_attention.cpp)
    idx: torch.Tensor  # the sparse rows' pool indices, concatenated
    rest: list[int]  # rows left to the torch reference (prefill chunks)
    cap_rows: list[int]  # kernel rows whose scores are captured at this layer ...
    cap_desc: torch.Tensor  # ... [C, 9] their reduction descriptors
    cap_tokens: torch.Tensor  # the chosen token indices of each capturing row, concatenated
    cap_sizes: list[int]  # output length per capturing row (pages or keys)
    kept_scores: int  # floats of scores the attention call keeps for the reduction

    def split_scores(self, scores: torch.Tensor) -> dict[int, torch.Tensor]:
        """{row: its scores} from the reduction's output for this layer."""
        return dict(zip(self.cap_rows, scores.split(self.cap_sizes)))


@dataclass
class LayerCalls:
    """Every layer's kernel calls of one forward, for a caller that runs the layer loop in C (the
    compiled dense path): `table` [L, 9] int64 holds per layer the attention call's rows, row count and
    key indices, then the score reduction's lse, score buffer, descriptors, their count (0: no capture
    at this layer), chosen tokens and output (the layout aspire_dense_forward reads). The tensors the
    table points into are kept here until the call returns."""
    table: torch.Tensor
    attention: int  # address of aspire_attention (or its bf16 pool's twin)
    reduce_scores: int  # address of aspire_reduce_scores
    _scores: dict[int, tuple[_LayerPlan, torch.Tensor]]  # capturing layer -> (its plan, its output)
    _keep: list

    def captures(self) -> dict[int, dict[int, torch.Tensor]]:
        """{row: {layer: scores}} once the call has run, as the per-layer path returns them."""
        out: dict[int, dict[int, torch.Tensor]] = {}
        for layer, (plan, scores) in self._scores.items():
            for row, s in plan.split_scores(scores).items():
                out.setdefault(row, {})[layer] = s
        return out


class CpuAttention:
    name = "cpu"

    def __init__(self, library: ctypes.CDLL | None = None):
        """`library`: another build of the kernel, opened by `_open` (default: this machine's, load_library)."""
        lib = library or load_library()
        self._reduce_scores = lib.aspire_reduce_scores
        self._by_pool = {torch.float32: lib.aspire_attention, torch.bfloat16: lib.aspire_attention_bf16}
        self._attention_at = {dtype: _address(fn) for dtype, fn in self._by_pool.items()}
        self._reduce_at = _address(self._reduce_scores)
        self._ref = TorchAttention()
        self._kept = torch.empty(0, dtype=torch.float32)

    def _kept_buffer(self, n: int) -> torch.Tensor:
        """Scratch for the captured scores, kept across calls: a fresh multi-MB buffer per call costs a
        page fault per 4 KiB on first touch, about as much as the capture's arithmetic."""
        if self._kept.numel() < n:
            self._kept = torch.empty(n, dtype=torch.float32)
        return self._kept[:n]

    def _plan(self, layer: int, meta: AttentionMeta, hq: int) -> _LayerPlan:
        """Kernel inputs for this layer. Layers whose rows read as many keys and capture alike share the
        row descriptors (every layer of a draft step but ASPIRE's refresh layer; every layer of a Vegas
        draft step, whose views differ per layer); only the concatenated key indices are per view.
        A plan is found by its rows' view objects and capture flags, which a forward's metadata fixes:
        cheap enough to look up for every layer of every step."""
        key = tuple((id(r.sparse[layer]) if r.sparse else 0, layer in r.capture_layers) for r in meta.rows)
        plans = meta.backend_cache.setdefault("cpu_plans", {})
        plan = plans.get(key)
        if plan is None:
            views = [r.view(layer) for r in meta.rows]
            shape = tuple((None if v is None else v.numel(), r.captures_at(layer)) for r, v in zip(meta.rows, views))
            layouts = meta.backend_cache.setdefault("cpu_layouts", {})
            if shape not in layouts:
                layouts[shape] = self._describe(meta, views, shape, hq)
            idx = [v for r, v in zip(meta.rows, views) if v is not None and r.n < SDPA_MIN_QUERIES]
            plan = plans[key] = replace(layouts[shape], idx=torch.cat(idx).to(torch.int64).contiguous()
                                                 if idx else _int64([0]))
        return plan

    def _describe(self, meta: AttentionMeta, views: list, shape: tuple, hq: int) -> _LayerPlan:
        """The row descriptors and capture layout of a layer (its key indices are filled in by _plan)."""
        desc, rest, idx_off = [], [], 0
        cap_rows, cap_desc, qsel, out_sizes, sbuf_size = [], [], [], [], 0
        for i, (r, sp, (_, capture)) in enumerate(zip(meta.rows, views, shape)):
            if r.n >= SDPA_MIN_QUERIES:
                rest.append(i)
                continue
            L = r.start + r.n if sp is None else sp.numel()
            cap_mask = cap_base = 0
            if capture:
                if r.capture_reduce not in (PAGE_MAX_SUM, TOKEN_MEAN):
                    raise ValueError(f"unknown score reduction {r.capture_reduce!r}")
                tokens = [qi % r.n for qi in r.capture_queries]  # -1 = the last token
                cap_mask, cap_base = sum(1 << t for t in set(tokens)), sbuf_size
                sbuf_size += len(set(tokens)) * hq * -(-L // _SCORE_ROW) * _SCORE_ROW
                pages = r.capture_reduce == PAGE_MAX_SUM
                cap_desc.append((r.q_start, r.n, L, cap_mask, cap_base, len(qsel), len(tokens),
                                 sum(out_sizes), int(pages)))
                qsel.extend(tokens)
                cap_rows.append(i)
                out_sizes.append(-(-L // meta.page_size) if pages else L)
            desc.append((r.q_start, r.n, r.base, r.start, idx_off if sp is not None else 0,
                         sp.numel() if sp is not None else -1, cap_mask, cap_base))
            if sp is not None:
                idx_off += sp.numel()
        return _LayerPlan(_int64(desc).reshape(-1, 8), _int64([0]), rest, cap_rows,
                          _int64(cap_desc).reshape(-1, 9), _int64(qsel or [0]), out_sizes, sbuf_size)

    @staticmethod
    def _covers(q: torch.Tensor, pool_dtype: torch.dtype = torch.float32) -> bool:
        d = q.shape[-1]
        return (q.dtype in (torch.float32, torch.bfloat16) and pool_dtype in (torch.float32, torch.bfloat16)
                and q.device.type == "cpu" and d % 16 == 0 and d <= 256)

    def layer_calls(self, meta: AttentionMeta, q: torch.Tensor, num_layers: int,
                    pool_dtype: torch.dtype = torch.float32) -> LayerCalls | None:
        """The kernel calls of every layer of this forward over a pool of `pool_dtype`, or None when a
        row goes to the torch reference at some layer (a prefill chunk) or the kernel does not cover q:
        the caller then calls `attend` layer by layer."""
        if q.dtype != torch.float32 or not self._covers(q, pool_dtype):  # the compiled dense path's fp32 q
            return None
        plans = [self._plan(layer, meta, q.shape[1]) for layer in range(num_layers)]
        if any(p.rest or not p.rows.shape[0] for p in plans):
            return None
        kept_size = max(p.kept_scores for p in plans)
        kept = self._kept_buffer(kept_size) if kept_size else None
        lse = torch.empty(q.shape[:2], dtype=torch.float32) if kept_size else None
        table, scores = [], {}
        for layer, p in enumerate(plans):
            call = [p.rows.data_ptr(), p.rows.shape[0], p.idx.data_ptr(), 0, 0, 0, 0, 0, 0]
            if p.cap_rows:
                out = torch.zeros(sum(p.cap_sizes), dtype=torch.float32)
                scores[layer] = (p, out)
                call[3:] = [lse.data_ptr(), kept.data_ptr(), p.cap_desc.data_ptr(), p.cap_desc.shape[0],
                            p.cap_tokens.data_ptr(), out.data_ptr()]
            table.append(call)
        return LayerCalls(_int64(table), self._attention_at[pool_dtype], self._reduce_at, scores, [plans, kept, lse])

    def attend(self, layer, q, k_cache, v_cache, meta: AttentionMeta):
        if not self._covers(q, k_cache.dtype) or v_cache.dtype != k_cache.dtype:
            return self._ref.attend(layer, q, k_cache, v_cache, meta)
        d = q.shape[-1]
        if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the CPU attention kernel needs contiguous q and per-layer K/V caches")
        plan = self._plan(layer, meta, q.shape[1])
        dtype, q = q.dtype, q.float()  # a bf16 model's queries: widened (T x Hq x D, small beside the KV)
        out = torch.empty_like(q)
        hq, (hkv, cap, _) = q.shape[1], k_cache.shape
        threads = torch.get_num_threads()
        capture = bool(plan.cap_rows)
        lse = torch.empty(q.shape[:2], dtype=torch.float32) if capture else None
        kept = self._kept_buffer(plan.kept_scores) if capture else None
        if plan.rows.shape[0]:
            rc = self._by_pool[k_cache.dtype](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                                 lse.data_ptr() if capture else None, kept.data_ptr() if capture else None,
                                 plan.rows.data_ptr(), plan.rows.shape[0], plan.idx.data_ptr(), hq, hkv, d, cap,
                                 meta.scale, threads)
            if rc:
                raise ValueError(f"the CPU attention kernel rejected the shapes (Hq={hq}, Hkv={hkv}, D={d})")
        captures = {}
        if capture:
            scores = torch.zeros(sum(plan.cap_sizes), dtype=torch.float32)
            rc = self._reduce_scores(kept.data_ptr(), lse.data_ptr(), plan.cap_desc.data_ptr(),
                                     plan.cap_desc.shape[0], plan.cap_tokens.data_ptr(), meta.page_size,
                                     scores.data_ptr(), hq, threads)
            if rc:
                raise ValueError(f"the CPU score kernel rejected page size {meta.page_size}")
            captures = plan.split_scores(scores)
        for i in plan.rest:
            row = meta.rows[i]
            o, row_scores = self._ref.attend_row(layer, q[row.q_start:row.q_start + row.n], k_cache, v_cache, row,
                                                 meta)
            out[row.q_start:row.q_start + row.n] = o
            if row_scores is not None:
                captures[i] = row_scores
        return out.to(dtype), captures
