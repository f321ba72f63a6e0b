// What the int8 / int4 ops (quant.cpp: the weights' checks, the activations' quantisation, the
// ops) share with their kernels (quant_gemm.cpp: the products of the codes by the quantised
// activations): the activation sub-block, the grouped layout's rows, the codes' prefetch
// policies, the quantised activations (Rows), a weight of a call (Weight) and the product.
// Hidden visibility, as kernels.h's: every CPU form's library has its own.
#pragma once

#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace pagedhybrid {

constexpr int kAct = 32;  // activation sub-block (elements per activation scale)
// rows of a group of the grouped layout (weightquant.group_rows; quant_gemm.cpp's group_rows)
constexpr int64_t kGroup = 16;

// Weight codes are prefetched ahead of the loads, with a hint chosen by the CPU's vendor at load
// (code_prefetch(); one instantiation of the kernels per policy, chosen once per call):
// * AMD (`NtaAhead`): 2 KiB ahead, non-temporally. The rows of a task are contiguous, so this
//   runs into the next rows, which the hardware prefetcher (a new stream every 512-byte row of a
//   1024-wide int4 weight) fetches late; kept out of the outer caches, they also leave the step's
//   other data there. On the 2-core EPYC: int4 decode products (an LM head and a layer's
//   projections, M = 1, interleaved with and without) 1346 -> 1123 us (-17%), int8 -10%, int4
//   block 128 -21%, a torch op after them ~12% faster; a T0 prefetch as fast but that op slower.
// * Intel and the rest (`T0Ahead`): 4 KiB ahead into L1. An NTA prefetch there fills L1 alone
//   and the line is gone before its load: the int4 block-32 loop read 32 MiB of codes in huge
//   pages at 5.0 GB/s with it against 22.6 with no prefetch and 23.8 with T0 4 KiB ahead (one
//   thread, a 2-core Xeon with AVX512-BF16 / AMX, alternating; T1 / T2 at 2-8 KiB 22.9-23.9).
struct PH_LOCAL NtaAhead {
  static constexpr const char* kName = "NTA 2 KiB ahead";
  static void at(const uint8_t* p) {
    _mm_prefetch(reinterpret_cast<const char*>(p + 2048), _MM_HINT_NTA);
  }
};
struct PH_LOCAL T0Ahead {
  static constexpr const char* kName = "T0 4 KiB ahead";
  static void at(const uint8_t* p) {
    _mm_prefetch(reinterpret_cast<const char*>(p + 4096), _MM_HINT_T0);
  }
};

struct Rows {  // the quantised activations
  const int8_t* q;
  const int8_t* natural;  // the codes in their natural order (4-bit weights: q is reordered)
  const float* d;
  const float* xsum;
  const int32_t* isum;  // [subs] per row: sum(q) of each sub-block
  const float* pairs;  // 4-bit weights: [d_s x 4 | d_s+1 x 4] per pair of sub-blocks
  int64_t width, subs, blocks;  // per row: codes, sub-block scales, block sums
};

struct Weight {  // one weight's rows, and where its products go
  const uint8_t* codes;
  const c10::Half* scales;
  const uint8_t* zeros;
  int64_t n;
  void* out;  // [M, n] in x's dtype
  bool grouped;  // in groups of kGroup rows (group_rows)
};

// out_j = x . w_j^T for every weight j (all with the activations' layout): one parallel step,
// tasks of up to kRowsPerTask rows x kColsPerTask rows of one weight (a grouped weight: whole
// groups, kGroupTaskBytes of codes at one task of rows). quant_gemm.cpp defines it for the forms
// quant_linear_many runs: either policy, 4- or 8-bit codes, out in float32, bfloat16 or float16.
template <class PF, int BITS, typename TO>
PH_LOCAL void product(const Rows& x, int64_t m, const std::vector<Weight>& ws, int64_t block);

}  // namespace pagedhybrid
