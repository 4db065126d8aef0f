// Fused decode / draft / verify attention for the CPU: one call per layer for all rows of a batch.
//
// Why: the torch path runs ~15 small ops per row and layer (gather, two small-m GEMMs, softmax),
// whose per-op dispatch dominates short sparse rows and does not use a second core. Here each
// (row, KV head), or a chunk of its keys when there are too few pairs for the threads, is one work
// item of an OpenMP loop; it reads each key and value once, in place in the pool (full view) or
// through the row's pool indices (sparse view, no gather copy), for all the query heads of its group
// and all the row's tokens at once, with an online softmax in base 2, prefetching ahead (the next
// block into L1, the two after into L2; a full row of few queries, a decode step or one draft's
// verification, leaves its stream to the hardware) so the KV stream overlaps the arithmetic. The
// chunks of a row merge by their log-sum-exp.
//
// Layouts (contiguous; head_dim a multiple of 16, at most 256): q, out [T, Hq, D] fp32;
// k, v [Hkv, cap, D] (one layer of the pool), fp32 (aspire_attention) or bf16 (aspire_attention_bf16:
// the queries and the softmax's probabilities rounded to bf16 as torch's bf16 attention rounds them,
// products exact and summed in fp32: bf16 dot products on the pool's rows in place where the CPU has
// them (AVX512_BF16), else each key and value widened to fp32);
// rows [R, 8] int64: q_start, n, base, start, idx_off, idx_len (-1 = full view [base, base+start+n)),
// cap_mask (bit i: keep token i's scores, in sbuf from cap_base on; n < 64), cap_base.
// lse [T, Hq] (optional): log2 of each query's softmax normaliser, in log2-scaled score units.
// A sparse row's idx[idx_off : idx_off+idx_len] are pool positions; its last n are its own tokens.
// Query token i (0..n-1) of a row sees key j iff j <= L - n + i (L = keys of the row's view).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"  // VL, vf, vi, vh, bf16, load, store, splat, to_bf16, from_bf16, round_bf16, widen
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

// Keys per block, in vectors (NB; BK = NB * VL keys). Rows of several tokens use four vectors, so
// the block's K (transposed), scores and V rows and the next block's prefetched rows stay in L1 (with
// 64 keys on an AVX2 machine they did not: verification of 2-5 tokens 8-20% slower). Rows of one
// token (decode, draft) do little arithmetic per key and use 64 keys, so that a block's fixed work
// (the running max and sum, the rescale, the next block's addresses) spreads over more (with 32
// keys on the AVX2 machine: 4-7% slower). With AVX-512 both are 64 keys. A bf16 pool's one-token
// rows read by bf16 dot products use the shorter blocks too (half the multiply-adds per key, so less
// still to spread): with 32 keys a decode row on the 2-core Zen 4 took 10-21% less at 7k-31k keys.
constexpr int NB_MULTI = 4, NB_ONE = 64 / VL > 4 ? 64 / VL : 4;
constexpr int BK_MAX = NB_ONE * VL;
constexpr int MAXND = 256 / VL;  // vectors per row of the largest head dim
constexpr int TILE = 16;  // accumulator vectors a register tile may hold (half of AVX-512's, all of AVX2's)
constexpr int REGS = VL == 16 ? 32 : 16;  // vector registers
// Key vectors per score tile for qb queries in a block of nb: the most (a divisor of nb) with qb x kt
// accumulators, kt K vectors and one broadcast within the registers.
constexpr int score_tile(int qb, int nb) {
  int kt = nb;
  while (kt > 1 && (qb * kt + kt + 1 > REGS || nb % kt)) --kt;
  return kt;
}
constexpr float LOG2E = 1.4426950408889634f;
#ifndef ASPIRE_WIDEN_QUERIES
#define ASPIRE_WIDEN_QUERIES 2
#endif
constexpr int64_t WIDEN_QUERIES = ASPIRE_WIDEN_QUERIES;  // see attend_chunk

