// Ragged paged attention for XLA:CPU, called through the XLA FFI (see cpu.py, which builds and registers it).
//
// Same contract as reference.py: q [T, Hq, D] (float32), the whole paged pool [L, P, S, 2*Hkv, D] (float32,
// bfloat16, or float8 e4m3fn or e5m2) with K and V interleaved on the head axis (row 2h is head h's K, 2h+1 its V),
// read in place at `layer`. Work items are (request, tile of up to kTileTokens query tokens), a long range of keys
// split among several where a call has few items (split_items); each walks its request's keys a window at a time
// (blocks of 16 keys, the softmax's maximum and sum updated once per window), so every key's K/V row is read from
// memory once per item straight from its page. Items are shared between the caller and XLA's intra-op thread pool.
// WriteKv, the companion, writes a step's K/V rows in place.
//
// Compute is float32. With a known head_dim (64, 128, 256) the 16 scores of a row are one vector (a
// transposing reduction of 16 partial-sum vectors; for many rows, K transposed once per block). Where the CPU
// has AVX-512 BF16, bfloat16 pages are scored by vdpbf16ps against q rounded to bfloat16, and their values
// weighted by vdpbf16ps with the softmax weights rounded to bfloat16 (as transformers rounds a bfloat16
// model's probabilities); elsewhere (and for other head_dims) bfloat16 pages are widened to float32. float8
// pages are widened to bfloat16 (exactly) a window of keys at a time and then computed on as bfloat16 pages are
// (for other head_dims: widened to float32 as they are read). Where the CPU has AVX2 and FMA but no AVX-512
// (JAXENGINE_ATTENTION_AVX2), the known head_dims run on 256-bit registers: up to 4 rows scored at once, each
// key's row widened once for all of them (block_scores_rows), and their values 16 dimensions at a time
// (accumulate_window). Measured on a 2-core Zen 3 EPYC, llama-135m's heads (9 of 64, 3 kv heads), bfloat16 pages,
// per layer: 64 decode requests x 192 keys 3.4 -> 1.1-1.3 ms, 4 x 128-token prefill 9.1 -> 1.2-1.6 ms against
// the 16-lane code (whose selects and reductions GCC splits into 128-bit pieces there). 8 rows a kv head or more
// (prefill tiles; decode with 8 query heads a kv head or more) run with the rows in the lanes (head_window_lanes).

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define JAXENGINE_ATTENTION_AVX2 1  // 256-bit kernels for the scores and values (16 registers, see block_scores_rows)
#endif
#if defined(__AVX512F__) || defined(JAXENGINE_ATTENTION_AVX2)
#include <immintrin.h>
#endif

#include "cpu_pool.h"
#include "cpu_tiles.h"
#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTileTokens = 16; // query tokens per work item (multi-token requests)
constexpr int kKeyBlock = 16;   // keys per vector of scores
constexpr int kTransposeRows = 8;  // rows of a kv head from which a window's K is transposed (head_window_vector)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The pool's element type.
enum class Pages { kF32, kBf16, kE4M3, kE5M2, kUnsupported };

inline Pages pages_of(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return Pages::kF32;
    case ffi::DataType::BF16: return Pages::kBf16;
    case ffi::DataType::F8E4M3FN: return Pages::kE4M3;
    case ffi::DataType::F8E5M2: return Pages::kE5M2;
    default: return Pages::kUnsupported;
  }
}

struct Problem {
  const float* q;
  const void* kv;  // float32, bfloat16 (uint16), E4M3 or E5M2 pages
  const int32_t* kv_lens;
  const int32_t* block_tables;
  const int32_t* cu_q_lens;
  float* out;
  int64_t num_pages, page_size, num_kv_heads, group, head_dim, pages_per_seq, layer;
  int32_t window;
  float sm_scale, soft_cap;
  const float* sinks = nullptr;  // [Hq]: each query head's sink logit (GPT-OSS), or none
};

// What a row's unnormalised output is multiplied by: 1 / its sum, where a head's sink (a logit in the softmax's
// denominator that weights no value) joins the sum, both rescaled to the larger of the row's maximum and the sink.
inline float output_scale(const Problem& p, int64_t head, float m, float l) {
  if (l <= 0.0f) return 0.0f;
  if (p.sinks == nullptr) return 1.0f / l;
  const float sink = p.sinks[head];
  if (sink <= m) return 1.0f / (l + std::exp(sink - m));
  const float c = std::exp(m - sink);
  return c / (l * c + 1.0f);
}

// Work item: a request's tokens [first_token, end_token) against its keys from key_begin to key_end (all of
// them unless a long range is split among items, see split_items). `partial`, for a split item: where its rows'
// running maximum, sum and unnormalised output go ([rows, 2 + D]), merged once every part is done.
struct Item {
  int32_t req, first_token, end_token;
  int32_t key_begin = 0, key_end = std::numeric_limits<int32_t>::max();
  float* partial = nullptr;
};

// 8 floats in one vector register (AVX) or two (SSE); 16 in one (AVX-512) or two. Loads and stores need no
// alignment.
typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline v16 load16(const float* x) {
  v16 v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

// 16 bfloat16 values widened to float32 (a bfloat16 is the top half of a float32).
inline v16 load16(const uint16_t* x) {
#ifdef __AVX512F__
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
  return reinterpret_cast<v16>(_mm512_castsi512_ps(w));
#else
  u16x16 h;
  std::memcpy(&h, x, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  v16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
#endif
}

// float8 pages' values, one byte each: e4m3fn (bias 7, 3 mantissa bits, no infinities, largest 448) and e5m2
// (bias 15, 2 mantissa bits: a float16's top byte). Written saturated (to_fp8): a finite value never
// becomes NaN or infinite.
struct E4M3 {
  uint8_t bits;
};
struct E5M2 {
  uint8_t bits;
};

inline float to_float(float x) { return x; }

inline float to_float(E4M3 x) {
  const int e = (x.bits >> 3) & 15, m = x.bits & 7;
  const float magnitude = (x.bits & 0x7f) == 0x7f ? std::numeric_limits<float>::quiet_NaN()
                          : e == 0                ? std::ldexp(static_cast<float>(m), -9)
                                                  : std::ldexp(static_cast<float>(8 + m), e - 10);
  return x.bits & 0x80 ? -magnitude : magnitude;
}

inline float to_float(E5M2 x) {
  const int e = (x.bits >> 2) & 31, m = x.bits & 3;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float magnitude = e == 31  ? (m ? std::numeric_limits<float>::quiet_NaN() : kInf)
                          : e == 0 ? std::ldexp(static_cast<float>(m), -16)
                                   : std::ldexp(static_cast<float>(4 + m), e - 17);
  return x.bits & 0x80 ? -magnitude : magnitude;
}


inline float to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline void store16(float* x, v16 v) { std::memcpy(x, &v, sizeof(v)); }

// A 16-lane vector's low and high 8 lanes.
inline void halves(v16 v, v8& lo, v8& hi) {
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
}

// A vector's sum and maximum, reduced in registers (AVX-512) or through its two halves.
inline float sum16(v16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  v8 lo, hi;
  halves(v, lo, hi);
  const v8 x = lo + hi;
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
#endif
}

inline float max16(v16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  v8 lo, hi;
  halves(v, lo, hi);
  const v8 x = lo > hi ? lo : hi;
  return std::max(std::max(std::max(x[0], x[1]), std::max(x[2], x[3])),
                  std::max(std::max(x[4], x[5]), std::max(x[6], x[7])));
#endif
}

// Lane-pair sums of two vectors interleaved, the steps of a transposing reduction: after four levels lane j
// holds the full sum of the j-th of 16 vectors (45 shuffles and adds for 16 sums, not 16 reductions).
inline v16 fold1(v16 a, v16 b) {
  return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
inline v16 fold2(v16 a, v16 b) {
  return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
inline v16 fold4(v16 a, v16 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
inline v16 fold8(v16 a, v16 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

// The page holding `key` of the request whose block table is `table`, or -1 where its id is outside [0, P) or
// the key is past the table.
inline int32_t key_page(const Problem& p, const int32_t* table, int64_t key) {
  const int64_t slot = key / p.page_size;
  const int32_t page = slot < p.pages_per_seq ? table[slot] : -1;
  return page >= 0 && page < p.num_pages ? page : -1;
}

// The [2 * Hkv, D] row of `key` in this layer's page `page`.
template <class T>
inline const T* key_row(const Problem& p, const T* kv, int32_t page, int64_t key) {
  return kv + ((p.layer * p.num_pages + page) * p.page_size + key % p.page_size) * 2 * p.num_kv_heads * p.head_dim;
}

// Pointers to the [2 * Hkv, D] page rows of keys [block, block + n) (past n: the pool's first row, never
// weighted); usable[j]: the key exists and its page id is valid (a bad one is skipped, never read).
template <class T>
void locate_keys(const Problem& p, const T* kv, const int32_t* table, int32_t block, int n, const T** key_rows,
                 bool* usable) {
  for (int j = 0; j < kKeyBlock; ++j) {
    const int32_t page = j < n ? key_page(p, table, block + j) : -1;
    usable[j] = page >= 0;
    key_rows[j] = usable[j] ? key_row(p, kv, page, block + j) : kv;
  }
}

// Keys touched ahead of their use, at most (a window, see run_item): an eighth of a core's L2 cache, 32-256 KB, as
// the window computed on and the next one prefetched beside it must stay in L2 with what else the step keeps
// there. 256 KB was tuned on a Xeon (2 MB of L2); on a Zen 3 EPYC (512 KB) a 64 KB window took 64 decode
// requests x 1024 keys from 6.8-7.4 to 3.5-3.6 ms a layer over random pages (4.7-5.0 -> 2.9-3.2 over
// contiguous ones; 4 x 4096 keys 1.7-2.2 -> 0.9-1.0 ms), with 96 KB as good and 128 KB and more worse.
int64_t touch_bytes() {
  static const int64_t bytes = [] {
#ifdef _SC_LEVEL2_CACHE_SIZE
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l2 > 0) return std::clamp<int64_t>(l2 / 8, int64_t{32} << 10, int64_t{256} << 10);
#endif
    return int64_t{128} << 10;  // L2 unknown: a megabyte's share
  }();
  return bytes;
}

// The rows of a range of keys in their pages, a run of lines per page, and a prefetcher over them: it brings
// them into L2 while other keys are computed on, a few lines at each step() so that the loads overlap the
// compute instead of stalling it (run_item). The pages are interleaved line by line (a line of each page, then
// the next line of each), as touch_keys reads them: every page is then an ascending stream that the core's
// own L2 prefetcher follows ahead of the software prefetches. Measured on a Xeon (AMX), 64 decode requests x
// 192 keys over 30 layers, random pages: 16.0-18.6 -> 13.0-14.1 ms against one page after the other (whose
// prefetches, each holding a line-fill buffer, stalled the core); 640 keys 65 -> 55 ms.
struct KeyPages {
  static constexpr int kMaxPages = 64;
  const char* start[kMaxPages];
  int64_t length[kMaxPages];
  int pages = 0, page = 0;
  int64_t at = 0, per_step = 0, longest = 0;

  int64_t lines() const {
    int64_t n = 0;
    for (int i = 0; i < pages; ++i) n += (length[i] + 63) / 64;
    return n;
  }
  void step() { issue(per_step); }
  void step_all() { issue(std::numeric_limits<int64_t>::max()); }
  void issue(int64_t n) {  // line `at` of pages page.. (those that long), then line at + 64 of every page
    while (n > 0 && at < longest) {
      for (; page < pages && n > 0; ++page) {
        if (at < length[page]) {
          __builtin_prefetch(start[page] + at, 0, 2);  // prefetcht1: into L2 (into L1 was ~2x slower)
          --n;
        }
      }
      if (page >= pages) page = 0, at += 64;
    }
  }
};

// Finds keys [first, last]'s rows (their pages in this layer) for `plan`; returns the key after the last one
// found (pages past kMaxPages are left out, for a next call). Pages whose id is outside [0, P) are skipped.
template <class T>
int32_t plan_keys(const Problem& p, const T* kv, const int32_t* table, int32_t first, int32_t last, int64_t row_bytes,
                  KeyPages& plan) {
  plan.pages = plan.page = 0;
  plan.at = plan.longest = 0;
  int32_t key = first;
  for (; key <= last && plan.pages < KeyPages::kMaxPages;) {
    const int32_t end = static_cast<int32_t>(std::min<int64_t>(last, (key / p.page_size + 1) * p.page_size - 1));
    const int32_t page = key_page(p, table, key);
    if (page >= 0) {
      plan.start[plan.pages] = reinterpret_cast<const char*>(key_row(p, kv, page, key));
      plan.length[plan.pages] = (end - key + 1) * row_bytes;
      plan.longest = std::max(plan.longest, plan.length[plan.pages++]);
    }
    key = end + 1;
  }
  return key;
}

// Reads one byte of every line of keys [first, last]'s rows (their pages in this layer), the pages
// interleaved line by line (see run_item). Pages whose id is outside [0, P) are not read.
template <class T>
void touch_keys(const Problem& p, const T* kv, const int32_t* table, int32_t first, int32_t last, int64_t row_bytes) {
  KeyPages runs;
  uint32_t sink = 0;
  for (int32_t key = first; key <= last;) {
    key = plan_keys(p, kv, table, key, last, row_bytes, runs);
    for (int64_t b = 0; b < runs.longest; b += 64)
      for (int i = 0; i < runs.pages; ++i)
        if (b < runs.length[i]) sink += *reinterpret_cast<const volatile uint8_t*>(runs.start[i] + b);
  }
  (void)sink;
}

struct RowState {
  float* q;      // [D], scaled
  uint16_t* qb;  // [D]: q rounded to bfloat16 (the bfloat16 dot products' operand)
  float* acc;    // [D]
  float m, l;
  int32_t lo, hi;  // the row's first and last key
};

// The keys of the block from `block` that `row` attends to, [first, last] counted from the block's start;
// false where none.
inline bool block_keys(const RowState& row, int32_t block, int32_t& first, int32_t& last) {
  first = std::max(row.lo, block) - block, last = std::min(row.hi, block + kKeyBlock - 1) - block;
  return first <= last;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBf16Dot = true;  // bfloat16 pages are scored with vdpbf16ps, q rounded to bfloat16

// acc + the products of a's and b's bfloat16 pairs (vdpbf16ps). In assembly: GCC 12 spills every
// __m512i -> __m512bh cast through the stack here.
inline __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
#else
constexpr bool kBf16Dot = false;
#endif
#ifdef JAXENGINE_ATTENTION_AVX2
// bfloat16 pages are read 16 values (8 pair words) at a time, even and odd dimensions widened apart
// (even_values, odd_values: one instruction per 8 values), so a row's q and accumulator keep each 16 dimensions'
// even ones first (paired_index).
constexpr bool kPairedWords = true;
#else
constexpr bool kPairedWords = false;
#endif

// Where dimension d of a row's accumulator is kept: in natural order, except for bfloat16 pages on the vector
// path (accumulate_values), where lane k of the two accumulators for dimensions [32c, 32c + 32) (k < 32
// across both) holds dimension 32c + 8 (k % 16 / 4) + 4 (k / 16) + k % 4; on AVX2 (kPairedWords), each 16
// dimensions' even ones, then their odd ones (and q's dimensions in the same order).
template <int kD, class T>
constexpr int64_t paired_index(int64_t d) {
  if constexpr (kD > 0 && kBf16Dot && std::is_same_v<T, uint16_t>) {
    const int64_t c = d / 32, rest = d % 32, lane_group = rest / 8, half = (rest % 8) / 4;
    return 32 * c + 16 * half + 4 * lane_group + rest % 4;
  }
  if constexpr (kD > 0 && kPairedWords && std::is_same_v<T, uint16_t>) return 16 * (d / 16) + 8 * (d % 2) + d % 16 / 2;
  return d;
}

// dst[d] = acc[paired_index(d)] * scale for d < D: a row's output from its accumulator.
template <int kD, class T>
inline void store_output(const float* acc, float scale, float* dst, int64_t D) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (kD > 0 && kBf16Dot && std::is_same_v<T, uint16_t>) {
    // Each 32 dimensions are a permutation of their two accumulator vectors' lanes.
    alignas(64) static const std::array<int32_t, 32> order = [] {
      std::array<int32_t, 32> lanes{};
      for (int d = 0; d < 32; ++d) lanes[d] = static_cast<int32_t>(paired_index<kD, T>(d));
      return lanes;
    }();
    const __m512i order_lo = _mm512_load_si512(order.data()), order_hi = _mm512_load_si512(order.data() + 16);
    const __m512 factor = _mm512_set1_ps(scale);
    for (int c = 0; c < kD / 32; ++c) {
      const __m512 a0 = _mm512_loadu_ps(acc + 32 * c), a1 = _mm512_loadu_ps(acc + 32 * c + 16);
      _mm512_storeu_ps(dst + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(a0, order_lo, a1), factor));
      _mm512_storeu_ps(dst + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(a0, order_hi, a1), factor));
    }
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) dst[d] = acc[paired_index<kD, T>(d)] * scale;
}

// The 16 scores of one row against the block's keys (lane j = q . k_j), kD a multiple of 32: float32 pages
// by FMAs; bfloat16 pages by the AVX-512 BF16 dot product of bfloat16 pairs where the CPU has it (else widened).
template <int kD, class T>
inline v16 block_scores(const RowState& row, const T* const* key_rows, int64_t k_offset) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  __m512i qb[kD / 32];
  if constexpr (std::is_same_v<T, uint16_t>)
    for (int c = 0; c < kD / 32; ++c) qb[c] = _mm512_loadu_si512(row.qb + 32 * c);
#endif
  auto dot = [&](int j) {
    const T* k = key_rows[j] + k_offset;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<T, uint16_t>) {
      __m512 a = _mm512_setzero_ps();
      for (int c = 0; c < kD / 32; ++c) a = dot_bf16(a, qb[c], _mm512_loadu_si512(k + 32 * c));
      return reinterpret_cast<v16>(a);
    }
#endif
    v16 a = load16(row.q) * load16(k);
    for (int c = 1; c < kD / 16; ++c) a += load16(row.q + 16 * c) * load16(k + 16 * c);
    return a;
  };
  auto two = [&](int j) { return fold1(dot(j), dot(j + 1)); };
  auto four = [&](int j) { return fold2(two(j), two(j + 2)); };
  auto eight = [&](int j) { return fold4(four(j), four(j + 4)); };
  return fold8(eight(0), eight(8));
}

#ifdef JAXENGINE_ATTENTION_AVX2
// e^(x - m) on 8 lanes, 0 where x is -inf (a masked score; an old maximum with nothing accumulated under it).
inline __m256 exp_unless_masked(__m256 x, __m256 m) {
  return _mm256_and_ps(exp8(_mm256_sub_ps(x, m)), _mm256_cmp_ps(x, _mm256_set1_ps(kNegInf), _CMP_NEQ_UQ));
}

// 16 values of a page row as float32, in a row's lane order (paired_index): as they are (float32 pages), or
// bfloat16 pair words' even values, then their odd ones.
inline void load_chunk(const float* x, __m256& lo, __m256& hi) { lo = _mm256_loadu_ps(x), hi = _mm256_loadu_ps(x + 8); }
inline void load_chunk(const uint16_t* x, __m256& lo, __m256& hi) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  lo = even_values(words), hi = odd_values(words);
}

