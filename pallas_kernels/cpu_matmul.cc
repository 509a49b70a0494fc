// y[M, N] (f32) = x[M, K] (f32, rounded to bfloat16) @ w (bfloat16, packed), accumulated in float32, for
// XLA:CPU through the XLA FFI (see cpu.py). XLA:CPU's own bfloat16 dots run far below the machine's peak at
// the row counts of decode and prefill steps (and its bfloat16 GEMV is slower than float32); this one uses the
// AVX-512 BF16 dot-product instruction (vdpbf16ps: 32 multiply-adds of bfloat16 pairs into 16 float32 lanes).
//
// The weight is packed once at load time (cpu.pack_bf16) into panels of 32 output columns, each contiguous:
// wp[P, K2, 64] with wp[p, k, 2c + j] = w[2k + j, 32p + c] (zero past K and N). A panel is then read as one
// sequential stream (full memory bandwidth for the one-row steps of a single request), and each pair of
// weight rows is already the (w[2k, n], w[2k+1, n]) pairs the instruction takes. x is rounded to bfloat16
// once per call into (x[m, 2k], x[m, 2k+1]) pairs, each broadcast as one 32-bit word, laid out by row block
// in chunks of 16 pairs a row ([K2p / 16][R][16]): a chunk of a row is one vector store, and a block's rows
// are one sequential stream (a [K2, R] transpose, written pair by pair, had cost up to a fifth of a
// prefill matmul's time in its rounding phase); on the way a row can be RMS-normalised (the prologue: XLA
// would otherwise run it as a fusion of its own, writing and reading the rows again). Up to 12 rows x 32
// columns of accumulators stay in registers for the whole K loop. The work, shared between the caller and
// XLA's intra-op thread pool, comes in two phases: row blocks to round, then panels (all rows each, so a
// panel is read from memory once and stays in cache across row blocks; on tiles, from 512 rows, groups of
// rows x groups of panels: Shared::plan). The epilogue either adds a residual
// to the result as it is stored, or, for the gated MLP's gate/up projection (its panels 16 gate and 16 up
// columns), applies silu(gate) * up to the accumulators and writes the down projection's x already rounded
// in its row-block layout: no [M, 2I] float32 result goes through memory, and the down projection skips its
// rounding phase. Rows past a given count (a bucket's padding tokens) are neither rounded nor multiplied:
// their output is zero.
//
// Where the CPU has AMX-BF16 (Intel Xeon from Sapphire Rapids on) the panels run on its tiles instead
// (amx_item) for calls of 8 live rows or more: the same layouts, 16-row blocks, ~6x the register path's speed
// at 64 rows.
//
// Where the CPU has AVX2 and FMA but no AVX-512 BF16 (AMD Zen 2/3, Intel before Sapphire Rapids' cores), the
// same weights, prologues, epilogues and work sharing run cpu_matmul_avx2.h's kernels: each pair of weights is
// widened to float32 as it is loaded, and the rows are held rounded but widened (Problem::widened).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu_pool.h"
#include "cpu_tiles.h"
#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define JAXENGINE_MATMUL_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXENGINE_MATMUL_AVX2 1
#endif

#if defined(JAXENGINE_MATMUL_AVX512) || defined(JAXENGINE_MATMUL_AVX2)
#include <immintrin.h>

namespace {

constexpr int kPanel = 32;   // output columns per panel (work item)
constexpr int kMaxRows = 12; // rows per register block: 24 accumulators + 5 working registers of 32
constexpr int64_t kStreamBytes = int64_t{8} << 20;  // results from this size on bypass the cache (Problem::stream)

struct Problem {
  const uint32_t* a;  // x's bf16 pairs by row block: rows [m0, m0 + R) are [K2p / 16][R][16] at a + m0 * K2p
  const uint16_t* w;  // [P, K2, 64] packed bf16
  float* y;           // [M, N], or null where the result goes to `gated` instead
  const float* residual;  // [M, N] added to y, or null
  uint32_t* gated;    // kGatedPairs: act(gate) * up as a next matmul's x pairs ([M, gated_K2p] by row block)
  int64_t M, N, K2;
  int64_t K2p;        // K2 rounded up to 16: a row's pairs in whole chunks
  int64_t rows;       // rows per block (the last may have fewer)
  int64_t gated_K2p;  // the next matmul's K2p: N / 4 rounded up to 16
  bool stream = false;    // store full panels with non-temporal stores (a large result, no residual)
  bool amx = false;       // the tile path (amx_panel): blocks of kTileRows rows
  int32_t activation = 0;  // gated: the activation (the epilogue's code: kGatedPairs and its kin below)
  const uint32_t* last_block = nullptr;  // amx: the last block's pairs padded to kTileRows rows where it has fewer
  // Weight-only quantized (MatmulDequant): W4A16's int4 panels [P, K2, 32] (byte (k, c): w[2k, c]'s unsigned
  // value in its low nibble, w[2k + 1, c]'s in its high one) or FP8's panels [P, K2, 64] (bytes (k, c) and (k, 32
  // + c): w[2k, c] and w[2k + 1, c] in float8 e4m3), with float32 [P, groups, 64], each group's 32 scales then 32
  // biases (int4: -zero point x scale), each group `group_pairs` pairs of rows; w is unused (each panel is
  // dequantized to bfloat16 first: dequantized_panel).
  const uint8_t* quant = nullptr;
  const float* quant_scale = nullptr;
  int64_t groups = 0, group_pairs = 0;
  bool fp8 = false;
  // MXFP4 (GroupedMatmulMxfp4): quant holds int4's layout of float4 e2m1 codes ([P, K2, 32]), and in place of
  // quant_scale each group of 16 pairs has a power of two per column, E8M0 bytes [P, groups, 32] (2^(e - 127)).
  const uint8_t* exponents = nullptr;
  // Where given, [P * 32] float32 added to each column's products (the accumulators start from it): a bias the
  // epilogue then sees as part of the product (a gated matmul's gate/up biases).
  const float* column_bias = nullptr;
  // The AVX2 path (cpu_matmul_avx2.h): the rows' bfloat16 values widened to float32 ([K2p / 16][R][32] by row
  // block, at widened + 2 * m0 * K2p), from x or from the pairs at `a`.
  const float* widened = nullptr;
};

// Fewer live rows than this run on registers even where tiles are available: a step of one request reads
// its weights at the memory's pace either way, and the tiles' 16-row blocks and round trip through memory
// cost more there (measured on the AMX Xeon, 30 layers of a decode step's matmuls: 1 row 8.7 ms on tiles
// against 8.2 on registers, 4 rows 9.5 against 9.2, 8 rows 9.7 against 13.2; one request's TPOT 10.1-10.7
// against 8.8-9.6 ms).
constexpr int64_t kTileMinRows = 8;  // cpu.TILE_MIN_ROWS

// On tiles, a call of kGroupMinRows live rows or more whose weights are at most twice its rows' pairs is
// shared out in items of kGroupRows rows x panels of up to kGroupWeightBytes of weights (Shared::plan), each
// a pair of blocks outer (its x tiles stay in L1 across the panels) and the group's panels inner (their
// weights stay in L2 across the pairs): a core then reads the pairs of its own rows, which it rounded, and
// writes its own rows of y, at the price of every core reading every weight. Measured on the AMX Xeon, 30
// layers of a step's matmuls (distinct weights): 512 rows 67-72 -> 61-62 ms, 1024 rows 141-143 -> 113-116;
// 256 rows unchanged and 128 rows slower (so not below 512); with the gate/up projection (weights 6x its
// rows' pairs at 512 rows) grouped too, 512 rows 65-67 ms against 59-64.
constexpr int64_t kGroupMinRows = 512;
constexpr int64_t kGroupRows = 256;
constexpr int64_t kGroupWeightBytes = int64_t{128} << 10;

// Rows per block. Registers: M split into ceil(M / 12) blocks as even as can be (64 rows: 11 x 5 + 9, not
// 12 x 5 + 4, whose last block would run at a third of the width). Tiles: 16 (a tile's rows), the last
// block taking the rest. A gated matmul and the one reading its pairs have the same live rows and so agree
// (on the path too: kTileMinRows).
inline int64_t block_rows(int64_t M, bool amx) {
  if (amx) return kTileRows;
  const int64_t blocks = (M + kMaxRows - 1) / kMaxRows;
  return (M + blocks - 1) / blocks;
}

// The AVX2 path holds the rounding phase's rows as float32 (two words a pair: Problem::widened), and widens the
// pairs a kRounded matmul is given into them too.
#ifdef JAXENGINE_MATMUL_AVX2
constexpr bool kWidened = true;
#else
constexpr bool kWidened = false;
#endif

// What the kernel does to each row of x before rounding it to bfloat16 (the `prologue` attribute).
enum Prologue : int32_t {
  kPlain = 0,    // x [M, K] as it is
  kRmsNorm = 1,  // x [M, K] -> norm * (x * rsqrt(mean(x^2) + eps)): transformers' RMSNorm, in float32
  kRounded = 2,  // x is already bfloat16 pairs laid out by row block (a kGatedPairs matmul's result): no phase 1
                 // (on AVX2 a phase that widens them)
};

// What becomes of the products (the `epilogue` attribute).
enum Epilogue : int32_t {
  kStore = 0,        // y [M, N] float32, plus the residual where given
  kGatedPairs = 1,   // panels of 16 gate and 16 up columns (pack_gated): silu(gate) * up [M, N / 2] rounded to
                     // bfloat16 pairs, laid out as the x of a kRounded matmul over the same live rows
  kGatedPairsGeluTanh = 2,  // kGatedPairs with the tanh-approximated GELU (Gemma's) in place of silu
  kGatedPairsSwigluOai = 3,  // kGatedPairs with GPT-OSS's clamped SwiGLU (cpu_gated.h kSwigluOai)
};

struct Input {
  const float* x;
  int64_t K;           // the matmul's K, x's row width
  int32_t prologue;
  const float* norm;   // [K] for kRmsNorm
  float eps;
  uint32_t* pairs;     // where the rounded rows go (Problem::a)
};

}  // namespace
#endif

