// Outrider's CPU kernels: matrix-vector products straight from GGUF-quantized weights, and attention.
//
// Written with GCC/Clang vector extensions rather than intrinsics, so one source compiles (with
// -march=native) to AVX-512, AVX2 or NEON code. Two promises shape every loop here:
//
// - Row independence. A row of the output depends only on the same row of the input: tiles of rows
//   share the dequantized weights but never an accumulator, and every row runs the same sequence of
//   float operations whatever the tile size. So a verify pass over k+1 tokens gives bit for bit the
//   logits of k+1 single steps, and greedy speculation equals plain decoding.
// - Exact weights. Every GGUF type is held as the integers the file stores with float32 scales (and
//   zeros), w = scale * code + zero, dequantized in registers with float32 activations, or met by int8
//   activations in integer dot products (see "int8 activations", the fast path on AVX2).
//
// Threads: at::parallel_for, i.e. torch's own OpenMP pool (torch's wheel ships libgomp.so.1, which this
// library then shares), so our kernels and torch's ops never fight over cores.
//
// Timings in the comments below, unless they say otherwise: a 2-vCPU AMD EPYC (lscpu: avx2, fma, f16c,
// avx512f/bw/vl, avx512_vnni, avx_vnni; no AMX). "x86-64-v3 build" = OUTRIDER_NATIVE_MARCH=x86-64-v3,
// code for avx2, fma and f16c only; "native" = -march=native, the AVX512-VNNI code. Those against
// llama.cpp, measured in the same runs, are in docs/bench/avx2.md.

#include <chrono>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));

#if defined(__AVX512F__)
constexpr int MAX_TILE = 8;  // rows of input per pass over a weight row: 2 x 8 accumulators fit in 32 registers
#else
constexpr int MAX_TILE = 4;
#endif

static inline v16f load16(const float* p) { v16f v; std::memcpy(&v, p, sizeof v); return v; }
static inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }
// On AVX2 a 64-byte vector is two ymm registers, and GCC built `v16f{} + x` (and `v * x`) from scalar
// stores to the stack: 40% of an AVX2 decode step sat in attention's splats (perf). One broadcast,
// copied into both halves, stays in registers.
static inline v16f splat(float x) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  const __m256 half = _mm256_set1_ps(x);
  v16f v;
  std::memcpy(&v, &half, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &half, 32);
  return v;
#else
  return v16f{} + x;
#endif
}

// 16 bytes to 16 int32 lanes, zero- or sign-extended. GCC scalarizes __builtin_convertvector from byte
// vectors, so x86 gets the widening moves by name.
template <bool SIGNED>
static inline v16i widen(const void* p) {
  v16i w;
#if defined(__AVX512F__)
  __m128i raw = _mm_loadu_si128(static_cast<const __m128i*>(p));
  __m512i v = SIGNED ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
  std::memcpy(&w, &v, sizeof w);
#elif defined(__AVX2__)
  const char* c = static_cast<const char*>(p);
  __m128i raw_lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  __m128i raw_hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8));
  __m256i lo = SIGNED ? _mm256_cvtepi8_epi32(raw_lo) : _mm256_cvtepu8_epi32(raw_lo);
  __m256i hi = SIGNED ? _mm256_cvtepi8_epi32(raw_hi) : _mm256_cvtepu8_epi32(raw_hi);
  std::memcpy(&w, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&w) + 32, &hi, 32);
#else
  v16u8 raw;
  std::memcpy(&raw, p, 16);
  w = __builtin_convertvector(raw, v16i);
  if (SIGNED) w = (w ^ 128) - 128;
#endif
  return w;
}

static inline v16i widen_u8(const uint8_t* p) { return widen<false>(p); }
static inline v16f widen_i8(const int8_t* p) { return __builtin_convertvector(widen<true>(p), v16f); }

// A fixed reduction tree: the same sum for the same lanes, on every call. AVX-512 adds halves of the
// register (the same pairs, in the same order, as the portable loop) instead of spilling 16 lanes.
static inline float hsum(v16f v) {
#if defined(__AVX512F__)
  __m512 z;
  std::memcpy(&z, &v, sizeof z);
  __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(z), _mm512_extractf32x8_ps(z, 1));  // l[i] + l[i + 8]
  __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));    // a[i] + a[i + 4]
  __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));                                 // b0 + b2, b1 + b3
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
#else
  float lanes[16];
  std::memcpy(lanes, &v, sizeof lanes);
  float a[8];
  for (int i = 0; i < 8; ++i) a[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) a[i] = a[i] + a[i + 4];
  return (a[0] + a[2]) + (a[1] + a[3]);
#endif
}


// The element-wise steps (exp, tanh, and the SiLU, GELU, softcap and softmax built on them) run on vectors
// of EW_LANES floats: 16, or 8 on AVX2, where GCC built a 64-byte vector's comparisons and selects from xmm
// and scalar steps through the stack (perf, x86-64-v3 build (avx2, fma, f16c): the SiLU cost a third of
// what the MLP's projections cost at one row). A lane takes the same operations either way.
#if defined(__AVX2__) && !defined(__AVX512F__)
typedef float vew __attribute__((vector_size(32)));
#else
typedef v16f vew;
#endif
constexpr int EW_LANES = sizeof(vew) / sizeof(float);
static inline vew load_ew(const float* p) { vew v; std::memcpy(&v, p, sizeof v); return v; }
static inline void store_ew(float* p, vew v) { std::memcpy(p, &v, sizeof v); }
static inline float hmax(vew v) {
  float lanes[EW_LANES];
  std::memcpy(lanes, &v, sizeof lanes);
  float m = lanes[0];
  for (int i = 1; i < EW_LANES; ++i) m = lanes[i] > m ? lanes[i] : m;
  return m;
}

// exp(x) to about 2 ulp: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for exp(r), 2^n from
// the exponent bits. Vectorized, so softmax and the activations cost a few cycles per element.
static inline vew vexp(vew x) {
  typedef decltype(x > x) vi;
  x = x < -87.0f ? vew{} - 87.0f : x;
  x = x > 88.0f ? vew{} + 88.0f : x;
  vew t = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(t, vi);            // truncates towards zero
  vew nf = __builtin_convertvector(n, vew);
  vi down = nf > t;                                 // -1 where truncation went up (negative t)
  n = n + down;
  nf = __builtin_convertvector(n, vew);
  vew r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  vew p = vew{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  vi bits = (n + 127) << 23;
  vew scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

static inline vew vtanh(vew x) {
  x = x < -9.0f ? vew{} - 9.0f : x;
  x = x > 9.0f ? vew{} + 9.0f : x;
  vew e = vexp(x * 2.0f);
  return (e - 1.0f) / (e + 1.0f);
}

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

constexpr int64_t PREFETCH_ROWS = 4;

// A tile reads all of its R rows of x for every weight row. Once they outgrow the L1 cache (8 rows of
// K = 2048: Gemma 3's down projection) they come from L2 each time, and an 8-row tile cost 2x what a
// 6-row one did. Such a tile walks K in blocks instead, over a block of weight rows, keeping each
// (weight row, x row) accumulator in memory between blocks: 14% faster there, no gain at 56 KB of x or
// less (measured). Every accumulator still takes the same fused multiply-adds in the same order, so the
// result is bit for bit the unblocked one.
constexpr int64_t TILE_X_BYTES = 61440;        // above this, a tile's rows of x are walked in blocks of K
constexpr int64_t TILE_X_BLOCK_BYTES = 16384;  // ... of this many bytes of x
constexpr int64_t BLOCKED_WEIGHT_ROWS = 8;

template <class W, int R>
static void tile_k_blocked(const W& w, int64_t groups, const float* x, int64_t ldx, float* y, int64_t ldy,
                           int64_t n0, int64_t n1) {
  constexpr int64_t NB = BLOCKED_WEIGHT_ROWS;
  const int64_t block = std::max<int64_t>(1, TILE_X_BLOCK_BYTES / (R * 32 * 4));  // groups per block
  RowReader<W> row{w, groups};
  v16f acc_a[NB][R], acc_b[NB][R];
  for (int64_t nb = n0; nb < n1; nb += NB) {
    const int64_t count = std::min(NB, n1 - nb);
    for (int64_t i = 0; i < count; ++i)
      for (int r = 0; r < R; ++r) acc_a[i][r] = acc_b[i][r] = v16f{};
    for (int64_t g0 = 0; g0 < groups; g0 += block) {
      const int64_t g1 = std::min(groups, g0 + block);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t n = nb + i;
        row.start(n);
        v16f ca[R], cb[R];
        for (int r = 0; r < R; ++r) { ca[r] = acc_a[i][r]; cb[r] = acc_b[i][r]; }
        for (int64_t g = g0; g < g1; ++g) {
          v16f a, b;
          row.group(n, g, a, b);
          for (int r = 0; r < R; ++r) {
            const float* xr = x + r * ldx + g * 32;
            ca[r] = ca[r] + a * load16(xr);
            cb[r] = cb[r] + b * load16(xr + 16);
          }
        }
        for (int r = 0; r < R; ++r) { acc_a[i][r] = ca[r]; acc_b[i][r] = cb[r]; }
      }
    }
    for (int64_t i = 0; i < count; ++i)
      for (int r = 0; r < R; ++r) y[r * ldy + nb + i] = hsum(acc_a[i][r] + acc_b[i][r]);
  }
}

// y[r, n] for R rows of x against weight rows n0..n1. Each row of x has its own two accumulators per
// weight row (one per half of a group), updated in the same order for every R: this is what makes the
// result independent of the tile. With few rows of x, two weight rows go together, so that four
// accumulator chains (not two) hide the latency of the FMAs.
template <class W, int R>
static void tile(const W& w, int64_t groups, const float* x, int64_t ldx, float* y, int64_t ldy,
                 int64_t n0, int64_t n1) {
  if (R * ldx * 4 > TILE_X_BYTES) return tile_k_blocked<W, R>(w, groups, x, ldx, y, ldy, n0, n1);
  constexpr int C = R <= 4 ? 2 : 1;
  RowReader<W> rows[2] = {{w, groups}, {w, groups}};
  int64_t n = n0;
  for (; n + C <= n1; n += C) {
    v16f acc_a[C][R], acc_b[C][R];
    for (int c = 0; c < C; ++c) {
      for (int r = 0; r < R; ++r) acc_a[c][r] = acc_b[c][r] = v16f{};
      rows[c].start(n + c);
      if (n + c + PREFETCH_ROWS < n1) rows[c].prefetch(n + c + PREFETCH_ROWS);
    }
    for (int64_t g = 0; g < groups; ++g) {
      v16f a[C], b[C];
      for (int c = 0; c < C; ++c) rows[c].group(n + c, g, a[c], b[c]);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * ldx + g * 32;
        v16f xa = load16(xr), xb = load16(xr + 16);
        for (int c = 0; c < C; ++c) {
          acc_a[c][r] = acc_a[c][r] + a[c] * xa;
          acc_b[c][r] = acc_b[c][r] + b[c] * xb;
        }
      }
    }
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) y[r * ldy + n + c] = hsum(acc_a[c][r] + acc_b[c][r]);
  }
  for (; n < n1; ++n) {  // an odd last row
    v16f acc_a[R], acc_b[R];
    for (int r = 0; r < R; ++r) acc_a[r] = acc_b[r] = v16f{};
    rows[0].start(n);
    for (int64_t g = 0; g < groups; ++g) {
      v16f a, b;
      rows[0].group(n, g, a, b);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * ldx + g * 32;
        acc_a[r] = acc_a[r] + a * load16(xr);
        acc_b[r] = acc_b[r] + b * load16(xr + 16);
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = hsum(acc_a[r] + acc_b[r]);
  }
}

// the last tile: `rest` rows, 0 <= rest < MAX, as a template argument
template <int N, class Tile>
static inline void last_row_tile(int64_t rest, int64_t r, Tile& tile) {
  if constexpr (N > 0) {
    if (rest == N) tile(std::integral_constant<int, N>{}, r);
    else last_row_tile<N - 1>(rest, r, tile);
  }
}

// `tile(std::integral_constant<int, R>{}, r0)` for rows r0 .. r0 + R - 1 of x: tiles of MAX rows, then one of the rest
// (a tile's row count is a template argument, so its accumulators live in registers)
template <int MAX, class Tile>
static inline void over_row_tiles(int64_t rows, Tile&& tile) {
  int64_t r = 0;
  for (; r + MAX <= rows; r += MAX) tile(std::integral_constant<int, MAX>{}, r);
  last_row_tile<MAX - 1>(rows - r, r, tile);
}

