// What every kernel source shares: the vector types and their helpers, the codes Python passes (weight
// kinds, activations, kv modes), and the walk over tiles of rows.
//
// The float kernels and attention are written with GCC/Clang vector extensions rather than intrinsics, so
// they compile (with -march=native) to AVX-512, AVX2 or NEON code; the int8 kernels are x86 intrinsics, a
// source per instruction set (int8_avx2.cpp, int8_avx512_vnni.cpp, amx.cpp), of which the build's target
// macros (isa.h) leave one or two non-empty. Two promises shape every loop:
//
// - Row independence. A row of the output depends only on the same row of the input: tiles of rows
//   share the dequantized weights but never an accumulator, and every row runs the same sequence of
//   float operations whatever the tile size. So a verify pass over k+1 tokens gives bit for bit the
//   logits of k+1 single steps, and greedy speculation equals plain decoding.
// - Exact weights. Every GGUF type is held as the integers the file stores with float32 scales (and
//   zeros), w = scale * code + zero, dequantized in registers with float32 activations, or met by int8
//   activations in integer dot products (int8.h, the fast path on AVX2).
//
// Threads: at::parallel_for, i.e. torch's own OpenMP pool (torch's wheel ships libgomp.so.1, which this
// library then shares), so our kernels and torch's ops never fight over cores. A call may take fewer threads
// than the pool (`threads` of linear and LayerStack: a draft model beside its target), so the kernels split
// their work through kernel_parallel_for, which splits it into at most that call's count of tasks.
//
// Timings in the kernels' comments, unless they say otherwise: a 2-vCPU AMD EPYC (lscpu: avx2, fma, f16c,
// avx512f/bw/vl, avx512_vnni, avx_vnni; no AMX). "x86-64-v3 build" = OUTRIDER_NATIVE_MARCH=x86-64-v3,
// code for avx2, fma and f16c only; "native" = -march=native, the AVX512-VNNI code. Those against
// llama.cpp, measured in the same runs, are in docs/bench/avx2.md.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "isa.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

// The threads of the call running on this thread (ThreadsScope sets it for the call; 0: the whole pool). Each
// output's float operations are the same however the work is split, so a count changes no result.
inline thread_local int64_t call_threads = 0;

inline int64_t kernel_threads() {
  const int64_t pool = at::get_num_threads();
  return call_threads > 0 ? std::min<int64_t>(call_threads, pool) : pool;
}

struct ThreadsScope {
  int64_t before;
  explicit ThreadsScope(int64_t threads) : before(call_threads) { if (threads > 0) call_threads = threads; }
  ~ThreadsScope() { call_threads = before; }
};

// at::parallel_for in at most kernel_threads() tasks
template <class F>
inline void kernel_parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t threads = kernel_threads();
  if (threads < at::get_num_threads()) grain = std::max(grain, (end - begin + threads - 1) / threads);
  at::parallel_for(begin, end, grain, f);
}

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));

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

// How a weight is held (PackedLinear.kind): packed nibbles, int8 codes, float32, 5-bit codes. Exported to
// Python as WEIGHT_KINDS, with ACTIVATIONS, KV_MODES and KEY_BLOCK, so Python's table (outrider.native.codes)
// is checked against these.
enum WeightKind { KIND_Q4 = 0, KIND_Q8 = 1, KIND_F32 = 2, KIND_Q5 = 3 };

enum Act { ACT_NONE = 0, ACT_SILU = 1, ACT_GELU_TANH = 2 };

// Where a layer's keys and values come from (Gemma 4 adds the last two).
enum KVMode { KV_OWN = 0, KV_K_IS_V = 1, KV_SHARED = 2 };

constexpr int64_t KEY_BLOCK = 64;  // positions per pass over a query; the cache is padded to a multiple

// A lane form of a KIND_Q8 weight whose codes fit -32..31 (Q6_K's), held in six bits (see "Lane tiles",
// int8.h): the lane tiles' kind only, never a PackedLinear's
constexpr int64_t KIND_Q6_LANES = 4;

// bytes of one block of 16 rows and one group of 32 codes in the lane form
constexpr int64_t lane_group_bytes(int64_t kind) {
  return kind == KIND_Q4 ? 256 : kind == KIND_Q5 ? 320 : kind == KIND_Q6_LANES ? 384 : 512;
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
