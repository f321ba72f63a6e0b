// Products of int8 / int4 projection weights: out [M, N] = x [M, K] . dequant(w)^T.
//
// Weights (checked here) are weightquant.py's QuantizedWeight, com.microsoft.MatMulNBits' layout:
// codes uint8 [N, nb, block * bits / 8] (K zero-padded to nb * block; 4-bit codes two to a byte,
// element 2j in the low nibble), scales float16 [N, nb], zeros uint8 [N, nb] or none (symmetric:
// 2^(bits-1)); value = (code - zero) * scale. They are read in place: no dequantised copy.
//
// Activations are quantised per row on the fly into int8 codes with one float scale per
// kAct = 32 elements (llama.cpp's q8 path): d = max|x| / 127, q = round(x * (1 / d)) (ties to
// even, 0 where d = 0) -- weightquant.quantize_rows, bit for bit. A 4-bit weight's 32 elements of
// a sub-block arrive as [low nibbles | high nibbles] = [even | odd] elements, so each activation
// sub-block is stored in that order too (once per row, not once per weight row). Per sub-block
// the integer dot product is exact: 4-bit codes (unsigned, 0..15) times the activation codes by
// vpmaddubsw (pairs <= 2 * 15 * 127, no int16 saturation); 8-bit codes as signed c - 128 with the
// sign moved onto the activation (|c - 128| <= 128, pairs <= 2 * 128 * 127 < 32767); then pairs
// summed into int32 lanes (vpmaddwd) -- or, where the CPU has AVX512-VNNI (vpdpbusd), in one
// instruction with the same integer result. Each sub-block's int32 lanes are scaled by
// d * scale in fp32 and accumulated in two sets of 8 fp32 lanes (alternate sub-blocks: two
// independent FMA chains); the zero points enter as one more pass over the row's blocks,
// sum_b zero_b * scale_b * sum_sub(d * sum(q)) (the activation sums are taken while quantising).
// Out is the fixed horizontal sum minus that correction, rounded once to x's dtype.
//
// Every output element is computed the same way whatever M is and wherever its row sits (rows are
// register-blocked up to 4 to share the weight loads, nothing else), so the one kernel is also
// the batch-invariant form. Work: tasks of up to kRowsPerTask rows x kColsPerTask weight rows
// (the weight rows stay in L1 while the rows stream past them).
//
// Here: the weights' checks, the activations' quantisation and the ops; the kernels (the dot
// products and their tasks) are quant_gemm.cpp's, quant.h what the two share.
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "quant.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