// The lane sums of 8 vectors: lane j = the sum of s[j]'s 8 lanes (6 horizontal adds, 2 lane swaps, an add).
inline __m256 sums8(const __m256* s) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// The 16 scores of each of N rows (<= 4) against a block's keys (lane j = q . k_j) on 256-bit registers, where
// AVX-512 is missing: two keys at a time, each key's row loaded (and widened) once for all N rows, q (in the
// same lane order, paired_index) read from memory, 2N accumulators of 8 partial sums; then 8 keys' partial sums
// a row reduced at once (sums8). block_scores' reduction of 16-lane vectors runs two 256-bit halves and
// cross-lane shuffles for each of its 45 steps here; one row at a time, it also widened each key once per row.
template <int kD, int N, class T>
inline void block_scores_rows(RowState* const* rows, const T* const* key_rows, int64_t k_offset, v16* scores) {
  __m256 partial[N][kKeyBlock];
  for (int j = 0; j < kKeyBlock; j += 2) {
    const T* k0 = key_rows[j] + k_offset;
    const T* k1 = key_rows[j + 1] + k_offset;
    __m256 a0[N], a1[N];
    for (int r = 0; r < N; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int c = 0; c < kD / 16; ++c) {
      __m256 x0[2], x1[2];
      load_chunk(k0 + 16 * c, x0[0], x0[1]);
      load_chunk(k1 + 16 * c, x1[0], x1[1]);
      for (int i = 0; i < 2; ++i) {
        for (int r = 0; r < N; ++r) {
          const __m256 q = _mm256_loadu_ps(rows[r]->q + 16 * c + 8 * i);
          a0[r] = _mm256_fmadd_ps(q, x0[i], a0[r]);
          a1[r] = _mm256_fmadd_ps(q, x1[i], a1[r]);
        }
      }
    }
    for (int r = 0; r < N; ++r) partial[r][j] = a0[r], partial[r][j + 1] = a1[r];
  }
  for (int r = 0; r < N; ++r) {
    const __m256 lo = sums8(partial[r]), hi = sums8(partial[r] + 8);
    std::memcpy(&scores[r], &lo, sizeof(lo));
    std::memcpy(reinterpret_cast<char*>(&scores[r]) + sizeof(lo), &hi, sizeof(hi));
  }
}

// block_scores_rows for `count` (1 to kRows) rows.
template <int kD, int kRows, class T>
inline void block_scores_group(RowState* const* rows, int count, const T* const* key_rows, int64_t k_offset,
                               v16* scores) {
  static_assert(kRows == 4);
  switch (count) {
    case 1: return block_scores_rows<kD, 1>(rows, key_rows, k_offset, scores);
    case 2: return block_scores_rows<kD, 2>(rows, key_rows, k_offset, scores);
    case 3: return block_scores_rows<kD, 3>(rows, key_rows, k_offset, scores);
    default: return block_scores_rows<kD, 4>(rows, key_rows, k_offset, scores);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// A 16 x 16 matrix of 32-bit words transposed in registers: out[j] lane i = in[i] lane j (64 shuffles).
inline void transpose16(const __m512i* in, __m512i* out) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: rows 2i, 2i+1 interleaved word by word
    t[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], 128-bit lane L: word 4L + c of rows 4i .. 4i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // out[4L + c], 128-bit lane i = u[4i + c]'s lane L
    const __m512i ab_lo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i ab_hi = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
    const __m512i cd_lo = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i cd_hi = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
    out[c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
    out[4 + c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xdd);
    out[8 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xdd);
  }
}

// A block's 16 K rows (bfloat16 pages) transposed into kt[kD / 2]: kt[i] lane j = key j's dimensions
// (2i, 2i + 1), the pair vdpbf16ps takes.
template <int kD>
inline void transpose_keys(const uint16_t* const* key_rows, int64_t k_offset, __m512i* kt) {
  for (int c = 0; c < kD / 32; ++c) {
    __m512i in[kKeyBlock];
    for (int j = 0; j < kKeyBlock; ++j) in[j] = _mm512_loadu_si512(key_rows[j] + k_offset + 32 * c);
    transpose16(in, kt + 16 * c);
  }
}

// The 16 scores of each of N rows against a block whose K is transposed (transpose_keys): lane j = q . k_j, a
// vdpbf16ps per pair of q's dimensions (broadcast) with no reduction after it. The sums run in `kChains`
// chains a row, so that N * kChains products are in flight.
template <int kD, int N>
inline void block_scores_transposed(RowState* const* rows, const __m512i* kt, v16* scores) {
  constexpr int kChains = N >= 4 ? 2 : N >= 2 ? 4 : 8;
  __m512 acc[N][kChains];
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < kChains; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int i = 0; i < kD / 2; i += kChains) {
    for (int c = 0; c < kChains; ++c) {
      const __m512i k = _mm512_load_si512(kt + i + c);
      for (int r = 0; r < N; ++r) {
        uint32_t pair;
        std::memcpy(&pair, rows[r]->qb + 2 * (i + c), sizeof(pair));
        acc[r][c] = dot_bf16(acc[r][c], _mm512_set1_epi32(static_cast<int>(pair)), k);
      }
    }
  }
  for (int r = 0; r < N; ++r) {
    __m512 sum = acc[r][0];
    for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[r][c]);
    scores[r] = reinterpret_cast<v16>(sum);
  }
}
#endif

