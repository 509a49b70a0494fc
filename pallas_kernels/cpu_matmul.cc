// y[M, N] (f32) = x[M, K] (f32, rounded to bfloat16) @ w[K, N] (bfloat16), accumulated in float32, for
// XLA:CPU through the XLA FFI (see cpu.py). XLA:CPU's own bfloat16 dots run far below the machine's peak at
// the row counts of decode and prefill steps (and its bfloat16 GEMV is slower than float32); this one uses the
// AVX-512 BF16 dot-product instruction (vdpbf16ps: 32 multiply-adds of bfloat16 pairs into 16 float32 lanes).
//
// The weight keeps its [K, N] row-major layout (no packing at load time, so sharding, checkpoints and the
// XLA fallback see the same array). A panel is 32 output columns: for each pair of weight rows (2k, 2k+1)
// its two 64-byte rows are interleaved in registers into the (w[2k, n], w[2k+1, n]) pairs the instruction
// takes, which permutes the columns inside 128-bit lanes; the permutation is undone once, at the store.
// x is rounded to bfloat16 once per call into a buffer whose rows hold the (x[m, 2k], x[m, 2k+1]) pairs as
// 32-bit words, each broadcast to all lanes. Up to 12 rows x 32 columns of accumulators stay in registers
// for the whole K loop. Work items are panels (all rows each, so a panel is read from memory once and its
// rows stay in cache across row blocks), shared between the caller and XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

constexpr int kPanel = 32;   // output columns per work item
constexpr int kMaxRows = 12; // rows per register block: 24 accumulators + 5 working registers of 32

struct Problem {
  const uint32_t* a;  // [M, K2] bf16 pairs of x
  const uint16_t* w;  // [K, N] bf16
  float* y;           // [M, N]
  int64_t M, K, N, K2;
};

// Row block [m0, m0 + R) x columns [n0, n0 + 32) (masked to `cols` columns at the right edge).
template <int R>
void block(const Problem& p, int64_t m0, int64_t n0, __mmask32 mask) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const uint16_t* w = p.w + n0;
  const uint32_t* a = p.a + m0 * p.K2;
  const int64_t pairs = p.K / 2;
  for (int64_t k = 0; k < pairs; ++k) {
    const __m512i r0 = _mm512_maskz_loadu_epi16(mask, w + (2 * k) * p.N);
    const __m512i r1 = _mm512_maskz_loadu_epi16(mask, w + (2 * k + 1) * p.N);
    const __m512bh b_lo = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
    const __m512bh b_hi = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * p.K2 + k]));
      lo[r] = _mm512_dpbf16_ps(lo[r], x, b_lo);
      hi[r] = _mm512_dpbf16_ps(hi[r], x, b_hi);
    }
  }
  if (p.K % 2) {  // the last, unpaired weight row: its partner is zero (and so is x's padding)
    const __m512i r0 = _mm512_maskz_loadu_epi16(mask, w + (p.K - 1) * p.N);
    const __m512i zero = _mm512_setzero_si512();
    const __m512bh b_lo = (__m512bh)_mm512_unpacklo_epi16(r0, zero);
    const __m512bh b_hi = (__m512bh)_mm512_unpackhi_epi16(r0, zero);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * p.K2 + pairs]));
      lo[r] = _mm512_dpbf16_ps(lo[r], x, b_lo);
      hi[r] = _mm512_dpbf16_ps(hi[r], x, b_hi);
    }
  }
  // unpacklo holds columns {0-3, 8-11, 16-19, 24-27} of the panel, unpackhi {4-7, 12-15, 20-23, 28-31}.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __mmask16 mask_first = static_cast<__mmask16>(mask), mask_second = static_cast<__mmask16>(mask >> 16);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* y = p.y + (m0 + r) * p.N + n0;
    _mm512_mask_storeu_ps(y, mask_first, _mm512_permutex2var_ps(lo[r], first, hi[r]));
    _mm512_mask_storeu_ps(y + 16, mask_second, _mm512_permutex2var_ps(lo[r], second, hi[r]));
  }
}

template <int R>
void rows(const Problem& p, int64_t m0, int64_t n0, __mmask32 mask, int64_t count) {
  if constexpr (R > 0) {
    if (count == R) return block<R>(p, m0, n0, mask);
    return rows<R - 1>(p, m0, n0, mask, count);
  }
}

void panel(const Problem& p, int64_t index) {
  const int64_t n0 = index * kPanel;
  const int64_t cols = std::min<int64_t>(kPanel, p.N - n0);
  const __mmask32 mask = cols == kPanel ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << cols) - 1);
  for (int64_t m0 = 0; m0 < p.M; m0 += kMaxRows)
    rows<kMaxRows>(p, m0, n0, mask, std::min<int64_t>(kMaxRows, p.M - m0));
}

struct Shared {
  Problem problem;
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void work() {
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      panel(problem, i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Rounds x to bfloat16 (to nearest even) into rows of K2 pairs, zero-padding an odd K.
void round_rows(const float* x, int64_t M, int64_t K, int64_t K2, uint32_t* a) {
  uint16_t* out = reinterpret_cast<uint16_t*>(a);
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * K;
    uint16_t* dst = out + m * 2 * K2;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
      _mm512_storeu_si512(dst + k, (__m512i)v);
    }
    for (; k < K; ++k) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_set1_ps(src[k]));
      dst[k] = static_cast<uint16_t>(_mm256_extract_epi16((__m256i)v, 0));
    }
    if (K % 2) dst[K] = 0;
  }
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] != w_dims[0])
    return ffi::Error::InvalidArgument("cpu matmul: x must be [M, K] and w [K, N]");
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->problem;
  const int64_t M = x_dims[0], K = x_dims[1], N = w_dims[1], K2 = (K + 1) / 2;
  thread_local std::vector<uint32_t> pairs;
  pairs.resize(static_cast<size_t>(M * K2));
  round_rows(x.typed_data(), M, K, K2, pairs.data());
  p = Problem{pairs.data(), w.typed_data(), y->typed_data(), M, K, N, K2};
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::memset(p.y, 0, sizeof(float) * M * N);
    return ffi::Error::Success();
  }
  shared->items = (N + kPanel - 1) / kPanel;
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 0), shared->items);
  for (int64_t i = 1; i < helpers; ++i) pool.Schedule([shared] { shared->work(); });
  shared->work();
  // Helpers that start late find no panels; the caller waits only for panels already taken. The buffer of
  // pairs is the caller's and outlives every taken panel.
  while (shared->done.load(std::memory_order_acquire) < shared->items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

#else  // no AVX-512 BF16: cpu.py never calls this (matmul_available() is False); kept for a clear error.

namespace {
ffi::Error Matmul(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::BF16>, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Unimplemented("cpu matmul: this CPU (or compiler) has no AVX-512 BF16");
}
}  // namespace

#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuMatmulBf16, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // w [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
