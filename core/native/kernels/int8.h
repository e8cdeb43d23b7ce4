// What the int8 kernels share, whatever instruction set runs their tiles.
#pragma once

#include "common.h"
#include "matmul.h"

#if defined(INT8_KERNELS)

// ------------------------------------------------------------------------ int8 activations (AVX2)
//
// The float kernels (float_matmul.cpp) dequantize every weight to float32 and multiply; on AVX2, without AVX-512's
// 16-entry table lookup and at half the width, that ran at 0.08x llama.cpp's decode (perf: 80% of the
// cycles in the tiles). Here, as in llama.cpp, each row of x is first quantized on its own to int8 in
// blocks of 32 (d = amax / 127, q = round(x / d)), and a weight group meets it in integer arithmetic:
// u8 x s8 products summed four to an int32 lane (`maddubs` + `madd` on AVX2, one `dpbusd` with AVX-VNNI or
// AVX512-VNNI), four groups per step, then per row and step one conversion and one float multiply-add with
// the combined scales s_g * d_g; the zero of a group adds z_g * d_g * sum(q). A row of x is quantized the same
// way whatever other rows come with it, and each (weight row, x row) pair runs the same instructions in
// the same order for every tile size: row independence holds as in the float kernels.

// x's rows, quantized per 32-block: codes, the block's scale d, and d * sum(codes) per 32 and per 16 (what
// a group's zero multiplies).
struct QuantizedRows {
  int64_t rows = 0, k = 0, groups = 0;
  std::vector<int8_t> q;
  std::vector<float> d, sum32, sum16;
  std::vector<int32_t> code_sums16;  // the sum of x's codes per 16 (as integers: GroupMajorRows::start)
  // x laid out for the tiles' four-group steps (prepare_vnni_rows, prepare_quad_rows): codes, rows x k,
  // and each block's d spread over the lanes its group takes, rows x groups x 8
  std::vector<uint8_t> stepped;
  std::vector<float> d_lanes;
  std::vector<float> sum_lanes;  // d * sum(codes) per 32 in one lane of its group's (the zeros' term)
};

static inline float hsum8(__m256 v) {
  __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

void quantize_rows(const float* x, int64_t rows, int64_t k, QuantizedRows& out);

// (signed; for signed weight codes, x takes their sign: |w| * (x * sign w) = w * x).

// 16 bytes of packed nibbles (byte j: code j low, code j + 16 high) as 32 code bytes in order
static inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// unsigned codes packed in BYTES per group of 32, one scale per group
template <int BYTES>
struct PackedGroups {
  static constexpr int SCALES = 1;
  static constexpr bool SIGNED = false;
  const uint8_t* codes;
  int64_t groups;
  inline const void* row(int64_t n, int64_t& bytes) const { bytes = groups * BYTES; return codes + n * bytes; }
  inline const uint8_t* at(int64_t n, int64_t g) const { return codes + (n * groups + g) * BYTES; }
};

struct IntQ4 : PackedGroups<16> {
  inline __m256i group(int64_t n, int64_t g) const { return unpack_nibbles(at(n, g)); }
};

// bit i of `bits` as byte i: 0x10 or 0 (byte i takes byte i / 8 of the word, then keeps its bit i % 8)
static inline __m256i bit4_bytes(uint32_t bits) {
  const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), spread);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

struct IntQ5 : PackedGroups<20> {
  inline __m256i group(int64_t n, int64_t g) const {
    const uint8_t* p = at(n, g);
    uint32_t word;  // bit j: code j's bit 4
    std::memcpy(&word, p + 16, 4);
    return _mm256_or_si256(unpack_nibbles(p), bit4_bytes(word));
  }
};

template <int G>
struct IntQ8 {
  static constexpr int SCALES = 32 / G;
  static constexpr bool SIGNED = true;
  const int8_t* codes;
  int64_t k;
  inline const void* row(int64_t n, int64_t& bytes) const { bytes = k; return codes + n * k; }
  inline __m256i group(int64_t n, int64_t g) const {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + n * k + g * 32));
  }
};