template <class W>
static void matmul(const W& w, int64_t groups, const float* x, int64_t rows, int64_t k, float* y, int64_t n_out) {
  // A grain of 16 output rows keeps the two halves of a small matrix on two threads.
  at::parallel_for(0, n_out, 16, [&](int64_t n0, int64_t n1) {
    over_row_tiles<MAX_TILE>(rows, [&](auto row_count, int64_t r) {
      tile<W, decltype(row_count)::value>(w, groups, x + r * k, k, y + r * n_out, n_out, n0, n1);
    });
  });
}

// --------------------------------------------------------------------------- row-wise pre/post steps

static void rms_norm_row(const float* x, const float* weight, float eps, int64_t n, float* out) {
  v16f acc{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) { v16f v = load16(x + i); acc = acc + v * v; }
  float ss = hsum(acc);
  for (; i < n; ++i) ss += x[i] * x[i];
  float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
  for (; i + 16 <= n; i += 16) store16(out + i, load16(x + i) * inv * load16(weight + i));
  for (; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

enum Act { ACT_NONE = 0, ACT_SILU = 1, ACT_GELU_TANH = 2 };

// out = act(gate) * up, gate and up the two halves of a row of 2n
static void glu_row(const float* gu, int64_t n, int act, float* out) {
  const float* gate = gu;
  const float* up = gu + n;
  int64_t i = 0;
  for (; i + EW_LANES <= n; i += EW_LANES) {
    vew g = load_ew(gate + i), h;
    if (act == ACT_SILU) {
      h = g / (vexp(-g) + 1.0f);
    } else {
      vew inner = (g + g * g * g * 0.044715f) * 0.7978845608028654f;
      h = g * 0.5f * (vtanh(inner) + 1.0f);
    }
    store_ew(out + i, h * load_ew(up + i));
  }
  for (; i < n; ++i) {
    float g = gate[i], h;
    if (act == ACT_SILU) h = g / (1.0f + std::exp(-g));
    else h = 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    out[i] = h * up[i];
  }
}

static void softcap_row(float* y, int64_t n, float cap) {
  int64_t i = 0;
  for (; i + EW_LANES <= n; i += EW_LANES) store_ew(y + i, vtanh(load_ew(y + i) * (1.0f / cap)) * cap);
  for (; i < n; ++i) y[i] = std::tanh(y[i] / cap) * cap;
}

// ----------------------------------------------------------------------------------------- linear

static const float* held(const torch::Tensor& t) {
  TORCH_CHECK(!t.numel() || (t.scalar_type() == torch::kFloat32 && t.is_contiguous()),
              "scales and zeros must be contiguous float32");
  return t.numel() ? t.data_ptr<float>() : nullptr;
}

// How a weight is held (PackedLinear.kind): packed nibbles, int8 codes, float32, 5-bit codes. Exported to
// Python as WEIGHT_KINDS, with ACTIVATIONS, KV_MODES and KEY_BLOCK, so Python's table (outrider.native.codes)
// is checked against these.
enum WeightKind { KIND_Q4 = 0, KIND_Q8 = 1, KIND_F32 = 2, KIND_Q5 = 3 };

// Calls f with the weight format named by kind (see WeightKind), group and zeros.
template <class F>
static void with_format(int64_t kind, const torch::Tensor& codes, const torch::Tensor& scales,
                        const torch::Tensor& zeros, int64_t group, int64_t k, F&& f) {
  const float* s = held(scales);
  const float* z = held(zeros);
  if (kind == KIND_Q4) {
    f(Q4{codes.data_ptr<uint8_t>(), s, z, k / 32});
  } else if (kind == KIND_Q8) {
    const int8_t* c = codes.data_ptr<int8_t>();
    if (group == 32 && z) f(Q8<32, true>{c, s, z, k});
    else if (group == 32) f(Q8<32, false>{c, s, z, k});
    else if (group == 16 && z) f(Q8<16, true>{c, s, z, k});
    else if (group == 16) f(Q8<16, false>{c, s, z, k});
    else TORCH_CHECK(false, "int8 weights need a group of 16 or 32");
  } else if (kind == KIND_Q5) {
    f(Q5{codes.data_ptr<uint8_t>(), s, z, k / 32});
  } else {
    TORCH_CHECK(kind == KIND_F32, "unknown weight kind ", kind);
    f(F32{codes.data_ptr<float>(), nullptr, nullptr, k});
  }
}

// ------------------------------------------------------------------------ int8 activations (AVX2)
//
// The float kernels above dequantize every weight to float32 and multiply; on AVX2, without AVX-512's
// 16-entry table lookup and at half the width, that ran at 0.08x llama.cpp's decode (perf: 80% of the
// cycles in the tiles). Here, as in llama.cpp, each row of x is first quantized on its own to int8 in
// blocks of 32 (d = amax / 127, q = round(x / d)), and a weight group meets it in integer arithmetic:
// u8 x s8 products summed four to an int32 lane (`maddubs` + `madd` on AVX2, one `dpbusd` with AVX-VNNI or
// AVX512-VNNI), four groups per step, then per row and step one conversion and one float multiply-add with
// the combined scales s_g * d_g; the zero of a group adds z_g * d_g * sum(q). A row of x is quantized the same
// way whatever other rows come with it, and each (weight row, x row) pair runs the same instructions in
// the same order for every tile size: row independence holds as in the float kernels.
#if defined(__AVX2__) && defined(__FMA__)
constexpr bool HAS_INT8_KERNELS = true;

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

static inline int32_t hsum8_epi32(__m256i v) {
  __m128i h4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  __m128i h2 = _mm_add_epi32(h4, _mm_unpackhi_epi64(h4, h4));
  return _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 1)));
}

static void quantize_rows(const float* x, int64_t rows, int64_t k, QuantizedRows& out) {
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

// Each format gives a group's 32 codes as bytes for `maddubs` (unsigned), and the x codes to meet them
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define INT8_VNNI512 1  // the int8 tiles below take the AVX512-VNNI form
#endif

// acc + the sums of four adjacent products of unsigned u and signed v bytes, per int32 lane: one AVX-VNNI
// `dpbusd` where the CPU has it (Intel since Alder Lake, AMD since Zen 4), else maddubs + madd. The
// integer sums are the same either way (maddubs cannot saturate here: at most 2 * 128 * 127 < 32767).
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
constexpr bool HAS_DPBUSD256 = true;
#else
constexpr bool HAS_DPBUSD256 = false;
#endif

static inline __m256i dot4_add(__m256i acc, __m256i u, __m256i v) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, v);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, v);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1)));
#endif
}

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

#if !defined(INT8_VNNI512)
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

#endif

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

#endif

// Rows of x per pass over the weights: 2 x 8 accumulators (zmm: 16 of 32 registers; ymm: all 16, so some
// spill, and still 8 rows cost less than two passes of 4 once the weights do not fit the cache: Gemma 3 on
// x86-64-v3 AVX2 build (avx2, fma, f16c), one thread, 2-vCPU AMD EPYC: 6 and 8 rows -18% and -11%;
// docs/bench/avx2.md, 'Eight rows per pass')
constexpr int INT8_MAX_TILE = 8;

template <class W>
static void int8_matmul(const W& w, const float* scales, const float* zeros, const QuantizedRows& xq, float* y,
                        int64_t n_out) {
  at::parallel_for(0, n_out, 16, [&](int64_t n0, int64_t n1) {
    over_row_tiles<INT8_MAX_TILE>(xq.rows, [&](auto row_count, int64_t r) {
      int8_tile<W, decltype(row_count)::value>(w, scales, zeros, xq, r, y + r * n_out, n_out, n0, n1);
    });
  });
}

// false where the weight is float32 (which keeps float activations)
static bool run_int8_matmul(int64_t kind, const torch::Tensor& codes, const torch::Tensor& scales,
                            const torch::Tensor& zeros, int64_t group, const float* x, int64_t rows, int64_t k,
                            float* y, int64_t n_out) {
  if (kind == KIND_F32) return false;
  QuantizedRows xq;
  quantize_rows(x, rows, k, xq);
#if defined(INT8_VNNI512)
  prepare_vnni_rows(xq, kind == KIND_Q8);
#else
  prepare_quad_rows(xq, kind == KIND_Q8);
#endif
  const float* s = held(scales);
  const float* z = held(zeros);
  if (kind == KIND_Q4) int8_matmul(IntQ4{{codes.data_ptr<uint8_t>(), k / 32}}, s, z, xq, y, n_out);
  else if (kind == KIND_Q5) int8_matmul(IntQ5{{codes.data_ptr<uint8_t>(), k / 32}}, s, z, xq, y, n_out);
  else if (kind == KIND_Q8 && group == 32) int8_matmul(IntQ8<32>{codes.data_ptr<int8_t>(), k}, s, z, xq, y, n_out);
  else if (kind == KIND_Q8 && group == 16) int8_matmul(IntQ8<16>{codes.data_ptr<int8_t>(), k}, s, z, xq, y, n_out);
  else TORCH_CHECK(false, "int8 activations: unknown weight kind ", kind, " with group ", group);
  return true;
}

// The products a second that one core gives a row in this build's lane tiles on registers alone: nothing
// loaded, no codes unpacked, no x to lay out, only what each (row, group of 32 codes) pair itself costs.
// A k-row pass over P weights cannot take less than k * P / rate, whatever the tiles around it do
// (benchmarks/activations.py --floor). The integer step: AVX512-VNNI a zmm `dpbusd` (64 products),
// AVX-VNNI a ymm one (32), signed codes alike (they meet x + 128); plain AVX2, 4- and 5-bit codes
// `maddubs` pairs added in int16 and one `madd` per group, 8-bit codes (signed_codes) a `sign`, a `maddubs`,
// a `madd` and an add per 32 products (a pair of `maddubs` of them could overflow int16). With float_steps,
// each group's float step too, as the tiles take it: the sum to float, times the weight scales x d, added;
// for 4- and 5-bit codes the zero's multiply-add. Independent chains (rows) hide the steps' latency.
static double int8_product_rate(double seconds, bool signed_codes, bool float_steps) {
#if defined(INT8_VNNI512)
  using Reg = __m512i;
  using Acc = __m512;
  constexpr int CHAINS = 8, WIDTH = 64;
  auto group = [](Reg u, Reg v, bool, Reg& sum) {
    for (int m = 0; m < 8; ++m) {
      asm volatile("" : "+x"(u), "+x"(v));  // operands unknown to the compiler (volatile: nor hoisted): no product is folded or shared
      sum = _mm512_dpbusd_epi32(sum, u, v);
    }
  };
  auto to_float = [](Reg sum) { return _mm512_cvtepi32_ps(sum); };
  auto times = [](Acc a, Acc b) { return _mm512_mul_ps(a, b); };
  auto fma = [](Acc a, Acc b, Acc c) { return _mm512_fmadd_ps(a, b, c); };
  const Reg u = _mm512_set1_epi8(3), v = _mm512_set1_epi8(5);
  const Acc one = _mm512_set1_ps(1.0f);
#else
  using Reg = __m256i;
  using Acc = __m256;
  constexpr int CHAINS = 6, WIDTH = 32;
  auto group = [](Reg u, Reg v, bool signed_codes, Reg& sum) {
    if (HAS_DPBUSD256) {
      for (int m = 0; m < 8; ++m) {
        asm volatile("" : "+x"(u), "+x"(v));
        sum = dot4_add(sum, u, v);
      }
    } else if (signed_codes) {  // |w| once per register of codes, for every row (as in the tiles)
      Reg magnitude = _mm256_abs_epi8(u);
      for (int m = 0; m < 8; ++m) {
        asm volatile("" : "+x"(u), "+x"(v), "+x"(magnitude));
        const Reg p = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(v, u));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
      }
    } else {
      Reg pairs;
      for (int m = 0; m < 4; ++m) {
        asm volatile("" : "+x"(u), "+x"(v));
        const Reg t = _mm256_add_epi16(_mm256_maddubs_epi16(u, v), _mm256_maddubs_epi16(v, u));
        pairs = m == 0 ? t : _mm256_add_epi16(pairs, t);
      }
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
  };
  auto to_float = [](Reg sum) { return _mm256_cvtepi32_ps(sum); };
  auto times = [](Acc a, Acc b) { return _mm256_mul_ps(a, b); };
  auto fma = [](Acc a, Acc b, Acc c) { return _mm256_fmadd_ps(a, b, c); };
  const Reg u = _mm256_set1_epi8(3), v = _mm256_set1_epi8(5);
  const Acc one = _mm256_set1_ps(1.0f);
#endif
  Acc acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = one;
  int64_t groups = 0;
  const auto start = std::chrono::steady_clock::now();
  double elapsed = 0;
  do {
    for (int n = 0; n < 1000; ++n)
      for (int i = 0; i < CHAINS; ++i) {
        Reg sum = u;  // a group's sum starts afresh (at x's start for signed codes), as in the tiles
        group(u, v, signed_codes, sum);
        if (!float_steps) {
          asm volatile("" ::"x"(sum));  // used: the products stay
          continue;
        }
        Acc ws = one, d = one;
        asm volatile("" : "+x"(ws), "+x"(d));
        acc[i] = fma(times(ws, d), to_float(sum), acc[i]);
        if (!signed_codes) acc[i] = fma(ws, d, acc[i]);  // the zero times d x sum(x)
      }
    groups += 1000 * CHAINS;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (elapsed < seconds);
  for (int i = 0; i < CHAINS; ++i) asm volatile("" ::"x"(acc[i]));  // used: the loops stay
  return static_cast<double>(groups) * 8 * WIDTH / elapsed;
}
#else
constexpr bool HAS_INT8_KERNELS = false;
static double int8_product_rate(double, bool, bool) { return 0.0; }
static bool run_int8_matmul(int64_t, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, int64_t,
                            const float*, int64_t, int64_t, float*, int64_t) { return false; }
#endif

#if defined(INT8_VNNI512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define INT8_AMX 1  // lane tiles of AMX_MIN_ROWS rows take AMX (below)
constexpr bool HAS_AMX_TILES = true;
// Linux hands AMX's tile state to a process only on request, once (arch_prctl), for all its threads.
static bool request_amx() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
static const bool AMX_GRANTED = request_amx();
#else
constexpr bool HAS_AMX_TILES = false;
constexpr bool AMX_GRANTED = false;
#endif

// Lane tiles of at least this many rows take AMX where the build and the OS have it (0: none). A group's
// tile sequence costs the same for 1 or 16 rows, so fewer rows keep the dpbusd tile; the bits are the same.
// Intel Xeon VM (avx512_vnni, amx_int8; GCC 13), one thread, SmolLM2 / Gemma 3 shapes, AMX time over
// dpbusd's: 8 rows 1.57 / 1.20, 12 rows 1.26 / 1.08, 16 rows 0.87 / 0.87 (docs/bench/avx2.md, 'AMX tiles').
constexpr int AMX_MIN_ROWS = 16;
static std::atomic<int> amx_min_rows{HAS_AMX_TILES && AMX_GRANTED ? AMX_MIN_ROWS : 0};

static int set_amx_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= 16, "AMX tiles: from 1 to 16 rows (a lane tile's), or 0 for none; got ", rows);
  TORCH_CHECK(rows == 0 || (HAS_AMX_TILES && AMX_GRANTED), "AMX tiles: this build or this process has none");
  return amx_min_rows.exchange(static_cast<int>(rows));
}

