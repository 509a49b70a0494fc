// The native matmul's kernels for x86 CPUs with AVX2 and FMA but no AVX-512 BF16 (AMD Zen 2/3, Intel from
// Haswell to Alder Lake's cores): part of cpu_matmul.cc (included where that file's common part is defined: the
// Problem, Input and their codes), the same packed panels, prologues, epilogues and work sharing as its AVX-512
// kernels, on 256-bit registers.
//
// There is no bfloat16 dot-product instruction here, so each pair of a panel's weights (w[2k, n], w[2k+1, n]) is
// widened to two float32 where it is loaded (the even value by a shift, the odd one by a mask: a bfloat16 is a
// float32's upper half) and multiplied by fused multiply-adds. The rounding phase holds x's rows rounded to
// bfloat16 but widened to float32 in the pairs' chunk layout ([K2p / 16][R][32] floats by row block,
// Problem::widened), so each of a row's values is one broadcast load; the pairs a kRounded matmul is given (the
// gated epilogue's) are widened into it the same way. A call of one row block (up to 12 rows: block_rows, as on
// AVX-512, so the gated pairs' layout is the same) reads the pairs as they are: one or two rows (a request's
// decode step) x the whole panel in one pass over the weights, more in pieces of up to 4 rows x half a panel.
// Larger calls widen each panel to float32 once (a thread's copy, in L2) and run pieces of up to 6 rows x half
// of it: 12 accumulators, no conversion in the loop. The products go through a small buffer to the epilogue.
// Measured on a 2-core Zen 3 EPYC against XLA's float32 dots (min of alternated runs): 64 rows 0.8-1.0x
// XLA's time (llama-135m's q/k/v, gate/up with its SwiGLU against XLA's dot alone, down), 512 rows 1.05-1.16x;
// one row ~0.3-0.6x (half the bytes).

#pragma once

#include <cfloat>

namespace {

// v rounded to bfloat16 (to nearest even; a NaN stays a NaN), as the float32 it widens to.
inline __m256 round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
  const __m256 quiet = _mm256_castsi256_ps(_mm256_or_si256(bits, _mm256_set1_epi32(0x400000)));
  const __m256 either = _mm256_blendv_ps(_mm256_castsi256_ps(rounded), quiet, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_and_ps(either, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Pairs of bfloat16 (the even value in the low half) from two vectors already rounded (round_bf16).
inline __m256i pair_words(__m256 even, __m256 odd) {
  return _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(even), 16), _mm256_castps_si256(odd));
}

// n (< 8: fewer) floats from x, zero past them.
inline __m256 load_masked(const float* x, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(x);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(x, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
}

// Row m of x after the prologue, rounded to bfloat16 and widened, chunk c of 32 values at out + c * stride (zero
// past K): the AVX-512 round_row's numbers (the norm's mean summed in 8 lanes, not 16).
void round_row(const Input& in, int64_t m, float* out, int64_t stride) {
  const float* src = in.x + m * in.K;
  const int64_t K = in.K;
  __m256 scale = _mm256_set1_ps(1.f);
  if (in.prologue == kRmsNorm) {
    __m256 squares = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 v = load_masked(src + k, K - k);
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, squares);
    float sum = 0.f;
    for (float lane : lanes) sum += lane;
    scale = _mm256_set1_ps(1.f / std::sqrt(sum / static_cast<float>(K) + in.eps));
  }
  for (int64_t k = 0; k < K; k += 32, out += stride) {
    for (int q = 0; q < 4; ++q) {
      const int64_t at = k + 8 * q;
      __m256 v = at < K ? load_masked(src + at, K - at) : _mm256_setzero_ps();
      if (in.prologue == kRmsNorm && at < K)
        v = _mm256_mul_ps(load_masked(in.norm + at, K - at), _mm256_mul_ps(v, scale));
      _mm256_storeu_ps(out + 8 * q, round_bf16(v));
    }
  }
}

// Row block `index`'s rows into Problem::widened: x's rows through the prologue (round_row), or the given pairs
// (kRounded: [K2p / 16][R][16] words, each chunk of a row 32 floats at the same place of the widened layout).
void round_block(const Input& in, const Problem& p, int64_t index) {
  const int64_t m0 = index * p.rows, R = std::min<int64_t>(p.rows, p.M - m0);
  float* out = reinterpret_cast<float*>(in.pairs) + 2 * m0 * p.K2p;
  if (in.x) {
    for (int64_t r = 0; r < R; ++r) round_row(in, m0 + r, out + 32 * r, 32 * R);
    return;
  }
  const uint32_t* a = p.a + m0 * p.K2p;
  for (int64_t i = 0; i < p.K2p * R / 8; ++i, a += 8, out += 16) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
    const __m256 even = even_values(words), odd = odd_values(words);
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);  // by 128-bit lane
    _mm256_storeu_ps(out, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
}

// R rows x Q vectors of 8 columns (from column 8 q0) of a panel `w` ([K2, 64]), the rows' widened values at a
// (row r's chunk c at a + c * stride + 32 r), into products[r][8 q0 ..]; the sums start from the columns' biases
// where given. With `Prefetch`, `prefetch` is a panel brought towards L2 on the way (two lines per pair of rows).
template <int R, int Q, bool Prefetch = false>
__attribute__((always_inline)) inline void multiply(const Problem& p, const float* a, int64_t stride,
                                                     const uint16_t* w, int q0, const float* bias,
                                                     const uint16_t* prefetch, float (*products)[kPanel]) {
  __m256 sums[R][Q];
#pragma GCC unroll 4
  for (int q = 0; q < Q; ++q) {
    const __m256 start = bias ? _mm256_loadu_ps(bias + 8 * (q0 + q)) : _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sums[r][q] = start;
  }
  for (int64_t c = 0; c < p.K2; c += 16, a += stride) {
    const int64_t n = std::min<int64_t>(16, p.K2 - c);
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* row = w + 64 * (c + j) + 16 * q0;
      if constexpr (Prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + 64 * (c + j)), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + 64 * (c + j) + 32), _MM_HINT_T1);
      }
      __m256 even[Q], odd[Q];