#ifdef JAXENGINE_MATMUL_AVX512
#include "cpu_gated.h"

namespace {

// Row r of the row block [m0, m0 + R) x panel `index`, its 32 products in lo (columns 0-15) and hi (16-31),
// to where the epilogue puts them.
inline void store_row(const Problem& p, int64_t m0, int64_t R, int64_t r, int64_t index, __mmask32 mask, __m512 lo,
                      __m512 hi, bool add_residual = true) {
  if (p.gated) {
    // A panel is 16 gate columns and the same 16 up columns (pack_gated): silu(gate) * up is 16 columns of
    // the next matmul's x, 8 of its pairs, half a chunk of this row block there (its rows are the same
    // block of the same rows: the next matmul has the same live rows, so the same block_rows).
    uint32_t* out = p.gated + m0 * p.gated_K2p + (index / 2) * 16 * R + (index % 2) * 8 + 16 * r;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        (__m256i)_mm512_cvtneps_pbh(gated_mul(lo, hi, p.activation)));
    return;
  }
  const int64_t at = (m0 + r) * p.N + index * kPanel;
  float* y = p.y + at;
  if (p.stream && mask == ~__mmask32{0}) {
    _mm512_stream_ps(y, lo);
    _mm512_stream_ps(y + 16, hi);
    return;
  }
  const __mmask16 mask_lo = static_cast<__mmask16>(mask), mask_hi = static_cast<__mmask16>(mask >> 16);
  if (p.residual && add_residual) {
    lo = _mm512_add_ps(lo, _mm512_maskz_loadu_ps(mask_lo, p.residual + at));
    hi = _mm512_add_ps(hi, _mm512_maskz_loadu_ps(mask_hi, p.residual + at + 16));
  }
  _mm512_mask_storeu_ps(y, mask_lo, lo);
  _mm512_mask_storeu_ps(y + 16, mask_hi, hi);
}

// The sums of R rows x panel `index` as they start: its columns' biases (Problem::column_bias), or zero.
template <int R>
__attribute__((always_inline)) inline void start_sums(const Problem& p, int64_t index, __m512 (&lo)[R],
                                                       __m512 (&hi)[R]) {
  const __m512 lo0 = p.column_bias ? _mm512_loadu_ps(p.column_bias + index * kPanel) : _mm512_setzero_ps();
  const __m512 hi0 = p.column_bias ? _mm512_loadu_ps(p.column_bias + index * kPanel + 16) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = lo0, hi[r] = hi0;
}

// One pair of a panel's rows (columns 0-15 in b_lo, 16-31 in b_hi) into R rows' sums: row r's pair of x is
// a[16 r + j] (pair j of the rows' chunk).
template <int R>
__attribute__((always_inline)) inline void multiply_pair(const uint32_t* a, int64_t j, __m512bh b_lo, __m512bh b_hi,
                                                          __m512 (&lo)[R], __m512 (&hi)[R]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[16 * r + j]));
    lo[r] = _mm512_dpbf16_ps(lo[r], x, b_lo);
    hi[r] = _mm512_dpbf16_ps(hi[r], x, b_hi);
  }
}

// Row block [m0, m0 + R) x the 32 columns of panel `index` (masked to the columns below N). `prefetch`, where
// given, is a panel brought towards L2 on the way, two lines per k (a whole panel over one block's K loop).
template <int R>
void block(const Problem& p, int64_t m0, int64_t index, __mmask32 mask, const uint16_t* prefetch) {
  __m512 lo[R], hi[R];
  start_sums<R>(p, index, lo, hi);
  const uint16_t* w = p.w + index * p.K2 * 64;
  const uint32_t* a = p.a + m0 * p.K2p;  // this block's pairs, [K2p / 16][R][16]: one sequential stream
  for (int64_t c = 0; c < p.K2; c += 16, a += 16 * R) {
    const int64_t n = std::min<int64_t>(16, p.K2 - c);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = c + j;
      const __m512bh b_lo = (__m512bh)_mm512_loadu_si512(w + 64 * k);
      const __m512bh b_hi = (__m512bh)_mm512_loadu_si512(w + 64 * k + 32);
      if (prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + 64 * k), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + 64 * k + 32), _MM_HINT_T1);
      }
      multiply_pair<R>(a, j, b_lo, b_hi, lo, hi);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) store_row(p, m0, R, r, index, mask, lo[r], hi[r]);
}

template <int R>
void rows(const Problem& p, int64_t m0, int64_t index, __mmask32 mask, int64_t count, const uint16_t* prefetch) {
  if constexpr (R > 0) {
    if (count == R) return block<R>(p, m0, index, mask, prefetch);
    return rows<R - 1>(p, m0, index, mask, count, prefetch);
  }
}

// The columns of panel `index` below N (all 32 but in a last, partial panel).
inline __mmask32 panel_mask(const Problem& p, int64_t index) {
  const int64_t cols = std::min<int64_t>(kPanel, p.N - index * kPanel);
  return cols == kPanel ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << cols) - 1);
}

// Panel `index` for all rows; the panel `next` (this worker's likely next one, or -1) is prefetched during the
// first row block, so the first block of the next panel does not wait on memory for its weights.
void panel(const Problem& p, int64_t index, int64_t next) {
  const __mmask32 mask = panel_mask(p, index);
  const uint16_t* prefetch = next >= 0 ? p.w + next * p.K2 * 64 : nullptr;
  for (int64_t m0 = 0; m0 < p.M; m0 += p.rows)
    rows<kMaxRows>(p, m0, index, mask, std::min<int64_t>(p.rows, p.M - m0), m0 == 0 ? prefetch : nullptr);
}

// Decodes 16 float8 e4m3 values (bytes) exactly: placed in a float16's sign, the low four bits of its exponent and
// the top three of its mantissa, each is its value / 256 (normal or subnormal alike: both formats' exponents
// differ by that bias), which vcvtph2ps widens; the 256 is in the panel's scales (pack_fp8_panels).
inline __m512 fp8_over_256(__m128i bytes) {
  const __m256i v = _mm256_cvtepu8_epi16(bytes);
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8),
                                       _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_cvtph_ps(half);
}

