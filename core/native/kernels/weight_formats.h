// The float kernels' view of a held weight: each format yields a row's values dequantized to float32.
#pragma once

#include "common.h"

// s * c + z for the 4-bit code c in the low four bits of each lane. AVX-512 computes the 16 possible
// values once per group (the same fused multiply-add per value as computing each lane) and looks
// them up (vpermps reads only the low four bits of each index): one instruction per 16 weights in
// place of a mask, a conversion and a multiply-add.
struct NibbleDequant {
#if defined(__AVX512F__)
  __m512 table;
  inline NibbleDequant(float s, float z) {
    const v16f codes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16f t = codes * s + z;
    std::memcpy(&table, &t, sizeof table);
  }
  inline v16f operator()(v16i w) const {
    __m512i idx;
    std::memcpy(&idx, &w, sizeof idx);
    __m512 f = _mm512_permutexvar_ps(idx, table);
    v16f out;
    std::memcpy(&out, &f, sizeof out);
    return out;
  }
#else
  float s, z;
  inline NibbleDequant(float s_, float z_) : s(s_), z(z_) {}
  inline v16f operator()(v16i w) const { return __builtin_convertvector(w & 15, v16f) * s + z; }
#endif
};

// s * c + z for the 5-bit code c: its low four bits in the low four bits of each lane, bit 4 in the
// lane's bit of `top`. As for 4 bits, the 32 possible values are computed once per group; a lane looks
// up the low half of the table, and those whose bit 4 is set the high half: two permutes per 16 weights
// in place of isolating bit 4 with a variable shift, a mask, an or, a conversion and a multiply-add.
#if defined(__AVX512F__)
struct FiveBitDequant {
  NibbleDequant low;  // codes 0-15
  __m512 high;        // codes 16-31
  inline FiveBitDequant(float s, float z) : low(s, z) {
    const v16f upper = {16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
    v16f u = upper * s + z;
    std::memcpy(&high, &u, sizeof high);
  }
  inline v16f operator()(v16i w, uint32_t top) const {
    __m512i idx;
    std::memcpy(&idx, &w, sizeof idx);
    __m512 f = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(idx, low.table), static_cast<__mmask16>(top), idx,
                                          high);
    v16f out;
    std::memcpy(&out, &f, sizeof out);
    return out;
  }
};
#endif

// ------------------------------------------------------------------------------------ weight formats
//
// Each format yields a weight row's values 32 at a time, as two vectors (positions 0-15 and 16-31 of
// the group), dequantized exactly as w = scale * code + zero, given the row's scales s and zeros z as
// float32 (SCALES per group of 32).

struct Q4 {  // 4-bit codes, two per byte: byte j of a group holds code j (low nibble) and j + 16 (high)
  static constexpr int SCALES = 1;
  const uint8_t* codes;
  const float* scales;
  const float* zeros;
  int64_t groups;  // per row: K / 32
  inline const void* row_codes(int64_t n, int64_t& bytes) const { bytes = groups * 16; return codes + n * bytes; }
  inline void group(int64_t n, int64_t g, const float* s, const float* z, v16f& a, v16f& b) const {
    v16i w = widen_u8(codes + (n * groups + g) * 16);
    NibbleDequant dequant(s[g], z[g]);
    a = dequant(w);
    b = dequant(w >> 4);
  }
};

struct Q5 {  // 5-bit codes: per group 20 bytes, the low 4 bits packed as in Q4, then bit 4 of code j at bit j
  static constexpr int SCALES = 1;
  const uint8_t* codes;
  const float* scales;
  const float* zeros;
  int64_t groups;
  inline const void* row_codes(int64_t n, int64_t& bytes) const { bytes = groups * 20; return codes + n * bytes; }
  inline void group(int64_t n, int64_t g, const float* s, const float* z, v16f& a, v16f& b) const {
    const uint8_t* p = codes + (n * groups + g) * 20;
    v16i w = widen_u8(p);
    uint32_t high;
    std::memcpy(&high, p + 16, 4);
#if defined(__AVX512F__)
    FiveBitDequant dequant(s[g], z[g]);
    a = dequant(w, high & 0xffffu);
    b = dequant(w >> 4, high >> 16);
#else
    const v16i lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16i top_a = ((v16i{} + static_cast<int32_t>((high & 0xffffu) << 4)) >> lanes) & 16;
    v16i top_b = ((v16i{} + static_cast<int32_t>((high >> 16) << 4)) >> lanes) & 16;
    a = __builtin_convertvector((w & 15) | top_a, v16f) * s[g] + z[g];
    b = __builtin_convertvector((w >> 4) | top_b, v16f) * s[g] + z[g];
#endif
  }
};