// Grows a thread-local buffer to at least `size` elements, never shrinks it: a resize that shrank it would
// zero-fill it again when the next call grows it (0.4% of a prefill profile's samples).
template <class Buffer>
inline void at_least(Buffer& buffer, size_t size) {
  if (buffer.size() < size) buffer.resize(size);
}

#ifdef JAXENGINE_CPU_TILES
// Every row's 16 scores against every block of a window on AMX tiles, out[r * blocks + b] for r below count
// rounded up to 16: S = Q K^T with a tile of 16 rows' q (rounded to bfloat16, 32 dimensions) by a tile of the
// block's transposed K (transpose_keys: 16 pairs of dimensions x 16 keys, a tile as it is), one tdpbf16ps per 32
// dimensions. The same bfloat16 products as block_scores_transposed, summed in the tiles' order. Tiles: 0 the
// scores, 2-5 q's chunks, 6-7 K's.
template <int kD>
void tile_scores(RowState* const* rows, int count, const __m512i* kt, int blocks, v16* out) {
  static_assert(kD == 64 || kD == 128, "a tile of q per 32 dimensions: 2 or 4");
  alignas(64) uint16_t q[kTileRows * kD];
  configure_tiles();
  for (int r0 = 0; r0 < count; r0 += kTileRows) {
    const int n = std::min(kTileRows, count - r0);
    for (int r = 0; r < kTileRows; ++r) {
      if (r < n) std::memcpy(q + r * kD, rows[r0 + r]->qb, sizeof(uint16_t) * kD);
      else std::memset(q + r * kD, 0, sizeof(uint16_t) * kD);
    }
    _tile_loadd(2, q, 2 * kD);
    _tile_loadd(3, q + 32, 2 * kD);
    if constexpr (kD == 128) {
      _tile_loadd(4, q + 64, 2 * kD);
      _tile_loadd(5, q + 96, 2 * kD);
    }
    for (int b = 0; b < blocks; ++b) {
      const __m512i* k = kt + static_cast<size_t>(b) * kD / 2;
      _tile_zero(0);
      _tile_loadd(6, k, 64);
      _tile_loadd(7, k + 16, 64);
      _tile_dpbf16ps(0, 2, 6);
      _tile_dpbf16ps(0, 3, 7);
      if constexpr (kD == 128) {
        _tile_loadd(6, k + 32, 64);
        _tile_loadd(7, k + 48, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(0, 5, 7);
      }
      _tile_stored(0, out + static_cast<size_t>(r0) * blocks + b, 64 * blocks);
    }
  }
  _tile_release();
}

// Every row's accumulator (paired_index order) times its correction, plus its weights over a window's blocks by
// their V rows, on AMX tiles: a tile of 16 rows' weights (bfloat16, 32 keys) by a tile of 16 key pairs' V
// (a pair of keys' rows interleaved 16 bits at a time, as accumulate_window interleaves them: the products'
// columns are then the accumulator's lanes). V is interleaved once per window for all rows, the keys
// outside those some row attends to ([first, last] of the union) zero, never read; `step` runs once a block
// (the key prefetcher). Rows that attend to no key of the window (attends false) are left as they are. The same
// bfloat16 products as accumulate_window, summed in the tiles' order. Tiles: 0-3 products, 4 weights, 5-6 V.
template <int kD, class Step>
void tile_values(RowState* const* rows, int count, const v16* weights, const float* corrections,
                 const char* attends, const uint16_t* const* key_rows, int64_t v_offset, int32_t start, int blocks,
                 Step step) {
  static_assert(kD == 64 || kD == 128, "four tiles of products per pass: 64 dimensions");
  constexpr int kChunks = kD / 32;  // 32 dimensions: two tiles of V (and of products) per chunk
  const int block_pairs = (blocks + 1) / 2;
  thread_local std::vector<__m512i> vt;  // [block pair][chunk][2][16 key pairs]: each a tile of V
  thread_local std::vector<__m512i> wt;  // [block pair][16 rows]: a tile of weights
  at_least(vt, static_cast<size_t>(block_pairs) * kChunks * 2 * 16);
  at_least(wt, static_cast<size_t>(block_pairs) * 16);
  for (int b = 0; b < 2 * block_pairs; ++b) {
    int first = kKeyBlock, last = -1;
    if (b < blocks) {
      step();
      for (int r = 0; r < count; ++r) {
        int32_t lo, hi;
        if (attends[r] && block_keys(*rows[r], start + b * kKeyBlock, lo, hi))
          first = std::min(first, lo), last = std::max(last, hi);
      }
    }
    const uint16_t* const* block_rows = key_rows + static_cast<size_t>(b < blocks ? b : 0) * kKeyBlock;
    for (int i = 0; i < kKeyBlock / 2; ++i) {
      const int j = 2 * i;
      for (int c = 0; c < kChunks; ++c) {
        const __m512i v0 = j >= first && j <= last ? _mm512_loadu_si512(block_rows[j] + v_offset + 32 * c)
                                                   : _mm512_setzero_si512();
        const __m512i v1 = j + 1 >= first && j + 1 <= last
                               ? _mm512_loadu_si512(block_rows[j + 1] + v_offset + 32 * c)
                               : _mm512_setzero_si512();
        __m512i* tile = vt.data() + (static_cast<size_t>(b / 2) * kChunks + c) * 2 * 16 + (b % 2) * 8 + i;
        tile[0] = _mm512_unpacklo_epi16(v0, v1);
        tile[16] = _mm512_unpackhi_epi16(v0, v1);
      }
    }
  }
  alignas(64) float out[kTileRows][kD];
  configure_tiles();
  for (int r0 = 0; r0 < count; r0 += kTileRows) {
    const int n = std::min(kTileRows, count - r0);
    for (int bp = 0; bp < block_pairs; ++bp)
      for (int r = 0; r < kTileRows; ++r) {
        const bool live = r < n && attends[r0 + r];
        const v16* w = weights + static_cast<size_t>(r0 + (live ? r : 0)) * blocks;
        const __m512 w0 = live ? (__m512)w[2 * bp] : _mm512_setzero_ps();
        const __m512 w1 = live && 2 * bp + 1 < blocks ? (__m512)w[2 * bp + 1] : _mm512_setzero_ps();
        wt[static_cast<size_t>(bp) * 16 + r] = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);
      }
    for (int pass = 0; pass < kChunks / 2; ++pass) {  // four tiles of products (64 dimensions) a pass
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int bp = 0; bp < block_pairs; ++bp) {
        const __m512i* v = vt.data() + (static_cast<size_t>(bp) * kChunks + 2 * pass) * 2 * 16;
        _tile_loadd(4, wt.data() + static_cast<size_t>(bp) * 16, 64);
        _tile_loadd(5, v, 64);
        _tile_loadd(6, v + 16, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, v + 32, 64);
        _tile_loadd(6, v + 48, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 6);
      }
      _tile_stored(0, &out[0][64 * pass], 4 * kD);  // the tile numbers are the instruction's: no loop
      _tile_stored(1, &out[0][64 * pass + 16], 4 * kD);
      _tile_stored(2, &out[0][64 * pass + 32], 4 * kD);
      _tile_stored(3, &out[0][64 * pass + 48], 4 * kD);
    }
    for (int r = 0; r < n; ++r) {
      if (!attends[r0 + r]) continue;
      float* acc = rows[r0 + r]->acc;
      const __m512 correction = _mm512_set1_ps(corrections[r0 + r]);
      for (int d = 0; d < kD; d += 16)
        _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + d), correction, _mm512_load_ps(&out[r][d])));
    }
  }
  _tile_release();
}
#endif

// acc_r = acc_r * correction_r + sum over a window's blocks and keys of weights_r[b][j] * V_j, for N rows of one
// kv head at once: each key's V is loaded (and widened) once for all of them, and the accumulators stay in
// registers across the window's blocks. A block's V rows are read only for the keys some row attends to
// ([first, last] of the union); a row's weights are zero for keys it does not attend. `step` runs once a
// block (the key prefetcher, see head_window_vector).
template <int kD, int N, class T, class Step>
inline void accumulate_window(RowState* const* rows, const v16* const* weights, const float* corrections,
                              const T* const* key_rows, int64_t v_offset, int32_t start, int blocks, Step step) {
  auto block_range = [&](int b, int& first, int& last) {
    first = kKeyBlock, last = -1;
    for (int r = 0; r < N; ++r) {
      int32_t lo, hi;
      if (block_keys(*rows[r], start + b * kKeyBlock, lo, hi)) first = std::min(first, lo), last = std::max(last, hi);
    }
    return first <= last;
  };
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    // bfloat16 pages: the weights rounded to bfloat16 (as transformers rounds the probabilities before
    // multiplying them by a bfloat16 V) and the keys taken in pairs: (p_j, p_j+1) . (V_j[d], V_j+1[d]) by
    // vdpbf16ps. Interleaving two keys' V rows 16 bits at a time leaves the accumulators' lanes in the order
    // `paired_index` describes. Measured in one process: prefill attention -12-18%, decode -7-9%.
    __m512 a[N][kD / 16];
    for (int r = 0; r < N; ++r)
      for (int c = 0; c < kD / 16; ++c) a[r][c] = _mm512_loadu_ps(rows[r]->acc + 16 * c) * corrections[r];
    for (int b = 0; b < blocks; ++b) {
      step();
      int first, last;
      if (!block_range(b, first, last)) continue;
      const T* const* block_rows = key_rows + b * kKeyBlock;
      alignas(64) uint32_t pairs[N][kKeyBlock / 2];  // (p_2i, p_2i+1) as bfloat16 in one word
      for (int r = 0; r < N; ++r) {
        const __m256bh w = _mm512_cvtneps_pbh((__m512)weights[r][b]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[r]), (__m256i)w);
      }
      for (int j = first & ~1; j <= last; j += 2) {
        for (int c = 0; c < kD / 32; ++c) {  // keys outside [first, last] are zero, never read from memory
          const __m512i v0 = j >= first ? _mm512_loadu_si512(block_rows[j] + v_offset + 32 * c)
                                        : _mm512_setzero_si512();
          const __m512i v1 = j + 1 <= last ? _mm512_loadu_si512(block_rows[j + 1] + v_offset + 32 * c)
                                           : _mm512_setzero_si512();
          const __m512i lo = _mm512_unpacklo_epi16(v0, v1), hi = _mm512_unpackhi_epi16(v0, v1);
          for (int r = 0; r < N; ++r) {
            const __m512i p = _mm512_set1_epi32(static_cast<int>(pairs[r][j / 2]));
            a[r][2 * c] = dot_bf16(a[r][2 * c], p, lo);
            a[r][2 * c + 1] = dot_bf16(a[r][2 * c + 1], p, hi);
          }
        }
      }
    }
    for (int r = 0; r < N; ++r)
      for (int c = 0; c < kD / 16; ++c) _mm512_storeu_ps(rows[r]->acc + 16 * c, a[r][c]);
    return;
  }
#endif
#ifdef JAXENGINE_ATTENTION_AVX2
  // 256-bit registers: 16 dimensions at a time (2N accumulators, in the lane order of load_chunk) in a pass
  // over the window's keys, each key's 16 values loaded (widened) once for the N rows; the key prefetcher
  // steps in the first pass.
  for (int c = 0; c < kD / 16; ++c) {
    __m256 a[N][2];
    for (int r = 0; r < N; ++r) {
      const __m256 correction = _mm256_set1_ps(corrections[r]);
      a[r][0] = _mm256_mul_ps(_mm256_loadu_ps(rows[r]->acc + 16 * c), correction);
      a[r][1] = _mm256_mul_ps(_mm256_loadu_ps(rows[r]->acc + 16 * c + 8), correction);
    }
    for (int b = 0; b < blocks; ++b) {
      if (c == 0) step();
      int first, last;
      if (!block_range(b, first, last)) continue;
      for (int j = first; j <= last; ++j) {
        __m256 v0, v1;
        load_chunk(key_rows[b * kKeyBlock + j] + v_offset + 16 * c, v0, v1);
        for (int r = 0; r < N; ++r) {
          const __m256 w = _mm256_broadcast_ss(reinterpret_cast<const float*>(&weights[r][b]) + j);
          a[r][0] = _mm256_fmadd_ps(w, v0, a[r][0]);
          a[r][1] = _mm256_fmadd_ps(w, v1, a[r][1]);
        }
      }
    }
    for (int r = 0; r < N; ++r) {
      _mm256_storeu_ps(rows[r]->acc + 16 * c, a[r][0]);
      _mm256_storeu_ps(rows[r]->acc + 16 * c + 8, a[r][1]);
    }
  }
  return;
