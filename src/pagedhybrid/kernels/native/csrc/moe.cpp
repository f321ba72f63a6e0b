// Mixture-of-experts feed-forward: Qwen3.5-MoE's routed experts with the shared expert fused in
// (transformers 5.24's Qwen3_5MoeSparseMoeBlock after its router).
//
// moe_experts(x [T, H], index int64 [T, k], weights [T, k], gate_up [E, 2I, H], down [E, H, I],
//             shared_gate_proj [Is, H]?, shared_up_proj [Is, H]?, shared_down_proj [H, Is]?,
//             shared_gate [1, H]?, out [T, H], invariant):
//   out[t] = sum over the k experts e = index[t, j] in ascending expert order of
//              weights[t, j] * down_e(silu(g) * u), [g; u] = gate_up_e x[t]
//            + sigmoid(shared_gate . x[t]) * shared_down(silu(shared_gate_proj x[t]) *
//                                                        shared_up_proj x[t])
// (the shared part only when its four weights are given). x, weights and out are float32,
// bfloat16 or float16 (one dtype); the expert weights are x's dtype or, beside float32 x,
// bfloat16 / float16 (widened to fp32 in registers, as the linear kernels do). Every product
// rounds to x's dtype where transformers' module rounds (after each projection, the SiLU, the
// gating product, the routing weight, each add), with fp32 arithmetic and accumulation inside.
//
// Algorithm, one call per layer, four parallel phases (common.h's parallel_items):
//   0. one stable counting sort of the T*k (token, slot) pairs by expert (serial, O(T k + E)):
//      expert e's pairs occupy positions [first[e], first[e + 1]) in token order;
//   1. per token: its row copied to its k positions of xs [T k, H] (the one permute) and the
//      shared gate's dot product;
//   2. per (expert, row chunk, channel tile): gate and up products of the expert's gathered rows
//      read from the weights in place, h = silu(g) * u into hs [T k, I] (the shared expert's
//      over every token into hs_shared [T, Is]);
//   3. per (expert, row chunk, hidden tile): y = h . down_e^T times the pair's routing weight
//      into ys [T k, H] (the shared expert's times its sigmoid gate into ys_shared [T, H]);
//   4. per token: its k rows of ys summed in ascending expert order, then the shared row added.
// No expert weight is copied; the scratch is O(T k (H + I)), kept by the calling thread.
//
// Forms: the fast form multiplies an expert's rows with gemm.h's packed micro-kernel when it
// has kPackRows rows or more (prefill), else with the streaming dot-product kernel (decode:
// each expert weight read once). The invariant form (`invariant` true) uses the streaming
// kernel alone, whose every output element has one fixed reduction order whatever the number
// of rows, and the SiLU / sigmoid lane code (vec.h's activate) -- so a token's result is
// bitwise independent of which other tokens are in the call and picked the same experts, of
// its position and of the thread count. The fast form uses the same nonlinearities and sums;
// only its products for many-row experts differ at the rounding level.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "gemm.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

constexpr const char* kOp = "moe_experts";
constexpr int64_t kStreamRows = 64;  // rows per streaming task
constexpr int64_t kTileCols = 128;  // output columns per streaming task (32 -> 128: an MoE
                                    // layer at 8 / 32 tokens ~17% / ~12% faster, 4 paired runs)

struct Task {
  int64_t job;   // expert id, or E for the shared expert
  int64_t r0, rows;
  int64_t c0, cols;
  bool packed;   // the packed micro-kernel (else the streaming kernel)
};

// Tasks over (job, row chunk, column tile) for an output of `width` columns.
std::vector<Task> tasks_for(const std::vector<int64_t>& first, int64_t shared_rows,
                            int64_t width, int64_t shared_width, bool invariant) {
  std::vector<Task> tasks;
  const int64_t jobs = static_cast<int64_t>(first.size()) - 1;
  for (int64_t e = 0; e <= jobs; ++e) {
    const int64_t n = e < jobs ? first[e + 1] - first[e] : shared_rows;
    const int64_t w = e < jobs ? width : shared_width;
    if (n == 0 || w == 0) continue;
    const bool packed = !invariant && n >= kPackRows;
    const int64_t rstep = packed ? kPackTaskRows : kStreamRows;
    const int64_t cstep = packed ? kPanel : kTileCols;
    for (int64_t c0 = 0; c0 < w; c0 += cstep)
      for (int64_t r0 = 0; r0 < n; r0 += rstep) {
        const int64_t rows = std::min(rstep, n - r0);  // a packed job's last chunk may be short
        tasks.push_back({e, r0, rows, c0, std::min(cstep, w - c0), packed && rows >= kPackRows});
      }
  }
  return tasks;
}

