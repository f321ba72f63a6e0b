// The GEMM tiles the native kernels share (linear.cpp's projections, moe.cpp's experts): one
// thread's product out [rows, cols] = x [rows, K] . w [cols, K]^T, x rows TX and weight rows TW
// widened to fp32 in registers, fp32 accumulation, out rounded once to TO.
//
// gemm_stream -- the dot-product form with one fixed reduction order per output element: kLanes
// partial sums, lane l accumulating k = l, l + kLanes, ... in ascending order with FMAs (a masked
// zero-filled load for the K tail), then one fixed horizontal reduction. Rows and weight rows are
// register-blocked 4 x 4 (4 x 3 and 3 x 3 on AVX2, 2 x 4 for a pair of tail rows; a single row
// 1 x 1 on AVX-512, 1 x 8 on AVX2; a block only shares loads, each accumulator's arithmetic is
// its own), so neither the number of rows, a row's position nor the blocking changes a bit of a
// result: the batch-invariant products use it alone. For one row it streams each weight once
// (decode), prefetching the next block's rows.
//
// gemm_panel -- the packed form for many rows (prefill): up to kPackTaskRows rows against one
// panel of up to kPanel weight rows, packed K-major into fp32 (kDepth dims at a time) and an
// outer-product micro-kernel keeping kMicroRows x kPanel accumulators in registers; the K blocks
// change the summation order, so its results depend on the path taken (not batch-invariant).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common.h"
#include "vec.h"

namespace pagedhybrid {
namespace {  // internal linkage: every CPU form's library has its own copy

constexpr int kBlockRows = 4;  // x rows per register block
constexpr int kBlockCols = 4;  // weight rows per register block
#if defined(__AVX512F__)
constexpr int kWideCols = kBlockCols;  // weight rows beside 3-4 x rows (32 registers: room)
#else
// AVX2 has 16 registers: 4 x 4 accumulators and their loads spill, 4 x 3 do not (a 4-row
// product of a [4096, 256] bf16 weight: 177 -> 127 us on one EPYC core)
constexpr int kWideCols = 3;
#endif

// How a register block reads and multiplies one step of K. `Widened`: kLanes elements of x rows
// TX and weight rows TW widened to fp32 in registers by load(), FMAs into fp32 lanes (every
// form).
struct Widened {
  static constexpr int kStep = kLanes;
  template <typename T>
  static VF read(const T* p) { return load(p); }
  template <typename T>
  static VF read_first(const T* p, int n) { return load_first(p, n); }
  static VF madd(VF acc, VF x, VF w) { return fma(x, w, acc); }
};

// `Pairs`: bf16 rows against bf16 weight rows where the CPU form has AVX512-BF16 -- 32 elements
// a step by vdpbf16ps (the products exact, pairs summed into the fp32 lanes, denormals flushed),
// no widening: the widening form is bound by its conversions at one row. Lane l accumulates
// the pairs at k = 2l, 2l + 32, ... in ascending order, then the same fixed horizontal sum, so
// every row count takes this form (gemm_fixed does not widen such weights, linear.cpp not such
// rows).
#if defined(__AVX512BF16__)
template <typename TX, typename TW>
constexpr bool kBf16Pairs =
    std::is_same_v<TX, c10::BFloat16> && std::is_same_v<TW, c10::BFloat16>;

struct Pairs {
  static constexpr int kStep = 32;
  static __m512bh read(const c10::BFloat16* p) {
    return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
  }
  static __m512bh read_first(const c10::BFloat16* p, int n) {  // n < 32
    return reinterpret_cast<__m512bh>(
        _mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint32_t{1} << n) - 1), p));
  }
  static VF madd(VF acc, __m512bh x, __m512bh w) { return _mm512_dpbf16_ps(acc, x, w); }
};

template <typename TX, typename TW>
using StepOf = std::conditional_t<kBf16Pairs<TX, TW>, Pairs, Widened>;
#else
template <typename TX, typename TW>
constexpr bool kBf16Pairs = false;

template <typename TX, typename TW>
using StepOf = Widened;
#endif

