"""Building and loading this package's C++ kernels (csrc/): the system compiler, a private per-machine
cache, and only verified libraries loaded from it. Shared by the attention (cpu_attention.py) and dense
(cpu_dense.py) kernels.

A cached library is loaded only from a directory and file owned by this user that nobody else can
write, and only if its content hash is the one recorded when it was built; otherwise it is rebuilt.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

from ..errors import ConfigError

_FLAG_SETS = (["-O3", "-march=native"], ["-O3"])  # the first set the compiler accepts is used


class KernelBuildError(ConfigError):
    pass


def cache_dir() -> Path:
    if os.environ.get("ASPIRE_BENCH_CACHE"):
        return Path(os.environ["ASPIRE_BENCH_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "aspire-bench"


def compiler() -> str:
    """The system C++ compiler: $CXX, else g++, c++ or clang++ (KernelBuildError when there is none)."""
    for cxx in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cxx and shutil.which(cxx):
            return cxx
    raise KernelBuildError("attention backend 'cpu' needs a C++ compiler and none was found: install g++ "
                           "(or set $CXX), or use --attention-backend torch")


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("vendor_id", "cpu family", "flags", ...); empty where
    there is no such file."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            info.setdefault(key, value)
    except OSError:
        pass
    return info


def cpu_flags(info: dict[str, str] | None = None) -> set[str]:
    """The CPU's feature flags (`flags` on x86, `Features` on ARM) from `info` (default: cpuinfo())."""
    info = cpuinfo() if info is None else info
    return set((info.get("flags") or info.get("Features") or "").split())


def _machine_key() -> str:
    """-march=native code is only valid on this kind of CPU, so the cache key includes its flags."""
    info = cpuinfo()
    return platform.machine() + (info.get("flags") or info.get("Features") or "")


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


def private_cache() -> tuple[Path, bool]:
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


def build(cxx: str, kernels: Path | None, force: bool, *, src: Path, what: str, hint: str = "",
          extra_flags: tuple[str, ...] = ()) -> Path:
    """The path of a trusted, verified library for the source `src`, this compiler and CPU: the cached one,
    else a fresh build (library renamed into place, then its content hash recorded in a sidecar, both
    atomic). `what` names the kernel in errors, `hint` is the way out a failed build suggests."""
    kernels = kernels or private_cache()[0]
    # the source and the headers it may include (csrc/*.h): a change to either is a new build
    source = b"".join(p.read_bytes() for p in (src, *sorted(src.parent.glob("*.h"))))
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
    raise KernelBuildError(f"could not compile {what} with {cxx} (GCC >= 12 or Clang needed):\n{errors[-1]}"
                           + (f"\n{hint}" if hint else ""))


def load(cxx: str, open_lib, *, src: Path, what: str, hint: str, extra_flags: tuple[str, ...] = ()):
    """open_lib(path) of the built library for `src` (see build). A library that fails to load (corrupt, or
    missing a symbol) is rebuilt once; if that fails too, a KernelBuildError naming `what` and `hint`."""
    kernels, one_run = private_cache()
    try:
        try:
            return open_lib(build(cxx, kernels, False, src=src, what=what, hint=hint, extra_flags=extra_flags))
        except (OSError, AttributeError):
            try:
                return open_lib(build(cxx, kernels, True, src=src, what=what, hint=hint, extra_flags=extra_flags))
            except (OSError, AttributeError) as e:
                raise KernelBuildError(f"{what} could not be built and loaded ({e}): {hint}") from e
    finally:
        if one_run:  # the loaded library stays mapped after its file is gone
            shutil.rmtree(kernels, ignore_errors=True)
