// The matrix products linear.cpp chooses among, on raw pointers: float32 activations (float_matmul.cpp),
// int8 activations against the row form (four-group tiles) or the lane form (lane tiles; int8_matmul.cpp).
#pragma once

#include <cstdint>

// A weight's lane form (see int8.h, "Lane tiles"): float32 scales and zeros, or (FACTORED_SCALES builds, K-quants)
// int8 sub-scales and sub-zeros per unit with float16 super-scales and super-zeros (their bits) per 256 weights
// of a row, a unit's scale being their product (exact: see ScaleFactors, core/models/linear.py); the other
// pair is null.
struct LaneWeights {
  const uint8_t* codes;
  const float *scales, *zeros;
  const int8_t *sub_scales = nullptr, *sub_zeros = nullptr;
  const uint16_t *super_scales = nullptr, *super_zeros = nullptr;
};

// y [rows, n_out] = x [rows, k] times the row-form weight's transpose, x in float32; prompt: rows need not
// match one-row calls bit for bit (see panel_matmul). codes: see with_format
// (weight_formats.h).
void float_matmul(int64_t kind, const void* codes, const float* scales, const float* zeros, int64_t group,
                  const float* x, int64_t rows, int64_t k, float* y, int64_t n_out, bool prompt);

// The same with x quantized to int8 per row and 32 (four-group tiles); false, and nothing done, for float32
// weights, which keep float activations.
bool int8_matmul(int64_t kind, int64_t group, const void* codes, const float* scales, const float* zeros,
                 const float* x, int64_t rows, int64_t k, float* y, int64_t n_out);

// The same from the lane form (n_out a multiple of 16): lane tiles, or AMX tiles from amx_min_rows rows.
void lane_matmul(int64_t kind, int64_t group, const LaneWeights& w, const float* x, int64_t rows, int64_t k, float* y,
                 int64_t n_out);