// bf16 dot products (AVX512_BF16's vdpbf16ps): per 32-bit lane, acc + a.lo * b.lo + a.hi * b.hi for
// pairs of bf16, the products exact and summed in fp32: a bf16 pool's scores read each key as D / 2
// such pairs, half the multiply-adds of widening it, and nothing widened (ASPIRE_BF16_DOT=0 builds
// the widening code on such a CPU too: the tests check both).
#ifndef ASPIRE_BF16_DOT
#define ASPIRE_BF16_DOT 1
#endif
#if !defined(__AVX512BF16__) || (ASPIRE_VL == 8 && !defined(__AVX512VL__))
#undef ASPIRE_BF16_DOT
#define ASPIRE_BF16_DOT 0
#endif
constexpr bool BF16_DOT = ASPIRE_BF16_DOT;
// Two bf16 of a key or query row, dimensions 2i (low half) and 2i + 1: what a bf16 dot product takes.
typedef uint32_t bf16x2;
inline vf load(const bf16x2* p) { vf x; std::memcpy(&x, p, sizeof x); return x; }  // VL pairs, as bits
inline vf splat_bits(bf16x2 b) {
  const vi x = vi{} + static_cast<int32_t>(b);
  vf f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
#if ASPIRE_BF16_DOT
inline vf dot2(vf acc, vf a, vf b) {
#if ASPIRE_VL == 16
  return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
#else
  return (vf)_mm256_dpbf16_ps((__m256)acc, (__m256bh)a, (__m256bh)b);
#endif
}
#else
inline vf dot2(vf acc, vf, vf) { return acc; }  // never called: no bf16x2 rows without the instruction
#endif
typedef uint16_t vh2 __attribute__((vector_size(VL * 4)));  // 2 VL bf16
// Two V rows' 2 VL dims as bf16 pairs (row a's value, row b's) for a bf16 dot product with a pair of
// probabilities, in two vectors of VL dims that interleave 4-dim quarters of 128-bit lanes (in-lane
// unpacks, the cheap shuffles): lo holds dims 0-3, 8-11, ..., hi dims 4-7, 12-15, ...
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
inline void value_pairs(const bf16* a, const bf16* b, vf& lo, vf& hi) {
  vh2 x, y;
  std::memcpy(&x, a, sizeof x);
  std::memcpy(&y, b, sizeof y);
#if ASPIRE_VL == 16
  const vh2 l = SHUF(x, y, 0, 32, 1, 33, 2, 34, 3, 35, 8, 40, 9, 41, 10, 42, 11, 43, 16, 48, 17, 49, 18, 50, 19, 51,
                     24, 56, 25, 57, 26, 58, 27, 59);
  const vh2 h = SHUF(x, y, 4, 36, 5, 37, 6, 38, 7, 39, 12, 44, 13, 45, 14, 46, 15, 47, 20, 52, 21, 53, 22, 54, 23, 55,
                     28, 60, 29, 61, 30, 62, 31, 63);
#else
  const vh2 l = SHUF(x, y, 0, 16, 1, 17, 2, 18, 3, 19, 8, 24, 9, 25, 10, 26, 11, 27);
  const vh2 h = SHUF(x, y, 4, 20, 5, 21, 6, 22, 7, 23, 12, 28, 13, 29, 14, 30, 15, 31);
#endif
  std::memcpy(&lo, &l, sizeof lo);
  std::memcpy(&hi, &h, sizeof hi);
}
// The accumulators of value_pairs' two vectors back in the order of the dims.
inline void unpair(vf& lo, vf& hi) {
#if ASPIRE_VL == 16
  const vf a = SHUF(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const vf b = SHUF(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#else
  const vf a = SHUF(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11);
  const vf b = SHUF(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
#endif
  lo = a;
  hi = b;
}
#undef SHUF

// The length of a captured token's score row: keys rounded up to a multiple of 64, whole blocks on
// every build (the caller sizes the buffer with the same rule).
constexpr int ROW_PAD = 64;
static_assert(ROW_PAD % (NB_MULTI * VL) == 0 && ROW_PAD % BK_MAX == 0, "a score row must hold whole key blocks");
inline int64_t padded(int64_t L) { return (L + ROW_PAD - 1) / ROW_PAD * ROW_PAD; }

// Elements of a K/V row per 64-byte cache line: one prefetch each.
template <class T>
constexpr int64_t LINE = 64 / sizeof(T);
// A loaded vector kept in a register for its several uses (the compiler would fold the load into
// each multiply-add instead: one load per use, and the loads, not the multiply-adds, set the pace).
#if defined(__AVX__)
inline vf in_register(vf x) { __asm__("" : "+x"(x)); return x; }
#else  // no register holds a whole vf (x86 without AVX: the fallback build; other ISAs): the compiler's choice
inline vf in_register(vf x) { return x; }
#endif

// In-register shuffles in stages that stay within 128-bit lanes or move whole ones (unpack of
// floats, of float pairs, then 128-bit lane selects), the cheap ones on AVX-512 and AVX2 (~1/cycle)
// where a shuffle across lanes element by element is not. lanes_lo / lanes_hi: the even / odd
// 128-bit lanes of a, then those of b.
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#if ASPIRE_VL == 16
inline vf unpack_lo(vf a, vf b) { return SHUF(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29); }
inline vf unpack_hi(vf a, vf b) { return SHUF(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31); }
inline vf pairs_lo(vf a, vf b) { return SHUF(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29); }
inline vf pairs_hi(vf a, vf b) { return SHUF(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31); }
inline vf lanes_lo(vf a, vf b) { return SHUF(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27); }
inline vf lanes_hi(vf a, vf b) { return SHUF(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31); }
#else
inline vf unpack_lo(vf a, vf b) { return SHUF(a, b, 0, 8, 1, 9, 4, 12, 5, 13); }
inline vf unpack_hi(vf a, vf b) { return SHUF(a, b, 2, 10, 3, 11, 6, 14, 7, 15); }
inline vf pairs_lo(vf a, vf b) { return SHUF(a, b, 0, 1, 8, 9, 4, 5, 12, 13); }
inline vf pairs_hi(vf a, vf b) { return SHUF(a, b, 2, 3, 10, 11, 6, 7, 14, 15); }
inline vf lanes_lo(vf a, vf b) { return SHUF(a, b, 0, 1, 2, 3, 8, 9, 10, 11); }
inline vf lanes_hi(vf a, vf b) { return SHUF(a, b, 4, 5, 6, 7, 12, 13, 14, 15); }
#endif
#undef SHUF

// Horizontal max / sum: a log-tree of in-register shuffles.
template <class Op>
inline float hreduce(vf x, Op op) {
#define SWAP(...) op(x, __builtin_shufflevector(x, x, __VA_ARGS__))
#if ASPIRE_VL == 16
  x = SWAP(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x = SWAP(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x = SWAP(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x = SWAP(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
  x = SWAP(4, 5, 6, 7, 0, 1, 2, 3);
  x = SWAP(2, 3, 0, 1, 6, 7, 4, 5);
  x = SWAP(1, 0, 3, 2, 5, 4, 7, 6);
#endif
#undef SWAP
  return x[0];
}
inline float hmax(vf x) { return hreduce(x, [](vf a, vf b) { return a > b ? a : b; }); }
inline float hsum(vf x) { return hreduce(x, [](vf a, vf b) { return a + b; }); }

// VL x VL transpose in registers: within-lane 4x4 transposes (two stages), then lane selects.
inline void transpose(vf* r) {
  vf t[VL];
  for (int i = 0; i < VL; i += 2) {
    t[i] = unpack_lo(r[i], r[i + 1]);
    t[i + 1] = unpack_hi(r[i], r[i + 1]);
  }
  for (int g = 0; g < VL; g += 4) {
    r[g] = pairs_lo(t[g], t[g + 2]);
    r[g + 1] = pairs_hi(t[g], t[g + 2]);
    r[g + 2] = pairs_lo(t[g + 1], t[g + 3]);
    r[g + 3] = pairs_hi(t[g + 1], t[g + 3]);
  }
#if ASPIRE_VL == 16
  for (int g = 0; g < VL; g += 8)
    for (int i = 0; i < 4; ++i) {
      t[g + i] = lanes_lo(r[g + i], r[g + i + 4]);
      t[g + i + 4] = lanes_hi(r[g + i], r[g + i + 4]);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = lanes_lo(t[i], t[i + 8]);
    r[i + 8] = lanes_hi(t[i], t[i + 8]);
  }
#else
  for (int i = 0; i < 4; ++i) {
    t[i] = lanes_lo(r[i], r[i + 4]);
    t[i + 4] = lanes_hi(r[i], r[i + 4]);
  }
  for (int i = 0; i < VL; ++i) r[i] = t[i];
#endif
}

// Lane t of the result: the sum of r[t]'s lanes (r is overwritten). The transpose's stages with each
// pair's two halves added instead of kept: 30 shuffles where a transpose takes 64 (VL 16; 14 and 24
// for VL 8).
inline vf hsum_rows(vf* r) {
  for (int i = 0; i < VL / 2; ++i) r[i] = unpack_lo(r[2 * i], r[2 * i + 1]) + unpack_hi(r[2 * i], r[2 * i + 1]);
  for (int i = 0; i < VL / 4; ++i) r[i] = pairs_lo(r[2 * i], r[2 * i + 1]) + pairs_hi(r[2 * i], r[2 * i + 1]);
#if ASPIRE_VL == 16
  for (int i = 0; i < 2; ++i) r[i] = lanes_lo(r[2 * i], r[2 * i + 1]) + lanes_hi(r[2 * i], r[2 * i + 1]);
#endif
  return lanes_lo(r[0], r[1]) + lanes_hi(r[0], r[1]);
}
constexpr int HSUM_SHUFFLES = VL == 16 ? 30 : 14, TRANSPOSE_SHUFFLES = VL == 16 ? 64 : 24;

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

// One work item: a chunk [j_begin, j_end) of one (row, KV head)'s keys for all its queries; T: the
// pool's element (float or bf16).
template <class T>
struct Item {
  const float* q;
  const T* kh;  // this KV head's keys and values in the pool
  const T* vh;
  float* sbuf;
  const int64_t* idx;
  int64_t q_start, n, base, idx_off, cap_mask, cap_base, L, nq, hq, g, kvh, D;
  bool sparse;
  int64_t pos(int64_t j) const { return sparse ? idx[idx_off + j] : base + j; }
};

// Per-item running state: queries (qs; as bf16 pairs in qp for bf16x2 keys), online-softmax max m
// and sum l, accumulators, the block's probabilities, its K and V rows and (transposed scores) its K
// block transposed to [D][BK]. R: the element of the K rows the arithmetic reads (krow): the pool's
// own, fp32 where a bf16 block is widened once into scratch, or bf16x2 for bf16 dot products
// (attend_chunk); the V rows (vrow) are widened with them, else in the pool's element. score_scale:
// what the scores are multiplied by (a bf16 pool's queries are rounded unscaled; an fp32 pool's carry
// the scale).
template <class T, class R>
using ValueRow = std::conditional_t<std::is_same_v<R, float>, float, T>;
template <class T, class R = T>
struct State {
  float *qs, *acc, *p, *m, *l, *kt;
  const R* krow[BK_MAX];
  const ValueRow<T, R>* vrow[BK_MAX];
  int64_t j0, jb;
  const T* pf[2 * BK_MAX];  // K and V rows of the block prefetched during this one's arithmetic
  int64_t npf, groups;
  const bf16x2* qp;
  float score_scale;
  bf16* pb;  // bf16x2 keys: the block's probabilities in bf16, [nq][BK], read in pairs by P·V
};

// Queries q0..q0+QB-1 over the current block: scores, masked online softmax, P·V. It prefetches its
// share (every groups-th row) of the next block, K rows during the scores and V rows during P·V, so
// the next loads are in flight during the arithmetic instead of after it.
//
// Scores two ways. Transposed (DOT false): the K block transposed once, then each dimension's keys
// times a broadcast query element, VL keys per vector: the transposition is shared by all queries.
// Dot (DOT true): per query and key the product of the K row with the query summed across its lanes,
// VL keys folded at once (hsum_rows): no transposition, 30 shuffles per 16 keys and query. Cheaper when
// a (row, KV head) has few queries (decode and draft rows: the GQA group), see use_dot. Every K row
// is loaded once per two queries, and no key is checked: the block's rows past its end point at its
// first row, and their scores are masked (on a Zen 4 a decode row's arithmetic 27% less, one
// draft's verification 18%, than with per-key checks and a load per query). With bf16x2 keys (a bf16
// pool on a CPU with bf16 dot products) the dot path multiplies pairs of dims, and P·V pairs of keys.
template <class T, class R, int ND, int NB, int QB, bool DOT>
inline void group_block(const Item<T>& it, State<T, R>& st, int64_t q0, int64_t gidx) {
  constexpr int BK = NB * VL;
  constexpr bool PAIRS = std::is_same_v<R, bf16x2>;
  static_assert(DOT || !PAIRS, "bf16x2 keys are scored by dot products");
  const int64_t nd = ND > 0 ? ND : it.D / VL;
  const int64_t D = nd * VL;
  const int64_t nk = PAIRS ? nd / 2 : nd;  // vectors of a K row (and of a query) as the scores read it
  vf iota;
  for (int j = 0; j < VL; ++j) iota[j] = static_cast<float>(j);
  vf s[QB][NB];
  if constexpr (!DOT)
    for (int u = 0; u < QB; ++u)
      for (int b = 0; b < NB; ++b) s[u][b] = vf{};
  if constexpr (DOT) {
    // queries in passes of (at most) two, so a pass's 2 x VL partial products and a K row stay in
    // registers; rows past the block's end point at its first (the caller's padding) and are masked
    // below, so no key is checked here
    for (int u0 = 0; u0 < QB; u0 += 2) {
      constexpr int UMAX = QB < 2 ? QB : 2;
      const int nu = QB - u0 < UMAX ? QB - u0 : UMAX;
      vf qv[UMAX][ND > 0 ? ND : MAXND];
      for (int u = 0; u < nu; ++u)
        for (int64_t c = 0; c < nk; ++c)
          qv[u][c] = PAIRS ? load(st.qp + (q0 + u0 + u) * (D / 2) + c * VL) : load(st.qs + (q0 + u0 + u) * D + c * VL);
      for (int b = 0; b < NB; ++b) {
        if (u0 == 0)  // this group's share of the next block's K rows, spread over the first pass
          for (int64_t r = b * VL * st.groups + gidx, r_end = (b + 1) * VL * st.groups; r < r_end && r < st.npf; r += st.groups)
            for (int64_t c = 0; c < D; c += LINE<T>) __builtin_prefetch(st.pf[2 * r] + c);
        vf r[UMAX][VL];
        for (int t = 0; t < VL; ++t) {
          const R* kr = st.krow[b * VL + t];
          for (int64_t c = 0; c < nk; ++c) {
            const vf kv = in_register(load(kr + c * VL));
            for (int u = 0; u < UMAX; ++u)
              if (u < nu) {
                if constexpr (PAIRS) r[u][t] = dot2(c == 0 ? vf{} : r[u][t], qv[u][c], kv);
                else r[u][t] = c == 0 ? qv[u][c] * kv : r[u][t] + qv[u][c] * kv;
              }
          }
        }
        for (int u = 0; u < nu; ++u) s[u0 + u][b] = hsum_rows(r[u]);
      }
    }
  }
  // this group's share of the next block's K rows, needed first (by the next block's scores); issued
  // before the score loop: inside it they cost 15%
  for (int64_t r = gidx; !DOT && r < st.npf; r += st.groups)
    for (int64_t c = 0; c < D; c += LINE<T>) __builtin_prefetch(st.pf[2 * r] + c);
  // scores in tiles of KT key vectors, so the tile's accumulators, its K vectors and a broadcast
  // query element fit the registers (else accumulators spill and chain through memory every step)
  constexpr int KT = score_tile(QB, NB);
  for (int b0 = 0; b0 < (DOT ? 0 : NB); b0 += KT)
    for (int64_t e = 0; e < D; ++e) {
      vf kv[KT];
      for (int b = 0; b < KT; ++b) kv[b] = in_register(load(st.kt + e * BK + (b0 + b) * VL));
      for (int u = 0; u < QB; ++u) {
        const vf qe = splat(st.qs[(q0 + u) * D + e]);
        for (int b = 0; b < KT; ++b) s[u][b0 + b] += qe * kv[b];
      }
    }
  float corr[QB];
  int64_t vis_max = 0;
  for (int u = 0; u < QB; ++u) {
    const int64_t qi = q0 + u, tok = qi % it.n;
    // keys past the block's end and keys after this query's token (the causal tail) are masked; a
    // chunk's first block always has a visible key (chunks start before the row's own tokens)
    int64_t visible = it.L - it.n + tok + 1 - st.j0;
    visible = visible > st.jb ? st.jb : visible;
    vis_max = visible > vis_max ? visible : vis_max;
    vf bm = splat(-INFINITY);
    for (int b = 0; b < NB; ++b) {
      const vf sb = std::is_same_v<T, float> ? s[u][b] : s[u][b] * st.score_scale;
      s[u][b] = (iota + static_cast<float>(b * VL)) < static_cast<float>(visible) ? sb : splat(-INFINITY);
      bm = s[u][b] > bm ? s[u][b] : bm;
    }
    if (it.cap_mask >> tok & 1) {  // a captured token: keep its scores
      const int64_t slot = __builtin_popcountll(it.cap_mask & ((int64_t{1} << tok) - 1));
      float* dst = it.sbuf + it.cap_base + (slot * it.hq + it.kvh * it.g + qi / it.n) * padded(it.L) + st.j0;
      for (int b = 0; b < NB; ++b) store(dst + b * VL, s[u][b]);
    }
    const float mold = st.m[qi], bmax = hmax(bm);
    const float mnew = bmax > mold ? bmax : mold;
    corr[u] = mnew == mold ? 1.f : exp2_neg(splat(mold - mnew))[0];  // m = -inf at first: 0
    vf sum = {};
    for (int b = 0; b < NB; ++b) {
      const vf e = exp2_neg(s[u][b] - mnew);
      // a bf16 pool's probabilities are rounded to bf16 for P·V (as torch's bf16 attention rounds
      // them), the normaliser summed from the unrounded ones
      if constexpr (PAIRS) {
        const vh r = round_bf16(e);
        std::memcpy(st.pb + qi * BK + b * VL, &r, sizeof r);
      } else {
        store(st.p + qi * BK + b * VL, std::is_same_v<T, float> ? e : widen(round_bf16(e)));
      }
      sum += e;
    }
    st.m[qi] = mnew;
    st.l[qi] = st.l[qi] * corr[u] + hsum(sum);
  }
  // acc = acc * corr + sum_j p_j V_j, accumulators in registers over the block
  vf av[QB][ND > 0 ? ND : MAXND];
  for (int u = 0; u < QB; ++u)
    for (int64_t c = 0; c < nd; ++c) {
      av[u][c] = load(st.acc + (q0 + u) * D + c * VL);
      if (corr[u] != 1.f) av[u][c] *= corr[u];  // the running max rarely moves after a few blocks
    }
  // whole groups of VL keys: the masked keys' probabilities are 0 and their rows (padding) readable
  for (int64_t j8 = 0; j8 < vis_max; j8 += VL) {
    for (int64_t r = j8 * st.groups + gidx, r_end = (j8 + VL) * st.groups; r < r_end && r < st.npf; r += st.groups)
      for (int64_t c = 0; c < D; c += LINE<T>) __builtin_prefetch(st.pf[2 * r + 1] + c);  // V rows, used last, during P·V
    if constexpr (PAIRS)  // two keys at a time: a pair of probabilities times a pair of V rows
      for (int64_t jj = j8; jj < j8 + VL; jj += 2) {
        vf pp[QB];
        for (int u = 0; u < QB; ++u) {
          bf16x2 pair;
          std::memcpy(&pair, st.pb + (q0 + u) * BK + jj, sizeof pair);
          pp[u] = splat_bits(pair);
        }
        for (int64_t c = 0; c < nd; c += 2) {
          vf lo, hi;
          value_pairs(st.vrow[jj] + c * VL, st.vrow[jj + 1] + c * VL, lo, hi);
          lo = in_register(lo);
          hi = in_register(hi);
          for (int u = 0; u < QB; ++u) {
            av[u][c] = dot2(av[u][c], pp[u], lo);
            av[u][c + 1] = dot2(av[u][c + 1], pp[u], hi);
          }
        }
      }
    else
      for (int64_t jj = j8; jj < j8 + VL; ++jj) {
        const auto* vr = st.vrow[jj];
        for (int64_t c = 0; c < nd; ++c) {
          const vf vv = in_register(load(vr + c * VL));
          for (int u = 0; u < QB; ++u) av[u][c] += splat(st.p[(q0 + u) * BK + jj]) * vv;
        }
      }
  }
  for (int u = 0; u < QB; ++u)
    for (int64_t c = 0; c < nd; ++c) store(st.acc + (q0 + u) * D + c * VL, av[u][c]);
}

// Queries in groups of QMAX (query_group), the rest in one group of
// exactly the remaining count: no query is padded.
template <class T, class R, int ND, int NB, int QMAX, bool DOT>
inline void run_groups(const Item<T>& it, State<T, R>& st, int64_t nq) {
  int64_t q0 = 0, gidx = 0;
  for (; nq - q0 >= QMAX; q0 += QMAX, ++gidx) group_block<T, R, ND, NB, QMAX, DOT>(it, st, q0, gidx);
  if constexpr (QMAX == 4) {
    if (nq - q0 == 3) group_block<T, R, ND, NB, 3, DOT>(it, st, q0, gidx);
    if (nq - q0 == 2) group_block<T, R, ND, NB, 2, DOT>(it, st, q0, gidx);
    if (nq - q0 == 1) group_block<T, R, ND, NB, 1, DOT>(it, st, q0, gidx);
  } else if constexpr (QMAX == 2) {
    if (nq - q0 == 1) group_block<T, R, ND, NB, 1, DOT>(it, st, q0, gidx);
  }
}

// Scores by dot products (no transposition) when the folds they take (HSUM_SHUFFLES per VL keys and
// query) are fewer than the transposition's (TRANSPOSE_SHUFFLES per VL keys and VL dimensions), with
// a margin of two VL measured at the edges. AVX-512: at head dim 32, 4 queries are 10% cheaper
// transposed; at head dim 128, 16 queries 11% cheaper by dot products. AVX2, head dim 32: 6 queries
// 4-6% cheaper transposed, 4 queries 9-11% cheaper by dot products.
inline bool use_dot(int64_t nq, int64_t D) { return HSUM_SHUFFLES * nq + 2 * VL < TRANSPOSE_SHUFFLES * (D / VL); }

// Queries per group: the most (4, 2 or 1) whose scores (QB x nb vectors) and accumulators (QB x nd)
// both fit a register tile.
constexpr int query_group(int nd, int nb) {
  return nd == 0 ? 1 : 4 * nb <= TILE && 4 * nd <= TILE ? 4 : 2 * nb <= TILE && 2 * nd <= TILE ? 2 : 1;
}

// One chunk of an item in blocks of NB vectors of keys, its arithmetic reading rows of R.
template <class T, class R, int ND, int NB>
void attend_chunk_as(const Item<T>& it, int64_t j_begin, int64_t j_end, float scale, float* out, float* lse,
                     float* part) {
  constexpr int QMAX = query_group(ND, NB), BK = NB * VL;
  constexpr bool PAIRS = std::is_same_v<R, bf16x2>, FP32 = std::is_same_v<T, float>;
  const int64_t D = it.D, nq = it.nq, n = it.n;
  // bf16 dot products: always. With the keys read as pairs the dot path was the faster at every query
  // count measured (Zen 4, 8-float vectors, 4 rows x 7k keys, G = 3, D = 64: 3 to 63 queries 1-17%
  // faster than the transposition; 1 to 21 tokens per row)
  const bool dot = PAIRS || use_dot(nq, it.D);
  std::vector<float> qs(nq * D), acc(nq * D, 0.f), p(nq * BK), m(nq, -INFINITY), l(nq, 0.f), kt(dot ? 0 : D * BK);
  std::vector<bf16x2> qp(PAIRS ? nq * D / 2 : 0);
  std::vector<bf16> pb(PAIRS ? nq * BK : 0);
  State<T, R> st{qs.data(), acc.data(), p.data(), m.data(), l.data(), kt.data(), {}, {}, 0, 0, {}, 0, 0,
                      qp.data(), FP32 ? 1.f : scale * LOG2E, pb.data()};
  constexpr bool widen = !FP32 && std::is_same_v<R, float>;
  std::vector<float> wide(widen ? 2 * BK * D : 0);  // a widened block: its K rows, then its V rows
  const T* kp[BK_MAX];  // the block's K and V rows in the pool
  const T* vp[BK_MAX];
  st.groups = (nq + QMAX - 1) / QMAX;
  for (int64_t gi = 0; gi < it.g; ++gi)
    for (int64_t i = 0; i < n; ++i) {
      const float* src = it.q + ((it.q_start + i) * it.hq + it.kvh * it.g + gi) * D;
      float* dst = st.qs + (gi * n + i) * D;
      // scores in log2 units. A bf16 pool's queries are rounded to bf16 as its keys are (a bf16
      // model's attention in torch does the same), whichever way its scores are computed, and the
      // scale applied to the scores: equal to the fp32 scores of the rounded queries.
      for (int64_t e = 0; e < D; ++e) dst[e] = FP32 ? src[e] * scale * LOG2E : from_bf16(to_bf16(src[e]));
      if constexpr (PAIRS)
        for (int64_t e = 0; e < D; e += 2)
          qp[((gi * n + i) * D + e) / 2] = to_bf16(dst[e]) | bf16x2{to_bf16(dst[e + 1])} << 16;
    }
  const int64_t nd = D / VL;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += BK) {
    st.j0 = j0;
    st.jb = j_end - j0 < BK ? j_end - j0 : BK;
    if (it.sparse)
      for (int64_t jj = 0; jj < st.jb; ++jj) {
        kp[jj] = it.kh + it.idx[it.idx_off + j0 + jj] * D;
        vp[jj] = it.vh + it.idx[it.idx_off + j0 + jj] * D;
      }
    else
      for (int64_t jj = 0; jj < st.jb; ++jj) {
        kp[jj] = it.kh + (it.base + j0 + jj) * D;
        vp[jj] = it.vh + (it.base + j0 + jj) * D;
      }
    if (j0 == j_begin)  // the chunk's first block: no earlier block prefetched it (short rows: -4 to -13%)
      for (int64_t jj = 0; jj < st.jb; ++jj)
        for (int64_t c = 0; c < D; c += LINE<T>) {
          __builtin_prefetch(kp[jj] + c);
          __builtin_prefetch(vp[jj] + c);
        }
    if constexpr (widen)  // each key and value widened once, however many queries read it
      for (int64_t jj = 0; jj < st.jb; ++jj) {
        float* kw = wide.data() + jj * D;
        float* vw = wide.data() + (BK + jj) * D;
        for (int64_t c = 0; c < nd; ++c) {
          store(kw + c * VL, load(kp[jj] + c * VL));
          store(vw + c * VL, load(vp[jj] + c * VL));
        }
        st.krow[jj] = kw;
        st.vrow[jj] = vw;
      }
    else  // in place (bf16x2: the same bytes, read as pairs)
      for (int64_t jj = 0; jj < st.jb; ++jj) {
        st.krow[jj] = reinterpret_cast<const R*>(kp[jj]);
        st.vrow[jj] = vp[jj];
      }
    for (int64_t jj = st.jb; jj < BK; ++jj) {  // past the end: readable rows whose scores are masked
      st.krow[jj] = st.krow[0];
      st.vrow[jj] = st.vrow[0];
    }
    // the next block into L1, spread over this block's arithmetic (further ahead, lines fall out of L1
    // before they are used). Not for a full row scored by dot products (a decode step, a verification
    // of one draft): with so little arithmetic per key the hardware's prefetchers keep its stream
    // going, and the prefetch instructions only take their place in the queues (on a Zen 4, 8 rows
    // at 16k, twelve runs: a decode row's layer 0.60-0.86 of its time with them, one draft's
    // 0.82-1.30, median 0.91; in the slowest memory states the prefetches won).
    const bool prefetch = it.sparse || !dot;
    const int64_t pf_begin = j0 + BK, pf_end = pf_begin + BK < j_end ? pf_begin + BK : j_end;
    st.npf = prefetch && pf_end > pf_begin ? pf_end - pf_begin : 0;
    for (int64_t r = 0; r < st.npf; ++r) {
      const int64_t pos = it.pos(pf_begin + r);
      st.pf[2 * r] = it.kh + pos * D;
      st.pf[2 * r + 1] = it.vh + pos * D;
    }
    // the two blocks after it into L2 only (prefetcht2), where they have room: the hardware's own
    // prefetchers do not follow a sparse row's pages, nor keep pace with rows of several tokens (on a
    // Zen 4, 8 rows at 16k: a draft row's layer 23% faster, verification of 2-3 drafts 22-26%; into
    // L1 instead: 6% slower). Each block is so asked for twice, three and two blocks ahead: 10-14%
    // faster for a draft row, 11% for two drafts' verification, than once at either distance.
    const int64_t l2_end = !prefetch ? pf_end : pf_end + 2 * BK < j_end ? pf_end + 2 * BK : j_end;
    if (it.sparse)
      for (int64_t r = pf_end; r < l2_end; ++r) {
        const int64_t pos = it.idx[it.idx_off + r];
        for (int64_t c = 0; c < D; c += LINE<T>) {
          __builtin_prefetch(it.kh + pos * D + c, 0, 1);
          __builtin_prefetch(it.vh + pos * D + c, 0, 1);
        }
      }
    else  // one contiguous span of K and one of V
      for (int64_t c = (it.base + pf_end) * D, c_end = (it.base + l2_end) * D; c < c_end; c += LINE<T>) {
        __builtin_prefetch(it.kh + c, 0, 1);
        __builtin_prefetch(it.vh + c, 0, 1);
      }
    // K block transposed to [D][BK] (VL x VL tiles through registers), so scores vectorise over keys
    if (!dot)
      for (int kb = 0; kb < NB; ++kb)
        for (int64_t c = 0; c < nd; ++c) {
          vf r[VL];
          for (int t = 0; t < VL; ++t) r[t] = load(st.krow[kb * VL + t] + c * VL);  // past the end: padding, masked
          transpose(r);
          for (int t = 0; t < VL; ++t) store(st.kt + (c * VL + t) * BK + kb * VL, r[t]);
        }
    if (dot)
      run_groups<T, R, ND, NB, QMAX, true>(it, st, nq);
    else if constexpr (!PAIRS)
      run_groups<T, R, ND, NB, QMAX, false>(it, st, nq);
  }
  if constexpr (PAIRS)  // P·V's accumulators back in the order of the dims
    for (int64_t qi = 0; qi < nq; ++qi)
      for (int64_t c = 0; c < nd; c += 2) {
        vf lo = load(st.acc + qi * D + c * VL), hi = load(st.acc + qi * D + (c + 1) * VL);
        unpair(lo, hi);
        store(st.acc + qi * D + c * VL, lo);
        store(st.acc + qi * D + (c + 1) * VL, hi);
      }
  for (int64_t qi = 0; qi < nq; ++qi) {
    if (part) {  // a chunk of a split row: unnormalised, merged by merge_parts
      std::memcpy(part + qi * D, st.acc + qi * D, D * sizeof(float));
      part[nq * D + qi] = st.m[qi];
      part[nq * D + nq + qi] = st.l[qi];
      continue;
    }
    const int64_t gi = qi / n, i = qi % n, h = (it.q_start + i) * it.hq + it.kvh * it.g + gi;
    const float inv = 1.f / st.l[qi];
    for (int64_t e = 0; e < D; ++e) out[h * D + e] = st.acc[qi * D + e] * inv;
    if (lse) lse[h] = st.m[qi] + std::log2(st.l[qi]);
  }
}

// A bf16 pool's keys and values are read in place as pairs by bf16 dot products where the CPU has them
// (and the head dim is whole pairs of vectors). Otherwise they are widened into fp32 scratch first
// when more than two queries read them: the scores read each K row once per pair of queries and P·V
// each V row once per group of queries, and each such read of a bf16 row widens it again.
// Whether an item of a pool of T with ND vectors a head row (0: any other head dim) can be read as bf16
// pairs (PAIRABLE: the variants compiled), and whether this one is (in_pairs: whole pairs of vectors).
template <class T, int ND>
constexpr bool PAIRABLE = !std::is_same_v<T, float> && BF16_DOT && ND % 2 == 0;
template <class T, int ND>
inline bool in_pairs(const Item<T>& it) { return PAIRABLE<T, ND> && it.D % (2 * VL) == 0; }

template <class T, int ND, int NB>
void attend_chunk(const Item<T>& it, int64_t j_begin, int64_t j_end, float scale, float* out, float* lse,
                  float* part) {
  // (only the variants a head dim can take are compiled: ND is D / VL, or 0 for any other D)
  constexpr bool fp32 = std::is_same_v<T, float>, widened = !fp32 && !(PAIRABLE<T, ND> && ND > 0);
  if constexpr (PAIRABLE<T, ND>)
    if (in_pairs<T, ND>(it)) return attend_chunk_as<T, bf16x2, ND, NB>(it, j_begin, j_end, scale, out, lse, part);
  if constexpr (widened)
    if (it.nq > WIDEN_QUERIES) return attend_chunk_as<T, float, ND, NB>(it, j_begin, j_end, scale, out, lse, part);
  if constexpr (fp32 || widened) attend_chunk_as<T, T, ND, NB>(it, j_begin, j_end, scale, out, lse, part);
}

// A one-token row (decode, draft) in the longer blocks, any other in the shorter (see NB_ONE); a bf16
// pool's rows read in pairs by dot products all in the shorter.
template <class T, int ND>
void attend_item(const Item<T>& it, int64_t j_begin, int64_t j_end, float scale, float* out, float* lse, float* part) {
  if (it.n == 1 && !in_pairs<T, ND>(it)) attend_chunk<T, ND, NB_ONE>(it, j_begin, j_end, scale, out, lse, part);
  else attend_chunk<T, ND, NB_MULTI>(it, j_begin, j_end, scale, out, lse, part);
}

// The chunks of one split (row, KV head), each [acc (nq x D), m (nq), l (nq)], merged by their
// log-sum-exp: weights 2^(m_c - M) with M the largest max.
template <class T>
void merge_parts(const Item<T>& it, const float* parts, int64_t chunks, float* out, float* lse) {
  const int64_t nq = it.nq, D = it.D, stride = nq * (D + 2);
  for (int64_t qi = 0; qi < nq; ++qi) {
    float M = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) M = std::fmax(M, parts[c * stride + nq * D + qi]);
    const int64_t gi = qi / it.n, i = qi % it.n, h = (it.q_start + i) * it.hq + it.kvh * it.g + gi;
    float* dst = out + h * D;
    float l = 0.f;
    for (int64_t e = 0; e < D; ++e) dst[e] = 0.f;
    for (int64_t c = 0; c < chunks; ++c) {
      const float* pc = parts + c * stride;
      const float w = std::exp2(pc[nq * D + qi] - M);
      l += w * pc[nq * D + nq + qi];
      for (int64_t e = 0; e < D; ++e) dst[e] += w * pc[qi * D + e];
    }
    for (int64_t e = 0; e < D; ++e) dst[e] /= l;
    if (lse) lse[h] = M + std::log2(l);
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
    if (page_max_sum && page % VL == 0) {  // the VL keys lie in one page: one horizontal sum
      vf iota;
      for (int t = 0; t < VL; ++t) iota[t] = static_cast<float>(t);
      out[out_off + j0 / page] += hsum(iota < static_cast<float>(jb) ? tok : vf{});
      continue;
    }
    for (int64_t t = 0; t < jb; ++t) {
      if (page_max_sum) out[out_off + (j0 + t) / page] += tok[t];
      else out[out_off + j0 + t] = tok[t];
    }
  }
}

}  // namespace

// Floats per vector this build uses (what a benchmark records beside its figures).
extern "C" int aspire_vector_width() { return VL; }
// 1 where a bf16 pool's scores and P·V are bf16 dot products, 0 where they widen to fp32.
extern "C" int aspire_bf16_dot() { return BF16_DOT; }

constexpr int64_t MIN_CHUNK = 1024;  // keys: below this a split costs more in merging than it gains

namespace {

template <class T>
int attention(const float* q, const T* k, const T* v, float* out, float* lse, float* sbuf, const int64_t* rows,
              int64_t num_rows, const int64_t* idx, int64_t hq, int64_t hkv, int64_t d, int64_t cap, float scale,
              int num_threads) {
  if (hkv <= 0 || hq % hkv != 0 || d % VL != 0 || d > 256 || num_threads < 1) return 1;
  const int64_t g = hq / hkv;
  // Rows are split into key chunks when there are too few (row, KV head) pairs to give every thread
  // several items: each chunk streams its keys for all the row's queries, and the chunks' partial
  // softmaxes merge afterwards. A chunk boundary is a multiple of the key block, and the last chunk
  // holds the row's own tokens, so every chunk has a visible key for every query.
  int64_t work = 0;
  for (int64_t r = 0; r < num_rows; ++r) work += (rows[r * 8 + 5] >= 0 ? rows[r * 8 + 5] : rows[r * 8 + 3] + rows[r * 8 + 1]);
  int64_t clen = work * hkv / (4 * num_threads);
  clen = (clen < MIN_CHUNK ? MIN_CHUNK : clen + BK_MAX - 1) / BK_MAX * BK_MAX;  // whole blocks of either size
  std::vector<Item<T>> items;
  std::vector<int64_t> item_chunk, item_begin, item_end, part_off, merge_items;
  int64_t part_size = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t* row = rows + r * 8;
    for (int64_t kvh = 0; kvh < hkv; ++kvh) {
      Item<T> it{q, k + kvh * cap * d, v + kvh * cap * d, sbuf, idx, row[0], row[1], row[2], row[4], row[6], row[7],
              row[5] >= 0 ? row[5] : row[3] + row[1], g * row[1], hq, g, kvh, d, row[5] >= 0};
      const int64_t chunks = (it.L - it.n) / clen > 1 ? (it.L - it.n) / clen : 1;
      if (chunks > 1) merge_items.push_back(static_cast<int64_t>(items.size()));
      for (int64_t c = 0; c < chunks; ++c) {
        items.push_back(it);
        item_chunk.push_back(chunks > 1 ? c : -1);
        item_begin.push_back(c * clen);
        item_end.push_back(c == chunks - 1 ? it.L : (c + 1) * clen);
        part_off.push_back(part_size);
        if (chunks > 1) part_size += it.nq * (d + 2);
      }
    }
  }
  std::vector<float> parts(part_size);
  const int64_t n_items = static_cast<int64_t>(items.size()), n_merge = static_cast<int64_t>(merge_items.size());
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      float* part = item_chunk[i] >= 0 ? parts.data() + part_off[i] : nullptr;
      switch (d) {
#define CASE(D) case D: attend_item<T, D / VL>(items[i], item_begin[i], item_end[i], scale, out, lse, part); break;
        CASE(16) CASE(32) CASE(64) CASE(128)
#undef CASE
        default: attend_item<T, 0>(items[i], item_begin[i], item_end[i], scale, out, lse, part);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_merge; ++i) {
      const int64_t first = merge_items[i];
      int64_t chunks = 0;
      while (first + chunks < n_items && item_chunk[first + chunks] == chunks) ++chunks;
      merge_parts(items[first], parts.data() + part_off[first], chunks, out, lse);
    }
  }
  return 0;
}

}  // namespace

// Attention over an fp32 pool, and over a bf16 one (q and out fp32 in both).
extern "C" int aspire_attention(const float* q, const float* k, const float* v, float* out, float* lse, float* sbuf,
                                const int64_t* rows, int64_t num_rows, const int64_t* idx, int64_t hq, int64_t hkv,
                                int64_t d, int64_t cap, float scale, int num_threads) {
  return attention(q, k, v, out, lse, sbuf, rows, num_rows, idx, hq, hkv, d, cap, scale, num_threads);
}

extern "C" int aspire_attention_bf16(const float* q, const bf16* k, const bf16* v, float* out, float* lse,
                                     float* sbuf, const int64_t* rows, int64_t num_rows, const int64_t* idx, int64_t hq,
                                     int64_t hkv, int64_t d, int64_t cap, float scale, int num_threads) {
  return attention(q, k, v, out, lse, sbuf, rows, num_rows, idx, hq, hkv, d, cap, scale, num_threads);
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
