// A small pool for the linear kernels' parallel loops (cpu_linear.cpp): the calling thread
// works on the items at once, and helper threads join when they are awake, instead of an
// OpenMP region that waits for its sleeping worker at the start and at the end.
//
// Why not OpenMP here: poise runs OpenMP with OMP_WAIT_POLICY=PASSIVE (poise/__init__.py:
// spinning workers on shared cores made steps 2-5x slower), so every region wakes a sleeping
// worker and the caller sleeps at the region's end until it arrives. On this 2-vCPU VM that
// is ~60 us per region (an empty 2-thread region: 80 us against 21 us on one thread), and a
// decode step runs ~100 linear regions (SmolLM2-1.7B: ~6 ms of a 60-70 ms int8 step).
//
// How: run() publishes the loop and takes items itself; a helper that is awake takes items
// too, and run() returns once every item is done and no helper is inside one. A helper that
// finishes spins for up to spin_us (POISE_POOL_SPIN_US, default 200) for the next loop,
// yielding its core to any other runnable thread while it does (sched_yield), then sleeps.
// So on an idle machine consecutive layers' loops find the helper awake, and on a busy one
// the helper gives way and the caller does the items alone: no loop waits for a helper that
// has not joined it. Items go in order (a shared counter), so a helper takes whatever the
// caller has not.
#pragma once

#include <immintrin.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

namespace ppool {

class Pool {
 public:
  // One pool for the library, never destroyed (helpers may be asleep in it at exit).
  static Pool& instance() {
    static Pool* pool = new Pool();
    return *pool;
  }

  // fn(item) for item in [0, n) on up to `threads` threads, the caller among them.
  template <class F>
  void run(int64_t n, int threads, F&& fn) {
    if (n <= 0) return;
    if (threads <= 1 || n == 1 || spin_us_.load(std::memory_order_relaxed) < 0) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> one_loop(run_mu_);  // one caller at a time
    ensure_helpers(threads - 1);
    using Fn = std::remove_reference_t<F>;
    fn_ = [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); };
    ctx_ = const_cast<void*>(static_cast<const void*>(&fn));
    n_ = n;
    wanted_ = threads - 1;
    next_.store(0, std::memory_order_relaxed);
    joined_.store(0, std::memory_order_release);  // open: helpers may join
    gen_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    work();
    // Close: wait until no helper is inside an item, then keep late ones out.
    int expected = 0;
    for (int spins = 1; !joined_.compare_exchange_weak(expected, -1, std::memory_order_acq_rel);
         ++spins) {
      expected = 0;
      if ((spins & 255) == 0) sched_yield();  // a helper preempted inside an item
      _mm_pause();
    }
  }

  void set_spin_us(int us) { spin_us_.store(us, std::memory_order_relaxed); }

 private:
  Pool() {
    const char* env = std::getenv("POISE_POOL_SPIN_US");
    spin_us_.store(env != nullptr ? std::atoi(env) : 200, std::memory_order_relaxed);
    pthread_atfork(nullptr, nullptr, [] { instance().after_fork(); });
  }

  // A forked child has only the forking thread: no helpers, and locks that a helper may have
  // held at the fork are made anew (its loops then run on the caller until helpers start).
  void after_fork() {
    helpers_.clear();  // detached, so destroying them joins nothing
    new (&run_mu_) std::mutex();
    new (&mu_) std::mutex();
    new (&cv_) std::condition_variable();
    sleeping_.store(0);
    joined_.store(-1);
  }

  void ensure_helpers(int count) {
    while (static_cast<int>(helpers_.size()) < count) {
      const int index = static_cast<int>(helpers_.size());
      try {
        helpers_.emplace_back([this, index] { helper(index); });
      } catch (const std::system_error&) {
        return;  // no more threads to be had: the loops run on those there are
      }
      helpers_.back().detach();
    }
  }

  void work() {
    for (;;) {
      const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= n_) return;
      fn_(ctx_, i);
    }
  }

  bool try_join() {
    int seen = joined_.load(std::memory_order_acquire);
    while (seen >= 0)
      if (joined_.compare_exchange_weak(seen, seen + 1, std::memory_order_acq_rel)) return true;
    return false;
  }

  void helper(int index) {
    uint64_t seen = gen_.load(std::memory_order_acquire);
    for (;;) {
      wait_for(seen);
      seen = gen_.load(std::memory_order_acquire);
      if (try_join()) {
        if (index < wanted_) work();  // the loop's fields, read once joined
        joined_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  // Returns once gen_ differs from `seen`: a polite spin, then asleep.
  void wait_for(uint64_t seen) {
    using clock = std::chrono::steady_clock;
    const int us = spin_us_.load(std::memory_order_relaxed);
    const auto until = clock::now() + std::chrono::microseconds(us > 0 ? us : 0);
    for (int spins = 0; gen_.load(std::memory_order_acquire) == seen; ++spins) {
      if ((spins & 63) == 63) {
        if (clock::now() >= until) break;
        sched_yield();  // a runnable thread on this core goes first
      }
      _mm_pause();
    }
    if (gen_.load(std::memory_order_acquire) != seen) return;
    std::unique_lock<std::mutex> lk(mu_);
    sleeping_.fetch_add(1, std::memory_order_seq_cst);
    cv_.wait(lk, [&] { return gen_.load(std::memory_order_seq_cst) != seen; });
    sleeping_.fetch_sub(1, std::memory_order_seq_cst);
  }

  std::mutex run_mu_, mu_;
  std::condition_variable cv_;
  std::vector<std::thread> helpers_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> joined_{-1};
  std::atomic<int> sleeping_{0};
  void (*fn_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0;
  int wanted_ = 0;
  std::atomic<int> spin_us_{200};
};

// fn(item) for item in [0, n): on the pool, or (use_openmp, for before / after measurements in
// one process) in an OpenMP region with the items handed out dynamically as before.
inline std::atomic<bool>& use_openmp() {
  static std::atomic<bool> flag{std::getenv("POISE_LINEAR_OPENMP") != nullptr};
  return flag;
}

template <class F>
void parallel_for(int64_t n, int threads, F&& fn) {
  if (use_openmp().load(std::memory_order_relaxed)) {
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  Pool::instance().run(n, threads, fn);
}

}  // namespace ppool
