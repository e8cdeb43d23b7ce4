// LayerStack: a model's transformer layers in one call (bound in bindings.cpp).
#pragma once

#include "api.h"
#include "common.h"

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
                           bool prompt, int64_t int8) const {
    return linear(x, kind, codes, scales, zeros, group, n_out, k, in_norm, eps, act, residual, out_norm, 0.0, prompt,
                  lanes, int8, 0);
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

  // The activations (int8: 1 int8, 0 float32, -1 the process's setting) and the most threads (0: the whole pool)
  // every run takes: a model's own, given once where it differs from the process's (a draft model).
  void pin(int64_t int8, int64_t threads) {
    call_int8(int8);
    TORCH_CHECK(threads >= 0, "LayerStack.pin: threads must be >= 0");
    int8_ = int8, threads_ = threads;
  }

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
    ThreadsScope scope(threads_);
    x = x.contiguous();
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      size_t kv = l.kv_layer >= 0 ? l.kv_layer : i;
      c10::optional<torch::Tensor> bias;
      if (l.qkv_bias.has_value()) bias = l.qkv_bias->expand({x.size(0), l.qkv_bias->size(0)}).contiguous();
      torch::Tensor qkv = l.qkv(x, l.attn_norm, eps_, ACT_NONE, bias, c10::nullopt, prompt, int8_);
      torch::Tensor a = attend(qkv, keys[kv], values[kv], start, l.n_heads ? l.n_heads : n_heads_,
                               l.n_kv ? l.n_kv : n_kv_, l.d ? l.d : d_, l.cos, l.sin, l.q_norm, l.k_norm, eps_,
                               l.window, scale_, l.kv_mode, l.v_norm);
      x = l.o(a, c10::nullopt, eps_, ACT_NONE, x, l.post_attn_norm, prompt, int8_);
      torch::Tensor gu = l.gate_up(x, l.ffn_norm, eps_, ACT_NONE, c10::nullopt, c10::nullopt, prompt, int8_);
      x = l.down(gu, c10::nullopt, eps_, act_, x, l.post_ffn_norm, prompt, int8_);
      if (l.per_layer_input) {
        TORCH_CHECK(per_layer.has_value(), "LayerStack.run: this model needs its per-layer inputs");
        torch::Tensor gate = l.inp_gate(x, c10::nullopt, eps_, ACT_NONE, c10::nullopt, c10::nullopt, prompt, int8_);
        torch::Tensor gate_in = torch::cat({gate, per_layer->select(1, static_cast<int64_t>(i))}, 1).contiguous();
        x = l.inp_proj(gate_in, c10::nullopt, eps_, act_, x, l.inp_post_norm, prompt, int8_);
      }
      if (l.out_scale.has_value()) x = x * *l.out_scale;
    }
    return x;
  }

  // Several sequences' rows through every layer in one call (a ragged batch): x [N, hidden] holds counts[b] rows of
  // sequence b, in order, at positions starts[b].., over its own cache (keys[b], values[b]: one tensor per layer).
  // The linears take all N rows at once (their weights are read once for all); attention takes each sequence's
  // rows over its own cache (attend_segments). A row's result is bit for bit what its sequence's own run gives
  // (prompt = false: each linear's rows are computed alone, as a verify pass's). Gemma 4's layers, which read
  // other layers' caches and per-layer inputs, run one sequence at a time.
  torch::Tensor run_ragged(torch::Tensor x, const std::vector<int64_t>& counts, const std::vector<int64_t>& starts,
                           const std::vector<std::vector<torch::Tensor>>& keys,
                           const std::vector<std::vector<torch::Tensor>>& values) const {
    TORCH_CHECK(counts.size() == starts.size() && counts.size() == keys.size() && counts.size() == values.size(),
                "LayerStack.run_ragged: counts, starts, keys and values name ", counts.size(), ", ", starts.size(),
                ", ", keys.size(), " and ", values.size(), " sequences");
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    TORCH_CHECK(total == x.size(0), "LayerStack.run_ragged: counts add up to ", total, " rows, x has ", x.size(0));
    for (size_t b = 0; b < keys.size(); ++b)
      TORCH_CHECK(keys[b].size() == layers_.size() && values[b].size() == layers_.size(), "LayerStack.run_ragged: "
                  "sequence ", b, "'s cache has ", keys[b].size(), " layers, the model ", layers_.size());
    for (const StackLayer& l : layers_)
      TORCH_CHECK(l.kv_layer < 0 && !l.per_layer_input, "LayerStack.run_ragged: Gemma 4's layers run one sequence "
                  "at a time");
    ThreadsScope scope(threads_);
    x = x.contiguous();
    std::vector<AttendSegment> segments(counts.size());
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      c10::optional<torch::Tensor> bias;
      if (l.qkv_bias.has_value()) bias = l.qkv_bias->expand({x.size(0), l.qkv_bias->size(0)}).contiguous();
      torch::Tensor qkv = l.qkv(x, l.attn_norm, eps_, ACT_NONE, bias, c10::nullopt, false, int8_);
      for (size_t b = 0, row = 0; b < counts.size(); row += counts[b], ++b)
        segments[b] = AttendSegment{static_cast<int64_t>(row), counts[b], starts[b], keys[b][i], values[b][i]};
      torch::Tensor a = attend_segments(qkv, segments, n_heads_, n_kv_, d_, l.cos, l.sin, l.q_norm, l.k_norm, eps_,
                                        l.window, scale_, l.kv_mode, l.v_norm);
      x = l.o(a, c10::nullopt, eps_, ACT_NONE, x, l.post_attn_norm, false, int8_);
      torch::Tensor gu = l.gate_up(x, l.ffn_norm, eps_, ACT_NONE, c10::nullopt, c10::nullopt, false, int8_);
      x = l.down(gu, c10::nullopt, eps_, act_, x, l.post_ffn_norm, false, int8_);
      if (l.out_scale.has_value()) x = x * *l.out_scale;
    }
    return x;
  }

 private:
  int64_t n_heads_, n_kv_, d_;
  double eps_, scale_;
  int64_t act_;
  int64_t int8_ = -1, threads_ = 0;
  std::vector<StackLayer> layers_;
};