// Lane tiles: 16 weight rows interleaved so that int32 lane j of a register belongs to weight row j of a
// block of 16, and four adjacent codes of that row fill it; x's four codes meet them as one broadcast
// dword. A lane then sums a whole group in integers (8 dpbusd steps with VNNI), and a row of x pays one
// conversion, scale product and multiply-add per group for 16 outputs at once, where the four-group steps
// above paid one per four groups for one output: a quarter of the float work, which is what a verify pass
// over many rows is bound by. No lanes are summed across, so there is no reduction either, and a row's
// sums are the same instructions in the same order whatever rows come with it. These replace the tiles
// above wherever a weight has a lane form (its row count a multiple of 16: every real model's).
// The layout (made once at load, `outrider.models.linear.lane_form`), per block of 16 rows and group:
// 4-bit: 256 bytes, register m (64 bytes) holding bytes 4m..4m+3 of each row's 16 (low nibbles: codes
// 4m.., high: 16 + 4m..); 5-bit: the same, then 8 64-bit masks of bit 4 (low m = 0..3, high m = 0..3;
// bit 4j + t for row j's code t of the four); 8-bit: 512 bytes, register c holding codes 4c..4c+3 of each
// row, as w + 128 (unsigned: dpbusd's unsigned side, against x's signed codes; the 128 x sum(x) this adds
// is taken off by starting each sum at -128 x sum(x), a number per row and group). Scales and zeros as
// [block][group x S][16].
// bytes of one block of 16 rows and one group of 32 codes in the lane form
constexpr int64_t lane_group_bytes(int64_t kind) { return kind == KIND_Q4 ? 256 : kind == KIND_Q5 ? 320 : 512; }

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool HAS_LANE_TILES = true;

struct LaneWeights {
  const uint8_t* codes;
  const float *scales, *zeros;
};

constexpr int64_t LANE_PREFETCH_BYTES = 4096;

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

template <int KIND, int S, int R>
static void lane_tile(const LaneWeights& w, const QuantizedRows& xq, int64_t r0, float* y,
                      int64_t ldy, int64_t b0, int64_t b1) {
  constexpr int64_t BYTES = lane_group_bytes(KIND);
  const int64_t groups = xq.groups, count = groups * S;
  const GroupMajorRows<R, S> rows(xq, r0);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* p = w.codes + b * groups * BYTES;
    const float* s = w.scales + b * count * 16;
    const float* z = w.zeros ? w.zeros + b * count * 16 : nullptr;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* pg = p + g * BYTES;
      // the weights stream from memory once per pass: ask for those LANE_PREFETCH_BYTES ahead (the next
      // block's too), every line of them
      for (int64_t i = 0; i < BYTES; i += 64) _mm_prefetch(reinterpret_cast<const char*>(pg + LANE_PREFETCH_BYTES + i), _MM_HINT_T0);
      if constexpr (KIND == KIND_Q8) {
        __m512i c[8];
        for (int i = 0; i < 8; ++i) c[i] = _mm512_loadu_si512(pg + 64 * i);
        const __m512 ws_a = _mm512_loadu_ps(s + g * S * 16), ws_b = S == 2 ? _mm512_loadu_ps(s + g * S * 16 + 16) : ws_a;
        for (int r = 0; r < R; ++r) {
          const int32_t* x = rows.codes(g, r);
          __m512i a = _mm512_set1_epi32(rows.start(g, 0, r));
          __m512i e = S == 1 ? _mm512_setzero_si512() : _mm512_set1_epi32(rows.start(g, 1, r));
          for (int i = 0; i < 4; ++i) {
            a = _mm512_dpbusd_epi32(a, c[i], _mm512_set1_epi32(x[i]));
            e = _mm512_dpbusd_epi32(e, c[4 + i], _mm512_set1_epi32(x[4 + i]));
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
        const __m512 ws = _mm512_loadu_ps(s + g * 16);
        for (int r = 0; r < R; ++r) {
          const int32_t* x = rows.codes(g, r);
          __m512i a = _mm512_setzero_si512(), e = _mm512_setzero_si512();
          for (int m = 0; m < 4; ++m) {
            a = _mm512_dpbusd_epi32(a, lo[m], _mm512_set1_epi32(x[m]));
            e = _mm512_dpbusd_epi32(e, hi[m], _mm512_set1_epi32(x[4 + m]));
          }
          const __m512 d = _mm512_set1_ps(rows.d(g, r));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws, d), _mm512_cvtepi32_ps(_mm512_add_epi32(a, e)), acc[r]);
        }
      }
      if (z) {  // each group's zero times x's block sum (per 16 where the scales are)
        for (int h = 0; h < S; ++h) {
          const __m512 wz = _mm512_loadu_ps(z + (g * S + h) * 16);
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

#if defined(INT8_AMX)
// AMX (Intel since Sapphire Rapids): TDPBSUD multiplies a tile of up to 16 rows of x's signed codes by a
// tile of unsigned weight codes laid out four adjacent codes of 16 weight rows to a 64-byte row, which is
// the lane form itself: 8-bit codes are read in place, 4- and 5-bit ones unpacked to bytes once per group
// for all of a tile's rows. One instruction gives every row's 16 sums of a group (of each half, with
// scales per 16), the integers the dpbusd chains above give, and the float steps after it are the tile's
// above, op for op: so the bits are the same whichever of the two runs a tile, and a verify pass over k
// rows still gives each row the bits of a one-row step (which keeps the dpbusd tile: at one row TDPBSUD's
// 16 x 16 x 32 products are mostly idle).
// GCC's tile intrinsics tell the compiler of no memory they read or write: stores to what a tile loads,
// and loads of what a tile stored, must not move across them.
static inline void tile_memory_barrier() { asm volatile("" ::: "memory"); }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// x's codes (tile A) times weight codes (tile B) into tile C, stored as int32 rows of 16 at out. A macro:
// the intrinsics take tile numbers as tokens, which a template argument is not.
#define TILE_PRODUCT(C, A, B, x, weights, out) \
  do {                                          \
    _tile_loadd(A, x, 32);                      \
    _tile_loadd(B, weights, 64);                \
    _tile_zero(C);                              \
    _tile_dpbsud(C, A, B);                      \
    _tile_stored(C, out, 64);                   \
  } while (0)

// Group g's products are started AHEAD groups before its float steps, into slot g % SLOTS: a tile's
// loads, product and store take longer than a group's float steps, which run meanwhile.
template <int KIND, int S, int R>
static void amx_lane_tile(const LaneWeights& w, const QuantizedRows& xq, int64_t r0, float* y,
                          int64_t ldy, int64_t b0, int64_t b1) {
  constexpr int64_t BYTES = lane_group_bytes(KIND);
  constexpr int K = 32 / S;  // codes per product
  constexpr int SLOTS = 4 / S, AHEAD = SLOTS - 1;
  const int64_t groups = xq.groups, count = groups * S;
  const GroupMajorRows<R, S> rows(xq, r0);
  alignas(64) uint8_t unpacked[SLOTS][512];
  alignas(64) int32_t sums[SLOTS][S][R * 16];
  // tiles 0-3: sums (a slot's, or with S = 2 a slot's two halves); 4-5 x's codes; 6-7 weight codes
  TileConfig config;
  for (int t = 0; t < 4; ++t) config.rows[t] = R, config.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) config.rows[t] = R, config.colsb[t] = K;
  for (int t = 6; t < 8; ++t) config.rows[t] = K / 4, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  // a group's 4- or 5-bit codes as bytes: rows 0-3 the codes 4m.. (low nibbles), 4-7 the codes 16 + 4m..
  auto weight_bytes = [&](const uint8_t* pg, uint8_t* out) __attribute__((always_inline)) {
    if constexpr (KIND == KIND_Q8) return pg;
    for (int m = 0; m < 4; ++m) {
      __m512i lo, hi;
      zmm_lane_codes<KIND>(pg, m, lo, hi);
      _mm512_store_si512(out + 64 * m, lo);
      _mm512_store_si512(out + 256 + 64 * m, hi);
    }
    return static_cast<const uint8_t*>(out);
  };
  const auto* x = reinterpret_cast<const uint8_t*>(rows.codes(0, 0));  // group g's rows at x + g * R * 32
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* p = w.codes + b * groups * BYTES;
    const float* s = w.scales + b * count * 16;
    const float* z = w.zeros ? w.zeros + b * count * 16 : nullptr;
    auto products = [&](int64_t g) __attribute__((always_inline)) {
      const uint8_t* pg = p + g * BYTES;
      for (int64_t i = 0; i < BYTES; i += 64) _mm_prefetch(reinterpret_cast<const char*>(pg + LANE_PREFETCH_BYTES + i), _MM_HINT_T0);
      const int slot = static_cast<int>(g % SLOTS);
      const uint8_t* wb = weight_bytes(pg, unpacked[slot]);
      const uint8_t* xg = x + g * R * 32;
      int32_t* out = sums[slot][0];
      tile_memory_barrier();
      if constexpr (S == 1) {
        switch (slot) {
          case 0: TILE_PRODUCT(0, 4, 6, xg, wb, out); break;
          case 1: TILE_PRODUCT(1, 5, 7, xg, wb, out); break;
          case 2: TILE_PRODUCT(2, 4, 6, xg, wb, out); break;
          default: TILE_PRODUCT(3, 5, 7, xg, wb, out); break;
        }
      } else if (slot == 0) {
        TILE_PRODUCT(0, 4, 6, xg, wb, out);
        TILE_PRODUCT(1, 5, 7, xg + 16, wb + 256, sums[0][1]);
      } else {
        TILE_PRODUCT(2, 4, 6, xg, wb, out);
        TILE_PRODUCT(3, 5, 7, xg + 16, wb + 256, sums[1][1]);
      }
      tile_memory_barrier();
    };
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < AHEAD && g < groups; ++g) products(g);
    for (int64_t g = 0; g < groups; ++g) {
      if (g + AHEAD < groups) products(g + AHEAD);
      const auto& sum = sums[g % SLOTS];
      if constexpr (S == 1) {
        const __m512 ws = _mm512_loadu_ps(s + g * 16);
        for (int r = 0; r < R; ++r) {
          __m512i total = _mm512_load_si512(sum[0] + 16 * r);
          if constexpr (KIND == KIND_Q8) total = _mm512_add_epi32(_mm512_set1_epi32(rows.start(g, 0, r)), total);
          const __m512 d = _mm512_set1_ps(rows.d(g, r));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws, d), _mm512_cvtepi32_ps(total), acc[r]);
        }
      } else {
        const __m512 ws_a = _mm512_loadu_ps(s + g * 32), ws_b = _mm512_loadu_ps(s + g * 32 + 16);
        for (int r = 0; r < R; ++r) {
          const __m512i a = _mm512_add_epi32(_mm512_set1_epi32(rows.start(g, 0, r)), _mm512_load_si512(sum[0] + 16 * r));
          const __m512i e = _mm512_add_epi32(_mm512_set1_epi32(rows.start(g, 1, r)), _mm512_load_si512(sum[1] + 16 * r));
          const __m512 d = _mm512_set1_ps(rows.d(g, r));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws_a, d), _mm512_cvtepi32_ps(a), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws_b, d), _mm512_cvtepi32_ps(e), acc[r]);
        }
      }
      if (z) {  // as in the dpbusd tile
        for (int h = 0; h < S; ++h) {
          const __m512 wz = _mm512_loadu_ps(z + (g * S + h) * 16);
          for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wz, _mm512_set1_ps(rows.zero_sum(g, h, r)), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy + b * 16, acc[r]);
  }
  _tile_release();
}
#endif
#else
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

