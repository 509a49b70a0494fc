// y[M, N] (f32) = x[M, K] (f32, rounded to bfloat16) @ w (bfloat16, packed), accumulated in float32, for
// XLA:CPU through the XLA FFI (see cpu.py). XLA:CPU's own bfloat16 dots run far below the machine's peak at
// the row counts of decode and prefill steps (and its bfloat16 GEMV is slower than float32); this one uses the
// AVX-512 BF16 dot-product instruction (vdpbf16ps: 32 multiply-adds of bfloat16 pairs into 16 float32 lanes).
//
// The weight is packed once at load time (cpu.pack_bf16) into panels of 32 output columns, each contiguous:
// wp[P, K2, 64] with wp[p, k, 2c + j] = w[2k + j, 32p + c] (zero past K and N). A panel is then read as one
// sequential stream (full memory bandwidth for the one-row steps of a single request), and each pair of
// weight rows is already the (w[2k, n], w[2k+1, n]) pairs the instruction takes. x is rounded to bfloat16
// once per call into (x[m, 2k], x[m, 2k+1]) pairs, each broadcast as one 32-bit word, interleaved by row
// block so a block's rows are one sequential stream too. Up to 12 rows x 32 columns of accumulators stay in
// registers for the whole K loop. Work items are panels (all rows each, so a panel is read from memory once
// and stays in cache across row blocks), shared between the caller and XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

constexpr int kPanel = 32;   // output columns per panel (work item)
constexpr int kMaxRows = 12; // rows per register block: 24 accumulators + 5 working registers of 32

struct Problem {
  const uint32_t* a;  // bf16 pairs of x by row block: the block of rows [m0, m0 + R) is [K2, R] at a + m0 * K2
  const uint16_t* w;  // [P, K2, 64] packed bf16
  float* y;           // [M, N]
  int64_t M, N, K2;
  int64_t rows;       // rows per block (the last may have fewer)
};

// Rows per register block: M split into ceil(M / 12) blocks as even as can be (64 rows: 11 x 5 + 9, not
// 12 x 5 + 4, whose last block would run at a third of the width).
inline int64_t block_rows(int64_t M) {
  const int64_t blocks = (M + kMaxRows - 1) / kMaxRows;
  return (M + blocks - 1) / blocks;
}

// Row block [m0, m0 + R) x the 32 columns of panel `index` (masked to the columns below N).
template <int R>
void block(const Problem& p, int64_t m0, int64_t index, __mmask32 mask) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const uint16_t* w = p.w + index * p.K2 * 64;
  const uint32_t* a = p.a + m0 * p.K2;  // this block's [K2, R] pairs: one sequential stream
  for (int64_t k = 0; k < p.K2; ++k) {
    const __m512bh b_lo = (__m512bh)_mm512_loadu_si512(w + 64 * k);
    const __m512bh b_hi = (__m512bh)_mm512_loadu_si512(w + 64 * k + 32);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[k * R + r]));
      lo[r] = _mm512_dpbf16_ps(lo[r], x, b_lo);
      hi[r] = _mm512_dpbf16_ps(hi[r], x, b_hi);
    }
  }
  const __mmask16 mask_lo = static_cast<__mmask16>(mask), mask_hi = static_cast<__mmask16>(mask >> 16);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* y = p.y + (m0 + r) * p.N + index * kPanel;
    _mm512_mask_storeu_ps(y, mask_lo, lo[r]);
    _mm512_mask_storeu_ps(y + 16, mask_hi, hi[r]);
  }
}

template <int R>
void rows(const Problem& p, int64_t m0, int64_t index, __mmask32 mask, int64_t count) {
  if constexpr (R > 0) {
    if (count == R) return block<R>(p, m0, index, mask);
    return rows<R - 1>(p, m0, index, mask, count);
  }
}

void panel(const Problem& p, int64_t index) {
  const int64_t cols = std::min<int64_t>(kPanel, p.N - index * kPanel);
  const __mmask32 mask = cols == kPanel ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << cols) - 1);
  for (int64_t m0 = 0; m0 < p.M; m0 += p.rows)
    rows<kMaxRows>(p, m0, index, mask, std::min<int64_t>(p.rows, p.M - m0));
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

// Rounds x to bfloat16 (to nearest even) into pairs, zero-padding an odd K, laid out by row block: the
// pairs of rows [m0, m0 + R) as [K2, R], so a register block reads its rows as one sequential stream.
void round_rows(const float* x, int64_t M, int64_t K, int64_t K2, int64_t rows, uint32_t* a) {
  thread_local std::vector<uint32_t> row;
  row.resize(static_cast<size_t>(K2));
  uint16_t* out = reinterpret_cast<uint16_t*>(row.data());
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * K;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
      _mm512_storeu_si512(out + k, (__m512i)v);
    }
    for (; k < K; ++k) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_set1_ps(src[k]));
      out[k] = static_cast<uint16_t>(_mm256_extract_epi16((__m256i)v, 0));
    }
    if (K % 2) out[K] = 0;
    const int64_t m0 = m - m % rows, R = std::min<int64_t>(rows, M - m0), r = m - m0;
    uint32_t* dst = a + m0 * K2 + r;
    for (int64_t k2 = 0; k2 < K2; ++k2) dst[k2 * R] = row[k2];
  }
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const auto y_dims = y->dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 3 || y_dims.size() != 2 || w_dims[2] != 2 * kPanel ||
      y_dims[0] != x_dims[0])
    return ffi::Error::InvalidArgument("cpu matmul: x must be [M, K], w packed [P, K2, 64] and y [M, N]");
  const int64_t M = x_dims[0], K = x_dims[1], N = y_dims[1], K2 = w_dims[1];
  if (K2 != (K + 1) / 2 || w_dims[0] != (N + kPanel - 1) / kPanel)
    return ffi::Error::InvalidArgument("cpu matmul: the packed weight's shape does not match x's K and y's N");
  if (M == 0 || N == 0) return ffi::Error::Success();
  auto shared = std::make_shared<Shared>();
  thread_local std::vector<uint32_t> pairs;
  pairs.resize(static_cast<size_t>(M * K2));
  const int64_t rows = block_rows(M);
  round_rows(x.typed_data(), M, K, K2, rows, pairs.data());
  shared->problem = Problem{pairs.data(), w.typed_data(), y->typed_data(), M, N, K2, rows};
  shared->items = w_dims[0];
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
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // w packed [P, K2, 64]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