// x rows TX, weight rows TW, out TO: one step of K at a time as StepOf<TX, TW> reads and
// multiplies it (a masked zero-filled read for the K tail), then one fixed horizontal sum per
// accumulator.
template <typename TX, typename TW, typename TO, int R, int C>
inline void block(const TX* x, const TW* w, int64_t k, int64_t ldx, int64_t ldw, TO* out,
                  int64_t ldo) {
  using S = StepOf<TX, TW>;
  using V = decltype(S::read(w));
  VF acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  int64_t e = 0;
  for (; e + S::kStep <= k; e += S::kStep) {
    // decode streams each weight once: fetch the next block's rows (same offset) into L2 while
    // this block computes (short 2-8 KiB rows start too many streams for the hardware
    // prefetcher to ramp up on) -- for 2-4 rows too (an MoE layer's experts at 32 tokens, ~4
    // rows each: 3.75 -> 2.70 ms); past the matrix's end a prefetch is a no-op
    for (int c = 0; c < C; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(w + (C + c) * ldw + e), _MM_HINT_T1);
    V wv[C];
    for (int c = 0; c < C; ++c) wv[c] = S::read(w + c * ldw + e);
    for (int r = 0; r < R; ++r) {
      const auto xv = S::read(x + r * ldx + e);
      for (int c = 0; c < C; ++c) acc[r][c] = S::madd(acc[r][c], xv, wv[c]);
    }
  }
  if (e < k) {
    const int n = static_cast<int>(k - e);
    V wv[C];
    for (int c = 0; c < C; ++c) wv[c] = S::read_first(w + c * ldw + e, n);
    for (int r = 0; r < R; ++r) {
      const auto xv = S::read_first(x + r * ldx + e, n);
      for (int c = 0; c < C; ++c) acc[r][c] = S::madd(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = from_float<TO>(reduce_add(acc[r][c]));
}

// A single row (decode) on AVX-512 reads one weight row at a time: a task's rows are contiguous,
// so the weight is one sequential stream, which the prefetchers follow; 8 weight rows a block (8
// streams 2-4 KiB apart) read a decode step's bf16 weights at 23-28 GB/s against 31 (the
// benchmark model's 282 MB of projections, 2 threads, AVX512-BF16; fp32 the same either way).
// On AVX2 a single row blocks 8 weight rows: there a bf16 row's widening FMA chain alone is
// slower than memory (22.5 against 27.5 GB/s). More rows share each weight load kBlockCols at a
// time. Each accumulator's arithmetic is its own either way, so the blocking changes no bit of
// the result.
#if defined(__AVX512F__)
constexpr int kSingleRowCols = 1;
#else
constexpr int kSingleRowCols = 2 * kBlockCols;
#endif
template <typename TX, typename TW, typename TO, int R>
inline void row_block(const TX* x, const TW* w, int64_t cols, int64_t k, int64_t ldx, TO* out,
                      int64_t ldo) {
  constexpr int kCols = R == 1 ? kSingleRowCols : R > 4 ? 3 : R >= 3 ? kWideCols : kBlockCols;
  int64_t c = 0;
  for (; c + kCols <= cols; c += kCols)
    block<TX, TW, TO, R, kCols>(x, w + c * k, k, ldx, k, out + c, ldo);
  if constexpr (kCols != kBlockCols) {
    for (; c + kBlockCols <= cols; c += kBlockCols)
      block<TX, TW, TO, R, kBlockCols>(x, w + c * k, k, ldx, k, out + c, ldo);
  }
  for (; c < cols; ++c) block<TX, TW, TO, R, 1>(x, w + c * k, k, ldx, k, out + c, ldo);
}

// out[r * ldo + c] = x row r . w row c, for r < rows, c < cols (x rows ldx apart, w rows k apart)
template <typename TX, typename TW, typename TO>
inline void gemm_stream(const TX* x, int64_t ldx, int64_t rows, const TW* w, int64_t cols,
                        int64_t k, TO* out, int64_t ldo) {
  int64_t r = 0;
  if constexpr (kBf16Pairs<TX, TW>) {  // 8 rows x 3 weight rows: each weight load feeds 8 rows
    for (; r + 8 <= rows; r += 8)
      row_block<TX, TW, TO, 8>(x + r * ldx, w, cols, k, ldx, out + r * ldo, ldo);
  }
  for (; r + kBlockRows <= rows; r += kBlockRows)
    row_block<TX, TW, TO, kBlockRows>(x + r * ldx, w, cols, k, ldx, out + r * ldo, ldo);
  if (r + 3 <= rows) {  // the rest share each weight load (a verify chunk, an expert's rows)
    row_block<TX, TW, TO, 3>(x + r * ldx, w, cols, k, ldx, out + r * ldo, ldo);
    r += 3;
  } else if (r + 2 <= rows) {
    row_block<TX, TW, TO, 2>(x + r * ldx, w, cols, k, ldx, out + r * ldo, ldo);
    r += 2;
  }
  for (; r < rows; ++r) row_block<TX, TW, TO, 1>(x + r * ldx, w, cols, k, ldx, out + r * ldo, ldo);
}

constexpr int64_t kWidenRows = 16;  // rows from which gemm_fixed widens bf16/fp16 weights first

// gemm_stream; with bf16 / fp16 weights and at least kWidenRows rows the weight rows are widened
// into a per-thread fp32 panel once (exactly) and reused by every row block: the same bits
template <typename TX, typename TW, typename TO>
inline void gemm_fixed(const TX* x, int64_t ldx, int64_t rows, const TW* w, int64_t cols,
                       int64_t k, TO* out, int64_t ldo) {
  if constexpr (!std::is_same_v<TW, float> && !kBf16Pairs<TX, TW>) {
    if (rows >= kWidenRows) {
      thread_local std::vector<float> panel;
      panel.resize(static_cast<size_t>(cols * k));
      for (int64_t i = 0; i < cols * k; i += kLanes) {
        const int rest = static_cast<int>(std::min<int64_t>(kLanes, cols * k - i));
        if (rest == kLanes) {
          store(panel.data() + i, load(w + i));
        } else {
          store_first(panel.data() + i, load_first(w + i, rest), rest);
        }
      }
      gemm_stream<TX, float, TO>(x, ldx, rows, panel.data(), cols, k, out, ldo);
      return;
    }
  }
  gemm_stream<TX, TW, TO>(x, ldx, rows, w, cols, k, out, ldo);
}

constexpr int kPanelVecs = 2;
constexpr int kPanel = kPanelVecs * kLanes;  // output columns (weight rows) per panel
#if defined(__AVX512F__)
constexpr int kMicroRows = 12;  // 24 accumulators + 2 weight vectors + 1 broadcast of 32 zmm
#else
constexpr int kMicroRows = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast of 16 ymm
#endif
constexpr int64_t kPackRows = 16;      // rows from which the packed form runs
constexpr int64_t kPackTaskRows = 96;  // rows per task (a multiple of 12 and of 6)
constexpr int64_t kDepth = 256;        // K dims per packed panel block (32 KiB: L1)

// panel[e][c] = w[c][e0 + e] for e < kc, c < cols (zero columns past cols), in fp32
template <typename TW>
void pack_panel(const TW* w, int64_t k, int64_t e0, int kc, int cols, float* panel) {
  for (int cb = 0; cb < kPanelVecs; ++cb) {
    for (int e = 0; e < kc; e += kLanes) {
      const int n = std::min(kLanes, kc - e);
      VF rows[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        const int c = cb * kLanes + j;
        const TW* src = w + c * k + e0 + e;
        rows[j] = c >= cols ? zero() : n == kLanes ? load(src) : load_first(src, n);
      }
      transpose(rows);  // rows[i] = dim e + i of the kLanes columns
      for (int i = 0; i < n; ++i) store(panel + (e + i) * kPanel + cb * kLanes, rows[i]);
    }
  }
}

// tile[r][:] (+)= x[r][0:kc] . panel for R rows (tile rows of kPanel fp32)
template <typename TX, int R>
inline void micro(const TX* x, int64_t ldx, const float* panel, int kc, bool first,
                  float* tile) {
  VF acc[R][kPanelVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kPanelVecs; ++v)
      acc[r][v] = first ? zero() : load(tile + r * kPanel + v * kLanes);
  for (int e = 0; e < kc; ++e) {
    VF wv[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) wv[v] = load(panel + e * kPanel + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const VF xb = bcast(to_float(x[r * ldx + e]));
      for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = fma(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kPanelVecs; ++v) store(tile + r * kPanel + v * kLanes, acc[r][v]);
}

template <typename TX>
inline void micro_rows(int rows, const TX* x, int64_t ldx, const float* panel, int kc,
                       bool first, float* tile) {
  switch (rows) {
#define PH_CASE(N) \
  case N:          \
    return micro<TX, N>(x, ldx, panel, kc, first, tile);
    PH_CASE(1) PH_CASE(2) PH_CASE(3) PH_CASE(4) PH_CASE(5) PH_CASE(6)
#if defined(__AVX512F__)
    PH_CASE(7) PH_CASE(8) PH_CASE(9) PH_CASE(10) PH_CASE(11) PH_CASE(12)
#endif
#undef PH_CASE
    default:
      break;
  }
}

// out[r * ldo + c] = x row r . w row c for r < rows <= kPackTaskRows, c < cols <= kPanel: the
// panel packed kDepth dims at a time, the micro-kernel over kMicroRows rows at a time, summed
// into an fp32 tile rounded to TO once
template <typename TX, typename TW, typename TO>
inline void gemm_panel(const TX* x, int64_t ldx, int64_t rows, const TW* w, int cols, int64_t k,
                       TO* out, int64_t ldo) {
  if constexpr (!std::is_same_v<TX, float>) {  // bf16 / fp16 rows widened first (exactly): the
    // micro-kernel's broadcasts are then loads, not a scalar widening each (16 x [4096, 256]
    // bf16 on AVX2: 504 -> 328 us; the same products, so the same bits)
    thread_local std::vector<float> xf;
    xf.resize(static_cast<size_t>(rows * k));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < k; e += kLanes) {
        const int n = static_cast<int>(std::min<int64_t>(kLanes, k - e));
        if (n == kLanes) {
          store(xf.data() + r * k + e, load(x + r * ldx + e));
        } else {
          store_first(xf.data() + r * k + e, load_first(x + r * ldx + e, n), n);
        }
      }
    gemm_panel<float, TW, TO>(xf.data(), k, rows, w, cols, k, out, ldo);
    return;
  }
  thread_local std::vector<float> panel, tile;
  panel.resize(static_cast<size_t>(kDepth * kPanel));
  tile.resize(static_cast<size_t>(kPackTaskRows * kPanel));
  for (int64_t e0 = 0; e0 < k; e0 += kDepth) {
    const int kc = static_cast<int>(std::min<int64_t>(kDepth, k - e0));
    pack_panel<TW>(w, k, e0, kc, cols, panel.data());
    for (int64_t r = 0; r < rows; r += kMicroRows)
      micro_rows<TX>(static_cast<int>(std::min<int64_t>(kMicroRows, rows - r)),
                     x + r * ldx + e0, ldx, panel.data(), kc, e0 == 0,
                     tile.data() + r * kPanel);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) out[r * ldo + c] = from_float<TO>(tile[r * kPanel + c]);
}

// The dtypes the products take (by_dtypes dispatches them): x float32, bfloat16 or float16; the
// weights in x's dtype, or bfloat16 / float16 beside float32 x.
inline void check_x_dtype(const char* op, at::ScalarType xt) {
  PH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, op, "x",
           "dtype must be float32, bfloat16 or float16 (got ", xt, ")");
}
inline void check_w_dtype(const char* op, const char* arg, at::ScalarType xt,
                          at::ScalarType wt) {
  PH_CHECK(wt == xt || (xt == at::kFloat && (wt == at::kBFloat16 || wt == at::kHalf)), op, arg,
           "dtype must be x's (", xt, "), or bfloat16 / float16 with float32 x (got ", wt, ")");
}

// f(x tag, w tag) for the dtype pairs check_linear allows (out is x's dtype)
template <class F>
void by_dtypes(const at::Tensor& x, const at::Tensor& w, const F& f) {
  const auto xt = x.scalar_type(), wt = w.scalar_type();
  if (xt == at::kBFloat16) {
    f(c10::BFloat16{}, c10::BFloat16{});
  } else if (xt == at::kHalf) {
    f(c10::Half{}, c10::Half{});
  } else if (wt == at::kBFloat16) {
    f(float{}, c10::BFloat16{});
  } else if (wt == at::kHalf) {
    f(float{}, c10::Half{});
  } else {
    f(float{}, float{});
  }
}

}  // namespace
}  // namespace pagedhybrid