// sum of a[i] * b[i] in a fixed order: 8 lanes, then the tail
static inline float dot_f32(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = hsum8(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

constexpr int64_t INT8_PREFETCH_ROWS = 4;


// A group's codes wc (wu: as maddubs takes them) against 32 codes of x: 8 int32 sums of 4 products, as float
template <bool SIGNED>
static inline __m256 group_dot(__m256i wc, __m256i wu, const int8_t* x) {
  __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  if (SIGNED) qx = _mm256_sign_epi8(qx, wc);
  return _mm256_cvtepi32_ps(dot4_add(_mm256_setzero_si256(), wu, qx));
}

// Weight rows stream from memory once per token: ask for the one INT8_PREFETCH_ROWS ahead of row n.
template <class W>
static inline void prefetch_ahead(const W& w, const float* scales, int64_t n, int64_t n1, int64_t count) {
  if (n + INT8_PREFETCH_ROWS >= n1) return;
  int64_t bytes;
  const char* ahead = static_cast<const char*>(w.row(n + INT8_PREFETCH_ROWS, bytes));
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(ahead + i);
  __builtin_prefetch(scales + (n + INT8_PREFETCH_ROWS) * count);
}

// a group's scale products s * d spread over group_dot's lanes (0-3: the first 16 weights, 4-7: the rest);
// `s` points at the group's S weight scales, d is x's block scale
template <int S>
static inline __m256 group_scale(const float* s, float d) {
  return S == 1 ? _mm256_set1_ps(s[0] * d) : _mm256_set_m128(_mm_set1_ps(s[1] * d), _mm_set1_ps(s[0] * d));
}

// What the zeros add to output (weight row n, x row `row`) beyond what the tile's steps carried: per-32
// zeros ride in the four-group steps' lanes, so only groups g0.. are left; per-16 zeros (fused tensors
// only) are one dot product of the row's zeros with x's sums per 16.
template <int S>
static inline float zeros_left(const float* zeros, const QuantizedRows& xq, int64_t row, int64_t n, int64_t g0) {
  if (!zeros) return 0.0f;
  if (S == 2) return dot_f32(zeros + n * xq.groups * 2, xq.sum16.data() + row * 2 * xq.groups, xq.groups * 2);
  float sum = 0.0f;
  for (int64_t g = g0; g < xq.groups; ++g) sum += zeros[n * xq.groups + g] * xq.sum32[row * xq.groups + g];
  return sum;
}

// Rows of x per pass over the weights: 2 x 8 accumulators (zmm: 16 of 32 registers; ymm: all 16, so some
// spill, and still 8 rows cost less than two passes of 4 once the weights do not fit the cache: Gemma 3 on
// x86-64-v3 AVX2 build (avx2, fma, f16c), one thread, 2-vCPU AMD EPYC: 6 and 8 rows -18% and -11%;
// docs/bench/avx2.md, 'Eight rows per pass')
constexpr int INT8_MAX_TILE = 8;

// Calls f with the int8 tiles' reader of the weight's codes
template <class F>
static inline void with_int8_format(int64_t kind, int64_t group, const void* codes, int64_t k, F&& f) {
  if (kind == KIND_Q4) f(IntQ4{{static_cast<const uint8_t*>(codes), k / 32}});
  else if (kind == KIND_Q5) f(IntQ5{{static_cast<const uint8_t*>(codes), k / 32}});
  else if (kind == KIND_Q8 && group == 32) f(IntQ8<32>{static_cast<const int8_t*>(codes), k});
  else if (kind == KIND_Q8 && group == 16) f(IntQ8<16>{static_cast<const int8_t*>(codes), k});
  else TORCH_CHECK(false, "int8 activations: unknown weight kind ", kind, " with group ", group);
}

// Four-group tiles (int8_avx2.cpp or int8_avx512_vnni.cpp): y = the row-form weight against xq's rows
void run_four_group_matmul(int64_t kind, int64_t group, const void* codes, const float* scales, const float* zeros,
                           QuantizedRows& xq, float* y, int64_t n_out);

// Lane tiles: 16 weight rows interleaved so that int32 lane j of a register belongs to weight row j of a
// block of 16, and four adjacent codes of that row fill it; x's four codes meet them as one broadcast
// dword. A lane then sums a whole group in integers (8 dpbusd steps with VNNI), and a row of x pays one
// conversion, scale product and multiply-add per group for 16 outputs at once, where the four-group steps
// paid one per four groups for one output: a quarter of the float work, which is what a verify pass
// over many rows is bound by. No lanes are summed across, so there is no reduction either, and a row's
// sums are the same instructions in the same order whatever rows come with it. These replace the four-group
// tiles wherever a weight has a lane form (its row count a multiple of 16).
// The layout (made once at load, `outrider.models.linear.lane_form`), per block of 16 rows and group:
// 4-bit: 256 bytes, register m (64 bytes) holding bytes 4m..4m+3 of each row's 16 (low nibbles: codes
// 4m.., high: 16 + 4m..); 5-bit: the same, then 8 64-bit masks of bit 4 (low m = 0..3, high m = 0..3;
// bit 4j + t for row j's code t of the four); 8-bit: 512 bytes, register c holding codes 4c..4c+3 of each
// row, as w + 128 (unsigned: dpbusd's unsigned side, against x's signed codes; the 128 x sum(x) this adds
// is taken off by starting each sum at -128 x sum(x), a number per row and group); 6-bit (KIND_Q6_LANES,
// per-16 int8 codes within -32..31, as w + 32, the sums starting at -32 x sum(x)): 384 bytes, the 4-bit layout of
// their low four bits, then two 64-byte registers of bits 4-5, register p byte 4j + t holding those of
// row j's codes 4m + t (bits 0-1) and 16 + 4m + t (bits 2-3) for m = 2p, and for m = 2p + 1 (bits 4-7).
// Scales and zeros as [block][group x S][16].

constexpr int64_t LANE_PREFETCH_BYTES = 4096;
// The lane tiles prefetch into L2, not L1 (the AMX tiles, many rows per pass and bound by their products, keep T0):
// a stream of prefetches into L1 waits on the core's few L1 miss buffers, while into L2 more lines can be in
// flight, and a line in L2 still reaches L1 in time for its group
constexpr auto LANE_PREFETCH_HINT = _MM_HINT_T1;  // an enum in GCC, an int in clang

// What a lane tile's R rows of x give each group (codes, scale d, the sums the zeros multiply), copied
// group-major once per tile: a group's rows then sit at fixed offsets from one pointer. At their own
// addresses the rows took R general registers, spilled in an 8-row tile (2-vCPU AMD EPYC, one thread,
// 1 / 2 / 4 / 8 rows, ms: x86-64-v3 build (avx2, fma, f16c), Gemma 3 9.1 / 11.2 / 15.8 / 27.1 -> 8.8 /
// 10.4 / 14.9 / 25.4; native (avx512_vnni) 8 rows, SmolLM2 5.6 -> 5.2, Gemma 3 11.5 -> 10.5).
// S: scales per group (1, or 2 for int8 codes per 16), the unit of the zeros' sums and of the starts.
template <int R, int S>
struct GroupMajorRows {
  std::unique_ptr<int8_t[]> code_bytes;
  std::unique_ptr<float[]> scales, zero_sums;
  std::unique_ptr<int32_t[]> starts;
  GroupMajorRows(const QuantizedRows& xq, int64_t r0)
      : code_bytes(new int8_t[xq.groups * R * 32]), scales(new float[xq.groups * R]),
        zero_sums(new float[xq.groups * S * R]), starts(new int32_t[xq.groups * S * R]) {
    const int64_t groups = xq.groups;
    for (int64_t g = 0; g < groups; ++g)
      for (int r = 0; r < R; ++r) {
        const int64_t block = (r0 + r) * groups + g;
        std::memcpy(&code_bytes[(g * R + r) * 32], xq.q.data() + (r0 + r) * xq.k + g * 32, 32);
        scales[g * R + r] = xq.d[block];
        for (int h = 0; h < S; ++h) {
          const int64_t at = (g * S + h) * R + r;
          zero_sums[at] = S == 1 ? xq.sum32[block] : xq.sum16[2 * block + h];
          const int32_t code_sum = S == 1 ? xq.code_sums16[2 * block] + xq.code_sums16[2 * block + 1]
                                          : xq.code_sums16[2 * block + h];
          starts[at] = -128 * code_sum;
        }
      }
  }
  // the group's 32 codes of row r, four to a dword
  const int32_t* codes(int64_t g, int r) const { return reinterpret_cast<const int32_t*>(&code_bytes[(g * R + r) * 32]); }
  float d(int64_t g, int r) const { return scales[g * R + r]; }
  // d x the sum of row r's codes over scale unit h of group g: what that unit's zero multiplies
  float zero_sum(int64_t g, int h, int r) const { return zero_sums[(g * S + h) * R + r]; }
  // where an integer sum of unit h against int8 weight codes held + 128 starts: -128 x the sum of x's codes
  int32_t start(int64_t g, int h, int r) const { return starts[(g * S + h) * R + r]; }
};

// Where a lane sum of int8 codes starts, given the +128 form's start (-128 x the sum of x's codes,
// GroupMajorRows::start): that start for 8-bit codes (held + 128), a quarter of it for six-bit ones (held + 32);
// 4- and 5-bit codes start at zero. Exact: the start is a multiple of 128.
template <int KIND>
static inline int32_t lane_start(int32_t eight_bit_start) {
  return KIND == KIND_Q6_LANES ? eight_bit_start / 4 : KIND == KIND_Q8 ? eight_bit_start : 0;
}

#if defined(INT8_VNNI512)
// Register m of a group's 4- or 5-bit lane codes as bytes: lo the codes 4m.. of the group, hi 16 + 4m..
template <int KIND>
static inline void zmm_lane_codes(const uint8_t* pg, int m, __m512i& lo, __m512i& hi) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  const __m512i raw = _mm512_loadu_si512(pg + 64 * m);
  lo = _mm512_and_si512(raw, nibble);
  hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
  if constexpr (KIND == KIND_Q5) {
    uint64_t mask_lo, mask_hi;
    std::memcpy(&mask_lo, pg + 256 + 8 * m, 8);
    std::memcpy(&mask_hi, pg + 256 + 32 + 8 * m, 8);
    lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(mask_lo, bit4));
    hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(mask_hi, bit4));
  }
}