// out [rows, cols] (ldo apart) = x rows . w rows: packed or streaming as the task says
template <typename TX, typename TW>
inline void product(const TX* x, int64_t ldx, int64_t rows, const TW* w, int64_t cols,
                    int64_t k, TX* out, int64_t ldo, bool packed) {
  if (packed) {
    gemm_panel<TX, TW, TX>(x, ldx, rows, w, static_cast<int>(cols), k, out, ldo);
  } else {
    gemm_fixed<TX, TW, TX>(x, ldx, rows, w, cols, k, out, ldo);
  }
}

// h[c] = round(round(silu(g[c])) * u[c]) for c < n (g, u rounded products)
template <typename TX>
inline void swiglu(const TX* g, const TX* u, int64_t n, TX* h) {
  alignas(64) float gv[kLanes];
  for (int64_t c = 0; c < n; c += kLanes) {
    const int m = static_cast<int>(std::min<int64_t>(kLanes, n - c));
    for (int i = 0; i < m; ++i) gv[i] = to_float(g[c + i]);
    silu_lanes(gv, m);
    for (int i = 0; i < m; ++i)
      h[c + i] = from_float<TX>(to_float(from_float<TX>(gv[i])) * to_float(u[c + i]));
  }
}

inline float sigmoid_of(float x) {
  alignas(64) float v[kLanes] = {};
  v[0] = x;
  store(v, activate<false>(load(v)));
  return v[0];
}

