"""Llama (SmolLM2, Llama 2/3 and kin) as llama.cpp reads it from GGUF."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ModelFileError
from ..gguf_file import GGUFFile
from ..kv_cache import KVCache
from .layers import Rotary, attention, default_scale, rms_norm


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
        scaling = str(g.arch_key("rope.scaling.type", "none"))
        if scaling not in ("none", "linear"):
            raise ModelFileError(f"{g.path}: rope scaling '{scaling}' is not supported (only linear); "
                                 "use a model without it")
        factor = float(g.arch_key("rope.scaling.factor", 1.0) or 1.0) if scaling == "linear" else 1.0
        return cls(
            vocab_size=g.tensors["token_embd.weight"].shape[0],
            hidden_size=hidden,
            n_layers=int(g.require("block_count")),
            n_heads=heads,
            n_kv_heads=int(g.arch_key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            ffn_size=int(g.require("feed_forward_length")),
            eps=float(g.require("attention.layer_norm_rms_epsilon")),
            rope_base=float(g.arch_key("rope.freq_base", 10000.0)),
            rope_freq_scale=1.0 / factor,
            context_length=int(g.require("context_length")),
        )


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # convert_hf_to_gguf permutes Q/K rows so ggml's interleaved rope matches HF's rotate_half;
    # undoing it lets llama use the same half-split (NEOX) rotary as every other architecture.
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


class _Layer:
    def __init__(self, g: GGUFFile, i: int, cfg: LlamaConfig, dtype: torch.dtype, device):
        def load(name: str) -> torch.Tensor:
            return g.load(f"blk.{i}.{name}.weight")

        q = _unpermute(load("attn_q"), cfg.n_heads)
        k = _unpermute(load("attn_k"), cfg.n_kv_heads)
        self.wqkv = torch.cat([q, k, load("attn_v")]).to(dtype).to(device)
        self.wo = load("attn_output").to(dtype).to(device)
        self.w_gate_up = torch.cat([load("ffn_gate"), load("ffn_up")]).to(dtype).to(device)
        self.w_down = load("ffn_down").to(dtype).to(device)
        self.attn_norm = load("attn_norm").to(dtype).to(device)
        self.ffn_norm = load("ffn_norm").to(dtype).to(device)


class Llama:
    architecture = "llama"

    def __init__(self, g: GGUFFile, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.config = cfg = LlamaConfig.from_gguf(g)
        self.dtype, self.device = dtype, torch.device(device)
        if any(name.endswith(".bias") for name in g.tensors) or any("_exps" in name for name in g.tensors):
            raise ModelFileError(f"{g.path}: llama variants with biases or experts are not supported")
        self.embed = g.load("token_embd.weight").to(dtype).to(device)
        self.output = g.load("output.weight").to(dtype).to(device) if "output.weight" in g.tensors else self.embed
        self.output_norm = g.load("output_norm.weight").to(dtype).to(device)
        self.layers = [_Layer(g, i, cfg, dtype, device) for i in range(cfg.n_layers)]
        freq_factors = g.load("rope_freqs.weight") if "rope_freqs.weight" in g.tensors else None
        self.rotary = Rotary(cfg.head_dim, cfg.rope_base, cfg.context_length, cfg.rope_freq_scale,
                             freq_factors, dtype, device)
        self.scale = default_scale(cfg.head_dim)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        cfg = self.config
        return KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_len or cfg.context_length, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache, hidden: bool = False):
        """Logits [T, vocab] (float32) for tokens at positions start..start+T-1; with `hidden`, also the
        final-normed hidden states [T, hidden_size]. Writes the cache and sets its length to start+T."""
        cfg = self.config
        t = tokens.shape[0]
        q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            a = rms_norm(x, layer.attn_norm, cfg.eps)
            q, k, v = F.linear(a, layer.wqkv).split([q_size, kv_size, kv_size], dim=-1)
            q = self.rotary(q.view(t, cfg.n_heads, cfg.head_dim).transpose(0, 1), start)
            k = self.rotary(k.view(t, cfg.n_kv_heads, cfg.head_dim).transpose(0, 1), start)
            v = v.view(t, cfg.n_kv_heads, cfg.head_dim).transpose(0, 1)
            keys, values = cache.write(i, start, k, v)
            o = attention(q, keys, values, start, self.scale)
            x = x + F.linear(o.transpose(0, 1).reshape(t, q_size), layer.wo)
            f = rms_norm(x, layer.ffn_norm, cfg.eps)
            gate, up = F.linear(f, layer.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.w_down)
        cache.length = start + t
        h = rms_norm(x, self.output_norm, cfg.eps)
        logits = F.linear(h, self.output).float()
        return (logits, h) if hidden else logits
