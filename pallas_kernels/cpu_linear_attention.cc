// Gated DeltaNet's recurrence for XLA:CPU (Qwen3.5, Qwen3-Next), called through the XLA FFI (see cpu.py, which builds
// and registers it; jaxengine/layers/linear_attention.py holds the contract and the XLA form).
//
// Each request's state row [Hv, dk, dv] (float32) is updated in place, token after token of its chunk: decayed by
// exp(g), corrected along k towards v at rate beta (the delta rule), then read along q. A request whose chunk starts
// its sequence (kv_len == its chunk's length) starts from zeros. Work items are (request, value head) pairs, shared
// with XLA's intra-op pool; an item's state (dk x dv floats: 64 KiB at 128 x 128) stays in cache across its tokens.
// Where XLA's form gathered every request's state, computed a new one and scattered it back (a decode step of 64
// sequences moved ~4 copies of their states), this reads and writes each state once a step.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct DeltaShared {
  const float *q, *k, *v, *g, *beta;
  float *state, *out;
  const int32_t *cu_q_lens, *kv_lens, *rows;
  int64_t Hk, Hv, dk, dv, num_rows, items;
  std::atomic<int64_t> next{0}, done{0};

  void work() {
    const int64_t per_k = Hv / Hk;
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      const int64_t r = i / Hv, h = i % Hv, kh = h / per_k;
      const int64_t first = cu_q_lens[r], last = cu_q_lens[r + 1];
      const int64_t row = rows[r];
      if (last > first && row >= 0 && row < num_rows) {
        float* s = state + (row * Hv + h) * dk * dv;
        if (kv_lens[r] == last - first) std::memset(s, 0, sizeof(float) * dk * dv);
        for (int64_t t = first; t < last; ++t) step(s, t, h, kh);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }

  // One token on one head's state s [dk, dv]: s *= exp(g); s += k (beta (v - s^T k))^T; out = s^T q.
  void step(float* s, int64_t t, int64_t h, int64_t kh) const {
    const float* qt = q + (t * Hk + kh) * dk;
    const float* kt = k + (t * Hk + kh) * dk;
    const float* vt = v + (t * Hv + h) * dv;
    const float decay = std::exp(g[t * Hv + h]), rate = beta[t * Hv + h];
    float delta[kMaxDv], o[kMaxDv];
    for (int64_t j = 0; j < dv; ++j) delta[j] = 0.0f;
    for (int64_t a = 0; a < dk; ++a) {  // decay, and the state's prediction of v along k
      float* sa = s + a * dv;
      const float ka = kt[a];
      for (int64_t j = 0; j < dv; ++j) {
        sa[j] *= decay;
        delta[j] += sa[j] * ka;
      }
    }
    for (int64_t j = 0; j < dv; ++j) {
      delta[j] = (vt[j] - delta[j]) * rate;
      o[j] = 0.0f;
    }
    for (int64_t a = 0; a < dk; ++a) {  // the correction, and the read along q
      float* sa = s + a * dv;
      const float ka = kt[a], qa = qt[a];
      for (int64_t j = 0; j < dv; ++j) {
        sa[j] += ka * delta[j];
        o[j] += sa[j] * qa;
      }
    }
    std::memcpy(out + (t * Hv + h) * dv, o, sizeof(float) * dv);
  }

  static constexpr int64_t kMaxDv = 512;
};

// q, k [T, Hk, dk] (L2-normalised, q scaled), v [T, Hv, dv], g (log decay) and beta [T, Hv]; the state pool [L, rows,
// Hv, dk, dv] (aliased to the second result), its layer; the batch's cu_q_lens [R + 1], kv_lens [R], each request's
// state row [R] and num_seqs. Returns out [T, Hv, dv] (tokens of no request: zeros) and the pool.
ffi::Error GatedDeltaRule(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta,
                          ffi::Buffer<ffi::F32> pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> cu_q_lens,
                          ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> num_seqs,
                          ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> pool_out) {
  const auto q_dims = q.dimensions(), k_dims = k.dimensions(), v_dims = v.dimensions(), p_dims = pool.dimensions();
  if (q_dims.size() != 3 || k_dims.size() != 3 || !std::equal(q_dims.begin(), q_dims.end(), k_dims.begin()) ||
      v_dims.size() != 3 || p_dims.size() != 5 ||
      v_dims[0] != q_dims[0] || p_dims[2] != v_dims[1] || p_dims[3] != q_dims[2] || p_dims[4] != v_dims[2])
    return ffi::Error::InvalidArgument("cpu gated_delta_rule: q, k [T, Hk, dk], v [T, Hv, dv] and the state pool "
                                       "[L, rows, Hv, dk, dv] disagree");
  const int64_t T = q_dims[0], Hk = q_dims[1], dk = q_dims[2], Hv = v_dims[1], dv = v_dims[2];
  const size_t R = rows.element_count();
  if (Hv % Hk || dv > DeltaShared::kMaxDv || g.element_count() != static_cast<size_t>(T * Hv) ||
      beta.element_count() != static_cast<size_t>(T * Hv) || cu_q_lens.element_count() != R + 1 ||
      kv_lens.element_count() != R || num_seqs.element_count() != 1)
    return ffi::Error::InvalidArgument("cpu gated_delta_rule: Hv must be a multiple of Hk, dv <= 512, g and beta "
                                       "[T, Hv], cu_q_lens [R + 1], kv_lens and rows [R]");
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, p_dims[0] - 1);
  float* state = pool_out->typed_data();
  if (state != pool.typed_data()) std::memcpy(state, pool.typed_data(), pool.size_bytes());
  std::memset(out->typed_data(), 0, out->size_bytes());
  auto shared = std::make_shared<DeltaShared>();
  DeltaShared& s = *shared;
  s.q = q.typed_data(), s.k = k.typed_data(), s.v = v.typed_data(), s.g = g.typed_data();
  s.beta = beta.typed_data(), s.out = out->typed_data();
  s.state = state + l * p_dims[1] * Hv * dk * dv;
  s.cu_q_lens = cu_q_lens.typed_data(), s.kv_lens = kv_lens.typed_data(), s.rows = rows.typed_data();
  s.Hk = Hk, s.Hv = Hv, s.dk = dk, s.dv = dv, s.num_rows = p_dims[1];
  s.items = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, static_cast<int64_t>(R)) * Hv;
  share_work(thread_pool, shared, s.items);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuGatedDeltaRule, GatedDeltaRule,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [T, Hk, dk]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k [T, Hk, dk]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v [T, Hv, dv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // g [T, Hv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // beta [T, Hv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // state pool (aliased to the second result)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens [R + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // state rows [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [T, Hv, dv]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // the state pool
