// The row-wise steps around a matmul and inside attention: RMS norm, the gated activations, softcap.
#pragma once

#include "common.h"

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
