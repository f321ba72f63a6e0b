// Which CPU form this library is (common.h): `cpu_form() -> str`, the name the build gave it
// ("avx512_bf16", "avx512" or "avx2"), and what its kernels do with bf16 (`bf16_dot`: true when
// bf16 pairs are multiplied by vdpbf16ps, false when bf16 is widened to fp32 in registers).
#include <torch/library.h>

#include <string>

#include "common.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

std::string cpu_form() { return PH_FORM; }

bool bf16_dot() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

int64_t vector_lanes() { return kLanes; }

}  // namespace
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.def("cpu_form() -> str", &pagedhybrid::cpu_form);
  m.def("bf16_dot() -> bool", &pagedhybrid::bf16_dot);
  m.def("vector_lanes() -> int", &pagedhybrid::vector_lanes);
}
