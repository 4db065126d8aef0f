"""Triton attention-score reductions for ASPIRE (PAGE_MAX_SUM) and Vegas (TOKEN_MEAN):
  TOKEN_MEAN    score[u] = mean over chosen queries q of mean over heads h of p[h, q, u]
  PAGE_MAX_SUM  score[P] = mean over q of sum over u in P of max over h of p[h, q, u]

Two passes, never heads x context in global memory: pass 1, the attention kernel, writes each query's
per-head log-sum-exp; pass 2 (here) recomputes the chosen queries' logits block by block of keys, turns
them into probabilities with that lse and reduces in registers, exactly as torch_ref.reduce_scores. A
key block is a whole number of pages, so page sums stay in one program. More: docs/kernels.md, "_scores".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import triton_common as tc
from .base import PAGE_MAX_SUM, TOKEN_MEAN
from .triton_common import LOG2E, MIN_M, dot_flags, mm, pow2

MODE_TOKEN_MEAN = 0
MODE_TOKEN_MAX = 1  # max over heads per token (page sums done by torch: odd page sizes)
MODE_PAGE_MAX_SUM = 2


@triton.jit
def _scores(q_ptr, k_ptr, lse_ptr, out_ptr,
            r_tok0, r_qpos0, r_base, r_kvlen, r_qoff, r_nq, r_outoff, qidx_ptr,
            stride_qt, stride_qh, stride_kh, stride_kc, stride_lt,
            sm_scale_log2, HKV, G, D, inv_heads,
            QC: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            PAGE: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    r = tl.program_id(0)
    blk = tl.program_id(1)
    tok0 = tl.load(r_tok0 + r)
    qpos0 = tl.load(r_qpos0 + r)
    base = tl.load(r_base + r)
    kv_len = tl.load(r_kvlen + r)
    q_off = tl.load(r_qoff + r)
    nq = tl.load(r_nq + r)
    out_off = tl.load(r_outoff + r).to(tl.int64)

    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_len  # blocks past this row's context do nothing but a masked store
    kv_idx = (base + offs_n).to(tl.int64)
    stride_kh64 = stride_kh.to(tl.int64)  # head offsets of a large pool overflow int32
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_m = tl.arange(0, QC * G_PAD)
    jj = offs_m // G_PAD
    g = offs_m % G_PAD

    tok_acc = tl.zeros([BLOCK_N], tl.float32)
    for c in range(0, nq, QC):
        m_valid = (c + jj < nq) & (g < G)
        qi = tl.load(qidx_ptr + q_off + c + jj, mask=m_valid, other=0)
        tok = (tok0 + qi).to(tl.int64)
        qpos = qpos0 + qi
        visible = m_valid[:, None] & n_mask[None, :] & (offs_n[None, :] <= qpos[:, None])
        hmax = tl.zeros([QC, BLOCK_N], tl.float32)  # probabilities are >= 0: 0 is max's identity
        for kvh in range(HKV):
            head = kvh * G + g
            q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                        mask=m_valid[:, None] & d_mask[None, :], other=0.0)
            lse = tl.load(lse_ptr + tok * stride_lt + head, mask=m_valid, other=0.0)
            k = tl.load(k_ptr + kvh * stride_kh64 + kv_idx[:, None] * stride_kc + offs_d[None, :],
                        mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            s = mm(q, tl.trans(k), PREC, UPCAST) * sm_scale_log2
            p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
            if MODE == 0:
                tok_acc += tl.sum(p, 0)
            else:
                hmax = tl.maximum(hmax, tl.max(tl.reshape(p, (QC, G_PAD, BLOCK_N)), 1))
        if MODE != 0:
            tok_acc += tl.sum(hmax, 0)
    if MODE == 0:
        tok_acc = tok_acc * inv_heads
    tok_acc = tok_acc / nq.to(tl.float32)
    if MODE == 2:
        NP: tl.constexpr = BLOCK_N // PAGE
        pages = tl.sum(tl.reshape(tok_acc, (NP, PAGE)), 1)
        offs_p = blk * NP + tl.arange(0, NP)
        n_pages = (kv_len + PAGE - 1) // PAGE
        tl.store(out_ptr + out_off + offs_p, pages, mask=offs_p < n_pages)
    else:
        tl.store(out_ptr + out_off + offs_n, tok_acc, mask=n_mask)


@dataclass
class ScoreRow:
    """A capturing row at one (full-attention) layer."""
    q_start: int
    start: int
    base: int
    kv_len: int  # start + n
    queries: tuple[int, ...]  # row-local query indices (duplicates count twice, as in the reference)
    reduce: str


@triton.jit
def _score_lse(q_ptr, k_ptr, part_ptr,
               r_tok0, r_qpos0, r_base, r_kvlen, r_qoff, r_nq, qidx_ptr,
               stride_qt, stride_qh, stride_kh, stride_kc, stride_pr, stride_pb, stride_pq,
               sm_scale_log2, HKV, G, D,
               QC: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Pass 1 for rows whose attention output came from elsewhere (prefill path): per (row, key
    block), each chosen query's per-head log-sum-exp over the block -> part[row, block, query, head];
    torch merges the blocks (blocks x heads per query, not context x heads)."""
    r = tl.program_id(0)
    blk = tl.program_id(1)
    tok0 = tl.load(r_tok0 + r)
    qpos0 = tl.load(r_qpos0 + r)
    base = tl.load(r_base + r)
    kv_len = tl.load(r_kvlen + r)
    q_off = tl.load(r_qoff + r)
    nq = tl.load(r_nq + r)
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_len
    kv_idx = (base + offs_n).to(tl.int64)
    stride_kh64 = stride_kh.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_m = tl.arange(0, QC * G_PAD)
    jj = offs_m // G_PAD
    g = offs_m % G_PAD
    part = part_ptr + r.to(tl.int64) * stride_pr + blk.to(tl.int64) * stride_pb
    for c in range(0, nq, QC):
        m_valid = (c + jj < nq) & (g < G)
        qi = tl.load(qidx_ptr + q_off + c + jj, mask=m_valid, other=0)
        tok = (tok0 + qi).to(tl.int64)
        visible = m_valid[:, None] & n_mask[None, :] & (offs_n[None, :] <= (qpos0 + qi)[:, None])
        for kvh in range(HKV):
            head = kvh * G + g
            q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                        mask=m_valid[:, None] & d_mask[None, :], other=0.0)
            k = tl.load(k_ptr + kvh * stride_kh64 + kv_idx[:, None] * stride_kc + offs_d[None, :],
                        mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            s = mm(q, tl.trans(k), PREC, UPCAST) * sm_scale_log2
            s = tl.where(visible, s, float("-inf"))
            m = tl.max(s, 1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            ssum = tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            plse = tl.where(ssum == 0.0, float("-inf"), m_safe + tl.log2(tl.where(ssum == 0.0, 1.0, ssum)))
            tl.store(part + (c + jj) * stride_pq + head, plse, mask=m_valid)


def _row_arrays(rows: list[ScoreRow], sizes: list[int], dev):
    """int32 per-row arrays [7, R] (tok0, qpos0, base, kv_len, query offset, #queries, output offset)
    and the concatenated row-local query indices, in one host->device copy."""
    cols = [[], [], [], [], [], [], []]
    qidx, qo, oo = [], 0, 0
    for r, size in zip(rows, sizes):
        n = r.kv_len - r.start
        qs = [j % n for j in r.queries]  # negative indices count from the row's end, as in torch
        for c, v in zip(cols, (r.q_start, r.start, r.base, r.kv_len, qo, len(qs), oo)):
            c.append(v)
        qidx.extend(qs)
        qo += len(qs)
        oo += size
    ints = torch.tensor([v for c in cols for v in c] + qidx, dtype=torch.int32).to(dev, non_blocking=True)
    nr = len(rows)
    return ints[:7 * nr].view(7, nr), ints[7 * nr:]


def _query_chunk(rows: list[ScoreRow], g_pad: int) -> int:
    """Queries per tile: all of them up to 128 tile rows, at least MIN_M rows (tl.dot's M)."""
    qc = min(pow2(max(len(r.queries) for r in rows)), max(1, 128 // g_pad))
    return max(qc, MIN_M // g_pad)


def capture_lse(q: torch.Tensor, k_cache: torch.Tensor, rows: list[ScoreRow], scale: float,
                block_n: int = 64) -> torch.Tensor:
    """Base-2 log-sum-exp [T, Hq] (fp32) of the chosen queries of `rows`; other tokens unset."""
    T, hq, d = q.shape
    hkv = k_cache.shape[0]
    g = hq // hkv
    g_pad = pow2(g)
    dev = q.device
    a, qidx_dev = _row_arrays(rows, [0] * len(rows), dev)
    max_nq = max(len(r.queries) for r in rows)
    nblk = -(-max(r.kv_len for r in rows) // block_n)
    part = tc.empty((len(rows), nblk, max_nq, hq), torch.float32, dev)
    _score_lse[(len(rows), nblk)](
        q, k_cache, part, a[0], a[1], a[2], a[3], a[4], a[5], qidx_dev,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        part.stride(0), part.stride(1), part.stride(2),
        scale * LOG2E, hkv, g, d,
        QC=_query_chunk(rows, g_pad), G_PAD=g_pad, BLOCK_N=block_n, BLOCK_D=max(16, pow2(d)),
        num_warps=8, **dot_flags(q.dtype))
    ln2 = 0.6931471805599453
    merged = torch.logsumexp(part * ln2, dim=1) / ln2  # [R, max_nq, Hq]; -inf blocks weigh 0
    lse = tc.empty((T, hq), torch.float32, dev)
    r_of, j_of, tok_of = [], [], []
    for ri, r in enumerate(rows):
        n = r.kv_len - r.start
        for j, qj in enumerate(r.queries):
            r_of.append(ri)
            j_of.append(j)
            tok_of.append(r.q_start + qj % n)
    sel = torch.tensor([r_of, j_of, tok_of], dtype=torch.long).to(dev)
    lse[sel[2]] = merged[sel[0], sel[1]]
    return lse


def attention_scores(q: torch.Tensor, k_cache: torch.Tensor, lse: torch.Tensor | None, rows: list[ScoreRow],
                     scale: float, page_size: int, block_n: int = 64) -> list[torch.Tensor]:
    """Per row: float32 scores, [kv_len] (TOKEN_MEAN) or [ceil(kv_len / page_size)] (PAGE_MAX_SUM).
    lse: [T, Hq] base-2 log-sum-exp of every capturing query, as paged_attention(want_lse=True) gives
    it for free; None runs pass 1 here (capture_lse: one more read of K)."""
    if not rows:
        return []
    _, hq, d = q.shape
    hkv = k_cache.shape[0]
    g = hq // hkv
    g_pad = pow2(g)
    dev = q.device
    if lse is None:
        lse = capture_lse(q, k_cache, rows, scale, block_n)
    in_kernel_pages = page_size & (page_size - 1) == 0
    if in_kernel_pages:
        block_n = max(block_n, page_size)
    results: list[torch.Tensor | None] = [None] * len(rows)
    for reduce in (TOKEN_MEAN, PAGE_MAX_SUM):
        sel = [i for i, r in enumerate(rows) if r.reduce == reduce]
        if not sel:
            continue
        if reduce == TOKEN_MEAN:
            mode = MODE_TOKEN_MEAN
        else:
            mode = MODE_PAGE_MAX_SUM if in_kernel_pages else MODE_TOKEN_MAX
        group = [rows[i] for i in sel]
        sizes = [-(-r.kv_len // page_size) if mode == MODE_PAGE_MAX_SUM else r.kv_len for r in group]
        a, qidx_dev = _row_arrays(group, sizes, dev)
        out = tc.empty((sum(sizes),), torch.float32, dev)
        max_kv = max(r.kv_len for r in group)
        _scores[(len(group), -(-max_kv // block_n))](
            q, k_cache, lse, out, a[0], a[1], a[2], a[3], a[4], a[5], a[6], qidx_dev,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), lse.stride(0),
            scale * LOG2E, hkv, g, d, 1.0 / hq,
            QC=_query_chunk(group, g_pad), G_PAD=g_pad, BLOCK_N=block_n, BLOCK_D=max(16, pow2(d)),
            PAGE=page_size if mode == MODE_PAGE_MAX_SUM else 1, MODE=mode,
            num_warps=8, **dot_flags(q.dtype))
        for i, part in zip(sel, out.split(sizes)):
            if mode == MODE_TOKEN_MAX:  # page size not a power of two: sum pages here
                part = torch.nn.functional.pad(part, (0, (-part.numel()) % page_size)).view(-1, page_size).sum(-1)
            results[i] = part
    return results