// int4 and fp8 panels (their values times their group's scales plus biases, float32 [groups, 64]) to bfloat16.
void affine_panel(const Problem& p, const uint8_t* q, const float* scales, uint16_t* panel_w) {
  const __m512i low = _mm512_set1_epi32(0xF);
  for (int64_t g = 0; g < p.groups; ++g) {
    const float* group = scales + g * 64;  // 32 scales, then 32 biases
    const __m512 s[2] = {_mm512_loadu_ps(group), _mm512_loadu_ps(group + 16)};
    const __m512 b[2] = {_mm512_loadu_ps(group + 32), _mm512_loadu_ps(group + 48)};
    for (int64_t k = g * p.group_pairs; k < (g + 1) * p.group_pairs; ++k) {
      for (int h = 0; h < 2; ++h) {  // columns 16h .. 16h + 15
        __m512 even, odd;
        if (p.fp8) {
          const uint8_t* row = q + k * 64 + 16 * h;
          even = _mm512_fmadd_ps(fp8_over_256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))), s[h], b[h]);
          odd = _mm512_fmadd_ps(fp8_over_256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32))), s[h], b[h]);
        } else {
          const __m512i v =
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 32 + 16 * h)));
          even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), s[h], b[h]);
          odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s[h], b[h]);
        }
        const __m512i pairs = _mm512_or_si512(
            _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even)),
            _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd)), 16));
        _mm512_store_si512(panel_w + k * 64 + 32 * h, pairs);
      }
    }
  }
}

// MXFP4 to bfloat16: each byte's two float4 e2m1 codes (low nibble first) are one 32-bit lane, code | code << 12
// as vpermw's indices (its low 5 bits index the first code, the upper word the second: the table of 16 bfloat16
// values is written twice), which looks both values up as one bfloat16 pair at once; the column's power of two
// 2^(e - 127) is then added to each nonzero value's exponent field, exact where no result leaves the normal range
// (e in [2, 252]: e2m1's exponents are 2^-1 .. 2^2). A group with a column outside that range (never seen in a
// checkpoint) is dequantized through float32 instead: vscalefps, exact, then rounded (a float32 subnormal result
// flushes to zero, as the conversion to bfloat16 treats it).
struct Mxfp4 {
  alignas(64) static constexpr uint16_t kTable[32] = {
      0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
      0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
      0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
      0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
  alignas(64) static constexpr float kValues[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                                    -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  const __m512i table = _mm512_load_si512(kTable);
  const __m512 values = _mm512_load_ps(kValues);
  __m512i shift[2];  // a group's exponents (e - 127) << 7 in both words of each column's lane, columns 16h ..
  __m512 power[2];   // and as floats (e - 127)
  bool exact = true;

  // Group g's exponents (32 bytes, one per column); `exact`: whether the exponent-field path is for all of them.
  void group(const uint8_t* exponents) {
    exact = true;
    for (int h = 0; h < 2; ++h) {
      const __m512i e = _mm512_sub_epi32(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(exponents + 16 * h))),
          _mm512_set1_epi32(127));
      exact = exact && _mm512_cmp_epi32_mask(_mm512_abs_epi32(e), _mm512_set1_epi32(125), _MM_CMPINT_LE) == 0xFFFF;
      const __m512i word = _mm512_and_si512(_mm512_slli_epi32(e, 7), _mm512_set1_epi32(0xFFFF));
      shift[h] = _mm512_or_si512(word, _mm512_slli_epi32(word, 16));
      power[h] = _mm512_cvtepi32_ps(e);
    }
  }

  // The bfloat16 pairs of 16 columns (16h ..) of one pair of rows: their 16 code bytes at `codes`.
  __m512i pairs(const uint8_t* codes, int h) const {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    if (exact) {
      const __m512i looked_up = _mm512_permutexvar_epi16(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), table);
      return _mm512_mask_add_epi16(looked_up, _mm512_test_epi16_mask(looked_up, _mm512_set1_epi16(0x7FFF)),
                                   looked_up, shift[h]);
    }
    const __m512 even = _mm512_scalef_ps(_mm512_permutexvar_ps(v, values), power[h]);
    const __m512 odd = _mm512_scalef_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), values), power[h]);
    return _mm512_or_si512(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even)),
                           _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd)), 16));
  }
};

// An MXFP4 panel to a bfloat16 one ([K2, 64], pack_bf16's layout).
void mxfp4_panel(const Problem& p, const uint8_t* q, const uint8_t* exponents, uint16_t* panel_w) {
  Mxfp4 mx;
  for (int64_t g = 0; g < p.groups; ++g) {
    mx.group(exponents + g * 32);
    for (int64_t k = g * p.group_pairs; k < (g + 1) * p.group_pairs; ++k)
      for (int h = 0; h < 2; ++h) _mm512_store_si512(panel_w + k * 64 + 32 * h, mx.pairs(q + k * 32 + 16 * h, h));
  }
}

// A call of one row block (rows <= kMaxRows) x an MXFP4 panel: each pair of the panel's rows is dequantized into
// registers and multiplied at once (the same numbers as dequantized_panel's, without its panel's round trip
// through the cache: one gpt-oss-20b layer's experts, benchmarks/moe_layer.py, 1 token 4.82 -> 2.63 ms, 8 tokens
// 18.6 -> 12.4 ms; bfloat16 experts 6.7 and 20-31 ms).
template <int R>
void mxfp4_block(const Problem& p, int64_t index, __mmask32 mask, const uint8_t* q, const uint8_t* exponents) {
  __m512 lo[R], hi[R];
  start_sums<R>(p, index, lo, hi);
  Mxfp4 mx;
  const uint32_t* a = p.a;  // the one block's pairs, [K2 / 16][R][16]: a group of 16 pairs is a chunk
  for (int64_t g = 0; g < p.groups; ++g, a += 16 * R) {
    mx.group(exponents + g * 32);
    for (int j = 0; j < 16; ++j) {
      const uint8_t* codes = q + (16 * g + j) * 32;
      multiply_pair<R>(a, j, (__m512bh)mx.pairs(codes, 0), (__m512bh)mx.pairs(codes + 16, 1), lo, hi);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) store_row(p, 0, R, r, index, mask, lo[r], hi[r]);
}

template <int R>
void mxfp4_rows(const Problem& p, int64_t index, __mmask32 mask, const uint8_t* q, const uint8_t* exponents) {
  if constexpr (R > 0) {
    if (p.M == R) return mxfp4_block<R>(p, index, mask, q, exponents);
    return mxfp4_rows<R - 1>(p, index, mask, q, exponents);
  }
}

#ifdef JAXENGINE_CPU_TILES
// The tile path, where the CPU has AMX-BF16 (and Linux lets the process use its tile registers): one
// tdpbf16ps multiplies a 16 x 32 bfloat16 tile of x by a 32 x 16 one of w into 16 x 16 float32, 16x the
// multiply-adds of a vdpbf16ps. The layouts are the register path's: a panel's rows of 32 column pairs are
// two tiles of 16 columns side by side (stride 128 bytes), and a 16-row block's chunk of 16 pairs is one
// tile of x (stride 64 bytes). JAXENGINE_CPU_AMX=0 turns it off (the register path then runs).
// Tiles 0-3: the products of two 16-row blocks x the panel's two halves; 4-5: the blocks' x; 6-7: w's halves
// (configure_tiles, cpu_tiles.h).
//
// A pair of blocks x a panel whose products wait in a buffer for their epilogue (the register path's
// store_row), run a few rows at a time inside the next pair's loop of tiles where that pair is not its panel's
// first pass (which streams the weights from memory): the vector epilogue (SwiGLU's exp and division, the
// rounding to pairs) then overlaps the tiles' products instead of following them. Measured on the AMX Xeon, 30
// layers of a 512-row step's matmuls: 61.4-68.3 -> 60.3-62.5 ms against each pair's epilogue right after its
// tiles; 64 rows unchanged within the noise.
struct Pending {
  int64_t m0 = -1, index = 0;
  float (*products)[kPanel] = nullptr;
};

// Block m0's pairs and the stride of its chunks: the padded copy for a short last block (a tile reads 16 rows).
inline const uint32_t* block_pairs(const Problem& p, int64_t m0, int64_t& stride) {
  const int64_t R = std::min<int64_t>(kTileRows, p.M - m0);
  stride = 16 * (R < kTileRows && p.last_block ? kTileRows : R);
  return R < kTileRows && p.last_block ? p.last_block : p.a + m0 * p.K2p;
}

// Rows [begin, end) of a pending unit's 2 x 16 (rows past M skipped): the K past the last whole chunk of 16
// pairs (K2 % 16, on registers: a tile of w would read past the panel), then the epilogue (store_row).
void finish_rows(const Problem& p, const Pending& u, int64_t begin, int64_t end) {
  const __mmask32 mask = panel_mask(p, u.index);
  const uint16_t* w = p.w + u.index * p.K2 * 64;
  const int64_t chunks = p.K2 / 16;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b0 = u.m0 + (i / kTileRows) * kTileRows, r = i % kTileRows;
    if (b0 + r >= p.M) continue;
    const int64_t R = std::min<int64_t>(kTileRows, p.M - b0);
    __m512 lo = _mm512_load_ps(u.products[i]);
    __m512 hi = _mm512_load_ps(u.products[i] + 16);
    if (p.K2 % 16) {
      int64_t stride = 0;
      const uint32_t* a = block_pairs(p, b0, stride);
      for (int64_t k = 16 * chunks; k < p.K2; ++k) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[stride * chunks + 16 * r + k % 16]));
        lo = _mm512_dpbf16_ps(lo, x, (__m512bh)_mm512_loadu_si512(w + 64 * k));
        hi = _mm512_dpbf16_ps(hi, x, (__m512bh)_mm512_loadu_si512(w + 64 * k + 32));
      }
    }
    store_row(p, b0, R, r, u.index, mask, lo, hi, /*add_residual=*/false);
  }
}

