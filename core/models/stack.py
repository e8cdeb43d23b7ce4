"""The transformer layers of the llama-like architectures, as one object: a list of per-layer weights
(`LayerWeights`) run either by the CPU kernels' `LayerStack` in one native call, or by a Python loop of
`decoder_layer`, the one torch form of a layer: the torch path, the reference the native stack must
match, and what the static (CUDA graph) step, Gemma 4's layers and the MTP head's training call too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from outrider.models.kv_cache import KVCache
from outrider.models.layers import Attention, Rotary
from outrider.models.linear import NATIVE_ACT, PackedLinear, int8_code


@dataclass
class LayerWeights:
    """One pre-norm layer: x += o(attention(qkv(norm(x)) + qkv_bias)), then x += down(act(gate_up(norm(x)))),
    with an optional q/k/v bias (Qwen2), post-norms on each branch (Gemma) and q/k norms (Gemma, Qwen3) inside
    attention."""

    wqkv: object
    wo: object
    w_gate_up: object
    w_down: object
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    rotary: Rotary
    window: int | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None

    def linears(self) -> tuple:
        return self.wqkv, self.wo, self.w_gate_up, self.w_down


def attention_half(l, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor], eps: float,
                   prompt: bool = False) -> torch.Tensor:
    """x + post_norm(o(attend(qkv(norm(x)) + qkv_bias))): `attend` maps the fused q/k/v rows to the heads'
    outputs. The bias goes in as the projection's residual, the one add the native stack makes too."""
    o = attend(l.wqkv(x, in_norm=l.attn_norm, eps=eps, residual=getattr(l, "qkv_bias", None), prompt=prompt))
    return l.wo(o, out_norm=l.post_attn_norm, residual=x, eps=eps, prompt=prompt)


def mlp_half(l, x: torch.Tensor, act: str, eps: float, prompt: bool = False) -> torch.Tensor:
    """x + post_norm(down(act(gate) * up(norm(x))))."""
    gate_up = l.w_gate_up(x, in_norm=l.ffn_norm, eps=eps, prompt=prompt)
    return l.w_down(gate_up, act=act, out_norm=l.post_ffn_norm, residual=x, eps=eps, prompt=prompt)


def decoder_layer(l, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor], eps: float, act: str,
                  prompt: bool = False) -> torch.Tensor:
    """One pre-norm layer `l` (a `LayerWeights`, or anything with its fields) over rows x [T, hidden]. Where
    the rows attend (a KV cache, a static cache, or only each other) is `attend`'s business."""
    return mlp_half(l, attention_half(l, x, attend, eps, prompt), act, eps, prompt)


class LayerStack:
    """`run(x, start, cache, prompt)`: x [T, hidden] at positions start..start+T-1 through every layer,
    writing the cache. Native (one call per forward) when the attention and every linear run on the CPU
    kernels; a Python loop otherwise, or with `native=False`. `run_sequences`: the rows of several sequences,
    each with its own row count, start and cache, in one pass."""

    def __init__(self, layers: list[LayerWeights], attention: Attention, eps: float, act: str,
                 native: bool = True):
        self.layers, self.attention, self.eps, self.act = layers, attention, eps, act
        kernels = attention.kernels
        self.native = None
        if native and kernels is not None and all(isinstance(w, PackedLinear) for l in layers for w in l.linears()):
            self.native = kernels.LayerStack(n_heads=attention.n_heads, n_kv=attention.n_kv_heads,
                                             head_dim=attention.head_dim, eps=eps, scale=attention.scale,
                                             act=NATIVE_ACT[act])
            for l in layers:
                add_layer(self.native, l, l.rotary)

    def pin(self, int8: bool | None, threads: int) -> None:
        """Every run's activations and most threads (`PackedLinear.pin`), the native stack's and each linear's."""
        for l in self.layers:
            for w in l.linears():
                if isinstance(w, PackedLinear):
                    w.pin(int8, threads)
        if self.native is not None:
            self.native.pin(int8=int8_code(int8), threads=threads)

    def run(self, x: torch.Tensor, start: int, cache: KVCache, prompt: bool) -> torch.Tensor:
        if self.native is not None:
            return self.native.run(x, start, cache.keys, cache.values, prompt, None)
        for i, l in enumerate(self.layers):
            attend = lambda qkv: self.attention(qkv, i, start, cache, l.rotary, l.q_norm, l.k_norm, l.window)
            x = decoder_layer(l, x, attend, self.eps, self.act, prompt)
        return x

    def run_sequences(self, x: torch.Tensor, counts: list[int], starts: list[int], caches: list[KVCache]) -> torch.Tensor:
        """Several independent sequences' rows in one pass (a ragged batch): x [N, hidden] holds counts[b] rows of
        sequence b, in order, at positions starts[b].. of caches[b]. The linears read their weights once for all N
        rows (what makes it pay: a decode step is bound by reading them); each sequence's rows attend over its own
        cache. Native: one call, each row bit for bit its own sequence's `run` with prompt=False (a verify pass)."""
        if self.native is not None:
            return self.native.run_ragged(x=x, counts=list(counts), starts=list(starts),
                                          keys=[c.keys for c in caches], values=[c.values for c in caches])
        bounds = [0]
        for n in counts:
            bounds.append(bounds[-1] + n)
        for i, l in enumerate(self.layers):
            def attend(qkv: torch.Tensor) -> torch.Tensor:
                return torch.cat([self.attention(qkv[bounds[b]:bounds[b + 1]], i, starts[b], caches[b], l.rotary,
                                                 l.q_norm, l.k_norm, l.window) for b in range(len(caches)) if counts[b]])
            x = decoder_layer(l, x, attend, self.eps, self.act)
        return x


def add_layer(native_stack, l, rotary: Rotary) -> None:
    """Append layer `l` (a `LayerWeights`, or any layer with its fields and PackedLinear weights) to the
    kernels' `LayerStack`, by field name."""
    native_stack.add(qkv=l.wqkv.held(), o=l.wo.held(), gate_up=l.w_gate_up.held(), down=l.w_down.held(),
                     attn_norm=l.attn_norm, q_norm=l.q_norm, k_norm=l.k_norm, post_attn_norm=l.post_attn_norm,
                     ffn_norm=l.ffn_norm, post_ffn_norm=l.post_ffn_norm, cos=rotary.cos, sin=rotary.sin,
                     window=l.window or 0, qkv_bias=getattr(l, "qkv_bias", None))
