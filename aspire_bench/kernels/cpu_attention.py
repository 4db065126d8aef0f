"""Compiled CPU attention backend: one fused C++ call per layer for every decode, draft and verify row.

The torch reference runs ~15 small ops per row and layer; on a CPU their dispatch cost dominates
short sparse rows and keeps them on one core. `csrc/cpu_attention.cpp` instead runs one OpenMP work
item per (row, KV head) that reads each key and value once (in place for a full view, through the
row's pool indices for a sparse one) for every query of the group, with an online softmax. Captured
attention scores (ASPIRE's page scores, Vegas's token scores) come from a second call that reuses
the attention call's log-sum-exp, so they cost a pass over K only.
It covers fp32 with a head dim that is a multiple of 16 up to 256 (every Llama/Qwen size).

The kernel is built on first use with the system C++ compiler (`$CXX`, else `g++`/`c++`/`clang++`)
into a per-machine cache (`$ASPIRE_BENCH_CACHE`, else `$XDG_CACHE_HOME/aspire-bench`, else
`~/.cache/aspire-bench`) and loaded with ctypes: no torch headers, a few seconds to build. A cached
library is loaded only from a directory and file owned by this user that nobody else can write, and only
if its content hash is the one recorded when it was built; otherwise it is rebuilt. Rows it
does not cover go to the torch reference: prefill chunks (many queries: SDPA is better there), and
everything in other dtypes or head dims.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from .base import PAGE_MAX_SUM, SDPA_MIN_QUERIES, TOKEN_MEAN, AttentionMeta
from .torch_ref import TorchAttention

SOURCE = Path(__file__).with_name("csrc") / "cpu_attention.cpp"
_BLOCK = 64  # the kernel's key block (BK): a captured token's score row is padded to whole blocks
_FLAG_SETS = (["-O3", "-march=native"], ["-O3"])  # the first set the compiler accepts is used
_lib = None
_lock = threading.Lock()


class KernelBuildError(ConfigError):
    pass


def cache_dir() -> Path:
    if os.environ.get("ASPIRE_BENCH_CACHE"):
        return Path(os.environ["ASPIRE_BENCH_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "aspire-bench"


def _compiler() -> str:
    for cxx in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cxx and shutil.which(cxx):
            return cxx
    raise KernelBuildError("attention backend 'cpu' needs a C++ compiler and none was found: install g++ "
                           "(or set $CXX), or use --attention-backend torch")


def _machine_key() -> str:
    """-march=native code is only valid on this kind of CPU, so the cache key includes its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _uid() -> int:
    return os.getuid()


def _untrusted(path: Path, want_dir: bool) -> str | None:
    """Why `path` may not be trusted (None when it may): it must be a real directory or regular file,
    owned by this user and not group- or world-writable, so that nobody else can plant code in it."""
    try:
        st = path.lstat()
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if not (stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)):
        return "is not a directory" if want_dir else "is not a regular file"
    if st.st_uid != _uid():
        return f"is owned by uid {st.st_uid}, not by you (uid {_uid()})"
    if st.st_mode & 0o022:
        return "is group- or world-writable"
    return None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(out: Path) -> bool:
    """The cached library may be loaded: it and its sidecar are trusted files and the library's content
    hash is the one recorded when it was built."""
    side = out.with_name(out.name + ".sha256")
    if _untrusted(out, False) or _untrusted(side, False):
        return False
    try:
        return side.read_text().strip() == _digest(out)
    except OSError:
        return False


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _private_cache() -> tuple[Path, bool]:
    """(the directory to build in, whether it is a one-run temporary): the cache's kernels directory,
    created private (0700) when missing. An existing one that another user could write to is not used:
    the library is built in a fresh private temporary directory instead."""
    kernels = cache_dir() / "kernels"
    try:
        kernels.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        kernels.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        pass  # reported below as untrusted
    reason = _untrusted(kernels, True)
    if reason is None:
        return kernels, False
    warnings.warn(f"kernel cache {kernels} {reason}: not used; the CPU kernel is built in a private temporary "
                  f"directory for this run (make the directory yours with mode 700, or set $ASPIRE_BENCH_CACHE "
                  f"to a private directory)", stacklevel=4)
    return Path(tempfile.mkdtemp(prefix="aspire-bench-kernels-")), True  # 0700 and ours


