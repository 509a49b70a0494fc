// Ragged paged attention for XLA:CPU, called through the XLA FFI (see cpu.py, which builds and registers it).
//
// Same contract as reference.py: q [T, Hq, D], the whole paged pool [L, P, S, 2*Hkv, D] with K and V
// interleaved on the head axis (row 2h is head h's K, 2h+1 its V), read in place at `layer`. Work items are
// (request, tile of up to kTileTokens query tokens); each walks its request's keys in blocks with an online
// softmax, so every key's K/V row is read once per item straight from its page. Items are shared between the
// caller and XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTileTokens = 8;  // query tokens per work item (multi-token requests)
constexpr int kKeyBlock = 32;    // keys scored before each softmax rescale
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp for x <= 0 (scores minus their running max) by range reduction and a degree-6 polynomial (Cephes);
// plain arithmetic, so GCC vectorises the loops that call it. Relative error ~1e-7.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct Problem {
  const float* q;
  const float* kv;
  const int32_t* kv_lens;
  const int32_t* block_tables;
  const int32_t* cu_q_lens;
  float* out;
  int64_t num_pages, page_size, num_kv_heads, group, head_dim, pages_per_seq, layer;
  int32_t window;
  float sm_scale, soft_cap;
};

struct Item {
  int32_t req, first_token, end_token;
};

// 8 floats in one vector register (AVX) or two (SSE); loads and stores need no alignment.
typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* x) {
  v8 v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

inline void store8(float* x, v8 v) { std::memcpy(x, &v, sizeof(v)); }

inline float sum8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// Scores of one query row against keys [first, last]: four keys at a time, so four independent chains of
// FMAs run side by side. kD: the head dimension when known at compile time (a multiple of 8), else 0.
template <int kD>
inline void score_keys(const float* qi, const float* const* key_rows, int64_t k_offset, int first, int last,
                       int64_t D, float* s) {
  int j = first;
  if constexpr (kD > 0) {
    for (; j + 3 <= last; j += 4) {
      const float *k0 = key_rows[j] + k_offset, *k1 = key_rows[j + 1] + k_offset;
      const float *k2 = key_rows[j + 2] + k_offset, *k3 = key_rows[j + 3] + k_offset;
      v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int d = 0; d < kD; d += 8) {
        const v8 q = load8(qi + d);
        a0 += q * load8(k0 + d);
        a1 += q * load8(k1 + d);
        a2 += q * load8(k2 + d);
        a3 += q * load8(k3 + d);
      }
      s[j] = sum8(a0), s[j + 1] = sum8(a1), s[j + 2] = sum8(a2), s[j + 3] = sum8(a3);
    }
  }
  for (; j <= last; ++j) {
    const float* k = key_rows[j] + k_offset;
    float dot = 0.0f;
    for (int64_t d = 0; d < D; ++d) dot += qi[d] * k[d];
    s[j] = dot;
  }
}

// acc = acc * correction + sum_j weights[j] * V_j, the accumulator held in registers across the keys.
template <int kD>
inline void accumulate_values(float* ai, float correction, const float* const* key_rows, int64_t v_offset,
                              int first, int last, int64_t D, const float* weights) {
  if constexpr (kD > 0) {
    v8 a[kD / 8];
    for (int c = 0; c < kD / 8; ++c) a[c] = load8(ai + 8 * c) * correction;
    for (int j = first; j <= last; ++j) {
      const float* v = key_rows[j] + v_offset;
      const float w = weights[j];
      for (int c = 0; c < kD / 8; ++c) a[c] += w * load8(v + 8 * c);
    }
    for (int c = 0; c < kD / 8; ++c) store8(ai + 8 * c, a[c]);
  } else {
    for (int64_t d = 0; d < D; ++d) ai[d] *= correction;
    for (int j = first; j <= last; ++j) {
      const float* v = key_rows[j] + v_offset;
      const float w = weights[j];
      for (int64_t d = 0; d < D; ++d) ai[d] += w * v[d];
    }
  }
}