#pragma GCC unroll 4
      for (int q = 0; q < Q; ++q) {
        const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * q));
        even[q] = even_values(pairs);
        odd[q] = odd_values(pairs);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 x_even = _mm256_broadcast_ss(a + 32 * r + 2 * j);
        const __m256 x_odd = _mm256_broadcast_ss(a + 32 * r + 2 * j + 1);
#pragma GCC unroll 4
        for (int q = 0; q < Q; ++q) {
          sums[r][q] = _mm256_fmadd_ps(x_even, even[q], sums[r][q]);
          sums[r][q] = _mm256_fmadd_ps(x_odd, odd[q], sums[r][q]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < Q; ++q) _mm256_storeu_ps(products[r] + 8 * (q0 + q), sums[r][q]);
}

// Rows [r0, r0 + count) (count <= 4) of a row block x half `h` of a panel (16 columns).
template <bool Prefetch>
void multiply_half(const Problem& p, const float* a, int64_t stride, const uint16_t* w, int h, const float* bias,
                   const uint16_t* prefetch, int64_t r0, int64_t count, float (*products)[kPanel]) {
  a += 32 * r0;
  products += r0;
  switch (count) {
    case 1: return multiply<1, 2, Prefetch>(p, a, stride, w, 2 * h, bias, prefetch, products);
    case 2: return multiply<2, 2, Prefetch>(p, a, stride, w, 2 * h, bias, prefetch, products);
    case 3: return multiply<3, 2, Prefetch>(p, a, stride, w, 2 * h, bias, prefetch, products);
    default: return multiply<4, 2, Prefetch>(p, a, stride, w, 2 * h, bias, prefetch, products);
  }
}

// act(gate) * up on 8 lanes, the AVX-512 gated_mul's arithmetic (cpu_gated.h) on 256-bit registers.
inline __m256 gated_activation(__m256 g, __m256 u, int32_t activation) {
  __m256 s = g;
  if (activation == kGatedPairsSwigluOai) {
    g = _mm256_min_ps(g, _mm256_set1_ps(7.f));
    u = _mm256_add_ps(_mm256_max_ps(_mm256_min_ps(u, _mm256_set1_ps(7.f)), _mm256_set1_ps(-7.f)), _mm256_set1_ps(1.f));
    s = _mm256_mul_ps(g, _mm256_set1_ps(1.702f));
  } else if (activation == kGatedPairsGeluTanh) {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    s = _mm256_mul_ps(_mm256_set1_ps(2.f * 0.7978845608028654f), _mm256_fmadd_ps(cube, _mm256_set1_ps(0.044715f), g));
  }
  const __m256 negative = _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 e = exp8(_mm256_blendv_ps(_mm256_sub_ps(_mm256_setzero_ps(), s), s, negative));  // e^-|s|
  const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(_mm256_set1_ps(1.f), e, negative),
                                       _mm256_add_ps(e, _mm256_set1_ps(1.f)));
  return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), u);
}

