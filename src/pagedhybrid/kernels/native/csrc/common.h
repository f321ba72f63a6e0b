// What every op of the native CPU kernels shares: the op namespace of this build's CPU form,
// argument checks that name the op, the argument and the rule, and one parallel region per call.
//
// CPU forms. Each form is a separate library compiled for one ISA (vec.h): `avx512_bf16`
// (AVX-512 + vdpbf16ps + vpdpbusd), `avx512_vnni` (AVX-512 + vpdpbusd, bf16 in fp32 registers),
// `avx512` (AVX-512 F/BW/VL/DQ; bf16 converted to fp32 in registers),
// `avx2` (AVX2 + FMA + F16C, the same in 8 lanes). The build passes -DPH_FORM_ID=<form> and
// -DPH_NS=pagedhybrid_<form>, so every form registers its ops under its own namespace
// (torch.ops.pagedhybrid_<form>.*) and all the forms a CPU can run load side by side in one
// process; python picks one at start (kernels/native/__init__.py), and the op `cpu_form()` says
// which form a library is.
//
// Checks (PH_CHECK) run before any memory is touched and raise c10::ValueError (Python
// ValueError) with the message "pagedhybrid.<op>: <argument>: <rule> (got ...)". They cost O(B)
// or O(block-table entries the call reads): nothing per element of K/V, of a state or of a row.
//
// Threads (parallel_items, Helpers): one parallel step per call; items are claimed from a shared
// counter in chunks of `grain` by the calling thread and by helper threads that join when they
// get a core, and the call returns when its items are done -- it never waits for a helper that
// was not scheduled (an OpenMP region's join barrier does, which on cores shared with another
// busy process costs a scheduler tick or more per region). Work below `kInlineWork`
// multiply-adds runs inline on the calling thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#ifndef PH_NS
#define PH_NS pagedhybrid
#endif
#ifndef PH_FORM_ID
#define PH_FORM_ID default
#endif
#define PH_STR2(x) #x
#define PH_STR(x) PH_STR2(x)
#define PH_FORM PH_STR(PH_FORM_ID)

#define PH_CHECK(cond, op, arg, ...) \
  TORCH_CHECK_VALUE(cond, "pagedhybrid.", op, ": ", arg, ": ", __VA_ARGS__)

namespace pagedhybrid {

inline std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// `t` is a CPU tensor with exactly `dims` dimensions, dtype `dtype`, contiguous.
inline void check_tensor(const char* op, const char* arg, const at::Tensor& t, int64_t dims,
                         at::ScalarType dtype) {
  PH_CHECK(t.defined(), op, arg, "must be a tensor");
  PH_CHECK(t.device().is_cpu(), op, arg, "must be a CPU tensor (got ", t.device(), ")");
  PH_CHECK(t.dim() == dims, op, arg, "must have ", dims, " dimensions (got shape ", shape_of(t),
           ")");
  PH_CHECK(t.scalar_type() == dtype, op, arg, "must be ", dtype, " (got ", t.scalar_type(), ")");
  PH_CHECK(t.is_contiguous(), op, arg, "must be contiguous");
}

inline void check_size(const char* op, const char* arg, const at::Tensor& t, int64_t dim,
                       int64_t want, const char* what) {
  PH_CHECK(t.size(dim) == want, op, arg, "size(", dim, ") must equal ", what, " = ", want,
           " (got shape ", shape_of(t), ")");
}

// State-pool rows: every slot in [0, pool_rows), and no two sequences on one row (two items
// would update it at once).
inline void check_slots(const char* op, const at::Tensor& slots, int64_t batch,
                        int64_t pool_rows) {
  check_tensor(op, "slots", slots, 1, at::kLong);
  check_size(op, "slots", slots, 0, batch, "the number of sequences");
  const int64_t* s = slots.data_ptr<int64_t>();
  std::vector<bool> seen(static_cast<size_t>(pool_rows), false);
  for (int64_t i = 0; i < batch; ++i) {
    PH_CHECK(s[i] >= 0 && s[i] < pool_rows, op, "slots", "slots[", i, "] = ", s[i],
             " is outside the state pool [0, ", pool_rows, ")");
    PH_CHECK(!seen[s[i]], op, "slots", "slot ", s[i],
             " is repeated (each sequence needs its own state row)");
    seen[s[i]] = true;
  }
}

// cu_seqlens int32 [B+1]: cu[0] == 0, non-decreasing, cu[B] == rows.
// The sequence count B of a packed call's cu_seqlens [B+1] (its rank and length checked).
inline int64_t varlen_batch(const char* op, const at::Tensor& cu_t) {
  PH_CHECK(cu_t.dim() == 1 && cu_t.size(0) >= 1, op, "cu_seqlens", "must be [B+1] (got shape ",
           shape_of(cu_t), ")");
  return cu_t.size(0) - 1;
}

inline const int32_t* check_cu_seqlens(const char* op, const at::Tensor& cu_t, int64_t batch,
                                       int64_t rows) {
  check_tensor(op, "cu_seqlens", cu_t, 1, at::kInt);
  check_size(op, "cu_seqlens", cu_t, 0, batch + 1, "the number of sequences + 1");
  const int32_t* cu = cu_t.data_ptr<int32_t>();
  PH_CHECK(cu[0] == 0, op, "cu_seqlens", "must start at 0 (got ", cu[0], ")");
  for (int64_t i = 0; i < batch; ++i)
    PH_CHECK(cu[i + 1] >= cu[i], op, "cu_seqlens", "must be non-decreasing (cu_seqlens[", i + 1,
             "] = ", cu[i + 1], " < cu_seqlens[", i, "] = ", cu[i], ")");
  PH_CHECK(cu[batch] == rows, op, "cu_seqlens", "cu_seqlens[", batch,
           "] must equal the number of token rows ", rows, " (got ", cu[batch], ")");
  return cu;
}

// multiply-adds below which a call runs inline: waking a helper costs ~10-50 us (more on a
// shared core), as much as ~250k multiply-adds of a decode-sized projection compute in
constexpr int64_t kInlineWork = int64_t{1} << 18;

// The helper threads of parallel_items: (torch threads - 1) threads that watch for the next call
// for kSpinUs after each one (a decode step's calls follow each other within that), then sleep
// on a condition variable. A call publishes its job, wakes them and starts on the items itself;
// a helper that wakes while items are left claims some, one that wakes late finds none and
// sleeps again. The caller then waits only for items already claimed -- being run by a thread
// that is running -- never for a helper that has not been scheduled yet (an OpenMP region's
// join barrier waits for every thread of the team: on a core shared with another busy process
// that is a scheduler tick or more, 4-12 ms, for an op that computes in 0.3 ms).
class Helpers {
 public:
  static constexpr int kSpinUs = 200;  // how long a helper watches for the next call
  static Helpers& get() {
    static Helpers* pool = new Helpers();  // never destroyed: helpers may sleep at exit
    return *pool;
  }

