"""GGUF weights held compact for torch's weight-only quantized matmuls (the CUDA backend's default).

On a GPU, decoding one token reads every weight once, so bytes held per weight decide the speed. Two forms,
both run by kernels that ship with torch (no build step), both taking bfloat16 (or float32) activations:

- `Int4Linear`: the GGUF's own 4-bit codes (Q4_0, Q4_1, Q4_K), repacked for torch's int4 weight-only kernel
  (`aten._weight_int4pack_mm`, the tinygemm kernel gpt-fast uses; `_weight_int4pack_mm_for_cpu` on the CPU,
  which is how this file is tested without a GPU). That kernel computes w = (q - 8) * scale + zero per group
  of 32, so a GGUF block's w = d * q + m becomes scale = d, zero = m + 8 d: the codes are kept exactly, the
  scales and zeros are rounded to the activation dtype.
- `Int8Linear`: every other type (Q5_*, Q6_K, Q8_0, float tensors) dequantized and requantized to int8 with
  one scale per output row (`aten._weight_int8pack_mm`). This is the one lossy step: each weight moves by at
  most half its row's step, max |w_row| / 254; the tests bound the product by that.

Both take the call of `DenseLinear` (`linear(x, in_norm=..., act=..., out_norm=..., residual=..., softcap=...)`),
so the architectures run them unchanged.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from outrider.io.gguf import GGUFFile
from outrider.models.linear import INT4_TYPES, block_codes, torch_post_steps, torch_pre_steps

INT4_GROUP = 32  # GGUF's 4-bit blocks scale per 32 weights; the int4 kernel takes groups of 32..256
INT4_MIDPOINT = 8  # the int4 kernel's zero point: w = (q - 8) * scale + zero
ROW_MULTIPLE = 16  # the CPU int4 packer needs rows in multiples of 16 (CUDA: 8); padded rows are zero


def int4_inner_k_tiles(k: int) -> int | None:
    """The int4 kernel's K tiling for an input width k, or None where k does not fit it (then int8)."""
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    return None


class _QuantLinear:
    n_out: int

    def __call__(self, x: torch.Tensor, in_norm: torch.Tensor | None = None, eps: float = 0.0,
                 act: str | None = None, out_norm: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 softcap: float = 0.0, prompt: bool = False) -> torch.Tensor:
        x = torch_pre_steps(x, in_norm, act, eps)
        y = self.matmul(x.reshape(-1, x.shape[-1]).to(self.dtype).contiguous())
        return torch_post_steps(y.reshape(*x.shape[:-1], self.n_out), out_norm, residual, softcap, eps)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int4Linear(_QuantLinear):
    """codes [N, K] (0..15, int32 or uint8), scales and zeros [N, K / 32] with w = (q - 8) * scale + zero."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
                 device: torch.device | str):
        n, k = codes.shape
        tiles = int4_inner_k_tiles(k)
        if tiles is None:
            raise ValueError(f"int4 weights need an input width that is a multiple of 32, not {k}")
        self.device, self.dtype, self.n_out, self.k = torch.device(device), dtype, n, k
        pad = -n % ROW_MULTIPLE
        # moved as bytes first: the repacking then runs on the device, which matters at 8B weights
        codes = F.pad(codes.to(torch.uint8).to(device), (0, 0, 0, pad), value=INT4_MIDPOINT)  # padded rows: w = 0
        scales, zeros = F.pad(scales.float(), (0, 0, 0, pad)), F.pad(zeros.float(), (0, 0, 0, pad))
        # [K / 32, N, 2]: a group's scale and zero side by side, as the kernel loads them
        self.scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype).to(device)
        if self.device.type == "cuda":
            # the CUDA packer takes two codes per byte, the even column in the high nibble
            self.packed = torch.ops.aten._convert_weight_to_int4pack(codes[:, ::2] << 4 | codes[:, 1::2], tiles)
            self._mm = torch.ops.aten._weight_int4pack_mm
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            self._mm = torch.ops.aten._weight_int4pack_mm_for_cpu

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm(x, self.packed, INT4_GROUP, self.scales_and_zeros)
        return y[:, :self.n_out] if y.shape[1] != self.n_out else y

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales_and_zeros]


class Int8Linear(_QuantLinear):
    """weight [N, K] (float) requantized to int8 codes with one scale per row: w ~ code * scale."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, device: torch.device | str):
        weight = weight.to(device).double()  # requantized where the weight will live (the GPU at 8B)
        # the scale as the kernel will read it (rounded to dtype), so the codes are rounded against it
        scale = (weight.abs().amax(dim=1).clamp_min(1e-30) / 127).to(dtype)
        self.codes = torch.round(weight / scale.double()[:, None]).clamp(-127, 127).to(torch.int8)
        self.scales = scale
        self.device, self.dtype = torch.device(device), dtype
        self.n_out, self.k = weight.shape
        self._kernel = self._probe()

    def _probe(self) -> bool:
        """Whether torch has `_weight_int8pack_mm` for this device and dtype; else a dequantize-then-matmul
        that is correct anywhere (and slow: it writes the dense weight once per call)."""
        try:
            for rows in (1, 16, 64):  # a step, a verify bucket, a prefill chunk: a kernel may take only some
                torch.ops.aten._weight_int8pack_mm(torch.zeros(rows, self.k, dtype=self.dtype, device=self.device),
                                                   self.codes, self.scales)
            return True
        except (RuntimeError, NotImplementedError):
            return False

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel:
            return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)
        return F.linear(x, self.codes.to(self.dtype)) * self.scales

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.codes[ids].to(self.dtype) * self.scales[ids, None]

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales]


def int4_parts(g: GGUFFile, names: Sequence[str], remap) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes [N, K], scales, zeros [N, K / 32]) in the int4 kernel's convention, rows of `names` stacked,
    or None when a part is not a 4-bit GGUF type (or K does not fit the kernel)."""
    infos = [g.tensors[name] for name in names]
    if any(info.type not in INT4_TYPES for info in infos) or int4_inner_k_tiles(infos[0].shape[1]) is None:
        return None
    codes, scales, zeros = [], [], []
    for info in infos:
        c, s, z, group = block_codes(g.raw(info.name), info.type)
        assert group == INT4_GROUP
        rows = lambda a: torch.from_numpy(np.ascontiguousarray(a)).reshape(info.shape[0], -1)
        fix = remap(info.name)
        s, z = rows(s), rows(z)
        codes.append(fix(rows(c)))
        scales.append(fix(s))
        zeros.append(fix(z + INT4_MIDPOINT * s))  # d q + m = d (q - 8) + (m + 8 d)
    return torch.cat(codes), torch.cat(scales), torch.cat(zeros)


def load_quantized_linear(g: GGUFFile, names: Sequence[str], dtype: torch.dtype, device: torch.device | str,
                          remap) -> _QuantLinear:
    """`Int4Linear` when every part is 4-bit, else `Int8Linear` of the dequantized rows."""
    parts = int4_parts(g, names, remap)
    if parts is not None:
        return Int4Linear(*parts, dtype=dtype, device=device)
    weight = torch.cat([remap(name)(g.load(name)) for name in names])
    return Int8Linear(weight, dtype, device)
