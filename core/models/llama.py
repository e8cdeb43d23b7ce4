"""Llama (SmolLM2, Llama 2/3 and kin) as llama.cpp reads it from GGUF."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outrider.errors import ModelFileError
from outrider.io.gguf import GGUFFile
from outrider.models.decoder import Decoder, rope_freq_scale
from outrider.models.layers import ATTENTION_DTYPE, Attention, Rotary, default_scale, trunk_layers
from outrider.models.stack import LayerStack, LayerWeights
from outrider.models.weight_forms import load_linear


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    eps: float
    rope_base: float
    rope_freq_scale: float
    context_length: int

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "LlamaConfig":
        hidden, heads = int(g.require("embedding_length")), int(g.require("attention.head_count"))
        head_dim = int(g.arch_key("attention.key_length", hidden // heads))
        if int(g.arch_key("rope.dimension_count", head_dim)) != head_dim:
            raise ModelFileError(f"{g.path}: partial rotary (rope.dimension_count != head_dim) is not supported")
        return cls(
            vocab_size=g.tensors["token_embd.weight"].shape[0],
            hidden_size=hidden,
            n_layers=trunk_layers(g),
            n_heads=heads,
            n_kv_heads=int(g.arch_key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            ffn_size=int(g.require("feed_forward_length")),
            eps=float(g.require("attention.layer_norm_rms_epsilon")),
            rope_base=float(g.arch_key("rope.freq_base", 10000.0)),
            rope_freq_scale=rope_freq_scale(g),
            context_length=int(g.require("context_length")),
        )


def unpermute_qk(n_heads: int):
    # convert_hf_to_gguf permutes Q/K rows so ggml's interleaved rope matches HF's rotate_half;
    # undoing it lets llama use the same half-split (NEOX) rotary as every other architecture.
    def rows(w: torch.Tensor) -> torch.Tensor:
        out = w.shape[0]
        return w.reshape(n_heads, out // n_heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)
    return rows


def permute_qk(n_heads: int):
    """convert_hf_to_gguf's permutation itself, the inverse of `unpermute_qk`: rows written back to a GGUF."""
    def rows(w: torch.Tensor) -> torch.Tensor:
        return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, -1).transpose(1, 2).reshape(w.shape)
    return rows


class _Layer:
    def __init__(self, g: GGUFFile, i: int, cfg: LlamaConfig, packed: bool | str, dtype: torch.dtype, device):
        p = f"blk.{i}."
        unpermute = {p + "attn_q.weight": unpermute_qk(cfg.n_heads), p + "attn_k.weight": unpermute_qk(cfg.n_kv_heads)}
        linear = lambda *names: load_linear(g, [p + n + ".weight" for n in names], packed, dtype, device, unpermute)
        self.wqkv = linear("attn_q", "attn_k", "attn_v")
        self.wo = linear("attn_output")
        self.w_gate_up = linear("ffn_gate", "ffn_up")
        self.w_down = linear("ffn_down")
        self.attn_norm = g.load(p + "attn_norm.weight").to(dtype).to(device)
        self.ffn_norm = g.load(p + "ffn_norm.weight").to(dtype).to(device)

    def tensors(self) -> list[torch.Tensor]:
        out = self.wqkv.tensors() + self.wo.tensors() + self.w_gate_up.tensors() + self.w_down.tensors()
        return out + [self.attn_norm, self.ffn_norm]


class Llama(Decoder):
    architecture = "llama"
    activation = "silu"

    def __init__(self, g: GGUFFile, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 native: bool = False, attention_dtype: torch.dtype = ATTENTION_DTYPE, linear_form: str | None = None):
        """`native`: weights packed for, and attention run by, the CPU kernels (`outrider.native`);
        `linear_form` overrides how the linear layers are held (`load_linear`: "quantized" on a GPU)."""
        self.config = cfg = LlamaConfig.from_gguf(g)
        self._refuse_variants(g)
        form = self._load_ends(g, dtype, device, native, linear_form)
        self.layers = [self._layer(g, i, form) for i in range(cfg.n_layers)]
        freq_factors = g.load("rope_freqs.weight") if "rope_freqs.weight" in g.tensors else None
        self.rotary = Rotary(cfg.head_dim, cfg.rope_base, cfg.context_length, cfg.rope_freq_scale,
                             freq_factors, dtype, device)
        self.attention = Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, default_scale(cfg.head_dim), cfg.eps,
                                   native, attention_dtype)
        self.stack = LayerStack([self._weights(l) for l in self.layers], self.attention, cfg.eps, self.activation)

    def _refuse_variants(self, g: GGUFFile) -> None:
        if any(name.endswith(".bias") for name in g.tensors) or any("_exps" in name for name in g.tensors):
            raise ModelFileError(f"{g.path}: llama variants with biases or experts are not supported")

    def _layer(self, g: GGUFFile, i: int, form: bool | str) -> _Layer:
        return _Layer(g, i, self.config, form, self.dtype, self.device)

    def _weights(self, l: _Layer) -> LayerWeights:
        return LayerWeights(l.wqkv, l.wo, l.w_gate_up, l.w_down, l.attn_norm, l.ffn_norm, self.rotary)

    def block(self, g: GGUFFile, i: int) -> LayerWeights:
        """Decoder block `blk.{i}` of `g` held and run as this model's own layers are: an MTP (nextn) block,
        read from this model's file or from a sidecar in its layout."""
        return self._weights(self._layer(g, i, self.linear_form))