// the CPU's vendor picks the codes' prefetch policy (quant.h: NtaAhead, T0Ahead)
bool amd_cpu() {
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline int32_t hsum(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}

// One row of x: k elements (zero-padded to width, a multiple of the weight block) into codes q
// [width] and scales d [width / kAct]; isum [width / kAct] = sum(q) per sub-block, xsum
// [width / block] = per weight block sum over its sub-blocks of d * sum(q). With `odd_even` (4-bit weights) each pair of
// sub-blocks (s, s + 1) is stored as [evens of s | evens of s + 1 | odds of s | odds of s + 1]
// -- the order in which 32 bytes of 4-bit codes unpack into low and high nibbles -- with
// pairs[8 i ..] = [d_s x 4 | d_s+1 x 4]; a last unpaired sub-block as [evens | odds].
template <typename TX>
void quantize_row(const TX* x, int64_t k, int64_t width, int64_t block, bool odd_even,
                  float* pairs, int8_t* q, float* d, float* xsum, int32_t* isum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // per 128-bit lane: bytes 0, 2, ..., 14 then 1, 3, ..., 15
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  float buf[kAct];
  const int64_t subs_per_block = block / kAct;
  float block_sum = 0.0f;
  for (int64_t s = 0; s * kAct < width; ++s) {
    const int64_t e0 = s * kAct;
    __m256 v[4];
    if (e0 + kAct <= k) {
      for (int i = 0; i < 4; ++i) v[i] = load8(x + e0 + 8 * i);
    } else {
      for (int i = 0; i < kAct; ++i) buf[i] = e0 + i < k ? to_float(x[e0 + i]) : 0.0f;
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(buf + 8 * i);
    }
    __m256 amax = _mm256_andnot_ps(sign, v[0]);
    for (int i = 1; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float dv = _mm_cvtss_f32(m4) / 127.0f;
    const float inv = dv != 0.0f ? 1.0f / dv : 0.0f;
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], iv));  // nearest-even
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]),
                                           _mm256_add_epi32(i[2], i[3]));
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                        _mm256_packs_epi32(i[2], i[3]));
    packed = _mm256_permutevar8x32_epi32(packed, order);  // elements back in order
    if (odd_even) {
      packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(packed, split),
                                        _MM_SHUFFLE(3, 1, 2, 0));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + e0), packed);
    d[s] = dv;
    isum[s] = hsum(total);
    block_sum += dv * static_cast<float>(isum[s]);
    if ((s + 1) % subs_per_block == 0) {
      xsum[s / subs_per_block] = block_sum;
      block_sum = 0.0f;
    }
  }
  if (!odd_even) return;
  for (int64_t i = 0; 2 * i + 1 < width / kAct; ++i) {
    __m256i* p = reinterpret_cast<__m256i*>(q + 2 * i * kAct);
    const __m256i s0 = _mm256_loadu_si256(p), s1 = _mm256_loadu_si256(p + 1);
    _mm256_storeu_si256(p, _mm256_permute2x128_si256(s0, s1, 0x20));
    _mm256_storeu_si256(p + 1, _mm256_permute2x128_si256(s0, s1, 0x31));
    _mm256_storeu_ps(pairs + 8 * i, _mm256_set_m128(_mm_set1_ps(d[2 * i + 1]),
                                                    _mm_set1_ps(d[2 * i])));
  }
#if defined(__AVX512BW__)
  if (block != kAct) return;
  // block 32 on AVX-512 (dot_quads): each quad of sub-blocks (two pairs) as
  // [evens s .. s + 3 | odds s .. s + 3], what 64 bytes of codes unpack into
  for (int64_t g = 0; 4 * g + 3 < width / kAct; ++g) {
    int8_t* p = q + 4 * g * kAct;
    const __m512i a0 = _mm512_loadu_si512(p), a1 = _mm512_loadu_si512(p + 64);
    _mm512_storeu_si512(p, _mm512_shuffle_i64x2(a0, a1, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm512_storeu_si512(p + 64, _mm512_shuffle_i64x2(a0, a1, _MM_SHUFFLE(3, 2, 3, 2)));
  }
#endif
}


// A weight's codes: the row layout [N, nb, block * bits / 8], or in groups of kGroup rows
// [N / 16, nb, L, 64] (group_rows).
struct CodeLayout {
  int64_t n, nb, block;
  bool grouped;
};
CodeLayout code_layout(const at::Tensor& codes, int64_t bits) {
  if (codes.dim() == 4)
    return {codes.size(0) * kGroup, codes.size(1), codes.size(2) * 32 / bits, true};
  return {codes.size(0), codes.size(1), codes.size(2) * 8 / bits, false};
}

// scales (and zeros) of codes of `lay`: grouped [N / 16, nb, 16], each group's rows last; else
// [N, nb]
void check_scales(const char* op, const std::string& name, const CodeLayout& lay,
                  const at::Tensor& scales, const c10::optional<at::Tensor>& zeros) {
  const auto check_rows = [&](const std::string& arg, const at::Tensor& t, at::ScalarType dt) {
    check_tensor(op, arg.c_str(), t, lay.grouped ? 3 : 2, dt);
    check_size(op, arg.c_str(), t, 0, lay.grouped ? lay.n / kGroup : lay.n,
               lay.grouped ? "the groups of codes" : "the rows N of codes");
    check_size(op, arg.c_str(), t, 1, lay.nb, "the blocks of codes");
    if (lay.grouped) check_size(op, arg.c_str(), t, 2, kGroup, "the rows of a group");
  };
  check_rows(name + "scales", scales, at::kHalf);
  if (zeros.has_value() && zeros->defined()) check_rows(name + "zeros", *zeros, at::kByte);
}

}  // namespace

