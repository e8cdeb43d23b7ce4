// int8 activations: each row of x quantized on its own, then the four-group or the lane tiles of this
// build's instruction set.

#include "int8.h"

#if defined(INT8_KERNELS)
static inline int32_t hsum8_epi32(__m256i v) {
  __m128i h4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  __m128i h2 = _mm_add_epi32(h4, _mm_unpackhi_epi64(h4, h4));
  return _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 1)));
}

void quantize_rows(const float* x, int64_t rows, int64_t k, QuantizedRows& out) {
  const int64_t groups = k / 32;
  out.rows = rows, out.k = k, out.groups = groups;
  out.q.resize(rows * k), out.d.resize(rows * groups), out.sum32.resize(rows * groups), out.sum16.resize(rows * groups * 2);
  out.code_sums16.resize(rows * groups * 2);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < rows * groups; ++b) {
    const float* xb = x + b * 32;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const bool nan = _mm256_movemask_ps(unordered) != 0;  // max drops NaNs: a NaN in x must reach y
    const float m = _mm_cvtss_f32(m4);
    const float d = nan ? NAN : m / 127.0f;
    const __m256 inv = _mm256_set1_ps(nan || m <= 0.0f ? 0.0f : std::min(127.0f / m, FLT_MAX));
    __m256i i32[4];
    for (int i = 0; i < 4; ++i)
      i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute puts them back
    __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
    __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + b * 32), i8);
    // sums of the codes per 16 (lanes 0-3 of madd(maddubs(1, q)) hold the first 16, 4-7 the second)
    __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), i8), ones16);
    const int32_t lo = hsum8_epi32(_mm256_blend_epi32(pairs, _mm256_setzero_si256(), 0xF0));
    const int32_t hi = hsum8_epi32(_mm256_blend_epi32(pairs, _mm256_setzero_si256(), 0x0F));
    out.d[b] = d;
    out.sum32[b] = d * static_cast<float>(lo + hi);
    out.sum16[2 * b] = d * static_cast<float>(lo);
    out.sum16[2 * b + 1] = d * static_cast<float>(hi);
    out.code_sums16[2 * b] = lo, out.code_sums16[2 * b + 1] = hi;
  }
}


bool int8_matmul(int64_t kind, int64_t group, const void* codes, const float* scales, const float* zeros,
                 const float* x, int64_t rows, int64_t k, float* y, int64_t n_out) {
  if (kind == KIND_F32) return false;
  QuantizedRows xq;
  quantize_rows(x, rows, k, xq);
  run_four_group_matmul(kind, group, codes, scales, zeros, xq, y, n_out);
  return true;
}

void lane_matmul(int64_t kind, int64_t group, const LaneWeights& w, const float* x, int64_t rows, int64_t k, float* y,
                 int64_t n_out) {
  QuantizedRows xq;
  quantize_rows(x, rows, k, xq);
  TORCH_CHECK(kind == KIND_Q4 || kind == KIND_Q5 ||
              ((kind == KIND_Q8 || (SIX_BIT_LANES && kind == KIND_Q6_LANES)) && (group == 32 || group == 16)),
              "linear: no lane tile for kind ", kind);
  const int scales = (kind == KIND_Q8 || kind == KIND_Q6_LANES) && group == 16 ? 2 : 1;
  const int amx_from = amx_from_rows();
  kernel_parallel_for(0, n_out / 16, 1, [&](int64_t b0, int64_t b1) {
    over_row_tiles<LANE_MAX_TILE>(xq.rows, [&](auto row_count, int64_t r) {
      constexpr int R = decltype(row_count)::value;
      if (amx_from && R >= amx_from) run_amx_lane_tile(kind, scales, R, w, xq, r, y + r * n_out, n_out, b0, b1);
      else run_lane_tile(kind, scales, R, w, xq, r, y + r * n_out, n_out, b0, b1);
    });
  });
}
#else
bool int8_matmul(int64_t, int64_t, const void*, const float*, const float*, const float*, int64_t, int64_t, float*,
                 int64_t) {
  return false;
}

void lane_matmul(int64_t, int64_t, const LaneWeights&, const float*, int64_t, int64_t, float*, int64_t) {
  TORCH_CHECK(false, "linear: this build has no lane tiles");
}
#endif
