"""Building blocks shared by the architectures: RMS norm, rotary embeddings, masked attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # GGUF norm weights are used as stored: Gemma's converter already folded in the +1.
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class Rotary:
    """NEOX-style rotary embedding (pairs i, i + d/2), with cos/sin tabulated for every position."""

    def __init__(self, head_dim: int, base: float, max_len: int, freq_scale: float = 1.0,
                 freq_factors: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double()
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64) * freq_scale, inv_freq)
        self.cos = angles.cos().to(dtype).to(device)
        self.sin = angles.sin().to(dtype).to(device)

    def __call__(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x: [heads, T, head_dim] for positions start..start+T-1."""
        t = x.shape[-2]
        cos, sin = self.cos[start:start + t], self.sin[start:start + t]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
              window: int | None = None) -> torch.Tensor:
    """Causal attention of q ([heads, T, d], positions start..) over k, v ([kv_heads, start+T, d]).

    With `window`, a query at position p sees keys at positions > p - window only; keys that no query
    in this block can see are sliced away before the kernel runs.
    """
    t = q.shape[1]
    first_key = 0
    if window is not None:
        first_key = max(0, start - window + 1)
        k, v = k[:, first_key:], v[:, first_key:]
    mask = None
    if t > 1 or first_key > 0 or window is not None:
        q_pos = torch.arange(start, start + t, device=q.device)[:, None]
        k_pos = torch.arange(first_key, first_key + k.shape[1], device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask = mask & (q_pos - k_pos < window)
    out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[0] != k.shape[0])
    return out.squeeze(0)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
