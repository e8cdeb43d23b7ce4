// Quantized weights against float32 activations: each weight dequantized in registers (weight_formats.h),
// in tiles of rows of x; prompts through a dequantized panel (AVX-512) or torch's BLAS (elsewhere).

#include "common.h"
#include "matmul.h"
#include "weight_formats.h"

#if !defined(__AVX512F__)
#include <torch/types.h>  // BLAS for prompts
#endif

#if defined(__AVX512F__)
constexpr int MAX_TILE = 8;  // rows of input per pass over a weight row: 2 x 8 accumulators fit in 32 registers
#else
constexpr int MAX_TILE = 4;
#endif

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


template <class W>
static void matmul(const W& w, int64_t groups, const float* x, int64_t rows, int64_t k, float* y, int64_t n_out) {
  // A grain of 16 output rows keeps the two halves of a small matrix on two threads.
  kernel_parallel_for(0, n_out, 16, [&](int64_t n0, int64_t n1) {
    over_row_tiles<MAX_TILE>(rows, [&](auto row_count, int64_t r) {
      tile<W, decltype(row_count)::value>(w, groups, x + r * k, k, y + r * n_out, n_out, n0, n1);
    });
  });
}
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
  kernel_parallel_for(0, (n_out + 3) / 4, 1, [&](int64_t b0, int64_t b1) {
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
    kernel_parallel_for(0, nb, 16, [&](int64_t a, int64_t b) {
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

void float_matmul(int64_t kind, const void* codes, const float* scales, const float* zeros, int64_t group,
                  const float* x, int64_t rows, int64_t k, float* y, int64_t n_out, bool prompt) {
  const int64_t groups = k / 32;
  with_format(kind, codes, scales, zeros, group, k, [&](const auto& w) {
#if defined(__AVX512F__)
    if (prompt && rows >= PROMPT_PANEL_MIN_ROWS) return panel_matmul(w, groups, x, rows, k, y, n_out);
#else
    if (prompt && rows >= PROMPT_PANEL_MIN_ROWS) return blas_prompt_matmul(w, groups, x, rows, k, y, n_out);
#endif
    matmul(w, groups, x, rows, k, y, n_out);
  });
}
