// One token from one row of logits (sample_logits, declared in api.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"  // not api.h: it brings torch's headers, which this pointer-only source does without

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
namespace {

constexpr int64_t BLOCK = 256;  // exps summed per block: after the block sums the walk touches one block
static_assert(BLOCK % EW_LANES == 0, "a block is whole vectors");

struct Candidate {
  float z;  // the tempered logit
  float e;  // exp(z - zmax)
  int32_t index;
};

// z descending, then index ascending: a stable descending sort's order, as warp's top-p sees it (torch.topk
// promises no order among ties at the top-k boundary: there the two may keep different tokens of equal z)
static inline bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.z > b.z || (a.z == b.z && a.index < b.index);
}

// exp(d) for d = z - zmax <= 0, and 0 where float's exp underflows: vexp clamps its input there, which would
// give every masked token (a logit of -FLT_MAX) a probability the reference's softmax does not
static inline vew exps(vew d) {
  vew e = vexp(d);
  return d >= -87.0f ? e : vew{};
}

static inline float exp_of(float z, float zmax) {
  vew lane = vew{} + (z - zmax);
  return exps(lane)[0];  // the vector exp, so a token's exp is the same bits in every pass
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
      vew e = exps(z - zmax);
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
      const float e = exp_of(z, zmax);
      if (e > 0.0f) last = i;  // a token whose exp underflows has no probability: never the fallback
      cum += e;
      if (cum > target) return i;
    }
    return last;  // rounding: the block's sum token by token fell short of its sum by vectors
  }
  for (int64_t i = std::min(n, (last_block + 1) * BLOCK) - 1; last_block >= 0 && i >= last_block * BLOCK; --i)
    if (x[i] / t >= floor && exp_of(x[i] / t, zmax) > 0.0f) return i;  // u * total rounded up to total: the last
                                                                         // token with nonzero probability
  return -1;
}

// The tokens with z >= floor and a nonzero exp, in no order, and their mass. A token whose exp underflows (a
// logit of -FLT_MAX tempered to -inf, or far below the largest) can never be drawn and adds no mass: left out,
// the candidates' z are finite, and so are the bins of top-p below.
static double collect(const float* x, int64_t n, float t, float zmax, float floor, std::vector<Candidate>& out) {
  out.clear();
  double mass = 0.0;
  int64_t i = 0;
  for (; i + EW_LANES <= n; i += EW_LANES) {
    vew z = load_ew(x + i) / t;
    if (hmax(z) < floor) continue;
    vew e = exps(z - zmax);
    float zs[EW_LANES], es[EW_LANES];
    std::memcpy(zs, &z, sizeof zs);
    std::memcpy(es, &e, sizeof es);
    for (int l = 0; l < EW_LANES; ++l)
      if (zs[l] >= floor && es[l] > 0.0f) {
        out.push_back({zs[l], es[l], (int32_t)(i + l)});
        mass += es[l];
      }
  }
  for (; i < n; ++i) {
    const float z = x[i] / t;
    const float e = exp_of(z, zmax);
    if (z >= floor && e > 0.0f) {
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
  auto bin = [&](const Candidate& k) {  // monotone in z
    const float at = (top - k.z) * scale;
    return at < (float)(BINS - 1) ? (int)at : BINS - 1;
  };
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
      vew e = exps(z - zmax), d = zmax - z;
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

}  // namespace

int64_t sample_logits(const float* x, int64_t n, double temperature, int64_t top_k, double top_p, double min_p,
                      double u) {
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
    if ((int64_t)kept.size() > k) {  // fewer: every token with probability is among the k largest
      std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), ranks_before);
      kept.resize(k);
    }
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