#endif
  v16 a[N][kD / 16];
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < kD / 16; ++c) a[r][c] = load16(rows[r]->acc + 16 * c) * corrections[r];
  for (int b = 0; b < blocks; ++b) {
    step();
    int first, last;
    if (!block_range(b, first, last)) continue;
    for (int j = first; j <= last; ++j) {
      const T* v = key_rows[b * kKeyBlock + j] + v_offset;
      for (int c = 0; c < kD / 16; ++c) {
        const v16 x = load16(v + 16 * c);
        for (int r = 0; r < N; ++r) a[r][c] += weights[r][b][j] * x;
      }
    }
  }
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < kD / 16; ++c) store16(rows[r]->acc + 16 * c, a[r][c]);
}

// The lane-wise maximum, a where a > b, else b (a NaN in b stays).
inline v16 lane_max(v16 a, v16 b) {
#ifdef JAXENGINE_ATTENTION_AVX2
  __m256 x[2], y[2];
  std::memcpy(x, &a, sizeof(a));
  std::memcpy(y, &b, sizeof(b));
  x[0] = _mm256_max_ps(x[0], y[0]), x[1] = _mm256_max_ps(x[1], y[1]);  // (maxps: a > b ? a : b)
  std::memcpy(&a, x, sizeof(a));
  return a;
#else
  return a > b ? a : b;
#endif
}

// A row's window: its masked scores s[0, blocks) (top: their lane-wise maximum) become its weights, e^(s - m)
// with m its new running maximum (0 where masked); its sum is updated, and `correction` is what its accumulator
// is to be multiplied by before the window's values. False where it attends to no key of the window.
inline bool window_weights(RowState& state, v16* s, v16 top, int blocks, float& correction) {
  const float window_max = max16(top);
  if (window_max == kNegInf) return false;
  const float m_new = std::max(state.m, window_max);
  correction = state.m == kNegInf ? 0.0f : exp_nonpositive(state.m - m_new);
  state.m = m_new;
  v16 sum = splat(0.0f);
#ifdef JAXENGINE_ATTENTION_AVX2
  // The same on each 256-bit half (GCC splits the 16-lane selects into 128-bit pieces here).
  const __m256 m = _mm256_set1_ps(m_new);
  __m256 halves_sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int b = 0; b < blocks; ++b) {
    float* lanes = reinterpret_cast<float*>(&s[b]);
    for (int i = 0; i < 2; ++i) {
      const __m256 x = _mm256_loadu_ps(lanes + 8 * i);
      const __m256 e = exp_unless_masked(x, m);
      _mm256_storeu_ps(lanes + 8 * i, e);
      halves_sum[i] = _mm256_add_ps(halves_sum[i], e);
    }
  }
  std::memcpy(&sum, halves_sum, sizeof(sum));
#else
  for (int b = 0; b < blocks; ++b) {
    s[b] = s[b] != splat(kNegInf) ? exp16(s[b] - m_new) : splat(0.0f);
    sum += s[b];
  }
#endif
  state.l = state.l * correction + sum16(sum);
  return true;
}

// One kv head's rows (all tokens of the item x the head's query heads) against a window of keys, `blocks` blocks
// of 16 from `start` (key_rows and ok: each block's 16 rows and usable lanes). The softmax works a window at a
// time: first every block's scores of kRows rows (independent chains the core can overlap), masked, with a
// running maximum per lane; then each row's window maximum (one reduction), the correction of what it had
// accumulated before the window (one exp) and its weights with their sum (one reduction); then one pass over
// V for the window's blocks, kRows rows' accumulators in registers throughout (accumulate_window). Against
// updating the maximum, the correction and the sum at every block (a reduction, a scalar exp and another
// reduction per row and block, each in the chain of the next block), measured in one process, 30 layers,
// three runs: 64-request decode -10-11%, 4 x 128-token prefill -7-14%. Keeping the accumulators in registers
// across blocks (they were loaded, corrected and stored at each block) and scoring a prefill tile's rows
// against transposed keys (block_scores_transposed), with 16-token tiles instead of 8: 4 x 128-token prefill
// -12-14%, one 2048-token prompt -27-28%, decode unchanged. `plan` (the key prefetcher) steps once per block in
// the scores pass and once in the values pass of the head's first rows: stepping in the scores pass alone
// issued the prefetches in bursts, and the decode ran 10% slower instead.
template <int kD, class T>
void head_window_vector(const Problem& p, RowState* const* rows, int count, const T* const* key_rows,
                        const i32x16* ok, const char* whole, int32_t start, int blocks, int h, KeyPages& plan) {
#ifdef JAXENGINE_ATTENTION_AVX2
  constexpr int kRows = 4;  // rows per pass (block_scores_rows, accumulate_window: 8 accumulators)
#else
  constexpr int kRows = kD <= 64 ? 4 : kD <= 128 ? 2 : 1;  // rows per pass over V: 16 accumulators at most
#endif
  const int64_t v_offset = 2 * h * kD + kD;
  const v16 neg_inf = splat(kNegInf);
  thread_local std::vector<v16> scores;  // [kRows (tiles: count), blocks]: scores, then weights (0 where masked)
  at_least(scores, static_cast<size_t>(kRows) * blocks);
  // Many rows (a prefill tile's tokens x the group's query heads) score against K transposed once per block
  // (transpose_keys) instead of reducing 16 partial-sum vectors per row and block (block_scores); a few rows
  // (a decode token's) would not repay the transposes.
  bool transposed = false, tiled = false;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  thread_local std::vector<__m512i> kt;  // [blocks, kD / 2]
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (count >= kTransposeRows) {
      transposed = true;
      at_least(kt, static_cast<size_t>(blocks) * kD / 2);
      for (int b = 0; b < blocks; ++b)
        transpose_keys<kD>(key_rows + b * kKeyBlock, 2 * h * kD, kt.data() + static_cast<size_t>(b) * kD / 2);
    }
  }
#endif
  // Where AMX runs, those rows' scores come from tiles, all of the window's at once (tile_scores), and then
  // their values too, every row's weights first (tile_values): a prefill step of 4 x 128 tokens, 30 layers,
  // attention 22.6-26.4 -> 17.2-19.1 ms with the scores on tiles, -> 13.0-13.3 (17.3-19.1 in the same runs)
  // with the values too, on the AMX Xeon.
  thread_local std::vector<v16> tiled_scores;  // [count rounded up to 16, blocks]
#ifdef JAXENGINE_CPU_TILES
  if constexpr (kD == 64 || kD == 128) {
    if (transposed && amx_enabled()) {
      tiled = true;
      at_least(tiled_scores, static_cast<size_t>((count + kTileRows - 1) / kTileRows * kTileRows) * blocks);
      tile_scores<kD>(rows, count, kt.data(), blocks, tiled_scores.data());
    }
  }
#endif
  const i32x16 lanes = i32x16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  // A row's scores of block b (score() computes them), soft-capped and masked to the keys it attends to.
  auto masked = [&](const RowState& row, int b, auto score) {
    const int32_t block = start + b * kKeyBlock;
    int32_t first, last;
    if (!block_keys(row, block, first, last)) return neg_inf;
    v16 s = score();
    if (p.soft_cap > 0.0f)
      for (int j = 0; j < kKeyBlock; ++j) s[j] = p.soft_cap * std::tanh(s[j] / p.soft_cap);
    if (whole[b] && first == 0 && last == kKeyBlock - 1) return s;  // (most blocks: no lane masked)
    const i32x16 keys = lanes + block;
    return (ok[b] & (keys >= row.lo) & (keys <= row.hi)) ? s : neg_inf;
  };
#ifdef JAXENGINE_CPU_TILES
  if constexpr (std::is_same_v<T, uint16_t> && (kD == 64 || kD == 128)) {
    if (tiled) {  // every row's weights, then their values on tiles too (tile_values)
      at_least(scores, static_cast<size_t>(count) * blocks);
      thread_local std::vector<float> corrections;
      thread_local std::vector<char> attends;  // whether each row attends to some key of the window
      at_least(corrections, count);
      at_least(attends, count);
      for (int b = 0; b < blocks; ++b) plan.step();
      for (int r = 0; r < count; ++r) {
        v16 top = neg_inf;
        v16* s = scores.data() + static_cast<size_t>(r) * blocks;
        for (int b = 0; b < blocks; ++b) {
          s[b] = masked(*rows[r], b, [&] { return tiled_scores[static_cast<size_t>(r) * blocks + b]; });
          top = lane_max(top, s[b]);
        }
        attends[r] = window_weights(*rows[r], s, top, blocks, corrections[r]);
      }
      tile_values<kD>(rows, count, scores.data(), corrections.data(), attends.data(), key_rows, v_offset, start,
                      blocks, [&] { plan.step(); });
      return;
    }
  }
#endif
  for (int i = 0; i < count; i += kRows) {
    const int group = std::min(kRows, count - i);
    RowState* const* row = rows + i;
    RowState* padded[kRows];  // the group's rows, the last repeated past it (their scores unused)
    for (int r = 0; r < kRows; ++r) padded[r] = row[std::min(r, group - 1)];
    v16 top[kRows];
    for (int r = 0; r < group; ++r) top[r] = neg_inf;
    for (int b = 0; b < blocks; ++b) {
      if (i == 0) plan.step();
      v16 group_scores[kRows];  // the group's scores at once, where a kernel for rows at once runs
      bool scored = false;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      if (transposed) {
        block_scores_transposed<kD, kRows>(padded, kt.data() + static_cast<size_t>(b) * kD / 2, group_scores);
        scored = true;
      }
#endif
#ifdef JAXENGINE_ATTENTION_AVX2
      const int32_t block = start + b * kKeyBlock;
      int32_t first, last;  // (unused)
      if (std::any_of(row, row + group, [&](const RowState* r) { return block_keys(*r, block, first, last); }))
        block_scores_group<kD, kRows>(row, group, key_rows + b * kKeyBlock, 2 * h * kD, group_scores);
      scored = true;  // (scores of a block no row attends to are never read: masked() returns -inf first)
#endif
      for (int r = 0; r < group; ++r) {
        v16& s = scores[r * blocks + b];
        s = masked(*row[r], b, [&] {
          return scored ? group_scores[r] : block_scores<kD>(*row[r], key_rows + b * kKeyBlock, 2 * h * kD);
        });
        top[r] = lane_max(top[r], s);
      }
    }
    float corrections[kRows];  // each row's, applied to its accumulator before the window's values
    bool attends[kRows];
    for (int r = 0; r < group; ++r)
      attends[r] = window_weights(*row[r], &scores[r * blocks], top[r], blocks, corrections[r]);
    RowState* active[kRows];  // the rows that attend to some key of the window
    const v16* active_weights[kRows];
    float active_corrections[kRows];
    int n = 0;
    for (int r = 0; r < group; ++r)
      if (attends[r])
        active[n] = row[r], active_weights[n] = &scores[r * blocks], active_corrections[n++] = corrections[r];
    auto step = [&] {
      if (i == 0) plan.step();
    };
    auto run = [&](auto rows_in_pass) {
      accumulate_window<kD, decltype(rows_in_pass)::value>(active, active_weights, active_corrections, key_rows,
                                                           v_offset, start, blocks, step);
    };
    if (n == kRows) run(std::integral_constant<int, kRows>{});
    else if constexpr (kRows > 1) {
      if (n == 1) run(std::integral_constant<int, 1>{});
      if constexpr (kRows > 2) {
        if (n == 2) run(std::integral_constant<int, 2>{});
        if (n == 3) run(std::integral_constant<int, 3>{});
      }
    }
    if (n == 0 && i == 0)
      for (int b = 0; b < blocks; ++b) plan.step();
  }
}

