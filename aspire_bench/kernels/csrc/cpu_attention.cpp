// Fused decode / draft / verify attention for the CPU: one call per layer for all rows of a batch.
//
// Why: the torch path runs ~15 small ops per row and layer (gather, two small-m GEMMs, softmax),
// whose per-op dispatch dominates short sparse rows and does not use a second core. Here each
// (row, KV head) is one work item of an OpenMP loop; it reads each key and value once, in place in
// the pool (full view) or through the row's pool indices (sparse view, no gather copy), for all the
// query heads of its group and all the row's tokens at once, with an online softmax in base 2.
//
// Layouts (fp32, contiguous; head_dim a multiple of 16, at most 256): q, out [T, Hq, D];
// k, v [Hkv, cap, D] (one layer of the pool);
// rows [R, 8] int64: q_start, n, base, start, idx_off, idx_len (-1 = full view [base, base+start+n)),
// cap_mask (bit i: keep token i's scores, in sbuf from cap_base on; n < 64), cap_base.
// lse [T, Hq] (optional): log2 of each query's softmax normaliser, in log2-scaled score units.
// A sparse row's idx[idx_off : idx_off+idx_len] are pool positions; its last n are its own tokens.
// Query token i (0..n-1) of a row sees key j iff j <= L - n + i (L = keys of the row's view).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Explicit SIMD through GCC (>= 12) / Clang vector extensions: 16 floats, one AVX-512 register (two
// AVX2 ones).
constexpr int VL = 16;
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
constexpr int BK = 64;  // keys per block: the block's K (transposed), scores and V rows stay in L1
constexpr int NB = BK / VL;
constexpr float LOG2E = 1.4426950408889634f;

// Keys rounded up to whole blocks: the length of a captured token's score row.
inline int64_t padded(int64_t L) { return (L + BK - 1) / BK * BK; }