// The pair of 16-row blocks from m0 (the second may be short or absent) x panel `index`, on tiles; `next`, a
// panel to prefetch towards L2 on the way (or -1). The residual is the tiles' starting sums (each row's sum in
// one order, whatever its block). Whole panels of whole blocks, with no activation, no K past the chunks and
// no streaming, load it and store the result straight from the tiles to y; the others store their tiles to
// `spare` (the residual's rows copied there first) and become the pending unit, whose epilogue the next unit
// runs; the pending unit before them is finished on the way.
void amx_pair(const Problem& p, int64_t m0, int64_t index, bool first_pass, int64_t next, Pending& pending,
              float (*spare)[kPanel]) {
  const __mmask32 mask = panel_mask(p, index);
  const uint16_t* w = p.w + index * p.K2 * 64;
  const int64_t chunks = p.K2 / 16;
  const bool two = m0 + kTileRows < p.M;
  int64_t stride0 = 0, stride1 = 0;
  const uint32_t* a0 = block_pairs(p, m0, stride0);
  const uint32_t* a1 = two ? block_pairs(p, m0 + kTileRows, stride1) : nullptr;
  const bool direct = !p.gated && !p.stream && mask == ~__mmask32{0} && p.K2 % 16 == 0 &&
                      m0 + (two ? 2 : 1) * kTileRows <= p.M;
  const int64_t row_bytes = 4 * p.N;
  const int64_t at = m0 * p.N + index * kPanel;  // the tiles' first element in y (and the residual)
  if (direct && p.residual) {
    _tile_loadd(0, p.residual + at, row_bytes);
    _tile_loadd(1, p.residual + at + 16, row_bytes);
    if (two) {
      _tile_loadd(2, p.residual + at + kTileRows * p.N, row_bytes);
      _tile_loadd(3, p.residual + at + kTileRows * p.N + 16, row_bytes);
    }
  } else if (p.residual) {
    for (int64_t r = 0; r < 2 * kTileRows; ++r) {
      const bool row = r < (two ? 2 : 1) * kTileRows && m0 + r < p.M;
      const __mmask32 live = row ? mask : 0;
      const float* from = p.residual + (row ? at + r * p.N : 0);
      _mm512_store_ps(spare[r], _mm512_maskz_loadu_ps(static_cast<__mmask16>(live), from));
      _mm512_store_ps(spare[r] + 16, _mm512_maskz_loadu_ps(static_cast<__mmask16>(live >> 16), from + 16));
    }
    _tile_loadd(0, spare[0], 4 * kPanel);
    _tile_loadd(1, spare[0] + 16, 4 * kPanel);
    _tile_loadd(2, spare[kTileRows], 4 * kPanel);
    _tile_loadd(3, spare[kTileRows] + 16, 4 * kPanel);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint16_t* prefetch = next >= 0 ? p.w + next * p.K2 * 64 : nullptr;
  if (pending.m0 >= 0 && first_pass) {  // a panel's first pass streams its weights from memory: no epilogue there
    finish_rows(p, pending, 0, 2 * kTileRows);
    pending.m0 = -1;
  }
  // The pending unit's rows, a few with each chunk of this one's.
  const int64_t per_chunk = pending.m0 >= 0 ? (2 * kTileRows + chunks - 1) / std::max<int64_t>(chunks, 1) : 0;
  int64_t finished = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    if (prefetch)  // the same rows of the next panel, 16 x 128 bytes, towards L2 (T1)
      for (int line = 0; line < 32; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + 16 * 64 * c + 32 * line), _MM_HINT_T1);
    _tile_loadd(6, w + 16 * 64 * c, 128);
    _tile_loadd(7, w + 16 * 64 * c + 32, 128);
    _tile_loadd(4, a0 + stride0 * c, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a1 + stride1 * c, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (finished < 2 * kTileRows && per_chunk) {
      const int64_t upto = std::min<int64_t>(2 * kTileRows, finished + per_chunk);
      finish_rows(p, pending, finished, upto);
      finished = upto;
    }
  }
  if (pending.m0 >= 0) finish_rows(p, pending, finished, 2 * kTileRows);
  pending.m0 = -1;
  if (direct) {
    _tile_stored(0, p.y + at, row_bytes);
    _tile_stored(1, p.y + at + 16, row_bytes);
    if (two) {
      _tile_stored(2, p.y + at + kTileRows * p.N, row_bytes);
      _tile_stored(3, p.y + at + kTileRows * p.N + 16, row_bytes);
    }
    return;
  }
  _tile_stored(0, spare[0], 4 * kPanel);
  _tile_stored(1, spare[0] + 16, 4 * kPanel);
  if (two) {
    _tile_stored(2, spare[kTileRows], 4 * kPanel);
    _tile_stored(3, spare[kTileRows] + 16, 4 * kPanel);
  }
  pending = Pending{m0, index, spare};
}

// Rows [r0, r1) (whole pairs of blocks but at M) x panels [q0, q1): a pair of blocks outer, its x tiles staying
// in L1 across the panels, whose weights stay in L2 across the pairs. The first pair's pass over each panel
// prefetches the panel after it, the last one `next` (the worker's likely next item's first panel, or -1).
void amx_item(const Problem& p, int64_t r0, int64_t r1, int64_t q0, int64_t q1, int64_t next) {
  alignas(64) float products[2][2 * kTileRows][kPanel];
  Pending pending;
  int turn = 0;
  for (int64_t m0 = r0; m0 < r1; m0 += 2 * kTileRows)
    for (int64_t q = q0; q < q1; ++q, turn ^= 1)
      amx_pair(p, m0, q, m0 == r0, m0 != r0 ? -1 : q + 1 < q1 ? q + 1 : next, pending, products[turn]);
  if (pending.m0 >= 0) finish_rows(p, pending, 0, 2 * kTileRows);
}
#endif  // JAXENGINE_CPU_TILES

inline void store_bf16(uint16_t* out, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

inline __m512 load_masked(const float* x, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << n) - 1), x);
}

