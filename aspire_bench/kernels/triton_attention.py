"""Triton mixed-batch paged attention: decode/draft rows (1 query) and verify rows (n queries,
causal by absolute position) in one launch, full views read in place, sparse views through index
lists, GQA without repeating K/V, split-K (flash-decoding) for long contexts.

A program handles (query block, kv head, split); its tile rows are (query, group head) pairs, so the
query heads sharing a KV head read each K/V tile once. With several splits each program writes a
normalised partial output and its log-sum-exp (base 2: exp2 is the fast path on GPUs), a combine
kernel merges them, and the score kernel turns logits back into probabilities with the same lse.
Layouts, the plan and the tiles: docs/kernels.md, "The Triton kernels".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import triton_common as tc
from .triton_common import LOG2E, MIN_M, dot_flags, mm, pow2


@triton.jit
def _attn_fwd(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr,
              qb_tok, qb_nq, qb_qpos, qb_kvlen, qb_base, qb_idxoff, idx_ptr, pos_ptr,
              stride_qt, stride_qh, stride_kh, stride_kc, stride_vh, stride_vc,
              stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
              sm_scale_log2, chunk, G, D,
              BLOCK_M: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    tok0 = tl.load(qb_tok + qb)
    nq = tl.load(qb_nq + qb)
    qpos0 = tl.load(qb_qpos + qb)
    kv_len = tl.load(qb_kvlen + qb)
    base = tl.load(qb_base + qb)
    idx_off = tl.load(qb_idxoff + qb)
    is_sparse = idx_off >= 0
    idx_off = tl.maximum(idx_off, 0)

    offs_m = tl.arange(0, BLOCK_M)  # BLOCK_M >= BLOCK_Q * G_PAD; rows past nq * G_PAD are masked
    qi = offs_m // G_PAD
    g = offs_m % G_PAD
    m_valid = (qi < nq) & (g < G)
    head = kvh * G + g
    tok = (tok0 + qi).to(tl.int64)
    qpos = qpos0 + qi
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D

    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_mask[None, :], other=0.0)

    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)
    sp_hi = tl.where(is_sparse, hi, 0)  # bound for index-list loads: none for a full view
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        # Full view: slot positions base..; sparse view: the row's index list. A masked-off load
        # touches no memory, so the branch-free form costs full rows nothing.
        sp_mask = offs_n < sp_hi
        kv_idx = tl.where(is_sparse, tl.load(idx_ptr + idx_off + offs_n, mask=sp_mask, other=0), base + offs_n)
        kpos = tl.where(is_sparse, tl.load(pos_ptr + idx_off + offs_n, mask=sp_mask, other=0), offs_n)
        kv_idx = kv_idx.to(tl.int64)  # pool offsets overflow int32 at long contexts x batch
        k = tl.load(k_base + kv_idx[:, None] * stride_kc + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        s = mm(q, tl.trans(k), PREC, UPCAST) * sm_scale_log2
        visible = n_mask[None, :] & (kpos[None, :] <= qpos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A tile can hide every key from a query (causal tail, split boundary): keep exp2 finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + kv_idx[:, None] * stride_vc + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        # p is rounded to the cache dtype before P@V, as the torch reference does.
        acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, PREC, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    if SPLIT:
        # Splits past a short row's context write nothing (the combine never reads them). The
        # scalar test is broadcast explicitly: the interpreter rejects block & scalar-bool masks.
        row_mask = m_valid & ((tl.zeros([BLOCK_M], tl.int32) + lo) < kv_len)
        po = po_ptr + split.to(tl.int64) * stride_ps + tok[:, None] * stride_pt + head[:, None] * stride_ph
        tl.store(po + offs_d[None, :], o, mask=row_mask[:, None] & d_mask[None, :])
        tl.store(plse_ptr + split.to(tl.int64) * stride_ls + tok * stride_lt + head, lse, mask=row_mask)
    else:
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_mask[None, :])
        if WRITE_LSE:
            tl.store(lse_ptr + tok * stride_lt + head, lse, mask=m_valid)


@triton.jit
def _attn_combine(out_ptr, lse_ptr, po_ptr, plse_ptr, tok_nsplit,
                  stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_plt, stride_lt,
                  HQ, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr):
    """One program per token: merge its splits' (output, lse) pairs, all heads at once."""
    t = tl.program_id(0).to(tl.int64)
    ns = tl.load(tok_nsplit + t)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < HQ
    mask = h_mask[:, None] & (offs_d[None, :] < D)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(ns):
        lse = tl.load(plse_ptr + s * stride_ls + t * stride_plt + offs_h, mask=h_mask, other=float("-inf"))
        o = tl.load(po_ptr + s * stride_ps + t * stride_pt + offs_h[:, None] * stride_ph + offs_d[None, :],
                    mask=mask, other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)
        w_sum = w_sum * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m = m_new
    w_safe = tl.where(w_sum == 0.0, 1.0, w_sum)
    mine = h_mask & ((tl.zeros([BLOCK_H], tl.int32) + ns) > 0)
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             (acc / w_safe[:, None]).to(out_ptr.dtype.element_ty), mask=mask & mine[:, None])
    if WRITE_LSE:
        lse_out = tl.where(w_sum == 0.0, float("-inf"), m + tl.log2(w_safe))
        tl.store(lse_ptr + t * stride_lt + offs_h, lse_out, mask=mine)


