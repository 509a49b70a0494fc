// y[M, N] (f32) = W8A8 int8 product of x[M, K] (f32) and an int8 weight (packed), for XLA:CPU through the XLA FFI
// (see cpu.py: matmul_int8). A W8A8 checkpoint's projection (jaxengine/models/quantization.py): each row of x is
// quantized symmetrically, scale s = max|x| / 127 and q = round(x / s) (half to even), the int8 products are
// summed in int32 and the result is acc * s * w_scale[n]. XLA:CPU's own int8 dots ran slower than its bfloat16
// ones here; this one uses AVX-512 VNNI's vpdpbusd (64 multiply-adds of unsigned x signed bytes into 16 int32
// lanes, twice the bfloat16 instruction's): x's quantized values are stored shifted by 128 (unsigned), and the
// shift's share, 128 * the column's sum of weights (`comp`, computed at packing), is taken off the sums.
//
// The weight is packed once at load time (cpu.pack_int8) into panels of 32 output columns, each contiguous:
// wp[P, K4, 128] with wp[p, k, 4c + j] = w[4k + j, 32p + c] (zero past K and N), so a panel is one sequential
// stream and each 64-byte half of a row of it is the (4 k) x (16 columns) the instruction takes. x is quantized
// once per call (the first phase; on the way a row can be RMS-normalised, as the bfloat16 kernel's prologue)
// into quads of bytes laid out by row block in chunks of 16 quads a row ([K4p / 16][R][16]), as cpu_matmul.cc
// lays out its bfloat16 pairs. Up to 12 rows x 32 columns of int32 sums stay in registers for the whole K loop;
// the second phase shares out the panels (all rows each: a panel is read from memory once). Rows past a given
// count (a bucket's padding tokens) are neither quantized nor multiplied: their output is zero.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_pool.h"
#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "cpu_gated.h"

namespace {

constexpr int kPanel = 32;    // output columns per panel (work item)
constexpr int kMaxRows = 12;  // rows per register block: 24 accumulators + 3 working registers of 32
constexpr int kRmsNorm = 1;   // the prologue (cpu.py's _PROLOGUES): rms_norm, or none (0)
// The epilogue (cpu.py's _EPILOGUES, GATED_ACTIVATIONS): the products stored, or act(gate) * up of a gated
// weight's panels (pack_int8 of pack_gated's column order: 16 gate and the same 16 up columns a panel), stored
// as [M, N / 2] float32, the down projection's input.
constexpr int kStore = 0, kGatedSilu = 1, kGatedGeluTanh = 2;

struct Int8Matmul {
  // the first phase's input
  const float* x;      // [M, K]
  const float* norm;   // [K] where the prologue is rms_norm
  int32_t prologue;
  float eps;
  // the quantized rows and their scales (the caller's buffers)
  uint32_t* quads;     // rows [m0, m0 + R) are [K4p / 16][R][16] at quads + m0 * K4p
  float* x_scale;      // [M]
  // the weight and the result
  const int8_t* w;     // [P, K4, 128]
  const int32_t* comp;     // [P * 32]: 128 * each column's sum of weights
  const float* w_scale;    // [P * 32]
  float* y;            // [M, N]
  const float* residual;   // [M, N] added to y, or null
  int32_t epilogue;
  int64_t M, N, K, K4, K4p, rows, P;

  int64_t row_blocks = 0;
  std::atomic<int64_t> blocks_taken{0}, blocks_done{0}, panels_taken{0}, done{0};