template <typename TX, typename TW>
void moe_impl(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights,
              const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor* shared,
              at::Tensor& out, bool invariant) {
  const int64_t t_rows = x.size(0), hidden = x.size(1), k = index.size(1);
  const int64_t experts = gate_up.size(0), inter = gate_up.size(1) / 2;
  const int64_t pairs = t_rows * k;
  const int64_t s_inter = shared ? shared[0].size(0) : 0;
  const TX* xp = x.data_ptr<TX>();
  const int64_t* ip = index.data_ptr<int64_t>();
  const TX* wp = weights.data_ptr<TX>();
  const TW* gup = gate_up.data_ptr<TW>();
  const TW* dnp = down.data_ptr<TW>();
  TX* op = out.data_ptr<TX>();

  // 0. pairs grouped by expert, in token order within each (a stable counting sort)
  std::vector<int64_t> first(static_cast<size_t>(experts + 1), 0), pair_at(pairs), pos_of(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++first[ip[p] + 1];
  for (int64_t e = 0; e < experts; ++e) first[e + 1] += first[e];
  {
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t pos = next[ip[p]]++;
      pair_at[pos] = p;
      pos_of[p] = pos;
    }
  }
  // the scratch: kept by the calling thread from call to call (grown, never shrunk), so that a
  // prefill chunk's ~T k (2H + I) elements are not fresh pages each layer (allocations past
  // glibc's 32 MiB mmap ceiling were mapped, zeroed by the kernel and unmapped every call: ~10%
  // of a 2048-token call)
  thread_local std::vector<TX> scratch;
  const int64_t ns = shared ? t_rows : 0;
  const int64_t need = pairs * (2 * hidden + inter) + ns * (s_inter + hidden);
  if (static_cast<int64_t>(scratch.size()) < need) {
    scratch = std::vector<TX>();  // the old pages go before the new ones come
    scratch.resize(static_cast<size_t>(need));
  }
  TX* xsp = scratch.data();
  TX* hsp = xsp + pairs * hidden;
  TX* ysp = hsp + pairs * inter;
  TX* hssp = shared ? ysp + pairs * hidden : nullptr;
  TX* yssp = shared ? hssp + ns * s_inter : nullptr;
  std::vector<float> gate_of(static_cast<size_t>(ns));

  // 1. the permute, and the shared expert's gate (one dot per token, rounded as a product)
  const TW* sgate = shared ? shared[3].data_ptr<TW>() : nullptr;
  parallel_items(t_rows, 1, pairs * hidden, [&](int64_t t) {
    for (int64_t j = 0; j < k; ++j)
      std::copy(xp + t * hidden, xp + (t + 1) * hidden, xsp + pos_of[t * k + j] * hidden);
    if (sgate) {
      TX logit;
      gemm_stream<TX, TW, TX>(xp + t * hidden, hidden, 1, sgate, 1, hidden, &logit, 1);
      gate_of[t] = to_float(from_float<TX>(sigmoid_of(to_float(logit))));
    }
  });

  // 2. h = silu(x . gate^T) * (x . up^T) per expert's rows and channel tile
  const std::vector<Task> up_tasks = tasks_for(first, shared ? t_rows : 0, inter, s_inter,
                                               invariant);
  const int64_t flops = (pairs * inter + (shared ? t_rows * s_inter : 0)) * hidden;
  parallel_items(static_cast<int64_t>(up_tasks.size()), 1, 2 * flops, [&](int64_t i) {
    const Task& tk = up_tasks[i];
    const bool is_shared = tk.job == experts;
    const TX* rows = is_shared ? xp + tk.r0 * hidden : xsp + (first[tk.job] + tk.r0) * hidden;
    const int64_t width = is_shared ? s_inter : inter;
    const TW* gw = is_shared ? shared[0].data_ptr<TW>() : gup + tk.job * 2 * inter * hidden;
    const TW* uw = is_shared ? shared[1].data_ptr<TW>() : gw + inter * hidden;
    TX* h = (is_shared ? hssp + tk.r0 * width : hsp + (first[tk.job] + tk.r0) * width) + tk.c0;
    thread_local std::vector<TX> g, u;
    g.resize(static_cast<size_t>(tk.rows * tk.cols));
    u.resize(g.size());
    product<TX, TW>(rows, hidden, tk.rows, gw + tk.c0 * hidden, tk.cols, hidden, g.data(),
                    tk.cols, tk.packed);
    product<TX, TW>(rows, hidden, tk.rows, uw + tk.c0 * hidden, tk.cols, hidden, u.data(),
                    tk.cols, tk.packed);
    for (int64_t r = 0; r < tk.rows; ++r)
      swiglu<TX>(g.data() + r * tk.cols, u.data() + r * tk.cols, tk.cols, h + r * width);
  });

  // 3. y = (h . down^T) * routing weight (the shared expert's: * its sigmoid gate)
  const std::vector<Task> down_tasks = tasks_for(first, shared ? t_rows : 0, hidden, hidden,
                                                 invariant);
  parallel_items(static_cast<int64_t>(down_tasks.size()), 1, flops, [&](int64_t i) {
    const Task& tk = down_tasks[i];
    const bool is_shared = tk.job == experts;
    const int64_t width = is_shared ? s_inter : inter;
    const int64_t row0 = is_shared ? tk.r0 : first[tk.job] + tk.r0;
    const TX* h = (is_shared ? hssp : hsp) + row0 * width;
    const TW* dw = (is_shared ? shared[2].data_ptr<TW>() : dnp + tk.job * hidden * inter) +
                   tk.c0 * width;
    TX* y = (is_shared ? yssp : ysp) + row0 * hidden + tk.c0;
    product<TX, TW>(h, width, tk.rows, dw, tk.cols, width, y, hidden, tk.packed);
    for (int64_t r = 0; r < tk.rows; ++r) {
      const float s = is_shared ? gate_of[row0 + r] : to_float(wp[pair_at[row0 + r]]);
      TX* yr = y + r * hidden;
      for (int64_t c = 0; c < tk.cols; ++c) yr[c] = from_float<TX>(to_float(yr[c]) * s);
    }
  });

  // 4. per token: its experts' rows in ascending expert order, then the shared expert's
  parallel_items(t_rows, 1, pairs * hidden, [&](int64_t t) {
    int64_t slots[64];
    int64_t n = 0;
    for (int64_t j = 0; j < k; ++j) {  // insertion sort of the token's k slots by expert
      const int64_t s = t * k + j;
      int64_t m = n++;
      while (m > 0 && ip[slots[m - 1]] > ip[s]) {
        slots[m] = slots[m - 1];
        --m;
      }
      slots[m] = s;
    }
    TX* o = op + t * hidden;  // k >= 1 (checked): the first expert's row, then the others
    std::copy(ysp + pos_of[slots[0]] * hidden, ysp + (pos_of[slots[0]] + 1) * hidden, o);
    for (int64_t m = 1; m < n; ++m) {
      const TX* y = ysp + pos_of[slots[m]] * hidden;
      for (int64_t c = 0; c < hidden; ++c) o[c] = from_float<TX>(to_float(o[c]) + to_float(y[c]));
    }
    if (shared) {
      const TX* y = yssp + t * hidden;
      for (int64_t c = 0; c < hidden; ++c) o[c] = from_float<TX>(to_float(o[c]) + to_float(y[c]));
    }
  });
}

