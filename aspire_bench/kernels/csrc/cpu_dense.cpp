// The dense part of a transformer layer for the CPU, one call per layer (fp32 arithmetic; weights and
// KV pool fp32 or bf16: the _bf16 entry points read bf16 weight panels, widening each vector to fp32
// in registers as it is loaded (exact: the arithmetic of fp32 panels holding the same values, half
// the bytes), and round each key and value written to bf16 as torch does).
//
// Why: with a small model a forward on a CPU is dominated by the per-call cost of ~20 torch ops per
// layer, not by its arithmetic (the bundled model: 60 MFLOP and 15 MB of weights for 8 tokens). Here
// one call runs everything between two attention calls:
//   post (layer l):  x += attn Wo^T + bo;  x += down(silu(gate(h)) * up(h)), h = rms_norm(x) * mlp_norm
//   pre (layer l+1): h = rms_norm(x) * attn_norm;  qkv = h Wqkv^T + bqkv;  q/k: rms_norm * q_norm/k_norm
//                    (Qwen3), RoPE; q out, k and v written to the pool at each token's position
// in one OpenMP region whose phases are separated by barriers, and aspire_dense_head the final norm
// and LM head of the rows that need logits.
//
// GEMMs: weights are prepacked (by the Python side) into panels of 32 output columns stored k-major,
// P[panel][k][32] of fp32 or bf16, zero-padded; gate and up share a panel (16 columns each) so the MLP's activation is
// the GEMM's epilogue. The micro-kernel keeps MR <= 8 tokens x 32 columns in register tiles and
// sums over k in order with FMAs, so a token's result does not depend on how many tokens share the
// call (batch-invariant). Work items are (panel, block of 8 tokens), split statically over threads.
//
// Layouts (fp32 but the pools and the packed weights, contiguous): x [T, hidden] (updated in place);
// attn [T, Hq*D]; q out [T, Hq, D]; k, v pools [layers, Hkv, cap, D], fp32 or bf16; dest [T] int64 pool
// positions; cos, sin [T, D] (HF convention: rotate_half = cat(-x2, x1)). Per layer, 12 pointers
// (0 = absent), in this order: attn_norm, Wqkv (packed), bqkv, q_norm, k_norm, Wo (packed), bo,
// mlp_norm, Wgate_up (packed, interleaved), bgate_up (interleaved likewise, padded), Wdown (packed),
// bdown; the packed weights in the pool's element, norms and biases fp32.
// dims: hidden, Hq, Hkv, D, intermediate, cap (pool positions per layer and head).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"  // VL, vf, vi, bf16, load, store, splat, to_bf16

