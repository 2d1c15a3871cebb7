// parallel_for: the chunks of one kernel call on the calling thread and XLA's intra-op pool,
// shared by the matvec and attention kernels. The caller takes chunks too, so every call
// finishes even when no pool thread is free. (Helpers of our own that spin between calls, as
// ggml's do, measured the same as the pool on a 2-core Zen 3: 3072 x 576 int4 147 vs 148 us,
// 49152 x 576 int8 1.79 vs 1.72 ms, one core 201 us and 2.68 ms; min of 30 alternated runs.)
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ggmlx_native {

// One call's chunks. Pool tasks that start after the call has returned find none left and only
// drop their reference.
struct Chunks {
  std::function<void(int64_t)> fn;
  int64_t n = 0;
  std::atomic<int64_t> next{0}, done{0};

  void work() {
    for (int64_t c; (c = next.fetch_add(1)) < n;) {
      fn(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// fn(c) for c in [0, n_chunks) on up to `threads` threads, the caller among them.
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t threads, int64_t n_chunks,
                         std::function<void(int64_t)> fn) {
  auto c = std::make_shared<Chunks>();
  c->fn = std::move(fn);
  c->n = n_chunks;
  const int64_t helpers = std::min(threads, n_chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([c] { c->work(); });
  c->work();
  while (c->done.load(std::memory_order_acquire) < c->n) std::this_thread::yield();
}

}  // namespace ggmlx_native
