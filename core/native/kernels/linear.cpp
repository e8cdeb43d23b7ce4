// linear(): the norms and activation before a matmul, the matmul this process's activation mode and the
// weight's form choose, and the norm, residual and softcap after it; row lookups of a held weight.

#include <torch/types.h>

#include "api.h"
#include "common.h"
#include "matmul.h"
#include "row_ops.h"
#include "weight_formats.h"

// A held tensor's data as T, its type and layout checked; null where it is empty (a weight without zeros)
template <class T>
static const T* held_as(const torch::Tensor& t, const char* what) {
  constexpr auto type = c10::CppTypeToScalarType<T>::value;
  TORCH_CHECK(!t.numel() || (t.scalar_type() == type && t.is_contiguous()), what, " must be contiguous ", type);
  return t.numel() ? t.data_ptr<T>() : nullptr;
}

static const float* held(const torch::Tensor& t) { return held_as<float>(t, "scales and zeros"); }

// The row form's codes, checked for the type their kind holds (see with_format)
static const void* row_codes(int64_t kind, const torch::Tensor& codes) {
  if (kind == KIND_Q4 || kind == KIND_Q5) return codes.data_ptr<uint8_t>();
  if (kind == KIND_Q8) return codes.data_ptr<int8_t>();
  if (kind == KIND_F32) return codes.data_ptr<float>();
  return codes.data_ptr();
}

// Whether quantized weights meet int8 activations or float32 ones: the process's setting, chosen by the CPU
// backend (`-o backend.activations`, default PREFERS_INT8), for every linear call that names none (int8 = -1);
// a model loaded with its own mode (a draft model beside its target) names it in each call.
static std::atomic<bool> int8_activations_on{PREFERS_INT8};

void set_int8_activations(bool on) {
  TORCH_CHECK(!on || HAS_INT8_KERNELS, "int8 activations need a CPU with AVX2 (this build has no int8 kernels)");
  int8_activations_on.store(on, std::memory_order_relaxed);
}

bool int8_activations() { return int8_activations_on.load(); }

bool call_int8(int64_t int8) {
  TORCH_CHECK(int8 >= -1 && int8 <= 1, "linear: int8 is -1 (the process's setting), 0 or 1, not ", int8);
  TORCH_CHECK(int8 != 1 || HAS_INT8_KERNELS, "int8 activations need a CPU with AVX2 (this build has no int8 kernels)");
  return int8 < 0 ? int8_activations_on.load(std::memory_order_relaxed) : int8 == 1;
}

static const int8_t* held_int8(const torch::Tensor& t) { return held_as<int8_t>(t, "sub-scales and sub-zeros"); }

static const uint16_t* held_f16_bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(held_as<at::Half>(t, "super-scales and super-zeros"));
}

// A lane form's pointers, its sizes checked: 3 tensors (codes, scales, zeros) or 5 (codes, sub-scales,
// sub-zeros, super-scales, super-zeros; see LaneWeights), zeros either empty or all there
static LaneWeights lane_weights(const std::vector<torch::Tensor>& lanes, int64_t kind, int64_t group, int64_t n_out,
                                int64_t k) {
  TORCH_CHECK((lanes.size() == 3 || (FACTORED_SCALES && lanes.size() == 5)) && n_out % 16 == 0,
              "a lane form is 3 tensors (5 with factored scales, F16C builds) over a multiple of 16 rows");
  const int64_t count = n_out * (k / 32) * (kind == KIND_Q8 ? 32 / group : 1);
  TORCH_CHECK(lanes[1].numel() == count && (lanes[2].numel() == 0 || lanes[2].numel() == count),
              "a lane form needs a scale (and zero) per ", kind == KIND_Q8 ? group : 32, " weights of a row");
  if (lanes.size() == 5)
    TORCH_CHECK(k % 256 == 0 && lanes[3].numel() == n_out * (k / 256) &&
                lanes[4].numel() == (lanes[2].numel() ? lanes[3].numel() : 0),
                "factored scales need K a multiple of 256 and a super-scale (and zero) per 256 weights of a row");
  if (lanes.size() == 3) return LaneWeights{lanes[0].data_ptr<uint8_t>(), held(lanes[1]), held(lanes[2])};
  LaneWeights w{lanes[0].data_ptr<uint8_t>(), nullptr, nullptr};
  w.sub_scales = held_int8(lanes[1]), w.sub_zeros = held_int8(lanes[2]);
  w.super_scales = held_f16_bits(lanes[3]), w.super_zeros = held_f16_bits(lanes[4]);
  return w;
}

