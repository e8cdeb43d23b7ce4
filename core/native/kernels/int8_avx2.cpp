// The int8 tiles on AVX2 (maddubs + madd), or AVX-VNNI's 256-bit dpbusd where the build has it: CPUs
// without AVX512-VNNI. Empty in AVX512-VNNI builds (int8_avx512_vnni.cpp).

#include "int8.h"

#if defined(INT8_KERNELS) && !defined(INT8_VNNI512)
// AVX2 four-group steps: the four groups' codes as four registers of eight codes per group (each 64-bit
// chunk holds one group's: g, g + 2, g + 1, g + 3 for unsigned codes, g .. g + 3 for signed), each met
// by x's codes in the same layout with `maddubs`. For 4- and 5-bit codes the four int16 results add
// without overflow (8 products of at most 31 * 127 per lane: 31496 < 32767), then one `madd`; signed
// 8-bit codes could overflow that, so each takes its `madd` and the int32 results add. Either way a row
// pays one conversion, one scale multiply and one multiply-add per 128 weights, where one group at a
// time paid four of each.
struct QuadCodes {
  __m256i c[4];  // codes 0-7, 16-23, 8-15, 24-31 of each group
};

// 64 bytes of four groups' packed nibbles (byte j: code j low, code j + 16 high), chunks g, g+2, g+1, g+3
static inline QuadCodes nibble_quad(__m256i first, __m256i second) {
  const __m256i a = _mm256_unpacklo_epi64(first, second), b = _mm256_unpackhi_epi64(first, second);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  return {{_mm256_and_si256(a, nibble), _mm256_and_si256(_mm256_srli_epi16(a, 4), nibble),
           _mm256_and_si256(b, nibble), _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble)}};
}

static inline QuadCodes quad_codes(const IntQ4& w, int64_t n, int64_t g) {
  const uint8_t* p = w.at(n, g);
  return nibble_quad(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
}

// four groups of 32 signed codes, as (codes 0-7, 16-23, 8-15, 24-31) of groups g .. g + 3
template <int G>
static inline QuadCodes quad_codes(const IntQ8<G>& w, int64_t n, int64_t g) {
  const __m256i* p = reinterpret_cast<const __m256i*>(w.codes + n * w.k + g * 32);
  const __m256i g0 = _mm256_loadu_si256(p), g1 = _mm256_loadu_si256(p + 1);
  const __m256i g2 = _mm256_loadu_si256(p + 2), g3 = _mm256_loadu_si256(p + 3);
  const __m256i lo01 = _mm256_unpacklo_epi64(g0, g1), lo23 = _mm256_unpacklo_epi64(g2, g3);
  const __m256i hi01 = _mm256_unpackhi_epi64(g0, g1), hi23 = _mm256_unpackhi_epi64(g2, g3);
  return {{_mm256_permute2x128_si256(lo01, lo23, 0x20), _mm256_permute2x128_si256(lo01, lo23, 0x31),
           _mm256_permute2x128_si256(hi01, hi23, 0x20), _mm256_permute2x128_si256(hi01, hi23, 0x31)}};
}

static inline QuadCodes quad_codes(const IntQ5& w, int64_t n, int64_t g) {
  const uint8_t* p = w.at(n, g);
  auto nibbles = [&](int i) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 20 * i)); };
  QuadCodes q = nibble_quad(_mm256_set_m128i(nibbles(1), nibbles(0)), _mm256_set_m128i(nibbles(3), nibbles(2)));
  uint32_t top[4];  // bit j of a group's word: code j's bit 4
  for (int i = 0; i < 4; ++i) std::memcpy(&top[i], p + 20 * i + 16, 4);
  const int chunk_group[4] = {0, 2, 1, 3};
  const int first_code[4] = {0, 16, 8, 24};  // of q.c[j]
  for (int j = 0; j < 4; ++j) {
    uint32_t bits = 0;
    for (int c = 0; c < 4; ++c) bits |= ((top[chunk_group[c]] >> first_code[j]) & 0xFF) << (8 * c);
    q.c[j] = _mm256_or_si256(q.c[j], bit4_bytes(bits));
  }
  return q;
}

