// The sampler's kernels for XLA:CPU, called through the XLA FFI (see cpu.py).
//
// first_argmax: for each row of x [R, V] (float32) the index of its first maximum, a NaN counting as the
// maximum (the first NaN wins), as jnp.argmax gives. XLA:CPU runs that as a max, a compare-and-select into an
// index array and a min (or as a variadic reduce, slower still): ~1.8 ms for the [64, 32000] logits of a
// decode step, where one pass over the rows, shared with XLA's intra-op pool, takes a tenth of that.
//
// The row is taken after the greedy sampler's logit processing (sampler.process_logits without slot state):
// bias_values[r, j] added at bias_ids[r, j], then -inf at banned[r, j], ids outside [0, V) unused. XLA applied
// those as two scatters into a copy of the logits before the argmax: the greedy sampling step took 0.67 ms for
// [64, 49152] logits in cache and 1.64 ms for logits just written, with nothing to apply, against 0.22 and
// 0.47 ms now. A row with nothing to apply is read as it is; one with something is copied, patched and read.
//
// sample: the random draw of sampler.sample (temperature, min-p, top-k, top-p) on the same patched rows. XLA:CPU
// sorted [64, 49152] logits in ~0.6 s to find top-k's and top-p's cutoff and drew with jax.random's Gumbel
// noise in ~60 ms; here a histogram of each row's values finds the cutoff (a sort of the one or two buckets
// where it falls settles it exactly; a top-k of at most 1024 takes its k largest during the scaling pass
// instead), and one uniform number per row, from its seed and counter, picks the token by inverse transform:
// ~1.5 ms for a temperature-only 64-row step, ~2.6 ms with top-k 50 (and top-p), ~4.5 ms with top-p alone.
// In the full variant, sample also applies the slot state first (penalties, allowed tokens), as
// process_logits does, to the rows that hold a slot.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cpu_pool.h"
#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRowsPerItem = 4;

typedef uint8_t u8x16 __attribute__((vector_size(16)));

// The first maximum of x[0, n) (a NaN wins, the first one); 0 for n == 0.
int32_t first_argmax(const float* x, int64_t n) {
  const v16 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16 best = splat(-std::numeric_limits<float>::infinity()), best_at = splat(-1.0f), at = lanes;
  i32x16 nan = {};
  int64_t k = 0;
  // Each lane keeps its first maximum (a strict > never moves to a later equal value). Indices are kept as
  // floats, exact below 2^24: rows longer than that take the scalar loop.
  if (n < (int64_t{1} << 24)) {
    for (; k + 16 <= n; k += 16) {
      v16 v;
      __builtin_memcpy(&v, x + k, sizeof(v));
      nan |= v != v;
      const i32x16 greater = v > best;
      best = greater ? v : best;
      best_at = greater ? at : best_at;
      at += 16.0f;
    }
  }
  bool any_nan = false;
  for (int j = 0; j < 16; ++j) any_nan |= nan[j] != 0;
  if (any_nan) {  // rare: the first NaN, found again one element at a time
    for (int64_t i = 0; i < k; ++i)
      if (std::isnan(x[i])) return static_cast<int32_t>(i);
  }
  float top = -std::numeric_limits<float>::infinity();
  int64_t top_at = -1;
  for (int j = 0; j < 16; ++j) {
    if (best_at[j] < 0.0f) continue;  // the lane never rose above -inf
    const int64_t i = static_cast<int64_t>(best_at[j]);
    if (best[j] > top || (best[j] == top && i < top_at)) top = best[j], top_at = i;
  }
  for (; k < n; ++k) {
    if (std::isnan(x[k])) return static_cast<int32_t>(k);
    if (x[k] > top) top = x[k], top_at = k;
  }
  // Nothing above -inf (a row of -inf or an empty row): the first element.
  return static_cast<int32_t>(top_at < 0 ? 0 : top_at);
}

// A row of x after the greedy sampler's logit processing: bias_values[r, j] added at bias_ids[r, j], then -inf at
// banned[r, j] (ids outside [0, V) unused). A row with nothing to apply is read where it is; one with something
// is copied into a thread-local buffer and patched there.
struct Rows {
  const float* x;
  int64_t rows, cols;
  const int32_t* bias_ids;  // [rows, num_bias]
  const float* bias_values;
  const int32_t* banned;    // [rows, num_banned]
  int64_t num_bias = 0, num_banned = 0;
  // The full sampler's slot state (sampler.process_logits with slot state), where given: row r takes slot
  // slots[r] of output_counts, prompt_mask and allowed [num_slots, cols] (slots outside [0, num_slots): none).
  const int32_t* output_counts = nullptr;
  const bool *prompt_mask = nullptr, *allowed = nullptr;
  const int32_t* slots = nullptr;
  const float *presence = nullptr, *frequency = nullptr, *repetition = nullptr;
  int64_t num_slots = 0;