// AVX2: the same layout, each 64-byte register as two ymm halves (weight rows 0-7 and 8-15 of the block),
// taken one after the other. 4- and 5-bit codes: a group's eight maddubs add up in int16 (8 x 2 x 15 x 127
// < 32767 for 4-bit; 5-bit codes, up to 31, take a madd after each four), then one madd to int32; with
// AVX-VNNI, dpbusd chains as above. int8 codes (+ 128: maddubs' pairs could overflow int16) take their
// sign back, and meet x as |w| and x with w's sign, a madd per register; with AVX-VNNI, dpbusd.
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
      const float* s = w.scales + b * count * 16 + 8 * half;
      const float* z = w.zeros ? w.zeros + b * count * 16 + 8 * half : nullptr;
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* pg = p + g * BYTES;
        if (half == 0)
          for (int64_t i = 0; i < BYTES; i += 64) _mm_prefetch(reinterpret_cast<const char*>(pg + LANE_PREFETCH_BYTES + i), _MM_HINT_T0);
        if constexpr (KIND == KIND_Q8) {
          const __m256 ws_a = _mm256_loadu_ps(s + g * S * 16), ws_b = S == 2 ? _mm256_loadu_ps(s + g * S * 16 + 16) : ws_a;
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
          const __m256 ws = _mm256_loadu_ps(s + g * 16);
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
          const __m256 ws = _mm256_loadu_ps(s + g * 16);
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
        if (z) {
          for (int h = 0; h < S; ++h) {
            const __m256 wz = _mm256_loadu_ps(z + (g * S + h) * 16);
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
#endif

// Rows of x per pass over a lane-form weight: a verify of up to 16 rows (a draft of 15) reads the weights
// once; at 8 a ninth row paid a second pass, nearly a step (the 9-row times below against 8 rows'
// 6.69 / 12.62 ms native and 15.42 / 27.99 ms x86-64-v3, same runs). zmm: 16 accumulators and 8 registers of codes
// in 32; ymm: spilled, as at 8, and still fewer passes. 2-vCPU AMD EPYC, one thread, 9 / 12 / 16 rows
// (benchmarks/activations.py, ms): native (avx512_vnni) SmolLM2 8.37 / 9.87 / 11.72 -> 6.95 / 8.38 /
// 10.41, Gemma 3 19.13 / 20.66 / 23.25 -> 13.32 / 15.42 / 18.14; x86-64-v3 (avx2, fma, f16c) SmolLM2
// 17.93 / 22.77 / 29.25 -> 15.73 / 20.34 / 26.40, Gemma 3 36.12 / 43.27 / 54.48 -> 29.73 / 41.14 / 55.42 (no gain at 16 there).
constexpr int LANE_MAX_TILE = 16;

#if !defined(INT8_AMX)
template <int KIND, int S, int R>
static void amx_lane_tile(const LaneWeights&, const QuantizedRows&, int64_t, float*, int64_t, int64_t, int64_t) {}
#endif

template <int KIND, int S>
static void lane_matmul(const LaneWeights& w, const QuantizedRows& xq, float* y, int64_t n_out) {
  const int amx_from = amx_min_rows.load(std::memory_order_relaxed);
  at::parallel_for(0, n_out / 16, 1, [&](int64_t b0, int64_t b1) {
    over_row_tiles<LANE_MAX_TILE>(xq.rows, [&](auto row_count, int64_t r) {
      constexpr int R = decltype(row_count)::value;
      if (amx_from && R >= amx_from) amx_lane_tile<KIND, S, R>(w, xq, r, y + r * n_out, n_out, b0, b1);
      else lane_tile<KIND, S, R>(w, xq, r, y + r * n_out, n_out, b0, b1);
    });
  });
}

// lanes: the lane form's tensors (codes, scales, zeros or empty)
static void run_lane_matmul(int64_t kind, int64_t group, const std::vector<torch::Tensor>& lanes, const float* x,
                            int64_t rows, int64_t k, float* y, int64_t n_out) {
  TORCH_CHECK(lanes.size() == 3 && n_out % 16 == 0, "linear: a lane form is 3 tensors over a multiple of 16 rows");
  QuantizedRows xq;
  quantize_rows(x, rows, k, xq);
  const LaneWeights w{lanes[0].data_ptr<uint8_t>(), lanes[1].data_ptr<float>(), held(lanes[2])};
  if (kind == KIND_Q4) return lane_matmul<KIND_Q4, 1>(w, xq, y, n_out);
  if (kind == KIND_Q5) return lane_matmul<KIND_Q5, 1>(w, xq, y, n_out);
  TORCH_CHECK(kind == KIND_Q8 && (group == 32 || group == 16), "linear: no lane tile for kind ", kind);
  if (group == 32) lane_matmul<KIND_Q8, 1>(w, xq, y, n_out);
  else lane_matmul<KIND_Q8, 2>(w, xq, y, n_out);
}
#else
constexpr bool HAS_LANE_TILES = false;
static void run_lane_matmul(int64_t, int64_t, const std::vector<torch::Tensor>&, const float*, int64_t, int64_t,
                            float*, int64_t) {
  TORCH_CHECK(false, "linear: this build has no lane tiles");
}
#endif

// Whether quantized weights meet int8 activations (above) or float32 ones: one setting per process,
// chosen by the CPU backend (`-o backend.activations`), read by every linear call. int8 is the default
// where it was measured faster for every row count (1-512): AVX2 without AVX-512 (the float kernels lack
// a table lookup and half the width) and AVX512-VNNI; AVX-512 without VNNI keeps float32.
#if (defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)) || defined(INT8_VNNI512)
constexpr bool PREFERS_INT8 = true;
#else
constexpr bool PREFERS_INT8 = false;
#endif
static std::atomic<bool> int8_activations{PREFERS_INT8};

static void set_int8_activations(bool on) {
  TORCH_CHECK(!on || HAS_INT8_KERNELS, "int8 activations need a CPU with AVX2 (this build has no int8 kernels)");
  int8_activations.store(on, std::memory_order_relaxed);
}

// Prompts: many rows of x. Four weight rows are dequantized once into a float panel (for every row of x,
// not once per tile), then 4 x 4 blocks of dot products run at the FMA units' pace, and a shuffle tree
// turns the block's 16 accumulators into 16 sums at once. The sums come in another order than the
// per-row kernel's, so only calls marked `prompt` take this path: a verify pass, of any length, must give
// each row the bits a one-row call gives it. Below 12 rows the tiles' repeated dequantization costs less
// than the panel's stores (measured on both real models' layers).
constexpr int64_t PROMPT_PANEL_MIN_ROWS = 12;

#if defined(__AVX512F__)
template <int... I>
static inline v16f pick(v16f a, v16f b) { return __builtin_shufflevector(a, b, I...); }

// v[0..15] -> one vector whose lane i is the sum of v[i]'s lanes
static inline v16f sum16(v16f* v) {
  v16f c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)
    c[i] = pick<0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23>(v[2 * i], v[2 * i + 1]) +
           pick<8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31>(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i)
    d[i] = pick<0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27>(c[2 * i], c[2 * i + 1]) +
           pick<4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31>(c[2 * i], c[2 * i + 1]);
  for (int i = 0; i < 2; ++i)
    e[i] = pick<0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29>(d[2 * i], d[2 * i + 1]) +
           pick<2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31>(d[2 * i], d[2 * i + 1]);
  return pick<0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30>(e[0], e[1]) +
         pick<1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31>(e[0], e[1]);
}

template <class W>
static void panel_matmul(const W& w, int64_t groups, const float* x, int64_t rows, int64_t k, float* y,
                         int64_t n_out) {
  at::parallel_for(0, (n_out + 3) / 4, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> panel(4 * k);
    RowReader<W> row{w, groups};
    for (int64_t blk = b0; blk < b1; ++blk) {
      int64_t n = blk * 4, cols = std::min<int64_t>(4, n_out - n);
      for (int64_t c = 0; c < 4; ++c) {
        float* pc = panel.data() + c * k;
        if (c >= cols) { std::fill(pc, pc + k, 0.0f); continue; }
        row.start(n + c);
        for (int64_t g = 0; g < groups; ++g) {
          v16f a, b;
          row.group(n + c, g, a, b);
          store16(pc + g * 32, a);
          store16(pc + g * 32 + 16, b);
        }
      }
      const float* p = panel.data();
      for (int64_t r = 0; r < rows; r += 4) {
        const float* xr[4];
        for (int i = 0; i < 4; ++i) xr[i] = x + std::min<int64_t>(r + i, rows - 1) * k;
        v16f acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = v16f{};
        for (int64_t e = 0; e < k; e += 16) {
          v16f p0 = load16(p + e), p1 = load16(p + k + e), p2 = load16(p + 2 * k + e), p3 = load16(p + 3 * k + e);
          for (int i = 0; i < 4; ++i) {
            v16f xv = load16(xr[i] + e);
            acc[4 * i] = acc[4 * i] + p0 * xv;
            acc[4 * i + 1] = acc[4 * i + 1] + p1 * xv;
            acc[4 * i + 2] = acc[4 * i + 2] + p2 * xv;
            acc[4 * i + 3] = acc[4 * i + 3] + p3 * xv;
          }
        }
        float sums[16];
        store16(sums, sum16(acc));
        for (int i = 0; i < 4 && r + i < rows; ++i)
          for (int c = 0; c < cols; ++c) y[(r + i) * n_out + n + c] = sums[4 * i + c];
      }
    }
  });
}
#endif

#if !defined(__AVX512F__)
// Without AVX-512 there is no panel kernel, and a long prompt through the row tiles ran 10x slower than
// torch's float32 BLAS (AVX2 EPYC, SmolLM2, 213 rows: 14 s vs 1.2 s). A prompt is compute bound, so
// blocks of weight rows are dequantized to float32 and BLAS multiplies them; prompt rows need not match
// one-row calls bit for bit (see panel_matmul), and every prompt call takes this same path.
constexpr int64_t BLAS_BLOCK_ROWS = 1024;

template <typename W>
static void blas_prompt_matmul(const W& w, int64_t groups, const float* x, int64_t rows, int64_t k, float* y,
                               int64_t n_out) {
  auto xt = torch::from_blob(const_cast<float*>(x), {rows, k}, torch::kFloat32);
  auto yt = torch::from_blob(y, {rows, n_out}, torch::kFloat32);
  torch::Tensor block = torch::empty({std::min(BLAS_BLOCK_ROWS, n_out), k}, torch::kFloat32);
  float* bp = block.data_ptr<float>();
  for (int64_t n0 = 0; n0 < n_out; n0 += BLAS_BLOCK_ROWS) {
    const int64_t nb = std::min(BLAS_BLOCK_ROWS, n_out - n0);
    at::parallel_for(0, nb, 16, [&](int64_t a, int64_t b) {
      RowReader<W> row{w, groups};
      for (int64_t i = a; i < b; ++i) {
        row.start(n0 + i);
        for (int64_t g = 0; g < groups; ++g) {
          v16f lo, hi;
          row.group(n0 + i, g, lo, hi);
          store16(bp + i * k + g * 32, lo);
          store16(bp + i * k + g * 32 + 16, hi);
        }
      }
    });
    yt.narrow(1, n0, nb).copy_(at::mm(xt, block.narrow(0, 0, nb).t()));
  }
}
#endif

static void run_matmul(int64_t kind, const torch::Tensor& codes, const torch::Tensor& scales,
                       const torch::Tensor& zeros, int64_t group, int64_t groups, const float* x, int64_t rows,
                       int64_t k, float* y, int64_t n_out, bool prompt, const std::vector<torch::Tensor>& lanes) {
  // int8 activations take every row, prompt rows too: a prefill then gives each row the bits a single
  // step would, so replaying a sequence from scratch agrees with decoding it (as float32 nearly does)
  const bool int8 = int8_activations.load(std::memory_order_relaxed);
  if (int8 && !lanes.empty()) return run_lane_matmul(kind, group, lanes, x, rows, k, y, n_out);
  TORCH_CHECK(codes.numel() || kind == KIND_F32, "linear: this weight is held in its lane form only (for int8 "
              "activations); PackedLinear.hold_rows() gives it its row form back");
  if (int8 && run_int8_matmul(kind, codes, scales, zeros, group, x, rows, k, y, n_out)) return;
  with_format(kind, codes, scales, zeros, group, k, [&](const auto& w) {
#if defined(__AVX512F__)
    if (prompt && rows >= PROMPT_PANEL_MIN_ROWS) return panel_matmul(w, groups, x, rows, k, y, n_out);
#else
    if (prompt && rows >= PROMPT_PANEL_MIN_ROWS) return blas_prompt_matmul(w, groups, x, rows, k, y, n_out);
#endif
    matmul(w, groups, x, rows, k, y, n_out);
  });
}

// Post steps (see linear): columns per block of a row split across threads, and the output size below
// which they stay on the calling thread.
constexpr int64_t POST_BLOCK = 16384, POST_PARALLEL_MIN = 32768;

// y = post(W @ pre(x)). pre: rms_norm with in_norm, then act(gate) * up over the two halves of x.
// post: rms_norm with out_norm, then + residual, then softcap. kind: see with_format. zeros may be
// empty (int8 only). prompt: the rows need not match one-row calls bit for bit (see panel_matmul).
torch::Tensor linear(torch::Tensor x, int64_t kind, torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros,
                     int64_t group, int64_t n_out, int64_t k, c10::optional<torch::Tensor> in_norm, double eps,
                     int64_t act, c10::optional<torch::Tensor> residual, c10::optional<torch::Tensor> out_norm,
                     double softcap, bool prompt, const std::vector<torch::Tensor>& lanes) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "linear: x must be contiguous float32");
  TORCH_CHECK(k % 32 == 0, "linear: K must be a multiple of 32");
  int64_t rows = x.numel() / x.size(-1);
  const float* xin = x.data_ptr<float>();
  int64_t width = act != ACT_NONE ? 2 * k : k;
  TORCH_CHECK(x.size(-1) == width, "linear: x has ", x.size(-1), " columns, the weight needs ", width);
  std::vector<float> normed, prepared;
  if (in_norm.has_value()) {
    TORCH_CHECK(in_norm->numel() == width && in_norm->is_contiguous(), "linear: in_norm must have ", width, " values");
    normed.resize(rows * width);
    for (int64_t r = 0; r < rows; ++r)
      rms_norm_row(xin + r * width, in_norm->data_ptr<float>(), static_cast<float>(eps), width, normed.data() + r * width);
    xin = normed.data();
  }
  if (act != ACT_NONE) {
    prepared.resize(rows * k);
    for (int64_t r = 0; r < rows; ++r) glu_row(xin + r * 2 * k, k, static_cast<int>(act), prepared.data() + r * k);
    xin = prepared.data();
  }
  if (residual.has_value())
    TORCH_CHECK(residual->is_contiguous() && residual->scalar_type() == torch::kFloat32 &&
                residual->numel() == rows * n_out, "linear: residual must be contiguous float32 [rows, n_out]");
  auto shape = x.sizes().vec();
  shape.back() = n_out;
  torch::Tensor y = torch::empty(shape, x.options());
  float* out = y.data_ptr<float>();
  int64_t groups = k / 32;
  run_matmul(kind, codes, scales, zeros, group, groups, xin, rows, k, out, n_out, prompt, lanes);
  if (out_norm.has_value() || residual.has_value() || softcap > 0) {
    const float* res = residual.has_value() ? residual->data_ptr<float>() : nullptr;
    // Without a norm the steps are elementwise, so a row may be split into blocks of columns (a multiple
    // of 16 wide: each element takes the vector or scalar path it takes in a whole-row pass), and Gemma's
    // 262k-wide softcapped head row runs on every thread. A small output stays on this thread: waking
    // the others costs more than the steps.
    const int64_t block = out_norm.has_value() ? n_out : POST_BLOCK;
    const int64_t per_row = (n_out + block - 1) / block;
    auto post = [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        int64_t r = b / per_row, c0 = (b % per_row) * block, c1 = std::min(n_out, c0 + block);
        float* yr = out + r * n_out;
        if (out_norm.has_value()) rms_norm_row(yr, out_norm->data_ptr<float>(), static_cast<float>(eps), n_out, yr);
        if (res) for (int64_t i = c0; i < c1; ++i) yr[i] = res[r * n_out + i] + yr[i];
        if (softcap > 0) softcap_row(yr + c0, c1 - c0, static_cast<float>(softcap));
      }
    };
    if (rows * n_out < POST_PARALLEL_MIN) post(0, rows * per_row);
    else at::parallel_for(0, rows * per_row, 1, post);
  }
  return y;
}