inline vf load(const float* p) { vf x; std::memcpy(&x, p, sizeof x); return x; }
inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof x); }
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
// Horizontal max / sum: a log-tree of in-register shuffles.
template <class Op>
inline float hreduce(vf x, Op op) {
  x = op(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = op(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return x[0];
}
inline float hmax(vf x) { return hreduce(x, [](vf a, vf b) { return a > b ? a : b; }); }
inline float hsum(vf x) { return hreduce(x, [](vf a, vf b) { return a + b; }); }

// 16x16 transpose in registers: four butterfly stages of two-source shuffles (h = 8, 4, 2, 1 lanes).
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
template <int H>
inline void butterfly(vf* r) {
  for (int i = 0; i < VL; ++i) {
    if (i & H) continue;
    const vf a = r[i], b = r[i + H];
    if constexpr (H == 8) {
      r[i] = SHUF(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
      r[i + H] = SHUF(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    } else if constexpr (H == 4) {
      r[i] = SHUF(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
      r[i + H] = SHUF(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    } else if constexpr (H == 2) {
      r[i] = SHUF(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[i + H] = SHUF(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    } else {
      r[i] = SHUF(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      r[i + H] = SHUF(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
  }
}
#undef SHUF
inline void transpose16(vf* r) { butterfly<8>(r); butterfly<4>(r); butterfly<2>(r); butterfly<1>(r); }

// 2^x for x <= 0; x < -126 (including -inf, a masked key) gives exactly 0. Relative error ~2e-7.
inline vf exp2_neg(vf x) {
  const vi dead = x < -126.f;
  const vf xc = dead ? splat(-126.f) : x;
  const vi t = __builtin_convertvector(xc, vi);  // truncates toward zero: ceil for xc < 0
  const vi n = t - (__builtin_convertvector(t, vf) > xc ? 1 : 0);  // floor
  const vf f = xc - __builtin_convertvector(n, vf);  // [0, 1)
  vf p = splat(2.1690609173e-04f);
  p = p * f + 1.2443081508e-03f;
  p = p * f + 9.6784725545e-03f;
  p = p * f + 5.5483524724e-02f;
  p = p * f + 2.4022979581e-01f;
  p = p * f + 6.9314698706e-01f;
  p = p * f + 1.0000000018e+00f;
  const vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return dead ? splat(0.f) : p * scale;
}

// One (row, KV head): ND = head_dim / 16 vectors, at compile time for the common sizes (the
// accumulators then live in registers), ND == 0 for any other multiple of 16; QB queries are
// processed together.
template <int ND, int QB>
void attend_item(const float* q, const float* k, const float* v, float* out, float* lse, float* sbuf,
                 const int64_t* row, const int64_t* idx, int64_t hq, int64_t g, int64_t kvh, int64_t cap,
                 int64_t d, float scale) {
  const int64_t nd = ND > 0 ? ND : d / VL;
  const int64_t D = nd * VL;
  const int64_t q_start = row[0], n = row[1], base = row[2], start = row[3];
  const int64_t idx_off = row[4], idx_len = row[5], cap_mask = row[6], cap_base = row[7];
  const bool sparse = idx_len >= 0;
  const int64_t L = sparse ? idx_len : start + n;
  const int64_t nq = g * n;  // query vectors of this item: qi = gi * n + i (head kvh*g+gi, token i)
  const int64_t nqp = (nq + QB - 1) / QB * QB;  // padded with zero queries, computed and dropped
  const float* kh = k + kvh * cap * D;
  const float* vh = v + kvh * cap * D;

  std::vector<float> qs(nqp * D, 0.f), acc(nqp * D, 0.f), p(nqp * BK), m(nqp, -INFINITY), l(nqp, 0.f);
  std::vector<float> kt_buf(D * BK);  // K block transposed: [D][BK]
  float* kt = kt_buf.data();
  const float* vrow[BK];
  for (int64_t gi = 0; gi < g; ++gi)
    for (int64_t i = 0; i < n; ++i) {
      const float* src = q + ((q_start + i) * hq + kvh * g + gi) * D;
      float* dst = qs.data() + (gi * n + i) * D;
      for (int64_t e = 0; e < D; ++e) dst[e] = src[e] * scale * LOG2E;  // scores in log2 units
    }
  vf iota;
  for (int j = 0; j < VL; ++j) iota[j] = static_cast<float>(j);

  for (int64_t j0 = 0; j0 < L; j0 += BK) {
    const int64_t jb = L - j0 < BK ? L - j0 : BK;
    // K block transposed to [D][BK] (16x16 tiles through registers), so scores vectorise over keys
    const float* krow[BK];
    for (int64_t jj = 0; jj < jb; ++jj) {
      const int64_t pos = sparse ? idx[idx_off + j0 + jj] : base + j0 + jj;
      krow[jj] = kh + pos * D;
      vrow[jj] = vh + pos * D;
    }
    // The next block's rows, prefetched a slice per query group below: the loads then overlap
    // this block's arithmetic instead of stalling on full fill buffers all at once
    const int64_t next = L - j0 - BK < BK ? (L - j0 - BK > 0 ? L - j0 - BK : 0) : BK;
    const int64_t groups = nqp / QB, per_group = (next + groups - 1) / groups;
    for (int kb = 0; kb < NB; ++kb)
      for (int64_t c = 0; c < nd; ++c) {
        vf r[VL];
        for (int t = 0; t < VL; ++t) {
          const int64_t jj = kb * VL + t;
          r[t] = jj < jb ? load(krow[jj] + c * VL) : vf{};  // past the end: zeros, masked below
        }
        transpose16(r);
        for (int t = 0; t < VL; ++t) store(kt + (c * VL + t) * BK + kb * VL, r[t]);
      }

    // QB queries at a time, so each K and V vector loaded feeds QB multiply-adds
    for (int64_t q0 = 0; q0 < nqp; q0 += QB) {
      const int64_t pf0 = q0 / QB * per_group, pf1 = pf0 + per_group < next ? pf0 + per_group : next;
      for (int64_t jj = j0 + BK + pf0; jj < j0 + BK + pf1; ++jj) {
        const int64_t pos = sparse ? idx[idx_off + jj] : base + jj;
        for (int64_t c = 0; c < D; c += VL) {
          __builtin_prefetch(kh + pos * D + c);
          __builtin_prefetch(vh + pos * D + c);
        }
      }
      vf s[QB][NB] = {};
      for (int64_t e = 0; e < D; ++e) {
        vf kv[NB];
        for (int b = 0; b < NB; ++b) kv[b] = load(kt + e * BK + b * VL);
        for (int u = 0; u < QB; ++u) {
          const vf qe = splat(qs[(q0 + u) * D + e]);
          for (int b = 0; b < NB; ++b) s[u][b] += qe * kv[b];
        }
      }
      float corr[QB];
      int64_t vis_max = 0;
      for (int u = 0; u < QB; ++u) {
        const int64_t qi = q0 + u;
        // keys past the block's end and keys after this query's token (the causal tail) are masked;
        // block 0 always has a visible key, so m is finite from then on
        int64_t visible = L - n + qi % n + 1 - j0;
        visible = visible > jb ? jb : visible;
        vis_max = visible > vis_max ? visible : vis_max;
        vf bm = splat(-INFINITY);
        for (int b = 0; b < NB; ++b) {
          s[u][b] = (iota + static_cast<float>(b * VL)) < static_cast<float>(visible) ? s[u][b]
                                                                                     : splat(-INFINITY);
          bm = s[u][b] > bm ? s[u][b] : bm;
        }
        if (cap_mask && qi < nq && (cap_mask >> (qi % n) & 1)) {  // a captured token: keep its scores
          const int64_t slot = __builtin_popcountll(cap_mask & ((int64_t{1} << (qi % n)) - 1));
          float* dst = sbuf + cap_base + (slot * hq + kvh * g + qi / n) * padded(L) + j0;
          for (int b = 0; b < NB; ++b) store(dst + b * VL, s[u][b]);
        }
        const float mold = m[qi], bmax = hmax(bm);
        const float mnew = bmax > mold ? bmax : mold;
        corr[u] = mnew == mold ? 1.f : exp2_neg(splat(mold - mnew))[0];  // m = -inf at first: 0
        vf sum = {};
        for (int b = 0; b < NB; ++b) {
          const vf e = exp2_neg(s[u][b] - mnew);
          store(p.data() + qi * BK + b * VL, e);
          sum += e;
        }
        m[qi] = mnew;
        l[qi] = l[qi] * corr[u] + hsum(sum);
      }
      // acc = acc * corr + sum_j p_j V_j, accumulators in registers over the block
      vf av[QB][ND > 0 ? ND : 16];
      for (int u = 0; u < QB; ++u)
        for (int64_t c = 0; c < nd; ++c) {
          av[u][c] = load(acc.data() + (q0 + u) * D + c * VL);
          if (corr[u] != 1.f) av[u][c] *= corr[u];  // the running max rarely moves after a few blocks
        }
      for (int64_t jj = 0; jj < vis_max; ++jj) {
        const float* vr = vrow[jj];
        for (int64_t c = 0; c < nd; ++c) {
          const vf vv = load(vr + c * VL);
          for (int u = 0; u < QB; ++u) av[u][c] += splat(p[(q0 + u) * BK + jj]) * vv;
        }
      }
      for (int u = 0; u < QB; ++u)
        for (int64_t c = 0; c < nd; ++c) store(acc.data() + (q0 + u) * D + c * VL, av[u][c]);
    }
  }
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int64_t gi = qi / n, i = qi % n;
    float* dst = out + ((q_start + i) * hq + kvh * g + gi) * D;
    const float inv = 1.f / l[qi];
    for (int64_t e = 0; e < D; ++e) dst[e] = acc[qi * D + e] * inv;
    if (lse) lse[(q_start + i) * hq + kvh * g + gi] = m[qi] + std::log2(l[qi]);
  }
}

// Captured attention scores, reduced as the decoders need them: p = 2^(s - lse) per head from the
// scores the attention call kept, then per key the max (PAGE_MAX_SUM) or mean (TOKEN_MEAN) over all
// query heads, averaged over the chosen tokens; PAGE_MAX_SUM then sums per page. A work item is a
// page-aligned chunk of one row's keys, so items never write the same output.
void reduce_chunk(const float* sbuf, const float* lse, const int64_t* crow, const int64_t* qsel,
                  int64_t j_begin, int64_t j_end, int64_t page, float* out, int64_t hq) {
  const int64_t q_start = crow[0], L = crow[2], cap_mask = crow[3], cap_base = crow[4];
  const int64_t sel_off = crow[5], nsel = crow[6], out_off = crow[7], page_max_sum = crow[8];
  const float w = 1.f / static_cast<float>(nsel), head_w = page_max_sum ? 1.f : 1.f / static_cast<float>(hq);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += VL) {
    vf tok = {};
    for (int64_t c = 0; c < nsel; ++c) {
      const int64_t i = qsel[sel_off + c];
      const int64_t slot = __builtin_popcountll(cap_mask & ((int64_t{1} << i) - 1));
      vf red = {};
      for (int64_t h = 0; h < hq; ++h) {
        const vf sv = load(sbuf + cap_base + (slot * hq + h) * padded(L) + j0);
        const vf pr = exp2_neg(sv - lse[(q_start + i) * hq + h]);
        red = page_max_sum ? (pr > red ? pr : red) : red + pr;
      }
      tok += red * head_w;
    }
    tok *= w;
    const int64_t jb = j_end - j0 < VL ? j_end - j0 : VL;
    for (int64_t t = 0; t < jb; ++t) {
      if (page_max_sum) out[out_off + (j0 + t) / page] += tok[t];
      else out[out_off + j0 + t] = tok[t];
    }
  }
}

}  // namespace

extern "C" int aspire_attention(const float* q, const float* k, const float* v, float* out,
                                float* lse, float* sbuf, const int64_t* rows, int64_t num_rows, const int64_t* idx, int64_t hq,
                                int64_t hkv, int64_t d, int64_t cap, float scale, int num_threads) {
  if (hkv <= 0 || hq % hkv != 0 || d % VL != 0 || d > 256) return 1;
  const int64_t g = hq / hkv;
  const int64_t items = num_rows * hkv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t* row = rows + (it / hkv) * 8;
    const int64_t kvh = it % hkv;
    // 4 queries at a time where their accumulators fit in registers and padding wastes little
    const int64_t nq = g * row[1];
    const int qb = d > 64 ? 2 : (nq % 4 == 0 || nq > 4) ? 4 : nq % 2 == 0 ? 2 : 1;
    switch (d * 8 + qb) {
#define CASE(D, QB) case D * 8 + QB: attend_item<D / VL, QB>(q, k, v, out, lse, sbuf, row, idx, hq, g, kvh, cap, d, scale); break;
      CASE(32, 4) CASE(32, 2) CASE(32, 1) CASE(64, 4) CASE(64, 2) CASE(64, 1) CASE(128, 2) CASE(128, 1)
#undef CASE
      default: attend_item<0, 1>(q, k, v, out, lse, sbuf, row, idx, hq, g, kvh, cap, d, scale);
    }
  }
  return 0;
}

// crows [C, 9] int64: q_start, n, L, cap_mask, cap_base (as in the attention call), sel_off, nsel,
// out_off, page_max_sum (1) or token mean (0); qsel: each row's chosen token indices (repeats count
// twice); out: zeroed by the caller.
extern "C" int aspire_reduce_scores(const float* sbuf, const float* lse, const int64_t* crows,
                                    int64_t num_rows, const int64_t* qsel, int64_t page, float* out,
                                    int64_t hq, int num_threads) {
  if (page <= 0) return 1;
  const int64_t chunk = (1024 + page - 1) / page * page;
  std::vector<int64_t> item_row, item_begin;
  for (int64_t r = 0; r < num_rows; ++r)
    for (int64_t j = 0; j < crows[r * 9 + 2]; j += chunk) {
      item_row.push_back(r);
      item_begin.push_back(j);
    }
  const int64_t items = static_cast<int64_t>(item_row.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t* crow = crows + item_row[it] * 9;
    const int64_t end = item_begin[it] + chunk < crow[2] ? item_begin[it] + chunk : crow[2];
    reduce_chunk(sbuf, lse, crow, qsel, item_begin[it], end, page, out, hq);
  }
  return 0;
}