// x's codes of each full four groups in quad_codes' layout (the groups after them are read from q), d
// spread over each group's lane pair, and the block sums in the first lane of each pair
static void prepare_quad_rows(QuantizedRows& xq, bool signed_weights) {
  const int64_t rows = xq.rows, k = xq.k, groups = xq.groups, quads = groups / 4;
  xq.stepped.resize(rows * k);
  xq.d_lanes.assign(rows * groups * 8, 0.0f);
  xq.sum_lanes.assign(rows * groups * 8, 0.0f);
  const int chunk_group[4] = {0, signed_weights ? 1 : 2, signed_weights ? 2 : 1, 3};
  const int first_code[4] = {0, 16, 8, 24};
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* x = xq.q.data() + r * k;
    uint8_t* out = xq.stepped.data() + r * k;
    const float* d = xq.d.data() + r * groups;
    for (int64_t q = 0; q < quads; ++q) {
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < 4; ++c)
          std::memcpy(out + q * 128 + j * 32 + c * 8, x + (4 * q + chunk_group[c]) * 32 + first_code[j], 8);
      for (int c = 0; c < 4; ++c) {
        float* lanes = xq.d_lanes.data() + r * groups * 8 + q * 8 + 2 * c;
        lanes[0] = lanes[1] = d[4 * q + chunk_group[c]];
        xq.sum_lanes[r * groups * 8 + q * 8 + 2 * c] = xq.sum32[r * groups + 4 * q + chunk_group[c]];
      }
    }
  }
}