// Rows `rows` of a weight, dequantized to float32 [len(rows), K] (the token embedding of a tied head).
torch::Tensor dequantize_rows(torch::Tensor rows, int64_t kind, torch::Tensor codes, torch::Tensor scales,
                              torch::Tensor zeros, int64_t group, int64_t k) {
  auto idx = rows.to(torch::kInt64).contiguous();
  int64_t n = idx.numel();
  torch::Tensor out = torch::empty({n, k}, torch::dtype(torch::kFloat32));
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < codes.size(0), "dequantize_rows: row ", ip[i], " out of range");
  float* op = out.data_ptr<float>();
  auto rows_of = [&](const auto& w) {
    RowReader<std::decay_t<decltype(w)>> row{w, k / 32};
    for (int64_t i = 0; i < n; ++i) {
      row.start(ip[i]);
      for (int64_t g = 0; g < k / 32; ++g) {
        v16f a, b;
        row.group(ip[i], g, a, b);
        store16(op + i * k + g * 32, a);
        store16(op + i * k + g * 32 + 16, b);
      }
    }
  };
  with_format(kind, codes, scales, zeros, group, k, rows_of);
  return out;
}

// Rows `rows` of a weight held in its lane form (see "Lane tiles"), back in the row form: codes, scales
// and zeros as PackedLinear holds them, for the row lookups of an embedding and for float32 activations.
std::vector<torch::Tensor> lane_rows(torch::Tensor rows, int64_t kind, std::vector<torch::Tensor> lanes, int64_t group,
                                     int64_t k) {
  TORCH_CHECK(lanes.size() == 3 && (kind == KIND_Q4 || kind == KIND_Q5 || kind == KIND_Q8),
              "lane_rows: a lane form is 3 tensors of a 4-, 5- or 8-bit weight");
  auto idx = rows.to(torch::kInt64).contiguous();
  const int64_t n = idx.numel(), groups = k / 32, count = groups * (kind == KIND_Q8 ? 32 / group : 1);
  const int64_t lane_bytes = lane_group_bytes(kind);
  const int64_t row_bytes = kind == KIND_Q4 ? 16 : kind == KIND_Q5 ? 20 : 32;
  const int64_t blocks = lanes[1].numel() / (count * 16);
  torch::Tensor codes = torch::empty({n, groups * row_bytes}, torch::dtype(kind == KIND_Q8 ? torch::kInt8 : torch::kUInt8));
  torch::Tensor scales = torch::empty({n, count}, torch::dtype(torch::kFloat32));
  torch::Tensor zeros = lanes[2].numel() ? torch::empty({n, count}, torch::dtype(torch::kFloat32)) : torch::empty({0});
  const uint8_t* lc = lanes[0].data_ptr<uint8_t>();
  const float *ls = lanes[1].data_ptr<float>(), *lz = lanes[2].numel() ? lanes[2].data_ptr<float>() : nullptr;
  uint8_t* out = static_cast<uint8_t*>(codes.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = idx.data_ptr<int64_t>()[i], b = row / 16, j = row % 16;
    TORCH_CHECK(row >= 0 && b < blocks, "lane_rows: row ", row, " out of range");
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = lc + (b * groups + g) * lane_bytes;
      uint8_t* o = out + (i * groups + g) * row_bytes;
      if (kind == KIND_Q8) {
        for (int c = 0; c < 32; ++c) o[c] = p[64 * (c / 4) + 4 * j + c % 4] ^ 0x80;
        continue;
      }
      for (int c = 0; c < 16; ++c) o[c] = p[64 * (c / 4) + 4 * j + c % 4];
      if (kind == KIND_Q5) {
        uint32_t word = 0;  // bit c: code c's bit 4
        for (int c = 0; c < 32; ++c) {
          uint64_t mask;
          std::memcpy(&mask, p + 256 + 32 * (c / 16) + 8 * ((c % 16) / 4), 8);
          word |= static_cast<uint32_t>((mask >> (4 * j + c % 4)) & 1) << c;
        }
        std::memcpy(o + 16, &word, 4);
      }
    }
    for (int64_t c = 0; c < count; ++c) {
      scales.data_ptr<float>()[i * count + c] = ls[(b * count + c) * 16 + j];
      if (lz) zeros.data_ptr<float>()[i * count + c] = lz[(b * count + c) * 16 + j];
    }
  }
  return {codes, scales, zeros};
}

// -------------------------------------------------------------------------------------- attention

// Rotary (NEOX half split) with full-width tables: out = x * cos + roll(x, d/2) * sin, where sin holds
// -sin in its first half (see layers.Rotary).
static void rope_row(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

constexpr int64_t KEY_BLOCK = 64;  // positions per pass over a query; the cache is padded to a multiple

// Where the key of position j, dimension e sits in a kv head's keys: blocks of KEY_BLOCK positions, each
// [D, KEY_BLOCK] (transposed), so 16 positions of one dimension are one vector and a block is one read.
static inline int64_t key_offset(int64_t d, int64_t e, int64_t j) {
  return (j / KEY_BLOCK) * KEY_BLOCK * d + e * KEY_BLOCK + j % KEY_BLOCK;
}

#if defined(__AVX512F__)
constexpr int64_t MAX_SHARED_HEADS = 4;  // heads that read a key block together: 4 x 4 score chains in 32 registers
#else
constexpr int64_t MAX_SHARED_HEADS = 1;  // 16 ymm registers hold one head's four chains (of two halves each)
#endif

struct AttendArgs {
  const float* src;  // qkv
  const float* kc;   // keys [G, Lpad / KEY_BLOCK, D, KEY_BLOCK]
  const float* vc;   // values [G, L, D]
  const float *cs, *sn, *qn;
  float eps;
  int64_t width, d, k_len, v_len, window;
  float scale;
  int64_t scores_len;  // per head in a work item's scores buffer: the positions this call reaches
};

// Q heads h0..h0+Q-1 of token t (at position p), all of kv group g: each head's scores, softmax and
// weighted values are the same float operations, in the same order, as if it were computed alone.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// Scores of one query over keys j .. j + 8 CHAINS - 1 (within one key block), each a sum over e in order
template <int CHAINS>
static inline void ymm_scores(const float* keys, const float* q, int64_t d, int64_t j, float* out) {
  __m256 s[CHAINS];
  for (int b = 0; b < CHAINS; ++b) s[b] = _mm256_setzero_ps();
  for (int64_t e = 0; e < d; ++e) {
    const float* row = keys + key_offset(d, e, j);
    const __m256 qe = _mm256_set1_ps(q[e]);
    for (int b = 0; b < CHAINS; ++b) s[b] = _mm256_fmadd_ps(qe, _mm256_loadu_ps(row + 8 * b), s[b]);
  }
  for (int b = 0; b < CHAINS; ++b) _mm256_storeu_ps(out + 8 * b, s[b]);
}

// f(std::integral_constant<int, N>{}) for n = N = 2, 4, 6 or 8 ymm chains (16-float steps: n is even). The
// count is a template argument: a test of it per position and chain cost 10% of attention in an 8-row
// verify (x86-64-v3 build: avx2, fma, f16c; 2-vCPU AMD EPYC; perf)
template <class F>
static inline void with_chains(int64_t n, F&& f) {
  switch (n) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 2>{}); break;
  }
}

