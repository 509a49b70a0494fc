// Gated DeltaNet's recurrence (Qwen3.5, Qwen3-Next; Kimi Delta Attention's: a decay per key row) and Mamba2's
// (Granite 4.0-H, Nemotron-H, Falcon-H1: `delta` off) for XLA:CPU, called through the XLA FFI (see cpu.py, which
// builds and registers it; jaxengine/layers/linear_attention.py holds the contract and the XLA form).
//
// Each request's state row [Hv, dk, dv] (float32; or bfloat16, computed in float32) is updated in place, token after
// token of its chunk: decayed by exp(g), corrected along k towards v at rate beta (the delta rule; Mamba2: beta v
// written along k), then read along q. A request whose chunk starts its sequence (kv_len == its chunk's length)
// starts from zeros. Work items are (request, value head, block of 32 columns), shared with XLA's intra-op pool: a
// chunk of several tokens runs on its block in L1 (`columns`), a decode step's one token on the whole head in place
// (`step`). Where XLA's form gathered every request's state, computed a new one and scattered it back (a decode step
// of 64 sequences moved ~4 copies of their states), this reads and writes each state once a step. On the 2-core
// EPYC, 6 heads of 128 x 128 (qwen3-next-mini's layer): a decode step of 64 sequences ~2.1 ms (the states' 25 MiB
// read and written: memory bound), a 512-token chunk of 4 prompts ~2.9 ms (5.7 ms whole-head: the 64 KiB states'
// passes ran from L2).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "cpu_pool.h"
#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Columns of a state a work item takes (dv a multiple of it; else a whole head's, `step`): the item copies its
// [dk, 32] block of the state to a contiguous buffer (16 KiB at dk 128: in L1, where the block's rows at the state's
// stride would contend for a few of L1's sets), runs the chunk's tokens on it, and copies it back. Each column's
// update needs only its own column (the prediction and the read are sums over the key dimension, per column), so a
// token's two passes over the block stay in L1; each pass keeps four sums in flight (two vectors of columns, even
// and odd rows) rather than one chain of dependent adds.
constexpr int64_t kColumns = 32;
constexpr int64_t kMaxDk = 512;