// Row m of x after the prologue, rounded to bfloat16 (to nearest even) as pairs, chunk c of 16 pairs (32
// values) at out + c * stride (zero past K).
void round_row(const Input& in, int64_t m, uint32_t* out, int64_t stride) {
  const float* src = in.x + m * in.K;
  const int64_t K = in.K;
  __m512 scale = _mm512_set1_ps(1.f);
  if (in.prologue == kRmsNorm) {
    __m512 squares = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = load_masked(src + k, K - k);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(K);
    scale = _mm512_set1_ps(1.f / std::sqrt(mean + in.eps));
  }
  auto value = [&](int64_t k) {  // 16 values of the row from column k (zero past K)
    const __m512 v = load_masked(src + k, K - k);
    if (in.prologue == kRmsNorm) return _mm512_mul_ps(load_masked(in.norm + k, K - k), _mm512_mul_ps(v, scale));
    return v;
  };
  for (int64_t k = 0; k < K; k += 32, out += stride)
    store_bf16(reinterpret_cast<uint16_t*>(out), value(k), K - k > 16 ? value(k + 16) : _mm512_setzero_ps());
}

// Rounds the rows [m0, m0 + R) of row block `index` into their pairs, laid out [K2p / 16][R][16] at
// a + m0 * K2p: each chunk of a row is one vector store, and a register block reads its rows as one
// sequential stream.
void round_block(const Input& in, const Problem& p, int64_t index) {
  const int64_t m0 = index * p.rows, R = std::min<int64_t>(p.rows, p.M - m0);
  uint32_t* a = in.pairs + m0 * p.K2p;
  for (int64_t r = 0; r < R; ++r) round_row(in, m0 + r, a + 16 * r, 16 * R);
}

}  // namespace
#endif  // JAXENGINE_MATMUL_AVX512

#ifdef JAXENGINE_MATMUL_AVX2
#include "cpu_matmul_avx2.h"
#endif

#if defined(JAXENGINE_MATMUL_AVX512) || defined(JAXENGINE_MATMUL_AVX2)
namespace {

// Weight-only quantized: panel `index` dequantized into a bfloat16 panel of this thread's ([K2, 64], pack_bf16's
// layout: each value times its group's scale plus its group's bias (int4: -zero point x scale), exact in float32,
// then rounded; MXFP4's: mxfp4_panel), then multiplied as a bfloat16 one (all rows: once per call).
void dequantized_panel(const Problem& p, int64_t index) {
  const int64_t width = p.fp8 ? 64 : 32;  // bytes of a panel's pair of rows
  const uint8_t* q = p.quant + index * p.K2 * width;
#ifdef JAXENGINE_MATMUL_AVX512
  if (p.exponents && p.M <= kMaxRows)  // one row block: the panel dequantized in registers as it is multiplied
    return mxfp4_rows<kMaxRows>(p, index, panel_mask(p, index), q, p.exponents + index * p.groups * 32);
#endif
  thread_local std::vector<uint16_t> buffer;
  buffer.resize(static_cast<size_t>(p.K2 * 64) + 32);
  uint16_t* panel_w = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
  if (p.exponents) {
    mxfp4_panel(p, q, p.exponents + index * p.groups * 32, panel_w);
  } else {
    affine_panel(p, q, p.quant_scale + index * p.groups * 64, panel_w);
  }
  Problem one = p;
  // block() reads panel `index` at w + index * K2 * 64: point that at this thread's panel
  one.w = reinterpret_cast<const uint16_t*>(reinterpret_cast<uintptr_t>(panel_w) -
                                             index * p.K2 * 64 * sizeof(uint16_t));
  panel(one, index, -1);
}

// Two phases shared between the caller and XLA's intra-op pool: row blocks are rounded (with the prologue),
// then, once every row block is done, items (panels, or row groups x panel groups: plan) are computed.
// Workers take row blocks and items from both ends, in turn one from the front and the next from the back, so
// each walks the weights in address order and knows its likely next panel to prefetch (and, with row groups,
// mostly multiplies rows it rounded itself). Measured in one process against taking panels in turn from the
// front: a decode step's matmuls 3-7% faster at 64 rows, 4-7% at one row, within 1% at 128 and 512.
struct Shared {
  Problem problem;
  Input input;
  int64_t row_blocks = 0, items = 0;
  // Items: row groups of group_rows x groups of group_panels panels, item i = (i / panel_groups,
  // i % panel_groups). Without groups (kGroupMinRows): all rows and one panel an item.
  int64_t panels = 0, group_rows = 0, group_panels = 1, panel_groups = 0;

  void plan(int64_t count) {
    const Problem& p = problem;
    panels = panel_groups = items = count;
    group_rows = p.M;
    group_panels = 1;
    const int64_t panel_bytes = p.K2 * 128;
    if (!p.amx || p.M < kGroupMinRows || panels * panel_bytes > 2 * p.M * p.K2p * 4) return;
    const int64_t per_group = std::max<int64_t>(1, kGroupWeightBytes / panel_bytes);
    group_rows = kGroupRows;
    group_panels = (panels + (panels + per_group - 1) / per_group - 1) / ((panels + per_group - 1) / per_group);
    panel_groups = (panels + group_panels - 1) / group_panels;  // as even as can be
    items = (p.M + group_rows - 1) / group_rows * panel_groups;
  }
  std::atomic<int64_t> blocks_done{0}, done{0};
  std::atomic<uint64_t> blocks_taken{0}, items_taken{0};
  std::atomic<int> workers{0};

  // The next of `count` from the front (or the back) of `taken` (taken from the front | from the back << 32),
  // or -1 once all are taken.
  static int64_t take(std::atomic<uint64_t>& taken, int64_t count, bool from_back) {
    uint64_t t = taken.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(t & 0xffffffffu), back = static_cast<int64_t>(t >> 32);
      if (front + back >= count) return -1;
      if (taken.compare_exchange_weak(t, from_back ? t + (uint64_t{1} << 32) : t + 1, std::memory_order_relaxed))
        return from_back ? count - 1 - back : front;
    }
  }

  void work() {
    const bool from_back = workers.fetch_add(1) % 2 == 1;
    for (int64_t i; (i = take(blocks_taken, row_blocks, from_back)) >= 0;) {
      round_block(input, problem, i);
      blocks_done.fetch_add(1, std::memory_order_release);
    }
    while (blocks_done.load(std::memory_order_acquire) < row_blocks) _mm_pause();  // taken blocks finish
#ifdef JAXENGINE_CPU_TILES
    bool tiles = false;
#endif
    for (int64_t i; (i = take(items_taken, items, from_back)) >= 0;) {
      const int64_t next = from_back ? i - 1 : i + 1;
      if (problem.quant) {
        dequantized_panel(problem, i);
      } else if (!problem.amx) {
        panel(problem, i, next >= 0 && next < items ? next : -1);
      } else {
#ifdef JAXENGINE_CPU_TILES  // (amx is never set without tiles)
        if (!tiles) configure_tiles(), tiles = true;
        const int64_t rg = i / panel_groups, pg = i % panel_groups;
        const int64_t q0 = pg * group_panels, q1 = std::min(panels, q0 + group_panels);
        const int64_t r0 = rg * group_rows, r1 = std::min(problem.M, r0 + group_rows);
        const int64_t after = next >= 0 && next < items ? (next % panel_groups) * group_panels : -1;
        amx_item(problem, r0, r1, q0, q1, after);
#endif
      }
      if (problem.stream) _mm_sfence();  // the stream stores are visible before the panel counts as done
      done.fetch_add(1, std::memory_order_release);
    }
#ifdef JAXENGINE_CPU_TILES
    if (tiles) _tile_release();
#endif
  }
};