// The lane tiles' kind of a weight's lane form: KIND_Q6_LANES where a per-16 int8 weight's codes are held in
// six bits (told by their size), else the weight's own
static int64_t lane_kind(int64_t kind, int64_t group, const std::vector<torch::Tensor>& lanes, int64_t n_out,
                         int64_t k) {
  TORCH_CHECK(kind == KIND_Q4 || kind == KIND_Q5 || kind == KIND_Q8, "a lane form of a 4-, 5- or 8-bit weight");
  const int64_t blocks_groups = n_out / 16 * (k / 32);
  if (kind != KIND_Q8 || lanes[0].numel() != blocks_groups * lane_group_bytes(KIND_Q6_LANES)) {
    TORCH_CHECK(lanes[0].numel() == blocks_groups * lane_group_bytes(kind), "a lane form of the wrong size");
    return kind;
  }
  TORCH_CHECK(SIX_BIT_LANES && group == 16, "six-bit lanes of per-16 codes only, in builds that read them (F16C)");
  return KIND_Q6_LANES;
}

static void run_matmul(int64_t kind, const torch::Tensor& codes, const torch::Tensor& scales,
                       const torch::Tensor& zeros, int64_t group, const float* x, int64_t rows, int64_t k, float* y,
                       int64_t n_out, bool prompt, const std::vector<torch::Tensor>& lanes, bool int8) {
  // int8 activations take every row, prompt rows too: a prefill then gives each row the bits a single
  // step would, so replaying a sequence from scratch agrees with decoding it (as float32 nearly does)
  if (int8 && !lanes.empty()) {
    TORCH_CHECK(HAS_LANE_TILES, "linear: this build has no lane tiles");
    return lane_matmul(lane_kind(kind, group, lanes, n_out, k), group, lane_weights(lanes, kind, group, n_out, k), x,
                       rows, k, y, n_out);
  }
  TORCH_CHECK(codes.numel() || kind == KIND_F32, "linear: this weight is held in its lane form only (for int8 "
              "activations); PackedLinear.hold_rows() gives it its row form back");
  if (int8 && kind != KIND_F32 &&
      int8_matmul(kind, group, row_codes(kind, codes), held(scales), held(zeros), x, rows, k, y, n_out))
    return;
  float_matmul(kind, row_codes(kind, codes), held(scales), held(zeros), group, x, rows, k, y, n_out, prompt);
}

// Post steps (see linear): columns per block of a row split across threads, and the output size below
// which they stay on the calling thread.
constexpr int64_t POST_BLOCK = 16384, POST_PARALLEL_MIN = 32768;

