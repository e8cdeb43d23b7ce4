"""Gemma 4 as llama.cpp reads it from GGUF (`general.architecture = gemma4`), text only.

What sets it apart from Gemma 3:
- sliding-window and global layers have their own head dims, kv head counts and RoPE (the global layers'
  "proportional" RoPE rotates only the first quarter of each half: the file's `rope_freqs` stops the rest);
- attention scale 1 (q and k are RMS-normed per head), and V is RMS-normed without a weight;
- `attention_k_eq_v`: global layers without `attn_v` use the K projection (before its norm) as V;
- norm weights are used as stored (no +1), each layer's output is scaled by `layer_output_scale`;
- E2B/E4B: per-layer input embeddings (a second, per-layer token table plus a projection of the input
  embedding, fed into every layer after its FFN) and KV-sharing layers (the last `shared_kv_layers` layers
  compute no K/V and read the cache of the last earlier layer of their own kind), with a double-wide MLP;
- 26B-A4B: a routed mixture of experts beside each layer's dense MLP.
Everything the file's `gemma4.*` metadata sets is honoured, or the file is refused in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from outrider.errors import ModelFileError, OutriderError
from outrider.io.gguf import GGUFFile, dequantize
from outrider.models.decoder import Decoder
from outrider.models.kv_cache import KVCache
from outrider.models.layers import ATTENTION_DTYPE, Rotary, attention, attention_mask
from outrider.models.linear import ACTIVATIONS, NATIVE_ACT, PackedLinear, int8_code, rms_norm
from outrider.models.stack import add_layer, attention_half, mlp_half
from outrider.models.weight_forms import load_linear
from outrider.native.codes import KV_MODES

# `gemma4.*` keys this file reads; any other key under the prefix is refused (it would change the model).
KNOWN_KEYS = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "rope.freq_base", "rope.freq_base_swa", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "attention.key_length_swa", "attention.value_length_swa",
    "final_logit_softcapping", "attention.sliding_window", "attention.shared_kv_layers",
    "embedding_length_per_layer_input", "attention.sliding_window_pattern", "rope.dimension_count",
    "rope.dimension_count_swa", "expert_count", "expert_used_count", "expert_feed_forward_length", "vocab_size",
})
KV_OWN, KV_K_IS_V, KV_SHARED = (KV_MODES[name] for name in ("own", "k_is_v", "shared"))  # the attend's kv_mode
ACT = "gelu_tanh"  # llama.cpp's LLM_FFN_GELU is ggml_gelu, the tanh approximation; HF's gelu_pytorch_tanh


def _per_layer(value, n: int, what: str, path) -> tuple[int, ...]:
    if isinstance(value, list):
        if len(value) != n:
            raise ModelFileError(f"{path}: gemma4.{what} has {len(value)} entries for {n} layers; the file is corrupt")
        return tuple(int(v) for v in value)
    return (int(value),) * n


@dataclass(frozen=True)
class Gemma4Config:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: tuple[int, ...]
    n_kv_heads: tuple[int, ...]
    head_dim: tuple[int, ...]
    ffn_size: tuple[int, ...]
    eps: float
    rope_base: float  # global layers
    rope_base_swa: float
    sliding_window: int
    is_local: tuple[bool, ...]
    final_logit_softcap: float
    context_length: int
    per_layer_input_size: int  # 0: no per-layer input embeddings
    kv_source_layer: tuple[int, ...]  # the layer whose K/V layer i reads (i itself unless it shares)
    n_experts: int
    n_experts_used: int
    expert_ffn_size: int

    @property
    def n_kv_layers(self) -> int:
        """Layers that compute and cache K/V (the first ones; the rest share)."""
        return sum(1 for i, src in enumerate(self.kv_source_layer) if src == i)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Gemma4Config":
        path = g.path
        unknown = sorted(k[len("gemma4."):] for k in g.metadata
                         if k.startswith("gemma4.") and k[len("gemma4."):] not in KNOWN_KEYS)
        if unknown:
            raise ModelFileError(f"{path}: gemma4 metadata key gemma4.{unknown[0]} is not supported by Outrider; "
                                 "convert the model with llama.cpp's convert_hf_to_gguf.py without it")
        n = int(g.require("block_count"))
        pattern = g.require("attention.sliding_window_pattern")
        if not isinstance(pattern, list) or len(pattern) != n:
            raise ModelFileError(f"{path}: gemma4.attention.sliding_window_pattern must list one flag per layer")
        is_local = tuple(bool(p) for p in pattern)
        hd_full, hd_swa = int(g.require("attention.key_length")), int(g.require("attention.key_length_swa"))
        if int(g.arch_key("attention.value_length", hd_full)) != hd_full or \
                int(g.arch_key("attention.value_length_swa", hd_swa)) != hd_swa:
            raise ModelFileError(f"{path}: gemma4 needs value_length == key_length (llama.cpp refuses it too)")
        if int(g.arch_key("rope.dimension_count", hd_full)) != hd_full:
            raise ModelFileError(f"{path}: gemma4.rope.dimension_count must equal key_length (the global layers' "
                                 "partial rotation is carried by rope_freqs)")
        if int(g.arch_key("rope.dimension_count_swa", hd_swa)) != hd_swa:
            raise ModelFileError(f"{path}: partial rotary on sliding layers (rope.dimension_count_swa != "
                                 "key_length_swa) is not supported")
        n_shared = int(g.arch_key("attention.shared_kv_layers", 0))
        first_shared = n - n_shared
        sources = list(range(n))
        for i in range(first_shared, n):
            earlier = [j for j in range(first_shared) if is_local[j] == is_local[i]]
            if not earlier:
                raise ModelFileError(f"{path}: layer {i} shares K/V but no earlier layer of its kind computes them")
            sources[i] = earlier[-1]
            # llama.cpp's rule (last kv layer, or the one before for sliding layers) must name the same layer
            if sources[i] != first_shared - (2 if is_local[i] else 1):
                raise ModelFileError(f"{path}: layer {i}'s shared K/V source differs between llama.cpp and "
                                     "transformers for this layer pattern; such a file is not supported")
        window = int(g.require("attention.sliding_window"))
        if any(is_local) and window <= 0:
            raise ModelFileError(f"{path}: gemma4 has sliding layers but attention.sliding_window is {window}")
        n_experts, n_used = int(g.arch_key("expert_count", 0)), int(g.arch_key("expert_used_count", 0))
        if any(name.endswith("ffn_gate_inp.weight") for name in g.tensors) and not 0 < n_used <= n_experts:
            raise ModelFileError(f"{path}: gemma4 experts need 0 < expert_used_count ({n_used}) <= expert_count "
                                 f"({n_experts}); the file is corrupt")
        vocab = g.tensors["token_embd.weight"].shape[0]
        if int(g.arch_key("vocab_size", vocab)) != vocab:
            raise ModelFileError(f"{path}: gemma4.vocab_size {g.arch_key('vocab_size')} differs from token_embd's "
                                 f"{vocab} rows; the file is corrupt")
        return cls(
            vocab_size=vocab,
            hidden_size=int(g.require("embedding_length")),
            n_layers=n,
            n_heads=_per_layer(g.require("attention.head_count"), n, "attention.head_count", path),
            n_kv_heads=_per_layer(g.require("attention.head_count_kv"), n, "attention.head_count_kv", path),
            head_dim=tuple(hd_swa if local else hd_full for local in is_local),
            ffn_size=_per_layer(g.require("feed_forward_length"), n, "feed_forward_length", path),
            eps=float(g.require("attention.layer_norm_rms_epsilon")),
            rope_base=float(g.arch_key("rope.freq_base", 1_000_000.0)),
            rope_base_swa=float(g.arch_key("rope.freq_base_swa", 10_000.0)),
            sliding_window=window,
            is_local=is_local,
            final_logit_softcap=float(g.arch_key("final_logit_softcapping", 0.0) or 0.0),
            context_length=int(g.require("context_length")),
            per_layer_input_size=int(g.arch_key("embedding_length_per_layer_input", 0) or 0),
            kv_source_layer=tuple(sources),
            n_experts=n_experts,
            n_experts_used=n_used,
            expert_ffn_size=int(g.arch_key("expert_feed_forward_length", 0)),
        )


class RowTable:
    """Rows of a (possibly quantized) GGUF table, dequantized on demand: E2B's per-layer token table is
    262144 x 8960 and is read a few rows per token, so it stays in the file's memory map."""

    def __init__(self, g: GGUFFile, name: str, dtype: torch.dtype):
        info = g.tensors[name]
        self.g, self.info, self.dtype = g, info, dtype
        self.row_bytes = info.nbytes // info.shape[0]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        raw = self.g.raw(self.info.name).reshape(self.info.shape[0], self.row_bytes)
        rows = np.ascontiguousarray(raw[ids.cpu().numpy()])
        return dequantize(rows.reshape(-1), self.info.type, (len(ids), self.info.shape[1])).to(self.dtype)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], None, eps)