// One matmul of `live` rows (rows past them are the caller's to zero): x's rows (f32 [live, K], or u32 pairs
// by row block when `rounded`) by the packed weight `w` ([P, K2, 64]) into y ([live, N] f32, or the gated
// pairs [live, gated_K2p] when `gated`), the residual added where given.
void run_matmul(ffi::ThreadPool& pool, const void* x, bool rounded, int64_t live, const uint16_t* w, int64_t P,
                int64_t K2, int64_t K, int64_t N, void* y, int32_t epilogue, const float* residual,
                int32_t prologue, const float* norm, float eps, const uint8_t* quant = nullptr,
                const float* quant_scale = nullptr, int64_t groups = 0, bool fp8 = false,
                const uint8_t* exponents = nullptr, const float* column_bias = nullptr) {
  const bool gated = epilogue != kStore;
  const int64_t K2p = (K2 + 15) / 16 * 16, gated_K2p = (N / 4 + 15) / 16 * 16;
  auto shared = std::make_shared<Shared>();
  // The rounded rows, on whole cache lines: each chunk of a row is one 64-byte store, and none splits
  // across two lines (a vector's data is only 16-byte aligned). Measured: a 64-row o projection's rounding
  // phase 7.3-8.3 -> 5.3-5.4 us; in one process, chains of 64-row calls 0.98-0.985x.
  // On the tile path, a tile of the last block reads 16 rows: past its end where it has fewer, into the slack
  // (16 rows more) of this buffer, or, for pairs from XLA, a copy padded to 16 rows (`padded`).
  const bool amx = live >= kTileMinRows && amx_enabled() && quant == nullptr;  // weight-only: the register path
  thread_local std::vector<uint32_t> buffer, padded;
  // The AVX2 path widens pairs from XLA into it too (kWidened: two float32 a pair), so it always rounds.
  const bool rounding = !rounded || kWidened;
  if (rounding) buffer.resize(static_cast<size_t>((live + (amx ? kTileRows : 0)) * K2p * (kWidened ? 2 : 1)) + 16);
  uint32_t* pairs = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
  const uint32_t* a = rounded ? static_cast<const uint32_t*>(x) : pairs;
  const int64_t rows = block_rows(live, amx);
  const uint32_t* last_block = nullptr;
  if (amx && rounded && live % kTileRows) {
    const int64_t m0 = live / kTileRows * kTileRows, R = live - m0;
    padded.assign(static_cast<size_t>(kTileRows * K2p), 0);
    for (int64_t c = 0; c < K2p / 16; ++c)
      std::memcpy(padded.data() + c * 16 * kTileRows, a + m0 * K2p + c * 16 * R, 4 * 16 * R);
    last_block = padded.data();
  }
  shared->problem = Problem{a, w, gated ? nullptr : static_cast<float*>(y), residual,
                            gated ? static_cast<uint32_t*>(y) : nullptr, live, N, K2, K2p, rows, gated_K2p};
  shared->problem.amx = amx;
  shared->problem.activation = epilogue;  // a gated epilogue's code is its activation's
  shared->problem.last_block = last_block;
  shared->problem.quant = quant;
  shared->problem.quant_scale = quant_scale;
  shared->problem.fp8 = fp8;
  shared->problem.groups = groups;
  shared->problem.group_pairs = groups ? K2 / groups : 0;
  shared->problem.exponents = exponents;
  shared->problem.column_bias = column_bias;
  shared->problem.widened = kWidened ? reinterpret_cast<const float*>(pairs) : nullptr;
  // A result too large for the cache (an output head's logits: 12.6 MB for 64 rows of a 49152-token
  // vocabulary) is streamed to memory, not read in first: a head call and the argmax after it 9.22 -> 8.83 ms
  // (eight alternations in one process). At 32 rows (6.3 MB) and fewer, streaming was no faster or slower.
  // Full panels only (a stream store has no mask), and whole rows on cache lines.
  shared->problem.stream = !gated && residual == nullptr && 4 * live * N >= kStreamBytes && N % 16 == 0 &&
                           reinterpret_cast<uintptr_t>(y) % 64 == 0;
  shared->input = Input{rounded ? nullptr : static_cast<const float*>(x), K, prologue, norm, eps, pairs};
  shared->row_blocks = rounding ? (live + rows - 1) / rows : 0;
  shared->plan(P);
  // The buffer of pairs is the caller's: it outlives every taken block and panel (a helper that starts late
  // takes none and never reads it).
  share_work(pool, shared, shared->items);
}

// The checks shared by both handlers: returns (through the references) K2, K, N, and whether x is rounded
// pairs and y gated pairs, for x [M, K] (or pairs), one packed weight's dims w_dims [P, K2, 64], y [M, width].
ffi::Error check_shapes(const ffi::AnyBuffer& x, const int64_t* w_dims, ffi::Result<ffi::AnyBuffer>& y,
                        int32_t prologue, int32_t epilogue, size_t norm_size, int64_t& K2, int64_t& K, int64_t& N,
                        bool& rounded, bool& gated) {
  const auto x_dims = x.dimensions();
  const auto y_dims = y->dimensions();
  if (prologue < kPlain || prologue > kRounded) return ffi::Error::InvalidArgument("cpu matmul: unknown prologue");
  if (epilogue < kStore || epilogue > kGatedPairsSwigluOai)
    return ffi::Error::InvalidArgument("cpu matmul: unknown epilogue");
  rounded = prologue == kRounded, gated = epilogue != kStore;
  if (x.element_type() != (rounded ? ffi::U32 : ffi::F32) || y->element_type() != (gated ? ffi::U32 : ffi::F32))
    return ffi::Error::InvalidArgument("cpu matmul: x (y) must be float32, or uint32 pairs for rounded (gated_pairs)");
  K2 = w_dims[1];
  const int64_t K2p = (K2 + 15) / 16 * 16;
  K = rounded ? 2 * K2 : x_dims[1];
  N = gated ? w_dims[0] * kPanel : y_dims[1];
  const int64_t gated_K2p = (N / 4 + 15) / 16 * 16;
  if ((rounded ? x_dims[1] != K2p : K2 != (K + 1) / 2) || (!gated && w_dims[0] != (N + kPanel - 1) / kPanel))
    return ffi::Error::InvalidArgument("cpu matmul: the packed weight's shape does not match x's K and y's N");
  if (gated && y_dims[1] != gated_K2p)
    return ffi::Error::InvalidArgument("cpu matmul: gated pairs must be [M, N / 4 rounded up to 16]");
  if (prologue == kRmsNorm && norm_size != static_cast<size_t>(K))
    return ffi::Error::InvalidArgument("cpu matmul: the norm weight must have x's K elements");
  return ffi::Error::Success();
}

