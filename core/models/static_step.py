"""Decode and verify forwards of fixed shape, so a GPU can replay them as CUDA graphs.

Eager PyTorch spends most of a small decode step launching kernels; a CUDA graph replays the whole step's
kernels in one launch, but only if every shape and address is fixed. So a step here takes its positions as
a device tensor (rotary rows and cache slots are gathered and scattered by index), attends over the whole
preallocated cache with a mask (not over a slice that grows), and runs a fixed number of rows: a forward
over T <= 16 tokens is padded up to the next bucket. Padded rows sit after the real ones, so causal
attention keeps them out of the real rows, and they write only cache slots at positions >= start + T,
which are garbage by the cache's own contract (`outrider.models.kv_cache`); the cache has `slack` slots past
`max_len` so padding never runs off its end.

`StaticStepModel` wraps an architecture's model: prompts (and anything longer than the largest bucket) run
the model's own eager forward into the same cache; steps of up to 16 tokens run the fixed-shape step, on a
GPU captured once per (cache, bucket) and replayed. On the CPU the same step runs eagerly, which is how its
logic is tested without a GPU. Nothing in a step reads a value back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from outrider.models.kv_cache import KVCache
from outrider.models.layers import attention
from outrider.models.linear import rms_norm
from outrider.models.stack import decoder_layer

ROW_BUCKETS = (1, 2, 4, 8, 16)  # rows a step is padded to: k + 1 = 1..16 verify shapes in five graphs
STATIC_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")  # whose forward `StaticStepModel.step` reproduces
WARMUP_RUNS = 2  # eager runs on a side stream before capture (cuBLAS and allocator setup stay out of the graph)


class StaticKVCache(KVCache):
    """A `KVCache` with `slack` slots past `max_len` for padded rows, and the CUDA graphs captured
    against its buffers (a graph replays fixed addresses, so it belongs to one cache)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, slack: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(n_layers, n_kv_heads, head_dim, max_len + slack, dtype, device)
        self.max_len, self.slack = max_len, slack
        self.key_positions = torch.arange(max_len + slack, device=device)
        self.graphs: dict[int, CapturedStep] = {}


@dataclass
class CapturedStep:
    graph: "torch.cuda.CUDAGraph"
    tokens: torch.Tensor  # [bucket] input buffer
    positions: torch.Tensor  # [bucket] input buffer
    logits: torch.Tensor  # [bucket, vocab] output buffer, overwritten by every replay
    hidden: torch.Tensor  # [bucket, hidden_size]


def bucket_for(t: int, buckets: tuple[int, ...] = ROW_BUCKETS) -> int | None:
    """The smallest bucket holding t rows, or None when t exceeds them all."""
    return next((b for b in buckets if b >= t), None)