// A state row's values in float32, from its pool's element type (float32, or bfloat16's bits: the engine's
// mamba_ssm_cache_dtype), and back (bfloat16: rounded to nearest even).
inline void load_state(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void store_state(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
inline void load_state(float* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // 16 at a time: widened, shifted into float32's high half
    u16x16 h;
    std::memcpy(&h, src + i, sizeof(h));
    const u32x16 bits = __builtin_convertvector(h, u32x16) << 16;
    std::memcpy(dst + i, &bits, sizeof(bits));
  }
  for (; i < n; ++i) {
    const uint32_t bits = uint32_t{src[i]} << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}
inline void store_state(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // rounded to nearest, ties to even
    u32x16 bits;
    std::memcpy(&bits, src + i, sizeof(bits));
    const u16x16 h = __builtin_convertvector((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, u16x16);
    std::memcpy(dst + i, &h, sizeof(h));
  }
  for (; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, sizeof(float));
    dst[i] = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
  }
}

// S: the state pool's element type (float, or uint16_t for bfloat16 bits).
template <typename S>
struct DeltaShared {
  const float *q, *k, *v, *g, *beta;
  S* state;
  float* out;
  const int32_t *cu_q_lens, *kv_lens, *rows;
  int64_t Hk, Hv, dk, dv, num_rows, blocks, items;
  int64_t group;  // value heads an item takes in turn (small heads: Mamba1's channels, a [state size, 1] state each)
  bool delta;  // the delta rule's correction (Gated DeltaNet); else Mamba2's plain write of beta v along k
  bool per_key;  // g gives each key row its own decay ([T, Hv, dk]: Kimi Delta Attention's); else one per head
  std::atomic<int64_t> next{0}, done{0};

  void work() {
    const int64_t per_k = Hv / Hk, groups = (Hv + group - 1) / group;
    // a bfloat16 pool's whole head, in float32 while its tokens run (a float32 pool's runs in place)
    std::unique_ptr<float[]> head(std::is_same_v<S, float> ? nullptr : new float[dk * dv]);
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      const int64_t r = i / (groups * blocks), block = i % blocks, h0 = i / blocks % groups * group;
      const int64_t first = cu_q_lens[r], last = cu_q_lens[r + 1];
      const int64_t row = rows[r];
      for (int64_t h = h0; h < std::min(Hv, h0 + group) && last > first && row >= 0 && row < num_rows; ++h) {
        const int64_t kh = h / per_k;
        S* s = state + (row * Hv + h) * dk * dv;
        const bool fresh = kv_lens[r] == last - first;
        if (blocks == 1 || last - first == 1) {  // a decode step's one token: the whole head, in place
          if (block == 0 && head && !delta && last - first == 1) {  // a bfloat16 row's Mamba step: one pass
            per_key ? mamba_step<true>(s, fresh, first, h, kh) : mamba_step<false>(s, fresh, first, h, kh);
          } else if (block == 0) {
            float* f = head ? head.get() : reinterpret_cast<float*>(s);
            if (fresh)
              std::memset(f, 0, sizeof(float) * dk * dv);
            else if (head)
              load_state(f, s, dk * dv);
            for (int64_t t = first; t < last; ++t) per_key ? step<true>(f, t, h, kh) : step<false>(f, t, h, kh);
            if (head) store_state(s, f, dk * dv);
          }
        } else if (per_key) {
          columns<true>(s + block * kColumns, fresh, first, last, h, kh, block * kColumns);
        } else {
          columns<false>(s + block * kColumns, fresh, first, last, h, kh, block * kColumns);
        }
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }

  // The tokens [first, last) on columns [j0, j0 + kColumns) of one head's state s (row stride dv); PerKey: each row
  // decays by its own exp(g) (the token's g row [dk] exponentiated once into `decays`).
  template <bool PerKey>
  void columns(S* s, bool fresh, int64_t first, int64_t last, int64_t h, int64_t kh, int64_t j0) const {
    alignas(64) v16 b[kMaxDk * 2];  // row a's columns: b[2a], b[2a + 1]
    for (int64_t a = 0; a < dk; ++a) {
      if (fresh)
        b[2 * a] = b[2 * a + 1] = v16{};
      else
        load_state(reinterpret_cast<float*>(&b[2 * a]), s + a * dv, kColumns);
    }
    const int64_t even = dk & ~int64_t{1};
    for (int64_t t = first; t < last; ++t) {
      const float* __restrict qt = q + (t * Hk + kh) * dk;
      const float* __restrict kt = k + (t * Hk + kh) * dk;
      const v16 rate = splat(beta[t * Hv + h]);
      float decays[PerKey ? kMaxDk : 1];
      const float* __restrict gt = g + (t * Hv + h) * (PerKey ? dk : 1);
      for (int64_t a = 0; a < (PerKey ? dk : 1); ++a) decays[a] = std::exp(gt[a]);
      auto decay = [&](int64_t a) { return splat(decays[PerKey ? a : 0]); };
      v16 v0, v1;
      std::memcpy(&v0, v + (t * Hv + h) * dv + j0, sizeof(v16));
      std::memcpy(&v1, v + (t * Hv + h) * dv + j0 + 16, sizeof(v16));
      if (!delta) {  // Mamba's write needs no prediction: decay, write and read in one pass over the block
        const v16 d0 = v0 * rate, d1 = v1 * rate;
        v16 o0{}, o1{}, u0{}, u1{};
        for (int64_t a = 0; a < even; a += 2) {
          const v16 da = decay(a), db = decay(a + 1);
          const v16 x0 = b[2 * a] * da + d0 * kt[a], x1 = b[2 * a + 1] * da + d1 * kt[a];
          const v16 y0 = b[2 * a + 2] * db + d0 * kt[a + 1], y1 = b[2 * a + 3] * db + d1 * kt[a + 1];
          b[2 * a] = x0, b[2 * a + 1] = x1, b[2 * a + 2] = y0, b[2 * a + 3] = y1;
          o0 += x0 * qt[a], o1 += x1 * qt[a], u0 += y0 * qt[a + 1], u1 += y1 * qt[a + 1];
        }
        if (even < dk) {
          const v16 d = decay(even);
          const v16 x0 = b[2 * even] * d + d0 * kt[even], x1 = b[2 * even + 1] * d + d1 * kt[even];
          b[2 * even] = x0, b[2 * even + 1] = x1;
          o0 += x0 * qt[even], o1 += x1 * qt[even];
        }
        const v16 out0 = o0 + u0, out1 = o1 + u1;
        std::memcpy(out + (t * Hv + h) * dv + j0, &out0, sizeof(v16));
        std::memcpy(out + (t * Hv + h) * dv + j0 + 16, &out1, sizeof(v16));
        continue;
      }
      v16 p0{}, p1{}, r0{}, r1{};  // the prediction along k: columns 0-15 and 16-31, even rows (p) and odd (r)
      for (int64_t a = 0; a < even; a += 2) {
        const v16 da = decay(a), db = decay(a + 1);
        const v16 x0 = b[2 * a] * da, x1 = b[2 * a + 1] * da;
        const v16 y0 = b[2 * a + 2] * db, y1 = b[2 * a + 3] * db;
        b[2 * a] = x0, b[2 * a + 1] = x1, b[2 * a + 2] = y0, b[2 * a + 3] = y1;
        p0 += x0 * kt[a], p1 += x1 * kt[a], r0 += y0 * kt[a + 1], r1 += y1 * kt[a + 1];
      }
      if (even < dk) {
        const v16 d = decay(even);
        const v16 x0 = b[2 * even] * d, x1 = b[2 * even + 1] * d;
        b[2 * even] = x0, b[2 * even + 1] = x1;
        p0 += x0 * kt[even], p1 += x1 * kt[even];
      }
      const v16 d0 = (v0 - (p0 + r0)) * rate, d1 = (v1 - (p1 + r1)) * rate;
      v16 o0{}, o1{}, u0{}, u1{};  // the read along q, likewise
      for (int64_t a = 0; a < even; a += 2) {
        const v16 x0 = b[2 * a] + d0 * kt[a], x1 = b[2 * a + 1] + d1 * kt[a];
        const v16 y0 = b[2 * a + 2] + d0 * kt[a + 1], y1 = b[2 * a + 3] + d1 * kt[a + 1];
        b[2 * a] = x0, b[2 * a + 1] = x1, b[2 * a + 2] = y0, b[2 * a + 3] = y1;
        o0 += x0 * qt[a], o1 += x1 * qt[a], u0 += y0 * qt[a + 1], u1 += y1 * qt[a + 1];
      }
      if (even < dk) {
        const v16 x0 = b[2 * even] + d0 * kt[even], x1 = b[2 * even + 1] + d1 * kt[even];
        b[2 * even] = x0, b[2 * even + 1] = x1;
        o0 += x0 * qt[even], o1 += x1 * qt[even];
      }
      const v16 out0 = o0 + u0, out1 = o1 + u1;
      std::memcpy(out + (t * Hv + h) * dv + j0, &out0, sizeof(v16));
      std::memcpy(out + (t * Hv + h) * dv + j0 + 16, &out1, sizeof(v16));
    }
    for (int64_t a = 0; a < dk; ++a) store_state(s + a * dv, reinterpret_cast<const float*>(&b[2 * a]), kColumns);
  }

  // Mamba's one token (no delta rule) on one head's whole state s [dk, dv] in its pool's type: each row read into
  // float32, decayed, written beta v along k, read along q, and stored (rounded) at once; from zeros where `fresh`.
  template <bool PerKey>
  void mamba_step(S* s, bool fresh, int64_t t, int64_t h, int64_t kh) const {
    const float* qt = q + (t * Hk + kh) * dk;
    const float* kt = k + (t * Hk + kh) * dk;
    const float* vt = v + (t * Hv + h) * dv;
    const float* gt = g + (t * Hv + h) * (PerKey ? dk : 1);
    const float head_decay = std::exp(gt[0]), rate = beta[t * Hv + h];
    float update[kMaxDv], o[kMaxDv], row[kMaxDv];
    for (int64_t j = 0; j < dv; ++j) update[j] = vt[j] * rate, o[j] = 0.0f;
    for (int64_t a = 0; a < dk; ++a) {
      S* sa = s + a * dv;
      if (fresh)
        std::memset(row, 0, sizeof(float) * dv);
      else
        load_state(row, sa, dv);
      const float ka = kt[a], qa = qt[a], decay = PerKey ? std::exp(gt[a]) : head_decay;
      for (int64_t j = 0; j < dv; ++j) {
        row[j] = row[j] * decay + ka * update[j];
        o[j] += row[j] * qa;
      }
      store_state(sa, row, dv);
    }
    std::memcpy(out + (t * Hv + h) * dv, o, sizeof(float) * dv);
  }

  // One token on one head's whole state s [dk, dv]: s *= exp(g) (PerKey: each row its own); s += k (beta (v - s^T
  // k))^T (Mamba2: k (beta v)^T); out = s^T q.
  template <bool PerKey>
  void step(float* s, int64_t t, int64_t h, int64_t kh) const {
    const float* qt = q + (t * Hk + kh) * dk;
    const float* kt = k + (t * Hk + kh) * dk;
    const float* vt = v + (t * Hv + h) * dv;
    const float* gt = g + (t * Hv + h) * (PerKey ? dk : 1);
    const float head_decay = std::exp(gt[0]), rate = beta[t * Hv + h];
    float update[kMaxDv], o[kMaxDv];
    if (!delta) {  // Mamba's write needs no prediction: decay, write and read in one pass over the state
      for (int64_t j = 0; j < dv; ++j) update[j] = vt[j] * rate, o[j] = 0.0f;
      for (int64_t a = 0; a < dk; ++a) {
        float* sa = s + a * dv;
        const float ka = kt[a], qa = qt[a], decay = PerKey ? std::exp(gt[a]) : head_decay;
        for (int64_t j = 0; j < dv; ++j) {
          sa[j] = sa[j] * decay + ka * update[j];
          o[j] += sa[j] * qa;
        }
      }
      std::memcpy(out + (t * Hv + h) * dv, o, sizeof(float) * dv);
      return;
    }
    for (int64_t j = 0; j < dv; ++j) update[j] = 0.0f;
    for (int64_t a = 0; a < dk; ++a) {  // decay, and the state's prediction of v along k
      float* sa = s + a * dv;
      const float ka = kt[a], decay = PerKey ? std::exp(gt[a]) : head_decay;
      for (int64_t j = 0; j < dv; ++j) {
        sa[j] *= decay;
        update[j] += sa[j] * ka;
      }
    }
    for (int64_t j = 0; j < dv; ++j) {
      update[j] = (vt[j] - update[j]) * rate;
      o[j] = 0.0f;
    }
    for (int64_t a = 0; a < dk; ++a) {  // the correction, and the read along q
      float* sa = s + a * dv;
      const float ka = kt[a], qa = qt[a];
      for (int64_t j = 0; j < dv; ++j) {
        sa[j] += ka * update[j];
        o[j] += sa[j] * qa;
      }
    }
    std::memcpy(out + (t * Hv + h) * dv, o, sizeof(float) * dv);
  }

  static constexpr int64_t kMaxDv = 512;
};

// The call's problem on a pool of element type S (`state`: the layer's rows).
template <typename S>
void run_delta(ffi::ThreadPool thread_pool, S* state, const float* q, const float* k, const float* v, const float* g,
               const float* beta, float* out, const int32_t* cu_q_lens, const int32_t* kv_lens, const int32_t* rows,
               int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t num_rows, bool delta, bool per_key,
               int64_t live) {
  auto shared = std::make_shared<DeltaShared<S>>();
  DeltaShared<S>& s = *shared;
  s.q = q, s.k = k, s.v = v, s.g = g, s.beta = beta, s.out = out, s.state = state;
  s.cu_q_lens = cu_q_lens, s.kv_lens = kv_lens, s.rows = rows;
  s.Hk = Hk, s.Hv = Hv, s.dk = dk, s.dv = dv, s.num_rows = num_rows, s.delta = delta, s.per_key = per_key;
  bool one_token = true;  // a decode step: whole heads in place, one item each
  for (int64_t r = 0; r < live; ++r) one_token = one_token && cu_q_lens[r + 1] - cu_q_lens[r] <= 1;
  s.blocks = dv % kColumns == 0 && !one_token ? dv / kColumns : 1;
  // whole heads of under 4096 state values (Mamba1's 16) go several to an item: one per item would cost more in
  // handing out items than in the work
  s.group = s.blocks == 1 ? std::clamp<int64_t>(4096 / (dk * dv), 1, Hv) : 1;
  s.items = live * ((Hv + s.group - 1) / s.group) * s.blocks;
  share_work(thread_pool, shared, s.items);
}

// q, k [T, Hk, dk] (L2-normalised, q scaled), v [T, Hv, dv], g (log decay: [T, Hv], or [T, Hv, dk] a decay per key
// row) and beta [T, Hv]; the state pool [L, rows, Hv, dk, dv] (aliased to the second result), its layer; the batch's
// cu_q_lens [R + 1], kv_lens [R], each request's state row [R] and num_seqs. Returns out [T, Hv, dv] (tokens of no
// request: zeros) and the pool.
ffi::Error GatedDeltaRule(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta,
                          ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> cu_q_lens,
                          ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> num_seqs,
                          ffi::Buffer<ffi::S32> delta, ffi::ResultBuffer<ffi::F32> out,
                          ffi::Result<ffi::AnyBuffer> pool_out) {
  const auto q_dims = q.dimensions(), k_dims = k.dimensions(), v_dims = v.dimensions(), p_dims = pool.dimensions();
  if (q_dims.size() != 3 || k_dims.size() != 3 || !std::equal(q_dims.begin(), q_dims.end(), k_dims.begin()) ||
      v_dims.size() != 3 || p_dims.size() != 5 ||
      v_dims[0] != q_dims[0] || p_dims[2] != v_dims[1] || p_dims[3] != q_dims[2] || p_dims[4] != v_dims[2])
    return ffi::Error::InvalidArgument("cpu gated_delta_rule: q, k [T, Hk, dk], v [T, Hv, dv] and the state pool "
                                       "[L, rows, Hv, dk, dv] disagree");
  const ffi::DataType type = pool.element_type();
  if ((type != ffi::DataType::F32 && type != ffi::DataType::BF16) || pool_out->element_type() != type)
    return ffi::Error::InvalidArgument("cpu gated_delta_rule: the state pool must be float32 or bfloat16");
  const int64_t T = q_dims[0], Hk = q_dims[1], dk = q_dims[2], Hv = v_dims[1], dv = v_dims[2];
  const size_t R = rows.element_count();
  const bool per_key = g.element_count() == static_cast<size_t>(T * Hv * dk) && dk > 1;
  if (Hv % Hk || dv > DeltaShared<float>::kMaxDv || dk > kMaxDk ||
      (g.element_count() != static_cast<size_t>(T * Hv) && !per_key) ||
      beta.element_count() != static_cast<size_t>(T * Hv) || cu_q_lens.element_count() != R + 1 ||
      kv_lens.element_count() != R || num_seqs.element_count() != 1 || delta.element_count() != 1)
    return ffi::Error::InvalidArgument("cpu gated_delta_rule: Hv must be a multiple of Hk, dk and dv <= 512, g "
                                       "[T, Hv] or [T, Hv, dk], beta [T, Hv], cu_q_lens [R + 1], kv_lens and rows "
                                       "[R], delta [1]");
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, p_dims[0] - 1);
  if (pool_out->untyped_data() != pool.untyped_data())
    std::memcpy(pool_out->untyped_data(), pool.untyped_data(), pool.size_bytes());
  std::memset(out->typed_data(), 0, out->size_bytes());
  const int64_t live = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, static_cast<int64_t>(R));
  const int64_t offset = l * p_dims[1] * Hv * dk * dv;  // the layer's rows
  const auto run = [&](auto* state) {
    run_delta(thread_pool, state + offset, q.typed_data(), k.typed_data(), v.typed_data(), g.typed_data(),
              beta.typed_data(), out->typed_data(), cu_q_lens.typed_data(), kv_lens.typed_data(), rows.typed_data(),
              Hk, Hv, dk, dv, p_dims[1], delta.typed_data()[0] != 0, per_key, live);
  };
  if (type == ffi::DataType::F32)
    run(static_cast<float*>(pool_out->untyped_data()));
  else
    run(static_cast<uint16_t*>(pool_out->untyped_data()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuGatedDeltaRule, GatedDeltaRule,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [T, Hk, dk]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k [T, Hk, dk]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v [T, Hv, dv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // g [T, Hv] or [T, Hv, dk]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // beta [T, Hv]
                                  .Arg<ffi::AnyBuffer>()          // state pool, float32 or bfloat16 (aliased to
                                                                  // the second result)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens [R + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // state rows [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()   // delta: 1 the delta rule, 0 Mamba2's write
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [T, Hv, dv]
                                  .Ret<ffi::AnyBuffer>());  // the state pool