// What Matmul and MatmulDequant share once the weight is located (one layer's dims w_dims, as bfloat16 panels
// [P, K2, 64]; `w`, or the quantized panels and their scales): the shapes checked, y's rows from `live` on (a bucket's
// padding tokens) zeroed, and the rows before it computed.
ffi::Error checked_matmul(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const int64_t* w_dims, const uint16_t* w,
                          const ffi::Buffer<ffi::F32>& norm, const ffi::Buffer<ffi::F32>& residual,
                          const ffi::Buffer<ffi::S32>& live_rows, ffi::Result<ffi::AnyBuffer>& y, int32_t prologue,
                          int32_t epilogue, float eps, const uint8_t* quant = nullptr,
                          const float* quant_scale = nullptr, int64_t groups = 0, bool fp8 = false) {
  int64_t K2, K, N;
  bool rounded, gated;
  if (auto error = check_shapes(x, w_dims, y, prologue, epilogue, norm.element_count(), K2, K, N, rounded, gated);
      error.failure())
    return error;
  const int64_t M = x.dimensions()[0];
  const bool add = residual.element_count() > 0;
  if (add && (gated || residual.dimensions().size() != 2 || residual.dimensions()[0] != M ||
              residual.dimensions()[1] != N))
    return ffi::Error::InvalidArgument("cpu matmul: the residual must be [M, N] (or empty), and none with gated pairs");
  if (live_rows.element_count() != 1)
    return ffi::Error::InvalidArgument("cpu matmul: live_rows must hold one count");
  const int64_t live = std::clamp<int64_t>(live_rows.typed_data()[0], 0, M);
  const int64_t width = y->dimensions()[1];
  std::memset(static_cast<char*>(y->untyped_data()) + 4 * live * width, 0, 4 * (M - live) * width);
  if (live == 0 || N == 0) return ffi::Error::Success();
  run_matmul(pool, x.untyped_data(), rounded, live, w, w_dims[0], K2, K, N, y->untyped_data(), epilogue,
             add ? residual.typed_data() : nullptr, prologue, norm.typed_data(), eps, quant, quant_scale, groups, fp8);
  return ffi::Error::Success();
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::BF16> stacked, ffi::Buffer<ffi::S32> layer,
                  ffi::Buffer<ffi::F32> norm, ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::S32> live_rows,
                  ffi::Result<ffi::AnyBuffer> y, int32_t prologue, int32_t epilogue, float eps) {
  const auto x_dims = x.dimensions();
  const auto s_dims = stacked.dimensions();
  const auto y_dims = y->dimensions();
  // The weight is one packed [P, K2, 64], or layer `layer` of a stack of them [L, P, K2, 64] (a scanned layer
  // loop's stacked weight, read in place: no slice of it is copied out).
  if (x_dims.size() != 2 || (s_dims.size() != 3 && s_dims.size() != 4) || y_dims.size() != 2 ||
      s_dims.back() != 2 * kPanel || y_dims[0] != x_dims[0])
    return ffi::Error::InvalidArgument("cpu matmul: x must be [M, K], w packed [(L,) P, K2, 64] and y [M, N]");
  if (layer.element_count() != 1) return ffi::Error::InvalidArgument("cpu matmul: layer must hold one index");
  const int64_t layers = s_dims.size() == 4 ? s_dims[0] : 1, index = layer.typed_data()[0];
  if (index < 0 || index >= layers)
    return ffi::Error::InvalidArgument("cpu matmul: the layer index is outside the stacked weight");
  const int64_t* w_dims = s_dims.begin() + (s_dims.size() - 3);  // one layer's [P, K2, 64]
  const uint16_t* w =
      reinterpret_cast<const uint16_t*>(stacked.typed_data()) + index * w_dims[0] * w_dims[1] * 2 * kPanel;
  return checked_matmul(pool, x, w_dims, w, norm, residual, live_rows, y, prologue, epilogue, eps);
}

// Weight-only quantized: x as for Matmul by a weight of int4 or float8 values with group scales (and biases)
// (Problem::quant): panels [P, K2, 32] (int4) or [P, K2, 64] (fp8) uint8, or a stack of them [L, P, K2, ..]
// (layer `layer`, read in place), scales and biases [(L,) P, groups, 64] float32. Each panel is dequantized to
// bfloat16 as it is taken, then multiplied as Matmul multiplies (prologues and epilogues alike).
ffi::Error MatmulDequant(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> stacked,
                         ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> norm,
                         ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::S32> live_rows, ffi::Result<ffi::AnyBuffer> y,
                         int32_t prologue, int32_t epilogue, float eps) {
  const auto x_dims = x.dimensions();
  const auto s_dims = stacked.dimensions();
  const auto c_dims = scale.dimensions();
  const auto y_dims = y->dimensions();
  if (x_dims.size() != 2 || (s_dims.size() != 3 && s_dims.size() != 4) || c_dims.size() != s_dims.size() ||
      y_dims.size() != 2 || (s_dims.back() != kPanel && s_dims.back() != 2 * kPanel) ||
      c_dims.back() != 2 * kPanel || y_dims[0] != x_dims[0])
    return ffi::Error::InvalidArgument("cpu dequantizing matmul: x must be [M, K], w packed [(L,) P, K2, 32] (int4) "
                                       "or [(L,) P, K2, 64] (fp8), its scales and biases [(L,) P, groups, 64] and "
                                       "y [M, N]");
  if (layer.element_count() != 1)
    return ffi::Error::InvalidArgument("cpu dequantizing matmul: layer must hold one index");
  const int64_t layers = s_dims.size() == 4 ? s_dims[0] : 1, index = layer.typed_data()[0];
  if (index < 0 || index >= layers)
    return ffi::Error::InvalidArgument("cpu dequantizing matmul: the layer index is outside the stacked weight");
  const int64_t P = s_dims[s_dims.size() - 3], K2_given = s_dims[s_dims.size() - 2], width = s_dims.back();
  const int64_t groups = c_dims[c_dims.size() - 2];
  if (c_dims[c_dims.size() - 3] != P || (layers > 1 && c_dims[0] != layers) || groups < 1 || K2_given % groups)
    return ffi::Error::InvalidArgument("cpu dequantizing matmul: the scales must be [(L,) P, groups, 64], groups "
                                       "dividing K2");
  const int64_t w_dims[3] = {P, K2_given, 2 * kPanel};  // the bfloat16 panels it dequantizes to
  return checked_matmul(pool, x, w_dims, nullptr, norm, residual, live_rows, y, prologue, epilogue, eps,
                        stacked.typed_data() + index * P * K2_given * width,
                        scale.typed_data() + index * P * groups * 2 * kPanel, groups, width == 2 * kPanel);
}

// Runs a grouped matmul's groups: x's rows sorted by group (f32 [M, x_width], or u32 pairs), group g's sizes[g]
// rows (in order) by `one(g, x rows, y rows, rows)`; a group without rows runs nothing; y's rows past the sizes'
// sum are zeroed.
template <typename One>
void run_groups(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& sizes, ffi::Result<ffi::AnyBuffer>& y,
                One one) {
  const int64_t groups = sizes.element_count(), M = x.dimensions()[0];
  const int64_t x_width = x.dimensions()[1], width = y->dimensions()[1];  // x: floats, or pair words when rounded
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = std::clamp<int64_t>(sizes.typed_data()[g], 0, M - row);
    if (rows == 0) continue;
    one(g, static_cast<const char*>(x.untyped_data()) + 4 * row * x_width,
        static_cast<char*>(y->untyped_data()) + 4 * row * width, rows);
    row += rows;
  }
  std::memset(static_cast<char*>(y->untyped_data()) + 4 * row * width, 0, 4 * (M - row) * width);
}

// A mixture of experts' grouped matmul: x's rows sorted by expert, group g (sizes[g] rows, in order) by the
// packed weight first + g of the stack [G, P, K2, 64] (a layer's experts: first = layer * experts). Each
// group runs as one matmul of its rows (their pairs and gated pairs laid out by that group's row blocks, so
// a rounded x and the gated pairs of the same groups agree); a group without rows reads no weight. Rows past
// the groups' sum are zero.
ffi::Error GroupedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::BF16> stacked,
                         ffi::Buffer<ffi::S32> first, ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::F32> norm,
                         ffi::Result<ffi::AnyBuffer> y, int32_t prologue, int32_t epilogue, float eps) {
  const auto x_dims = x.dimensions();
  const auto s_dims = stacked.dimensions();
  const auto y_dims = y->dimensions();
  if (x_dims.size() != 2 || s_dims.size() != 4 || y_dims.size() != 2 || s_dims.back() != 2 * kPanel ||
      y_dims[0] != x_dims[0])
    return ffi::Error::InvalidArgument("cpu grouped matmul: x must be [M, K], w packed [G, P, K2, 64] and y [M, N]");
  const int64_t* w_dims = s_dims.begin() + 1;
  int64_t K2, K, N;
  bool rounded, gated;
  if (auto error = check_shapes(x, w_dims, y, prologue, epilogue, norm.element_count(), K2, K, N, rounded, gated);
      error.failure())
    return error;
  if (first.element_count() != 1 || first.typed_data()[0] < 0 || first.typed_data()[0] + sizes.element_count() >
                                                                      s_dims[0])
    return ffi::Error::InvalidArgument("cpu grouped matmul: the groups' weights are outside the stack");
  const int64_t weight_size = w_dims[0] * K2 * 2 * kPanel;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(stacked.typed_data()) + first.typed_data()[0] * weight_size;
  run_groups(x, sizes, y, [&](int64_t g, const char* x_rows, char* y_rows, int64_t rows) {
    run_matmul(pool, x_rows, rounded, rows, w + g * weight_size, w_dims[0], K2, K, N, y_rows, epilogue, nullptr,
               prologue, norm.typed_data(), eps);
  });
  return ffi::Error::Success();
}