class _Experts:
    """The routed block of a 26B-A4B layer: a softmax router over an RMS-normed, scaled input picks
    `n_used` experts per row, whose weights are renormalized and scaled per expert."""

    def __init__(self, g: GGUFFile, p: str, cfg: Gemma4Config, packed: bool | str, dtype, device):
        load = lambda name: g.load(p + name).to(dtype).to(device)
        # a linear layer like the others, so that packed it gives every row the bits a one-row call does
        self.router = load_linear(g, [p + "ffn_gate_inp.weight"], packed, dtype, device)
        self.router_scale = load("ffn_gate_inp.scale") * cfg.hidden_size ** -0.5
        self.expert_scale = load("ffn_down_exps.scale") if p + "ffn_down_exps.scale" in g.tensors else None
        if p + "ffn_gate_up_exps.weight" in g.tensors:
            self.gate_up = load("ffn_gate_up_exps.weight")  # [n_experts, 2 * ffn, hidden]
        else:
            self.gate_up = torch.cat([load("ffn_gate_exps.weight"), load("ffn_up_exps.weight")], dim=1)
        self.down = load("ffn_down_exps.weight")  # [n_experts, hidden, ffn]
        self.pre_norm = load("pre_ffw_norm_2.weight")
        self.post_norm = load("post_ffw_norm_2.weight")
        self.n_used, self.eps = cfg.n_experts_used, cfg.eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(_rms(x, self.eps) * self.router_scale)
        probs = torch.softmax(scores.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.n_used, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[chosen]
        xe = rms_norm(x, self.pre_norm, self.eps)
        out = torch.zeros_like(x)
        for row in range(x.shape[0]):  # row by row: a row's result must not depend on its neighbours
            for slot in range(self.n_used):
                e = int(chosen[row, slot])
                gate, up = F.linear(xe[row:row + 1], self.gate_up[e]).chunk(2, dim=-1)
                y = F.linear(ACTIVATIONS[ACT](gate) * up, self.down[e])
                out[row:row + 1] += y * weights[row, slot].to(y.dtype)
        return rms_norm(out, self.post_norm, self.eps)

    def tensors(self) -> list[torch.Tensor]:
        return self.router.tensors() + [self.gate_up, self.down, self.pre_norm, self.post_norm]


class _Layer:
    def __init__(self, g: GGUFFile, i: int, cfg: Gemma4Config, packed: bool | str, dtype: torch.dtype, device):
        p = f"blk.{i}."
        has = lambda name: p + name + ".weight" in g.tensors
        linear = lambda *names: load_linear(g, [p + n + ".weight" for n in names], packed, dtype, device)
        norm = lambda name: g.load(p + name + ".weight").to(dtype).to(device)
        self.own_kv = cfg.kv_source_layer[i] == i
        self.window = (cfg.sliding_window or None) if cfg.is_local[i] else None
        if self.own_kv and not has("attn_k"):
            raise ModelFileError(f"{g.path}: layer {i} computes K/V but blk.{i}.attn_k is missing; "
                                 "the file is incomplete")
        if has("attn_qkv"):
            raise ModelFileError(f"{g.path}: fused blk.{i}.attn_qkv is not supported; convert with separate q/k/v")
        # K reused as V where the file has no attn_v (attention_k_eq_v)
        self.k_is_v = self.own_kv and not has("attn_v")
        self.kv_mode = KV_SHARED if not self.own_kv else KV_K_IS_V if self.k_is_v else KV_OWN
        parts = ["attn_q"] + (["attn_k"] if self.own_kv else []) + (["attn_v"] if self.kv_mode == KV_OWN else [])
        self.wqkv = linear(*parts)
        self.wo = linear("attn_output")
        self.q_norm = norm("attn_q_norm")
        self.k_norm = norm("attn_k_norm") if self.own_kv else None
        self.attn_norm, self.post_attn_norm = norm("attn_norm"), norm("post_attention_norm")
        self.ffn_norm, self.post_ffn_norm = norm("ffn_norm"), norm("post_ffw_norm")
        self.w_gate_up = linear("ffn_gate", "ffn_up")
        self.w_down = linear("ffn_down")
        self.experts = None
        if p + "ffn_gate_inp.weight" in g.tensors:
            self.experts = _Experts(g, p, cfg, packed, dtype, device)
            self.post_ffn_norm_1 = norm("post_ffw_norm_1")
        self.out_scale = g.load(p + "layer_output_scale.weight").to(dtype).to(device) \
            if has("layer_output_scale") else None
        if cfg.per_layer_input_size:
            self.inp_gate, self.inp_proj = linear("inp_gate"), linear("proj")
            self.inp_post_norm = norm("post_norm")

    def tensors(self) -> list[torch.Tensor]:
        out = self.wqkv.tensors() + self.wo.tensors() + self.w_gate_up.tensors() + self.w_down.tensors()
        out += [t for t in (self.q_norm, self.k_norm, self.attn_norm, self.post_attn_norm, self.ffn_norm,
                            self.post_ffn_norm, self.out_scale) if t is not None]
        if self.experts is not None:
            out += self.experts.tensors() + [self.post_ffn_norm_1]
        if hasattr(self, "inp_gate"):
            out += self.inp_gate.tensors() + self.inp_proj.tensors() + [self.inp_post_norm]
        return out


class Gemma4(Decoder):
    """`forward` is `Decoder`'s; the layers, the cache (only the layers that compute K/V) and the per-layer
    inputs are Gemma 4's own."""

    architecture = "gemma4"

    def __init__(self, g: GGUFFile, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 native: bool = False, attention_dtype: torch.dtype = ATTENTION_DTYPE, linear_form: str | None = None):
        """`native`: weights packed for the CPU kernels (`outrider.native`); `linear_form` overrides how the
        linear layers are held (`load_linear`: "quantized" on a GPU)."""
        self.config = cfg = Gemma4Config.from_gguf(g)
        self.attention_dtype, self.logit_softcap = attention_dtype, cfg.final_logit_softcap
        form = self._load_ends(g, dtype, device, native, linear_form)
        # rounded to the model dtype first, as the reference implementations do
        self.embed_scale = torch.tensor(math.sqrt(cfg.hidden_size), dtype=dtype)
        self.layers = [_Layer(g, i, cfg, form, dtype, device) for i in range(cfg.n_layers)]
        freq_factors = g.load("rope_freqs.weight") if "rope_freqs.weight" in g.tensors else None
        hd_full = max(cfg.head_dim[i] for i in range(cfg.n_layers) if not cfg.is_local[i]) \
            if not all(cfg.is_local) else None
        hd_swa = next((d for d, local in zip(cfg.head_dim, cfg.is_local) if local), None)
        self.local_rotary = Rotary(hd_swa, cfg.rope_base_swa, cfg.context_length, 1.0, None, dtype, device) \
            if hd_swa else None
        self.global_rotary = Rotary(hd_full, cfg.rope_base, cfg.context_length, 1.0, freq_factors, dtype, device) \
            if hd_full else None
        if cfg.per_layer_input_size:
            self.per_layer_table = RowTable(g, "per_layer_token_embd.weight", dtype)
            self.per_layer_proj = load_linear(g, ["per_layer_model_proj.weight"], form, dtype, device)
            self.per_layer_proj_norm = g.load("per_layer_proj_norm.weight").to(dtype).to(device)
        self._masks: dict[tuple, tuple] = {}
        # the CPU kernels' attention where every head dim suits it; their cache then holds float32 keys transposed
        self.kernels = None
        if native and all(d % 16 == 0 and d <= 1024 for d in cfg.head_dim):
            from outrider import native as native_kernels

            self.kernels = native_kernels.load()
        self.native_stack = self._native_stack()

    def pin_kernels(self, int8: bool | None, threads: int) -> None:
        parts = [self, *self.layers, *(l.experts for l in self.layers if l.experts is not None)]
        for w in (w for part in parts for w in vars(part).values() if isinstance(w, PackedLinear)):
            w.pin(int8, threads)
        if self.native_stack is not None:
            self.native_stack.pin(int8=int8_code(int8), threads=threads)

    def _rotary(self, i: int) -> Rotary:
        return self.local_rotary if self.config.is_local[i] else self.global_rotary

    def _native_stack(self):
        """Every layer in one native call (as for llama and gemma3), where the attention and every linear run
        on the kernels; the routed experts stay in Python."""
        cfg = self.config
        linears = [w for l in self.layers for w in (l.wqkv, l.wo, l.w_gate_up, l.w_down)
                   + ((l.inp_gate, l.inp_proj) if cfg.per_layer_input_size else ())]
        if self.kernels is None or any(l.experts is not None for l in self.layers) or \
                not all(isinstance(w, PackedLinear) for w in linears):
            return None
        stack = self.kernels.LayerStack(n_heads=cfg.n_heads[0], n_kv=cfg.n_kv_heads[0], head_dim=cfg.head_dim[0],
                                        eps=cfg.eps, scale=1.0, act=NATIVE_ACT[ACT])
        for i, l in enumerate(self.layers):
            add_layer(stack, l, self._rotary(i))
            ple = cfg.per_layer_input_size > 0
            stack.gemma4(n_heads=cfg.n_heads[i], n_kv=cfg.n_kv_heads[i], head_dim=cfg.head_dim[i],
                         kv_layer=cfg.kv_source_layer[i], kv_mode=l.kv_mode,
                         inp_gate=l.inp_gate.held() if ple else None, inp_proj=l.inp_proj.held() if ple else None,
                         inp_post_norm=l.inp_post_norm if ple else None, out_scale=l.out_scale)
        return stack

    @property
    def kv_source_layer(self) -> tuple[int, ...]:
        """For each layer, the cache layer it attends over: itself, or (KV-sharing layers) the last earlier
        layer of its kind. `new_cache` holds `config.n_kv_layers` layers, indexed by these numbers."""
        return self.config.kv_source_layer

    batches = False

    def forward_sequences(self, tokens: torch.Tensor, counts: list[int], starts: list[int], caches: list[KVCache],
                          hidden: bool = False):
        raise OutriderError("Gemma 4 runs one sequence at a time (its layers read other layers' K/V and per-layer "
                            "inputs): serve it with -np 1, and give outrider generate one prompt")

    def new_cache(self, max_len: int | None = None) -> KVCache:
        cfg, n = self.config, self.config.n_kv_layers
        native = self.kernels is not None
        return KVCache(n, list(cfg.n_kv_heads[:n]), list(cfg.head_dim[:n]), max_len or cfg.context_length,
                       torch.float32 if native else self.attention_dtype, self.device, keys_transposed=native)

    def _per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor, prompt: bool) -> torch.Tensor:
        """[T, n_layers, per_layer_input_size]: the token's own per-layer rows plus a projection of its input
        embedding, as both references compute them."""
        cfg, size = self.config, self.config.per_layer_input_size
        # the table stays in the file's memory map on the host; only the rows looked up go to x's device
        rows = self.per_layer_table(tokens).to(x.device) * torch.tensor(math.sqrt(size), dtype=self.dtype)
        proj = self.per_layer_proj(x, prompt=prompt) * torch.tensor(cfg.hidden_size ** -0.5, dtype=self.dtype)
        proj = rms_norm(proj.view(-1, cfg.n_layers, size), self.per_layer_proj_norm, cfg.eps)
        return ((proj + rows.view(-1, cfg.n_layers, size)) * torch.tensor(2.0 ** -0.5, dtype=self.dtype)).contiguous()

    def _hidden(self, tokens: torch.Tensor, start: int, cache: KVCache, prompt: bool) -> torch.Tensor:
        cfg, eps = self.config, self.config.eps
        x = self.embed(tokens) * self.embed_scale
        per_layer = self._per_layer_inputs(tokens, x, prompt) if cfg.per_layer_input_size else None
        if self.native_stack is not None:
            x = self.native_stack.run(x, start, cache.keys, cache.values, prompt, per_layer)
        else:
            x = self._layers(x, per_layer, start, cache, prompt)
        cache.length = start + tokens.shape[0]
        return rms_norm(x, self.output_norm, eps)

    def _layers(self, x: torch.Tensor, per_layer: torch.Tensor | None, start: int, cache: KVCache, prompt: bool):
        """The layers one call at a time: the torch path, and the reference the native stack must match."""
        eps = self.config.eps
        self._masks.clear()
        for i, l in enumerate(self.layers):
            x = attention_half(l, x, lambda qkv: self._attend(i, l, qkv, start, cache), eps, prompt)
            if l.experts is None:
                x = mlp_half(l, x, ACT, eps, prompt)
            else:  # the dense MLP and the experts, each post-normed, summed, normed again
                gate_up = l.w_gate_up(x, in_norm=l.ffn_norm, eps=eps, prompt=prompt)
                mlp = l.w_down(gate_up, act=ACT, out_norm=l.post_ffn_norm_1, eps=eps, prompt=prompt)
                x = x + rms_norm(mlp + l.experts(x), l.post_ffn_norm, eps)
            if per_layer is not None:  # act(gate) * per-layer input, as the two halves of one row
                gate = l.inp_gate(x, prompt=prompt)
                x = l.inp_proj(torch.cat([gate, per_layer[:, i]], dim=-1), act=ACT, out_norm=l.inp_post_norm,
                               residual=x, eps=eps, prompt=prompt)
            if l.out_scale is not None:
                x = x * l.out_scale
        return x

    def _attend(self, i: int, l: _Layer, qkv: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
        """Layer i's heads over the cache from its fused projections (its own K/V, or a source layer's)."""
        cfg = self.config
        t, hd, n_q, n_kv = qkv.shape[0], cfg.head_dim[i], cfg.n_heads[i], cfg.n_kv_heads[i]
        rotary, src = self._rotary(i), cfg.kv_source_layer[i]
        if self.kernels is not None:
            return self.kernels.attend(qkv.contiguous(), cache.keys[src], cache.values[src], start, n_q, n_kv, hd,
                                       rotary.cos, rotary.sin, l.q_norm, l.k_norm, cfg.eps, l.window or 0, 1.0,
                                       l.kv_mode, True)
        q = rotary(rms_norm(qkv[:, :n_q * hd].view(t, n_q, hd), l.q_norm, cfg.eps), start)
        if l.own_kv:
            k_raw = qkv[:, n_q * hd:(n_q + n_kv) * hd].view(t, n_kv, hd)
            v = k_raw if l.k_is_v else qkv[:, (n_q + n_kv) * hd:].view(t, n_kv, hd)
            k = rotary(rms_norm(k_raw, l.k_norm, cfg.eps), start)
            keys, values = cache.write(src, start, k.transpose(0, 1), _rms(v, cfg.eps).transpose(0, 1))
        else:
            end = start + t
            keys, values = cache.keys[src][:, :end], cache.values[src][:, :end]
        key = (start, t, l.window)
        if key not in self._masks:
            self._masks[key] = attention_mask(start, t, l.window, qkv.device)
        first_key, mask = self._masks[key]
        return attention(q.transpose(0, 1), keys, values, first_key, mask, 1.0)

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor the model reads per token (the input embeddings are row gathers, so they are left out)."""
        out = self.output.tensors() + [self.output_norm] + [t for layer in self.layers for t in layer.tensors()]
        if self.config.per_layer_input_size:
            out += self.per_layer_proj.tensors() + [self.per_layer_proj_norm]
        return out