namespace {

constexpr int NR = 32;        // output columns per panel (the packing's layout)
constexpr int NV = NR / VL;   // vectors per panel row
constexpr int HALF = NR / 2;  // SWIGLU: the gate's (and the up's) columns per panel
constexpr int MR = 8;         // tokens per work item
// The micro-kernel's register tile: MT tokens x CP vectors of accumulators, with CP vectors of the
// panel and a broadcast token element (AVX-512: 8 x 2 of 32 registers; AVX2: 6 x 2 of 16).
constexpr int CP = 2;
constexpr int MT = VL == 16 ? 8 : 6;
constexpr int PF_ROWS = 32;  // panel rows prefetched ahead (16 and 64 measured the same)

// 2^x, x clamped to [-126, 126] (exactly 0 below -126). Relative error ~2e-7.
inline vf exp2v(vf x) {
  const vi dead = x < -126.f;
  x = x < -126.f ? splat(-126.f) : x;
  x = x > 126.f ? splat(126.f) : x;
  const vi t = __builtin_convertvector(x, vi);  // truncates toward zero
  const vi n = t - (__builtin_convertvector(t, vf) > x ? 1 : 0);  // floor
  const vf f = x - __builtin_convertvector(n, vf);  // [0, 1)
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

// silu(g) * u = g / (1 + e^-g) * u.
inline vf swiglu(vf g, vf u) { return g / (1.f + exp2v(g * -1.4426950408889634f)) * u; }

// acc[m][c] = x[m, :K] . P[:, c*VL : (c+1)*VL] for m < T, CP vectors from c0; k in order.
template <int T, class W>
inline void tile(const float* x, int64_t ldx, const W* P, int64_t K, int c0, vf (*acc)[NV]) {
  vf a[T][CP] = {};
  for (int64_t k = 0; k < K; ++k) {
    // The panel streams from memory (a step's KV reads evict the weights from cache): on the first
    // pass ask for its rows PF_ROWS ahead, both lines of each; past its end lies the next item's panel.
    // Without it the loads stalled: a weights-only forward 13% slower on a 2-core AVX2 EPYC.
    if (c0 == 0)
      for (int l = 0; l < NR; l += 64 / static_cast<int>(sizeof(W))) __builtin_prefetch(P + (k + PF_ROWS) * NR + l);
    vf b[CP];
    for (int c = 0; c < CP; ++c) b[c] = load(P + k * NR + (c0 + c) * VL);
    for (int m = 0; m < T; ++m) {
      const vf s = splat(x[m * ldx + k]);
      for (int c = 0; c < CP; ++c) a[m][c] += s * b[c];
    }
  }
  for (int m = 0; m < T; ++m)
    for (int c = 0; c < CP; ++c) acc[m][c0 + c] = a[m][c];
}

// acc[m][:] = x[m, :K] . P[:, 0..31] for m < M (M <= MR), in register tiles; each token's sums run
// over k in order whatever the tiling, so its result does not depend on the tokens beside it.
template <int M, class W>
inline void micro(const float* x, int64_t ldx, const W* P, int64_t K, vf (*acc)[NV]) {
  constexpr int T = M < MT ? M : MT;
  for (int c0 = 0; c0 < NV; c0 += CP) tile<T>(x, ldx, P, K, c0, acc);
  if constexpr (M > MT) micro<M - MT>(x + MT * ldx, ldx, P, K, acc + MT);
}

template <class W>
inline void micro_any(int M, const float* x, int64_t ldx, const W* P, int64_t K, vf (*acc)[NV]) {
  switch (M) {
    case 8: micro<8>(x, ldx, P, K, acc); break;
    case 7: micro<7>(x, ldx, P, K, acc); break;
    case 6: micro<6>(x, ldx, P, K, acc); break;
    case 5: micro<5>(x, ldx, P, K, acc); break;
    case 4: micro<4>(x, ldx, P, K, acc); break;
    case 3: micro<3>(x, ldx, P, K, acc); break;
    case 2: micro<2>(x, ldx, P, K, acc); break;
    default: micro<1>(x, ldx, P, K, acc); break;
  }
}

enum Epilogue { STORE, ADD, SWIGLU };

// y[T, N] (row stride ldy) op= x[T, K] W^T + b. SWIGLU: panel p holds gate columns 16p.. in its
// first half and up columns in its second; y[:, 16p + j] = silu(gate + bg) * (up + bu), b interleaved
// like the panels. Runs inside a parallel region (an `omp for` with its closing barrier).
// bf16 panels: a decode, draft or verify step (a few blocks of tokens) widens each vector as the
// micro-kernel loads it; a prefill chunk (many blocks) widens each panel once into this thread's
// scratch and reads that, as the widening would otherwise be repeated for every block.
constexpr int64_t WIDEN_BLOCKS = 4;  // more blocks than this per panel: widen the panel once
template <class W>
void gemm(const float* x, int64_t T, int64_t K, const W* P, const float* b, int64_t N, float* y,
          int64_t ldy, Epilogue ep) {
  const int64_t width = ep == SWIGLU ? HALF : NR;  // output columns per panel
  const int64_t np = (N + width - 1) / width, nb = (T + MR - 1) / MR;
  constexpr bool narrow = sizeof(W) == 2;
  std::vector<float> wide(narrow && nb > WIDEN_BLOCKS ? K * NR : 0);
  int64_t widened = -1;  // the panel in `wide`
#pragma omp for schedule(static)
  for (int64_t item = 0; item < np * nb; ++item) {
    const int64_t p = item / nb, t0 = (item % nb) * MR;
    const int M = static_cast<int>(T - t0 < MR ? T - t0 : MR);
    vf acc[MR][NV];
    if (!wide.empty()) {
      if (widened != p) {  // items are split in contiguous runs: a thread meets each of its panels once
        for (int64_t i = 0; i < K * NR; i += VL) store(wide.data() + i, load(P + p * K * NR + i));
        widened = p;
      }
      micro_any(M, x + t0 * K, K, wide.data(), K, acc);
    } else {
      micro_any(M, x + t0 * K, K, P + p * K * NR, K, acc);
    }
    const int64_t c0 = p * width, cols = N - c0 < width ? N - c0 : width;
    if (b)
      for (int c = 0; c < NV; ++c) {
        const vf bc = load(b + p * NR + c * VL);
        for (int m = 0; m < M; ++m) acc[m][c] += bc;
      }
    for (int m = 0; m < M; ++m) {
      float* yr = y + (t0 + m) * ldy + c0;
      alignas(64) float out[NR];
      if (ep == SWIGLU)
        for (int c = 0; c < NV / 2; ++c) store(out + c * VL, swiglu(acc[m][c], acc[m][c + NV / 2]));
      else
        for (int c = 0; c < NV; ++c) store(out + c * VL, acc[m][c]);
      if (ep == ADD)
        for (int64_t j = 0; j < cols; ++j) yr[j] += out[j];
      else
        std::memcpy(yr, out, cols * sizeof(float));
    }
  }
}

inline float inv_rms(const float* x, int64_t n, float eps) {
  vf acc = splat(0.f);
  int64_t i = 0;
  for (; i + VL <= n; i += VL) {
    const vf v = load(x + i);
    acc += v * v;
  }
  float s = 0.f;
  for (int j = 0; j < VL; ++j) s += acc[j];
  for (; i < n; ++i) s += x[i] * x[i];
  return 1.f / std::sqrt(s / static_cast<float>(n) + eps);
}

// h[t] = rms_norm(x[t]) * w for this thread's share of the T tokens (then a barrier).
void norm_rows(const float* x, const float* w, int64_t T, int64_t n, float eps, float* h) {
#pragma omp for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float r = inv_rms(x + t * n, n, eps);
    for (int64_t i = 0; i < n; ++i) h[t * n + i] = x[t * n + i] * r * w[i];
  }
}

struct Dims {
  int64_t hidden, hq, hkv, d, inter, cap;
};

// One head of one token: optional rms_norm * w, then RoPE, into out.
inline void norm_rope(const float* in, const float* w, const float* cs, const float* sn, int64_t d, float eps,
                      float* tmp, float* out) {
  if (w) {
    const float r = inv_rms(in, d, eps);
    for (int64_t i = 0; i < d; ++i) tmp[i] = in[i] * r * w[i];
  } else {
    std::memcpy(tmp, in, d * sizeof(float));
  }
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = tmp[i] * cs[i] - tmp[i + half] * sn[i];
  for (int64_t i = half; i < d; ++i) out[i] = tmp[i] * cs[i] + tmp[i - half] * sn[i];
}

// d values into a pool row of its element.
inline void put(float* dst, const float* src, int64_t d) { std::memcpy(dst, src, d * sizeof(float)); }
inline void put(bf16* dst, const float* src, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = to_bf16(src[i]);
}

template <class KV>
int dense_layer(const int64_t* post, const int64_t* pre, int64_t pre_layer, const int64_t* dims, float eps,
                float* x, const float* attn, float* q, KV* kpool, KV* vpool, const int64_t* dest,
                const float* cos, const float* sin, int64_t T, int num_threads) {
  const Dims dm{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]};
  if (dm.d % 2) return 1;
  const int64_t H = dm.hq + 2 * dm.hkv, nqkv = H * dm.d, inter_p = (dm.inter + HALF - 1) / HALF * HALF;
  std::vector<float> h(T * (dm.hidden > inter_p ? dm.hidden : inter_p));
  std::vector<float> big(T * (nqkv > inter_p ? nqkv : inter_p));
  auto ptr = [](const int64_t* l, int i) { return reinterpret_cast<const float*>(l[i]); };
  auto wptr = [](const int64_t* l, int i) { return reinterpret_cast<const KV*>(l[i]); };  // panels: the pool's element
#pragma omp parallel num_threads(num_threads)
  {
    if (post) {
      gemm(attn, T, dm.hq * dm.d, wptr(post, 5), ptr(post, 6), dm.hidden, x, dm.hidden, ADD);
      norm_rows(x, ptr(post, 7), T, dm.hidden, eps, h.data());
      gemm(h.data(), T, dm.hidden, wptr(post, 8), ptr(post, 9), dm.inter, big.data(), dm.inter, SWIGLU);
      gemm(big.data(), T, dm.inter, wptr(post, 10), ptr(post, 11), dm.hidden, x, dm.hidden, ADD);
    }
    if (pre) {
      norm_rows(x, ptr(pre, 0), T, dm.hidden, eps, h.data());
      gemm(h.data(), T, dm.hidden, wptr(pre, 1), ptr(pre, 2), nqkv, big.data(), nqkv, STORE);
      const float *qn = ptr(pre, 3), *kn = ptr(pre, 4);
      const int64_t layer_off = pre_layer * dm.hkv * dm.cap * dm.d;
      std::vector<float> tmp(2 * dm.d);
#pragma omp for schedule(static)
      for (int64_t th = 0; th < T * (dm.hq + dm.hkv); ++th) {
        const int64_t t = th / (dm.hq + dm.hkv), hd = th % (dm.hq + dm.hkv);
        const float* in = big.data() + t * nqkv + hd * dm.d;
        const float *cs = cos + t * dm.d, *sn = sin + t * dm.d;
        if (hd < dm.hq) {
          norm_rope(in, qn, cs, sn, dm.d, eps, tmp.data(), q + (t * dm.hq + hd) * dm.d);
        } else {
          const int64_t kh = hd - dm.hq, at = layer_off + (kh * dm.cap + dest[t]) * dm.d;
          norm_rope(in, kn, cs, sn, dm.d, eps, tmp.data(), tmp.data() + dm.d);
          put(kpool + at, tmp.data() + dm.d, dm.d);
          put(vpool + at, in + dm.hkv * dm.d, dm.d);
        }
      }
    }
  }
  return 0;
}

}  // namespace

