// A small persistent thread pool for the CPU primitives of metalnn's native
// extension.
//
// MLX's CPU backend runs the primitives of one stream on that stream's single
// thread, so a primitive that wants more cores splits its own work:
// parallel_for(n, f) runs f(begin, end) over chunks of [0, n) on the calling
// thread plus the pool's workers and returns when all chunks are done.
//
// * The pool starts lazily with hardware_concurrency() - 1 workers (at most
//   15); METALNN_NUM_THREADS=<k> caps the total (caller included) at k, and
//   set_num_threads() changes it at run time.
// * Within that cap a loop uses the cores other processes leave free, as
//   measured by the thread governor of metalnn's BLAS shim (metalnn/cpu/native/
//   blas_threads.c, found by name when the shim is loaded; otherwise the cap):
//   a worker whose core another process holds would hold up the whole loop.
// * One parallel_for at a time: a second caller (another MLX stream) that finds
//   the pool busy runs its loop on its own thread instead of waiting.
// * A process forked after the pool started would make a fresh pool (threads do
//   not survive fork), though MLX itself cannot evaluate in such a child.
// * Waiting: a worker that finished a job, and a caller waiting for the workers'
//   last chunks, first poll for up to spin_microseconds() (default 50 us;
//   METALNN_SPIN_US=<us>, 0 never polls) before sleeping on a condition
//   variable. A decoding step runs a few hundred short parallel loops a few
//   microseconds apart: woken through the kernel each time, a worker would take
//   longer to start than the loop takes. Between steps the workers sleep.

#pragma once

#include <dlfcn.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace metalnn_native {

inline int default_spin_microseconds() {
  int us = 50;
  if (const char* env = std::getenv("METALNN_SPIN_US")) {
    const int v = std::atoi(env);
    if (v >= 0) us = std::min(v, 10000);
  }
  return us;
}

inline std::atomic<int>& spin_microseconds() {
  static std::atomic<int> us{default_spin_microseconds()};
  return us;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls ready() for up to spin_microseconds(); whether it became true.
template <class Ready>
bool spin_until(const Ready& ready) {
  const int us = spin_microseconds().load(std::memory_order_relaxed);
  if (us <= 0) return ready();
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= until) return ready();
  }
}

class ThreadPool {
 public:
  using Range = std::function<void(size_t, size_t)>;

