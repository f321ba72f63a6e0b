// The sampler's greedy pick: per row of fp32 logits [R, V], the index of the first maximum
// (torch.argmax's rule), or -1 where the row holds a NaN or an infinity (the engine fails that
// request alone). One pass finds the row's maximum and whether every value is finite (x - x is 0
// for a finite x, NaN otherwise, and a NaN anywhere makes the running sum NaN); a second pass
// finds the first lane equal to the maximum. Exact: no arithmetic touches the chosen value, so
// the result is the same whatever the batch, the row's place in it or the thread count.
//
// With a grammar's token bitmask (int32 [R, ceil(V / 32)], llguidance's and xgrammar's layout:
// bit t % 32 of word t / 32 allows token t) the maximum is taken over the allowed tokens only
// (still -1 for a row with a non-finite value anywhere, and -1 where the mask allows no token),
// and apply_token_bitmask_ writes -inf over the refused tokens in place: the packed mask is
// read as it comes from the grammar library, never unpacked to a [R, V] bool tensor.
//
// top_rows gives some rows' k best tokens in the same order: by value, then by id -- exactly
// the first k of the order in which greedy_rows (with or without a mask) picks, so the first of
// them a grammar allows is the masked argmax. A chunk of lanes none of which beats the k-th value
// kept so far is passed over with one compare.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"
#include "kernels.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

// The row's maximum into *best; false where it holds a NaN or an infinity (one pass).
bool max_if_finite(const float* x, int64_t v, float* best) {
  VF top = bcast(-__builtin_inff());
  VF nan_if_bad = zero();
  int64_t j = 0;
  for (; j + kLanes <= v; j += kLanes) {
    const VF a = load(x + j);
    top = vmax(top, a);
    nan_if_bad = add(nan_if_bad, sub(a, a));
  }
  *best = reduce_max(top);
  bool finite = std::isfinite(reduce_add(nan_if_bad));
  for (; j < v; ++j) {
    finite = finite && std::isfinite(x[j]);
    *best = x[j] > *best ? x[j] : *best;
  }
  return finite;
}

int64_t pick_row(const float* x, int64_t v) {
  float best;
  if (!max_if_finite(x, v, &best)) return -1;
  const VF want = bcast(best);
  int64_t j = 0;
  for (; j + kLanes <= v; j += kLanes) {
    const int lane = first_equal(load(x + j), want);
    if (lane >= 0) return j + lane;
  }
  for (; j < v; ++j)
    if (x[j] == best) return j;
  return -1;  // not reached: best is one of the row's values
}

// The first maximum over the tokens `bits` allows (-1: none allowed or a non-finite value).
int64_t pick_allowed(const float* x, int64_t v, const uint32_t* bits) {
  float best;  // the whole row's maximum: only its finite check is wanted here
  if (!max_if_finite(x, v, &best)) return -1;
  best = -__builtin_inff();
  int64_t at = -1;
  for (int64_t w = 0; w * 32 < v; ++w) {
    uint32_t word = bits[w];
    const int64_t base = w * 32;
    if (base + 32 > v) word &= (uint32_t{1} << (v - base)) - 1;  // bits past the vocabulary
    if (word == ~uint32_t{0}) {  // a whole word allowed: its maximum, then its first lane
      VF top = load(x + base);
      for (int k = kLanes; k < 32; k += kLanes) top = vmax(top, load(x + base + k));
      const float m = reduce_max(top);
      if (at >= 0 && m <= best) continue;
      for (int k = 0; k < 32; k += kLanes) {
        const int lane = first_equal(load(x + base + k), bcast(m));
        if (lane >= 0) {
          best = m, at = base + k + lane;
          break;
        }
      }
      continue;
    }
    for (; word != 0; word &= word - 1) {
      const int64_t t = base + __builtin_ctz(word);
      if (at < 0 || x[t] > best) best = x[t], at = t;
    }
  }
  return at;
}

void refuse_tokens(float* x, int64_t v, const uint32_t* bits) {
  const float ninf = -__builtin_inff();
  for (int64_t w = 0; w * 32 < v; ++w) {
    const uint32_t word = bits[w];
    if (word == ~uint32_t{0}) continue;
    const int64_t base = w * 32, n = std::min<int64_t>(32, v - base);
    for (int64_t k = 0; k < n; ++k)
      if (!((word >> k) & 1)) x[base + k] = ninf;
  }
}

