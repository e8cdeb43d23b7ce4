"""Gemma 3 as llama.cpp reads it from GGUF: interleaved sliding-window (local) and global layers,
each with its own rotary base; q/k norms; norms after attention and after the FFN; scaled embeddings."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ModelFileError
from ..gguf_file import GGUFFile
from ..kv_cache import KVCache
from .layers import Rotary, attention, rms_norm

LOCAL_ROPE_BASE = 10000.0  # llama.cpp hard-codes the local layers' base; GGUF stores only the global one
DEFAULT_SWA_PERIOD = 6  # five local layers, then one global


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
        n_layers = int(g.require("block_count"))
        head_dim = int(g.arch_key("attention.key_length", 256))
        if int(g.arch_key("attention.value_length", head_dim)) != head_dim:
            raise ModelFileError(f"{g.path}: key_length != value_length is not supported for gemma3")
        if g.arch_key("attn_logit_softcapping"):
            raise ModelFileError(f"{g.path}: attention logit softcapping is not supported; gemma3 files do not set it "
                                 "(this looks like a gemma2 file with the wrong architecture)")
        scaling = str(g.arch_key("rope.scaling.type", "none"))
        if scaling not in ("none", "linear"):
            raise ModelFileError(f"{g.path}: rope scaling '{scaling}' is not supported for gemma3 (only linear)")
        factor = float(g.arch_key("rope.scaling.factor", 1.0) or 1.0) if scaling == "linear" else 1.0
        window = int(g.arch_key("attention.sliding_window", 0))
        pattern = g.arch_key("attention.sliding_window_pattern")
        if window <= 0:
            is_local = (False,) * n_layers
        elif isinstance(pattern, list):
            is_local = tuple(bool(p) for p in pattern)
        else:
            period = int(pattern or DEFAULT_SWA_PERIOD)
            is_local = tuple(i % period < period - 1 for i in range(n_layers))
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
            rope_freq_scale=1.0 / factor,
            sliding_window=window,
            is_local=is_local,
            attention_scale=1.0 / math.sqrt(scale_dim),
            final_logit_softcap=float(g.arch_key("final_logit_softcapping", 0.0) or 0.0),
            context_length=int(g.require("context_length")),
        )


class _Layer:
    def __init__(self, g: GGUFFile, i: int, dtype: torch.dtype, device):
        def load(name: str) -> torch.Tensor:
            return g.load(f"blk.{i}.{name}.weight").to(dtype).to(device)

        self.wqkv = torch.cat([load("attn_q"), load("attn_k"), load("attn_v")])
        self.wo = load("attn_output")
        self.w_gate_up = torch.cat([load("ffn_gate"), load("ffn_up")])
        self.w_down = load("ffn_down")
        self.attn_norm, self.q_norm, self.k_norm = load("attn_norm"), load("attn_q_norm"), load("attn_k_norm")
        self.post_attn_norm, self.ffn_norm = load("post_attention_norm"), load("ffn_norm")
        self.post_ffn_norm = load("post_ffw_norm")


class Gemma3:
    architecture = "gemma3"

    def __init__(self, g: GGUFFile, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.config = cfg = Gemma3Config.from_gguf(g)
        self.dtype, self.device = dtype, torch.device(device)
        self.embed = g.load("token_embd.weight").to(dtype).to(device)
        self.output = g.load("output.weight").to(dtype).to(device) if "output.weight" in g.tensors else self.embed
        self.output_norm = g.load("output_norm.weight").to(dtype).to(device)
        self.embed_scale = torch.tensor(math.sqrt(cfg.hidden_size), dtype=dtype)
        self.layers = [_Layer(g, i, dtype, device) for i in range(cfg.n_layers)]
        self.local_rotary = Rotary(cfg.head_dim, LOCAL_ROPE_BASE, cfg.context_length, 1.0, None, dtype, device)
        self.global_rotary = Rotary(cfg.head_dim, cfg.rope_base, cfg.context_length, cfg.rope_freq_scale,
                                    None, dtype, device)

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
        x = self.embed[tokens] * self.embed_scale
        for i, layer in enumerate(self.layers):
            local = cfg.is_local[i]
            rotary = self.local_rotary if local else self.global_rotary
            a = rms_norm(x, layer.attn_norm, cfg.eps)
            q, k, v = F.linear(a, layer.wqkv).split([q_size, kv_size, kv_size], dim=-1)
            q = rms_norm(q.view(t, cfg.n_heads, cfg.head_dim).transpose(0, 1), layer.q_norm, cfg.eps)
            k = rms_norm(k.view(t, cfg.n_kv_heads, cfg.head_dim).transpose(0, 1), layer.k_norm, cfg.eps)
            q, k = rotary(q, start), rotary(k, start)
            v = v.view(t, cfg.n_kv_heads, cfg.head_dim).transpose(0, 1)
            keys, values = cache.write(i, start, k, v)
            o = attention(q, keys, values, start, cfg.attention_scale, cfg.sliding_window if local else None)
            x = x + rms_norm(F.linear(o.transpose(0, 1).reshape(t, q_size), layer.wo), layer.post_attn_norm, cfg.eps)
            f = rms_norm(x, layer.ffn_norm, cfg.eps)
            gate, up = F.linear(f, layer.w_gate_up).chunk(2, dim=-1)
            f = F.linear(F.gelu(gate, approximate="tanh") * up, layer.w_down)
            x = x + rms_norm(f, layer.post_ffn_norm, cfg.eps)
        cache.length = start + t
        h = rms_norm(x, self.output_norm, cfg.eps)
        logits = F.linear(h, self.output).float()
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return (logits, h) if hidden else logits