// The epilogue of a row block [m0, m0 + R) x panel `index` (products[r]: row r's 32 columns): as the AVX-512
// store_row puts them (y plus the residual, streamed where Problem::stream says; or the gated pairs).
void finish_block(const Problem& p, int64_t m0, int64_t R, int64_t index, float (*products)[kPanel]) {
  const int64_t cols = std::min<int64_t>(kPanel, p.N - index * kPanel);
  for (int64_t r = 0; r < R; ++r) {
    if (p.gated) {  // 16 gate and 16 up columns: 16 columns of the next matmul's x, half a chunk of this row
      const __m256 v0 = gated_activation(_mm256_load_ps(products[r]), _mm256_load_ps(products[r] + 16), p.activation);
      const __m256 v1 =
          gated_activation(_mm256_load_ps(products[r] + 8), _mm256_load_ps(products[r] + 24), p.activation);
      uint32_t* at = p.gated + m0 * p.gated_K2p + (index / 2) * 16 * R + (index % 2) * 8 + 16 * r;
      // values 0-7 and 8-15 rounded, their upper halves packed in order: pairs (0, 1) .. (14, 15)
      const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v0)), 16);
      const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v1)), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(at),
                          _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8));
      continue;
    }
    const int64_t at = (m0 + r) * p.N + index * kPanel;
    float* y = p.y + at;
    if (p.stream && cols == kPanel) {
      for (int q = 0; q < 4; ++q) _mm256_stream_ps(y + 8 * q, _mm256_loadu_ps(products[r] + 8 * q));
    } else if (p.residual) {
      for (int64_t c = 0; c < cols; ++c) y[c] = products[r][c] + p.residual[at + c];
    } else {
      std::memcpy(y, products[r], sizeof(float) * cols);
    }
  }
}

// The panel w ([K2, 64] pairs) widened to float32 at `out` by halves, [2][2 K2][16] (half h's row k: input k's 16
// columns; each half one stream, 8% faster than rows of 32 in a single-core harness), bringing the panel `prefetch`
// (where given) towards L2 on the way.
void widen_panel(const Problem& p, const uint16_t* w, const uint16_t* prefetch, float* out) {
  for (int64_t k = 0; k < p.K2; ++k, w += 64, out += 32) {
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + 64 * k), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + 64 * k + 32), _MM_HINT_T1);
    }
    for (int q = 0; q < 4; ++q) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * q));
      float* at = out + (q / 2) * 32 * p.K2 + 8 * (q % 2);
      _mm256_store_ps(at, even_values(pairs));
      _mm256_store_ps(at + 16, odd_values(pairs));
    }
  }
}

// R rows (<= 6) x half `h` of a widened panel (widen_panel), the rows' widened values at a as for multiply, into
// products[r][16 h ..]: 12 accumulators, one multiply-add of each per input (no conversion in the loop).
template <int R>
__attribute__((always_inline)) inline void multiply_widened(const Problem& p, const float* a, int64_t stride,
                                                             const float* wide, int h, const float* bias,
                                                             float (*products)[kPanel]) {
  __m256 sums[R][2];
#pragma GCC unroll 2
  for (int q = 0; q < 2; ++q) {
    const __m256 start = bias ? _mm256_loadu_ps(bias + 16 * h + 8 * q) : _mm256_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) sums[r][q] = start;
  }
  const int64_t K = 2 * p.K2;
  const float* row = wide + 16 * h * K;
  for (int64_t c = 0; c < K; c += 32, a += stride) {
    const int64_t n = std::min<int64_t>(32, K - c);
    // Unrolled by 4 (48 multiply-adds a pass; GCC left the loop rolled, 12 a pass with its counter and branch):
    // alternated in one session, 576- and 1536-square matmuls of 64 and 256 rows ran at 56-72 GFLOPS on one
    // core against 47-58 (medians), and the offline shared workload 1.13x (186 against 165 output tokens/s,
    // medians of 7 alternated runs).
#pragma GCC unroll 4
    for (int64_t j = 0; j < n; ++j, row += 16) {
      // (dereferenced, not _mm256_load_ps: GCC then kept the sums in memory across the loop)
      const __m256 w0 = *reinterpret_cast<const __m256*>(row), w1 = *reinterpret_cast<const __m256*>(row + 8);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_set1_ps(a[32 * r + j]);
        sums[r][0] = _mm256_fmadd_ps(x, w0, sums[r][0]);
        sums[r][1] = _mm256_fmadd_ps(x, w1, sums[r][1]);
      }
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(products[r] + 16 * h, sums[r][0]);
    _mm256_storeu_ps(products[r] + 16 * h + 8, sums[r][1]);
  }
}

