// The calls the Python module and LayerStack make (bindings.cpp): each defined in the source named beside it.
#pragma once

#include <torch/types.h>

#include <vector>

// linear.cpp
torch::Tensor linear(torch::Tensor x, int64_t kind, torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros,
                     int64_t group, int64_t n_out, int64_t k, c10::optional<torch::Tensor> in_norm, double eps,
                     int64_t act, c10::optional<torch::Tensor> residual, c10::optional<torch::Tensor> out_norm,
                     double softcap, bool prompt, const std::vector<torch::Tensor>& lanes, int64_t int8,
                     int64_t threads);
torch::Tensor dequantize_rows(torch::Tensor rows, int64_t kind, torch::Tensor codes, torch::Tensor scales,
                              torch::Tensor zeros, int64_t group, int64_t k);
std::vector<torch::Tensor> lane_rows(torch::Tensor rows, int64_t kind, std::vector<torch::Tensor> lanes, int64_t group,
                                     int64_t k);
void set_int8_activations(bool on);
bool int8_activations();
bool call_int8(int64_t int8);  // a call's int8 argument (-1, 0, 1) as a mode, checked

// attention.cpp
torch::Tensor attend(torch::Tensor qkv, torch::Tensor k_cache, torch::Tensor v_cache, int64_t start, int64_t n_heads,
                     int64_t n_kv, int64_t d, torch::Tensor cos, torch::Tensor sin,
                     c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, double eps,
                     int64_t window, double scale, int64_t kv_mode, bool v_norm);
// One sequence's rows of a ragged attend: rows row0..row0+t_len-1 of qkv at positions start.., over its own cache.
struct AttendSegment {
  int64_t row0, t_len, start;
  torch::Tensor k_cache, v_cache;
};
torch::Tensor attend_segments(const torch::Tensor& qkv, const std::vector<AttendSegment>& segments, int64_t n_heads,
                              int64_t n_kv, int64_t d, const torch::Tensor& cos, const torch::Tensor& sin,
                              c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, double eps,
                              int64_t window, double scale, int64_t kv_mode, bool v_norm);

// row_sampler.cpp: the token sample_at(warp(row)) draws with the uniform u (outrider.spec.sampling); -1 where the
// reference must decide
int64_t sample_logits(const float* logits, int64_t n, double temperature, int64_t top_k, double top_p,
                      double min_p, double u);

// amx.cpp
int set_amx_min_rows(int64_t rows);
bool amx_tiles_granted();  // built for AMX, and granted by the OS
