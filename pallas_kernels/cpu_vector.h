// Vector helpers shared by the native CPU kernels (cpu_attention.cc, cpu_matmul.cc): GCC vector types of 16
// lanes (one AVX-512 register, or two AVX ones) and exp for x <= 0. Plain vector arithmetic, so the compiler
// picks the instructions for the CPU it builds for.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline v16 splat(float x) { return v16{} + x; }

// e^r for the reduced argument r (|r| <= ln 2 / 2): the degree-6 polynomial of Cephes' expf, on a float or
// on 16 lanes (the same arithmetic on both).
template <class T>
inline T exp_polynomial(T r) {
  T q = T{} + 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  return q * r * r + r + 1.0f;
}

// exp for x <= 0 (attention's scores minus their running max, the gated MLP's -|gate|) by range reduction
// and a degree-6 polynomial (Cephes); plain arithmetic, so GCC vectorises the loops that call it. Relative
// error ~1e-7; below -87 the result is exp(-87).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float p = exp_polynomial(r);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// exp_nonpositive on every lane of a GCC vector (V: 16 or 8 floats; I: as many int32): always inlined (a call
// would pass the lanes through memory).
template <class V, class I>
__attribute__((always_inline)) inline V exp_lanes(V x) {
  const V low = V{} - 87.0f;
  x = x < low ? low : x;
  const V y = x * 1.44269504088896341f + 0.5f;
  V n = __builtin_convertvector(__builtin_convertvector(y, I), V);  // truncation, then floor:
  n = n > y ? n - 1.0f : n;
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const V q = exp_polynomial(r);
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return q * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
typedef int32_t i32x8 __attribute__((vector_size(32)));

// The even (low-half) and odd (high-half) bfloat16 values of 8 words that each hold a pair, widened to float32
// (a bfloat16 is a float32's upper half).
inline __m256 even_values(__m256i words) { return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)); }
inline __m256 odd_values(__m256i words) {
  return _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// exp_nonpositive on one 256-bit register's 8 lanes.
__attribute__((always_inline)) inline __m256 exp8(__m256 x) { return exp_lanes<__m256, i32x8>(x); }
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// exp_nonpositive on 16 lanes, as two exp8: where a 16-lane vector is two 256-bit registers, GCC splits its
// comparisons and selects into 128-bit pieces.
__attribute__((always_inline)) inline v16 exp16(v16 x) {
  __m256 lo, hi;
  std::memcpy(&lo, &x, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(lo), sizeof(hi));
  lo = exp8(lo), hi = exp8(hi);
  v16 y;
  std::memcpy(&y, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&y) + sizeof(lo), &hi, sizeof(hi));
  return y;
}
#else
// exp_nonpositive on 16 lanes.
__attribute__((always_inline)) inline v16 exp16(v16 x) { return exp_lanes<v16, i32x16>(x); }
#endif

}  // namespace
