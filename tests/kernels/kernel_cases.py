"""Random attention inputs shared by the kernel tests (Triton and compiled CPU backends)."""
from __future__ import annotations

import pytest
import torch

from aspire_bench.kernels.base import PAGE_MAX_SUM, AttentionMeta, RowMeta
from aspire_bench.kernels.torch_ref import TorchAttention


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert not torch.isnan(a).any(), "NaN in the kernel output (an unwritten element?)"
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def make_batch(specs, hq, hkv, d, dtype, page_size=16, layers=1, seed=0):
    """specs: (n, start, view) per row; view None = full, else fraction of the prefix's pages kept.
    Rows get disjoint slots in one pool, in shuffled order so bases are not monotonic in the batch."""
    g = torch.Generator().manual_seed(seed)
    sizes = [start + n + 5 for n, start, _ in specs]
    order = torch.randperm(len(specs), generator=g).tolist()
    bases, off = [0] * len(specs), 3
    for i in order:
        bases[i] = off
        off += sizes[i]
    cap = off + 7
    k = torch.randn(hkv, cap, d, generator=g).to(dtype)
    v = torch.randn(hkv, cap, d, generator=g).to(dtype)
    rows, q0 = [], 0
    for (n, start, frac), base in zip(specs, bases):
        r = RowMeta(q_start=q0, n=n, base=base, start=start)
        if frac is not None:
            pages = -(-start // page_size)
            keep = torch.randperm(pages, generator=g)[:max(1, int(frac * pages))].sort().values
            pos = (keep[:, None] * page_size + torch.arange(page_size)).flatten()
            pos = torch.cat((pos[pos < start], torch.arange(start, start + n)))
            r.sparse = [pos + base] * layers
            r.sparse_pos = [pos] * layers
        rows.append(r)
        q0 += n
    q = torch.randn(q0, hq, d, generator=g).to(dtype)
    return q, k, v, rows


def meta_of(rows, d, page_size=16):
    return AttentionMeta(rows=rows, num_tokens=sum(r.n for r in rows), page_size=page_size, scale=d ** -0.5)


def capture_at_layer0(row: RowMeta, queries, reduce: str = PAGE_MAX_SUM) -> None:
    """Ask for the row's attention scores at layer 0, averaged over `queries`, reduced by `reduce`."""
    row.capture_layers = frozenset({0})
    row.capture_queries = queries
    row.capture_reduce = reduce


def run_both(backend, q, k, v, rows, d, layer=0, page_size=16):
    """(reference result, backend result) of one layer, each on a fresh meta."""
    ref = TorchAttention().attend(layer, q, k, v, meta_of(rows, d, page_size))
    got = backend.attend(layer, q, k, v, meta_of(rows, d, page_size))
    return ref, got


def layers_sharing_a_plan(backend, rtol: float, seed: int = 5) -> AttentionMeta:
    """Three layers, the middle one a refresh layer (full view): each equals the reference. Returns
    the meta the backend cached its plans in (two distinct views: two plans)."""
    q, k, v, rows = make_batch([(1, 50, 0.5), (3, 20, None)], 4, 2, 16, torch.float32, layers=3, seed=seed)
    rows[0].sparse[1] = None  # a refresh layer: full view at layer 1
    rows[0].sparse_pos[1] = None
    meta = meta_of(rows, 16)
    for layer in range(3):
        out, _ = backend.attend(layer, q, k, v, meta)
        ref, _ = TorchAttention().attend(layer, q, k, v, meta_of(rows, 16))
        assert rel_err(out, ref) <= rtol
    return meta


def refuses_capture_on_sparse_layer(backend) -> None:
    q, k, v, rows = make_batch([(1, 50, 0.5)], 4, 2, 16, torch.float32)
    capture_at_layer0(rows[0], (0,))
    with pytest.raises(ValueError, match="full-attention layer"):
        backend.attend(0, q, k, v, meta_of(rows, 16))
