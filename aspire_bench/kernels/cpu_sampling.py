"""Compiled host work of a decoding step on the CPU (csrc/cpu_sampling.cpp), built and loaded like the
other kernels (cpu_build): top-k sampling distributions and draws, which decoders/sampler.py uses for
fp32 tensors on a CPU (the distributions when top-k is on), a whole step's sampling and acceptance,
which the Sampler uses too, and ASPIRE's page selection, which decoders/selection.py uses. Where the
library cannot be built (no compiler) their callers use the torch / numpy ops, or for a step's sampling
the Sampler's per-row path: the same distributions, the same draws, the same pages.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np
import torch

from . import cpu_build
from .cpu_build import KernelBuildError

SOURCE = Path(__file__).with_name("csrc") / "cpu_sampling.cpp"
_lib: ctypes.CDLL | None = None
_failed = False
_lock = threading.Lock()


def load_library() -> ctypes.CDLL | None:
    """The library, built once per machine and source version; None where it cannot be built."""
    global _lib, _failed
    with _lock:
        if _lib is None and not _failed:
            try:
                _lib = cpu_build.load(cpu_build.compiler(), _open, src=SOURCE, what="the CPU sampling kernel",
                                      hint="sampling uses the torch ops")
            except KernelBuildError:
                _failed = True  # the torch ops do the same; the attention kernel reports a missing compiler
    return _lib


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i64, f32, f64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double, ctypes.c_int
    lib.aspire_top_k_probs.argtypes = [p, i64, i64, f32, i64, f64, p, i32]
    lib.aspire_top_k_probs.restype = ctypes.c_int
    lib.aspire_draw.argtypes = [p, p, i64, f32]
    lib.aspire_draw.restype = i64
    lib.aspire_sample_step.argtypes = [p, i64, i64, f32, i64, f64, p, i64, p, p, p, i32]
    lib.aspire_sample_step.restype = ctypes.c_int
    lib.aspire_select_pages.argtypes = [p, i64, i64, i64, i64, p]
    lib.aspire_select_pages.restype = ctypes.c_int
    return lib


def top_k_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor | None:
    """Temperature, top-k and top-p over the last dim of fp32 CPU logits, as logits_to_probs defines them;
    None when the kernel does not apply (another device or dtype) or is not available."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or top_k < 1 or logits.numel() == 0:
        return None
    lib = load_library()
    if lib is None:
        return None
    x = logits.contiguous()
    out = torch.empty_like(x)
    vocab = x.shape[-1]
    rc = lib.aspire_top_k_probs(x.data_ptr(), x.numel() // vocab, vocab, temperature, top_k, top_p, out.data_ptr(),
                                torch.get_num_threads())
    if rc:
        raise ValueError(f"the CPU sampling kernel rejected temperature {temperature}, top-k {top_k}")
    return out


def draw(p: torch.Tensor, u: float | torch.Tensor, q: torch.Tensor | None = None) -> int | None:
    """The index sample_from's inverse CDF picks for the uniform u (a float32 value in [0, 1), or a
    one-element tensor of it): of the 1-D distribution p, or with q of max(0, p - q) unnormalised; -1
    when it has no mass. None when the kernel does not apply (another device or dtype, a strided row)
    or is not available; u is read only when it does (no device sync otherwise)."""
    ok = (p.device.type == "cpu" and p.dtype == torch.float32 and p.dim() == 1 and p.is_contiguous()
          and (q is None or (q.device.type == "cpu" and q.dtype == torch.float32 and q.shape == p.shape
                             and q.is_contiguous())))
    lib = (_lib or load_library()) if ok else None  # per draw: skip the lock once loaded
    if lib is None:
        return None
    return lib.aspire_draw(p.data_ptr(), None if q is None else q.data_ptr(), p.numel(), float(u))


def step_applies(logits: torch.Tensor, top_k: int) -> bool:
    """Whether sample_step can take a step of these stacked logits (fp32 on a CPU, top-k on, the library
    built): known before any uniform is drawn, so the per-row path draws the same ones where it cannot."""
    return ((_lib or load_library()) is not None and logits.dtype is torch.float32
            and logits.device.type == "cpu" and 1 <= top_k < logits.shape[-1])


def sample_step(logits: torch.Tensor, lens: list[int], drafts: list[int], qs: list[torch.Tensor], us: list[float],
                temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, list[int], list[int]]:
    """A step's sampling in one call, where step_applies: `logits` [sum(lens), vocab] stacked row after
    row, a row of lens[r] = d + 1 positions verifying its d drafts (d = 0: a decode or draft row); `drafts`
    and their distributions `qs` of every verify row (contiguous fp32 rows of the vocabulary, as this
    module and logits_to_probs make them: read through their addresses, unchecked), and lens[r]
    uniforms per row (float32 values), row after row. Returns (the distributions [sum(lens), vocab],
    each row's token, each row's accepted drafts): what logits_to_probs, sample_from and accept_sampling
    give with the same uniforms."""
    vocab, rows = logits.shape[-1], len(lens)
    if len(us) != len(logits) or len(drafts) != len(qs) or len(qs) != len(logits) - rows:
        raise ValueError(f"{rows} rows of {len(logits)} logits rows need as many uniforms ({len(us)}) and a draft "
                         f"and its distribution for each position past a row's first ({len(drafts)}, {len(qs)})")
    x = logits.contiguous()
    out = torch.empty_like(x)
    meta = np.array(lens + drafts + [q.data_ptr() for q in qs], dtype=np.int64)  # one array: one conversion
    u = np.array(us, dtype=np.float32)
    picked = np.empty(2 * rows, dtype=np.int64)
    lib = _lib or load_library()
    if lib is None:
        raise ValueError("a step's compiled sampling needs the CPU sampling library (see step_applies)")
    rc = lib.aspire_sample_step(x.data_ptr(), rows, vocab, temperature, top_k, top_p, meta.ctypes.data,
                                len(drafts), u.ctypes.data, out.data_ptr(), picked.ctypes.data,
                                torch.get_num_threads())
    if rc:
        raise ValueError(f"the CPU step sampling rejected temperature {temperature}, top-k {top_k}, the row "
                         f"lengths or a draft outside the vocabulary of {vocab}")
    picked = picked.tolist()
    return out, picked[:rows], picked[rows:]


def select_pages(scores: torch.Tensor | None, num_pages: int, budget: int, n_recent: int) -> torch.Tensor | None:
    """decoders/selection.py select_pages for 1 <= budget < num_pages and n_recent <= budget: the page
    set, int64, ascending. None when the kernel does not apply (scores not a contiguous fp32 CPU tensor)
    or is not available."""
    if scores is not None and (scores.device.type != "cpu" or scores.dtype != torch.float32
                               or not scores.is_contiguous()):
        return None
    lib = _lib or load_library()
    if lib is None:
        return None
    out = torch.empty(budget, dtype=torch.int64)
    rc = lib.aspire_select_pages(None if scores is None else scores.data_ptr(), 0 if scores is None else scores.numel(),
                                 num_pages, budget, n_recent, out.data_ptr())
    if rc:
        raise ValueError(f"the CPU page selection rejected {num_pages} pages, budget {budget}, {n_recent} recent")
    return out
