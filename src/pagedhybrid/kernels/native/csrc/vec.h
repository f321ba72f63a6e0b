// Portable 16-lane float vectors (GCC vector extensions) for the native CPU kernels.
//
// One source for both instruction sets: built with -mavx512f -mavx512bw ... a `V16` is one zmm
// register; built with -mavx2 -mfma -mf16c it is a pair of ymm registers (the compiler splits
// every operation). Loads convert the cache element types to fp32: bf16 is the high half of an
// fp32 (shift left 16), fp16 goes through the hardware converter (F16C / AVX-512), fp32 loads
// as is. `exp16` is a Cody-Waite range reduction with a degree-6 polynomial (max rel. error
// ~2e-7 on [-87, 88]; -inf -> 0). `transpose16` is the 4-stage butterfly of a 16x16 tile.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace pagedhybrid {

typedef float V16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef uint32_t U16 __attribute__((vector_size(64)));
typedef uint16_t H16 __attribute__((vector_size(32)));
typedef _Float16 F16x16 __attribute__((vector_size(32)));

constexpr int kLanes = 16;

inline V16 splat(float x) { return V16{} + x; }

inline V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline V16 load16(const c10::BFloat16* p) {
  H16 h;
  std::memcpy(&h, p, sizeof(h));
  U16 w = __builtin_convertvector(h, U16) << 16;
  V16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
inline V16 load16(const c10::Half* p) {
  F16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, V16);
}
inline void store16(float* p, V16 v) { std::memcpy(p, &v, sizeof(v)); }

// element-wise scalar conversions (tails, scalar paths)
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
template <typename T> inline T from_float(float x) { return static_cast<T>(x); }

inline float hsum(V16 v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
inline float hmax(V16 v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// exp(x) for 16 lanes; x = -inf (masked keys) gives exactly 0.
inline V16 exp16(V16 x) {
  const V16 lo = splat(-87.3f), hi = splat(88.3f);
  V16 xc = x < lo ? lo : (x > hi ? hi : x);  // GCC vector ?: selects per lane
  const float log2e = 1.44269504088896341f;
  const V16 magic = splat(12582912.0f);  // 1.5 * 2^23: round to nearest integer
  V16 t = xc * log2e + magic;
  V16 n = t - magic;
  V16 r = xc - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 split in hi/lo
  V16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  I16 ni = __builtin_convertvector(n, I16);
  I16 bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += ni << 23;
  V16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return x < lo ? V16{} : out;
}

// In-place transpose of 16 vectors (rows) into 16 vectors (columns).
inline void transpose16(V16 (&m)[16]) {
  // stage s swaps blocks of size 2^s between row pairs (i, i ^ 2^s)
#define PH_T_STAGE(S, LO, HI)                                                   \
  for (int i = 0; i < 16; ++i) {                                                \
    if (i & (S)) continue;                                                      \
    V16 a = m[i], b = m[i | (S)];                                               \
    m[i] = __builtin_shuffle(a, b, LO);                                         \
    m[i | (S)] = __builtin_shuffle(a, b, HI);                                   \
  }
  const I16 lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const I16 hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  const I16 lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const I16 hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const I16 lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const I16 hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const I16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const I16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  PH_T_STAGE(1, lo1, hi1)
  PH_T_STAGE(2, lo2, hi2)
  PH_T_STAGE(4, lo4, hi4)
  PH_T_STAGE(8, lo8, hi8)
#undef PH_T_STAGE
}

}  // namespace pagedhybrid
