"""The KV cache: one preallocated pool, carved into per-request slots of contiguous positions.

Layout per layer: [kv_heads, capacity, head_dim]. A slot is a page-aligned range of the capacity
axis, so full attention reads `k[layer, :, base:base+len]` in place (a strided view, no copy) and a
page p of a slot is positions [base + p*page_size, base + (p+1)*page_size) — what a page table holds.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from ..errors import OutOfMemoryBudget
from .memory import available_memory_bytes


def pool_tensor(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed tensor for the KV pool. On a Linux CPU it is a private anonymous mapping advised to use
    transparent huge pages (where the system's THP mode is `madvise` or `always`): a sparse view reads
    short runs of keys scattered over the whole pool, and with 4 KiB pages nearly every run is a TLB
    miss, which huge pages avoid. Elsewhere a plain torch.zeros."""
    if torch.device(device).type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP not available: 4 KiB pages, same values
        pass
    return torch.frombuffer(buf, dtype=dtype, count=torch.Size(shape).numel()).view(shape)  # keeps buf alive


@dataclass(eq=False)
class Slot:
    base: int  # first position of the slot in the pool
    capacity: int  # positions reserved
    length: int = 0  # valid positions (KV written and kept)


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device, page_size: int = 16,
                 memory_fraction: float = 0.9):
        capacity = -(-capacity // page_size) * page_size
        elem = torch.tensor([], dtype=dtype).element_size()
        need = 2 * num_layers * num_kv_heads * capacity * head_dim * elem
        have = available_memory_bytes(torch.device(device))
        if need > memory_fraction * have:
            raise OutOfMemoryBudget(
                f"the KV cache needs {need / 2**30:.2f} GiB ({capacity} positions x {num_layers} layers x "
                f"{num_kv_heads} KV heads x {head_dim} x 2 x {elem} B) but {have / 2**30:.2f} GiB is available "
                f"on {device}: lower --batch-size, the context length or --max-new-tokens")
        self.page_size = page_size
        self.capacity = capacity
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k, self.v = pool_tensor(shape, dtype, device), pool_tensor(shape, dtype, device)
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (start, size) ranges

    @property
    def bytes_per_position(self) -> int:
        """KV bytes of one position over all layers (K and V)."""
        L, H, _, D = self.k.shape
        return 2 * L * H * D * self.k.element_size()

    def reset(self) -> None:
        """Every slot free again (the tensors stay allocated)."""
        self._free = [(0, self.capacity)]

    def alloc(self, max_len: int) -> Slot:
        size = -(-max_len // self.page_size) * self.page_size
        for i, (start, free) in enumerate(self._free):
            if free >= size:
                self._free[i] = (start + size, free - size)
                if self._free[i][1] == 0:
                    del self._free[i]
                return Slot(base=start, capacity=size)
        raise OutOfMemoryBudget(
            f"no free KV slot of {size} positions (pool {self.capacity}); the cache was sized for fewer or "
            f"shorter requests: raise its capacity or lower --batch-size")

    def free(self, slot: Slot) -> None:
        self._free.append((slot.base, slot.capacity))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, size in self._free:  # coalesce neighbours so long slots can be allocated again
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self._free = merged
        slot.capacity = 0

    def rollback(self, slot: Slot, length: int) -> None:
        """Forget positions >= length (rejected drafts); they are overwritten later."""
        if not 0 <= length <= slot.length:
            raise ValueError(f"rollback to {length} outside 0..{slot.length}")
        slot.length = length

    def num_pages(self, length: int) -> int:
        return -(-length // self.page_size)