// Registers 2p and 2p + 1 of a group's six-bit lane codes (KIND_Q6_LANES) as bytes 0..63 (w + 32): lo[i] the
// codes 4(2p + i).. of the group, hi[i] 16 + 4(2p + i)..; bits 4-5 from register p of the high bits (see
// "Lane tiles"). 16-bit shifts: each byte's bits 4-5 come from its own byte, whatever the neighbour shifts in.
static inline void zmm_lane_codes6(const uint8_t* pg, int p, __m512i lo[2], __m512i hi[2]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  const __m512i high = _mm512_loadu_si512(pg + 256 + 64 * p);
  const __m512i lo_bits[2] = {_mm512_slli_epi16(high, 4), high};
  const __m512i hi_bits[2] = {_mm512_slli_epi16(high, 2), _mm512_srli_epi16(high, 2)};
  for (int i = 0; i < 2; ++i) {
    const __m512i raw = _mm512_loadu_si512(pg + 64 * (2 * p + i));
    lo[i] = _mm512_or_si512(_mm512_and_si512(raw, nibble), _mm512_and_si512(lo_bits[i], bits45));
    hi[i] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble), _mm512_and_si512(hi_bits[i], bits45));
  }
}

// A block's scales (or zeros) in the form its lane form holds them, from pointers at that block: float32, or
// (factored) int8 sub-scales per unit times the float16 super-scale of their 256 weights, PER_SUPER units
// (LaneWeights). Each product is exact in float32, so a unit's 16 lanes have the held scales' bits either way.
template <int PER_SUPER>
struct BlockScales {
  const float* held;
  const int8_t* sub;
  const uint16_t* super;
  BlockScales(const float* held_all, const int8_t* sub_all, const uint16_t* super_all, int64_t b, int64_t count,
              int64_t supers)
      : held(held_all ? held_all + b * count * 16 : nullptr), sub(sub_all ? sub_all + b * count * 16 : nullptr),
        super(super_all ? super_all + b * supers * 16 : nullptr) {}
  // the 16 lanes (weight rows) of unit `unit`; the form is the weight's, so the branch goes one way throughout
  __m512 operator()(int64_t unit) const {
    if (sub) {
      const __m512i sub32 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + unit * 16)));
      const __m256i super16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + unit / PER_SUPER * 16));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(sub32), _mm512_cvtph_ps(super16));
    }
    return _mm512_loadu_ps(held + unit * 16);
  }
};

