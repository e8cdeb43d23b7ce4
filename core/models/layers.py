"""Building blocks shared by the architectures: rotary embeddings, attention, the embedding and head."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from outrider.errors import ModelFileError
from outrider.models.kv_cache import KVCache
from outrider.models.linear import FLOAT_TYPES, rms_norm
from outrider.models.weight_forms import load_linear

ATTENTION_DTYPE = torch.float64  # torch attention and its KV cache with batch_invariant; see attention()
PREFILL_CHUNK = 64  # rows per forward with packed weights (see run_in_chunks)


class Rotary:
    """NEOX-style rotary embedding (pairs i, i + d/2), with cos/sin tabulated for every position.

    Stored as full-width tables so that one rotation is x * cos + roll(x, d/2) * sin: four ops for the
    queries and keys of a layer together (the native kernel reads the same tables)."""

    def __init__(self, head_dim: int, base: float, max_len: int, freq_scale: float = 1.0,
                 freq_factors: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double()
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64) * freq_scale, inv_freq)
        self.half = head_dim // 2
        self.cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype).to(device).contiguous()
        self.sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(dtype).to(device).contiguous()

    def __call__(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x: [T, heads, head_dim] for positions start..start+T-1."""
        t = x.shape[0]
        cos, sin = self.cos[start:start + t, None], self.sin[start:start + t, None]
        return x * cos + torch.roll(x, self.half, dims=-1) * sin