// R rows of x against weight rows n0..n1. Per (weight row, x row): four-group steps, alternately in two
// chains of multiply-adds (the chain's latency, not the arithmetic, bounds a one-row pass), then one
// group at a time for what is left. The zeros' term (the row's zeros against x's block sums) rides in
// the four-group steps' lanes, one multiply-add per row and step, and groups after them add it after;
// per-16 zeros are one dot product per row. The same steps for every R.
template <class W, int R>
static void int8_tile(const W& w, const float* scales, const float* zeros, const QuantizedRows& xq, int64_t r0,
                      float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int S = W::SCALES;
  const int64_t groups = xq.groups, k = xq.k, count = groups * S;
  const int8_t* xcodes = xq.q.data() + r0 * k;
  const uint8_t* xs = xq.stepped.data() + r0 * k;
  const float* d_lanes = xq.d_lanes.data() + r0 * groups * 8;
  const float* sum_lanes = xq.sum_lanes.data() + r0 * groups * 8;
  const int64_t quad_end = groups / 4 * 4;
  const bool lane_zeros = zeros && S == 1;
  // the scale of lane pair c: group g + c (signed codes) or g, g + 2, g + 1, g + 3 (nibble codes)
  const __m256i chunk_scale = W::SIGNED ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3) : _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
  for (int64_t n = n0; n < n1; ++n) {
    prefetch_ahead(w, scales, n, n1, count);
    const float* s = scales + n * count;
    __m256 acc[2][R];
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    auto step = [&](int64_t g, __m256* chain) __attribute__((always_inline)) {
      const __m256i wc = w.group(n, g), wu = W::SIGNED ? _mm256_sign_epi8(wc, wc) : wc;
      for (int r = 0; r < R; ++r) {
        const __m256 dot = group_dot<W::SIGNED>(wc, wu, xcodes + r * k + g * 32);
        chain[r] = _mm256_fmadd_ps(group_scale<S>(s + g * S, xq.d[(r0 + r) * groups + g]), dot, chain[r]);
      }
    };
    auto quad = [&](int64_t g, __m256* chain) __attribute__((always_inline)) {
      const QuadCodes q = quad_codes(w, n, g);
      if constexpr (!W::SIGNED) {
        const __m256 ws = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(s + g)), chunk_scale);
        for (int r = 0; r < R; ++r) {
          const uint8_t* x = xs + r * k + g * 32;
          auto xv = [&](int j) __attribute__((always_inline)) {
            return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * j));
          };
          __m256i sums = _mm256_setzero_si256();
          if constexpr (HAS_DPBUSD256) {
            for (int j = 0; j < 4; ++j) sums = dot4_add(sums, q.c[j], xv(j));
          } else {  // int16 sums of the four registers add without overflow (see above), then one madd
            auto part = [&](int j) __attribute__((always_inline)) { return _mm256_maddubs_epi16(q.c[j], xv(j)); };
            const __m256i pairs = _mm256_add_epi16(_mm256_add_epi16(part(0), part(1)), _mm256_add_epi16(part(2), part(3)));
            sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
          }
          const __m256 product = _mm256_mul_ps(ws, _mm256_loadu_ps(d_lanes + r * groups * 8 + g * 2));
          chain[r] = _mm256_fmadd_ps(product, _mm256_cvtepi32_ps(sums), chain[r]);
        }
      } else {
        __m256i magnitude[4];
        for (int j = 0; j < 4; ++j) magnitude[j] = _mm256_sign_epi8(q.c[j], q.c[j]);
        const __m256 own = S == 1 ? _mm256_castps128_ps256(_mm_loadu_ps(s + g)) : _mm256_loadu_ps(s + g * 2);
        const __m256 ws_lo = _mm256_permutevar8x32_ps(own, S == 1 ? chunk_scale : _mm256_add_epi32(chunk_scale, chunk_scale));
        const __m256 ws_hi = S == 1 ? ws_lo : _mm256_permutevar8x32_ps(own, _mm256_add_epi32(_mm256_add_epi32(chunk_scale, chunk_scale), _mm256_set1_epi32(1)));
        for (int r = 0; r < R; ++r) {
          const uint8_t* x = xs + r * k + g * 32;
          auto part = [&](__m256i acc, int j) __attribute__((always_inline)) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * j));
            return dot4_add(acc, magnitude[j], _mm256_sign_epi8(xv, q.c[j]));
          };
          const __m256i zero = _mm256_setzero_si256();
          const __m256 d = _mm256_loadu_ps(d_lanes + r * groups * 8 + g * 2);
          if (S == 1) {
            const __m256i sums = part(part(part(part(zero, 0), 1), 2), 3);
            chain[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws_lo, d), _mm256_cvtepi32_ps(sums), chain[r]);
          } else {  // codes 0-15 (registers 0 and 2) and 16-31 (1 and 3) have their own scales
            chain[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws_lo, d), _mm256_cvtepi32_ps(part(part(zero, 0), 2)), chain[r]);
            chain[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws_hi, d), _mm256_cvtepi32_ps(part(part(zero, 1), 3)), chain[r]);
          }
        }
      }
      if (lane_zeros) {  // each group's zero times its block sum, in the first lane of its pair
        const __m256 wz = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(zeros + n * count + g)), chunk_scale);
        for (int r = 0; r < R; ++r)
          chain[r] = _mm256_fmadd_ps(wz, _mm256_loadu_ps(sum_lanes + r * groups * 8 + g * 2), chain[r]);
      }
    };
    int64_t g = 0;
    for (; g + 8 <= quad_end; g += 8) {
      quad(g, acc[0]);
      quad(g + 4, acc[1]);
    }
    if (g < quad_end) quad(g, acc[0]), g += 4;
    for (; g + 2 <= groups; g += 2) {
      step(g, acc[0]);
      step(g + 1, acc[1]);
    }
    if (g < groups) step(g, acc[0]);
    for (int r = 0; r < R; ++r)
      y[r * ldy + n] = hsum8(_mm256_add_ps(acc[0][r], acc[1][r])) + zeros_left<S>(zeros, xq, r0 + r, n, quad_end);
  }
}

// Register m of a group's 4- or 5-bit lane codes, this half's (weight rows 0-7 or 8-15 of the block) as
// bytes: lo the codes 4m.. of the group, hi 16 + 4m..
template <int KIND>
static inline void ymm_lane_codes(const uint8_t* pg, int m, int half, __m256i& lo, __m256i& hi) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + 64 * m));
  lo = _mm256_and_si256(raw, nibble);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
  if constexpr (KIND == KIND_Q5) {
    uint32_t mask_lo, mask_hi;
    const uint8_t* masks = pg - 32 * half + 256;  // this half's 32 bits of each
    std::memcpy(&mask_lo, masks + 8 * m + 4 * half, 4);
    std::memcpy(&mask_hi, masks + 32 + 8 * m + 4 * half, 4);
    lo = _mm256_or_si256(lo, bit4_bytes(mask_lo));
    hi = _mm256_or_si256(hi, bit4_bytes(mask_hi));
  }
}