#ifdef JAXENGINE_ATTENTION_AVX2
constexpr int kLaneRows = 8;  // rows of a kv head from which they are computed in lanes (head_window_lanes)

// One kv head's rows, many of them (a prefill tile's tokens x the group's query heads), computed in lanes where
// AVX-512 is missing: the row runs along the vector's lanes (8 rows a register), so that a window's scores are
// a small matrix product (q by the window's keys, each key's value broadcast), the softmax's maxima, exps and
// sums are lane-wise over the keys (no horizontal reduction), and its values another (the weights by V, each V
// value broadcast). q and acc are [kD][padded] (a dimension's rows side by side, padded to whole registers, in
// load_chunk's lane order); m, l and each row's keys [lo, hi], one lane a row. Padding rows attend to no key.
// Against 4 rows at a time (block_scores_rows, accumulate_window: each group of 4 rows widening every K and V
// again, its 16-lane scores copied through memory), measured on the Zen 3 EPYC, per layer, 30 layers, random
// pages: llama-135m's heads (head_dim 64, 3 kv heads of 3), a 512-token chunk after 1472 keys 27-32 -> 21-22 ms,
// after 512 keys 15.7-18.1 -> 10.9-11.0, a 512-token prompt 5.6-6.0 -> 4.5-4.8; head_dim 128, 2 kv heads of 4,
// after 1472 keys 55-62 -> 36-37 ms; 4 x 128-token prompts unchanged (1.5-1.6 ms); decode with 16 query heads a
// kv head (head_dim 128), 64 requests x 512 keys 5.3-5.7 -> 3.2-4.1 ms; with 8 (one register), 64 x 512 keys
// 5.3-6.2 -> 4.3-5.9 ms (head_dim 128), 64 x 192 keys 1.27-1.50 -> 1.04-1.29 ms (head_dim 64).
struct LaneRows {
  int padded = 0;
  float *q, *acc, *m, *l;
  int32_t *lo, *hi;
  int32_t *lo_max, *hi_min;  // [padded / 8]: each register's rows' largest lo, smallest hi
};

// The lanes path's register block: c[n][r] = c[n][r] * scale[r] (c taken as 0 where scale is null) + the sum
// over t < steps of a[n * kAN + t * kAT] * b[t][r], for NB values of `a` broadcast at a time and 8 RV rows (b and
// c: a register's rows `padded` apart): NB x RV accumulators. The scores are one (a: the window's K, b: q), the
// values another (a: V, b: the weights).
template <int RV, int NB, int kAN, int kAT>
inline void lane_product(const float* a, const float* b, int64_t padded, int steps, const float* scale, float* c) {
  __m256 acc[NB][RV];
  for (int v = 0; v < RV; ++v) {
    const __m256 f = scale != nullptr ? _mm256_loadu_ps(scale + 8 * v) : _mm256_setzero_ps();
    for (int n = 0; n < NB; ++n)
      acc[n][v] = scale != nullptr ? _mm256_mul_ps(_mm256_loadu_ps(c + n * padded + 8 * v), f) : f;
  }
  for (int t = 0; t < steps; ++t) {
    __m256 x[RV];
    for (int v = 0; v < RV; ++v) x[v] = _mm256_loadu_ps(b + t * padded + 8 * v);
    for (int n = 0; n < NB; ++n) {
      const __m256 y = _mm256_broadcast_ss(a + n * kAN + t * kAT);
      for (int v = 0; v < RV; ++v) acc[n][v] = _mm256_fmadd_ps(y, x[v], acc[n][v]);
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int v = 0; v < RV; ++v) _mm256_storeu_ps(c + n * padded + 8 * v, acc[n][v]);
}

// Runs f(first register, registers) over a kv head's row registers, 2 at a time and then 1 where left.
template <class F>
inline void over_registers(int registers, F f) {
  int v = 0;
  for (; v + 2 <= registers; v += 2) f(v, std::integral_constant<int, 2>{});
  if (v < registers) f(v, std::integral_constant<int, 1>{});
}

// Runs f(first, count) over [0, n) (n even): `count` (a template argument) kMany at a time, then 2 or 4 left.
template <int kMany, class F>
inline void over_broadcasts(int n, F f) {
  int k = 0;
  for (; k + kMany <= n; k += kMany) f(k, std::integral_constant<int, kMany>{});
  if constexpr (kMany > 4) {
    if (n - k >= 4) f(k, std::integral_constant<int, 4>{}), k += 4;
  }
  if (n - k >= 2) f(k, std::integral_constant<int, 2>{});
}

// A kv head's rows in lanes (LaneRows) against a window of keys, `blocks` blocks of 16 from `start` (key_rows
// and ok as for head_window_vector): the window's K and V for this head widened to float32 once (kf, vf:
// [keys][kD], zero for keys not found), every row's scores (lane_product), masked where some row of a register
// does not attend to a whole block, the softmax lane-wise (each row's new maximum, its correction and its
// weights' sum), then the values (lane_product again).
template <int kD, class T>
void head_window_lanes(LaneRows& lr, const T* const* key_rows, const i32x16* ok, const char* whole, int32_t start,
                       int blocks, int h, KeyPages& plan) {
  const int keys = blocks * kKeyBlock, registers = lr.padded / 8;
  const int64_t padded = lr.padded;
  thread_local std::vector<float> work;  // kf, vf [keys][kD], then the scores / weights [keys][padded], corr
  at_least(work, static_cast<size_t>(keys) * (2 * kD + padded) + padded);
  float* kf = work.data();
  float* vf = kf + static_cast<size_t>(keys) * kD;
  float* s = vf + static_cast<size_t>(keys) * kD;
  float* corr = s + static_cast<size_t>(keys) * padded;
  for (int b = 0; b < blocks; ++b) {
    plan.step();
    for (int j = 0; j < kKeyBlock; ++j) {
      const int k = b * kKeyBlock + j;
      float* kd = kf + static_cast<size_t>(k) * kD;
      float* vd = vf + static_cast<size_t>(k) * kD;
      if (!ok[b][j]) {
        std::fill(kd, kd + kD, 0.0f), std::fill(vd, vd + kD, 0.0f);
        continue;
      }
      const T* row = key_rows[k] + 2 * h * kD;
      for (int c = 0; c < kD / 16; ++c) {
        __m256 lo, hi;
        load_chunk(row + 16 * c, lo, hi);
        _mm256_storeu_ps(kd + 16 * c, lo), _mm256_storeu_ps(kd + 16 * c + 8, hi);
        load_chunk(row + kD + 16 * c, lo, hi);
        _mm256_storeu_ps(vd + 16 * c, lo), _mm256_storeu_ps(vd + 16 * c + 8, hi);
      }
    }
  }
  // 2 row registers by 6 keys (12 accumulators, 2 loads and 6 broadcasts per 12 fmas, as the AVX2 matmul's
  // register block) or 1 by 8.
  over_registers(registers, [&](int v0, auto rv) {
    constexpr int RV = decltype(rv)::value;
    over_broadcasts<RV == 1 ? 8 : 6>(keys, [&](int k, auto kj) {
      lane_product<RV, decltype(kj)::value, kD, 1>(kf + static_cast<size_t>(k) * kD, lr.q + 8 * v0, padded, kD,
                                                    nullptr, s + k * padded + 8 * v0);
    });
  });
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  for (int v = 0; v < registers; ++v) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lr.lo + 8 * v));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lr.hi + 8 * v));
    __m256 top = neg_inf;
    for (int b = 0; b < blocks; ++b) {
      const int32_t block = start + b * kKeyBlock;
      const bool full = whole[b] && lr.lo_max[v] <= block && lr.hi_min[v] >= block + kKeyBlock - 1;
      for (int j = 0; j < kKeyBlock; ++j) {
        float* x = s + (b * kKeyBlock + j) * padded + 8 * v;
        __m256 score = _mm256_loadu_ps(x);
        if (!full) {
          const __m256i key = _mm256_set1_epi32(block + j);
          const __m256i out = _mm256_or_si256(_mm256_cmpgt_epi32(lo, key), _mm256_cmpgt_epi32(key, hi));
          score = ok[b][j] ? _mm256_blendv_ps(score, neg_inf, _mm256_castsi256_ps(out)) : neg_inf;
          _mm256_storeu_ps(x, score);
        }
        top = _mm256_max_ps(score, top);  // (maxps: a NaN score stays)
      }
    }
    const __m256 m_old = _mm256_loadu_ps(lr.m + 8 * v), m_new = _mm256_max_ps(top, m_old);
    // where the old maximum is -inf nothing was accumulated: the correction is 0 (not exp(NaN) where both are)
    const __m256 c = exp_unless_masked(m_old, m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int k = 0; k < keys; ++k) {
      float* x = s + k * padded + 8 * v;
      const __m256 score = _mm256_loadu_ps(x);
      const __m256 e = exp_unless_masked(score, m_new);
      _mm256_storeu_ps(x, e);
      sum = _mm256_add_ps(sum, e);
    }
    _mm256_storeu_ps(lr.l + 8 * v, _mm256_fmadd_ps(_mm256_loadu_ps(lr.l + 8 * v), c, sum));
    _mm256_storeu_ps(lr.m + 8 * v, m_new);
    _mm256_storeu_ps(corr + 8 * v, c);
  }
  // The values, 2 row registers by 6 dimensions or 1 by 8, the key prefetcher stepping `blocks` times spread
  // over the passes.
  const int dims = (registers + 1) / 2 * kD;  // the passes' dimensions, all together
  int done = 0, stepped = 0;
  over_registers(registers, [&](int v0, auto rv) {
    constexpr int RV = decltype(rv)::value;
    over_broadcasts<RV == 1 ? 8 : 6>(kD, [&](int d, auto di) {
      constexpr int DI = decltype(di)::value;
      for (done += DI; stepped * dims < done * blocks && stepped < blocks; ++stepped) plan.step();
      lane_product<RV, DI, 1, kD>(vf + d, s + 8 * v0, padded, keys, corr + 8 * v0, lr.acc + d * padded + 8 * v0);
    });
  });
  for (; stepped < blocks; ++stepped) plan.step();
}
#endif

// The same for any head_dim, one lane at a time.
template <class T>
void row_block_scalar(const Problem& p, RowState& row, const T* const* key_rows, const bool* usable,
                      int32_t block, int64_t k_offset) {
  int32_t first, last;
  if (!block_keys(row, block, first, last)) return;
  const int64_t D = p.head_dim;
  float s[kKeyBlock];
  float block_max = kNegInf;
  for (int j = first; j <= last; ++j) {
    const T* k = key_rows[j] + k_offset;
    float dot = 0.0f;
    for (int64_t d = 0; d < D; ++d) dot += row.q[d] * to_float(k[d]);
    if (p.soft_cap > 0.0f) dot = p.soft_cap * std::tanh(dot / p.soft_cap);
    s[j] = usable[j] ? dot : kNegInf;
    block_max = std::max(block_max, s[j]);
  }
  if (block_max == kNegInf) return;
  const float m_new = std::max(row.m, block_max);
  const float correction = row.m == kNegInf ? 0.0f : exp_nonpositive(row.m - m_new);
  row.m = m_new;
  float sum = 0.0f;
  for (int j = first; j <= last; ++j) {
    s[j] = s[j] == kNegInf ? 0.0f : exp_nonpositive(s[j] - m_new);
    sum += s[j];
  }
  row.l = row.l * correction + sum;
  for (int64_t d = 0; d < D; ++d) row.acc[d] *= correction;
  for (int j = first; j <= last; ++j) {
    const T* v = key_rows[j] + k_offset + D;
    for (int64_t d = 0; d < D; ++d) row.acc[d] += s[j] * to_float(v[d]);
  }
}