  explicit ThreadPool(int workers) {
    for (int i = 0; i < workers; ++i)
      threads_.emplace_back([this] { worker_loop(); });
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
      stop_flag_.store(true);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  int workers() const {
    return static_cast<int>(threads_.size());
  }

  // Runs f over [0, n) in chunks of at least `grain` items, using at most
  // `max_threads` threads (the caller included). Returns false (having done
  // nothing) when another parallel_for holds the pool.
  bool try_run(size_t n, size_t grain, int max_threads, const Range& f) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    const int helpers = std::min<int>(workers(), max_threads - 1);
    size_t chunks = std::max<size_t>(1, n / std::max<size_t>(grain, 1));
    // Two chunks a thread: enough to even out a thread that starts late, few enough that the
    // bookkeeping of the short loops of a decoding step stays small (SmolLM2's 120 decoding
    // products a token ran 1.15x faster than with four a thread, two threads).
    chunks = std::min<size_t>(chunks, static_cast<size_t>(helpers + 1) * 2);
    if (helpers <= 0 || chunks <= 1) {
      f(0, n);
      return true;
    }
    {
      std::unique_lock<std::mutex> lk(m_);
      // A worker woken for the previous job may still be on its way out.
      done_cv_.wait(lk, [this] { return running_ == 0; });
      job_ = &f;
      n_ = n;
      chunks_ = chunks;
      next_.store(0);
      done_ = 0;
      error_ = nullptr;
      active_helpers_ = helpers;
      finished_.store(false, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    work();  // the caller takes chunks too
    spin_until([this] { return finished_.load(std::memory_order_acquire); });
    std::unique_lock<std::mutex> lk(m_);
    done_cv_.wait(lk, [this] { return done_ == chunks_ && running_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  void work() {
    for (;;) {
      size_t c = next_.fetch_add(1);
      if (c >= chunks_) return;
      size_t begin = n_ * c / chunks_, end = n_ * (c + 1) / chunks_;
      try {
        if (begin < end) (*job_)(begin, end);
      } catch (...) {
        std::lock_guard<std::mutex> lk(m_);
        if (!error_) error_ = std::current_exception();
      }
      std::lock_guard<std::mutex> lk(m_);
      if (++done_ == chunks_) {
        if (running_ == 0) finished_.store(true, std::memory_order_release);
        done_cv_.notify_all();
      }
    }
  }

  void worker_loop() {
    uint64_t seen = 0;
    int index;
    {
      std::lock_guard<std::mutex> lk(m_);
      index = static_cast<int>(ids_++);
    }
    for (;;) {
      spin_until([&] { return generation_.load(std::memory_order_acquire) != seen || stop_flag_.load(); });
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return stop_ || generation_.load() != seen; });
        if (stop_) return;
        seen = generation_.load();
        if (index >= active_helpers_) continue;  // not needed for this job
        ++running_;
      }
      work();
      std::lock_guard<std::mutex> lk(m_);
      if (--running_ == 0) {
        if (done_ == chunks_) finished_.store(true, std::memory_order_release);
        done_cv_.notify_all();
      }
    }
  }

  std::vector<std::thread> threads_;
  std::mutex busy_;  // held for the duration of one parallel_for
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  bool stop_ = false;
  std::atomic<bool> stop_flag_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> finished_{false};  // every chunk done and no worker inside the job
  size_t ids_ = 0;
  const Range* job_ = nullptr;
  size_t n_ = 0, chunks_ = 0, done_ = 0;
  int running_ = 0, active_helpers_ = 0;
  std::atomic<size_t> next_{0};
  std::exception_ptr error_;
};

inline int default_num_threads() {
  int hw = static_cast<int>(std::thread::hardware_concurrency());
  int n = std::max(1, std::min(hw, 16));
  if (const char* env = std::getenv("METALNN_NUM_THREADS")) {
    int v = std::atoi(env);
    if (v >= 1) n = std::min(v, 16);
  }
  return n;
}

inline std::atomic<int>& num_threads_setting() {
  static std::atomic<int> n{default_num_threads()};
  return n;
}

inline int get_num_threads() {
  return num_threads_setting().load();
}

// At most `cap` threads, fewer when other processes keep cores busy (see the file comment).
inline int free_threads(int cap) {
  using Governor = int (*)(int);
  static const Governor governor = reinterpret_cast<Governor>(dlsym(RTLD_DEFAULT, "metalnn_free_threads"));
  return governor != nullptr ? governor(cap) : cap;
}

inline void set_num_threads(int n) {
  num_threads_setting().store(std::max(1, std::min(n, 16)));
}

inline ThreadPool& pool() {
  // Created on first use; a forked child (whose copy has no threads) makes its
  // own and never touches the parent's (deliberately leaked) one.
  static std::mutex m;
  static ThreadPool* p = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lk(m);
  if (p == nullptr || owner != getpid()) {
    const int hw = static_cast<int>(std::thread::hardware_concurrency());
    p = new ThreadPool(std::max(0, std::min(hw - 1, 15)));
    owner = getpid();
  }
  return *p;
}

// Runs f(begin, end) over [0, n) on up to get_num_threads() threads; serially
// when the work is small (n < 2 * grain) or one thread is requested.
inline void parallel_for(size_t n, size_t grain, const ThreadPool::Range& f) {
  if (n == 0) return;
  const int threads = free_threads(get_num_threads());
  if (threads <= 1 || n < 2 * std::max<size_t>(grain, 1)) {
    f(0, n);
    return;
  }
  if (!pool().try_run(n, grain, threads, f)) f(0, n);
}

}  // namespace metalnn_native