  bool used(int32_t id) const { return id >= 0 && id < cols; }

  int64_t slot(int64_t r) const {
    return slots != nullptr && slots[r] >= 0 && slots[r] < num_slots ? slots[r] : -1;
  }

  const float* row(int64_t r) const {
    const float* x_r = x + r * cols;
    const int32_t* ids = bias_ids + r * num_bias;
    const int32_t* bans = banned + r * num_banned;
    const int64_t s = slot(r);
    bool patched = s >= 0;
    for (int64_t j = 0; j < num_bias && !patched; ++j) patched = used(ids[j]);
    for (int64_t j = 0; j < num_banned && !patched; ++j) patched = used(bans[j]);
    if (!patched) return x_r;
    thread_local std::vector<float> copy;
    if (s < 0) {
      copy.assign(x_r, x_r + cols);
    } else {  // sampler.apply_penalties, then the allowed tokens, 16 tokens at a time
      copy.resize(cols);
      const int32_t* counts = output_counts + s * cols;
      const bool* prompt = prompt_mask + s * cols;
      const bool* allow = allowed + s * cols;
      const float rep = repetition[r], freq = frequency[r], pres = presence[r];
      const v16 inf = splat(-std::numeric_limits<float>::infinity());
      int64_t j = 0;
      for (; j + 16 <= cols; j += 16) {
        v16 v;
        i32x16 c;
        u8x16 in_prompt, ok;
        __builtin_memcpy(&v, x_r + j, sizeof(v));
        __builtin_memcpy(&c, counts + j, sizeof(c));
        __builtin_memcpy(&in_prompt, prompt + j, sizeof(in_prompt));
        __builtin_memcpy(&ok, allow + j, sizeof(ok));
        const i32x16 seen = (__builtin_convertvector(in_prompt, i32x16) != 0) | (c > 0);
        const v16 repeated = v > v16{} ? v / rep : v * rep;
        v = seen ? repeated : v;
        v -= freq * __builtin_convertvector(c, v16);
        v -= c > 0 ? splat(pres) : v16{};
        v = __builtin_convertvector(ok, i32x16) != 0 ? v : inf;
        __builtin_memcpy(copy.data() + j, &v, sizeof(v));
      }
      for (; j < cols; ++j) {
        float v = x_r[j];
        const int32_t c = counts[j];
        if (prompt[j] || c > 0) v = v > 0.0f ? v / rep : v * rep;
        v -= freq * static_cast<float>(c);
        v -= c > 0 ? pres : 0.0f;
        copy[j] = allow[j] ? v : -std::numeric_limits<float>::infinity();
      }
    }
    for (int64_t j = 0; j < num_bias; ++j)
      if (used(ids[j])) copy[ids[j]] += bias_values[r * num_bias + j];
    for (int64_t j = 0; j < num_banned; ++j)
      if (used(bans[j])) copy[bans[j]] = -std::numeric_limits<float>::infinity();
    return copy.data();
  }
};

// The FFI's checks of x [R, V], bias_ids and bias_values [R, B], banned [R, N]; fills `rows`.
ffi::Error bind_rows(const char* name, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S32>& bias_ids,
                     ffi::Buffer<ffi::F32>& bias_values, ffi::Buffer<ffi::S32>& banned, Rows& rows) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument(std::string(name) + ": x must be [R, V]");
  const auto bias_dims = bias_ids.dimensions(), banned_dims = banned.dimensions();
  if (bias_dims.size() != 2 || bias_dims[0] != dims[0] || bias_values.dimensions().size() != 2 ||
      bias_values.dimensions()[0] != dims[0] || bias_values.dimensions()[1] != bias_dims[1] ||
      banned_dims.size() != 2 || banned_dims[0] != dims[0])
    return ffi::Error::InvalidArgument(std::string(name) + ": bias_ids, bias_values [R, B] and banned [R, N]");
  rows.x = x.typed_data();
  rows.rows = dims[0];
  rows.cols = dims[1];
  rows.bias_ids = bias_ids.typed_data();
  rows.bias_values = bias_values.typed_data();
  rows.banned = banned.typed_data();
  rows.num_bias = bias_dims[1];
  rows.num_banned = banned_dims[1];
  return ffi::Error::Success();
}

