"""A KV cache preallocated for the whole context and indexed by absolute position.

Rows at positions >= `length` are garbage that the next forward overwrites, so rolling back
rejected draft tokens is just `truncate(n)`: nothing is copied or freed. Sliding-window layers keep
every position too (the window is applied as a mask when reading), so rollback across the window
boundary needs no special case.
"""

from __future__ import annotations

import torch

from outrider.native.codes import KEY_BLOCK  # the native kernel reads transposed keys this many positions at a time


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int | list[int], head_dim: int | list[int], max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 keys_transposed: bool = False):
        """`keys_transposed`: keys held [kv_heads, positions / KEY_BLOCK, head_dim, KEY_BLOCK], as the native
        attention kernel reads them: a query's scores for 16 positions are one vector per dimension, and a
        block of KEY_BLOCK positions is one contiguous read whatever the context length. Only that kernel
        writes and reads such a cache."""
        heads = n_kv_heads if isinstance(n_kv_heads, list) else [n_kv_heads] * n_layers
        dims = head_dim if isinstance(head_dim, list) else [head_dim] * n_layers
        if keys_transposed:
            padded = -(-max_len // KEY_BLOCK) * KEY_BLOCK
            self.keys = [torch.zeros(h, padded // KEY_BLOCK, d, KEY_BLOCK, dtype=dtype, device=device)
                         for h, d in zip(heads, dims)]
        else:  # [kv_heads, max_len, head_dim] per layer: a prefix view [:, :end] is what attention reads.
            self.keys = [torch.zeros(h, max_len, d, dtype=dtype, device=device) for h, d in zip(heads, dims)]
        self.values = [torch.zeros(h, max_len, d, dtype=dtype, device=device) for h, d in zip(heads, dims)]
        self.keys_transposed = keys_transposed
        self.max_len = max_len
        self.length = 0  # positions [0, length) hold valid entries

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([kv_heads, T, head_dim]) at positions start..start+T-1; return keys/values [0, start+T)."""
        end = start + k.shape[1]
        self.keys[layer][:, start:end] = k
        self.values[layer][:, start:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [kv_heads, end, head_dim] of positions [0, end), whatever the keys' layout: for a
        reader outside the model (a drafter attending over the target's cache). A copy when keys are blocked."""
        keys = self.keys[layer]
        if self.keys_transposed:
            h, blocks, d, _ = keys.shape
            keys = keys[:, : -(-end // KEY_BLOCK)].transpose(2, 3).reshape(h, -1, d)
        return keys[:, :end], self.values[layer][:, :end]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