inline uint16_t round_bf16(float x) {  // to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// The keys [lo, hi] that queries at positions [first, last] of a request with `ctx` keys attend to, together,
// within the item's key range (lo > hi: none).
inline void attended_keys(const Problem& p, const Item& item, int32_t ctx, int32_t first, int32_t last, int32_t& lo,
                          int32_t& hi) {
  hi = std::min({last, ctx - 1, item.key_end});
  lo = std::max(p.window > 0 ? std::max(first - p.window + 1, 0) : 0, item.key_begin);
}

// The keys [lo, hi] an item's rows attend to, together (lo > hi: none).
inline void item_keys(const Problem& p, const Item& item, int32_t& lo, int32_t& hi) {
  const int32_t q_start = p.cu_q_lens[item.req], q_len = p.cu_q_lens[item.req + 1] - q_start;
  const int32_t ctx = p.kv_lens[item.req];
  const int32_t first = ctx - q_len + (item.first_token - q_start), last = ctx - q_len + (item.end_token - 1 - q_start);
  attended_keys(p, item, ctx, first, last, lo, hi);
}

#ifdef __AVX512BW__
// A float8 format's bfloat16 values by magnitude (the byte without its sign): 128 words, four vectors.
template <class F>
struct Bf16Table {
  alignas(64) uint16_t words[128];
  Bf16Table() {
    for (int m = 0; m < 128; ++m) words[m] = round_bf16(to_float(F{static_cast<uint8_t>(m)}));  // exact
  }
};

template <class F>
const Bf16Table<F> kBf16Table;  // per format, built once at load
#endif

// n float8 values (n a multiple of 32) as bfloat16, exactly (every float8 value is a bfloat16 one). With
// AVX-512 BW, 32 at a time by table: each byte widened to a word, its magnitude's bfloat16 picked from the four
// vectors (two vpermi2w, bit 6 choosing between them), its sign moved to the word's top bit. Measured in one
// process, the shared model's layer (3 KV heads x 64), 16 decode requests x 2000 keys: 1.33 ms against widening
// through float16 and float32, 0.97-0.99 ms so (bfloat16 pages 0.87-0.91 ms: the decode is compute-bound here).
template <class F>
inline void widen_fp8_row(const F* src, uint16_t* dst, int64_t n) {
#ifdef __AVX512BW__
  const uint16_t* table = kBf16Table<F>.words;
  const __m512i t0 = _mm512_load_si512(table), t1 = _mm512_load_si512(table + 32);
  const __m512i t2 = _mm512_load_si512(table + 64), t3 = _mm512_load_si512(table + 96);
  const __m512i bit6 = _mm512_set1_epi16(0x40), sign = _mm512_set1_epi16(static_cast<short>(0x8000));
  for (int64_t i = 0; i < n; i += 32) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    const __m512i magnitude = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, bit6),
                                                      _mm512_permutex2var_epi16(t0, w, t1),
                                                      _mm512_permutex2var_epi16(t2, w, t3));
    // magnitude | (w << 8 & sign): ternary logic a | (b & c)
    _mm512_storeu_si512(dst + i, _mm512_ternarylogic_epi32(magnitude, _mm512_slli_epi16(w, 8), sign, 0xf8));
  }
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = round_bf16(to_float(src[i]));  // exact
#endif
}

// One request's tokens [first_token, end_token) over all heads, in blocks of 16 keys with an online softmax.
// Keys are read a window at a time ahead of their use (see below). next: the worker's next item, whose first
// keys are prefetched during this one's last window; ahead: in, the key below which this item's keys were so
// prefetched (-1: none); out, the same for next. `Stored`: the pages' type where it is not T's: float8 pages are
// widened to bfloat16 (exactly) a window at a time as they are first read, and computed on as bfloat16 pages
// are (widening each key for every row that reads it made a 2k-token prefill several times slower).
template <int kD, class T, class Stored = T>
void run_item(const Problem& p, const Item& item, const Item* next, int32_t& ahead) {
  static_assert(std::is_same_v<T, Stored> || std::is_same_v<T, uint16_t>, "float8 pages are computed as bfloat16");
  const Stored* kv = static_cast<const Stored*>(p.kv);
  const int64_t D = kD > 0 ? kD : p.head_dim, G = p.group, Hkv = p.num_kv_heads, Hq = Hkv * G;
  const int32_t q_start = p.cu_q_lens[item.req];
  const int32_t q_len = p.cu_q_lens[item.req + 1] - q_start;
  const int32_t ctx = p.kv_lens[item.req];
  const int tokens = item.end_token - item.first_token;
  const int rows = tokens * Hq;  // row i: token first + i / Hq, head i % Hq
  thread_local std::vector<float> buffer;
  thread_local std::vector<uint16_t> rounded;
  thread_local std::vector<RowState> states;
  thread_local std::vector<RowState*> by_head;  // [Hkv, tokens * G]
  buffer.resize(static_cast<size_t>(rows) * 2 * D);
  rounded.resize(static_cast<size_t>(rows) * D);
  states.resize(rows);
  by_head.resize(rows);
  int32_t key_lo, key_hi;  // the first token's first key, the last token's last
  item_keys(p, item, key_lo, key_hi);
  for (int i = 0; i < rows; ++i) {
    RowState& row = states[i];
    row.q = buffer.data() + 2 * i * D;
    row.acc = row.q + D;
    row.qb = rounded.data() + i * D;
    const int32_t token = item.first_token + i / Hq;
    const float* src = p.q + (token * Hq + i % Hq) * D;
    for (int64_t d = 0; d < D; ++d) row.q[kPairedWords ? paired_index<kD, T>(d) : d] = src[d] * p.sm_scale;
    if (kBf16Dot && std::is_same_v<T, uint16_t>)
      for (int64_t d = 0; d < D; ++d) row.qb[d] = round_bf16(row.q[d]);
    std::fill(row.acc, row.acc + D, 0.0f);
    const int32_t pos = ctx - q_len + (token - q_start);
    attended_keys(p, item, ctx, pos, pos, row.lo, row.hi);
    row.m = kNegInf;
    row.l = 0.0f;
    const int head = i % Hq, kv_head = head / G;
    by_head[kv_head * tokens * G + (i / Hq) * G + head % G] = &row;
  }
  const int32_t* table = p.block_tables + item.req * p.pages_per_seq;
  const int64_t width = 2 * Hkv * D, row_bytes = width * sizeof(Stored);
#ifdef JAXENGINE_ATTENTION_AVX2
  // Many rows a kv head (a prefill tile's) are computed in lanes (head_window_lanes), their state moved into
  // [kD][rows] layouts here and back into their RowStates at the end. (Soft caps stay on head_window_vector.)
  const int head_rows = tokens * static_cast<int>(G);
  const bool in_lanes = kD > 0 && p.soft_cap <= 0.0f && head_rows >= kLaneRows;
  thread_local std::vector<float> lane_floats;
  thread_local std::vector<int32_t> lane_ints;
  thread_local std::vector<LaneRows> lane_heads;
  if (in_lanes) {
    const int padded = (head_rows + 7) / 8 * 8;
    const size_t floats = static_cast<size_t>(2 * D + 2) * padded, ints = 2 * padded + padded / 4;
    lane_floats.resize(floats * Hkv);
    lane_ints.resize(ints * Hkv);
    lane_heads.resize(Hkv);
    for (int64_t h = 0; h < Hkv; ++h) {
      LaneRows& lr = lane_heads[h];
      lr.padded = padded;
      lr.q = lane_floats.data() + floats * h, lr.acc = lr.q + D * padded;
      lr.m = lr.acc + D * padded, lr.l = lr.m + padded;
      lr.lo = lane_ints.data() + ints * h, lr.hi = lr.lo + padded;
      lr.lo_max = lr.hi + padded, lr.hi_min = lr.lo_max + padded / 8;
      std::fill(lr.q, lr.q + floats, 0.0f);
      std::fill(lr.m, lr.m + padded, kNegInf);
      std::fill(lr.lo, lr.lo + padded, std::numeric_limits<int32_t>::max());
      std::fill(lr.hi, lr.hi + padded, -1);
      for (int r = 0; r < head_rows; ++r) {
        const RowState& row = *by_head[h * head_rows + r];
        for (int64_t d = 0; d < D; ++d) lr.q[d * padded + r] = row.q[d];
        lr.lo[r] = row.lo, lr.hi[r] = row.hi;
      }
      for (int v = 0; v < padded / 8; ++v) {
        lr.lo_max[v] = *std::max_element(lr.lo + 8 * v, lr.lo + 8 * v + 8);
        lr.hi_min[v] = *std::min_element(lr.hi + 8 * v, lr.hi + 8 * v + 8);
      }
    }
  }
#endif
  // Keys are read ahead of their use a window (touch_bytes(), 32-256 KB) at a time. While a window is computed
  // on, the next one (the item's own, or the first of the worker's next item) is prefetched into L2, a few lines
  // before each head's block, so that reading memory overlaps computing. Measured in one process, 64 decode
  // requests x 190 keys over 30 layers: 16.2 -> 13.2 ms (contiguous pages), 18.1 -> 14.8 ms (random pages);
  // through XLA, -9-10%. Prefetching into L1 (prefetcht0) instead was ~2x slower; bursts of prefetches, or
  // prefetching only the next block, did not help. A window nobody prefetched (a worker's first) is touched
  // first, its pages side by side: a line of each page, then the next line of each. That reads at close to
  // the full memory bandwidth (one stream per page: 25-27 GB/s for 12 KB pages on 2 cores), where touching
  // pages one after the other ran at ~15 GB/s and the compute's head-by-head reads at half of that.
  const int64_t widest_row = width * std::max(sizeof(T), sizeof(Stored));
  const int32_t window = std::max<int32_t>(kKeyBlock, (touch_bytes() / widest_row) / kKeyBlock * kKeyBlock);
  thread_local std::vector<const T*> key_rows;  // [window]: each key's [2 * Hkv, D] row
  thread_local std::vector<const Stored*> stored_rows;  // the same in the pages, where they are widened
  thread_local std::vector<T> widened;  // [window, 2 * Hkv, D]: a window's rows widened (float8 pages)
  thread_local std::vector<std::array<bool, kKeyBlock>> usable;  // [window / 16]: the keys found, per block
  thread_local std::vector<i32x16> ok;                           // the same as lane masks
  thread_local std::vector<char> whole;                          // whether every key of a block was found
  key_rows.resize(window);
  if constexpr (!std::is_same_v<T, Stored>) {
    stored_rows.resize(window);
    widened.resize(static_cast<size_t>(window) * width);
  }
  usable.resize(window / kKeyBlock);
  ok.resize(window / kKeyBlock);
  whole.resize(window / kKeyBlock);
  int32_t prefetched = std::max(ahead, key_lo);  // keys below were prefetched
  ahead = -1;
  KeyPages plan;
  for (int32_t start = key_lo, end; start <= key_hi; start = end) {
    end = static_cast<int32_t>(std::min<int64_t>(int64_t{start} + window, int64_t{key_hi} + 1));
    if (prefetched < end) touch_keys(p, kv, table, std::max(start, prefetched), end - 1, row_bytes);
    plan.step_all();
    if (end <= key_hi) {
      prefetched = plan_keys(p, kv, table, end, std::min<int32_t>(end + window, key_hi + 1) - 1, row_bytes, plan);
    } else if (next != nullptr) {
      int32_t lo, hi;
      item_keys(p, *next, lo, hi);
      if (lo <= hi)
        ahead = plan_keys(p, kv, p.block_tables + next->req * p.pages_per_seq, lo,
                          std::min<int32_t>(lo + window, hi + 1) - 1, row_bytes, plan);
    }
    const int blocks = (end - start + kKeyBlock - 1) / kKeyBlock;
    // Spread over this window's steps: two per kv head and block (its scores, its values), one per block on
    // the scalar path.
    const int64_t steps = kD > 0 ? 2 * blocks * Hkv : blocks;
    plan.per_step = (plan.lines() + steps - 1) / steps;
    for (int b = 0; b < blocks; ++b) {
      const int32_t block = start + b * kKeyBlock;
      const int n = std::min<int32_t>(kKeyBlock, end - block);
      if constexpr (std::is_same_v<T, Stored>) {
        locate_keys(p, kv, table, block, n, &key_rows[b * kKeyBlock], usable[b].data());
      } else {
        locate_keys(p, kv, table, block, n, &stored_rows[b * kKeyBlock], usable[b].data());
        for (int j = 0; j < kKeyBlock; ++j) {  // a key past n or without a page: a row never weighted
          T* row = widened.data() + static_cast<size_t>(b * kKeyBlock + j) * width;
          if (usable[b][j]) widen_fp8_row(stored_rows[b * kKeyBlock + j], row, width);
          key_rows[b * kKeyBlock + j] = usable[b][j] ? row : widened.data();
        }
      }
      for (int j = 0; j < kKeyBlock; ++j) ok[b][j] = usable[b][j] ? -1 : 0;
      whole[b] = std::all_of(usable[b].begin(), usable[b].end(), [](bool found) { return found; });
    }
    if constexpr (kD > 0) {
      for (int h = 0; h < Hkv; ++h) {
#ifdef JAXENGINE_ATTENTION_AVX2
        if (in_lanes) {
          head_window_lanes<kD>(lane_heads[h], key_rows.data(), ok.data(), whole.data(), start, blocks, h, plan);
          continue;
        }
#endif
        head_window_vector<kD>(p, by_head.data() + h * tokens * G, tokens * G, key_rows.data(), ok.data(),
                               whole.data(), start, blocks, h, plan);
      }
    } else {
      for (int b = 0; b < blocks; ++b) {
        plan.step();
        for (int i = 0; i < rows; ++i)
          row_block_scalar(p, states[i], &key_rows[b * kKeyBlock], usable[b].data(), start + b * kKeyBlock,
                           2 * ((i % Hq) / G) * D);
      }
    }
  }
  plan.step_all();
#ifdef JAXENGINE_ATTENTION_AVX2
  if (in_lanes) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const LaneRows& lr = lane_heads[h];
      for (int r = 0; r < head_rows; ++r) {
        RowState& row = *by_head[h * head_rows + r];
        row.m = lr.m[r], row.l = lr.l[r];
        for (int64_t d = 0; d < D; ++d) row.acc[d] = lr.acc[d * lr.padded + r];
      }
    }
  }