def _build(cxx: str, kernels: Path | None = None, force: bool = False, src: Path = SOURCE,
           extra_flags: tuple[str, ...] = ()) -> Path:
    """The path of a trusted, verified library for this source, compiler and CPU: the cached one, else a
    fresh build (library renamed into place, then its content hash recorded in a sidecar, both atomic).
    `src`/`extra_flags`: another kernel source of this package (csrc/cpu_dense.cpp) built the same way."""
    kernels = kernels or _private_cache()[0]
    source = src.read_bytes()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    errors = []
    for flags in _FLAG_SETS:
        cmd_flags = [*flags, *extra_flags, "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
        key = hashlib.sha256(source + repr((cmd_flags, version, _machine_key())).encode()).hexdigest()[:16]
        out = kernels / f"{src.stem}_{key}.so"
        if not force and _verified(out):
            return out
        with tempfile.TemporaryDirectory(dir=kernels) as tmp:
            tmp_so = Path(tmp) / out.name
            res = subprocess.run([cxx, *cmd_flags, str(src), "-o", str(tmp_so)], capture_output=True,
                                 text=True, check=False)
            if res.returncode == 0:
                os.chmod(tmp_so, 0o755)
                digest = _digest(tmp_so)
                os.replace(tmp_so, out)  # atomic: a concurrent run never loads a half-written library
                _write_atomic(out.with_name(out.name + ".sha256"), digest + "\n")
                return out
            errors.append(res.stderr.strip()[-2000:])
    what = "the CPU attention kernel" if src == SOURCE else f"the CPU kernel {src.name}"
    raise KernelBuildError(f"could not compile {what} with {cxx} (GCC >= 12 or Clang needed):\n{errors[-1]}"
                           + ("\nuse --attention-backend torch" if src == SOURCE else ""))


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.aspire_attention.argtypes = [p, p, p, p, p, p, p, i64, p, i64, i64, i64, i64, f32, i32]
    lib.aspire_reduce_scores.argtypes = [p, p, p, i64, p, i64, p, i64, i32]
    lib.aspire_attention.restype = lib.aspire_reduce_scores.restype = ctypes.c_int
    return lib


def load_library() -> ctypes.CDLL:
    """Build (once per machine and source version) and load the kernel library. A library that fails
    to load (corrupt, or missing a symbol) is rebuilt once; if that fails too, a KernelBuildError."""
    global _lib
    with _lock:
        if _lib is None:
            cxx = _compiler()
            kernels, one_run = _private_cache()
            try:
                _lib = _open(_build(cxx, kernels))
            except (OSError, AttributeError):
                try:
                    _lib = _open(_build(cxx, kernels, force=True))
                except (OSError, AttributeError) as e:
                    raise KernelBuildError(f"the CPU attention kernel could not be built and loaded ({e}): "
                                           "use --attention-backend torch") from e
            finally:
                if one_run:  # the loaded library stays mapped after its file is gone
                    shutil.rmtree(kernels, ignore_errors=True)
    return _lib


def _int64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


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


class CpuAttention:
    name = "cpu"

    def __init__(self):
        lib = load_library()
        self._attention, self._reduce_scores = lib.aspire_attention, lib.aspire_reduce_scores
        self._ref = TorchAttention()

    def _plan(self, layer: int, meta: AttentionMeta, hq: int) -> _LayerPlan:
        """Kernel inputs for this layer; layers whose rows share views and captures share a plan (in a
        draft step: all layers but ASPIRE's refresh layer)."""
        key = tuple((None if not r.sparse else id(r.sparse[layer]), layer in r.capture_layers)
                    for r in meta.rows)
        plans = meta.backend_cache.setdefault("cpu_plans", {})
        if key in plans:
            return plans[key]
        desc, idx, rest, idx_off = [], [], [], 0
        cap_rows, cap_desc, qsel, out_sizes, sbuf_size = [], [], [], [], 0
        for i, r in enumerate(meta.rows):
            sp = r.view(layer)
            capture = r.captures_at(layer)
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
                sbuf_size += len(set(tokens)) * hq * -(-L // _BLOCK) * _BLOCK
                pages = r.capture_reduce == PAGE_MAX_SUM
                cap_desc.append((r.q_start, r.n, L, cap_mask, cap_base, len(qsel), len(tokens),
                                 sum(out_sizes), int(pages)))
                qsel.extend(tokens)
                cap_rows.append(i)
                out_sizes.append(-(-L // meta.page_size) if pages else L)
            desc.append((r.q_start, r.n, r.base, r.start, idx_off if sp is not None else 0,
                         sp.numel() if sp is not None else -1, cap_mask, cap_base))
            if sp is not None:
                idx.append(sp)
                idx_off += sp.numel()
        plan = _LayerPlan(_int64(desc).reshape(-1, 8),
                          torch.cat(idx).to(torch.int64).contiguous() if idx else _int64([0]), rest, cap_rows,
                          _int64(cap_desc).reshape(-1, 9), _int64(qsel or [0]), out_sizes, sbuf_size)
        plans[key] = plan
        return plan

    def attend(self, layer, q, k_cache, v_cache, meta: AttentionMeta):
        d = q.shape[-1]
        if q.dtype != torch.float32 or q.device.type != "cpu" or d % 16 or d > 256:
            return self._ref.attend(layer, q, k_cache, v_cache, meta)
        if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the CPU attention kernel needs contiguous q and per-layer K/V caches")
        plan = self._plan(layer, meta, q.shape[1])
        out = torch.empty_like(q)
        hq, (hkv, cap, _) = q.shape[1], k_cache.shape
        threads = torch.get_num_threads()
        capture = bool(plan.cap_rows)
        lse = torch.empty(q.shape[:2], dtype=torch.float32) if capture else None
        kept = torch.empty(plan.kept_scores, dtype=torch.float32) if capture else None
        if plan.rows.shape[0]:
            rc = self._attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
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
            captures = dict(zip(plan.cap_rows, scores.split(plan.cap_sizes)))
        for i in plan.rest:
            row = meta.rows[i]
            o, row_scores = self._ref.attend_row(layer, q[row.q_start:row.q_start + row.n], k_cache, v_cache, row,
                                           meta)
            out[row.q_start:row.q_start + row.n] = o
            if row_scores is not None:
                captures[i] = row_scores
        return out, captures