// One request's tokens [first_token, end_token) over all heads. A key's K/V for every head are one
// contiguous row of the page, so the walk reads pages sequentially.
template <int kD>
void run_item(const Problem& p, const Item& item) {
  const int64_t D = kD > 0 ? kD : p.head_dim, G = p.group, W = 2 * p.num_kv_heads, Hq = p.num_kv_heads * p.group;
  const int32_t q_start = p.cu_q_lens[item.req];
  const int32_t q_len = p.cu_q_lens[item.req + 1] - q_start;
  const int32_t ctx = p.kv_lens[item.req];
  const int rows = (item.end_token - item.first_token) * Hq;  // row i: token first + i / Hq, head i % Hq
  thread_local std::vector<float> buffer;
  thread_local std::vector<int32_t> bounds;
  buffer.resize(static_cast<size_t>(rows) * (2 * D + 2) + 2 * kKeyBlock);
  bounds.resize(2 * static_cast<size_t>(rows));
  float* qs = buffer.data();         // [rows, D], scaled
  float* acc = qs + rows * D;        // [rows, D]
  float* m = acc + rows * D;         // [rows]
  float* l = m + rows;               // [rows]
  float* s = l + rows;               // [kKeyBlock]: scores, then weights
  int32_t* lo = bounds.data();       // first and last key of each row
  int32_t* hi = lo + rows;
  int32_t key_lo = std::numeric_limits<int32_t>::max(), key_hi = -1;
  for (int i = 0; i < rows; ++i) {
    const int32_t token = item.first_token + i / Hq;
    const float* src = p.q + (token * Hq + i % Hq) * D;
    for (int64_t d = 0; d < D; ++d) qs[i * D + d] = src[d] * p.sm_scale;
    const int32_t pos = ctx - q_len + (token - q_start);
    hi[i] = std::min(pos, ctx - 1);
    lo[i] = p.window > 0 ? std::max(pos - p.window + 1, 0) : 0;
    key_lo = std::min(key_lo, lo[i]);
    key_hi = std::max(key_hi, hi[i]);
    m[i] = kNegInf;
    l[i] = 0.0f;
  }
  std::fill(acc, acc + rows * D, 0.0f);
  const float* key_rows[kKeyBlock];  // [2 * Hkv, D] of each key
  const int32_t* table = p.block_tables + item.req * p.pages_per_seq;
  for (int32_t block = key_lo; block <= key_hi; block += kKeyBlock) {
    const int n = std::min<int32_t>(kKeyBlock, key_hi - block + 1);
    bool usable[kKeyBlock];
    for (int j = 0; j < n; ++j) {
      const int32_t key = block + j;
      const int64_t slot = key / p.page_size;
      const int32_t page = slot < p.pages_per_seq ? table[slot] : -1;
      usable[j] = page >= 0 && page < p.num_pages;  // a bad page id is skipped, never read
      key_rows[j] = p.kv + ((p.layer * p.num_pages + (usable[j] ? page : 0)) * p.page_size + key % p.page_size) * W * D;
    }
    for (int i = 0; i < rows; ++i) {
      const int32_t first = std::max(lo[i], block) - block, last = std::min(hi[i], block + n - 1) - block;
      if (first > last) continue;
      const int64_t k_offset = 2 * ((i % Hq) / G) * D;
      const float* qi = qs + i * D;
      score_keys<kD>(qi, key_rows, k_offset, first, last, D, s);
      float block_max = kNegInf;
      for (int j = first; j <= last; ++j) {
        if (p.soft_cap > 0.0f) s[j] = p.soft_cap * std::tanh(s[j] / p.soft_cap);
        if (!usable[j]) s[j] = kNegInf;
        block_max = std::max(block_max, s[j]);
      }
      if (block_max == kNegInf) continue;
      const float m_new = std::max(m[i], block_max);
      const float correction = m[i] == kNegInf ? 0.0f : exp_nonpositive(m[i] - m_new);
      m[i] = m_new;
      float sum = 0.0f;
      for (int j = first; j <= last; ++j) {  // -inf scores clamp to exp(-87) ~ 0 and are zeroed
        const float weight = exp_nonpositive(s[j] - m_new);
        s[j] = s[j] == kNegInf ? 0.0f : weight;
        sum += s[j];
      }
      l[i] = l[i] * correction + sum;
      accumulate_values<kD>(acc + i * D, correction, key_rows, k_offset + D, first, last, D, s);
    }
  }
  for (int i = 0; i < rows; ++i) {
    const int32_t token = item.first_token + i / Hq;
    float* dst = p.out + (token * Hq + i % Hq) * D;
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[i * D + d] * inv;
  }
}

struct Shared {
  Problem problem;
  void (*run)(const Problem&, const Item&);
  std::vector<Item> items;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};

  void work() {
    for (size_t i; (i = next.fetch_add(1)) < items.size();) {
      run(problem, items[i]);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kv,
                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                     ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                     ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window, float sm_scale,
                     float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = kv.dimensions();
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
  p = Problem{q.typed_data(), kv.typed_data(), kv_lens.typed_data(), block_tables.typed_data(),
              cu_q_lens.typed_data(), out->typed_data(), kv_dims[1], kv_dims[2], Hkv, Hq / Hkv, D,
              block_tables.dimensions()[1], std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1),
              window.typed_data()[0], sm_scale, soft_cap};
  shared->run = D == 64 ? run_item<64> : D == 128 ? run_item<128> : D == 256 ? run_item<256> : run_item<0>;
  std::memset(p.out, 0, sizeof(float) * T * Hq * D);  // padding tokens get zeros
  const int32_t live = std::clamp<int32_t>(num_seqs.typed_data()[0], 0, static_cast<int32_t>(R));
  for (int32_t r = 0; r < live; ++r) {
    const int32_t first = std::clamp<int32_t>(p.cu_q_lens[r], 0, T);
    const int32_t end = std::clamp<int32_t>(p.cu_q_lens[r + 1], first, T);
    for (int32_t t = first; t < end; t += kTileTokens)
      shared->items.push_back(Item{r, t, std::min(t + kTileTokens, end)});
  }
  const size_t helpers = std::min<size_t>(std::max<int64_t>(pool.num_threads(), 0), shared->items.size());
  for (size_t i = 1; i < helpers; ++i) pool.Schedule([shared] { shared->work(); });
  shared->work();
  // Helpers that start late find no items; the caller waits only for items already taken.
  while (shared->done.load(std::memory_order_acquire) < shared->items.size()) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // kv pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sliding window (<= 0: none)
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")        // <= 0: none
                                  .Ret<ffi::Buffer<ffi::F32>>());