// y = post(W @ pre(x)). pre: rms_norm with in_norm, then act(gate) * up over the two halves of x.
// post: rms_norm with out_norm, then + residual, then softcap. kind: see with_format. zeros may be
// empty (int8 only). prompt: the rows need not match one-row calls bit for bit (see panel_matmul,
// float_matmul.cpp). int8: int8 (1) or float32 (0) activations, -1 the process's setting; threads: at most that
// many (0: the whole pool).
torch::Tensor linear(torch::Tensor x, int64_t kind, torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros,
                     int64_t group, int64_t n_out, int64_t k, c10::optional<torch::Tensor> in_norm, double eps,
                     int64_t act, c10::optional<torch::Tensor> residual, c10::optional<torch::Tensor> out_norm,
                     double softcap, bool prompt, const std::vector<torch::Tensor>& lanes, int64_t int8,
                     int64_t threads) {
  const bool int8_on = call_int8(int8);
  ThreadsScope scope(threads);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "linear: x must be contiguous float32");
  TORCH_CHECK(k % 32 == 0, "linear: K must be a multiple of 32");
  int64_t rows = x.numel() / x.size(-1);
  const float* xin = x.data_ptr<float>();
  int64_t width = act != ACT_NONE ? 2 * k : k;
  TORCH_CHECK(x.size(-1) == width, "linear: x has ", x.size(-1), " columns, the weight needs ", width);
  std::vector<float> normed, prepared;
  if (in_norm.has_value()) {
    TORCH_CHECK(in_norm->numel() == width && in_norm->is_contiguous(), "linear: in_norm must have ", width, " values");
    normed.resize(rows * width);
    for (int64_t r = 0; r < rows; ++r)
      rms_norm_row(xin + r * width, in_norm->data_ptr<float>(), static_cast<float>(eps), width, normed.data() + r * width);
    xin = normed.data();
  }
  if (act != ACT_NONE) {
    prepared.resize(rows * k);
    for (int64_t r = 0; r < rows; ++r) glu_row(xin + r * 2 * k, k, static_cast<int>(act), prepared.data() + r * k);
    xin = prepared.data();
  }
  if (residual.has_value())
    TORCH_CHECK(residual->is_contiguous() && residual->scalar_type() == torch::kFloat32 &&
                residual->numel() == rows * n_out, "linear: residual must be contiguous float32 [rows, n_out]");
  auto shape = x.sizes().vec();
  shape.back() = n_out;
  torch::Tensor y = torch::empty(shape, x.options());
  float* out = y.data_ptr<float>();
  run_matmul(kind, codes, scales, zeros, group, xin, rows, k, out, n_out, prompt, lanes, int8_on);
  if (out_norm.has_value() || residual.has_value() || softcap > 0) {
    const float* res = residual.has_value() ? residual->data_ptr<float>() : nullptr;
    // Without a norm the steps are elementwise, so a row may be split into blocks of columns (a multiple
    // of 16 wide: each element takes the vector or scalar path it takes in a whole-row pass), and Gemma's
    // 262k-wide softcapped head row runs on every thread. A small output stays on this thread: waking
    // the others costs more than the steps.
    const int64_t block = out_norm.has_value() ? n_out : POST_BLOCK;
    const int64_t per_row = (n_out + block - 1) / block;
    auto post = [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        int64_t r = b / per_row, c0 = (b % per_row) * block, c1 = std::min(n_out, c0 + block);
        float* yr = out + r * n_out;
        if (out_norm.has_value()) rms_norm_row(yr, out_norm->data_ptr<float>(), static_cast<float>(eps), n_out, yr);
        if (res) for (int64_t i = c0; i < c1; ++i) yr[i] = res[r * n_out + i] + yr[i];
        if (softcap > 0) softcap_row(yr + c0, c1 - c0, static_cast<float>(softcap));
      }
    };
    if (rows * n_out < POST_PARALLEL_MIN) post(0, rows * per_row);
    else kernel_parallel_for(0, rows * per_row, 1, post);
  }
  return y;
}

// Rows `rows` of a weight, dequantized to float32 [len(rows), K] (the token embedding of a tied head).
torch::Tensor dequantize_rows(torch::Tensor rows, int64_t kind, torch::Tensor codes, torch::Tensor scales,
                              torch::Tensor zeros, int64_t group, int64_t k) {
  auto idx = rows.to(torch::kInt64).contiguous();
  int64_t n = idx.numel();
  torch::Tensor out = torch::empty({n, k}, torch::dtype(torch::kFloat32));
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < codes.size(0), "dequantize_rows: row ", ip[i], " out of range");
  float* op = out.data_ptr<float>();
  auto rows_of = [&](const auto& w) {
    RowReader<std::decay_t<decltype(w)>> row{w, k / 32};
    for (int64_t i = 0; i < n; ++i) {
      row.start(ip[i]);
      for (int64_t g = 0; g < k / 32; ++g) {
        v16f a, b;
        row.group(ip[i], g, a, b);
        store16(op + i * k + g * 32, a);
        store16(op + i * k + g * 32 + 16, b);
      }
    }
  };
  with_format(kind, row_codes(kind, codes), held(scales), held(zeros), group, k, rows_of);
  return out;
}

