// Rotary, the cache write and attention for a block of tokens, each query computed alone.

#include <torch/types.h>

#include <algorithm>

#include "api.h"
#include "common.h"
#include "row_ops.h"

// Rotary (NEOX half split) with full-width tables: out = x * cos + roll(x, d/2) * sin, where sin holds
// -sin in its first half (see layers.Rotary).
static void rope_row(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

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
  return attend_segments(qkv, {AttendSegment{0, qkv.size(0), start, k_cache, v_cache}}, n_heads, n_kv, d, cos, sin,
                         q_norm, k_norm, eps, window, scale, kv_mode, v_norm);
}

// attend for several sequences' rows in one call: segment s is rows row0..row0+t_len-1 of qkv, at positions
// start.., over its own cache. Each (query, head) is computed as attend computes it alone (the same float
// operations in the same order), so a segment's rows are bit for bit its own attend's; what is shared is one
// parallel region for all of them, so a step of many short sequences keeps every thread busy.
torch::Tensor attend_segments(const torch::Tensor& qkv, const std::vector<AttendSegment>& segments, int64_t n_heads,
                              int64_t n_kv, int64_t d, const torch::Tensor& cos, const torch::Tensor& sin,
                              c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, double eps,
                              int64_t window, double scale, int64_t kv_mode, bool v_norm) {
  TORCH_CHECK(qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat32, "attend: qkv must be contiguous float32");
  TORCH_CHECK(d % 16 == 0 && d <= 1024, "attend: head_dim must be a multiple of 16, at most 1024");
  TORCH_CHECK(kv_mode >= KV_OWN && kv_mode <= KV_SHARED, "attend: unknown kv_mode ", kv_mode);
  int64_t rows = qkv.size(0);
  int64_t width = (n_heads + (kv_mode == KV_OWN ? 2 : kv_mode == KV_K_IS_V ? 1 : 0) * n_kv) * d;
  TORCH_CHECK(qkv.size(1) == width, "attend: qkv has ", qkv.size(1), " columns, expected ", width);
  const float* src = qkv.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  float epsf = static_cast<float>(eps);
  int64_t per_kv = n_heads / n_kv;
  // Work items: a token and up to MAX_SHARED_HEADS heads of one kv group, which read the same keys and
  // values together (independent chains, one load for all of them); fewer heads per item where that
  // would leave fewer than two items per thread. (Which heads share an item changes no head's result.)
  int64_t shared = std::min<int64_t>(MAX_SHARED_HEADS, per_kv);
  while (shared > 1 && rows * n_kv * ((per_kv + shared - 1) / shared) < 2 * kernel_threads()) --shared;
  int64_t chunks_per_group = (per_kv + shared - 1) / shared;

  std::vector<AttendArgs> args;
  std::vector<int64_t> first_item{0};  // segment s's items are first_item[s] .. first_item[s + 1] - 1
  int64_t scores_max = 0;
  std::vector<float> ones(v_norm ? d : 0, 1.0f);
  for (const AttendSegment& seg : segments) {
    const torch::Tensor &k_cache = seg.k_cache, &v_cache = seg.v_cache;
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "attend: caches must be contiguous");
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == d && k_cache.size(3) == KEY_BLOCK,
                "attend: keys must be held in transposed blocks [kv_heads, blocks, head_dim, ", KEY_BLOCK, "]");
    TORCH_CHECK(seg.row0 >= 0 && seg.t_len >= 0 && seg.row0 + seg.t_len <= rows, "attend: a segment's rows lie "
                "outside qkv");
    int64_t k_len = k_cache.size(1) * KEY_BLOCK, v_len = v_cache.size(1), start = seg.start;
    TORCH_CHECK(start >= 0 && start + seg.t_len <= v_len, "attend: positions past the end of the cache");
    float* kc = k_cache.data_ptr<float>();
    float* vc = v_cache.data_ptr<float>();
    const float* seg_src = src + seg.row0 * width;
    // keys and values into the cache first: a query attends to the block's earlier tokens too
    for (int64_t t = 0; kv_mode != KV_SHARED && t < seg.t_len; ++t) {
      int64_t p = start + t;
      for (int64_t g = 0; g < n_kv; ++g) {
        float normed[1024], rotated[1024];
        const float* k = seg_src + t * width + (n_heads + g) * d;
        const float* v = kv_mode == KV_K_IS_V ? k : seg_src + t * width + (n_heads + n_kv + g) * d;
        if (kn) { rms_norm_row(k, kn, epsf, d, normed); k = normed; }
        rope_row(k, cs + p * d, sn + p * d, d, rotated);
        for (int64_t e = 0; e < d; ++e) kc[g * d * k_len + key_offset(d, e, p)] = rotated[e];
        if (v_norm) rms_norm_row(v, ones.data(), epsf, d, vc + (g * v_len + p) * d);
        else std::memcpy(vc + (g * v_len + p) * d, v, d * sizeof(float));
      }
    }
    // Scores only up to the last position this call reaches, not the cache's length, and not zeroed:
    // every score read is written first. (Sized by the context, the buffer cost Gemma 3 a 512 KB memset
    // per layer.)
    int64_t scores_len = (start + seg.t_len + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    scores_max = std::max(scores_max, scores_len);
    args.push_back(AttendArgs{seg_src, kc, vc, cs, sn, qn, epsf, width, d, k_len, v_len, window,
                              static_cast<float>(scale), scores_len});
    first_item.push_back(first_item.back() + seg.t_len * n_kv * chunks_per_group);
  }

  torch::Tensor out = torch::empty({rows, n_heads * d}, qkv.options());
  float* op = out.data_ptr<float>();
  // Items in order of segment, kv group, then heads, then token: a thread's share is whole groups where it can be,
  // so the tokens of a verify pass read their group's keys and values one after another, the later ones from
  // cache, not each from memory
  kernel_parallel_for(0, first_item.back(), 1, [&](int64_t i0, int64_t i1) {
    std::unique_ptr<float[]> scores(new float[shared * scores_max]);
    size_t s = std::upper_bound(first_item.begin(), first_item.end(), i0) - first_item.begin() - 1;
    for (int64_t i = i0; i < i1; ++i) {
      while (i >= first_item[s + 1]) ++s;
      const AttendSegment& seg = segments[s];
      const AttendArgs& a = args[s];
      int64_t t_len = seg.t_len, local = i - first_item[s];
      int64_t t = local % t_len, item = local / t_len;
      int64_t g = item / chunks_per_group, h0 = g * per_kv + (item % chunks_per_group) * shared;
      int64_t heads = std::min<int64_t>(shared, (g + 1) * per_kv - h0);
      float* o = op + (seg.row0 + t) * n_heads * d + h0 * d;
      int64_t p = seg.start + t;
      switch (heads) {
        case 4: if constexpr (MAX_SHARED_HEADS >= 4) { attend_heads<4>(a, t, p, h0, g, scores.get(), o); } break;
        case 3: if constexpr (MAX_SHARED_HEADS >= 3) { attend_heads<3>(a, t, p, h0, g, scores.get(), o); } break;
        case 2: if constexpr (MAX_SHARED_HEADS >= 2) { attend_heads<2>(a, t, p, h0, g, scores.get(), o); } break;
        default: attend_heads<1>(a, t, p, h0, g, scores.get(), o); break;
      }
    }
  });
  return out;
}