int64_t quant_weight_rows(const at::Tensor& codes) {
  return codes.dim() == 4 ? codes.size(0) * kGroup : codes.size(0);
}

void check_quant_weight(const char* op, const std::string& name, const at::Tensor& codes,
                        const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                        int64_t bits, int64_t k) {
  const std::string c = name + "codes";
  PH_CHECK(bits == 4 || bits == 8, op, name + "bits", "must be 4 or 8 (got ", bits, ")");
  PH_CHECK(codes.defined(), op, c, "must be a tensor");
  const bool grouped = codes.dim() == 4;  // in groups of kGroup rows
  check_tensor(op, c.c_str(), codes, grouped ? 4 : 3, at::kByte);
  const CodeLayout lay = code_layout(codes, bits);
  const int64_t nb = lay.nb, block = lay.block;
  if (grouped) {
    PH_CHECK(codes.size(3) == 4 * kGroup && codes.size(2) * 32 % bits == 0 && block >= kAct &&
                 block % kAct == 0, op, c, "grouped codes must be [N / ", kGroup,
             ", blocks, block * bits / 32, ", 4 * kGroup, "] with the block a multiple of ", kAct,
             " (got shape ", shape_of(codes), ", bits ", bits, ")");
  } else {
    PH_CHECK(block >= kAct && block % kAct == 0 && codes.size(2) * 8 % bits == 0, op, c,
             "size(2) * 8 / bits (the block) must be a multiple of ", kAct, " (got shape ",
             shape_of(codes), ", bits ", bits, ")");
  }
  PH_CHECK(nb >= 1 && k <= nb * block && k > (nb - 1) * block, op, c, "must hold K = ", k,
           " columns in size(1) blocks of ", block, " (got shape ", shape_of(codes), ")");
  check_scales(op, name, lay, scales, zeros);
}

