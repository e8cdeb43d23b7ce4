"""Building blocks shared by the architectures: RMS norm, rotary embeddings, attention, the output head."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .linear import DenseLinear, Int8Linear, load_linear

ATTENTION_DTYPE = torch.float64  # attention and the KV cache with batch_invariant (the default); see attention()
PREFILL_CHUNK = 32  # rows per forward for compact weights (see run_in_chunks)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # GGUF norm weights are used as stored: Gemma's converter already folded in the +1.
    return F.rms_norm(x, weight.shape, weight, eps)


class Rotary:
    """NEOX-style rotary embedding (pairs i, i + d/2), with cos/sin tabulated for every position.

    Stored as full-width tables so that one rotation is x * cos + roll(x, d/2) * sin: four ops for the
    queries and keys of a layer together."""

    def __init__(self, head_dim: int, base: float, max_len: int, freq_scale: float = 1.0,
                 freq_factors: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double()
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64) * freq_scale, inv_freq)
        self.half = head_dim // 2
        self.cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype).to(device)
        self.sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(dtype).to(device)

    def __call__(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x: [T, heads, head_dim] for positions start..start+T-1."""
        t = x.shape[0]
        cos, sin = self.cos[start:start + t, None], self.sin[start:start + t, None]
        return x * cos + torch.roll(x, self.half, dims=-1) * sin


def attention_mask(start: int, t: int, window: int | None, device) -> tuple[int, torch.Tensor | None]:
    """(first key position to read, boolean mask [T, keys] or None) for queries at start..start+T-1.

    With `window`, a query at position p sees keys at positions > p - window only; keys that no query in
    the block can see are not read at all. Built once per forward and shared by every layer of a kind."""
    first_key = max(0, start - window + 1) if window is not None else 0
    if t == 1:
        return first_key, None  # a single query sees every key from first_key on
    q_pos = torch.arange(start, start + t, device=device)[:, None]
    k_pos = torch.arange(first_key, start + t, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    return first_key, mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_key: int, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """q [heads, T, d] over k, v [kv_heads, end, d] from `first_key` on; returns [T, heads * d].

    Computed in the cache's dtype, float64 by default: in float32, SDPA's result for one query moves by ~1e-7 with the number of queries
    in the call (its blocking), and the bfloat16 rounding in front of the next int kernel can turn that
    into a different token at a near-tie. Rounded back from float64, a query's output does not depend on
    its neighbours, so a verify pass over k+1 tokens gives bit for bit the logits of k+1 single steps
    (the weight-only int kernels are row-independent already), and greedy speculative decoding stays
    identical to plain decoding. k and v come from a cache held in float64 (`batch_invariant`); it costs
    about 5% of decode speed at 300 tokens of context and 20% at 700, measured on SmolLM2."""
    k, v = k[:, first_key:], v[:, first_key:]
    out = F.scaled_dot_product_attention(q.to(k.dtype).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[0] != k.shape[0])
    return out[0].transpose(0, 1).reshape(q.shape[1], -1).to(q.dtype)


def run_in_chunks(hidden_fn, tokens: torch.Tensor, start: int, cache, chunk: int, last_only: bool) -> torch.Tensor:
    """Final hidden states of `hidden_fn(tokens, start, cache)`, `chunk` tokens at a time when `chunk` is set:
    torch's weight-only int kernels are fast for a few rows and slow down per row on long prompts. With
    `last_only`, only the last row is kept, so a prefill never pays the output head for the whole prompt."""
    t = tokens.shape[0]
    if not chunk or t <= chunk:
        h = hidden_fn(tokens, start, cache)
        return h[-1:] if last_only else h
    parts = []
    for i in range(0, t, chunk):
        h = hidden_fn(tokens[i:i + chunk], start + i, cache)
        parts.append(h)
    return h[-1:] if last_only else torch.cat(parts)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


class TokenEmbedding:
    """Row lookup in the token table. When the output head holds the same table as int8 (tied
    embeddings), rows are gathered from the head's codes, so the table is held once, compactly."""

    def __init__(self, table: torch.Tensor | None, head, dtype: torch.dtype):
        self.head, self.dtype = head, dtype
        self.table = None if table is None else table.to(dtype)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table[tokens]
        return (self.head.codes[tokens].to(torch.float32) * self.head.scale[tokens, None].float()).to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.table is None else [self.table]


def load_ends(g, weights: str, dtype: torch.dtype, device) -> tuple[object, TokenEmbedding, torch.Tensor]:
    """(output head, token embedding, final norm weight): the parts every architecture shares. The head is
    `output.weight`, or the embedding table when the file ties them."""
    tied = "output.weight" not in g.tensors
    head = load_linear(g, ["token_embd.weight" if tied else "output.weight"], weights, dtype, device)
    if tied and isinstance(head, Int8Linear):
        embed = TokenEmbedding(None, head, dtype)
    elif tied and isinstance(head, DenseLinear):
        embed = TokenEmbedding(head.weight, head, dtype)
    else:
        embed = TokenEmbedding(g.load("token_embd.weight").to(device), head, dtype)
    return head, embed, g.load("output_norm.weight").to(dtype).to(device)
