// The int8 tiles with AVX512-VNNI (zmm dpbusd): Intel since Ice Lake, AMD since Zen 4. Empty in other
// builds (int8_avx2.cpp).

#include "int8.h"

#if defined(INT8_VNNI512)
// AVX512-VNNI: `dpbusd` in place of maddubs + madd, four groups (128 weights) per step. A step's two
// registers hold the first 16 codes of each of the four groups (lo) and the last 16 (hi), so both meet
// x in the same lanes: four lanes per group, and one conversion, scale and multiply-add per row and four
// groups, where a register per group pair took two (the per-row float work is what a verify pass over
// many rows pays for). x's codes are laid out the same way once per matmul (prepare_vnni_rows). Groups
// left over take two-group and one-group steps; the same steps in the same order for every tile size.

struct CodeQuad {
  __m512i lo, hi;
};

static inline CodeQuad quad_codes(const IntQ4& w, int64_t n, int64_t g) {
  const __m512i raw = _mm512_loadu_si512(w.at(n, g));  // byte j of a group: code j low, code j + 16 high
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  return {_mm512_and_si512(raw, nibble), _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble)};
}

static inline CodeQuad quad_codes(const IntQ5& w, int64_t n, int64_t g) {
  const uint8_t* p = w.at(n, g);
  __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  raw = _mm512_inserti32x4(raw, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 20)), 1);
  raw = _mm512_inserti32x4(raw, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 40)), 2);
  raw = _mm512_inserti32x4(raw, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 60)), 3);
  uint64_t lo_top = 0, hi_top = 0;  // bit j of a group's word: code j's bit 4
  for (int i = 0; i < 4; ++i) {
    uint32_t word;
    std::memcpy(&word, p + 20 * i + 16, 4);
    lo_top |= static_cast<uint64_t>(word & 0xFFFF) << (16 * i);
    hi_top |= static_cast<uint64_t>(word >> 16) << (16 * i);
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  return {_mm512_or_si512(_mm512_and_si512(raw, nibble), _mm512_maskz_mov_epi8(lo_top, bit4)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble), _mm512_maskz_mov_epi8(hi_top, bit4))};
}

// 128 bytes of four groups in order as (first halves, last halves)
static inline CodeQuad halves_of_quad(const void* p) {
  const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(static_cast<const char*>(p) + 64);
  return {_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1))};
}

template <int G>
static inline CodeQuad quad_codes(const IntQ8<G>& w, int64_t n, int64_t g) {
  return halves_of_quad(w.codes + n * w.k + g * 32);
}

// What a VNNI tile reads of x beyond QuantizedRows' codes, made once per matmul and shared by every
// weight row: the codes in the steps' layout (each full quad of groups as its first halves, then its last
// halves; the groups after the last quad as they are), and, for signed weight codes, + 128 as bytes
// (dpbusd multiplies unsigned by signed: with x unsigned the weights keep their sign, and the 128 * sum(w)
// this adds is taken off by starting the sum at -128 * sum(w), once per weight step for all rows: the
// integer sums stay exact); and each block's scale d spread over the lanes its group takes (four in a
// quad, eight in a pair), so a lane's product s * d is one multiply.
static void prepare_vnni_rows(QuantizedRows& xq, bool signed_weights) {
  const int64_t rows = xq.rows, k = xq.k, groups = xq.groups, quads = groups / 4;
  xq.stepped.resize(rows * k);
  xq.d_lanes.assign(rows * groups * 8, 0.0f);
  xq.sum_lanes.assign(rows * groups * 8, 0.0f);  // a group's block sum in its first lane
  const __m512i bias = _mm512_set1_epi8(signed_weights ? static_cast<char>(0x80) : 0);  // x ^ 0x80 = x + 128
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* x = xq.q.data() + r * k;
    uint8_t* out = xq.stepped.data() + r * k;
    const float* d = xq.d.data() + r * groups;
    const float* sum = xq.sum32.data() + r * groups;
    float* lanes = xq.d_lanes.data() + r * groups * 8;
    float* sum_lanes = xq.sum_lanes.data() + r * groups * 8;
    for (int64_t q = 0; q < quads; ++q) {
      const CodeQuad h = halves_of_quad(x + q * 128);
      _mm512_storeu_si512(out + q * 128, _mm512_xor_si512(h.lo, bias));
      _mm512_storeu_si512(out + q * 128 + 64, _mm512_xor_si512(h.hi, bias));
      for (int i = 0; i < 4; ++i) {
        _mm_storeu_ps(lanes + q * 16 + 4 * i, _mm_set1_ps(d[4 * q + i]));
        sum_lanes[q * 16 + 4 * i] = sum[4 * q + i];
      }
    }
    for (int64_t i = quads * 128; i < k; ++i) out[i] = static_cast<uint8_t>(x[i]) ^ (signed_weights ? 0x80 : 0);
    for (int64_t g = quads * 4; g < groups; ++g) {
      _mm256_storeu_ps(lanes + quads * 16 + (g - quads * 4) * 8, _mm256_set1_ps(d[g]));
      sum_lanes[quads * 16 + (g - quads * 4) * 8] = sum[g];
    }
  }
}

