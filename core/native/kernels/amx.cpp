// AMX lane tiles (Intel since Sapphire Rapids), where the build has amx_int8 and Linux grants the tile
// state; elsewhere only the setting that would turn them on, refusing.

#include "int8.h"

#if defined(INT8_AMX)
#include <sys/syscall.h>
#include <unistd.h>

// Linux hands AMX's tile state to a process only on request, once (arch_prctl), for all its threads.
static bool request_amx() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
static const bool AMX_GRANTED = request_amx();
#else
constexpr bool AMX_GRANTED = false;
#endif

// Lane tiles of at least this many rows take AMX where the build and the OS have it (0: none). A group's
// tile sequence costs the same for 1 or 16 rows, so fewer rows keep the dpbusd tile; the bits are the same.
// Intel Xeon VM (avx512_vnni, amx_int8; GCC 13), one thread, SmolLM2 / Gemma 3 shapes, AMX time over
// dpbusd's: 8 rows 1.57 / 1.20, 12 rows 1.26 / 1.08, 16 rows 0.87 / 0.87 (docs/bench/avx2.md, 'AMX tiles').
constexpr int AMX_MIN_ROWS = 16;
static std::atomic<int> amx_min_rows{HAS_AMX_TILES && AMX_GRANTED ? AMX_MIN_ROWS : 0};

int set_amx_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= 16, "AMX tiles: from 1 to 16 rows (a lane tile's), or 0 for none; got ", rows);
  TORCH_CHECK(rows == 0 || (HAS_AMX_TILES && AMX_GRANTED), "AMX tiles: this build or this process has none");
  return amx_min_rows.exchange(static_cast<int>(rows));
}

bool amx_tiles_granted() { return HAS_AMX_TILES && AMX_GRANTED; }

#if defined(INT8_KERNELS)
int amx_from_rows() { return amx_min_rows.load(std::memory_order_relaxed); }
#endif

#if defined(INT8_AMX)
// AMX (Intel since Sapphire Rapids): TDPBSUD multiplies a tile of up to 16 rows of x's signed codes by a
// tile of unsigned weight codes laid out four adjacent codes of 16 weight rows to a 64-byte row, which is
// the lane form itself: 8-bit codes are read in place, 4-, 5- and six-bit ones unpacked to bytes once per group
// for all of a tile's rows. One instruction gives every row's 16 sums of a group (of each half, with
// scales per 16), the integers the dpbusd chains of int8_avx512_vnni.cpp's lane tile give, and the float steps after it
// are that tile's, op for op: so the bits are the same whichever of the two runs a tile, and a verify pass over k
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
  const int64_t groups = xq.groups, count = groups * S, supers = groups / 8;
  const GroupMajorRows<R, S> rows(xq, r0);
  alignas(64) uint8_t unpacked[SLOTS][512];
  alignas(64) int32_t sums[SLOTS][S][R * 16];
  // tiles 0-3: sums (a slot's, or with S = 2 a slot's two halves); 4-5 x's codes; 6-7 weight codes
  TileConfig config;
  for (int t = 0; t < 4; ++t) config.rows[t] = R, config.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) config.rows[t] = R, config.colsb[t] = K;
  for (int t = 6; t < 8; ++t) config.rows[t] = K / 4, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  // a group's 4-, 5- or six-bit codes as bytes: rows 0-3 the codes 4m.., 4-7 the codes 16 + 4m.. (8-bit
  // codes are held so)
  auto weight_bytes = [&](const uint8_t* pg, uint8_t* out) __attribute__((always_inline)) {
    if constexpr (KIND == KIND_Q8) return pg;
    if constexpr (KIND == KIND_Q6_LANES) {
      for (int q = 0; q < 2; ++q) {
        __m512i lo[2], hi[2];
        zmm_lane_codes6(pg, q, lo, hi);
        for (int i = 0; i < 2; ++i) {
          _mm512_store_si512(out + 64 * (2 * q + i), lo[i]);
          _mm512_store_si512(out + 256 + 64 * (2 * q + i), hi[i]);
        }
      }
    } else {
      for (int m = 0; m < 4; ++m) {
        __m512i lo, hi;
        zmm_lane_codes<KIND>(pg, m, lo, hi);
        _mm512_store_si512(out + 64 * m, lo);
        _mm512_store_si512(out + 256 + 64 * m, hi);
      }
    }
    return static_cast<const uint8_t*>(out);
  };
  const auto* x = reinterpret_cast<const uint8_t*>(rows.codes(0, 0));  // group g's rows at x + g * R * 32
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* p = w.codes + b * groups * BYTES;
    const BlockScales<8 * S> scale(w.scales, w.sub_scales, w.super_scales, b, count, supers);
    const BlockScales<8 * S> zero(w.zeros, w.sub_zeros, w.super_zeros, b, count, supers);
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
        const __m512 ws = scale(g);
        for (int r = 0; r < R; ++r) {
          __m512i total = _mm512_load_si512(sum[0] + 16 * r);
          if constexpr (KIND == KIND_Q8) total = _mm512_add_epi32(_mm512_set1_epi32(rows.start(g, 0, r)), total);
          const __m512 d = _mm512_set1_ps(rows.d(g, r));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws, d), _mm512_cvtepi32_ps(total), acc[r]);
        }
      } else {
        const __m512 ws_a = scale(g * 2), ws_b = scale(g * 2 + 1);
        for (int r = 0; r < R; ++r) {
          const __m512i a = _mm512_add_epi32(_mm512_set1_epi32(lane_start<KIND>(rows.start(g, 0, r))),
                                             _mm512_load_si512(sum[0] + 16 * r));
          const __m512i e = _mm512_add_epi32(_mm512_set1_epi32(lane_start<KIND>(rows.start(g, 1, r))),
                                             _mm512_load_si512(sum[1] + 16 * r));
          const __m512 d = _mm512_set1_ps(rows.d(g, r));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws_a, d), _mm512_cvtepi32_ps(a), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws_b, d), _mm512_cvtepi32_ps(e), acc[r]);
        }
      }
      if (w.zeros || w.sub_zeros) {  // as in the dpbusd tile
        for (int h = 0; h < S; ++h) {
          const __m512 wz = zero(g * S + h);
          for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wz, _mm512_set1_ps(rows.zero_sum(g, h, r)), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy + b * 16, acc[r]);
  }
  _tile_release();
}

void run_amx_lane_tile(int64_t kind, int scales, int rows, const LaneWeights& w, const QuantizedRows& xq, int64_t r0,
                       float* y, int64_t ldy, int64_t b0, int64_t b1) {
  with_lane_shape(kind, scales, rows, [&](auto kind_c, auto scales_c, auto rows_c) {
    amx_lane_tile<decltype(kind_c)::value, decltype(scales_c)::value, decltype(rows_c)::value>(w, xq, r0, y, ldy, b0,
                                                                                                b1);
  });
}
#elif defined(INT8_KERNELS)
void run_amx_lane_tile(int64_t, int, int, const LaneWeights&, const QuantizedRows&, int64_t, float*, int64_t, int64_t,
                       int64_t) {}
#endif
