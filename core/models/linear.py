"""Linear layers that keep GGUF weights compact in memory.

Decoding a small model on a CPU is bound by how fast weights stream from memory and through the matmul
kernel, so how a weight is held decides the speed. Three forms, chosen per tensor (`load_linear`):

- `Int4Linear`: 4-bit GGUF types (Q4_0, Q4_1, Q4_K) repacked for torch's weight-only int4 CPU kernel, one
  scale and zero per 32 weights. These are the numbers the file stores; only the scales are rounded to
  bfloat16.
- `Int8Linear`: other quantized types (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) as int8 with one scale per row, for
  torch's weight-only int8 kernel. Requantizing rounds each weight by at most half of 1/127 of its row's
  largest magnitude.
- `DenseLinear`: a dequantized matrix in the model's dtype (`weights = dense`, and float tensors).

The int kernels take bfloat16 activations; their results come back in the caller's dtype.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from ..errors import ConfigError
from ..gguf_file import GGUFFile

GROUP = 32
INT4_TYPES = {Q.Q4_0, Q.Q4_1, Q.Q4_K}
FLOAT_TYPES = {Q.F32, Q.F16, Q.BF16}
WEIGHT_MODES = ("compact", "dense")
RowMap = Callable[[torch.Tensor], torch.Tensor]  # a row permutation, applied to anything with rows first


def check_weights_mode(weights: str) -> None:
    if weights not in WEIGHT_MODES:
        raise ConfigError(f"unknown weights mode '{weights}'; choose one of: {', '.join(WEIGHT_MODES)}")


class DenseLinear:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]


class Int8Linear:
    def __init__(self, weight: torch.Tensor):
        scale = weight.abs().amax(dim=1).clamp(min=1e-30) / 127.0
        self.codes = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scale).to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale]


class Int4Linear:
    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        """codes [N, K] in 0..15; scale, zero [N, K/32]: w = scale * codes + zero."""
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        # torch's kernel computes (code - 8) * scale + zero', so zero' = zero + 8 * scale; layout [K/32, N, 2].
        self.scales_zeros = torch.stack([scale, zero + 8 * scale], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scales_zeros)
        return out.to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales_zeros]


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    # Each run of `run` bytes holds 2 * run weights: first the low nibbles, then the high ones.
    qs = qs.reshape(qs.shape[0], -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(0x0F)).reshape(qs.shape[0], -1)


def int4_parts(raw: np.ndarray, qtype: Q, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GGUF's own 4-bit codes and per-32 scale and zero (w = scale * code + zero), rows first."""
    if qtype == Q.Q4_K:
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        scale, zero = d * sc.astype(np.float32), -dmin * mn.astype(np.float32)
        codes = _nibbles(blocks[:, 16:].copy(), 32)
    else:
        size = 18 if qtype == Q.Q4_0 else 20
        blocks = raw.reshape(-1, size)
        scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        zero = (-8 * scale if qtype == Q.Q4_0 else blocks[:, 2:4].copy().view(np.float16).astype(np.float32))
        codes = _nibbles(blocks[:, size - 16:].copy(), 16)
    as_rows = lambda a: torch.from_numpy(np.ascontiguousarray(a)).reshape(rows, -1)
    return as_rows(codes), as_rows(scale), as_rows(zero)


def load_linear(g: GGUFFile, names: Sequence[str], mode: str, dtype: torch.dtype, device: torch.device | str,
                row_maps: dict[str, RowMap] | None = None):
    """One linear layer from the GGUF tensors `names`, their rows stacked in order (fused projections).
    `row_maps` reorders a tensor's rows (llama's q/k un-permutation) in whatever form it is held."""
    remap = lambda name: (row_maps or {}).get(name, lambda rows: rows)
    infos = [g.tensors[name] for name in names]
    cpu = torch.device(device).type == "cpu"
    if mode == "compact" and cpu and all(info.type in INT4_TYPES for info in infos):
        parts = []
        for info in infos:
            parts.append(tuple(map(remap(info.name), int4_parts(g.raw(info.name), info.type, info.shape[0]))))
        return Int4Linear(*(torch.cat(column) for column in zip(*parts)))
    weight = torch.cat([remap(name)(g.load(name)) for name in names])
    if mode == "compact" and cpu and not any(info.type in FLOAT_TYPES for info in infos):
        return Int8Linear(weight)
    return DenseLinear(weight.to(dtype).to(device))