#endif
  for (int i = 0; i < rows; ++i) {
    const RowState& row = states[i];
    if (item.partial != nullptr) {  // one part of a split item: merged by merge_parts
      float* dst = item.partial + i * (2 + D);
      dst[0] = row.m, dst[1] = row.l;
      std::copy(row.acc, row.acc + D, dst + 2);
      continue;
    }
    const int32_t token = item.first_token + i / Hq;
    float* dst = p.out + (token * Hq + i % Hq) * D;
    store_output<kD, T>(row.acc, output_scale(p, i % Hq, row.m, row.l), dst, D);
  }
}

// The output of `parts` items that split one item's keys between them (their partial rows, see run_item):
// each row's maximum over the parts, and the parts' sums and outputs rescaled to it.
template <int kD, class T>
void merge_parts(const Problem& p, const Item* parts, int count) {
  const int64_t D = kD > 0 ? kD : p.head_dim, Hq = p.num_kv_heads * p.group;
  const int rows = (parts[0].end_token - parts[0].first_token) * static_cast<int>(Hq);
  thread_local std::vector<float> acc;
  acc.resize(D);
  for (int i = 0; i < rows; ++i) {
    float m = kNegInf, l = 0.0f;
    for (int k = 0; k < count; ++k) m = std::max(m, parts[k].partial[i * (2 + D)]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; m != kNegInf && k < count; ++k) {
      const float* part = parts[k].partial + i * (2 + D);
      if (part[0] == kNegInf) continue;  // a part with none of this row's keys
      const float scale = exp_nonpositive(part[0] - m);
      l += part[1] * scale;
      for (int64_t d = 0; d < D; ++d) acc[d] += part[2 + d] * scale;
    }
    const int32_t token = parts[0].first_token + i / static_cast<int>(Hq);
    store_output<kD, T>(acc.data(), output_scale(p, i % Hq, m, l), p.out + (token * Hq + i % Hq) * D, D);
  }
}

struct Shared {
  Problem problem;
  void (*run)(const Problem&, const Item&, const Item*, int32_t&);
  void (*merge)(const Problem&, const Item*, int);
  std::vector<Item> items;
  std::vector<float> partials;                 // split items' partial rows
  std::vector<std::pair<size_t, int>> splits;  // each split item's parts: (first index in items, count)
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};

  // Each worker claims its next item before it runs the current one, so that it can prefetch the next one's
  // keys while it computes (run_item).
  void work() {
    int32_t ahead = -1;
    for (size_t i = next.fetch_add(1); i < items.size();) {
      const size_t following = next.fetch_add(1);
      run(problem, items[i], following < items.size() ? &items[following] : nullptr, ahead);
      done.fetch_add(1, std::memory_order_release);
      i = following;
    }
  }
};

// A pool of `Stored` values: computed on as T (uint16_t: bfloat16) for the known head_dims where float8 pages
// are widened (run_item), as they are for others.
template <class Stored, class T = Stored>
auto pick(int64_t D) -> void (*)(const Problem&, const Item&, const Item*, int32_t&) {
  return D == 64    ? run_item<64, T, Stored>
         : D == 128 ? run_item<128, T, Stored>
         : D == 256 ? run_item<256, T, Stored>
                    : run_item<0, Stored>;
}

template <class Stored, class T = Stored>
auto pick_merge(int64_t D) -> void (*)(const Problem&, const Item*, int) {
  return D == 64 ? merge_parts<64, T> : D == 128 ? merge_parts<128, T> : D == 256 ? merge_parts<256, T>
                                                                                 : merge_parts<0, Stored>;
}

constexpr int32_t kMinPartKeys = 256;  // keys a part of a split item has at least

// Where a call has fewer than two items a worker (a decode step of a few long requests, a short chunk after a
// long prefix), each item's keys are split among up to that many parts (of kMinPartKeys keys or more, whole
// blocks), so that every worker has keys to read; the parts are merged at the end (merge_parts).
void split_items(Shared& shared, int64_t workers) {
  const Problem& p = shared.problem;
  const int64_t target = 2 * workers, count = static_cast<int64_t>(shared.items.size());
  if (count == 0 || count >= target) return;
  const int64_t want = (target + count - 1) / count;
  std::vector<Item> items;
  std::vector<std::pair<size_t, int>> splits;
  int64_t partial_floats = 0;
  const int64_t row_floats = (2 + p.head_dim) * p.num_kv_heads * p.group;
  for (const Item& item : shared.items) {
    int32_t lo, hi;
    item_keys(p, item, lo, hi);
    const int64_t parts = std::min<int64_t>(want, (int64_t{hi} - lo + 1) / kMinPartKeys);
    if (parts < 2) {
      items.push_back(item);
      continue;
    }
    splits.emplace_back(items.size(), static_cast<int>(parts));
    const int64_t blocks = (int64_t{hi} - lo + kKeyBlock) / kKeyBlock;
    for (int64_t k = 0; k < parts; ++k) {
      Item part = item;
      part.key_begin = static_cast<int32_t>(lo + blocks * k / parts * kKeyBlock);
      part.key_end = k + 1 < parts ? static_cast<int32_t>(lo + blocks * (k + 1) / parts * kKeyBlock - 1) : hi;
      items.push_back(part);
      partial_floats += row_floats * (item.end_token - item.first_token);
    }
  }
  if (splits.empty()) return;
  shared.partials.resize(static_cast<size_t>(partial_floats));
  float* next = shared.partials.data();
  for (const auto& [first, parts] : splits)
    for (int k = 0; k < parts; ++k, next += row_floats * (items[first].end_token - items[first].first_token))
      items[first + k].partial = next;
  shared.items = std::move(items);
  shared.splits = std::move(splits);
}

ffi::Error AttentionOf(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                       ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                       ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window, const float* sinks,
                       float sm_scale, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = kv.dimensions();
  const Pages pages = pages_of(kv.element_type());
  if (pages == Pages::kUnsupported)
    return ffi::Error::InvalidArgument("cpu attention: the kv pages must be float32, bfloat16, float8_e4m3fn or "
                                       "float8_e5m2");
  if (q_dims.size() != 3 || kv_dims.size() != 5 || block_tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("cpu attention: q must be [T, H, D], kv [L, P, S, 2*Hkv, D]");
  const int64_t T = q_dims[0], Hq = q_dims[1], D = q_dims[2];
  const int64_t L = kv_dims[0], Hkv = kv_dims[3] / 2;
  const int64_t R = kv_lens.dimensions()[0];
  if (kv_dims[4] != D || Hkv == 0 || Hq % Hkv != 0)
    return ffi::Error::InvalidArgument("cpu attention: head_dim or head counts of q and kv disagree");
  if (cu_q_lens.element_count() != static_cast<size_t>(R + 1) || block_tables.dimensions()[0] != R)
    return ffi::Error::InvalidArgument("cpu attention: kv_lens [R], block_tables [R, pages] and cu_q_lens "
                                       "[R + 1] disagree");
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->problem;
  p = Problem{q.typed_data(), kv.untyped_data(), kv_lens.typed_data(), block_tables.typed_data(),
              cu_q_lens.typed_data(), out->typed_data(), kv_dims[1], kv_dims[2], Hkv, Hq / Hkv, D,
              block_tables.dimensions()[1], std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1),
              window.typed_data()[0], sm_scale, soft_cap, sinks};
  switch (pages) {
    case Pages::kBf16: shared->run = pick<uint16_t>(D), shared->merge = pick_merge<uint16_t>(D); break;
    case Pages::kE4M3: shared->run = pick<E4M3, uint16_t>(D), shared->merge = pick_merge<E4M3, uint16_t>(D); break;
    case Pages::kE5M2: shared->run = pick<E5M2, uint16_t>(D), shared->merge = pick_merge<E5M2, uint16_t>(D); break;
    default: shared->run = pick<float>(D), shared->merge = pick_merge<float>(D);
  }
  // Tokens that no item writes (a bucket's padding) get zeros. Only those: zeroing the whole output first
  // wrote 1.2 MB a layer for a 512-token step that the items then wrote again.
  const int64_t token_floats = Hq * D;
  auto zero = [&](int64_t from, int64_t to) {
    if (from < to) std::memset(p.out + from * token_floats, 0, sizeof(float) * (to - from) * token_floats);
  };
  const int32_t live = std::clamp<int32_t>(num_seqs.typed_data()[0], 0, static_cast<int32_t>(R));
  int32_t covered = 0;  // tokens below are written by an item
  for (int32_t r = 0; r < live; ++r) {
    const int32_t first = std::clamp<int32_t>(p.cu_q_lens[r], 0, T);
    const int32_t end = std::clamp<int32_t>(p.cu_q_lens[r + 1], first, T);
    zero(covered, first);
    covered = std::max(covered, end);
    for (int32_t t = first; t < end; t += kTileTokens)
      shared->items.push_back(Item{r, t, std::min(t + kTileTokens, end)});
  }
  zero(covered, T);
  split_items(*shared, std::max<int64_t>(pool.num_threads(), 1));
  share_work(pool, shared, static_cast<int64_t>(shared->items.size()));
  for (const auto& [first, parts] : shared->splits) shared->merge(p, &shared->items[first], parts);
  return ffi::Error::Success();
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                     ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                     ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window, float sm_scale,
                     float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  return AttentionOf(pool, q, kv, layer, kv_lens, block_tables, cu_q_lens, num_seqs, window, nullptr, sm_scale,
                     soft_cap, out);
}

// The same with each query head's sink logit (a target of its own: models without sinks keep the call above).
ffi::Error AttentionSinks(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                          ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> sinks,
                          float sm_scale, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  if (q.dimensions().size() != 3 || sinks.element_count() != static_cast<size_t>(q.dimensions()[1]))
    return ffi::Error::InvalidArgument("cpu attention: sinks must hold one value per query head");
  return AttentionOf(pool, q, kv, layer, kv_lens, block_tables, cu_q_lens, num_seqs, window, sinks.typed_data(),
                     sm_scale, soft_cap, out);
}

// The pool a K/V writer writes into: its result, aliased to the input pool (cpu.py); where XLA did not alias
// them after all, the result starts as a copy of the input.
inline void* writable_pool(ffi::AnyBuffer kv, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() != kv.untyped_data()) std::memcpy(out->untyped_data(), kv.untyped_data(), kv.size_bytes());
  return out->untyped_data();
}