// Registers 2p and 2p + 1 of a group's six-bit lane codes (KIND_Q6_LANES), this half's, as bytes 0..63
// (w + 32): lo[i] the codes 4(2p + i).. of the group, hi[i] 16 + 4(2p + i)..; bits 4-5 from register p of
// the high bits (see "Lane tiles").
static inline void ymm_lane_codes6(const uint8_t* pg, int p, __m256i lo[2], __m256i hi[2]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + 256 + 64 * p));
  // 16-bit shifts: each byte's bits 4-5 come from its own byte, whatever the neighbour shifts in
  const __m256i lo_bits[2] = {_mm256_slli_epi16(high, 4), high};
  const __m256i hi_bits[2] = {_mm256_slli_epi16(high, 2), _mm256_srli_epi16(high, 2)};
  for (int i = 0; i < 2; ++i) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + 64 * (2 * p + i)));
    lo[i] = _mm256_or_si256(_mm256_and_si256(raw, nibble), _mm256_and_si256(lo_bits[i], bits45));
    hi[i] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble), _mm256_and_si256(hi_bits[i], bits45));
  }
}

// One half's 8 lanes of scale (or zero) `unit` of a block, from pointers at that block and half: float32 as
// held, or an int8 sub-scale times the float16 super-scale of its 256 weights (PER_SUPER units), the same bits
// (LaneWeights). The form is the weight's, so the branch goes the same way every time.
template <int PER_SUPER>
static inline __m256 half_scales(const float* held, const int8_t* sub, const uint16_t* super, int64_t unit) {
#if defined(__F16C__)
  if (sub) {
    const __m256i sub32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + unit * 16)));
    const __m128i super16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(super + unit / PER_SUPER * 16));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(sub32), _mm256_cvtph_ps(super16));
  }
#endif
  return _mm256_loadu_ps(held + unit * 16);
}

