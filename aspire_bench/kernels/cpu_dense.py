"""Compiled dense layers for the CPU: csrc/cpu_dense.cpp built and loaded like the attention kernel.

One C++ call runs all of a layer's work between two attention calls (MLP of one layer, norms, QKV,
q/k norm, RoPE and KV write of the next), so a forward is 17 calls instead of ~350 torch ops, or, with
the compiled attention backend, one call that runs the whole layer loop; see the
source's header for the maths and layouts. This module builds the library (system compiler, the
attention kernel's private cache with its sha256 sidecar) and packs weights into the kernel's panel
layout; engine/dense.py drives it.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from . import cpu_build
from .cpu_build import KernelBuildError

SOURCE = Path(__file__).with_name("csrc") / "cpu_dense.cpp"
# The micro-kernel's multiply-adds must fuse (FMA): -std=c++17 alone may keep them apart.
_EXTRA_FLAGS = ("-ffp-contract=fast",)
PANEL = 32  # output columns per packed panel (csrc/cpu_dense.cpp: NR)
HALF = PANEL // 2
_lib = None
_lock = threading.Lock()


def load_library() -> ctypes.CDLL:
    """Build (once per machine and source version) and load the library; KernelBuildError when there
    is no compiler or the build fails."""
    global _lib
    with _lock:
        if _lib is None:
            try:
                cxx = cpu_build.compiler()
            except KernelBuildError:
                raise KernelBuildError("the compiled dense path needs a C++ compiler and none was found: "
                                       "install g++ (or set $CXX), or use dense backend fused") from None
            _lib = cpu_build.load(cxx, _open, src=SOURCE, what="the compiled dense path",
                                  hint="use dense backend fused", extra_flags=_EXTRA_FLAGS)
    return _lib


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    layers = (lib.aspire_dense_layer, lib.aspire_dense_layer_bf16)
    forwards = (lib.aspire_dense_forward, lib.aspire_dense_forward_bf16)
    for fn in layers:
        fn.argtypes = [p, p, i64, p, f32, p, p, p, p, p, p, p, p, i64, i32]
    for fn in forwards:
        fn.argtypes = [p, i64, p, f32, p, p, p, p, p, p, p, p, i64, p, p, p, f32, i64, i32]
    heads = (lib.aspire_dense_head, lib.aspire_dense_head_bf16)
    for fn in heads:
        fn.argtypes = [p, p, p, f32, p, p, i64, i64, p, i32]
    for fn in (*layers, *forwards, *heads, lib.aspire_dense_vector_width):
        fn.restype = ctypes.c_int
    return lib


def panel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The element of a weight's panels: bf16 weights stay bf16 (the kernel widens them in registers,
    exactly: half the bytes a step reads), others are fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def pack(w: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> [ceil(N / 32), K, 32]: panels of 32 output columns, k-major, zero-padded, of
    panel_dtype(w.dtype)."""
    n, k = w.shape
    n_pad = -(-n // PANEL) * PANEL
    wp = torch.zeros(n_pad, k, dtype=panel_dtype(w.dtype))
    wp[:n] = w
    return wp.view(n_pad // PANEL, PANEL, k).transpose(1, 2).contiguous()


def pad_bias(b: torch.Tensor | None) -> torch.Tensor | None:
    """A bias padded like its weight's panels."""
    if b is None:
        return None
    out = torch.zeros(-(-b.numel() // PANEL) * PANEL, dtype=torch.float32)
    out[:b.numel()] = b
    return out


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Rows (or entries) of gate and up, each padded to whole halves, as [gate 0:16, up 0:16, gate 16:32, ...]."""
    n = gate.shape[0]
    n_pad = -(-n // HALF) * HALF
    g = torch.zeros(n_pad, *gate.shape[1:], dtype=panel_dtype(gate.dtype))
    u = torch.zeros_like(g)
    g[:n], u[:n] = gate, up
    return torch.cat((g.view(n_pad // HALF, HALF, -1), u.view(n_pad // HALF, HALF, -1)), 1).reshape(2 * n_pad, -1)


def pack_gate_up(w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused [2I, K] gate/up weight (gate rows first) packed so that each panel holds 16 gate columns
    and the same 16 up columns: the kernel applies silu(gate) * up in the GEMM's epilogue."""
    inter = w.shape[0] // 2
    packed = pack(_interleave(w[:inter], w[inter:]))
    bias = None if b is None else _interleave(b[:inter, None], b[inter:, None]).flatten().contiguous()
    return packed, bias