#endif

// Rows of x per pass over a lane-form weight: a verify of up to 16 rows (a draft of 15) reads the weights
// once; at 8 a ninth row paid a second pass, nearly a step (the 9-row times below against 8 rows'
// 6.69 / 12.62 ms native and 15.42 / 27.99 ms x86-64-v3, same runs). zmm: 16 accumulators and 8 registers of codes
// in 32; ymm: spilled, as at 8, and still fewer passes. 2-vCPU AMD EPYC, one thread, 9 / 12 / 16 rows
// (benchmarks/activations.py, ms): native (avx512_vnni) SmolLM2 8.37 / 9.87 / 11.72 -> 6.95 / 8.38 /
// 10.41, Gemma 3 19.13 / 20.66 / 23.25 -> 13.32 / 15.42 / 18.14; x86-64-v3 (avx2, fma, f16c) SmolLM2
// 17.93 / 22.77 / 29.25 -> 15.73 / 20.34 / 26.40, Gemma 3 36.12 / 43.27 / 54.48 -> 29.73 / 41.14 / 55.42 (no gain at 16 there).
constexpr int LANE_MAX_TILE = 16;

// f(KIND, S, R) with a lane tile's weight kind, scales per group (2: int8 codes per 16) and rows of x as
// template arguments, from their values
template <int N, class F>
static inline void with_row_count(int rows, F& f) {
  if constexpr (N > 0) {
    if (rows == N) f(std::integral_constant<int, N>{});
    else with_row_count<N - 1>(rows, f);
  }
}

