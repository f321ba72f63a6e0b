// Which CPU form this library is (common.h): `cpu_form() -> str`, the name the build gave it
// ("avx512_bf16", "avx512_vnni", "avx512" or "avx2"), what its kernels do with bf16 (`bf16_dot`:
// true when bf16 pairs are multiplied by vdpbf16ps, false when bf16 is widened to fp32 in
// registers) and with int8 (`int8_dot`: "vpdpbusd" with AVX512-VNNI, else "vpmaddubsw").
// `set_num_threads(n)` / `num_threads()`: the threads of this library's pool (common.h;
// n <= 0: torch.get_num_threads() at each call).
#include <torch/library.h>

#include <algorithm>
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

std::string int8_dot() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "vpdpbusd";
#else
  return "vpmaddubsw";
#endif
}

int64_t vector_lanes() { return kLanes; }

void set_num_threads(int64_t n) {
  pool_threads().store(static_cast<int>(std::clamp<int64_t>(n, 0, 1024)));
}

int64_t num_threads() {
  const int set = pool_threads().load();
  return set > 0 ? set : at::get_num_threads();
}

}  // namespace
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.def("cpu_form() -> str", &pagedhybrid::cpu_form);
  m.def("bf16_dot() -> bool", &pagedhybrid::bf16_dot);
  m.def("int8_dot() -> str", &pagedhybrid::int8_dot);
  m.def("vector_lanes() -> int", &pagedhybrid::vector_lanes);
  m.def("set_num_threads(int n) -> ()", &pagedhybrid::set_num_threads);
  m.def("num_threads() -> int", &pagedhybrid::num_threads);
}