void quant_linear_many(const at::Tensor& x, int64_t bits, const std::vector<QuantWeightRef>& ws,
                       const std::vector<at::Tensor>& outs) {
  const char* op = "quant_linear";
  PH_CHECK(x.defined() && x.dim() == 2, op, "x", "must be [M, K] (got shape ",
           x.defined() ? shape_of(x) : std::string("none"), ")");
  const auto xt = x.scalar_type();
  PH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, op, "x",
           "must be float32, bfloat16 or float16 (got ", xt, ")");
  check_tensor(op, "x", x, 2, xt);
  PH_CHECK(!ws.empty() && ws.size() == outs.size(), op, "out", "one per weight");
  for (size_t j = 0; j < ws.size(); ++j) {
    check_quant_weight(op, "", ws[j].codes, ws[j].scales, ws[j].zeros, bits, x.size(1));
    const CodeLayout lj = code_layout(ws[j].codes, bits), l0 = code_layout(ws[0].codes, bits);
    PH_CHECK(lj.nb == l0.nb && lj.block == l0.block, op, "codes",
             "the weights of one call must share their blocks (got ", shape_of(ws[j].codes),
             " and ", shape_of(ws[0].codes), ")");
    check_tensor(op, "out", outs[j], 2, xt);
    check_size(op, "out", outs[j], 0, x.size(0), "the rows M of x");
    check_size(op, "out", outs[j], 1, quant_weight_rows(ws[j].codes), "the rows N of codes");
  }
  const CodeLayout lay = code_layout(ws[0].codes, bits);
  const int64_t m = x.size(0), k = x.size(1), nb = lay.nb, block = lay.block, width = nb * block;
  if (m == 0) return;
  bool grouped = false, rowwise = false;
  for (const auto& w : ws) (w.codes.dim() == 4 ? grouped : rowwise) = true;
  // 4-bit weights in rows take the codes reordered (quantize_row), grouped ones in order
  const bool both = bits == 4 && grouped && rowwise;
  std::vector<int8_t> q(m * width), natural(both ? m * width : 0);
  std::vector<float> d(m * (width / kAct)), xsum(m * nb);
  std::vector<int32_t> isum(m * (width / kAct));
  std::vector<float> pairs(bits == 4 ? m * (width / kAct / 2) * 8 : 0);
  std::vector<Weight> weights;
  for (size_t j = 0; j < ws.size(); ++j) {
    const auto& z = ws[j].zeros;
    weights.push_back({ws[j].codes.data_ptr<uint8_t>(), ws[j].scales.data_ptr<c10::Half>(),
                       z.has_value() && z->defined() ? z->data_ptr<uint8_t>() : nullptr,
                       quant_weight_rows(ws[j].codes), outs[j].data_ptr(),
                       ws[j].codes.dim() == 4});
  }
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    parallel_items(m, 8, m * width * 8, [&](int64_t r) {  // (4-bit in rows: reordered)
      quantize_row(xp + r * k, k, width, block, bits == 4 && rowwise,
                   pairs.data() + r * (width / kAct / 2) * 8, q.data() + r * width,
                   d.data() + r * (width / kAct), xsum.data() + r * nb,
                   isum.data() + r * (width / kAct));
    });
    if (both) {  // the grouped weights' codes in order
      parallel_items(m, 8, m * width * 8, [&](int64_t r) {
        quantize_row(xp + r * k, k, width, block, false, nullptr, natural.data() + r * width,
                     d.data() + r * (width / kAct), xsum.data() + r * nb,
                     isum.data() + r * (width / kAct));
      });
    }
    const Rows rows{q.data(), both ? natural.data() : q.data(), d.data(), xsum.data(),
                    isum.data(), pairs.data(), width, width / kAct, nb};
    const auto with = [&](auto policy) {
      using PF = decltype(policy);
      if (bits == 4) {
        product<PF, 4, scalar_t>(rows, m, weights, block);
      } else {
        product<PF, 8, scalar_t>(rows, m, weights, block);
      }
    };
    if (amd_cpu()) {
      with(NtaAhead{});
    } else {
      with(T0Ahead{});
    }
  };
  if (xt == at::kFloat) {
    run(float{});
  } else if (xt == at::kBFloat16) {
    run(c10::BFloat16{});
  } else {
    run(c10::Half{});
  }
}

void quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& zeros, int64_t bits, at::Tensor out) {
  quant_linear_many(x, bits, {QuantWeightRef{codes, scales, zeros}}, {out});
}