// Floats per vector this build uses.
extern "C" int aspire_dense_vector_width() { return VL; }

extern "C" int aspire_dense_layer(const int64_t* post, const int64_t* pre, int64_t pre_layer, const int64_t* dims,
                                  float eps, float* x, const float* attn, float* q, float* kpool, float* vpool,
                                  const int64_t* dest, const float* cos, const float* sin, int64_t T,
                                  int num_threads) {
  return dense_layer(post, pre, pre_layer, dims, eps, x, attn, q, kpool, vpool, dest, cos, sin, T, num_threads);
}

// The same with bf16 weight panels and a bf16 pool.
extern "C" int aspire_dense_layer_bf16(const int64_t* post, const int64_t* pre, int64_t pre_layer,
                                       const int64_t* dims, float eps, float* x, const float* attn, float* q,
                                       bf16* kpool, bf16* vpool, const int64_t* dest, const float* cos,
                                       const float* sin, int64_t T, int num_threads) {
  return dense_layer(post, pre, pre_layer, dims, eps, x, attn, q, kpool, vpool, dest, cos, sin, T, num_threads);
}

namespace {

// logits[r] = rms_norm(x[rows[r]]) * norm_w . head^T for r < R (head packed like a projection).
template <class W>
int dense_head(const float* norm_w, const W* head, const int64_t* dims, float eps, const float* x,
               const int64_t* rows, int64_t R, int64_t vocab, float* logits, int num_threads) {
  const int64_t n = dims[0];
  std::vector<float> h(R * n);
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + rows[r] * n;
      const float s = inv_rms(xr, n, eps);
      for (int64_t i = 0; i < n; ++i) h[r * n + i] = xr[i] * s * norm_w[i];
    }
    gemm(h.data(), R, n, head, nullptr, vocab, logits, vocab, STORE);
  }
  return 0;
}

}  // namespace

