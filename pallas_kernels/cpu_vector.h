// Vector helpers shared by the native CPU kernels (cpu_attention.cc, cpu_matmul.cc): GCC vector types of 16
// lanes (one AVX-512 register, or two AVX ones) and exp for x <= 0. Plain vector arithmetic, so the compiler
// picks the instructions for the CPU it builds for.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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

// exp_nonpositive on 16 lanes; always inlined (a call would pass the lanes through memory).
__attribute__((always_inline)) inline v16 exp16(v16 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const v16 y = x * 1.44269504088896341f + 0.5f;
  v16 n = __builtin_convertvector(__builtin_convertvector(y, i32x16), v16);  // truncation, then floor:
  n = n > y ? n - 1.0f : n;
  const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const v16 q = exp_polynomial(r);
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return q * scale;
}

}  // namespace