// out[e0 .. e0 + 8 CHAINS) = inv x the sum over positions first..p of score x value, in that order
template <int CHAINS>
static inline void ymm_weighted_values(const float* values, const float* scores, int64_t first, int64_t p, int64_t d,
                                       int64_t e0, float inv, float* out) {
  __m256 acc[CHAINS];
  for (int b = 0; b < CHAINS; ++b) acc[b] = _mm256_setzero_ps();
  for (int64_t j = first; j <= p; ++j) {
    const float* v = values + j * d + e0;
    const __m256 weight = _mm256_set1_ps(scores[j]);
    for (int b = 0; b < CHAINS; ++b) acc[b] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * b), acc[b]);
  }
  const __m256 scale = _mm256_set1_ps(inv);
  for (int b = 0; b < CHAINS; ++b) _mm256_storeu_ps(out + e0 + 8 * b, _mm256_mul_ps(acc[b], scale));
}
#endif

template <int Q>
static void attend_heads(const AttendArgs& a, int64_t t, int64_t p, int64_t h0, int64_t g, float* scores_buf,
                         float* out) {
  const int64_t d = a.d, k_len = a.k_len;
  float normed[1024], q[Q][1024];
  float* scores[Q];
  for (int c = 0; c < Q; ++c) {
    const float* qsrc = a.src + t * a.width + (h0 + c) * d;
    if (a.qn) { rms_norm_row(qsrc, a.qn, a.eps, d, normed); qsrc = normed; }
    rope_row(qsrc, a.cs + p * d, a.sn + p * d, d, q[c]);
    for (int64_t e = 0; e < d; ++e) q[c][e] *= a.scale;
    scores[c] = scores_buf + c * a.scores_len;
  }
  int64_t first = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
  // whole blocks of keys from the first one the window reaches (the positions before it are masked
  // below), then whole vectors up to p
  int64_t begin = first / KEY_BLOCK * KEY_BLOCK, end = (p + 1 + 15) / 16 * 16;
  const float* keys = a.kc + g * d * k_len;
  // scores of 64 positions at a time: four chains per head, each a sum over e in order
  int64_t j = begin;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  // GCC moved the 64-byte vectors of the loops after #else through the stack on AVX2 (a quarter of a
  // decode step; x86-64-v3 build (avx2, fma, f16c), perf): the same sums, one head at a time, in eight
  // ymm chains
  for (; j + KEY_BLOCK <= end; j += KEY_BLOCK)
    for (int c = 0; c < Q; ++c) ymm_scores<8>(keys, q[c], d, j, &scores[c][j]);
  if (j < end) {  // the last 16, 32 or 48 keys (one block's): the v16f loop kept its sums on the stack
    // here too (16% of attention in an 8-row verify, same build and machine, perf)
    with_chains((end - j) / 8, [&](auto chains) {
      for (int c = 0; c < Q; ++c) ymm_scores<decltype(chains)::value>(keys, q[c], d, j, &scores[c][j]);
    });
  }
#else
  for (; j + KEY_BLOCK <= end; j += KEY_BLOCK) {
    v16f s[Q][4] = {};
    for (int64_t e = 0; e < d; ++e) {
      const float* row = keys + key_offset(d, e, j);
      v16f k0 = load16(row), k1 = load16(row + 16), k2 = load16(row + 32), k3 = load16(row + 48);
      for (int c = 0; c < Q; ++c) {
        v16f qe = splat(q[c][e]);
        s[c][0] = s[c][0] + qe * k0;
        s[c][1] = s[c][1] + qe * k1;
        s[c][2] = s[c][2] + qe * k2;
        s[c][3] = s[c][3] + qe * k3;
      }
    }
    for (int c = 0; c < Q; ++c)
      for (int b = 0; b < 4; ++b) store16(&scores[c][j + 16 * b], s[c][b]);
  }
  for (; j < end; j += 16) {
    v16f s[Q] = {};
    for (int64_t e = 0; e < d; ++e) {
      v16f k0 = load16(keys + key_offset(d, e, j));
      for (int c = 0; c < Q; ++c) s[c] = s[c] + splat(q[c][e]) * k0;
    }
    for (int c = 0; c < Q; ++c) store16(&scores[c][j], s[c]);
  }
#endif
  float inv[Q];
  for (int c = 0; c < Q; ++c) {
    float* sc = scores[c];
    for (int64_t x = begin; x < first; ++x) sc[x] = -INFINITY;
    for (int64_t x = p + 1; x < end; ++x) sc[x] = -INFINITY;
    vew mx = vew{} - INFINITY;
    for (j = begin; j < end; j += EW_LANES) { vew v = load_ew(&sc[j]); mx = v > mx ? v : mx; }
    float m = hmax(mx);
    // the sum over positions as 16 lanes (lane i: positions begin + i + 16 n), then hsum's tree: the
    // same sum at either width
    vew total[16 / EW_LANES] = {};
    for (j = begin; j < end; j += 16)
      for (int h = 0; h < 16 / EW_LANES; ++h) {
        vew v = load_ew(&sc[j + h * EW_LANES]);
        vew e = vexp(v - m);
        e = v > -INFINITY ? e : vew{};
        store_ew(&sc[j + h * EW_LANES], e);
        total[h] = total[h] + e;
      }
    v16f total16;
    std::memcpy(&total16, total, sizeof total16);
    inv[c] = 1.0f / hsum(total16);
  }
  const float* values = a.vc + g * a.v_len * d;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  for (int c = 0; c < Q; ++c)
    for (int64_t e0 = 0; e0 < d; e0 += 64) {
      with_chains(std::min<int64_t>(8, (d - e0) / 8), [&](auto chains) {  // d is a multiple of 16
        ymm_weighted_values<decltype(chains)::value>(values, scores[c], first, p, d, e0, inv[c], out + c * d);
      });
    }
#else
  for (int64_t e0 = 0; e0 < d; e0 += 64) {
    int64_t chunks = std::min<int64_t>(4, (d - e0) / 16);
    v16f acc[Q][4] = {};
    for (j = first; j <= p; ++j) {
      const float* v = values + j * d + e0;
      for (int b = 0; b < 4; ++b) {
        if (b >= chunks) break;
        v16f vb = load16(v + 16 * b);
        for (int c = 0; c < Q; ++c) acc[c][b] = acc[c][b] + splat(scores[c][j]) * vb;
      }
    }
    for (int c = 0; c < Q; ++c)
      for (int b = 0; b < chunks; ++b) store16(out + c * d + e0 + 16 * b, acc[c][b] * inv[c]);
  }
#endif
}

// Where a layer's keys and values come from (Gemma 4 adds the last two).
enum KVMode { KV_OWN = 0, KV_K_IS_V = 1, KV_SHARED = 2 };

// qkv [T, (H + 2 G) * D]: queries, keys, values of T tokens at positions start..start+T-1. Normalizes
// (q_norm, k_norm) and rotates q and k, writes k into the cache of keys [G, Lpad / 64, D, 64] (blocks of
// 64 positions, each held transposed) and v
// into the values [G, L, D] at those positions, and returns attention [T, H * D] over positions
// [first, p] for the query at p, first = p - window + 1 with a window. Each (query, head) is computed
// alone, in the same order whatever T is. kv_mode KV_K_IS_V: qkv is [T, (H + G) * D] and the values are
// the keys as projected (before k_norm and rotary); KV_SHARED: qkv holds only the queries and the cache
// (another layer's) is read, not written. v_norm: the values are RMS-normed (without a weight) first.
torch::Tensor attend(torch::Tensor qkv, torch::Tensor k_cache, torch::Tensor v_cache, int64_t start, int64_t n_heads,
                     int64_t n_kv, int64_t d, torch::Tensor cos, torch::Tensor sin,
                     c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, double eps,
                     int64_t window, double scale, int64_t kv_mode, bool v_norm) {
  TORCH_CHECK(qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat32, "attend: qkv must be contiguous float32");
  TORCH_CHECK(d % 16 == 0 && d <= 1024, "attend: head_dim must be a multiple of 16, at most 1024");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "attend: caches must be contiguous");
  TORCH_CHECK(kv_mode >= KV_OWN && kv_mode <= KV_SHARED, "attend: unknown kv_mode ", kv_mode);
  int64_t t_len = qkv.size(0);
  int64_t width = (n_heads + (kv_mode == KV_OWN ? 2 : kv_mode == KV_K_IS_V ? 1 : 0) * n_kv) * d;
  TORCH_CHECK(qkv.size(1) == width, "attend: qkv has ", qkv.size(1), " columns, expected ", width);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == d && k_cache.size(3) == KEY_BLOCK,
              "attend: keys must be held in transposed blocks [kv_heads, blocks, head_dim, ", KEY_BLOCK, "]");
  int64_t k_len = k_cache.size(1) * KEY_BLOCK, v_len = v_cache.size(1);
  TORCH_CHECK(start + t_len <= v_len, "attend: positions past the end of the cache");
  const float* src = qkv.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  float epsf = static_cast<float>(eps);

  // keys and values into the cache first: a query attends to the block's earlier tokens too
  std::vector<float> ones(v_norm ? d : 0, 1.0f);
  for (int64_t t = 0; kv_mode != KV_SHARED && t < t_len; ++t) {
    int64_t p = start + t;
    for (int64_t g = 0; g < n_kv; ++g) {
      float normed[1024], rotated[1024];
      const float* k = src + t * width + (n_heads + g) * d;
      const float* v = kv_mode == KV_K_IS_V ? k : src + t * width + (n_heads + n_kv + g) * d;
      if (kn) { rms_norm_row(k, kn, epsf, d, normed); k = normed; }
      rope_row(k, cs + p * d, sn + p * d, d, rotated);
      for (int64_t e = 0; e < d; ++e) kc[g * d * k_len + key_offset(d, e, p)] = rotated[e];
      if (v_norm) rms_norm_row(v, ones.data(), epsf, d, vc + (g * v_len + p) * d);
      else std::memcpy(vc + (g * v_len + p) * d, v, d * sizeof(float));
    }
  }

  torch::Tensor out = torch::empty({t_len, n_heads * d}, qkv.options());
  float* op = out.data_ptr<float>();
  int64_t per_kv = n_heads / n_kv;
  // Work items: a token and up to MAX_SHARED_HEADS heads of one kv group, which read the same keys and
  // values together (independent chains, one load for all of them); fewer heads per item where that
  // would leave fewer than two items per thread.
  int64_t shared = std::min<int64_t>(MAX_SHARED_HEADS, per_kv);
  while (shared > 1 && t_len * n_kv * ((per_kv + shared - 1) / shared) < 2 * at::get_num_threads()) --shared;
  int64_t chunks_per_group = (per_kv + shared - 1) / shared;
  // Scores only up to the last position this call reaches, not the cache's length, and not zeroed:
  // every score read is written first. (Sized by the context, the buffer cost Gemma 3 a 512 KB memset
  // per layer.)
  int64_t scores_len = (start + t_len + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
  AttendArgs args{src, kc, vc, cs, sn, qn, epsf, width, d, k_len, v_len, window, static_cast<float>(scale), scores_len};
  at::parallel_for(0, t_len * n_kv * chunks_per_group, 1, [&](int64_t i0, int64_t i1) {
    std::unique_ptr<float[]> scores(new float[shared * scores_len]);
    for (int64_t i = i0; i < i1; ++i) {
      int64_t t = i / (n_kv * chunks_per_group), rest = i % (n_kv * chunks_per_group);
      int64_t g = rest / chunks_per_group, h0 = g * per_kv + (rest % chunks_per_group) * shared;
      int64_t heads = std::min<int64_t>(shared, (g + 1) * per_kv - h0);
      float* o = op + t * n_heads * d + h0 * d;
      switch (heads) {
        case 4: if constexpr (MAX_SHARED_HEADS >= 4) { attend_heads<4>(args, t, start + t, h0, g, scores.get(), o); } break;
        case 3: if constexpr (MAX_SHARED_HEADS >= 3) { attend_heads<3>(args, t, start + t, h0, g, scores.get(), o); } break;
        case 2: if constexpr (MAX_SHARED_HEADS >= 2) { attend_heads<2>(args, t, start + t, h0, g, scores.get(), o); } break;
        default: attend_heads<1>(args, t, start + t, h0, g, scores.get(), o); break;
      }
    }
  });
  return out;
}