extern "C" int aspire_dense_head(const float* norm_w, const float* head, const int64_t* dims, float eps,
                                 const float* x, const int64_t* rows, int64_t R, int64_t vocab, float* logits,
                                 int num_threads) {
  return dense_head(norm_w, head, dims, eps, x, rows, R, vocab, logits, num_threads);
}

// The same with the head in bf16 panels.
extern "C" int aspire_dense_head_bf16(const float* norm_w, const bf16* head, const int64_t* dims, float eps,
                                      const float* x, const int64_t* rows, int64_t R, int64_t vocab, float* logits,
                                      int num_threads) {
  return dense_head(norm_w, head, dims, eps, x, rows, R, vocab, logits, num_threads);
}

// A whole decode forward in one call: for each layer, the attention kernel's call (and its score
// reduction where the layer captures scores), then that layer's dense call, which also prepares the
// next layer's queries. From Python the same forward is 33 calls with the attention backend's
// per-layer bookkeeping between them: a millisecond per step on a 2-core machine, a third of a
// forward of 8 tokens without KV.
// The attention functions are the attention library's, passed as pointers (the two libraries are
// built apart). layers [L]: each layer's 12 pointers as for aspire_dense_layer. calls [L, 9] int64
// per layer: rows, num_rows, idx (the attention call's), then lse, sbuf, crows, num_crows, qsel, out
// (the score reduction's; num_crows 0 = none at this layer). attn [T, Hq*D] is scratch.
// Returns 0; 1 for an odd head dim; 2 + the attention's code, 16 + the reduction's when they refuse.
template <class KV>
using AttentionFn = int (*)(const float*, const KV*, const KV*, float*, float*, float*, const int64_t*, int64_t,
                            const int64_t*, int64_t, int64_t, int64_t, int64_t, float, int);