template <int G, bool ZERO>  // int8 codes, one scale (and zero) per G = 16 or 32 weights
struct Q8 {
  static constexpr int SCALES = 32 / G;
  const int8_t* codes;
  const float* scales;
  const float* zeros;
  int64_t k;
  inline const void* row_codes(int64_t n, int64_t& bytes) const { bytes = k; return codes + n * k; }
  inline void group(int64_t n, int64_t g, const float* s, const float* z, v16f& a, v16f& b) const {
    const int8_t* p = codes + n * k + g * 32;
    a = widen_i8(p);
    b = widen_i8(p + 16);
    if constexpr (G == 32) {
      if constexpr (ZERO) { a = a * s[g] + z[g]; b = b * s[g] + z[g]; }
      else { a = a * s[g]; b = b * s[g]; }
    } else {
      if constexpr (ZERO) { a = a * s[2 * g] + z[2 * g]; b = b * s[2 * g + 1] + z[2 * g + 1]; }
      else { a = a * s[2 * g]; b = b * s[2 * g + 1]; }
    }
  }
};

struct F32 {
  static constexpr int SCALES = 1;
  const float* w;
  const float* scales = nullptr;
  const float* zeros = nullptr;
  int64_t k;
  inline const void* row_codes(int64_t n, int64_t& bytes) const { bytes = k * 4; return w + n * k; }
  inline void group(int64_t n, int64_t g, const float*, const float*, v16f& a, v16f& b) const {
    a = load16(w + n * k + g * 32);
    b = load16(w + n * k + g * 32 + 16);
  }
};

// The row's scales and zeros, then its groups: what every kernel loops over. Scales and zeros are held
// as float32 even where float16 would hold them exactly (the file's own d and m): converting a row's
// worth before its groups cost 10-15% of a one-row matmul at K = 576 and 640 (measured, both models).
template <class W>
struct RowReader {
  const W& w;
  int64_t groups;
  const float *s = nullptr, *z = nullptr;
  inline void start(int64_t n) {
    s = w.scales ? w.scales + n * groups * W::SCALES : nullptr;
    z = w.zeros ? w.zeros + n * groups * W::SCALES : nullptr;
  }
  inline void group(int64_t n, int64_t g, v16f& a, v16f& b) const { w.group(n, g, s, z, a, b); }
  // Ask for row n's codes ahead of use: the rows stream from DRAM once per token.
  inline void prefetch(int64_t n) const {
    int64_t bytes;
    const char* p = static_cast<const char*>(w.row_codes(n, bytes));
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
  }
};

// Calls f with the weight format named by kind (see WeightKind), group and zeros; codes point at the
// row form's codes (uint8 for 4- and 5-bit, int8, or float32 weights).
template <class F>
static void with_format(int64_t kind, const void* codes, const float* s, const float* z, int64_t group, int64_t k,
                        F&& f) {
  if (kind == KIND_Q4) {
    f(Q4{static_cast<const uint8_t*>(codes), s, z, k / 32});
  } else if (kind == KIND_Q8) {
    const int8_t* c = static_cast<const int8_t*>(codes);
    if (group == 32 && z) f(Q8<32, true>{c, s, z, k});
    else if (group == 32) f(Q8<32, false>{c, s, z, k});
    else if (group == 16 && z) f(Q8<16, true>{c, s, z, k});
    else if (group == 16) f(Q8<16, false>{c, s, z, k});
    else TORCH_CHECK(false, "int8 weights need a group of 16 or 32");
  } else if (kind == KIND_Q5) {
    f(Q5{static_cast<const uint8_t*>(codes), s, z, k / 32});
  } else {
    TORCH_CHECK(kind == KIND_F32, "unknown weight kind ", kind);
    f(F32{static_cast<const float*>(codes), nullptr, nullptr, k});
  }
}