// Rows [r0, r0 + count) (count <= 6) of a row block x half `h` of a widened panel.
void multiply_widened_half(const Problem& p, const float* a, int64_t stride, const float* wide, int h,
                           const float* bias, int64_t r0, int64_t count, float (*products)[kPanel]) {
  a += 32 * r0;
  products += r0;
  switch (count) {
    case 1: return multiply_widened<1>(p, a, stride, wide, h, bias, products);
    case 2: return multiply_widened<2>(p, a, stride, wide, h, bias, products);
    case 3: return multiply_widened<3>(p, a, stride, wide, h, bias, products);
    case 4: return multiply_widened<4>(p, a, stride, wide, h, bias, products);
    case 5: return multiply_widened<5>(p, a, stride, wide, h, bias, products);
    default: return multiply_widened<6>(p, a, stride, wide, h, bias, products);
  }
}

// A row block's R rows in pieces of at most `most`, as even as can be (11 rows by 4: 4 + 4 + 3; by 6: 6 + 5):
// piece(i, first row, rows).
template <typename Piece>
void split_rows(int64_t R, int64_t most, Piece piece) {
  const int64_t pieces = (R + most - 1) / most;
  for (int64_t i = 0, r0 = 0; i < pieces; ++i) {
    const int64_t count = (R - r0 + (pieces - i) - 1) / (pieces - i);
    piece(i, r0, count);
    r0 += count;
  }
}

// Panel `index` for all rows; the panel `next` (this worker's likely next one, or -1) is prefetched during the
// first pass over the weights. One row block (up to 12 rows: a decode step's) reads the pairs as they are, in one
// pass (one or two rows x the whole panel) or in pieces of up to 4 rows x half the panel; more rows, the panel
// widened to float32 first (this thread's copy, in L2), then pieces of up to 6 rows x half of it. Measured on a
// Zen 3 core (576 x 3072 by 32-panels, 48 to 516 rows): the widened pieces 61-72 GFLOPS, the pairs' 46-54.
void panel(const Problem& p, int64_t index, int64_t next) {
  const uint16_t* w = p.w + index * p.K2 * 64;
  const uint16_t* prefetch = next >= 0 ? p.w + next * p.K2 * 64 : nullptr;
  const float* bias = p.column_bias ? p.column_bias + index * kPanel : nullptr;
  alignas(64) float products[kMaxRows][kPanel];
  const float* wide = nullptr;
  if (p.M > kMaxRows) {
    thread_local std::vector<float> buffer;
    buffer.resize(static_cast<size_t>(p.K2 * 64) + 16);
    float* out = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
    widen_panel(p, w, prefetch, out);
    wide = out;
    prefetch = nullptr;
  }
  for (int64_t m0 = 0; m0 < p.M; m0 += p.rows, prefetch = nullptr) {
    const int64_t R = std::min<int64_t>(p.rows, p.M - m0), stride = 32 * R;
    const float* a = p.widened + 2 * m0 * p.K2p;
    if (wide) {
      split_rows(R, 6, [&](int64_t, int64_t r0, int64_t count) {
        for (int h = 0; h < 2; ++h) multiply_widened_half(p, a, stride, wide, h, bias, r0, count, products);
      });
    } else if (R <= 2) {
      if (R == 1 && prefetch) multiply<1, 4, true>(p, a, stride, w, 0, bias, prefetch, products);
      else if (R == 1) multiply<1, 4>(p, a, stride, w, 0, bias, nullptr, products);
      else if (prefetch) multiply<2, 4, true>(p, a, stride, w, 0, bias, prefetch, products);
      else multiply<2, 4>(p, a, stride, w, 0, bias, nullptr, products);
    } else {
      split_rows(R, 4, [&](int64_t i, int64_t r0, int64_t count) {
        for (int h = 0; h < 2; ++h) {  // both halves of a piece in turn: its rows stay in L1
          if (h == 0 && i == 0 && prefetch) {
            multiply_half<true>(p, a, stride, w, h, bias, prefetch, r0, count, products);
          } else {
            multiply_half<false>(p, a, stride, w, h, bias, nullptr, r0, count, products);
          }
        }
      });
    }
    finish_block(p, m0, R, index, products);
  }
}

