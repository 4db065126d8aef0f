"""Memory a run may still use: free device memory, and on CPU the smaller of the host's available
memory and what the process's cgroup (v1 or v2) limit leaves, so a run in a memory-limited container
is refused with a message instead of being killed by the OOM killer."""
from __future__ import annotations

import os
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as a huge page-rounded number, v2 as "max".
_NO_LIMIT = 1 << 60


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    host = host_available_bytes()
    limited = cgroup_available_bytes()
    return host if limited is None else min(host, limited)


def host_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cgroup_available_bytes(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The least headroom (limit - usage + reclaimable page cache) over this process's memory cgroup
    and its ancestors, v2 or v1; None when no limit applies or the files cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, rel = parts
        if hid == "0" and controllers == "":  # v2, the unified hierarchy
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1, the memory controller's own hierarchy
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        headrooms += [h for d in _lineage(base, rel) if (h := _headroom(d, *files)) is not None]
    return min(headrooms) if headrooms else None


def _lineage(base: Path, rel: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to the mount; in a container the path of
    /proc/self/cgroup may not exist in its own namespace, and then the mount itself is the cgroup."""
    d = base / rel.strip("/")
    if not d.is_dir():
        return [base]
    out = [d]
    while d != base and base in d.parents:
        d = d.parent
        out.append(d)
    return out


def _headroom(d: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        raw = (d / limit_file).read_text().strip()
        if raw == "max" or int(raw) >= _NO_LIMIT:
            return None
        limit, usage = int(raw), int((d / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    return max(0, limit - usage + _stat(d / "memory.stat", inactive_key))


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
