"""Gemma 3 as llama.cpp reads it from GGUF: interleaved sliding-window (local) and global layers,
each with its own rotary base; q/k norms; norms after attention and after the FFN; scaled embeddings."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from outrider.errors import ModelFileError
from outrider.io.gguf import GGUFFile
from outrider.models.decoder import Decoder, rope_freq_scale
from outrider.models.layers import ATTENTION_DTYPE, Attention, Rotary, trunk_layers
from outrider.models.stack import LayerStack, LayerWeights
from outrider.models.weight_forms import load_linear

LOCAL_ROPE_BASE = 10000.0  # llama.cpp hard-codes the local layers' base; GGUF stores only the global one
DEFAULT_SWA_PERIOD = 6  # five local layers, then one global


def local_layers(g: GGUFFile, n: int) -> tuple[bool, ...]:
    """Which of blocks 0..n-1 of `g` are sliding-window (local) ones."""
    pattern = g.arch_key("attention.sliding_window_pattern")
    if int(g.arch_key("attention.sliding_window", 0)) <= 0:
        return (False,) * n
    if isinstance(pattern, list):
        # blocks past the list (an MTP block after the trunk's) continue its period: up to its first global
        listed = [bool(p) for p in pattern[:n]]
        period = next((i + 1 for i, p in enumerate(listed) if not p), DEFAULT_SWA_PERIOD)
        return tuple(listed) + tuple(i % period < period - 1 for i in range(len(listed), n))
    period = int(pattern or DEFAULT_SWA_PERIOD)
    return tuple(i % period < period - 1 for i in range(n))


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    eps: float
    rope_base: float
    rope_freq_scale: float  # global layers only
    sliding_window: int
    is_local: tuple[bool, ...]
    attention_scale: float
    final_logit_softcap: float
    context_length: int

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Gemma3Config":
        hidden, heads = int(g.require("embedding_length")), int(g.require("attention.head_count"))
        n_layers = trunk_layers(g)
        head_dim = int(g.arch_key("attention.key_length", 256))
        if int(g.arch_key("attention.value_length", head_dim)) != head_dim:
            raise ModelFileError(f"{g.path}: key_length != value_length is not supported for gemma3")
        if g.arch_key("attn_logit_softcapping"):
            raise ModelFileError(f"{g.path}: attention logit softcapping is not supported; gemma3 files do not set it "
                                 "(this looks like a gemma2 file with the wrong architecture)")
        window = int(g.arch_key("attention.sliding_window", 0))
        is_local = local_layers(g, n_layers)
        # llama.cpp: the 27B (62 layers) scales by hidden/heads (its query_pre_attn_scalar), others by head_dim.
        scale_dim = hidden // heads if n_layers == 62 else head_dim
        return cls(
            vocab_size=g.tensors["token_embd.weight"].shape[0],
            hidden_size=hidden, n_layers=n_layers, n_heads=heads,
            n_kv_heads=int(g.arch_key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            ffn_size=int(g.require("feed_forward_length")),
            eps=float(g.require("attention.layer_norm_rms_epsilon")),
            rope_base=float(g.arch_key("rope.freq_base", 1_000_000.0)),
            rope_freq_scale=rope_freq_scale(g),
            sliding_window=window,
            is_local=is_local,
            attention_scale=1.0 / math.sqrt(scale_dim),
            final_logit_softcap=float(g.arch_key("final_logit_softcapping", 0.0) or 0.0),
            context_length=int(g.require("context_length")),
        )


class _Layer:
    def __init__(self, g: GGUFFile, i: int, packed: bool | str, dtype: torch.dtype, device):
        p = f"blk.{i}."
        linear = lambda *names: load_linear(g, [p + n + ".weight" for n in names], packed, dtype, device)
        norm = lambda name: g.load(p + name + ".weight").to(dtype).to(device)
        self.wqkv = linear("attn_q", "attn_k", "attn_v")
        self.wo = linear("attn_output")
        self.w_gate_up = linear("ffn_gate", "ffn_up")
        self.w_down = linear("ffn_down")
        self.attn_norm, self.q_norm, self.k_norm = norm("attn_norm"), norm("attn_q_norm"), norm("attn_k_norm")
        self.post_attn_norm, self.ffn_norm, self.post_ffn_norm = norm("post_attention_norm"), norm("ffn_norm"), norm("post_ffw_norm")

    def tensors(self) -> list[torch.Tensor]:
        out = self.wqkv.tensors() + self.wo.tensors() + self.w_gate_up.tensors() + self.w_down.tensors()
        return out + [self.attn_norm, self.q_norm, self.k_norm, self.post_attn_norm, self.ffn_norm, self.post_ffn_norm]


class Gemma3(Decoder):
    architecture = "gemma3"
    activation = "gelu_tanh"

    def __init__(self, g: GGUFFile, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 native: bool = False, attention_dtype: torch.dtype = ATTENTION_DTYPE, linear_form: str | None = None):
        """`native`: weights packed for, and attention run by, the CPU kernels (`outrider.native`);
        `linear_form` overrides how the linear layers are held (`load_linear`: "quantized" on a GPU)."""
        self.config = cfg = Gemma3Config.from_gguf(g)
        form = self._load_ends(g, dtype, device, native, linear_form)
        self.logit_softcap = cfg.final_logit_softcap
        # rounded to the model dtype first, as the reference implementations do
        self.embed_scale = torch.tensor(math.sqrt(cfg.hidden_size), dtype=dtype)
        self.layers = [_Layer(g, i, form, dtype, device) for i in range(cfg.n_layers)]
        self.attention = Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.attention_scale, cfg.eps,
                                   native, attention_dtype)
        self.local_rotary = Rotary(cfg.head_dim, LOCAL_ROPE_BASE, cfg.context_length, 1.0, None, dtype, device)
        self.global_rotary = Rotary(cfg.head_dim, cfg.rope_base, cfg.context_length, cfg.rope_freq_scale,
                                    None, dtype, device)
        self.stack = LayerStack([self._weights(i, l) for i, l in enumerate(self.layers)], self.attention, cfg.eps,
                                self.activation)

    def block(self, g: GGUFFile, i: int) -> LayerWeights:
        """Decoder block `blk.{i}` of `g` held and run as this model's own layers are: an MTP (nextn) block,
        read from this model's file or from a sidecar in its layout (local or global by its index)."""
        local = local_layers(g, i + 1)[i]
        return self._weights(i, _Layer(g, i, self.linear_form, self.dtype, self.device), local)

    def position(self, local: bool):
        """(rotary, window) of a local (sliding-window) or global layer: window None for global ones."""
        if local:
            return self.local_rotary, self.config.sliding_window or None
        return self.global_rotary, None

    def _weights(self, i: int, l: _Layer, local: bool | None = None) -> LayerWeights:
        rotary, window = self.position(self.config.is_local[i] if local is None else local)
        return LayerWeights(l.wqkv, l.wo, l.w_gate_up, l.w_down, l.attn_norm, l.ffn_norm, rotary, window, l.q_norm,
                            l.k_norm, l.post_attn_norm, l.post_ffn_norm)

    def _embedded(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) * self.embed_scale