namespace {

// Rows [row0, row0 + R) of the weight as float32 (code - zero) * scale into out [R, K]: the
// prefill form multiplies a cache-sized chunk of them with the fp32 GEMM (kernels/native/quant.py).
void quant_dequantize(const at::Tensor& codes, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& zeros, int64_t bits, int64_t row0,
                      at::Tensor out) {
  const char* op = "quant_dequantize";
  PH_CHECK(bits == 4 || bits == 8, op, "bits", "must be 4 or 8 (got ", bits, ")");
  check_tensor(op, "out", out, 2, at::kFloat);
  const bool grouped = codes.defined() && codes.dim() == 4;
  if (grouped) check_quant_weight(op, "", codes, scales, zeros, bits, out.size(1));
  check_tensor(op, "codes", codes, grouped ? 4 : 3, at::kByte);
  const CodeLayout lay = code_layout(codes, bits);
  const int64_t n = lay.n, nb = lay.nb, block = lay.block;
  const int64_t rows = out.size(0), k = out.size(1);
  PH_CHECK(row0 >= 0 && row0 + rows <= n, op, "row0", "rows [row0, row0 + out.size(0)) must lie "
           "in [0, ", n, ") (got row0 ", row0, ", ", rows, " rows)");
  PH_CHECK(block >= kAct && block % kAct == 0 && k <= nb * block && k > (nb - 1) * block, op,
           "out", "size(1) must be the K the codes hold (got shape ", shape_of(out),
           ", codes ", shape_of(codes), ")");
  if (!grouped) check_scales(op, "", lay, scales, zeros);  // (grouped: with the codes above)
  const uint8_t* zp = zeros.has_value() && zeros->defined() ? zeros->data_ptr<uint8_t>() : nullptr;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  float* op_ = out.data_ptr<float>();
  const int64_t row_bytes = nb * block * bits / 8, block_bytes = block * bits / 8;
  const __m128i low = _mm_set1_epi8(0x0F);
  parallel_items(rows, 4, rows * k * 4, [&](int64_t r) {
    const int64_t c = row0 + r, g = c / kGroup, i = c % kGroup;
    float* o = op_ + r * k;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = grouped ? (g * nb + b) * kGroup + i : c * nb + b;  // scale, zero
      const __m256 s = _mm256_set1_ps(_cvtsh_ss(sp[at].x));
      const __m256 z = _mm256_set1_ps(zp ? zp[at] : (1 << (bits - 1)));
      // the block's codes: its rows in a row, or its lines of 16 rows' four bytes (row i at 4i)
      const uint8_t* src = grouped ? cp + g * kGroup * row_bytes + b * kGroup * block_bytes + 4 * i
                                   : cp + c * row_bytes + b * block_bytes;
      for (int64_t e = 0; e < block && b * block + e < k; e += 8) {
        __m128i eight;  // elements e .. e + 7 as bytes
        if (grouped && bits == 8) {  // two lines of four
          uint32_t lo, hi;
          std::memcpy(&lo, src + (e / 4) * 64, 4);
          std::memcpy(&hi, src + (e / 4 + 1) * 64, 4);
          eight = _mm_unpacklo_epi32(_mm_cvtsi32_si128(static_cast<int>(lo)),
                                     _mm_cvtsi32_si128(static_cast<int>(hi)));
        } else if (grouped) {  // one line: e + t low, e + 4 + t high
          uint32_t four;
          std::memcpy(&four, src + (e / 8) * 64, 4);
          const __m128i b4 = _mm_cvtsi32_si128(static_cast<int>(four));
          eight = _mm_unpacklo_epi32(_mm_and_si128(b4, low),
                                     _mm_and_si128(_mm_srli_epi16(b4, 4), low));
        } else if (bits == 4) {  // 4 bytes: low nibble first
          uint32_t four;
          std::memcpy(&four, src + e / 2, 4);
          const __m128i b4 = _mm_cvtsi32_si128(static_cast<int>(four));
          eight = _mm_unpacklo_epi8(_mm_and_si128(b4, low),
                                    _mm_and_si128(_mm_srli_epi16(b4, 4), low));
        } else {
          eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + e));
        }
        const __m256 w = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(
                                           _mm256_cvtepu8_epi32(eight)), z), s);
        const int64_t left = k - (b * block + e);
        if (left >= 8) {
          _mm256_storeu_ps(o + b * block + e, w);
        } else {
          float tail[8];
          _mm256_storeu_ps(tail, w);
          std::memcpy(o + b * block + e, tail, left * sizeof(float));
        }
      }
    }
  });
}

// The prefetch of the codes this CPU gets, as the engine's kernel line names it.
std::string code_prefetch() {
  return amd_cpu() ? std::string(NtaAhead::kName) + " (AMD)" : std::string(T0Ahead::kName);
}

}  // namespace
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.def("code_prefetch() -> str", &pagedhybrid::code_prefetch);
  m.def("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, int bits, "
        "Tensor(a!) out) -> ()");
  m.def("quant_dequantize(Tensor codes, Tensor scales, Tensor? zeros, int bits, int row0, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) {
  m.impl("quant_linear", &pagedhybrid::quant_linear);
  m.impl("quant_dequantize", &pagedhybrid::quant_dequantize);
}