struct Shared : Rows {
  int32_t* out;
  int64_t items;
  std::atomic<int64_t> next{0}, done{0};

  void work() {
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      for (int64_t r = i * kRowsPerItem; r < std::min(rows, (i + 1) * kRowsPerItem); ++r)
        out[r] = first_argmax(row(r), cols);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> bias_ids,
                  ffi::Buffer<ffi::F32> bias_values, ffi::Buffer<ffi::S32> banned, ffi::ResultBuffer<ffi::S32> out) {
  auto shared = std::make_shared<Shared>();
  if (auto error = bind_rows("cpu first_argmax", x, bias_ids, bias_values, banned, *shared); !error.success())
    return error;
  if (out->element_count() != static_cast<size_t>(shared->rows))
    return ffi::Error::InvalidArgument("cpu first_argmax: the result must be [R]");
  shared->out = out->typed_data();
  shared->items = (shared->rows + kRowsPerItem - 1) / kRowsPerItem;
  share_work(pool, shared, shared->items);
  return ffi::Error::Success();
}

// ---- Random sampling -----------------------------------------------------------------------------------------

typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int64_t i64x16 __attribute__((vector_size(128)));

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kBucketShift = 20;  // buckets of the order key's top 12 bits: sign, exponent, 3 mantissa bits
constexpr int kBuckets = 1 << (32 - kBucketShift);

// A key that orders floats as their values (NaN excluded): a < b exactly when key(a) < key(b); -0 is +0.
inline uint32_t order_key(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// A uniform double in [0, 1) from (seed, counter): SplitMix64's finaliser over the seed, then over that mixed
// with the counter (a counter-based generator: each row's draw depends on its sequence's seed and position only).
inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline double uniform(uint32_t seed, int32_t counter) {
  const uint64_t bits = mix64(mix64(seed) ^ (static_cast<uint64_t>(static_cast<uint32_t>(counter)) << 1 | 1));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

// exp16 of one value: the weights the draw computes 16 at a time, where a decision must agree with the draw's.
inline float exp1(float x) { return exp16(splat(x))[0]; }

struct Candidate {
  float value, weight;
};

struct SampleShared : Rows {
  const float *temperature, *top_p, *min_p;
  const int32_t *top_k, *counters;
  const uint32_t* seeds;
  int32_t* out;
  float* cutoff;
  std::atomic<int64_t> next{0}, done{0};

  // Bucket b's (value, weight) pairs, the largest value first (`into` sized for them, branch-free).
  // Out of line, as truncation_cutoff: inlined into sample_row, their loops ran short of registers.
  __attribute__((noinline)) static void gather(const float* s, const float* e, const uint16_t* bucket, int64_t n,
                                               int64_t b, int64_t size, std::vector<Candidate>& into) {
    into.resize(size + 1);
    Candidate* c = into.data();
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
      c[m] = {s[i], e[i]};
      m += bucket[i] == b;
    }
    into.resize(m);
    std::sort(into.begin(), into.end(), [](const Candidate& a, const Candidate& d) { return a.value > d.value; });
  }

  // The smallest value that top-k and top-p keep among the finite values s[i] (weights e[i] = exp(s[i] - max);
  // bucket[i] = order_key(s[i]) >> kBucketShift, 0 for -inf), as a sort of the row would find it: ranks below
  // k, and ranks whose top-k-normalised mass before them is below p (the first always); every value equal to
  // the cutoff is kept too. -inf where nothing is cut. The ranks are found through a histogram of the values
  // (count and mass per bucket) and a sort of the one or two buckets where the cut falls.
  __attribute__((noinline)) static float truncation_cutoff(const float* s, const float* e, const uint16_t* bucket,
                                                          int64_t n, int64_t k, int64_t finite, float p) {
    // Four interleaved histograms: consecutive tokens often share a bucket, and one histogram's increments
    // would wait on each other. Their strides are not multiples of 4 KiB: a load whose address matches an
    // earlier store's low 12 bits waits on it (4K aliasing), which tokens of one bucket hit in every way
    // (10.8 -> 6.0 ms for top-p over [64, 49152] logits).
    constexpr int kWays = 4;
    constexpr int64_t kStride = kBuckets + 40;
    thread_local std::vector<int32_t> counts(kWays * kStride);
    thread_local std::vector<double> masses(kWays * kStride);
    thread_local std::vector<Candidate> top_bucket, other;
    std::fill(counts.begin(), counts.end(), 0);
    int32_t* count = counts.data();
    double* mass = masses.data();
    const bool by_mass = p < 1.0f;  // top-k alone needs no masses
    int64_t i = 0;
    if (by_mass) {
      std::fill(masses.begin(), masses.end(), 0.0);
      for (; i + kWays <= n; i += kWays) {
        for (int w = 0; w < kWays; ++w) {
          ++count[w * kStride + bucket[i + w]];
          mass[w * kStride + bucket[i + w]] += e[i + w];
        }
      }
      for (; i < n; ++i) ++count[bucket[i]], mass[bucket[i]] += e[i];
      for (int w = 1; w < kWays; ++w)
        for (int64_t b = 0; b < kBuckets; ++b) mass[b] += mass[w * kStride + b];
    } else {
      for (; i + kWays <= n; i += kWays)
        for (int w = 0; w < kWays; ++w) ++count[w * kStride + bucket[i + w]];
      for (; i < n; ++i) ++count[bucket[i]];
    }
    for (int w = 1; w < kWays; ++w)
      for (int64_t b = 0; b < kBuckets; ++b) count[b] += count[w * kStride + b];
    count[0] = 0;  // -inf: not a candidate (its weight is 0)
    // Top-k: the bucket holding rank k - 1, and the mass of ranks below k (top-p's normaliser).
    int64_t k_bucket = -1;
    double total = 0.0;
    if (k < finite) {
      int64_t above = 0;
      for (int64_t b = kBuckets - 1; b > 0; --b) {
        if (above + count[b] >= k) {
          k_bucket = b;
          break;
        }
        above += count[b];
        if (by_mass) total += mass[b];
      }
      gather(s, e, bucket, n, k_bucket, count[k_bucket], top_bucket);
      if (!by_mass) return top_bucket[k - above - 1].value;
      for (int64_t j = 0; j < k - above; ++j) total += top_bucket[j].weight;
    } else {
      for (int64_t b = 1; b < kBuckets; ++b) total += mass[b];
    }
    // Top-p: walk the ranks from the largest, whole buckets at a time until the cut is near.
    const double target = static_cast<double>(p) * total;
    double before = 0.0;
    int64_t rank = 0;
    float last = kNegInf;
    for (int64_t b = kBuckets - 1; b > 0; --b) {
      if (count[b] == 0) continue;
      if (b != k_bucket && before + mass[b] < target) {
        before += mass[b];
        rank += count[b];
        continue;
      }
      const std::vector<Candidate>* sorted = &top_bucket;
      if (b != k_bucket) {
        gather(s, e, bucket, n, b, count[b], other);
        sorted = &other;
      }
      for (const Candidate& c : *sorted) {
        if (rank >= k || before >= target) return last;
        last = c.value;
        before += c.weight;
        ++rank;
      }
      if (b == k_bucket) return last;
    }
    return kNegInf;  // the mass before every rank stayed below p: nothing is cut
  }

  // Cuts `values` down to its k largest (the multiset, in no order); returns the smallest of them.
  static float keep_largest(std::vector<float>& values, int64_t k) {
    std::nth_element(values.begin(), values.begin() + (k - 1), values.end(), std::greater<float>());
    values.resize(k);
    return values[k - 1];
  }

  // Top-k (then min-p and top-p) from the k largest values alone, for rows with a top_k of at most
  // kSelectMax: `picked` holds the k largest of s (the multiset; found during the scaling pass), and the cutoff
  // comes from them sorted, with no pass over the row's weights. The same cutoff as truncation_cutoff's.
  static float top_k_cutoff(std::vector<float>& picked, int64_t k, float smax, float mp, float p) {
    if (static_cast<int64_t>(picked.size()) > k) keep_largest(picked, k);
    std::sort(picked.begin(), picked.end(), std::greater<float>());
    thread_local std::vector<float> weights;
    weights.clear();
    for (const float v : picked) {  // min-p drops the smallest: a suffix
      const float w = exp1(v - smax);
      if (w < mp) break;
      weights.push_back(w);
    }
    const int64_t kept = static_cast<int64_t>(weights.size());  // >= 1: the maximum's weight is 1
    if (!(p < 1.0f)) return picked[kept - 1];
    double total = 0.0;
    for (const float w : weights) total += w;
    const double target = static_cast<double>(p) * total;
    double before = 0.0;
    int64_t j = 0;
    for (; j < kept && before < target; ++j) before += weights[j];
    return picked[j - 1];
  }

  static constexpr int64_t kSelectMax = 1024;

  // s = x / t, its maximum and whether it holds a NaN; with Select, the k largest of s as well in `picked`
  // (values above the k-th largest so far are kept, cut down to the k largest whenever 2k are held).
  template <bool Select>
  static void scale(const float* x, float t, float* s, int64_t n, int64_t k, std::vector<float>& picked,
                    float& smax, bool& any_nan) {
    picked.clear();
    float floor = kNegInf;
    auto pick = [&](float v) {
      if (!(v > floor)) return;
      picked.push_back(v);
      if (static_cast<int64_t>(picked.size()) >= 2 * k)
        floor = keep_largest(picked, k);  // the k-th largest so far: ranks below k stay among the held
    };
    v16 top = splat(kNegInf);
    i32x16 nan = {};
    const v16 tv = splat(t);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      v16 v;
      __builtin_memcpy(&v, x + i, sizeof(v));
      v /= tv;
      nan |= v != v;
      top = v > top ? v : top;
      __builtin_memcpy(s + i, &v, sizeof(v));
      if constexpr (Select) {
        const i32x16 above = v > splat(floor);
        bool any = false;
        for (int j = 0; j < 16; ++j) any |= above[j] != 0;
        if (any)
          for (int j = 0; j < 16; ++j) pick(v[j]);
      }
    }
    smax = kNegInf;
    any_nan = false;
    for (int j = 0; j < 16; ++j) smax = std::max(smax, top[j]), any_nan |= nan[j] != 0;
    for (; i < n; ++i) {
      s[i] = x[i] / t;
      any_nan |= std::isnan(s[i]);
      smax = std::max(smax, s[i]);
      if constexpr (Select) pick(s[i]);
    }
  }

  int32_t sample_row(int64_t r, float* row_cutoff) const {
    const float* x_r = row(r);
    const float t = temperature[r];
    *row_cutoff = std::numeric_limits<float>::quiet_NaN();
    if (!(t > 0.0f)) return first_argmax(x_r, cols);
    const float mp = min_p[r];
    const int64_t k = top_k[r] > 0 && top_k[r] < cols ? top_k[r] : cols;
    const float p = top_p[r];
    const bool select = k <= kSelectMax;  // top-k from the k largest (top_k_cutoff)
    thread_local std::vector<float> scaled, weight, picked;
    thread_local std::vector<uint16_t> buckets;
    scaled.resize(cols);
    float* s = scaled.data();
    float smax;
    bool any_nan;
    if (select) scale<true>(x_r, t, s, cols, k, picked, smax, any_nan);
    else scale<false>(x_r, t, s, cols, k, picked, smax, any_nan);
    // No distribution to draw from (a NaN, nothing finite, an infinite logit): the greedy rule's token.
    if (any_nan || !std::isfinite(smax)) return first_argmax(x_r, cols);
    float cut = kNegInf;
    if (select) {
      cut = top_k_cutoff(picked, k, smax, mp, p);
    } else {
      // e = exp(s - max); min-p drops the tokens whose probability is below min_p times the largest (s = -inf);
      // with top-p (or a top-k above kSelectMax), each kept value's histogram bucket.
      const bool truncates = k < cols || p < 1.0f;
      weight.resize(cols);
      buckets.resize(cols);
      float* e = weight.data();
      uint16_t* bucket = buckets.data();
      const v16 mv = splat(mp), sm = splat(smax), inf = splat(kNegInf);
      i32x16 kept_lanes = {};
      int64_t i = 0;
      for (; i + 16 <= cols; i += 16) {
        v16 v;
        __builtin_memcpy(&v, s + i, sizeof(v));
        const v16 w = exp16(v - sm);
        const i32x16 drop = (v == inf) | (w < mv);
        const v16 wv = drop ? v16{} : w, sv = drop ? inf : v;
        kept_lanes += drop + 1;
        __builtin_memcpy(e + i, &wv, sizeof(wv));
        __builtin_memcpy(s + i, &sv, sizeof(sv));
        if (truncates) {
          u32x16 bits;
          __builtin_memcpy(&bits, &sv, sizeof(bits));
          bits = bits == 0x80000000u ? u32x16{} : bits;  // -0 as +0
          bits = (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
          const u16x16 b16 = __builtin_convertvector(bits >> kBucketShift, u16x16);
          __builtin_memcpy(bucket + i, &b16, sizeof(b16));
        }
      }
      int64_t finite = 0;
      for (int j = 0; j < 16; ++j) finite += kept_lanes[j];
      for (; i < cols; ++i) {
        const float w = exp1(s[i] - smax);
        if (s[i] == kNegInf || w < mp) {
          s[i] = kNegInf;
          e[i] = 0.0f;
        } else {
          e[i] = w;
          ++finite;
        }
        bucket[i] = static_cast<uint16_t>(order_key(s[i]) >> kBucketShift);
      }
      if (k < finite || p < 1.0f) cut = truncation_cutoff(s, e, bucket, cols, std::min(k, finite), finite, p);
    }
    return draw(s, select ? nullptr : weight.data(), smax, cut, mp, uniform(seeds[r], counters[r]), row_cutoff);
  }

  // Block b (tokens 16b..16b+15) of the draw: the weights w (0 where dropped) and kept values v (+inf
  // elsewhere); false where it keeps nothing (no exp then). A partial last block is padded with -inf.
  __attribute__((always_inline)) static inline bool block_weights(const float* s, const float* e, int64_t n,
                                                                  int64_t b, float smax, float cut, float mp, v16& w,
                                                                  v16& v) {
    const v16 inf = splat(kNegInf);
    const int64_t first = b * 16;
    if (first + 16 <= n) {
      __builtin_memcpy(&v, s + first, sizeof(v));
    } else {
      v = inf;
      for (int64_t j = first; j < n; ++j) v[j - first] = s[j];
    }
    i32x16 keep = (v >= splat(cut)) & (v != inf);
    v16 x = {};
    if (e != nullptr) {
      if (first + 16 <= n) __builtin_memcpy(&x, e + first, sizeof(x));
      else for (int64_t j = first; j < n; ++j) x[j - first] = e[j];
    } else {
      bool any = false;
      for (int j = 0; j < 16; ++j) any |= keep[j] != 0;
      if (!any) return false;
      x = exp16(v - splat(smax));
      keep &= x >= splat(mp);
    }
    w = keep ? x : v16{};
    v = keep ? v : splat(std::numeric_limits<float>::infinity());
    return true;
  }

  // The token drawn by inverse transform at u in [0, 1) over the weights w = exp(s - smax) of the tokens with
  // s >= cut, s > -inf and w >= mp (min-p), in token order, through sums of 16 tokens; `e`, where given, holds
  // the weights already (min-p applied as s = -inf), and where not, a block with no kept token costs no exp.
  // *row_cutoff = the smallest kept value.
  int32_t draw(const float* s, const float* e, float smax, float cut, float mp, double u, float* row_cutoff) const {
    thread_local std::vector<float> block;
    const int64_t blocks = (cols + 15) / 16;
    block.resize(blocks);
    const v16 none = splat(std::numeric_limits<float>::infinity());
    auto weights = [&](int64_t b, v16& w, v16& v) { return block_weights(s, e, cols, b, smax, cut, mp, w, v); };
    v16 low = none;
    double sum = 0.0;
    int64_t last_block = -1;
    for (int64_t b = 0; b < blocks; ++b) {
      v16 w, v;
      float total = 0.0f;
      if (weights(b, w, v)) {
        for (int j = 0; j < 16; ++j) total += w[j];
        low = v < low ? v : low;
      }
      block[b] = total;
      sum += total;
      if (total > 0.0f) last_block = b;
    }
    float smallest = none[0];
    for (int j = 0; j < 16; ++j) smallest = std::min(smallest, low[j]);
    *row_cutoff = smallest;
    const double target = u * sum;
    double before = 0.0;
    int64_t b = 0;
    for (; b < blocks; ++b) {
      if (block[b] == 0.0f) continue;
      if (before + block[b] > target) break;
      before += block[b];
    }
    v16 w, v;
    if (b < blocks) {  // the block's tokens one at a time
      weights(b, w, v);
      for (int j = 0; j < 16; ++j) {
        if (!(w[j] > 0.0f)) continue;
        before += w[j];
        if (before > target) return static_cast<int32_t>(b * 16 + j);
      }
    } else {
      b = last_block;  // u * sum rounded up to the sum
      weights(b, w, v);
    }
    for (int j = 15; j >= 0; --j)  // rounding: the block's last kept token
      if (w[j] > 0.0f) return static_cast<int32_t>(b * 16 + j);
    return 0;  // unreachable: the maximum is always kept
  }

  void work() {
    for (int64_t r; (r = next.fetch_add(1)) < rows;) {
      out[r] = sample_row(r, cutoff + r);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Sample(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> temperature,
                  ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::F32> min_p,
                  ffi::Buffer<ffi::U32> seeds, ffi::Buffer<ffi::S32> counters, ffi::Buffer<ffi::S32> bias_ids,
                  ffi::Buffer<ffi::F32> bias_values, ffi::Buffer<ffi::S32> banned,
                  ffi::Buffer<ffi::S32> output_counts, ffi::Buffer<ffi::PRED> prompt_mask,
                  ffi::Buffer<ffi::PRED> allowed, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> presence,
                  ffi::Buffer<ffi::F32> frequency, ffi::Buffer<ffi::F32> repetition, ffi::ResultBuffer<ffi::S32> out,
                  ffi::ResultBuffer<ffi::F32> cutoff) {
  auto shared = std::make_shared<SampleShared>();
  if (auto error = bind_rows("cpu sample", x, bias_ids, bias_values, banned, *shared); !error.success()) return error;
  const size_t rows = static_cast<size_t>(shared->rows);
  if (temperature.element_count() != rows || top_k.element_count() != rows || top_p.element_count() != rows ||
      min_p.element_count() != rows || seeds.element_count() != rows || counters.element_count() != rows ||
      slots.element_count() != rows || presence.element_count() != rows || frequency.element_count() != rows ||
      repetition.element_count() != rows || out->element_count() != rows || cutoff->element_count() != rows)
    return ffi::Error::InvalidArgument("cpu sample: the per-row parameters and the results must be [R]");
  const auto state_dims = output_counts.dimensions();
  auto like_counts = [&](auto dims) {
    return dims.size() == 2 && dims[0] == state_dims[0] && dims[1] == state_dims[1];
  };
  if (state_dims.size() != 2 || state_dims[1] != shared->cols || !like_counts(prompt_mask.dimensions()) ||
      !like_counts(allowed.dimensions()))
    return ffi::Error::InvalidArgument("cpu sample: output_counts, prompt_mask and allowed must be [S, V]");
  shared->output_counts = output_counts.typed_data();
  shared->prompt_mask = prompt_mask.typed_data();
  shared->allowed = allowed.typed_data();
  shared->slots = slots.typed_data();
  shared->presence = presence.typed_data();
  shared->frequency = frequency.typed_data();
  shared->repetition = repetition.typed_data();
  shared->num_slots = state_dims[0];
  shared->temperature = temperature.typed_data();
  shared->top_k = top_k.typed_data();
  shared->top_p = top_p.typed_data();
  shared->min_p = min_p.typed_data();
  shared->seeds = seeds.typed_data();
  shared->counters = counters.typed_data();
  shared->out = out->typed_data();
  shared->cutoff = cutoff->typed_data();
  share_work(pool, shared, shared->rows);
  return ffi::Error::Success();
}

// ---- Logprobs ---------------------------------------------------------------------------------------------------

// sampler.token_logprobs per row of x [R, V]: log_softmax as jax.nn.log_softmax computes it ((x - max) - log of
// the sum of exp(x - max)), its `k` largest (ties: the lower id first, as lax.top_k), the logprob of the row's
// token and that token's rank (1 + how many tokens have a larger logit: rounding can make two logprobs equal
// whose logits are not, and XLA's count then depends on how it fused the subtraction). XLA:CPU took ~11 ms for
// [64, 49152] and ~175 ms for a 512-token prefill's prompt logprobs; here one pass finds the maximum, one the
// sum, and one the top k (a vector compare against the k-th so far, the rare larger ones inserted one at a time)
// and the rank.
struct LogprobsShared {
  const float* x;
  const int32_t* tokens;
  int64_t rows, cols, k;
  int32_t* top_ids;
  float* top_lp;
  float* chosen;
  int32_t* rank;
  std::atomic<int64_t> next{0}, done{0};

  void row(int64_t r) const {
    const float* x_r = x + r * cols;
    v16 top = splat(kNegInf);
    int64_t i = 0;
    for (; i + 16 <= cols; i += 16) {
      v16 v;
      __builtin_memcpy(&v, x_r + i, sizeof(v));
      top = v > top ? v : top;
    }
    float m = kNegInf;
    for (int j = 0; j < 16; ++j) m = std::max(m, top[j]);
    for (; i < cols; ++i) m = std::max(m, x_r[i]);
    v16 sums = {};
    const v16 mv = splat(m);
    for (i = 0; i + 16 <= cols; i += 16) {
      v16 v;
      __builtin_memcpy(&v, x_r + i, sizeof(v));
      const v16 w = exp16(v - mv);
      sums += v == splat(kNegInf) ? v16{} : w;
    }
    float sum = 0.0f;
    for (int j = 0; j < 16; ++j) sum += sums[j];
    for (; i < cols; ++i) sum += x_r[i] == kNegInf ? 0.0f : exp_nonpositive(x_r[i] - m);
    const float lse = std::log(sum);
    // The top k and the rank are found on the logits (the logprobs' order, without their rounding ties).
    const int32_t token = tokens[r];
    const bool valid = token >= 0 && token < cols;
    const float own = valid ? x_r[token] : std::numeric_limits<float>::quiet_NaN();
    int32_t* ids = top_ids + r * k;
    float* best = top_lp + r * k;  // logits until the end, then logprobs
    int64_t held = 0, larger = 0;
    // Inserts (v, j) after the held values >= v: a later id never passes an equal earlier one.
    auto consider = [&](float v, int64_t j) {
      if (held == k && (k == 0 || !(v > best[k - 1]))) return;
      int64_t at = std::min(held, k - 1);
      while (at > 0 && best[at - 1] < v) {
        best[at] = best[at - 1];
        ids[at] = ids[at - 1];
        --at;
      }
      best[at] = v;
      ids[at] = static_cast<int32_t>(j);
      held = std::min(held + 1, k);
    };
    for (i = 0; i < std::min(k, cols); ++i) {  // the first k fill the list
      larger += x_r[i] > own;
      consider(x_r[i], i);
    }
    i64x16 count = {};
    const v16 own_v = splat(own);
    for (; i + 16 <= cols; i += 16) {
      v16 v;
      __builtin_memcpy(&v, x_r + i, sizeof(v));
      count -= __builtin_convertvector(v > own_v, i64x16);
      if (k == 0) continue;
      const i32x16 above = v > splat(best[k - 1]);
      bool any = false;
      for (int j = 0; j < 16; ++j) any |= above[j] != 0;
      if (any)
        for (int j = 0; j < 16; ++j) consider(v[j], i + j);
    }
    for (int j = 0; j < 16; ++j) larger += count[j];
    for (; i < cols; ++i) {
      larger += x_r[i] > own;
      consider(x_r[i], i);
    }
    for (int64_t j = 0; j < k; ++j) best[j] = (best[j] - m) - lse;
    chosen[r] = (own - m) - lse;
    rank[r] = static_cast<int32_t>(larger + 1);
  }

  void work() {
    for (int64_t r; (r = next.fetch_add(1)) < rows;) {
      row(r);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error TokenLogprobs(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> tokens,
                         ffi::ResultBuffer<ffi::S32> top_ids, ffi::ResultBuffer<ffi::F32> top_lp,
                         ffi::ResultBuffer<ffi::F32> chosen, ffi::ResultBuffer<ffi::S32> rank) {
  const auto dims = x.dimensions(), top_dims = top_ids->dimensions();
  if (dims.size() != 2 || tokens.element_count() != static_cast<size_t>(dims[0]) || top_dims.size() != 2 ||
      top_dims[0] != dims[0] || top_dims[1] > dims[1] ||
      top_lp->element_count() != top_ids->element_count() || chosen->element_count() != tokens.element_count() ||
      rank->element_count() != tokens.element_count())
    return ffi::Error::InvalidArgument("cpu token_logprobs: x [R, V], tokens [R], tops [R, K] (K <= V), [R]");
  auto shared = std::make_shared<LogprobsShared>();
  shared->x = x.typed_data();
  shared->tokens = tokens.typed_data();
  shared->rows = dims[0];
  shared->cols = dims[1];
  shared->k = top_dims[1];
  shared->top_ids = top_ids->typed_data();
  shared->top_lp = top_lp->typed_data();
  shared->chosen = chosen->typed_data();
  shared->rank = rank->typed_data();
  share_work(pool, shared, shared->rows);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuFirstArgmax, Argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [R, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // bias_ids [R, B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bias_values [R, B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // banned [R, N]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // [R]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuSample, Sample,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [R, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // temperature [R]; 0 = greedy
                                  .Arg<ffi::Buffer<ffi::S32>>()   // top_k [R]; 0 = off
                                  .Arg<ffi::Buffer<ffi::F32>>()   // top_p [R]; 1 = off
                                  .Arg<ffi::Buffer<ffi::F32>>()   // min_p [R]; 0 = off
                                  .Arg<ffi::Buffer<ffi::U32>>()   // seeds [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // counters [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // bias_ids [R, B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bias_values [R, B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // banned [R, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // output_counts [S, V]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // prompt_mask [S, V]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // allowed [S, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots [R]; outside [0, S) = none
                                  .Arg<ffi::Buffer<ffi::F32>>()   // presence_penalty [R]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // frequency_penalty [R]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // repetition_penalty [R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // tokens [R]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // cutoff [R]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuTokenLogprobs, TokenLogprobs,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [R, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // tokens [R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // top ids [R, K]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // top logprobs [R, K]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // the token's logprob [R]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // its rank [R]