@dataclass
class RowSpec:
    """One row as the attention kernel sees it at one layer."""
    q_start: int
    n: int
    start: int  # absolute position of the first query
    base: int  # slot base (used by a full view)
    kv_len: int
    idx: torch.Tensor | None = None  # sparse view: pool indices (int), else None
    pos: torch.Tensor | None = None  # sparse view: slot positions of those keys


@dataclass
class _Group:
    block_q: int
    arrays: torch.Tensor  # [6, num_qblocks] int32: tok0, nq, qpos0, kv_len, base, idx_off
    num_qblocks: int


@dataclass
class AttnPlan:
    """Everything the launches need that depends only on the batch layout, built once on the host and
    shipped to the device in a couple of copies; cached per view signature across layers."""
    groups: list[_Group]
    idx: torch.Tensor  # concatenated sparse pool indices (int32), or a 1-element dummy
    pos: torch.Tensor
    chunk: int  # keys per split
    num_splits: int  # grid size along the split axis (max over rows)
    tok_nsplit: torch.Tensor | None  # [T] int32 splits per token (None when num_splits == 1)
    num_tokens: int


def plan_attention(specs: list[RowSpec], num_tokens: int, hkv: int, g: int, device, block_n: int = 64,
                   min_chunk: int = 512, target_programs: int | None = None,
                   max_block_m: int = 128) -> AttnPlan:
    """Flatten rows into query blocks and choose the split-K chunk.

    Rows of one query (decode/draft) and multi-query rows (verify) form separate launches so that a
    decode row does not carry a verify-sized tile. Splits: enough programs to fill the GPU (target),
    but never chunks shorter than min_chunk keys (each split costs a partial write and a combine read).
    """
    g_pad = pow2(g)
    if target_programs is None:
        if torch.cuda.is_available() and torch.device(device).type == "cuda":
            # a few programs per SM keep enough loads in flight to stream K/V at full bandwidth
            target_programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
        else:
            target_programs = 1
    sparse_parts, pos_parts, off = [], [], 0
    idx_off_of: dict[int, int] = {}
    single, multi = [], []
    for sp in specs:
        if sp.idx is not None:
            key = id(sp.idx)
            if key not in idx_off_of:  # rows sharing a view tensor share one copy
                idx_off_of[key] = off
                sparse_parts.append(sp.idx)
                pos_parts.append(sp.pos)
                off += sp.idx.numel()
        (single if sp.n == 1 else multi).append(sp)
    max_n = max((sp.n for sp in multi), default=1)
    groups_host = []
    for rows, bq in ((single, 1), (multi, min(pow2(max_n), max(1, max_block_m // g_pad)))):
        if not rows:
            continue
        cols = [[], [], [], [], [], []]
        for sp in rows:
            io = idx_off_of[id(sp.idx)] if sp.idx is not None else -1
            for i0 in range(0, sp.n, bq):
                for c, v in zip(cols, (sp.q_start + i0, min(bq, sp.n - i0), sp.start + i0, sp.kv_len, sp.base, io)):
                    c.append(v)
        groups_host.append((bq, cols))
    num_qblocks = sum(len(c[0]) for _, c in groups_host)
    max_kv = max(sp.kv_len for sp in specs)
    want = max(1, math.ceil(target_programs / max(1, num_qblocks * hkv)))
    splits = max(1, min(want, math.ceil(max_kv / max(min_chunk, block_n))))
    chunk = math.ceil(math.ceil(max_kv / splits) / block_n) * block_n
    splits = math.ceil(max_kv / chunk)
    # One host->device copy for all the int arrays of the plan.
    flat = []
    for bq, cols in groups_host:
        flat.extend(v for c in cols for v in c)
    tok_nsplit = None
    if splits > 1:
        per_tok = [0] * num_tokens
        for sp in specs:
            ns = math.ceil(sp.kv_len / chunk)
            per_tok[sp.q_start:sp.q_start + sp.n] = [ns] * sp.n
        flat.extend(per_tok)
    dev_ints = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
    groups, o = [], 0
    for bq, cols in groups_host:
        nb = len(cols[0])
        groups.append(_Group(bq, dev_ints[o:o + 6 * nb].view(6, nb), nb))
        o += 6 * nb
    if splits > 1:
        tok_nsplit = dev_ints[o:o + num_tokens]
    if sparse_parts:
        idx = torch.cat([t.to(device) for t in sparse_parts]).to(torch.int32)
        pos = torch.cat([t.to(device) for t in pos_parts]).to(torch.int32)
    else:
        idx = pos = torch.zeros(1, dtype=torch.int32, device=device)
    return AttnPlan(groups, idx, pos, chunk, splits, tok_nsplit, num_tokens)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttnPlan,
                    scale: float, out: torch.Tensor | None = None, want_lse: bool = False,
                    block_n: int = 64, workspace: dict | None = None, num_warps: int | None = None,
                    num_stages: int | None = None):
    """Attention for every query block of the plan. q/out [T, Hq, D]; caches [Hkv, cap, D].
    Tokens of the batch that no plan row covers are left untouched in `out`. num_warps/num_stages:
    launch options of the main kernel (None: see _default_warps; Triton's default stages).
    Returns (out, lse) with lse [T, Hq] float32 in base 2 (None unless want_lse)."""
    T, hq, d = q.shape
    hkv = k_cache.shape[0]
    g = hq // hkv
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if out is None:
        out = tc.empty(q.shape, q.dtype, q.device)
    ws = workspace if workspace is not None else {}
    lse = None
    if want_lse:
        lse = _buffer(ws, "lse", (T, hq), q.device)
    split = plan.num_splits > 1
    if split:
        po = _buffer(ws, "po", (plan.num_splits, T, hq, d), q.device)
        plse = _buffer(ws, "plse", (plan.num_splits, T, hq), q.device)
    else:
        po = plse = out  # unused
    lse_arg = lse if lse is not None else out
    block_d = max(16, pow2(d))
    g_pad = pow2(g)
    for grp in plan.groups:
        a = grp.arrays
        # Tensor-core dots want M >= 16: a decode row of an MHA model pads its 1 x 1 tile.
        block_m = max(MIN_M, grp.block_q * g_pad)
        _attn_fwd[(grp.num_qblocks, hkv, plan.num_splits)](
            q, k_cache, v_cache, out, lse_arg, po, plse,
            a[0], a[1], a[2], a[3], a[4], a[5], plan.idx, plan.pos,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            out.stride(0), out.stride(1),
            po.stride(0) if split else 0, po.stride(1) if split else 0, po.stride(2) if split else 0,
            plse.stride(0) if split else 0, lse_arg.stride(0) if not split else plse.stride(1),
            scale * LOG2E, plan.chunk, g, d,
            BLOCK_M=block_m, G_PAD=g_pad, BLOCK_N=block_n, BLOCK_D=block_d,
            SPLIT=split, WRITE_LSE=want_lse, num_warps=num_warps or _default_warps(block_m, q.dtype),
            **({"num_stages": num_stages} if num_stages else {}), **dot_flags(q.dtype))
    if split:
        # Tokens the plan does not cover (prefill rows served elsewhere) carry 0 splits: left alone.
        _attn_combine[(T,)](
            out, lse_arg, po, plse, plan.tok_nsplit,
            out.stride(0), out.stride(1), po.stride(0), po.stride(1), po.stride(2),
            plse.stride(0), plse.stride(1), lse_arg.stride(0) if lse is not None else 0,
            hq, d, BLOCK_H=max(1, pow2(hq)), BLOCK_D=block_d, WRITE_LSE=want_lse)
    return out, lse


def _default_warps(block_m: int, dtype: torch.dtype) -> int:
    """From ptxas -v on sm_90 (triton_compile_check --resources): 4 warps spill past 16-row tiles, and
    fp32 (FMA dots, no tensor cores) needs 8 warps even at 16 rows."""
    return 4 if block_m <= 16 and dtype != torch.float32 else 8


def max_block_m(dtype: torch.dtype) -> int:
    """Largest tile height: 128 rows with tensor-core dots; fp32 spills beyond 32 rows even at 8 warps."""
    return 32 if dtype == torch.float32 else 128


def _buffer(ws: dict, name: str, shape, device) -> torch.Tensor:
    """fp32 scratch, reused across the layers of one forward (launches are stream-ordered)."""
    key = (name, tuple(shape), str(device))  # one per plan shape (ASPIRE: sparse + refresh layers)
    buf = ws.get(key)
    if buf is None:
        buf = ws[key] = tc.empty(shape, torch.float32, device)
    return buf