typedef int (*ReduceFn)(const float*, const float*, const int64_t*, int64_t, const int64_t*, int64_t, float*,
                        int64_t, int);

namespace {

template <class KV>
int dense_forward(const int64_t* layers, int64_t num_layers, const int64_t* dims, float eps, float* x,
                  float* attn, float* q, KV* kpool, KV* vpool, const int64_t* dest, const float* cos,
                  const float* sin, int64_t T, AttentionFn<KV> attend, ReduceFn reduce, const int64_t* calls,
                  float scale, int64_t page, int num_threads) {
  auto ptrs = [&](int64_t l) { return reinterpret_cast<const int64_t*>(layers[l]); };
  if (dense_layer(nullptr, ptrs(0), 0, dims, eps, x, nullptr, q, kpool, vpool, dest, cos, sin, T, num_threads))
    return 1;
  const int64_t hq = dims[1], hkv = dims[2], d = dims[3], cap = dims[5], per_layer = hkv * cap * d;
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* c = calls + l * 9;
    auto f32 = [&](int i) { return reinterpret_cast<float*>(c[i]); };
    auto i64 = [&](int i) { return reinterpret_cast<const int64_t*>(c[i]); };
    int rc = attend(q, kpool + l * per_layer, vpool + l * per_layer, attn, f32(3), f32(4), i64(0), c[1], i64(2),
                    hq, hkv, d, cap, scale, num_threads);
    if (rc) return 2 + rc;
    if (c[6] && (rc = reduce(f32(4), f32(3), i64(5), c[6], i64(7), page, f32(8), hq, num_threads))) return 16 + rc;
    dense_layer(ptrs(l), l + 1 < num_layers ? ptrs(l + 1) : nullptr, l + 1, dims, eps, x, attn, q, kpool, vpool,
                dest, cos, sin, T, num_threads);
  }
  return 0;
}

}  // namespace

extern "C" int aspire_dense_forward(const int64_t* layers, int64_t num_layers, const int64_t* dims, float eps,
                                    float* x, float* attn, float* q, float* kpool, float* vpool,
                                    const int64_t* dest, const float* cos, const float* sin, int64_t T,
                                    AttentionFn<float> attend, ReduceFn reduce, const int64_t* calls, float scale,
                                    int64_t page, int num_threads) {
  return dense_forward(layers, num_layers, dims, eps, x, attn, q, kpool, vpool, dest, cos, sin, T, attend, reduce,
                       calls, scale, page, num_threads);
}

// The same with bf16 weight panels and a bf16 pool, with the attention library's aspire_attention_bf16.
extern "C" int aspire_dense_forward_bf16(const int64_t* layers, int64_t num_layers, const int64_t* dims, float eps,
                                         float* x, float* attn, float* q, bf16* kpool, bf16* vpool,
                                         const int64_t* dest, const float* cos, const float* sin, int64_t T,
                                         AttentionFn<bf16> attend, ReduceFn reduce, const int64_t* calls,
                                         float scale, int64_t page, int num_threads) {
  return dense_forward(layers, num_layers, dims, eps, x, attn, q, kpool, vpool, dest, cos, sin, T, attend, reduce,
                       calls, scale, page, num_threads);
}
