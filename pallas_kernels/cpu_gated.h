// The gated MLP's activation on 16 lanes, act(gate) * up (GPT-OSS's: its own form), as the native matmuls apply
// it to a panel's products in registers (cpu_matmul.cc: bfloat16 weights; cpu_int8.cc: W8A8 int8). AVX-512 only:
// each includes it where its own instructions are available.

#pragma once

#include <immintrin.h>

#include "cpu_vector.h"

namespace {

// g * sigmoid(s) * u with sigmoid(s) = 1 / (1 + e^-s) for s >= 0 and e^s / (1 + e^s) below (never overflows).
// silu(g) * u is s = g; the tanh-approximated GELU, 0.5 g (1 + tanh(z)) = g * sigmoid(2z) with
// z = sqrt(2 / pi) (g + 0.044715 g^3), is s = 2z.
inline __m512 sigmoid_gated(__m512 g, __m512 s, __m512 u) {
  const __m512 e = (__m512)exp16((v16)_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(s)));
  const __mmask16 positive = _mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(positive, e, _mm512_set1_ps(1.f)),
                                       _mm512_add_ps(e, _mm512_set1_ps(1.f)));
  return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u);
}

// The gated activations, by the epilogue codes the kernels take (pallas_kernels/cpu.py GATED_ACTIVATIONS).
enum GatedActivation : int32_t {
  kSilu = 1,
  kGeluTanh = 2,
  // GPT-OSS's clamped SwiGLU with its constants (alpha 1.702, limit 7): g = min(gate, 7), then
  // g * sigmoid(1.702 g) * (clamp(up, -7, 7) + 1)
  kSwigluOai = 3,
};

inline __m512 gated_mul(__m512 g, __m512 u, int32_t activation) {
  if (activation == kSwigluOai) {
    const __m512 limit = _mm512_set1_ps(7.f);
    g = _mm512_min_ps(g, limit);
    u = _mm512_add_ps(_mm512_max_ps(_mm512_min_ps(u, limit), _mm512_set1_ps(-7.f)), _mm512_set1_ps(1.f));
    return sigmoid_gated(g, _mm512_mul_ps(_mm512_set1_ps(1.702f), g), u);
  }
  if (activation != kGeluTanh) return sigmoid_gated(g, g, u);
  const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  const __m512 z = _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), cube, g);
  return sigmoid_gated(g, _mm512_mul_ps(_mm512_set1_ps(2.f * 0.7978845608028654f), z), u);
}

}  // namespace
