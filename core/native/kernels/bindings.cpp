// The Python module: every call the other sources define that Python makes, and the codes and facts of
// this build. A new source's call is declared in api.h and bound here with one m.def.

#include <torch/extension.h>

#include "api.h"
#include "common.h"
#include "layer_stack.h"

// The compute calls touch tensors only, so they let go of the GIL: a prefill can take seconds, and other
// Python threads (`outrider serve`'s event loop) must go on meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = py::call_guard<py::gil_scoped_release>;
  m.def("linear", &linear, "y = post(W @ pre(x)) with W held as GGUF codes and float32 scales", no_gil());
  m.def("dequantize_rows", &dequantize_rows, "rows of a held weight as float32", no_gil());
  m.def("lane_rows", &lane_rows, "rows of a weight's lane form in the row form", no_gil());
  m.def("attend", &attend, "rotary, cache write and attention for a block of tokens", no_gil());
  m.def("sample_logits", [](const torch::Tensor& logits, double temperature, int64_t top_k, double top_p,
                            double min_p, double u) {
          TORCH_CHECK(logits.dim() == 1 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
                      "sample_logits takes one contiguous float32 row");
          return sample_logits(logits.data_ptr<float>(), logits.numel(), temperature, top_k, top_p, min_p, u);
        }, no_gil(), py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"),
        py::arg("u"), "the token sample_at(warp(logits)) draws with the uniform u; -1 where the reference must decide");
  // local: two builds may share a process. Keyword-only arguments: many are tensors or ints of the same
  // shape, which a positional call could swap without an error.
  py::class_<HeldLinear>(m, "HeldLinear", py::module_local())
      .def(py::init([](int64_t kind, torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros, int64_t group,
                       int64_t n_out, int64_t k, std::vector<torch::Tensor> lanes) {
             return HeldLinear{kind, group, n_out, k, codes, scales, zeros, lanes};
           }),
           py::kw_only(), py::arg("kind"), py::arg("codes"), py::arg("scales"), py::arg("zeros"), py::arg("group"),
           py::arg("n_out"), py::arg("k"), py::arg("lanes") = std::vector<torch::Tensor>{})
      .def_readonly("kind", &HeldLinear::kind)
      .def_readonly("codes", &HeldLinear::codes)
      .def_readonly("scales", &HeldLinear::scales)
      .def_readonly("zeros", &HeldLinear::zeros)
      .def_readonly("group", &HeldLinear::group)
      .def_readonly("n_out", &HeldLinear::n_out)
      .def_readonly("k", &HeldLinear::k);
  py::class_<LayerStack>(m, "LayerStack", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t>(), py::kw_only(), py::arg("n_heads"),
           py::arg("n_kv"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"), py::arg("act"))
      .def("add", &LayerStack::add, py::kw_only(), py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("attn_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("post_attn_norm"), py::arg("ffn_norm"),
           py::arg("post_ffn_norm"), py::arg("cos"), py::arg("sin"), py::arg("window"), py::arg("qkv_bias") = py::none())
      .def("gemma4", &LayerStack::gemma4, py::kw_only(), py::arg("n_heads"), py::arg("n_kv"), py::arg("head_dim"),
           py::arg("kv_layer"), py::arg("kv_mode"), py::arg("inp_gate"), py::arg("inp_proj"), py::arg("inp_post_norm"),
           py::arg("out_scale"))
      .def("pin", &LayerStack::pin, py::kw_only(), py::arg("int8"), py::arg("threads"))
      .def("run", &LayerStack::run, no_gil())
      .def("run_ragged", &LayerStack::run_ragged, no_gil(), py::kw_only(), py::arg("x"), py::arg("counts"),
           py::arg("starts"), py::arg("keys"), py::arg("values"));
  // The codes the calls above take, for outrider.native.codes's test (Python keeps its own copy so that
  // it runs without this module).
  py::dict kinds, acts, kv_modes;
  kinds["q4"] = int(KIND_Q4), kinds["q8"] = int(KIND_Q8), kinds["f32"] = int(KIND_F32), kinds["q5"] = int(KIND_Q5);
  acts["none"] = int(ACT_NONE), acts["silu"] = int(ACT_SILU), acts["gelu_tanh"] = int(ACT_GELU_TANH);
  kv_modes["own"] = int(KV_OWN), kv_modes["k_is_v"] = int(KV_K_IS_V), kv_modes["shared"] = int(KV_SHARED);
  m.attr("WEIGHT_KINDS") = kinds;
  m.attr("ACTIVATIONS") = acts;
  m.attr("KV_MODES") = kv_modes;
  m.attr("KEY_BLOCK") = py::int_(KEY_BLOCK);
  // int8 activations: whether this build has the kernels, and whether they are this CPU's faster choice
  // (AVX2 without AVX-512, and AVX512-VNNI).
  m.attr("HAS_INT8_KERNELS") = py::bool_(HAS_INT8_KERNELS);
  m.attr("PREFERS_INT8") = py::bool_(PREFERS_INT8);
  m.attr("HAS_LANE_TILES") = py::bool_(HAS_LANE_TILES);
  m.attr("FACTORED_SCALES") = py::bool_(FACTORED_SCALES);
  m.attr("SIX_BIT_LANES") = py::bool_(SIX_BIT_LANES);
  m.attr("HAS_DPBUSD256") = py::bool_(HAS_DPBUSD256);  // 256-bit dpbusd in the AVX2 tiles (else maddubs + madd)
  m.attr("HAS_AMX_TILES") = py::bool_(amx_tiles_granted());
  m.def("set_amx_min_rows", &set_amx_min_rows, "lane tiles of at least this many rows take AMX (0: none); returns the last");
  m.def("set_int8_activations", &set_int8_activations, "quantized weights meet int8 (true) or float32 activations");
  m.def("int8_activations", &int8_activations);
}