// ------------------------------------------------------------------------------------ layer stack

// A model's transformer layers run in one call. Each layer is the same five calls a Python loop would
// make (fused q/k/v projection, attention, output projection, gate/up projection, down projection),
// with the same arguments, so the result is bit for bit the loop's; what goes is the Python and argument
// conversion around each of them: about 5% of SmolLM2's one-token step (measured).
// A linear as PackedLinear holds it; Python builds one by keyword (HeldLinear(kind=..., codes=..., ...)), so
// no field can take another's place.
struct HeldLinear {
  int64_t kind, group, n_out, k;
  torch::Tensor codes, scales, zeros;
  std::vector<torch::Tensor> lanes;  // the lane form, where the weight has one (PackedLinear.lanes)
  torch::Tensor operator()(const torch::Tensor& x, c10::optional<torch::Tensor> in_norm, double eps, int64_t act,
                           c10::optional<torch::Tensor> residual, c10::optional<torch::Tensor> out_norm,
                           bool prompt) const {
    return linear(x, kind, codes, scales, zeros, group, n_out, k, in_norm, eps, act, residual, out_norm, 0.0, prompt,
                  lanes);
  }
};

struct StackLayer {
  HeldLinear qkv, o, gate_up, down;
  c10::optional<torch::Tensor> attn_norm, q_norm, k_norm, post_attn_norm, ffn_norm, post_ffn_norm;
  torch::Tensor cos, sin;
  int64_t window;
  c10::optional<torch::Tensor> qkv_bias;  // Qwen2: added to the fused q/k/v rows as the projection's residual
  // Gemma 4 (LayerStack.gemma4): this layer's own shape, where its keys and values come from, the
  // per-layer input step after the FFN and the output scale. Unset: the stack's shape, its own cache.
  int64_t n_heads = 0, n_kv = 0, d = 0, kv_layer = -1, kv_mode = KV_OWN;
  bool v_norm = false, per_layer_input = false;
  HeldLinear inp_gate, inp_proj;
  c10::optional<torch::Tensor> inp_post_norm, out_scale;
};

class LayerStack {
 public:
  LayerStack(int64_t n_heads, int64_t n_kv, int64_t d, double eps, double scale, int64_t act)
      : n_heads_(n_heads), n_kv_(n_kv), d_(d), eps_(eps), scale_(scale), act_(act) {}

  // One layer (keyword arguments only, see the bindings); norms may be None.
  void add(const HeldLinear& qkv, const HeldLinear& o, const HeldLinear& gate_up, const HeldLinear& down,
           c10::optional<torch::Tensor> attn_norm,
           c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
           c10::optional<torch::Tensor> post_attn_norm, c10::optional<torch::Tensor> ffn_norm,
           c10::optional<torch::Tensor> post_ffn_norm, torch::Tensor cos, torch::Tensor sin, int64_t window,
           c10::optional<torch::Tensor> qkv_bias) {
    layers_.push_back({qkv, o, gate_up, down, attn_norm, q_norm, k_norm, post_attn_norm, ffn_norm, post_ffn_norm,
                       cos.contiguous(), sin.contiguous(), window});
    if (qkv_bias.has_value()) layers_.back().qkv_bias = qkv_bias->to(torch::kFloat32).contiguous();
  }

  // The last added layer as Gemma 4 has it: its own heads and head dim, the cache layer it reads
  // (kv_mode: see attend), values RMS-normed, then after the FFN optionally
  // x = proj(act(inp_gate(x)) * per_layer[:, i]) post-normed onto x, and x * out_scale.
  void gemma4(int64_t n_heads, int64_t n_kv, int64_t d, int64_t kv_layer, int64_t kv_mode,
              c10::optional<HeldLinear> inp_gate, c10::optional<HeldLinear> inp_proj,
              c10::optional<torch::Tensor> inp_post_norm, c10::optional<torch::Tensor> out_scale) {
    TORCH_CHECK(!layers_.empty(), "LayerStack.gemma4: add the layer first");
    StackLayer& l = layers_.back();
    l.n_heads = n_heads, l.n_kv = n_kv, l.d = d, l.kv_layer = kv_layer, l.kv_mode = kv_mode, l.v_norm = true;
    l.per_layer_input = inp_gate.has_value();
    TORCH_CHECK(inp_gate.has_value() == inp_proj.has_value(), "LayerStack.gemma4: inp_gate and inp_proj go together");
    if (l.per_layer_input) l.inp_gate = *inp_gate, l.inp_proj = *inp_proj;
    l.inp_post_norm = inp_post_norm, l.out_scale = out_scale;
  }

  // x [T, hidden] at positions start..start+T-1 through every layer; keys and values: the cache's
  // tensors, one per layer that has its own (see attend). per_layer: Gemma 4's [T, layers, size] inputs.
  torch::Tensor run(torch::Tensor x, int64_t start, const std::vector<torch::Tensor>& keys,
                    const std::vector<torch::Tensor>& values, bool prompt,
                    c10::optional<torch::Tensor> per_layer) const {
    size_t cache_layers = 0;
    for (size_t i = 0; i < layers_.size(); ++i)
      cache_layers = std::max(cache_layers, static_cast<size_t>(layers_[i].kv_layer >= 0 ? layers_[i].kv_layer : i) + 1);
    TORCH_CHECK(keys.size() == cache_layers && values.size() == cache_layers,
                "LayerStack.run: the cache has ", keys.size(), " layers, the model ", cache_layers);
    x = x.contiguous();
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      size_t kv = l.kv_layer >= 0 ? l.kv_layer : i;
      c10::optional<torch::Tensor> bias;
      if (l.qkv_bias.has_value()) bias = l.qkv_bias->expand({x.size(0), l.qkv_bias->size(0)}).contiguous();
      torch::Tensor qkv = l.qkv(x, l.attn_norm, eps_, ACT_NONE, bias, c10::nullopt, prompt);
      torch::Tensor a = attend(qkv, keys[kv], values[kv], start, l.n_heads ? l.n_heads : n_heads_,
                               l.n_kv ? l.n_kv : n_kv_, l.d ? l.d : d_, l.cos, l.sin, l.q_norm, l.k_norm, eps_,
                               l.window, scale_, l.kv_mode, l.v_norm);
      x = l.o(a, c10::nullopt, eps_, ACT_NONE, x, l.post_attn_norm, prompt);
      torch::Tensor gu = l.gate_up(x, l.ffn_norm, eps_, ACT_NONE, c10::nullopt, c10::nullopt, prompt);
      x = l.down(gu, c10::nullopt, eps_, act_, x, l.post_ffn_norm, prompt);
      if (l.per_layer_input) {
        TORCH_CHECK(per_layer.has_value(), "LayerStack.run: this model needs its per-layer inputs");
        torch::Tensor gate = l.inp_gate(x, c10::nullopt, eps_, ACT_NONE, c10::nullopt, c10::nullopt, prompt);
        torch::Tensor gate_in = torch::cat({gate, per_layer->select(1, static_cast<int64_t>(i))}, 1).contiguous();
        x = l.inp_proj(gate_in, c10::nullopt, eps_, act_, x, l.inp_post_norm, prompt);
      }
      if (l.out_scale.has_value()) x = x * *l.out_scale;
    }
    return x;
  }

 private:
  int64_t n_heads_, n_kv_, d_;
  double eps_, scale_;
  int64_t act_;
  std::vector<StackLayer> layers_;
};

// ---- One token from one row of logits ------------------------------------------------------------------
// The token `sample_at(warp(logits, params), u)` gives (outrider.spec.sampling: temperature, then top-k,
// top-p and min-p on the tempered distribution, then the inverse CDF in vocabulary order), without warping
// the whole vocabulary: a 262k-token row warped and summed in torch costs a third of a small model's decode
// step. Top-k and top-p keep a prefix of the row in rank order, and every token of it lies above a floor
// some depth below the largest logit: only those candidates are ranked, and only as far as the boundary of
// what is kept needs (the draw itself is in vocabulary order). Without those filters the draw sums exps
// per block of the row, then walks one block. Sums run in double over float exps, in another order than
// the reference's float32 ones: the two can differ only where rounding decides (u * total within rounding
// of a boundary between tokens, or a token's mass before it within rounding of top_p).
// Returns -1 where the reference must decide (NaN or infinite logits, a non-positive temperature).
namespace row_sampler {

constexpr int64_t BLOCK = 256;  // exps summed per block: after the block sums the walk touches one block
static_assert(BLOCK % EW_LANES == 0, "a block is whole vectors");
constexpr int64_t SORT_BELOW = 64;  // a range this small is ranked by sorting it whole

struct Candidate {
  float z;  // the tempered logit
  float e;  // exp(z - zmax)
  int32_t index;
};

// z descending, then index ascending: the order of a stable descending sort, as warp's top-k and top-p see it
static inline bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.z > b.z || (a.z == b.z && a.index < b.index);
}

static inline float exp_of(float z, float zmax) {
  vew lane = vew{} + (z - zmax);
  return vexp(lane)[0];  // the vector exp, so a token's exp is the same bits in every pass
}

static float row_max(const float* x, int64_t n, bool& finite) {
  vew m = vew{} - INFINITY, bad = {};
  int64_t i = 0;
  for (; i + EW_LANES <= n; i += EW_LANES) {
    vew v = load_ew(x + i);
    m = v > m ? v : m;
    bad = (v != v) | (v - v != 0) ? vew{} + 1.0f : bad;  // NaN, or an infinity (inf - inf is NaN)
  }
  float mx = hmax(m);
  finite = hmax(bad) == 0.0f;
  for (; i < n; ++i) {
    finite = finite && std::isfinite(x[i]);
    mx = x[i] > mx ? x[i] : mx;
  }
  return mx;
}

// Sums of exp(z - zmax) over z >= floor per block of the row; their total
static double block_sums(const float* x, int64_t n, float t, float zmax, float floor, std::vector<double>& sums) {
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  sums.assign(blocks, 0.0);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = b * BLOCK, end = std::min(n, start + BLOCK);
    vew acc = {};
    int64_t i = start;
    for (; i + EW_LANES <= end; i += EW_LANES) {
      vew z = load_ew(x + i) / t;
      vew e = vexp(z - zmax);
      acc += z >= floor ? e : vew{};
    }
    float lanes[EW_LANES];
    std::memcpy(lanes, &acc, sizeof lanes);
    double s = 0.0;
    for (int l = 0; l < EW_LANES; ++l) s += lanes[l];
    for (; i < end; ++i) {
      const float z = x[i] / t;
      if (z >= floor) s += exp_of(z, zmax);
    }
    sums[b] = s;
    total += s;
  }
  return total;
}

// The inverse CDF in vocabulary order over the tokens with z >= floor
static int64_t draw_by_blocks(const float* x, int64_t n, float t, float zmax, float floor, double u) {
  std::vector<double> sums;
  const double total = block_sums(x, n, t, zmax, floor, sums);
  if (!(total > 0.0)) return -1;
  const double target = u * total;
  double cum = 0.0;
  int64_t last_block = -1;
  for (int64_t b = 0; b < (int64_t)sums.size(); ++b) {
    if (sums[b] > 0.0) last_block = b;
    if (cum + sums[b] <= target) {
      cum += sums[b];
      continue;
    }
    int64_t last = -1;
    for (int64_t i = b * BLOCK, end = std::min(n, (b + 1) * BLOCK); i < end; ++i) {
      const float z = x[i] / t;
      if (!(z >= floor)) continue;
      last = i;
      cum += exp_of(z, zmax);
      if (cum > target) return i;
    }
    return last;  // rounding: the block's sum token by token fell short of its sum by vectors
  }
  for (int64_t i = std::min(n, (last_block + 1) * BLOCK) - 1; last_block >= 0 && i >= last_block * BLOCK; --i)
    if (x[i] / t >= floor) return i;  // u * total rounded up to total: the last token with nonzero probability
  return -1;
}