// The k best of a row x[0, v) without a NaN into val / ids (k <= v), by value then id.
void top_row(const float* x, int64_t v, int64_t k, float* val, int64_t* ids) {
  int64_t n = 0;
  auto keep = [&](int64_t t) {  // after every kept value >= x[t]; a full list drops its last
    int64_t i = n < k ? n++ : k - 1;
    for (; i > 0 && val[i - 1] < x[t]; --i) val[i] = val[i - 1], ids[i] = ids[i - 1];
    val[i] = x[t], ids[i] = t;
  };
  int64_t j = 0;
  for (; j + kLanes <= v; j += kLanes) {
    if (n == k && reduce_max(load(x + j)) <= val[k - 1]) continue;
    for (int64_t t = j; t < j + kLanes; ++t)
      if (n < k || x[t] > val[k - 1]) keep(t);
  }
  for (; j < v; ++j)
    if (n < k || x[j] > val[k - 1]) keep(j);
}

void check_bitmask(const char* op, const at::Tensor& logits, const at::Tensor& bits) {
  check_tensor(op, "allowed", bits, 2, at::kInt);
  PH_CHECK(bits.size(0) == logits.size(0) && bits.size(1) == (logits.size(1) + 31) / 32, op,
           "allowed", "must be int32 [R, ceil(V / 32)] for logits ", shape_of(logits),
           " (got shape ", shape_of(bits), ")");
}

}  // namespace

at::Tensor greedy_rows(const at::Tensor& logits, const c10::optional<at::Tensor>& allowed) {
  const char* op = "greedy_rows";
  check_tensor(op, "logits", logits, 2, at::kFloat);
  PH_CHECK(logits.size(1) >= 1, op, "logits", "must have at least one column (got shape ",
           shape_of(logits), ")");
  const int64_t rows = logits.size(0), v = logits.size(1), words = (v + 31) / 32;
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  if (allowed.has_value()) {
    check_bitmask(op, logits, *allowed);
    const auto* bits = reinterpret_cast<const uint32_t*>(allowed->data_ptr<int32_t>());
    parallel_items(rows, 1, rows * v,
                   [&](int64_t r) { o[r] = pick_allowed(x + r * v, v, bits + r * words); });
  } else {
    parallel_items(rows, 1, rows * v, [&](int64_t r) { o[r] = pick_row(x + r * v, v); });
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> top_rows(const at::Tensor& logits, at::IntArrayRef rows,
                                            int64_t k) {
  const char* op = "top_rows";
  check_tensor(op, "logits", logits, 2, at::kFloat);
  const int64_t n = static_cast<int64_t>(rows.size()), r0 = logits.size(0), v = logits.size(1);
  PH_CHECK(k >= 1 && k <= v, op, "k", "must be in [1, ", v, "] (got ", k, ")");
  for (const int64_t r : rows)
    PH_CHECK(r >= 0 && r < r0, op, "rows", "must index the ", r0, " rows of logits (got ", r,
             ")");
  at::Tensor val = at::empty({n, k}, logits.options());
  at::Tensor ids = at::empty({n, k}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  float* pv = val.data_ptr<float>();
  int64_t* pi = ids.data_ptr<int64_t>();
  parallel_items(n, 1, n * v,
                 [&](int64_t i) { top_row(x + rows[i] * v, v, k, pv + i * k, pi + i * k); });
  return {val, ids};
}

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& allowed) {
  const char* op = "apply_token_bitmask_";
  check_tensor(op, "logits", logits, 2, at::kFloat);
  check_bitmask(op, logits, allowed);
  const int64_t rows = logits.size(0), v = logits.size(1), words = (v + 31) / 32;
  float* x = logits.data_ptr<float>();
  const auto* bits = reinterpret_cast<const uint32_t*>(allowed.data_ptr<int32_t>());
  parallel_items(rows, 1, rows * v,
                 [&](int64_t r) { refuse_tokens(x + r * v, v, bits + r * words); });
}

}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.def("greedy_rows(Tensor logits, Tensor? allowed=None) -> Tensor");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor allowed) -> ()");
  m.def("top_rows(Tensor logits, int[] rows, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) {
  m.impl("greedy_rows", &pagedhybrid::greedy_rows);
  m.impl("apply_token_bitmask_", &pagedhybrid::apply_token_bitmask_);
  m.impl("top_rows", &pagedhybrid::top_rows);
}