// AVX2: the same layout, each 64-byte register as two ymm halves (weight rows 0-7 and 8-15 of the block),
// taken one after the other. 4- and 5-bit codes: a group's eight maddubs add up in int16 (8 x 2 x 15 x 127
// < 32767 for 4-bit; 5-bit codes, up to 31, take a madd after each four), then one madd to int32; with
// AVX-VNNI, dpbusd chains as in int8_avx512_vnni.cpp. int8 codes (+ 128: maddubs' pairs could overflow
// int16) take their sign back, and meet x as |w| and x with w's sign, a madd per register; with AVX-VNNI,
// dpbusd.
template <int KIND, int S, int R>
static void lane_tile(const LaneWeights& w, const QuantizedRows& xq, int64_t r0, float* y,
                      int64_t ldy, int64_t b0, int64_t b1) {
  constexpr int64_t BYTES = lane_group_bytes(KIND);
  const int64_t groups = xq.groups, count = groups * S;
  const __m256i ones16 = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const GroupMajorRows<R, S> rows(xq, r0);
  for (int64_t b = b0; b < b1; ++b)
    for (int half = 0; half < 2; ++half) {
      const uint8_t* p = w.codes + b * groups * BYTES + 32 * half;
      const int64_t at = b * count * 16 + 8 * half, super_at = b * (groups / 8) * 16 + 8 * half;
      const float* s = w.scales ? w.scales + at : nullptr;
      const float* z = w.zeros ? w.zeros + at : nullptr;
      const int8_t* sub_s = w.sub_scales ? w.sub_scales + at : nullptr;
      const int8_t* sub_z = w.sub_zeros ? w.sub_zeros + at : nullptr;
      const uint16_t* super_s = w.super_scales ? w.super_scales + super_at : nullptr;
      const uint16_t* super_z = w.super_zeros ? w.super_zeros + super_at : nullptr;
      auto scale = [&](int64_t unit) { return half_scales<8 * S>(s, sub_s, super_s, unit); };
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* pg = p + g * BYTES;
        if (half == 0)
          for (int64_t i = 0; i < BYTES; i += 64) _mm_prefetch(reinterpret_cast<const char*>(pg + LANE_PREFETCH_BYTES + i), LANE_PREFETCH_HINT);
        if constexpr (KIND == KIND_Q6_LANES) {
          // codes 0..63 (unsigned: maddubs' side) against x's signed ones, per 16 (S = 2: a the first 16,
          // e the second). Two maddubs of a register pair add in int16 (at most 2 x 2 x 63 x 127 < 32767)
          // before their madd to int32. The sums start at -32 x x's code sums (the +128 codes' start / 4,
          // exact), so they are the int8 codes' sums, integer for integer, and the float steps are KIND_Q8's.
          static_assert(S == 2, "six-bit lanes hold per-16 codes");
          const __m256 ws_a = scale(g * 2), ws_b = scale(g * 2 + 1);
          __m256i a[R], e[R];
          for (int r = 0; r < R; ++r) {
            a[r] = _mm256_set1_epi32(lane_start<KIND>(rows.start(g, 0, r)));
            e[r] = _mm256_set1_epi32(lane_start<KIND>(rows.start(g, 1, r)));
          }
          for (int p = 0; p < 2; ++p) {
            __m256i lo[2], hi[2];
            ymm_lane_codes6(pg, p, lo, hi);
            for (int r = 0; r < R; ++r) {
              const int32_t* x = rows.codes(g, r);
              const __m256i x0 = _mm256_set1_epi32(x[2 * p]), x1 = _mm256_set1_epi32(x[2 * p + 1]);
              const __m256i x4 = _mm256_set1_epi32(x[4 + 2 * p]), x5 = _mm256_set1_epi32(x[5 + 2 * p]);
              if constexpr (HAS_DPBUSD256) {
                a[r] = dot4_add(dot4_add(a[r], lo[0], x0), lo[1], x1);
                e[r] = dot4_add(dot4_add(e[r], hi[0], x4), hi[1], x5);
              } else {
                const __m256i first = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], x0), _mm256_maddubs_epi16(lo[1], x1));
                const __m256i second = _mm256_add_epi16(_mm256_maddubs_epi16(hi[0], x4), _mm256_maddubs_epi16(hi[1], x5));
                a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(first, ones16));
                e[r] = _mm256_add_epi32(e[r], _mm256_madd_epi16(second, ones16));
              }
            }
          }
          for (int r = 0; r < R; ++r) {
            const __m256 d = _mm256_set1_ps(rows.d(g, r));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws_a, d), _mm256_cvtepi32_ps(a[r]), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws_b, d), _mm256_cvtepi32_ps(e[r]), acc[r]);
          }
        } else if constexpr (KIND == KIND_Q8) {
          const __m256 ws_a = scale(g * S), ws_b = S == 2 ? scale(g * S + 1) : ws_a;
          __m256i a[R], e[R];
          for (int r = 0; r < R; ++r) {
            a[r] = HAS_DPBUSD256 ? _mm256_set1_epi32(rows.start(g, 0, r)) : _mm256_setzero_si256();
            e[r] = HAS_DPBUSD256 && S == 2 ? _mm256_set1_epi32(rows.start(g, 1, r)) : _mm256_setzero_si256();
          }
          for (int i = 0; i < 8; ++i) {
            const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + 64 * i));
            const __m256i signed_c = _mm256_xor_si256(c, flip), magnitude = _mm256_abs_epi8(signed_c);
            for (int r = 0; r < R; ++r) {
              const __m256i xv = _mm256_set1_epi32(rows.codes(g, r)[i]);
              __m256i& sum = i < 4 || S == 1 ? a[r] : e[r];  // a group of 32: one sum (half the registers)
              sum = HAS_DPBUSD256 ? dot4_add(sum, c, xv) : dot4_add(sum, magnitude, _mm256_sign_epi8(xv, signed_c));
              // maddubs: a running register, not a tree of products on the stack (as GCC built it: a 4-row
              // pass over Gemma 3's Q8_0 head 3-6% slower, x86-64-v3 build (avx2, fma, f16c)); not for one row, which lost 5% with it, nor
              // for dpbusd, whose chain's latency the tree hides
              if constexpr (R >= 2 && !HAS_DPBUSD256) asm("" : "+x"(sum));
            }
          }
          for (int r = 0; r < R; ++r) {
            const __m256 d = _mm256_set1_ps(rows.d(g, r));
            if constexpr (S == 1) {
              acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws_a, d), _mm256_cvtepi32_ps(_mm256_add_epi32(a[r], e[r])), acc[r]);
            } else {
              acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws_a, d), _mm256_cvtepi32_ps(a[r]), acc[r]);
              acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws_b, d), _mm256_cvtepi32_ps(e[r]), acc[r]);
            }
          }
        } else if constexpr (HAS_DPBUSD256) {
          __m256i lo[4], hi[4];
          for (int m = 0; m < 4; ++m) ymm_lane_codes<KIND>(pg, m, half, lo[m], hi[m]);
          const __m256 ws = scale(g);
          for (int r = 0; r < R; ++r) {
            const int32_t* x = rows.codes(g, r);
            __m256i a = _mm256_setzero_si256(), e = _mm256_setzero_si256();
            for (int m = 0; m < 4; ++m) {
              a = dot4_add(a, lo[m], _mm256_set1_epi32(x[m]));
              e = dot4_add(e, hi[m], _mm256_set1_epi32(x[4 + m]));
            }
            const __m256 d = _mm256_set1_ps(rows.d(g, r));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws, d), _mm256_cvtepi32_ps(_mm256_add_epi32(a, e)), acc[r]);
          }
        } else {
          // maddubs: a register of codes at a time (lo: codes 4m.. of the group, hi: 16 + 4m..), met by
          // every row before the next is unpacked, each row's int16 sum a running register. With all eight
          // unpacked first, a 4-row tile kept its float accumulators on the stack and GCC built the sums as
          // a tree of products, on the stack too; the empty asm keeps each sum where it is (x86-64-v3
          // build (avx2, fma, f16c), one thread: SmolLM2 4 / 8 rows 7.0 / 12.3 -> 6.2 / 11.5 ms). Integer
          // sums: the same in any order. 4-bit: the four int16 sums add without overflow (see above);
          // 5-bit: a madd after two. Each sum starts at zero and the four registers are unrolled: GCC kept
          // them a loop, a branch per row for the first register and a copy per row after each add
          // (SmolLM2 8 rows 10.7-11.0 -> 10.55 ms, the same build and thread).
          const __m256 ws = scale(g);
          __m256i sums[R], first_half[R];
          for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
          for (int m = 0; m < 4; ++m) {
            __m256i lo, hi;
            ymm_lane_codes<KIND>(pg, m, half, lo, hi);
            for (int r = 0; r < R; ++r) {
              const int32_t* x = rows.codes(g, r);
              sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x[m])));
              sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x[4 + m])));
              asm("" : "+x"(sums[r]));
              if (KIND == KIND_Q5 && m == 1) {
                first_half[r] = _mm256_madd_epi16(sums[r], ones16);
                sums[r] = _mm256_setzero_si256();
              }
            }
          }
          for (int r = 0; r < R; ++r) {
            const __m256i sum = KIND == KIND_Q4 ? _mm256_madd_epi16(sums[r], ones16)
                                                : _mm256_add_epi32(first_half[r], _mm256_madd_epi16(sums[r], ones16));
            const __m256 d = _mm256_set1_ps(rows.d(g, r));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws, d), _mm256_cvtepi32_ps(sum), acc[r]);
          }
        }
        if (z || sub_z) {
          for (int h = 0; h < S; ++h) {
            const __m256 wz = half_scales<8 * S>(z, sub_z, super_z, g * S + h);
            for (int r = 0; r < R; ++r) {
              const float sum = rows.zero_sum(g, h, r);
              acc[r] = _mm256_fmadd_ps(wz, _mm256_set1_ps(sum), acc[r]);
            }
          }
        }
      }
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy + b * 16 + 8 * half, acc[r]);
    }
}

void run_four_group_matmul(int64_t kind, int64_t group, const void* codes, const float* scales, const float* zeros,
                           QuantizedRows& xq, float* y, int64_t n_out) {
  prepare_quad_rows(xq, kind == KIND_Q8);
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
