// How the native CPU kernels share a call's work with XLA's intra-op thread pool (cpu_attention.cc,
// cpu_matmul.cc, cpu_sampling.cc).

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

namespace {

// Runs shared->work() on the calling thread and on up to pool.num_threads() - 1 of the pool's threads (no
// more than there are items), then waits until shared->done counts all `items`. work() takes items from
// shared counters and bumps `done` (release) after each. Helpers that start late find no items left; the
// caller waits only for items already taken, and the shared state, held by every helper, outlives them.
template <class Pool, class Shared>
void share_work(Pool& pool, const std::shared_ptr<Shared>& shared, int64_t items) {
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 0), items);
  for (int64_t i = 1; i < helpers; ++i) pool.Schedule([shared] { shared->work(); });
  shared->work();
  while (static_cast<int64_t>(shared->done.load(std::memory_order_acquire)) < items) std::this_thread::yield();
}

}  // namespace
