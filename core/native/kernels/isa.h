// Which instruction sets this build's kernels take, from the compiler's target macros (-march): every
// source includes this, so every path is chosen once, here, for the whole module.
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The int8 kernels (int8_matmul.cpp and one of int8_avx2.cpp, int8_avx512_vnni.cpp) need AVX2 and FMA;
// without them quantized weights meet float32 activations only.
#if defined(__AVX2__) && defined(__FMA__)
#define INT8_KERNELS 1
constexpr bool HAS_INT8_KERNELS = true;
constexpr bool HAS_LANE_TILES = true;
#else
constexpr bool HAS_INT8_KERNELS = false;
constexpr bool HAS_LANE_TILES = false;
#endif

#if defined(INT8_KERNELS) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define INT8_VNNI512 1  // the int8 tiles take the AVX512-VNNI form (int8_avx512_vnni.cpp), else the AVX2 one
#endif

// Whether lane forms may hold K-quant scales factored (LaneWeights; float16 super-scales, F16C) and Q6_K's
// codes in six bits (KIND_Q6_LANES): every lane tile reads them (AVX2, AVX512-VNNI, AMX).
#if defined(INT8_KERNELS) && defined(__F16C__)
constexpr bool FACTORED_SCALES = true;
constexpr bool SIX_BIT_LANES = true;
#else
constexpr bool FACTORED_SCALES = false;
constexpr bool SIX_BIT_LANES = false;
#endif

#if defined(INT8_VNNI512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define INT8_AMX 1  // lane tiles of AMX_MIN_ROWS rows take AMX (amx.cpp)
constexpr bool HAS_AMX_TILES = true;
#else
constexpr bool HAS_AMX_TILES = false;
#endif

// Whether quantized weights meet int8 activations or float32 ones by default (`-o backend.activations auto`):
// int8 where it was measured faster for every row count (1-512): AVX2 without AVX-512 (the float kernels
// lack a table lookup and half the width) and AVX512-VNNI; AVX-512 without VNNI keeps float32.
#if (defined(INT8_KERNELS) && !defined(__AVX512F__)) || defined(INT8_VNNI512)
constexpr bool PREFERS_INT8 = true;
#else
constexpr bool PREFERS_INT8 = false;
#endif

#if defined(INT8_KERNELS)

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
#else
constexpr bool HAS_DPBUSD256 = false;
#endif