// The element where a token's K/V row (`width` values) starts in layer l of a pool [L, P, S, 2*Hkv, D], or -1
// where the token has no slot: a page id outside [0, P) (padding tokens) or an offset outside [0, S).
inline int64_t kv_row_at(int64_t l, int64_t P, int64_t S, int64_t width, int32_t page, int32_t offset) {
  if (page < 0 || page >= P || offset < 0 || offset >= S) return -1;
  return ((l * P + page) * S + offset) * width;
}

// x rounded to nearest even in a float8 format of kMant mantissa bits and exponent bias kBias, saturated at its
// largest finite magnitude (`max_code`, the bits without the sign; infinities too); NaN stays NaN (`nan_code`).
// What clipping to that magnitude and then converting gives in JAX (attention.to_cache).
template <int kMant, int kBias>
inline uint8_t to_fp8(float x, uint32_t max_code, uint8_t nan_code) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t magnitude = bits & 0x7fffffff;
  if (magnitude > 0x7f800000) return sign | nan_code;
  const int exponent = static_cast<int>(magnitude >> 23) - 127;
  uint32_t code;
  if (exponent < 1 - kBias) {  // below the smallest normal: a multiple of the smallest subnormal (ties to even)
    const float a = std::fabs(x) * std::ldexp(1.0f, kBias - 1 + kMant);
    code = static_cast<uint32_t>(std::nearbyint(a));
  } else {
    constexpr int kShift = 23 - kMant;
    const uint32_t mantissa = magnitude & 0x7fffff, rest = mantissa & ((1u << kShift) - 1), half = 1u << (kShift - 1);
    code = (static_cast<uint32_t>(exponent + kBias) << kMant) | (mantissa >> kShift);
    if (rest > half || (rest == half && (code & 1))) ++code;  // a carry moves into the exponent, as it should
  }
  return sign | static_cast<uint8_t>(std::min(code, max_code));
}

// Row `row` (2 * Hkv * D float32 values, head h's K at 2h, its V at 2h + 1) into the pool at element `at`,
// each K value divided by scales[0] and each V value by scales[1] (the KV cache's scales; 1 where none), rounded
// to nearest even to the pool's dtype (float8: saturated).
inline void store_kv_row(void* pool, Pages pages, int64_t at, const float* row, int64_t width, int64_t D,
                         const float* scales) {
  thread_local std::vector<float> scaled;
  for (int64_t start = 0; start < width; start += D) {
    const float scale = scales[(start / D) % 2];
    const float* src = row + start;
    if (scale != 1.0f) {
      scaled.resize(D);
      for (int64_t i = 0; i < D; ++i) scaled[i] = src[i] / scale;
      src = scaled.data();
    }
    switch (pages) {
      case Pages::kBf16: {
        uint16_t* dst = static_cast<uint16_t*>(pool) + at + start;
        for (int64_t i = 0; i < D; ++i) dst[i] = round_bf16(src[i]);
        break;
      }
      case Pages::kE4M3: {
        uint8_t* dst = static_cast<uint8_t*>(pool) + at + start;
        for (int64_t i = 0; i < D; ++i) dst[i] = to_fp8<3, 7>(src[i], 0x7e, 0x7f);
        break;
      }
      case Pages::kE5M2: {
        uint8_t* dst = static_cast<uint8_t*>(pool) + at + start;
        for (int64_t i = 0; i < D; ++i) dst[i] = to_fp8<2, 15>(src[i], 0x7b, 0x7e);
        break;
      }
      default: std::memcpy(static_cast<float*>(pool) + at + start, src, sizeof(float) * D);
    }
  }
}

// Writes this step's K/V rows into their pages in place: kv[layer, pages[t], offsets[t]] = rows[t] (float32 rows, K
// divided by scales[0] and V by scales[1], rounded to nearest even to the pool's dtype). A page id outside [0, P)
// (padding tokens) or an offset outside [0, S) is skipped. The pool is aliased to the result (cpu.py), so XLA
// neither copies it nor, as its own scatter into a bfloat16 pool does on CPU, converts it around each write.
ffi::Error WriteKv(ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> rows,
                   ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::F32> scales,
                   ffi::Result<ffi::AnyBuffer> out) {
  const auto kv_dims = kv.dimensions();
  const auto row_dims = rows.dimensions();
  const Pages kind = pages_of(kv.element_type());
  if (kind == Pages::kUnsupported || out->element_type() != kv.element_type())
    return ffi::Error::InvalidArgument("cpu write_kv: the pool must be float32, bfloat16, float8_e4m3fn or "
                                       "float8_e5m2");
  if (scales.element_count() != 2) return ffi::Error::InvalidArgument("cpu write_kv: scales must be [2]");
  if (kv_dims.size() != 5 || row_dims.size() != 3 || row_dims[1] != kv_dims[3] || row_dims[2] != kv_dims[4] ||
      pages.element_count() != static_cast<size_t>(row_dims[0]) || offsets.element_count() != pages.element_count())
    return ffi::Error::InvalidArgument("cpu write_kv: pool [L, P, S, 2*Hkv, D], rows [T, 2*Hkv, D], pages and "
                                       "offsets [T] disagree");
  const int64_t L = kv_dims[0], P = kv_dims[1], S = kv_dims[2], width = kv_dims[3] * kv_dims[4];
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  void* pool = writable_pool(kv, out);
  for (int64_t t = 0; t < row_dims[0]; ++t) {
    const int64_t at = kv_row_at(l, P, S, width, pages.typed_data()[t], offsets.typed_data()[t]);
    if (at >= 0)
      store_kv_row(pool, kind, at, rows.typed_data() + t * width, width, kv_dims[4], scales.typed_data());
  }
  return ffi::Error::Success();
}

// y = x * cos + rotate_half(x) * sin over one head's D values (transformers' half-split rotary layout).
inline void rotate(const float* x, const float* cos, const float* sin, float* y, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) y[d] = x[d] * cos[d] + -x[d + half] * sin[d];
  for (int64_t d = half; d < D; ++d) y[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

// Tokens per work item of RopeWriteKv: a decode step's (up to 64) run on the calling thread; a prefill step's
// are shared with XLA's pool (512 tokens: 8 items). Measured on the AMX Xeon, prefill alone (256 x 128-token
// prompts, one output token, 512-token steps): 45.2-47.6 -> 49.0-51.9 requests/s against the calling thread
// alone.
constexpr int64_t kRopeTokens = 64;

struct RopeShared {
  const float *qkv, *cos, *sin;
  float* q;
  void* pool;
  Pages kind;
  const float* scales;  // K's and V's (WriteKv)
  const int32_t *pages, *offsets;
  int64_t T, Hq, Hkv, D, l, P, S, width, items;
  std::atomic<int64_t> next{0}, done{0};

  void work() {
    thread_local std::vector<float> row;  // [2 * Hkv, D]: one token's rotated k and its v, interleaved by head
    row.resize(width);
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      for (int64_t t = i * kRopeTokens; t < std::min(T, (i + 1) * kRopeTokens); ++t) {
        const float* src = qkv + t * (Hq + 2 * Hkv) * D;
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < Hq; ++h) rotate(src + h * D, c, s, q + (t * Hq + h) * D, D);
        const int64_t at = kv_row_at(l, P, S, width, pages[t], offsets[t]);
        if (at < 0) continue;
        for (int64_t h = 0; h < Hkv; ++h) {
          rotate(src + (Hq + h) * D, c, s, row.data() + 2 * h * D, D);
          std::memcpy(row.data() + (2 * h + 1) * D, src + (Hq + Hkv + h) * D, sizeof(float) * D);
        }
        store_kv_row(pool, kind, at, row.data(), width, D, scales);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The rotary embedding of this step's q and k straight from the fused projection, with K/V written into
// their pages as WriteKv writes them: qkv [T, (Hq + 2 Hkv) D] holds each token's q heads, k heads and v heads;
// cos, sin [T, D] are the rotary tables (scaling included). Returns q [T, Hq, D] rotated, and the pool
// (aliased). One pass where XLA ran a split, two rotations, the K/V interleave and then the writer.
ffi::Error RopeWriteKv(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> cos,
                       ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::F32> scales,
                       ffi::ResultBuffer<ffi::F32> q, ffi::Result<ffi::AnyBuffer> out) {
  const auto kv_dims = kv.dimensions();
  const auto q_dims = q->dimensions();
  const Pages kind = pages_of(kv.element_type());
  if (kind == Pages::kUnsupported || out->element_type() != kv.element_type())
    return ffi::Error::InvalidArgument("cpu rope_write_kv: the pool must be float32, bfloat16, float8_e4m3fn or "
                                       "float8_e5m2");
  if (scales.element_count() != 2) return ffi::Error::InvalidArgument("cpu rope_write_kv: scales must be [2]");
  if (kv_dims.size() != 5 || q_dims.size() != 3 || qkv.dimensions().size() != 2 || q_dims[2] != kv_dims[4] ||
      q_dims[2] % 2 || qkv.dimensions()[0] != q_dims[0])
    return ffi::Error::InvalidArgument("cpu rope_write_kv: qkv [T, W], pool [L, P, S, 2*Hkv, D] and q [T, Hq, D] "
                                       "(D even) disagree");
  const int64_t T = q_dims[0], Hq = q_dims[1], D = q_dims[2], Hkv = kv_dims[3] / 2;
  const int64_t L = kv_dims[0], P = kv_dims[1], S = kv_dims[2], width = kv_dims[3] * kv_dims[4];
  const size_t tokens = static_cast<size_t>(T);
  if (qkv.dimensions()[1] != (Hq + 2 * Hkv) * D || cos.element_count() != tokens * D ||
      sin.element_count() != tokens * D || pages.element_count() != tokens || offsets.element_count() != tokens)
    return ffi::Error::InvalidArgument("cpu rope_write_kv: qkv must be [T, (Hq + 2*Hkv) * D], cos and sin [T, D], "
                                       "pages and offsets [T]");
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  void* pool = writable_pool(kv, out);
  auto shared = std::make_shared<RopeShared>();
  RopeShared& r = *shared;
  r.qkv = qkv.typed_data(), r.cos = cos.typed_data(), r.sin = sin.typed_data(), r.q = q->typed_data();
  r.pool = pool, r.kind = kind, r.scales = scales.typed_data();
  r.pages = pages.typed_data(), r.offsets = offsets.typed_data();
  r.T = T, r.Hq = Hq, r.Hkv = Hkv, r.D = D, r.l = l, r.P = P, r.S = S, r.width = width;
  r.items = (T + kRopeTokens - 1) / kRopeTokens;
  share_work(thread_pool, shared, r.items);
  return ffi::Error::Success();
}

// The identity, aliased: XLA must hold x in a buffer here, so it cannot fuse x's computation into each of
// x's consumers and evaluate it again in each (cpu.fusion_barrier).
ffi::Error FusionBarrier(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  if (out->size_bytes() != x.size_bytes()) return ffi::Error::InvalidArgument("cpu fusion_barrier: sizes differ");
  if (out->untyped_data() != x.untyped_data()) std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuRopeWriteKv, RopeWriteKv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // qkv [T, (Hq + 2*Hkv) * D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cos [T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sin [T, D]
                                  .Arg<ffi::AnyBuffer>()          // kv pool (aliased to the second result)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pages [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // offsets [T]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scales [2]: K's and V's
                                  .Ret<ffi::Buffer<ffi::F32>>()   // q [T, Hq, D], rotated
                                  .Ret<ffi::AnyBuffer>());        // the pool

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuFusionBarrier, FusionBarrier,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

// The attention calls' operands up to the sliding window (both targets), to which each adds its own.
auto attention_operands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()   // q
      .Arg<ffi::AnyBuffer>()          // kv pages: float32, bfloat16 or float8
      .Arg<ffi::Buffer<ffi::S32>>()   // layer
      .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
      .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
      .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens
      .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs
      .Arg<ffi::Buffer<ffi::S32>>();  // sliding window (<= 0: none)
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuAttention, Attention,
                              attention_operands()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")        // <= 0: none
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuAttentionSinks, AttentionSinks,
                              attention_operands()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks [Hq]
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")        // <= 0: none
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuWriteKv, WriteKv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // kv pool (aliased to the result)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::F32>>()   // rows [T, 2*Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pages [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // offsets [T]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scales [2]: K's and V's
                                  .Ret<ffi::AnyBuffer>());        // the pool