  // f(i) for i in [0, n) in chunks of grain, on the caller and up to `helpers` threads
  template <class F>
  void run(int64_t n, int64_t grain, int helpers, const F& f) {
    std::unique_lock<std::mutex> caller(call_mu_, std::try_to_lock);
    if (!caller.owns_lock()) {  // another thread's call is running: this one runs inline
      for (int64_t i = 0; i < n; ++i) f(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (static_cast<int>(threads_.size()) < helpers)
        threads_.emplace_back([this] { loop(); });
      ctx_ = &f;
      fn_ = [](const void* ctx, int64_t i) { (*static_cast<const F*>(ctx))(i); };
      n_ = n;
      grain_ = grain;
      next_.store(0, std::memory_order_relaxed);
      seats_.store(helpers, std::memory_order_relaxed);
      closed_.store(false, std::memory_order_seq_cst);
      job_.store(job_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    }
    cv_.notify_all();
    claim();
    closed_.store(true, std::memory_order_seq_cst);
    while (active_.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
  }

 private:
  void claim() {
    for (;;) {
      const int64_t lo = next_.fetch_add(grain_, std::memory_order_relaxed);
      if (lo >= n_) return;
      for (int64_t i = lo, hi = std::min(n_, lo + grain_); i < hi; ++i) fn_(ctx_, i);
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      // the next call of a step usually comes within microseconds (a decode step's products
      // are ~20-100 us apart): watch for it a while before sleeping, so that it does not wait
      // for a wake-up (the caller never waits for this thread either way)
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinUs);
      bool ready = false;
      while (!ready && std::chrono::steady_clock::now() < until) {
        for (int i = 0; i < 64 && !ready; ++i) {
          ready = job_.load(std::memory_order_acquire) != seen;
          _mm_pause();
        }
      }
      if (ready) {
        seen = job_.load(std::memory_order_acquire);
      } else {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return job_.load(std::memory_order_relaxed) != seen; });
        seen = job_.load(std::memory_order_relaxed);
      }
      active_.fetch_add(1, std::memory_order_seq_cst);
      if (!closed_.load(std::memory_order_seq_cst) &&
          job_.load(std::memory_order_acquire) == seen &&
          seats_.fetch_sub(1, std::memory_order_relaxed) > 0)
        claim();
      active_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> job_{0};
  std::atomic<bool> closed_{true};
  std::atomic<int> active_{0}, seats_{0};
  std::atomic<int64_t> next_{0};
  const void* ctx_ = nullptr;
  void (*fn_)(const void*, int64_t) = nullptr;
  int64_t n_ = 0, grain_ = 1;
};

// The threads of parallel_items (0: torch.get_num_threads()), set by the op set_num_threads --
// the engine's thread governor (engine/contention.py) drops torch and this pool to one thread
// together while other processes keep the cores busy.
inline std::atomic<int>& pool_threads() {
  static std::atomic<int> n{0};
  return n;
}

// f(i) for every i in [0, n): items claimed in chunks of `grain` by the caller and the helper
// threads (pool_threads() in all); `work` (multiply-adds of the whole call, an estimate) below
// kInlineWork runs inline, and so does a call from inside a parallel region.
template <class F>
void parallel_items(int64_t n, int64_t grain, int64_t work, const F& f) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int set = pool_threads().load(std::memory_order_relaxed);
  const int64_t threads = std::min<int64_t>(set > 0 ? set : at::get_num_threads(),
                                            (n + grain - 1) / grain);
  if (threads <= 1 || work < kInlineWork || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  Helpers::get().run(n, grain, static_cast<int>(threads - 1), f);
}

}  // namespace pagedhybrid