void moe_experts(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights,
                 const at::Tensor& gate_up, const at::Tensor& down,
                 const c10::optional<at::Tensor>& shared_gate_proj,
                 const c10::optional<at::Tensor>& shared_up_proj,
                 const c10::optional<at::Tensor>& shared_down_proj,
                 const c10::optional<at::Tensor>& shared_gate, at::Tensor out, bool invariant) {
  PH_CHECK(x.defined() && x.dim() == 2, kOp, "x", "must be [T, H] (got shape ",
           x.defined() ? shape_of(x) : std::string("none"), ")");
  const auto xt = x.scalar_type();
  check_x_dtype(kOp, xt);
  check_tensor(kOp, "x", x, 2, xt);
  const int64_t t_rows = x.size(0), hidden = x.size(1);
  PH_CHECK(gate_up.defined() && gate_up.dim() == 3, kOp, "gate_up", "must be [E, 2I, H] (got ",
           gate_up.defined() ? shape_of(gate_up) : std::string("none"), ")");
  const auto wt = gate_up.scalar_type();
  check_w_dtype(kOp, "gate_up", xt, wt);
  check_tensor(kOp, "gate_up", gate_up, 3, wt);
  const int64_t experts = gate_up.size(0), inter = gate_up.size(1) / 2;
  PH_CHECK(experts >= 1 && gate_up.size(1) % 2 == 0 && inter >= 1, kOp, "gate_up",
           "must be [E >= 1, 2I (even, >= 2), H] (got ", shape_of(gate_up), ")");
  check_size(kOp, "gate_up", gate_up, 2, hidden, "the hidden size H of x");
  check_tensor(kOp, "down", down, 3, wt);
  check_size(kOp, "down", down, 0, experts, "the number of experts E of gate_up");
  check_size(kOp, "down", down, 1, hidden, "the hidden size H of x");
  check_size(kOp, "down", down, 2, inter, "the intermediate size I of gate_up");
  check_tensor(kOp, "index", index, 2, at::kLong);
  check_size(kOp, "index", index, 0, t_rows, "the rows T of x");
  const int64_t k = index.size(1);
  PH_CHECK(k >= 1 && k <= std::min<int64_t>(experts, 64), kOp, "index",
           "top-k (size(1)) must be in [1, min(E, 64)] (got ", k, ", E = ", experts, ")");
  const int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t p = 0; p < t_rows * k; ++p)
    PH_CHECK(ip[p] >= 0 && ip[p] < experts, kOp, "index", "index[", p / k, ", ", p % k, "] = ",
             ip[p], " is outside the experts [0, ", experts, ")");
  check_tensor(kOp, "weights", weights, 2, xt);
  check_size(kOp, "weights", weights, 0, t_rows, "the rows T of x");
  check_size(kOp, "weights", weights, 1, k, "the top-k of index");
  check_tensor(kOp, "out", out, 2, xt);
  check_size(kOp, "out", out, 0, t_rows, "the rows T of x");
  check_size(kOp, "out", out, 1, hidden, "the hidden size H of x");
  const int given = shared_gate_proj.has_value() + shared_up_proj.has_value() +
                    shared_down_proj.has_value() + shared_gate.has_value();
  PH_CHECK(given == 0 || given == 4, kOp, "shared_*",
           "the shared expert needs all four weights or none (got ", given, ")");
  at::Tensor shared[4];
  if (given == 4) {
    shared[0] = *shared_gate_proj;
    shared[1] = *shared_up_proj;
    shared[2] = *shared_down_proj;
    shared[3] = *shared_gate;
    check_tensor(kOp, "shared_gate_proj", shared[0], 2, wt);
    const int64_t s_inter = shared[0].size(0);
    check_size(kOp, "shared_gate_proj", shared[0], 1, hidden, "the hidden size H of x");
    check_tensor(kOp, "shared_up_proj", shared[1], 2, wt);
    check_size(kOp, "shared_up_proj", shared[1], 0, s_inter, "shared_gate_proj's rows");
    check_size(kOp, "shared_up_proj", shared[1], 1, hidden, "the hidden size H of x");
    check_tensor(kOp, "shared_down_proj", shared[2], 2, wt);
    check_size(kOp, "shared_down_proj", shared[2], 0, hidden, "the hidden size H of x");
    check_size(kOp, "shared_down_proj", shared[2], 1, s_inter, "shared_gate_proj's rows");
    check_tensor(kOp, "shared_gate", shared[3], 2, wt);
    check_size(kOp, "shared_gate", shared[3], 0, 1, "1");
    check_size(kOp, "shared_gate", shared[3], 1, hidden, "the hidden size H of x");
  }
  if (t_rows == 0) return;
  by_dtypes(x, gate_up, [&](auto xtag, auto wtag) {
    moe_impl<decltype(xtag), decltype(wtag)>(x, index, weights, gate_up, down,
                                             given == 4 ? shared : nullptr, out, invariant);
  });
}

}  // namespace
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.def(
      "moe_experts(Tensor x, Tensor index, Tensor weights, Tensor gate_up, Tensor down, "
      "Tensor? shared_gate_proj, Tensor? shared_up_proj, Tensor? shared_down_proj, "
      "Tensor? shared_gate, Tensor(a!) out, bool invariant) -> ()");
}

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) {
  m.impl("moe_experts", &pagedhybrid::moe_experts);
}