// GroupedMatmul over MXFP4 weights (GPT-OSS's experts as the hub ships them): group g's weight is first + g of
// a stack of float4 e2m1 codes [G, P, K2, 32] (int4 panels' layout: a byte holds a column's two consecutive
// values, the first in its low nibble) and their powers of two, E8M0 bytes [G, P, K2 / 16, 32] (one per column
// and 32 inputs), with a float32 bias [G, P * 32] added to each column's products (or none: empty). Each panel
// is dequantized exactly to bfloat16 as it is taken (mxfp4_panel; a group of one row block's rows: in registers,
// mxfp4_block), then multiplied as GroupedMatmul multiplies.
ffi::Error GroupedMatmulMxfp4(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> codes,
                              ffi::Buffer<ffi::U8> exponents, ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> first,
                              ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::AnyBuffer> y, int32_t prologue,
                              int32_t epilogue) {
  const auto x_dims = x.dimensions();
  const auto c_dims = codes.dimensions();
  const auto e_dims = exponents.dimensions();
  const auto y_dims = y->dimensions();
  if (x_dims.size() != 2 || c_dims.size() != 4 || c_dims.back() != kPanel || y_dims.size() != 2 ||
      y_dims[0] != x_dims[0] || e_dims.size() != 4 || e_dims[0] != c_dims[0] || e_dims[1] != c_dims[1] ||
      e_dims[2] * 16 != c_dims[2] || e_dims[3] != kPanel)
    return ffi::Error::InvalidArgument("cpu MXFP4 grouped matmul: x must be [M, K], the codes [G, P, K2, 32], their "
                                       "exponents [G, P, K2 / 16, 32] and y [M, N]");
  const int64_t S = c_dims[0], P = c_dims[1], groups = e_dims[2];
  const bool biased = bias.element_count() > 0;
  if (biased && (bias.dimensions().size() != 2 || bias.dimensions()[0] != S || bias.dimensions()[1] != P * kPanel))
    return ffi::Error::InvalidArgument("cpu MXFP4 grouped matmul: the bias must be [G, P * 32] (or empty)");
  if (prologue == kRmsNorm) return ffi::Error::InvalidArgument("cpu MXFP4 grouped matmul: no rms_norm prologue");
  const int64_t w_dims[3] = {P, c_dims[2], 2 * kPanel};  // the bfloat16 panels it dequantizes to
  int64_t K2, K, N;
  bool rounded, gated;
  if (auto error = check_shapes(x, w_dims, y, prologue, epilogue, 0, K2, K, N, rounded, gated); error.failure())
    return error;
  if (first.element_count() != 1 || first.typed_data()[0] < 0 || first.typed_data()[0] + sizes.element_count() > S)
    return ffi::Error::InvalidArgument("cpu MXFP4 grouped matmul: the groups' weights are outside the stack");
  const int64_t at = first.typed_data()[0];
  run_groups(x, sizes, y, [&](int64_t g, const char* x_rows, char* y_rows, int64_t rows) {
    run_matmul(pool, x_rows, rounded, rows, nullptr, P, K2, K, N, y_rows, epilogue, nullptr, prologue, nullptr, 0.f,
               codes.typed_data() + (at + g) * P * K2 * kPanel, nullptr, groups, false,
               exponents.typed_data() + (at + g) * P * groups * kPanel,
               biased ? bias.typed_data() + (at + g) * P * kPanel : nullptr);
  });
  return ffi::Error::Success();
}

}  // namespace

#else  // neither AVX-512 BF16 nor AVX2: cpu.py never calls these (matmul_available() is False); kept for a clear error

namespace {
constexpr const char* kNoPath = "cpu matmul: this CPU (or compiler) has neither AVX-512 BF16 nor AVX2";
ffi::Error MatmulDequant(ffi::ThreadPool, ffi::AnyBuffer, ffi::Buffer<ffi::U8>, ffi::Buffer<ffi::F32>,
                         ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::S32>,
                         ffi::Result<ffi::AnyBuffer>, int32_t, int32_t, float) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, kNoPath);
}
ffi::Error Matmul(ffi::ThreadPool, ffi::AnyBuffer, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::F32>,
                  ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::S32>, ffi::Result<ffi::AnyBuffer>, int32_t, int32_t, float) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, kNoPath);
}
ffi::Error GroupedMatmul(ffi::ThreadPool, ffi::AnyBuffer, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::S32>,
                         ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::F32>, ffi::Result<ffi::AnyBuffer>, int32_t, int32_t,
                         float) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, kNoPath);
}
ffi::Error GroupedMatmulMxfp4(ffi::ThreadPool, ffi::AnyBuffer, ffi::Buffer<ffi::U8>, ffi::Buffer<ffi::U8>,
                              ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>,
                              ffi::Result<ffi::AnyBuffer>, int32_t, int32_t) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, kNoPath);
}
}  // namespace

#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuMatmulBf16, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // x f32 [M, K] (u32 [M, K2p] pairs: rounded)
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // w packed [P, K2, 64] or stacked [L, P, K2, 64]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // layer i32[1]: the stack's layer (0 for 3-D w)
                                  .Arg<ffi::Buffer<ffi::F32>>()    // norm weight [K] (kRmsNorm; else empty)
                                  .Arg<ffi::Buffer<ffi::F32>>()    // residual [M, N] added to y (or empty)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // live_rows i32[1]: rows past it are zero
                                  .Ret<ffi::AnyBuffer>()           // y f32 [M, N] (u32 pairs: gated_pairs)
                                  .Attr<int32_t>("prologue")
                                  .Attr<int32_t>("epilogue")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuMatmulDequant, MatmulDequant,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // x f32 [M, K] (u32 [M, K2p] pairs: rounded)
                                  .Arg<ffi::Buffer<ffi::U8>>()     // w [P, K2, 32 or 64] or stacked [L, P, K2, ..]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scales, biases [(L,) P, groups, 64]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // layer i32[1]: the stack's layer (0 for 3-D w)
                                  .Arg<ffi::Buffer<ffi::F32>>()    // norm weight [K] (kRmsNorm; else empty)
                                  .Arg<ffi::Buffer<ffi::F32>>()    // residual [M, N] added to y (or empty)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // live_rows i32[1]: rows past it are zero
                                  .Ret<ffi::AnyBuffer>()           // y f32 [M, N] (u32 pairs: gated_pairs)
                                  .Attr<int32_t>("prologue")
                                  .Attr<int32_t>("epilogue")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuGroupedMatmulBf16, GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // x f32 [M, K] sorted by group (u32 pairs: rounded)
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // w packed, stacked [G, P, K2, 64]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // first i32[1]: the first group's weight
                                  .Arg<ffi::Buffer<ffi::S32>>()    // sizes i32[groups]: each group's rows, in order
                                  .Arg<ffi::Buffer<ffi::F32>>()    // norm weight [K] (kRmsNorm; else empty)
                                  .Ret<ffi::AnyBuffer>()           // y f32 [M, N] (u32 pairs: gated_pairs)
                                  .Attr<int32_t>("prologue")
                                  .Attr<int32_t>("epilogue")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuGroupedMatmulMxfp4, GroupedMatmulMxfp4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // x f32 [M, K] sorted by group (u32 pairs: rounded)
                                  .Arg<ffi::Buffer<ffi::U8>>()     // codes [G, P, K2, 32]: float4 e2m1 pairs
                                  .Arg<ffi::Buffer<ffi::U8>>()     // exponents [G, P, K2 / 16, 32]: E8M0
                                  .Arg<ffi::Buffer<ffi::F32>>()    // bias [G, P * 32] (or empty)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // first i32[1]: the first group's weight
                                  .Arg<ffi::Buffer<ffi::S32>>()    // sizes i32[groups]: each group's rows, in order
                                  .Ret<ffi::AnyBuffer>()           // y f32 [M, N] (u32 pairs: gated_pairs)
                                  .Attr<int32_t>("prologue")
                                  .Attr<int32_t>("epilogue"));

// Whether matmuls run on the tile path here (cpu.matmul_tiles()).
extern "C" int JaxengineCpuMatmulTiles() { return amx_enabled() ? 1 : 0; }
