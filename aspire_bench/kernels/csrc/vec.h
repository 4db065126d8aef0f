// The SIMD vectors the CPU kernels share (GCC >= 12 / Clang vector extensions): one vector per
// register, 16 floats on AVX-512, else 8 (AVX2; two registers elsewhere). A vector wider than the
// registers is split by the compiler, and tiles sized for 32 registers of 16 then spill (an AVX2
// machine ran 3-7x slower). A build may choose 8 on AVX-512 too (-DASPIRE_VL=8: cores that split
// 512-bit operations in two halves, cpu_attention.vector_width_for).
#pragma once
#include <cstdint>
#include <cstring>

#ifndef ASPIRE_VL
#if defined(__AVX512F__)
#define ASPIRE_VL 16
#else
#define ASPIRE_VL 8
#endif
#endif
#if ASPIRE_VL == 16 && !defined(__AVX512F__)  // a build without -march=native: no AVX-512 registers
#undef ASPIRE_VL
#define ASPIRE_VL 8
#endif

namespace {

constexpr int VL = ASPIRE_VL;
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
// A bf16 (the upper half of an fp32's bits).
typedef uint16_t bf16;
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

inline vf load(const float* p) { vf x; std::memcpy(&x, p, sizeof x); return x; }
// VL bf16 widened exactly to fp32, two instructions (zero-extend, shift into the upper half): a bf16
// operand streams half the bytes for the same arithmetic.
inline vf widen(vh h) {
  const vi bits = __builtin_convertvector(h, vi) << 16;
  vf x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
inline vf load(const bf16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return widen(h);
}
inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof x); }
// An fp32 to bf16, rounded to nearest even as torch's conversion rounds.
inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<bf16>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// VL fp32 rounded to bf16 the same way (finite values).
inline vh round_bf16(vf x) {
  vu u;
  std::memcpy(&u, &x, sizeof u);
  return __builtin_convertvector((u + 0x7fffu + ((u >> 16) & 1u)) >> 16, vh);
}
// That bf16 as the fp32 it stands for (exact).
inline float from_bf16(bf16 h) {
  const uint32_t u = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
#if ASPIRE_VL == 16
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x}; }  // (not vf{} + x: an add, for -0's sake)
#endif

}  // namespace