// float8 e4m3 bytes to their values / 256, exactly (the AVX-512 fp8_over_256's float16 trick, on 8 values).
inline __m256 fp8_over_256(const uint8_t* bytes) {
  const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8),
                                    _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x7F)), 7));
  return _mm256_cvtph_ps(half);
}

// int4 and fp8 panels to bfloat16, as the AVX-512 affine_panel (8 columns at a time).
void affine_panel(const Problem& p, const uint8_t* q, const float* scales, uint16_t* panel_w) {
  const __m256i low = _mm256_set1_epi32(0xF);
  for (int64_t g = 0; g < p.groups; ++g) {
    const float* group = scales + g * 64;  // 32 scales, then 32 biases
    for (int64_t k = g * p.group_pairs; k < (g + 1) * p.group_pairs; ++k) {
      for (int h = 0; h < 4; ++h) {  // columns 8h .. 8h + 7
        const __m256 s = _mm256_loadu_ps(group + 8 * h), b = _mm256_loadu_ps(group + 32 + 8 * h);
        __m256 even, odd;
        if (p.fp8) {
          even = _mm256_fmadd_ps(fp8_over_256(q + k * 64 + 8 * h), s, b);
          odd = _mm256_fmadd_ps(fp8_over_256(q + k * 64 + 32 + 8 * h), s, b);
        } else {
          const __m256i v =
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * 32 + 8 * h)));
          even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), s, b);
          odd = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), s, b);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel_w + k * 64 + 16 * h),
                            pair_words(round_bf16(even), round_bf16(odd)));
      }
    }
  }
}

// MXFP4 to bfloat16 ([K2, 64], pack_bf16's layout), the AVX-512 mxfp4_panel's numbers: each float4 e2m1 code
// looked up (its magnitude, then its sign bit) and scaled by its column's power of two 2^(e - 127), exact where no
// result leaves the normal range (e in [2, 252]); a group with a column outside it, value by value (ldexp, a
// float32 subnormal result flushed to zero as the AVX-512 conversion does).
void mxfp4_panel(const Problem& p, const uint8_t* q, const uint8_t* exponents, uint16_t* panel_w) {
  alignas(32) static constexpr float kMagnitudes[8] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  const __m256 magnitudes = _mm256_load_ps(kMagnitudes);
  auto values = [&](__m256i codes) {
    const __m256 magnitude = _mm256_permutevar8x32_ps(magnitudes, codes);  // the low 3 bits index
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
    return _mm256_or_ps(magnitude, _mm256_castsi256_ps(sign));
  };
  for (int64_t g = 0; g < p.groups; ++g) {
    const uint8_t* e = exponents + g * 32;
    bool exact = true;
    for (int c = 0; c < kPanel; ++c) exact = exact && e[c] >= 2 && e[c] <= 252;
    __m256 power[4];
    for (int h = 0; h < 4; ++h)
      power[h] = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e + 8 * h))), 23));
    for (int64_t k = g * p.group_pairs; k < (g + 1) * p.group_pairs; ++k) {
      const uint8_t* codes = q + k * 32;
      for (int h = 0; h < 4; ++h) {
        __m256 even, odd;
        if (exact) {
          const __m256i v =
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * h)));
          even = _mm256_mul_ps(values(_mm256_and_si256(v, _mm256_set1_epi32(0xF))), power[h]);
          odd = _mm256_mul_ps(values(_mm256_srli_epi32(v, 4)), power[h]);
        } else {
          alignas(32) float lanes[2][8];
          for (int c = 0; c < 8; ++c)
            for (int j = 0; j < 2; ++j) {
              const int code = (codes[8 * h + c] >> (4 * j)) & 0xF;
              float v = std::ldexp(code & 8 ? -kMagnitudes[code & 7] : kMagnitudes[code & 7], e[8 * h + c] - 127);
              if (std::fabs(v) < FLT_MIN) v = std::copysign(0.f, v);
              lanes[j][c] = v;
            }
          even = _mm256_load_ps(lanes[0]);
          odd = _mm256_load_ps(lanes[1]);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel_w + k * 64 + 16 * h),
                            pair_words(round_bf16(even), round_bf16(odd)));
      }
    }
  }
}

}  // namespace