// Rows `rows` of a weight held in its lane form (see "Lane tiles"), back in the row form: codes, scales
// and zeros as PackedLinear holds them, for the row lookups of an embedding and for float32 activations.
std::vector<torch::Tensor> lane_rows(torch::Tensor rows, int64_t kind, std::vector<torch::Tensor> lanes, int64_t group,
                                     int64_t k) {
  TORCH_CHECK(lanes.size() >= 3 && k % 32 == 0, "lane_rows: no lane form");
  const int64_t count = (k / 32) * (kind == KIND_Q8 ? 32 / group : 1);
  const int64_t n_out = lanes[1].numel() / count;
  const LaneWeights w = lane_weights(lanes, kind, group, n_out, k);
  const bool six_bit = lane_kind(kind, group, lanes, n_out, k) == KIND_Q6_LANES;
  auto idx = rows.to(torch::kInt64).contiguous();
  const int64_t n = idx.numel(), groups = k / 32, blocks = n_out / 16;
  const int64_t lane_bytes = lane_group_bytes(six_bit ? KIND_Q6_LANES : kind);
  const int64_t row_bytes = kind == KIND_Q4 ? 16 : kind == KIND_Q5 ? 20 : 32;
  torch::Tensor codes = torch::empty({n, groups * row_bytes}, torch::dtype(kind == KIND_Q8 ? torch::kInt8 : torch::kUInt8));
  torch::Tensor scales = torch::empty({n, count}, torch::dtype(torch::kFloat32));
  torch::Tensor zeros = lanes[2].numel() ? torch::empty({n, count}, torch::dtype(torch::kFloat32)) : torch::empty({0});
  const uint8_t* lc = lanes[0].data_ptr<uint8_t>();
  const bool factored = w.sub_scales != nullptr;
  const int64_t supers = k / 256, per_super = factored ? count / supers : 0;
  const float* as_held[2] = {w.scales, w.zeros};
  const int8_t* sub[2] = {w.sub_scales, w.sub_zeros};
  const uint16_t* super[2] = {w.super_scales, w.super_zeros};
  // scale (0) or zero (1) c of row j of block b: as held, or its factors' product (float32, the same bits)
  auto held_value = [&](int which, int64_t b, int64_t j, int64_t c) {
    if (!factored) return as_held[which][(b * count + c) * 16 + j];
    const c10::Half super_value(super[which][(b * supers + c / per_super) * 16 + j], c10::Half::from_bits());
    return static_cast<float>(sub[which][(b * count + c) * 16 + j]) * static_cast<float>(super_value);
  };
  uint8_t* out = static_cast<uint8_t*>(codes.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = idx.data_ptr<int64_t>()[i], b = row / 16, j = row % 16;
    TORCH_CHECK(row >= 0 && b < blocks, "lane_rows: row ", row, " out of range");
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = lc + (b * groups + g) * lane_bytes;
      uint8_t* o = out + (i * groups + g) * row_bytes;
      if (six_bit) {  // code c: low four bits from register c % 16 / 4's nibbles, bits 4-5 from register c % 16 / 8
        for (int c = 0; c < 32; ++c) {
          const int m = c % 16 / 4, t = c % 4, second = c / 16;
          const int low = (p[64 * m + 4 * j + t] >> (4 * second)) & 15;
          const int high = (p[256 + 64 * (m / 2) + 4 * j + t] >> (4 * (m % 2) + 2 * second)) & 3;
          o[c] = static_cast<uint8_t>(static_cast<int8_t>(low + 16 * high - 32));
        }
        continue;
      }
      if (kind == KIND_Q8) {
        for (int c = 0; c < 32; ++c) o[c] = p[64 * (c / 4) + 4 * j + c % 4] ^ 0x80;
        continue;
      }
      for (int c = 0; c < 16; ++c) o[c] = p[64 * (c / 4) + 4 * j + c % 4];
      if (kind == KIND_Q5) {
        uint32_t word = 0;  // bit c: code c's bit 4
        for (int c = 0; c < 32; ++c) {
          uint64_t mask;
          std::memcpy(&mask, p + 256 + 32 * (c / 16) + 8 * ((c % 16) / 4), 8);
          word |= static_cast<uint32_t>((mask >> (4 * j + c % 4)) & 1) << c;
        }
        std::memcpy(o + 16, &word, 4);
      }
    }
    for (int64_t c = 0; c < count; ++c) {
      scales.data_ptr<float>()[i * count + c] = held_value(0, b, j, c);
      if (lanes[2].numel()) zeros.data_ptr<float>()[i * count + c] = held_value(1, b, j, c);
    }
  }
  return {codes, scales, zeros};
}