  // Row m quantized into its chunks (`stride` words apart), its scale into x_scale[m].
  void quantize_row(int64_t m, uint32_t* out, int64_t stride) const {
    const float* src = x + m * K;
    auto load = [&](const float* p, int64_t k) {
      const int64_t left = K - k;
      const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
      return _mm512_maskz_loadu_ps(mask, p + k);
    };
    __m512 norm_scale = _mm512_set1_ps(1.f);
    if (prologue == kRmsNorm) {
      __m512 squares = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = load(src, k);
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      norm_scale = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(K) + eps));
    }
    auto value = [&](int64_t k) {
      const __m512 v = load(src, k);
      return prologue == kRmsNorm ? _mm512_mul_ps(load(norm, k), _mm512_mul_ps(v, norm_scale)) : v;
    };
    __m512 largest = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) largest = _mm512_max_ps(largest, _mm512_abs_ps(value(k)));
    const float scale = _mm512_reduce_max_ps(largest) / 127.f;
    x_scale[m] = scale;
    const __m512 divisor = _mm512_set1_ps(scale > 0.f ? scale : 1.f);
    const __m512i shift = _mm512_set1_epi32(128), low = _mm512_set1_epi32(-128), high = _mm512_set1_epi32(127);
    for (int64_t k = 0; k < K4p * 4; k += 64, out += stride) {  // a chunk: 16 quads, 64 values
      __m128i bytes[4];
      for (int i = 0; i < 4; ++i) {
        // round half to even (the default rounding mode), as jnp.round; clamped, then shifted to unsigned
        __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(value(k + 16 * i), divisor));
        q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, low), high), shift);
        bytes[i] = _mm512_cvtepi32_epi8(q);
      }
      const __m512i chunk = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_set_m128i(bytes[1], bytes[0])), _mm256_set_m128i(bytes[3], bytes[2]), 1);
      _mm512_storeu_si512(out, chunk);
    }
  }

  void quantize_block(int64_t index) const {
    const int64_t m0 = index * rows, R = std::min<int64_t>(rows, M - m0);
    uint32_t* a = quads + m0 * K4p;
    for (int64_t r = 0; r < R; ++r) quantize_row(m0 + r, a + 16 * r, 16 * R);
  }

  template <int R>
  void block(int64_t m0, int64_t index, __mmask32 mask) const {
    // int32 lanes as GCC's vector type: as __m512i (64-bit lanes, cast for each vpdpbusd) the accumulators
    // went to the stack
    i32x16 lo[R], hi[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = i32x16{};
    const int8_t* wp = w + index * K4 * 128;
    const uint32_t* a = quads + m0 * K4p;  // this block's quads, [K4p / 16][R][16]
    for (int64_t c = 0; c < K4; c += 16, a += 16 * R) {
      const int64_t n = std::min<int64_t>(16, K4 - c);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t k = c + j;
        const __m512i b_lo = _mm512_loadu_si512(wp + 128 * k);
        const __m512i b_hi = _mm512_loadu_si512(wp + 128 * k + 64);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m512i xq = _mm512_set1_epi32(static_cast<int>(a[16 * r + j]));
          lo[r] = (i32x16)_mm512_dpbusd_epi32((__m512i)lo[r], xq, b_lo);
          hi[r] = (i32x16)_mm512_dpbusd_epi32((__m512i)hi[r], xq, b_hi);
        }
      }
    }
    const __m512i comp_lo = _mm512_loadu_si512(comp + index * kPanel);
    const __m512i comp_hi = _mm512_loadu_si512(comp + index * kPanel + 16);
    const __m512 scale_lo = _mm512_loadu_ps(w_scale + index * kPanel);
    const __m512 scale_hi = _mm512_loadu_ps(w_scale + index * kPanel + 16);
    const __mmask16 mask_lo = static_cast<__mmask16>(mask), mask_hi = static_cast<__mmask16>(mask >> 16);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      // (acc * s_x) * s_w, as quantization.int8_matmul computes it
      const __m512 s = _mm512_set1_ps(x_scale[m0 + r]);
      auto scaled = [&](i32x16 sums, __m512i comp, __m512 scale) {
        return _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32((__m512i)sums, comp)), s), scale);
      };
      __m512 out_lo = scaled(lo[r], comp_lo, scale_lo), out_hi = scaled(hi[r], comp_hi, scale_hi);
      if (epilogue != kStore) {  // 16 gate columns (lo) and their up columns (hi): 16 columns of [M, N / 2]
        _mm512_storeu_ps(y + (m0 + r) * (N / 2) + index * 16, gated_mul(out_lo, out_hi, epilogue));
        continue;
      }
      const int64_t at = (m0 + r) * N + index * kPanel;
      if (residual) {
        out_lo = _mm512_add_ps(out_lo, _mm512_maskz_loadu_ps(mask_lo, residual + at));
        out_hi = _mm512_add_ps(out_hi, _mm512_maskz_loadu_ps(mask_hi, residual + at + 16));
      }
      _mm512_mask_storeu_ps(y + at, mask_lo, out_lo);
      _mm512_mask_storeu_ps(y + at + 16, mask_hi, out_hi);
    }
  }

  template <int R>
  void rows_of(int64_t m0, int64_t index, __mmask32 mask, int64_t count) const {
    if constexpr (R > 0) {
      if (count == R) return block<R>(m0, index, mask);
      return rows_of<R - 1>(m0, index, mask, count);
    }
  }

  void panel(int64_t index) const {
    const int64_t cols = std::min<int64_t>(kPanel, N - index * kPanel);
    const __mmask32 mask = cols == kPanel ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << cols) - 1);
    for (int64_t m0 = 0; m0 < M; m0 += rows) rows_of<kMaxRows>(m0, index, mask, std::min<int64_t>(rows, M - m0));
  }

  // Both phases, shared between the caller and XLA's intra-op pool (cpu_pool.h: share_work).
  void work() {
    for (int64_t i; (i = blocks_taken.fetch_add(1, std::memory_order_relaxed)) < row_blocks;) {
      quantize_block(i);
      blocks_done.fetch_add(1, std::memory_order_release);
    }
    while (blocks_done.load(std::memory_order_acquire) < row_blocks) _mm_pause();  // taken blocks finish
    for (int64_t i; (i = panels_taken.fetch_add(1, std::memory_order_relaxed)) < P;) {
      panel(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Rows per block: M split into ceil(M / 12) blocks as even as can be.
inline int64_t block_rows(int64_t M) {
  const int64_t blocks = (M + kMaxRows - 1) / kMaxRows;
  return (M + blocks - 1) / blocks;
}

ffi::Error MatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> stacked,
                      ffi::Buffer<ffi::S32> comp, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> layer,
                      ffi::Buffer<ffi::F32> norm, ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::S32> live_rows,
                      ffi::ResultBuffer<ffi::F32> y, int32_t prologue, int32_t epilogue, float eps) {
  const auto x_dims = x.dimensions();
  const auto s_dims = stacked.dimensions();
  const auto y_dims = y->dimensions();
  if (x_dims.size() != 2 || (s_dims.size() != 3 && s_dims.size() != 4) || y_dims.size() != 2 ||
      s_dims.back() != 4 * kPanel || y_dims[0] != x_dims[0])
    return ffi::Error::InvalidArgument("cpu int8 matmul: x must be [M, K], w packed [(L,) P, K4, 128] and y [M, N]");
  if (layer.element_count() != 1 || live_rows.element_count() != 1)
    return ffi::Error::InvalidArgument("cpu int8 matmul: layer and live_rows must hold one number each");
  const int64_t layers = s_dims.size() == 4 ? s_dims[0] : 1, index = layer.typed_data()[0];
  if (index < 0 || index >= layers)
    return ffi::Error::InvalidArgument("cpu int8 matmul: the layer index is outside the stacked weight");
  const int64_t P = s_dims[s_dims.size() - 3], K4 = s_dims[s_dims.size() - 2];
  if (epilogue != kStore && epilogue != kGatedSilu && epilogue != kGatedGeluTanh)
    return ffi::Error::InvalidArgument("cpu int8 matmul: unknown epilogue");
  const bool gated = epilogue != kStore;
  // gated: the weight's N columns (whole panels) give y's N / 2
  const int64_t M = x_dims[0], K = x_dims[1], N = gated ? 2 * y_dims[1] : y_dims[1];
  if (K4 != (K + 3) / 4 || P != (N + kPanel - 1) / kPanel || (gated && N != P * kPanel))
    return ffi::Error::InvalidArgument("cpu int8 matmul: the packed weight's shape does not match x's K and y's N");
  if (comp.element_count() != static_cast<size_t>(layers * P * kPanel) || scale.element_count() != comp.element_count())
    return ffi::Error::InvalidArgument("cpu int8 matmul: comp and scale must be [(L,) P * 32]");
  if (prologue != 0 && prologue != kRmsNorm) return ffi::Error::InvalidArgument("cpu int8 matmul: unknown prologue");
  if (prologue == kRmsNorm && norm.element_count() != static_cast<size_t>(K))
    return ffi::Error::InvalidArgument("cpu int8 matmul: the norm weight must have x's K elements");
  const bool add = residual.element_count() > 0;
  if (add && (gated || residual.element_count() != static_cast<size_t>(M * N)))
    return ffi::Error::InvalidArgument("cpu int8 matmul: the residual must be [M, N] (or empty), and none when gated");
  const int64_t live = std::clamp<int64_t>(live_rows.typed_data()[0], 0, M), width = y_dims[1];
  std::memset(y->typed_data() + live * width, 0, 4 * (M - live) * width);
  if (live == 0 || N == 0) return ffi::Error::Success();
  const int64_t K4p = (K4 + 15) / 16 * 16;
  thread_local std::vector<uint32_t> buffer;
  thread_local std::vector<float> scales;
  buffer.resize(static_cast<size_t>(live * K4p) + 16);
  scales.resize(static_cast<size_t>(live));
  auto shared = std::make_shared<Int8Matmul>();
  Int8Matmul& p = *shared;
  p.x = x.typed_data();
  p.norm = norm.typed_data();
  p.prologue = prologue;
  p.eps = eps;
  // on whole cache lines: each chunk of a row is one 64-byte store
  p.quads = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
  p.x_scale = scales.data();
  p.w = stacked.typed_data() + index * P * K4 * 4 * kPanel;
  p.comp = comp.typed_data() + index * P * kPanel;
  p.w_scale = scale.typed_data() + index * P * kPanel;
  p.y = y->typed_data();
  p.residual = add ? residual.typed_data() : nullptr;
  p.epilogue = epilogue;
  p.M = live, p.N = N, p.K = K, p.K4 = K4, p.K4p = K4p, p.rows = block_rows(live), p.P = P;
  p.row_blocks = (live + p.rows - 1) / p.rows;
  share_work(pool, shared, P);
  return ffi::Error::Success();
}

}  // namespace

#else  // no AVX-512 VNNI: cpu.py never calls this (int8_matmul_available() is False); kept for a clear error.

namespace {
ffi::Error MatmulInt8(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::S8>, ffi::Buffer<ffi::S32>,
                      ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                      ffi::Buffer<ffi::S32>, ffi::ResultBuffer<ffi::F32>, int32_t, int32_t, float) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "cpu int8 matmul: this CPU (or compiler) has no AVX-512 VNNI");
}
}  // namespace

#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuMatmulInt8, MatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()    // w packed [P, K4, 128] or stacked [L, P, K4, 128]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // comp [(L,) P * 32]: 128 * column sums
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w's scales [(L,) P * 32]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer i32[1]: the stack's layer (0 for 3-D w)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // norm weight [K] (rms_norm; else empty)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // residual [M, N] added to y (or empty)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // live_rows i32[1]: rows past it are zero
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [M, N] (gated: [M, N / 2])
                                  .Attr<int32_t>("prologue")
                                  .Attr<int32_t>("epilogue")
                                  .Attr<float>("eps"));