def attention_mask(start: int, t: int, window: int | None, device) -> tuple[int, torch.Tensor | None]:
    """(first key position to read, boolean mask [T, keys] or None) for queries at start..start+T-1.

    With `window`, a query at position p sees keys at positions > p - window only; keys that no query in
    the block can see are not read at all."""
    first_key = max(0, start - window + 1) if window is not None else 0
    if t == 1:
        return first_key, None  # a single query sees every key from first_key on
    q_pos = torch.arange(start, start + t, device=device)[:, None]
    k_pos = torch.arange(first_key, start + t, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    return first_key, mask


def chain_mask(t: int, depth: int, window: int | None, device) -> torch.Tensor:
    """Which keys rows at depth `depth` of draft chains see, over the keys of depths 1..depth side by side
    [T, depth * T]. Row p at depth d is the d-th draft of the chain seeded at row n = p - d + 1: as the drafter's
    cache holds it then, it sees depth 1's rows 0..n (made from the target's hidden states) and the chain's
    rows n + 1..p, one from each depth 2..d. Rows p < d - 1 (no such chain) see what of this exists, so no row
    is empty. Depth 1 is the causal mask."""
    p = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    blocks = [j <= p - depth + 1] + [j == p - depth + s for s in range(2, depth + 1)]
    if window is not None:
        blocks = [b & (p - j < window) for b in blocks]
    return torch.cat(blocks, dim=1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_key: int, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """q [heads, T, d] over k, v [kv_heads, end, d] from `first_key` on; returns [T, heads * d].

    Computed in the cache's dtype, float64 with `batch_invariant`: in float32, SDPA's result for one
    query moves by ~1e-7 with the number of queries in the call (its blocking), which can turn into a
    different token at a near-tie. Rounded back from float64, a query's output does not depend on its
    neighbours, so a verify pass over k+1 tokens gives the logits of k+1 single steps."""
    k, v = k[:, first_key:], v[:, first_key:]
    out = F.scaled_dot_product_attention(q.to(k.dtype).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[0] != k.shape[0])
    return out[0].transpose(0, 1).reshape(q.shape[1], -1).to(q.dtype)


class Attention:
    """A layer's attention from its fused q/k/v projection [T, (heads + 2 kv_heads) * head_dim]: optional
    per-head RMS norms of q and k (Gemma), rotary, the cache write, causal (optionally windowed)
    attention. With `native` (and a head_dim the kernel takes) it is one call to the CPU kernel, which
    computes every query on its own in float32 (batch invariant by construction) over a cache with keys
    held transposed; otherwise torch ops, over a cache in `torch_dtype`. `new_cache` makes the cache the
    chosen path reads."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, scale: float, eps: float, native: bool,
                 torch_dtype: torch.dtype):
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale, self.eps = scale, eps
        self.kernels = None
        if native and head_dim % 16 == 0:
            from outrider import native as native_kernels

            self.kernels = native_kernels.load()
        self.cache_dtype = torch.float32 if self.kernels is not None else torch_dtype
        self._masks: dict[tuple, tuple[int, torch.Tensor | None]] = {}  # this forward's, shared by its layers

    def new_cache(self, n_layers: int, max_len: int, device) -> KVCache:
        return KVCache(n_layers, self.n_kv_heads, self.head_dim, max_len, self.cache_dtype, device,
                       keys_transposed=self.kernels is not None)

    def __call__(self, qkv: torch.Tensor, layer: int, start: int, cache, rotary: Rotary,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 window: int | None = None) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.attend(qkv, cache.keys[layer], cache.values[layer], start, self.n_heads,
                                       self.n_kv_heads, self.head_dim, rotary.cos, rotary.sin, q_norm, k_norm,
                                       self.eps, window or 0, self.scale, 0, False)
        q, k, v = self._heads(qkv, start, rotary, q_norm, k_norm)
        keys, values = cache.write(layer, start, k, v)
        first_key, mask = self._mask(start, qkv.shape[0], window, qkv.device)
        return attention(q, keys, values, first_key, mask, self.scale)

    def over_chain(self, qkv: torch.Tensor, rotary: Rotary, q_norm: torch.Tensor | None,
                   k_norm: torch.Tensor | None, window: int | None, depth_kv: list) -> torch.Tensor:
        """Rows at positions 0..T-1 with no cache, in torch: the differentiable form (the MTP head's training),
        the same equations as `__call__`'s torch path. Depth d = len(depth_kv) + 1 of draft chains trained all
        at once (EAGLE-3's training-time test, `chain_mask`): at depth 1 the rows attend over each other; a
        deeper row reads the shallower depths' keys, which `depth_kv` holds, (k, v) per depth; this depth's
        are appended to it."""
        q, k, v = self._heads(qkv, 0, rotary, q_norm, k_norm)
        depth_kv.append((k, v))
        keys, values = (torch.cat(parts, dim=1) for parts in zip(*depth_kv))
        return attention(q, keys, values, 0, chain_mask(qkv.shape[0], len(depth_kv), window, qkv.device), self.scale)

    def _heads(self, qkv: torch.Tensor, start: int, rotary: Rotary, q_norm, k_norm):
        """(q [heads, T, d], k and v [kv_heads, T, d]) of fused projections: q/k norms (Gemma), then rotary."""
        t, n_q, n_qk = qkv.shape[0], self.n_heads, self.n_heads + self.n_kv_heads
        qkv = qkv.view(t, n_qk + self.n_kv_heads, self.head_dim)
        q, k = qkv[:, :n_q], qkv[:, n_q:n_qk]
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, self.eps), rms_norm(k, k_norm, self.eps)
        qk = rotary(torch.cat([q, k], dim=1), start).transpose(0, 1)
        return qk[:n_q], qk[n_q:], qkv[:, n_qk:].transpose(0, 1)

    def _mask(self, start: int, t: int, window: int | None, device) -> tuple[int, torch.Tensor | None]:
        key = (start, t, window)
        if key not in self._masks:
            if any(k[:2] != (start, t) for k in self._masks):  # a new forward: the old ones are done
                self._masks.clear()
            self._masks[key] = attention_mask(start, t, window, device)
        return self._masks[key]


def run_in_chunks(hidden_fn, tokens: torch.Tensor, start: int, cache, chunk: int, last_only: bool,
                  every_row: bool = False) -> torch.Tensor:
    """Final hidden states of `hidden_fn(tokens, start, cache, prompt)`, `chunk` tokens at a time when `chunk`
    is set, which bounds the memory a long prompt takes. With `last_only`, only the last row is kept (every
    row with `every_row`, for a drafter that reads the prompt's hidden states), so a prefill never pays the
    output head for the whole prompt; such a forward is a prompt, whose rows the linear layers may sum in a
    faster order than one-row steps do (a verify pass needs every row)."""
    t = tokens.shape[0]
    keep_last = last_only and not every_row
    if not chunk or t <= chunk:
        h = hidden_fn(tokens, start, cache, last_only)
        return h[-1:] if keep_last else h
    parts = []
    for i in range(0, t, chunk):
        h = hidden_fn(tokens[i:i + chunk], start + i, cache, last_only)
        parts.append(h)
    return h[-1:] if keep_last else torch.cat(parts)


def trunk_layers(g) -> int:
    """Layers the trunk runs: `block_count` counts the MTP (nextn) blocks too, which come last (llama.cpp)."""
    n_blocks, n_mtp = int(g.require("block_count")), int(g.arch_key("nextn_predict_layers", 0) or 0)
    if not 0 <= n_mtp < n_blocks:
        raise ModelFileError(f"{g.path}: nextn_predict_layers = {n_mtp} must be below block_count = {n_blocks}")
    return n_blocks - n_mtp


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


class TokenEmbedding:
    """Row lookup in the token table: a dense `table`, or the rows of `row_source` (the output head, when the
    file ties them, or a layer holding the table's own quantized codes), dequantized as they are looked up, as
    llama.cpp's get_rows does: a 150k-token table in float32 is most of a gigabyte."""

    def __init__(self, table: torch.Tensor | None, row_source, dtype: torch.dtype):
        self.row_source, self.dtype = row_source, dtype
        self.table = None if table is None else table.to(dtype)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table[tokens]
        return self.row_source.rows(tokens).to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.table is None else [self.table]


def load_ends(g, packed: bool | str, dtype: torch.dtype, device) -> tuple[object, TokenEmbedding, torch.Tensor]:
    """(output head, token embedding, final norm weight): the parts every architecture shares. The head is
    `output.weight`, or the embedding table when the file ties them (then held once, in the head)."""
    tied = "output.weight" not in g.tensors
    head = load_linear(g, ["token_embd.weight" if tied else "output.weight"], packed, dtype, device)
    # a tied head serves the embedding's rows where its form can (int4 tiles cannot: they get a table); an
    # untied quantized table is held in its codes where the native kernels read them
    row_source = head if tied and hasattr(head, "rows") else None
    if row_source is None and packed in (True, "native") and g.tensors["token_embd.weight"].type not in FLOAT_TYPES:
        row_source = load_linear(g, ["token_embd.weight"], packed, dtype, device, lanes=False)
    table = None if row_source is not None else g.load("token_embd.weight").to(device)
    return head, TokenEmbedding(table, row_source, dtype), g.load("output_norm.weight").to(dtype).to(device)