// The lane sums of R <= 8 registers, each in _mm512_reduce_add_ps's tree (the 256-bit halves, then
// 128, 64, 32), so a row's sum has the same bits whatever R is; from three rows on, the registers are
// summed together (a transpose as it goes: 24 instructions for 8 rows, not 8 x 9).
template <int R>
static inline void reduce_lanes(const __m512* v, float* out) {
  if constexpr (R < 3) {
    for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(v[r]);
  } else {
    const __m512 zero = _mm512_setzero_ps();
    __m512 half[4];  // rows 2i and 2i + 1: lanes j + (j + 8), eight each
    for (int i = 0; i < 4; ++i) {
      const __m512 a = 2 * i < R ? v[2 * i] : zero, b = 2 * i + 1 < R ? v[2 * i + 1] : zero;
      half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    __m512 quarter[2];  // 128-bit chunk j: row 4i + j, lanes j + (j + 4)
    for (int i = 0; i < 2; ++i)
      quarter[i] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    // per chunk j: rows j and j + 4, lanes j + (j + 2), then the two left
    const __m512 eighth = _mm512_add_ps(_mm512_shuffle_ps(quarter[0], quarter[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                        _mm512_shuffle_ps(quarter[0], quarter[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 whole = _mm512_add_ps(eighth, _mm512_shuffle_ps(eighth, eighth, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i order = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 10, 6, 2, 12, 8, 4, 0);
    _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, whole)));
  }
}

template <class W, int R>
static void int8_tile(const W& w, const float* scales, const float* zeros, const QuantizedRows& xq, int64_t r0,
                      float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int S = W::SCALES;
  const int64_t groups = xq.groups, k = xq.k, count = groups * S;
  const uint8_t* xs = xq.stepped.data() + r0 * k;
  const float* d_lanes = xq.d_lanes.data() + r0 * groups * 8;
  const float* sum_lanes = xq.sum_lanes.data() + r0 * groups * 8;
  const bool lane_zeros = zeros && S == 1;  // per-16 zeros keep their own term (zeros_left)
  const __m512i quad_lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i pair_lane = S == 1 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0) : quad_lane;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  // codes of x (as dpbusd takes them: unsigned when the weights are signed) against weight codes c
  auto dot = [&](__m512i start, __m512i c, const uint8_t* x) __attribute__((always_inline)) {
    const __m512i xv = _mm512_loadu_si512(x);
    return W::SIGNED ? _mm512_dpbusd_epi32(start, xv, c) : _mm512_dpbusd_epi32(start, c, xv);
  };
  auto unbias = [&](__m512i c) __attribute__((always_inline)) {  // -128 * sum(c) per lane, or 0
    return W::SIGNED ? _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, c))
                     : _mm512_setzero_si512();
  };
  for (int64_t n = n0; n < n1; ++n) {
    prefetch_ahead(w, scales, n, n1, count);
    const float* s = scales + n * count;
    __m512 acc[2][R];
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    auto quad = [&](int64_t g, __m512* chain) __attribute__((always_inline)) {
      const CodeQuad c = quad_codes(w, n, g);
      if (S == 1) {
        const __m512 ws = _mm512_permutexvar_ps(quad_lane, _mm512_castps128_ps512(_mm_loadu_ps(s + g)));
        const __m512i start = W::SIGNED ? _mm512_add_epi32(unbias(c.lo), unbias(c.hi)) : _mm512_setzero_si512();
        for (int r = 0; r < R; ++r) {
          const uint8_t* x = xs + r * k + g * 32;
          const __m512i sums = dot(dot(start, c.lo, x), c.hi, x + 64);
          const __m512 product = _mm512_mul_ps(ws, _mm512_loadu_ps(d_lanes + r * groups * 8 + g * 4));
          chain[r] = _mm512_fmadd_ps(product, _mm512_cvtepi32_ps(sums), chain[r]);
        }
        if (lane_zeros) {  // each group's zero times its block sum, in the first of its lanes
          const __m512 wz = _mm512_permutexvar_ps(quad_lane, _mm512_castps128_ps512(_mm_loadu_ps(zeros + n * count + g)));
          for (int r = 0; r < R; ++r)
            chain[r] = _mm512_fmadd_ps(wz, _mm512_loadu_ps(sum_lanes + r * groups * 8 + g * 4), chain[r]);
        }
      } else {  // a scale per 16: lo and hi take their own
        const __m512 both = _mm512_castps256_ps512(_mm256_loadu_ps(s + g * 2));
        const __m512 ws_lo = _mm512_permutexvar_ps(_mm512_add_epi32(quad_lane, quad_lane), both);
        const __m512 ws_hi = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_add_epi32(quad_lane, quad_lane), _mm512_set1_epi32(1)), both);
        const __m512i start_lo = unbias(c.lo), start_hi = unbias(c.hi);
        for (int r = 0; r < R; ++r) {
          const uint8_t* x = xs + r * k + g * 32;
          const __m512 d = _mm512_loadu_ps(d_lanes + r * groups * 8 + g * 4);
          chain[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws_lo, d), _mm512_cvtepi32_ps(dot(start_lo, c.lo, x)), chain[r]);
          chain[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws_hi, d), _mm512_cvtepi32_ps(dot(start_hi, c.hi, x + 64)), chain[r]);
        }
      }
    };
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      quad(g, acc[0]);
      quad(g + 4, acc[1]);
    }
    if (g + 4 <= groups) quad(g, acc[0]), g += 4;
    if (g + 2 <= groups) {  // two groups as they are, eight lanes each
      const __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(w.group(n, g)), w.group(n, g + 1), 1);
      const __m128 own = S == 1 ? _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + g)))
                                : _mm_loadu_ps(s + g * 2);
      const __m512 ws = _mm512_permutexvar_ps(pair_lane, _mm512_castps128_ps512(own));
      const __m512i start = unbias(c);
      for (int r = 0; r < R; ++r) {
        const __m512 product = _mm512_mul_ps(ws, _mm512_loadu_ps(d_lanes + r * groups * 8 + g * 4));
        acc[0][r] = _mm512_fmadd_ps(product, _mm512_cvtepi32_ps(dot(start, c, xs + r * k + g * 32)), acc[0][r]);
      }
      if (lane_zeros) {
        const __m128 z = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zeros + n * count + g)));
        const __m512 wz = _mm512_permutexvar_ps(pair_lane, _mm512_castps128_ps512(z));
        for (int r = 0; r < R; ++r)
          acc[0][r] = _mm512_fmadd_ps(wz, _mm512_loadu_ps(sum_lanes + r * groups * 8 + g * 4), acc[0][r]);
      }
      g += 2;
    }
    float last[R] = {};
    if (g < groups) {  // an odd last group
      const __m256i wc = w.group(n, g), wu = W::SIGNED ? _mm256_sign_epi8(wc, wc) : wc;
      for (int r = 0; r < R; ++r) {
        const __m256 dot = group_dot<W::SIGNED>(wc, wu, xq.q.data() + (r0 + r) * k + g * 32);
        last[r] = hsum8(_mm256_mul_ps(group_scale<S>(s + g * S, xq.d[(r0 + r) * groups + g]), dot));
      }
    }
    __m512 both[R];
    for (int r = 0; r < R; ++r) both[r] = _mm512_add_ps(acc[0][r], acc[1][r]);
    float sums[8];
    reduce_lanes<R>(both, sums);
    for (int r = 0; r < R; ++r)
      y[r * ldy + n] = sums[r] + last[r] + zeros_left<S>(zeros, xq, r0 + r, n, g);
  }
}