class StaticStepModel:
    """`forward(tokens, start, cache, hidden, last_only)` as the wrapped model's, with decode and verify
    steps of fixed shape (CUDA graphs with `graphs`); every other attribute is the wrapped model's."""

    def __init__(self, model, buckets: tuple[int, ...] = ROW_BUCKETS, graphs: bool | None = None):
        if model.architecture not in STATIC_ARCHITECTURES:
            raise ValueError(f"no fixed-shape step for architecture '{model.architecture}'")
        self.model, self.buckets = model, tuple(sorted(buckets))
        self.device = model.device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        scale = getattr(model, "embed_scale", None)
        self.embed_scale = None if scale is None else scale.to(self.device)
        self.rows = torch.arange(self.buckets[-1], device=self.device)
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None

    def __getattr__(self, name: str):
        if name == "model":  # not set yet (copy, unpickling): no delegation, no recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    def new_cache(self, max_len: int | None = None) -> StaticKVCache:
        a = self.model.attention
        return StaticKVCache(self.model.config.n_layers, a.n_kv_heads, a.head_dim,
                             max_len or self.model.config.context_length, self.buckets[-1], a.cache_dtype,
                             self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache, hidden: bool = False,
                last_only: bool = False):
        t = tokens.shape[0]
        bucket = bucket_for(t, self.buckets)
        if last_only or bucket is None or not isinstance(cache, StaticKVCache) or start + t > cache.max_len:
            return self.model.forward(tokens, start, cache, hidden=hidden, last_only=last_only)
        logits, h = self._run(tokens, start, cache, bucket)
        cache.length = start + t
        logits = logits[:t].to(torch.float32, copy=True)  # a copy: the next replay overwrites the buffer
        return (logits, h[:t].clone()) if hidden else logits

    def _run(self, tokens: torch.Tensor, start: int, cache: StaticKVCache, bucket: int):
        t = tokens.shape[0]
        if not self.graphs:
            return self.step(F.pad(tokens, (0, bucket - t)), start + self.rows[:bucket], cache)
        captured = cache.graphs.get(bucket) or self._capture(cache, bucket)
        captured.tokens[:t].copy_(tokens, non_blocking=True)  # rows past t keep old ids: padding, never read
        torch.add(self.rows[:bucket], start, out=captured.positions)
        captured.graph.replay()
        return captured.logits, captured.hidden

    def _capture(self, cache: StaticKVCache, bucket: int) -> CapturedStep:
        # Warm-up runs execute for real: they write only the slack slots past max_len, never live entries.
        tokens = torch.zeros(bucket, dtype=torch.long, device=self.device)
        positions = cache.max_len + self.rows[:bucket].clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.step(tokens, positions, cache)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, h = self.step(tokens, positions, cache)
        cache.graphs[bucket] = captured = CapturedStep(graph, tokens, positions, logits, h)
        return captured

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache):
        """(logits [B, vocab], final-normed hidden [B, hidden]) for tokens at `positions` (a device tensor):
        the wrapped model's `_hidden` and head, with `static_attention` in place of its attention."""
        m, stack = self.model, self.model.stack
        x = m.embed(tokens)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        masks = {w: self._mask(positions, cache, w) for w in {l.window for l in stack.layers}}
        for i, l in enumerate(stack.layers):
            attend = lambda qkv: self.static_attention(qkv, i, positions, cache, l, masks[l.window])
            x = decoder_layer(l, x, attend, stack.eps, stack.act)
        h = rms_norm(x, m.output_norm, m.config.eps)
        return m.output(h, softcap=m.logit_softcap), h

    @staticmethod
    def _mask(positions: torch.Tensor, cache: StaticKVCache, window: int | None) -> torch.Tensor:
        q_pos, k_pos = positions[:, None], cache.key_positions[None, :]
        mask = k_pos <= q_pos
        return mask & (q_pos - k_pos < window) if window is not None else mask

    def static_attention(self, qkv: torch.Tensor, layer: int, positions: torch.Tensor, cache: StaticKVCache,
                         l, mask: torch.Tensor) -> torch.Tensor:
        a = self.model.attention
        t, n_q, n_qk = qkv.shape[0], a.n_heads, a.n_heads + a.n_kv_heads
        qkv = qkv.view(t, n_qk + a.n_kv_heads, a.head_dim)
        q, k = qkv[:, :n_q], qkv[:, n_q:n_qk]
        if l.q_norm is not None:
            q, k = rms_norm(q, l.q_norm, a.eps), rms_norm(k, l.k_norm, a.eps)
        table = l.rotary
        rows = positions.clamp(max=table.cos.shape[0] - 1)  # padded rows may lie past the table: garbage anyway
        qk = torch.cat([q, k], dim=1)
        qk = (qk * table.cos[rows, None] + torch.roll(qk, table.half, dims=-1) * table.sin[rows, None]).transpose(0, 1)
        keys, values = cache.keys[layer], cache.values[layer]
        keys.index_copy_(1, positions, qk[n_q:].to(keys.dtype))
        values.index_copy_(1, positions, qkv[:, n_qk:].transpose(0, 1).to(values.dtype))
        return attention(qk[:n_q], keys, values, 0, mask, a.scale)