template <class F>
static inline void with_lane_shape(int64_t kind, int scales, int rows, F&& f) {
  auto with_kind = [&](auto kind_c, auto scales_c) {
    auto call = [&](auto rows_c) { f(kind_c, scales_c, rows_c); };
    with_row_count<LANE_MAX_TILE>(rows, call);
  };
  using Q4 = std::integral_constant<int, KIND_Q4>;
  using Q5 = std::integral_constant<int, KIND_Q5>;
  using Q8 = std::integral_constant<int, KIND_Q8>;
  using Q6 = std::integral_constant<int, KIND_Q6_LANES>;
  if constexpr (SIX_BIT_LANES) {
    if (kind == KIND_Q6_LANES) {
      TORCH_CHECK(scales == 2, "linear: six-bit lanes hold per-16 codes only");
      with_kind(Q6{}, std::integral_constant<int, 2>{});
      return;
    }
  }
  if (kind == KIND_Q4) with_kind(Q4{}, std::integral_constant<int, 1>{});
  else if (kind == KIND_Q5) with_kind(Q5{}, std::integral_constant<int, 1>{});
  else if (scales == 1) with_kind(Q8{}, std::integral_constant<int, 1>{});
  else with_kind(Q8{}, std::integral_constant<int, 2>{});
}

// One lane tile of `rows` rows of x (xq's r0..) against blocks b0..b1 of 16 weight rows: the dpbusd (or
// maddubs) tile of int8_avx2.cpp or int8_avx512_vnni.cpp, or AMX's (amx.cpp; nothing where the build has none)
void run_lane_tile(int64_t kind, int scales, int rows, const LaneWeights& w, const QuantizedRows& xq, int64_t r0,
                   float* y, int64_t ldy, int64_t b0, int64_t b1);
void run_amx_lane_tile(int64_t kind, int scales, int rows, const LaneWeights& w, const QuantizedRows& xq, int64_t r0,
                       float* y, int64_t ldy, int64_t b0, int64_t b1);
// Lane tiles of at least this many rows take AMX (0: none); see set_amx_min_rows
int amx_from_rows();

#endif