// acc + dpbusd(w, the dword at x in every lane), the broadcast folded into the instruction ({1to16}): GCC's
// intrinsic leaves a vpbroadcastd of its own beside each, work every extra row of a verify pass pays again
static inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

template <int KIND, int S, int R>
static void lane_tile(const LaneWeights& w, const QuantizedRows& xq, int64_t r0, float* y,
                      int64_t ldy, int64_t b0, int64_t b1) {
  constexpr int64_t BYTES = lane_group_bytes(KIND);
  const int64_t groups = xq.groups, count = groups * S, supers = groups / 8;
  const GroupMajorRows<R, S> rows(xq, r0);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* p = w.codes + b * groups * BYTES;
    const BlockScales<8 * S> scale(w.scales, w.sub_scales, w.super_scales, b, count, supers);
    const BlockScales<8 * S> zero(w.zeros, w.sub_zeros, w.super_zeros, b, count, supers);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* pg = p + g * BYTES;
      // the weights stream from memory once per pass: ask for those LANE_PREFETCH_BYTES ahead (the next
      // block's too), every line of them
      for (int64_t i = 0; i < BYTES; i += 64) _mm_prefetch(reinterpret_cast<const char*>(pg + LANE_PREFETCH_BYTES + i), LANE_PREFETCH_HINT);
      if constexpr (KIND == KIND_Q8 || KIND == KIND_Q6_LANES) {
        // register i: codes 4i.. of the group (i < 4: the first 16), unsigned as dpbusd takes them (+ 128,
        // or + 32 in six bits), each sum started where that makes it the signed codes' sum (lane_start)
        __m512i c[8];
        if constexpr (KIND == KIND_Q8) {
          for (int i = 0; i < 8; ++i) c[i] = _mm512_loadu_si512(pg + 64 * i);
        } else {
          for (int q = 0; q < 2; ++q) zmm_lane_codes6(pg, q, c + 2 * q, c + 4 + 2 * q);
        }
        const __m512 ws_a = scale(g * S), ws_b = S == 2 ? scale(g * S + 1) : ws_a;
        for (int r = 0; r < R; ++r) {
          const int32_t* x = rows.codes(g, r);
          __m512i a = _mm512_set1_epi32(lane_start<KIND>(rows.start(g, 0, r)));
          __m512i e = S == 1 ? _mm512_setzero_si512() : _mm512_set1_epi32(lane_start<KIND>(rows.start(g, 1, r)));
          for (int i = 0; i < 4; ++i) {
            a = dpbusd_broadcast(a, c[i], x + i);
            e = dpbusd_broadcast(e, c[4 + i], x + 4 + i);
          }
          const __m512 d = _mm512_set1_ps(rows.d(g, r));
          if constexpr (S == 1) {
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws_a, d), _mm512_cvtepi32_ps(_mm512_add_epi32(a, e)), acc[r]);
          } else {
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws_a, d), _mm512_cvtepi32_ps(a), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws_b, d), _mm512_cvtepi32_ps(e), acc[r]);
          }
        }
      } else {
        __m512i lo[4], hi[4];
        for (int m = 0; m < 4; ++m) zmm_lane_codes<KIND>(pg, m, lo[m], hi[m]);
        const __m512 ws = scale(g);
        for (int r = 0; r < R; ++r) {
          const int32_t* x = rows.codes(g, r);
          // one chain (exact in any order): no add of two chains and one zeroed register less per row and group
          __m512i a = _mm512_setzero_si512();
          for (int m = 0; m < 4; ++m) {
            a = dpbusd_broadcast(a, lo[m], x + m);
            a = dpbusd_broadcast(a, hi[m], x + 4 + m);
          }
          const __m512 d = _mm512_set1_ps(rows.d(g, r));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws, d), _mm512_cvtepi32_ps(a), acc[r]);
        }
      }
      if (w.zeros || w.sub_zeros) {  // each group's zero times x's block sum (per 16 where the scales are)
        for (int h = 0; h < S; ++h) {
          const __m512 wz = zero(g * S + h);
          for (int r = 0; r < R; ++r) {
            const float sum = rows.zero_sum(g, h, r);
            acc[r] = _mm512_fmadd_ps(wz, _mm512_set1_ps(sum), acc[r]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy + b * 16, acc[r]);
  }
}

void run_four_group_matmul(int64_t kind, int64_t group, const void* codes, const float* scales, const float* zeros,
                           QuantizedRows& xq, float* y, int64_t n_out) {
  prepare_vnni_rows(xq, kind == KIND_Q8);
  with_int8_format(kind, group, codes, xq.k, [&](const auto& w) {
    using W = std::decay_t<decltype(w)>;
    kernel_parallel_for(0, n_out, 16, [&](int64_t n0, int64_t n1) {
      over_row_tiles<INT8_MAX_TILE>(xq.rows, [&](auto row_count, int64_t r) {
        int8_tile<W, decltype(row_count)::value>(w, scales, zeros, xq, r, y + r * n_out, n_out, n0, n1);
      });
    });
  });
}

void run_lane_tile(int64_t kind, int scales, int rows, const LaneWeights& w, const QuantizedRows& xq, int64_t r0,
                   float* y, int64_t ldy, int64_t b0, int64_t b1) {
  with_lane_shape(kind, scales, rows, [&](auto kind_c, auto scales_c, auto rows_c) {
    lane_tile<decltype(kind_c)::value, decltype(scales_c)::value, decltype(rows_c)::value>(w, xq, r0, y, ldy, b0, b1);
  });
}
#endif