// The tokens with z >= floor, in no order, and their mass
static double collect(const float* x, int64_t n, float t, float zmax, float floor, std::vector<Candidate>& out) {
  out.clear();
  double mass = 0.0;
  int64_t i = 0;
  for (; i + EW_LANES <= n; i += EW_LANES) {
    vew z = load_ew(x + i) / t;
    if (hmax(z) < floor) continue;
    vew e = vexp(z - zmax);
    float zs[EW_LANES], es[EW_LANES];
    std::memcpy(zs, &z, sizeof zs);
    std::memcpy(es, &e, sizeof es);
    for (int l = 0; l < EW_LANES; ++l)
      if (zs[l] >= floor) {
        out.push_back({zs[l], es[l], (int32_t)(i + l)});
        mass += es[l];
      }
  }
  for (; i < n; ++i) {
    const float z = x[i] / t;
    if (z >= floor) {
      const float e = exp_of(z, zmax);
      out.push_back({z, e, (int32_t)i});
      mass += e;
    }
  }
  return mass;
}

// How many of `c` top-p keeps: token j (in rank order) is kept while the mass ranked before it is below
// `keep_below`; those are left first in `c`, in no order. The candidates' masses go into bins of z (a bin
// holds a run of the rank order), the bins are walked from the top to the one where the mass reaches
// `keep_below`, and only that bin is sorted.
static size_t keep_top_p(std::vector<Candidate>& c, double keep_below) {
  float top = -INFINITY, bottom = INFINITY;
  for (const Candidate& k : c) {
    top = std::max(top, k.z);
    bottom = std::min(bottom, k.z);
  }
  constexpr int BINS = 2048;
  const float scale = top > bottom ? (BINS - 1) / (top - bottom) : 0.0f;
  auto bin = [&](const Candidate& k) { return std::min(BINS - 1, (int)((top - k.z) * scale)); };  // monotone in z
  std::vector<double> mass(BINS, 0.0);
  for (const Candidate& k : c) mass[bin(k)] += k.e;
  double before = 0.0;
  int boundary = 0;
  while (boundary < BINS - 1 && before + mass[boundary] < keep_below) before += mass[boundary++];
  auto above_end = std::partition(c.begin(), c.end(), [&](const Candidate& k) { return bin(k) < boundary; });
  auto bin_end = std::partition(above_end, c.end(), [&](const Candidate& k) { return bin(k) == boundary; });
  std::sort(above_end, bin_end, ranks_before);
  auto j = above_end;
  for (; j != bin_end; ++j) {
    if (j != c.begin() && !(before < keep_below)) break;
    before += j->e;
  }
  return (size_t)(j - c.begin());
}

// The mass of the tokens within each depth of DEPTHS below the largest z (the last: every token)
constexpr int N_DEPTHS = 5;
constexpr float DEPTHS[N_DEPTHS] = {8.0f, 16.0f, 32.0f, 64.0f, INFINITY};

static void depth_masses(const float* x, int64_t n, float t, float zmax, double* masses) {
  for (int b = 0; b < N_DEPTHS; ++b) masses[b] = 0.0;
  int64_t i = 0;
  while (i + EW_LANES <= n) {  // float sums per block, then double: top-p's edge is decided to ~1e-7
    vew acc[N_DEPTHS] = {};
    for (const int64_t end = std::min(n, i + BLOCK); i + EW_LANES <= end; i += EW_LANES) {
      vew z = load_ew(x + i) / t;
      vew e = vexp(z - zmax), d = zmax - z;
      for (int b = 0; b < N_DEPTHS; ++b) acc[b] += d <= DEPTHS[b] ? e : vew{};
    }
    for (int b = 0; b < N_DEPTHS; ++b) {
      float lanes[EW_LANES];
      std::memcpy(lanes, &acc[b], sizeof lanes);
      for (int l = 0; l < EW_LANES; ++l) masses[b] += lanes[l];
    }
  }
  for (; i < n; ++i) {
    const float z = x[i] / t, e = exp_of(z, zmax);
    for (int b = 0; b < N_DEPTHS; ++b)
      if (zmax - z <= DEPTHS[b]) masses[b] += e;
  }
}

static int64_t sample_logits(const torch::Tensor& logits, double temperature, int64_t top_k, double top_p,
                             double min_p, double u) {
  TORCH_CHECK(logits.dim() == 1 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "sample_logits takes one contiguous float32 row");
  const float* x = logits.data_ptr<float>();
  const int64_t n = logits.numel();
  const float t = (float)temperature;
  if (n == 0 || !(t > 0.0f) || !std::isfinite(t)) return -1;
  bool finite = true;
  const float zmax = row_max(x, n, finite) / t;  // x / t rounds monotonically: the largest z is the largest x's
  if (!finite || !std::isfinite(zmax)) return -1;
  const float min_p_floor = min_p > 0.0 ? zmax + (float)std::log(min_p) : -INFINITY;
  const int64_t k = top_k > 0 && top_k < n ? top_k : 0;
  if (k == 0 && top_p >= 1.0) return draw_by_blocks(x, n, t, zmax, min_p_floor, u);

  std::vector<Candidate> kept;
  if (k > 0) {  // down until the candidates hold the k largest
    for (float depth = 8.0f;; depth *= 2.0f) {
      const bool all = depth > 64.0f;
      collect(x, n, t, zmax, all ? -INFINITY : zmax - depth, kept);
      if ((int64_t)kept.size() >= k || all) break;
    }
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), ranks_before);
    kept.resize(k);
    if (top_p < 1.0) {
      double mass = 0.0;
      for (const Candidate& c : kept) mass += c.e;
      kept.resize(keep_top_p(kept, top_p * mass));
    }
  } else {  // top-p over the whole row: the least depth whose tokens hold top_p of its mass
    double masses[N_DEPTHS];
    depth_masses(x, n, t, zmax, masses);
    const double keep_below = top_p * masses[N_DEPTHS - 1];
    int d = 0;
    while (d < N_DEPTHS - 1 && masses[d] < keep_below) ++d;
    collect(x, n, t, zmax, zmax - DEPTHS[d], kept);
    kept.resize(keep_top_p(kept, keep_below));
  }
  if (min_p > 0.0) {
    kept.erase(std::remove_if(kept.begin(), kept.end(), [&](const Candidate& c) { return !(c.z >= min_p_floor); }),
               kept.end());
  }
  if (kept.empty()) return -1;
  std::sort(kept.begin(), kept.end(), [](const Candidate& a, const Candidate& b) { return a.index < b.index; });
  double total = 0.0;
  for (const Candidate& c : kept) total += c.e;
  const double target = u * total;
  double cum = 0.0;
  for (const Candidate& c : kept) {
    cum += c.e;
    if (cum > target) return c.index;
  }
  return kept.back().index;
}

}  // namespace row_sampler

// The compute calls touch tensors only, so they let go of the GIL: a prefill can take seconds, and other
// Python threads (`outrider serve`'s event loop) must go on meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = py::call_guard<py::gil_scoped_release>;
  m.def("linear", &linear, "y = post(W @ pre(x)) with W held as GGUF codes and float32 scales", no_gil());
  m.def("dequantize_rows", &dequantize_rows, "rows of a held weight as float32", no_gil());
  m.def("lane_rows", &lane_rows, "rows of a weight's lane form in the row form", no_gil());
  m.def("attend", &attend, "rotary, cache write and attention for a block of tokens", no_gil());
  m.def("sample_logits", &row_sampler::sample_logits, no_gil(), py::arg("logits"), py::arg("temperature"),
        py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"),
        "the token sample_at(warp(logits)) draws with the uniform u; -1 where the reference must decide");
  // local: two builds may share a process. Keyword-only arguments: many are tensors or ints of the same
  // shape, which a positional call could swap without an error.
  py::class_<HeldLinear>(m, "HeldLinear", py::module_local())
      .def(py::init([](int64_t kind, torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros, int64_t group,
                       int64_t n_out, int64_t k, std::vector<torch::Tensor> lanes) {
             return HeldLinear{kind, group, n_out, k, codes, scales, zeros, lanes};
           }),
           py::kw_only(), py::arg("kind"), py::arg("codes"), py::arg("scales"), py::arg("zeros"), py::arg("group"),
           py::arg("n_out"), py::arg("k"), py::arg("lanes") = std::vector<torch::Tensor>{})
      .def_readonly("kind", &HeldLinear::kind)
      .def_readonly("codes", &HeldLinear::codes)
      .def_readonly("scales", &HeldLinear::scales)
      .def_readonly("zeros", &HeldLinear::zeros)
      .def_readonly("group", &HeldLinear::group)
      .def_readonly("n_out", &HeldLinear::n_out)
      .def_readonly("k", &HeldLinear::k);
  py::class_<LayerStack>(m, "LayerStack", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t>(), py::kw_only(), py::arg("n_heads"),
           py::arg("n_kv"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"), py::arg("act"))
      .def("add", &LayerStack::add, py::kw_only(), py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("attn_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("post_attn_norm"), py::arg("ffn_norm"),
           py::arg("post_ffn_norm"), py::arg("cos"), py::arg("sin"), py::arg("window"), py::arg("qkv_bias") = py::none())
      .def("gemma4", &LayerStack::gemma4, py::kw_only(), py::arg("n_heads"), py::arg("n_kv"), py::arg("head_dim"),
           py::arg("kv_layer"), py::arg("kv_mode"), py::arg("inp_gate"), py::arg("inp_proj"), py::arg("inp_post_norm"),
           py::arg("out_scale"))
      .def("run", &LayerStack::run, no_gil());
  // The codes the calls above take, for outrider.native.codes's test (Python keeps its own copy so that
  // it runs without this module).
  py::dict kinds, acts, kv_modes;
  kinds["q4"] = int(KIND_Q4), kinds["q8"] = int(KIND_Q8), kinds["f32"] = int(KIND_F32), kinds["q5"] = int(KIND_Q5);
  acts["none"] = int(ACT_NONE), acts["silu"] = int(ACT_SILU), acts["gelu_tanh"] = int(ACT_GELU_TANH);
  kv_modes["own"] = int(KV_OWN), kv_modes["k_is_v"] = int(KV_K_IS_V), kv_modes["shared"] = int(KV_SHARED);
  m.attr("WEIGHT_KINDS") = kinds;
  m.attr("ACTIVATIONS") = acts;
  m.attr("KV_MODES") = kv_modes;
  m.attr("KEY_BLOCK") = py::int_(KEY_BLOCK);
  // int8 activations: whether this build has the kernels, and whether they are this CPU's faster choice
  // (AVX2 without AVX-512, and AVX512-VNNI).
  m.attr("HAS_INT8_KERNELS") = py::bool_(HAS_INT8_KERNELS);
  m.attr("PREFERS_INT8") = py::bool_(PREFERS_INT8);
  m.attr("HAS_LANE_TILES") = py::bool_(HAS_LANE_TILES);
#if defined(__AVX2__) && defined(__FMA__)
  m.attr("HAS_DPBUSD256") = py::bool_(HAS_DPBUSD256);  // 256-bit dpbusd in the AVX2 tiles (else maddubs + madd)
#else
  m.attr("HAS_DPBUSD256") = py::bool_(false);
#endif
  m.attr("HAS_AMX_TILES") = py::bool_(HAS_AMX_TILES && AMX_GRANTED);  // built for AMX, and granted by the OS
  m.def("set_amx_min_rows", &set_amx_min_rows, "lane tiles of at least this many rows take AMX (0: none); returns the last");
  m.def("int8_product_rate", &int8_product_rate, no_gil(), py::arg("seconds") = 0.2, py::arg("signed_codes") = false,
        py::arg("float_steps") = false,
        "products a second one core gives a row in the lane tiles, on registers alone (0: no int8 kernels)");
  m.def("set_int8_activations", &set_int8_activations, "quantized weights meet int8 (true) or float32 activations");
  m.def("int8_activations", [] { return int8_activations.load(); });
}
