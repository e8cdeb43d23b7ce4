"""Linear layers, and how a GGUF weight is held for them.

Decoding a small model on a CPU is bound by how fast weights stream from memory through the matmul, so
how a weight is held decides the speed. Two forms:

- `PackedLinear` (`weights = compact`, the CPU backend's default): the integers the GGUF file stores,
  with float32 scales and zeros, w = scale * code + zero, run by Outrider's own kernel
  (`outrider.native`), which dequantizes in registers against float32 activations, or meets int8
  activations in integer dot products (`-o backend.activations`, see `outrider.native.use_activations`). 4-bit types
  (Q4_0, Q4_1, Q4_K) as packed nibbles, 5-bit types (Q5_0, Q5_1, Q5_K) as nibbles plus a word of high
  bits, Q6_K and Q8_0 as int8 codes, one scale (and zero) per 32 weights, per 16 for Q6_K; float tensors
  as float32. With int8 activations on AVX2 or AVX512-VNNI the same codes are held in the lane form
  instead (`lane_form`: 16 weight rows interleaved per block, what the kernels' lane tiles read); with
  F16C (every such CPU), that form keeps K-quants' scales factored (`ScaleFactors`) and Q6_K's codes in
  six bits, as the file does, the same bits in fewer bytes.
- `DenseLinear` (`weights = dense`, the CUDA backend, or where the kernels cannot be built): the
  dequantized matrix in the model's dtype, through torch.

Both take the same call: `linear(x, in_norm=..., act=..., out_norm=..., residual=..., softcap=...)` is
post(W @ pre(x)), the steps around a matmul in a transformer layer, so the native kernel can do them
in one call and `DenseLinear` spells out what that call means. `prompt=True` marks rows that no one
compares bit for bit with one-row calls (a prefill): the kernel may then sum in a faster order. Without
it every row gets exactly the bits a one-row call gives it, which keeps greedy speculation equal to
plain decoding.
"""

from __future__ import annotations

import os
import weakref
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from outrider.errors import ConfigError
from outrider import native
from outrider.io.gguf import GGUFFile, check_supported
from outrider.models import packed_cache
from outrider.native import when_float32
from outrider.native.codes import ACTIVATIONS as ACTIVATION_CODES
from outrider.native.codes import WEIGHT_KINDS

GROUP = 32
INT4_TYPES = {Q.Q4_0, Q.Q4_1, Q.Q4_K}
FLOAT_TYPES = {Q.F32, Q.F16, Q.BF16}
WEIGHT_MODES = ("compact", "dense")
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
KIND_Q4, KIND_Q8, KIND_F32, KIND_Q5 = (WEIGHT_KINDS[name] for name in ("q4", "q8", "f32", "q5"))
INT5_TYPES = {Q.Q5_0, Q.Q5_1, Q.Q5_K}
NATIVE_ACT = {None if name == "none" else name: code for name, code in ACTIVATION_CODES.items()}
RowMap = Callable[[torch.Tensor], torch.Tensor]  # a row permutation, applied to anything with rows first


def int8_code(int8: bool | None) -> int:
    """A model's activations as the kernels take them per call: 1 int8, 0 float32, -1 (None) the process's."""
    return -1 if int8 is None else int(int8)


def check_weights_mode(weights: str) -> None:
    if weights not in WEIGHT_MODES:
        raise ConfigError(f"unknown weights mode '{weights}'; choose one of: {', '.join(WEIGHT_MODES)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # GGUF norm weights are used as stored: Gemma's converter already folded in the +1.
    return F.rms_norm(x, weight.shape, weight, eps)


def torch_pre_steps(x: torch.Tensor, in_norm, act, eps: float) -> torch.Tensor:
    """What a linear layer does to its input before the matmul, in torch: rms_norm, then act(gate) * up."""
    if in_norm is not None:
        x = rms_norm(x, in_norm, eps)
    if act is not None:
        gate, up = x.chunk(2, dim=-1)
        x = ACTIVATIONS[act](gate) * up
    return x


def torch_post_steps(y: torch.Tensor, out_norm, residual, softcap: float, eps: float) -> torch.Tensor:
    """What a linear layer does after the matmul, in torch: rms_norm, + residual, softcap."""
    if out_norm is not None:
        y = rms_norm(y, out_norm, eps)
    if residual is not None:
        y = residual + y
    if softcap:
        y = torch.tanh(y / softcap) * softcap
    return y


class DenseLinear:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, x: torch.Tensor, in_norm: torch.Tensor | None = None, eps: float = 0.0,
                 act: str | None = None, out_norm: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 softcap: float = 0.0, prompt: bool = False) -> torch.Tensor:
        y = self.product(torch_pre_steps(x, in_norm, act, eps))
        return torch_post_steps(y, out_norm, residual, softcap, eps)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]


class StackedLinear(DenseLinear):
    """A DenseLinear whose rows are the given tensors (q, k and v as one projection): they stay apart, e.g. as
    trainable parameters, each part its own product and the outputs joined; `weight` stacks them when asked."""

    def __init__(self, *parts: torch.Tensor):
        self.parts = parts

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat(self.parts) if len(self.parts) > 1 else self.parts[0]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        # a product per part and their outputs joined: stacking the weights instead copies them at every call
        # (and back again in a backward pass), where the outputs of a few hundred rows are far smaller
        if len(self.parts) == 1:
            return F.linear(x, self.parts[0])
        return torch.cat([F.linear(x, part) for part in self.parts], -1)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.parts)


class PackedLinear:
    def __init__(self, kind: int, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group: int, n_out: int, k: int, factors: ScaleFactors | None = None, lanes: bool = True):
        self.kernels = native.load()
        self.int8, self.threads = -1, 0  # the process's activations, the whole pool (see pin)
        self.kind, self.group, self.n_out, self.k = kind, group, n_out, k
        self.codes = codes.contiguous()
        self.scales = scales.to(torch.float32).contiguous()  # why not float16: RowReader, weight_formats.h
        self.zeros = (torch.empty(0) if zeros is None else zeros.to(torch.float32)).contiguous()
        # Builds with lane tiles hold the lane form, what the int8 kernels read; with int8 activations it is
        # the only form held (see hold_rows). A table only read by rows (`lanes=False`: an input embedding)
        # holds the row form alone.
        forms = held_forms()
        use_lanes = lanes and forms.lane_tiles
        if not use_lanes or not forms.factored_scales:
            factors = None
        # per-32 int8 codes (Q8_0's) all but never fit six bits, so the six-bit tiles are per-16 ones only
        six_bit = (use_lanes and kind == KIND_Q8 and group == 16 and forms.six_bit_codes
                   and fits_six_bits(self.codes))
        self.lanes = lane_form(kind, self.codes, self.scales, self.zeros, group, n_out, k, factors,
                               six_bit) if use_lanes else []
        if self.lanes and forms.int8_activations:
            self.codes, self.scales = self.codes.new_empty(0), self.scales.new_empty(0)
            self.zeros = self.zeros.new_empty(0)
            _LANES_ONLY.add(self)

    def held_tensors(self) -> dict:
        """What this weight holds, as `from_held` takes it back (`packed_cache` keeps it on disk)."""
        return {"kind": self.kind, "group": self.group, "n_out": self.n_out, "k": self.k, "codes": self.codes,
                "scales": self.scales, "zeros": self.zeros, "lanes": list(self.lanes)}

    @classmethod
    def from_held(cls, held: dict) -> PackedLinear:
        """A weight holding what `held_tensors` gave, as it was: nothing is packed again."""
        self = cls.__new__(cls)
        self.kernels = native.load()
        self.int8, self.threads = -1, 0
        self.kind, self.group, self.n_out, self.k = (int(held[key]) for key in ("kind", "group", "n_out", "k"))
        self.codes, self.scales, self.zeros, self.lanes = held["codes"], held["scales"], held["zeros"], held["lanes"]
        if self.lanes and not self.codes.numel() and self.kind != KIND_F32:
            _LANES_ONLY.add(self)
        return self

    def hold_rows(self) -> None:
        """The row form back, from the lane form, for float32 activations (`outrider.native.use_activations`
        calls this on every such weight): in place, since LayerStack's HeldLinear shares these tensors."""
        if self.codes.numel() or not self.lanes:
            return
        codes, scales, zeros = self.kernels.lane_rows(torch.arange(self.n_out), self.kind, self.lanes, self.group,
                                                      self.k)
        self.codes.set_(codes), self.scales.set_(scales), self.zeros.set_(zeros)
        _LANES_ONLY.discard(self)

    def pin(self, int8: bool | None, threads: int) -> None:
        """Every call of this weight with int8 (True) or float32 (False) activations, None: the process's setting
        (`outrider.native.use_activations`), and at most `threads` threads (0: the whole pool): the settings of
        a model loaded beside another (a draft model), passed with each call, not set around it."""
        self.int8, self.threads = int8_code(int8), threads

    def __call__(self, x: torch.Tensor, in_norm: torch.Tensor | None = None, eps: float = 0.0,
                 act: str | None = None, out_norm: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 softcap: float = 0.0, prompt: bool = False) -> torch.Tensor:
        if residual is not None and (residual.shape[:-1] != x.shape[:-1] or not residual.is_contiguous()):
            residual = residual.expand(*x.shape[:-1], self.n_out).contiguous()
        return self.kernels.linear(x.contiguous(), self.kind, self.codes, self.scales, self.zeros, self.group,
                                   self.n_out, self.k, in_norm, eps, NATIVE_ACT[act], residual, out_norm, softcap,
                                   prompt, self.lanes, self.int8, self.threads)

    def held(self):
        """This weight as the kernels' `HeldLinear`, the form `LayerStack` takes its linears in."""
        return self.kernels.HeldLinear(kind=self.kind, codes=self.codes, scales=self.scales, zeros=self.zeros,
                                       group=self.group, n_out=self.n_out, k=self.k, lanes=self.lanes)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.codes.numel() and self.lanes:  # those rows in the row form, then as ever
            codes, scales, zeros = self.kernels.lane_rows(ids.reshape(-1), self.kind, self.lanes, self.group, self.k)
            return self.kernels.dequantize_rows(torch.arange(ids.numel()), self.kind, codes, scales, zeros,
                                                self.group, self.k)
        return self.kernels.dequantize_rows(ids, self.kind, self.codes, self.scales, self.zeros, self.group, self.k)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors a forward reads: the lane form with int8 activations, else the row form (with float32
        ones both are held, and only the rows are read)."""
        if self.lanes and (self.kernels.int8_activations() if self.int8 < 0 else self.int8):
            return list(self.lanes)
        return [self.codes, self.scales, self.zeros]


LANES = 16  # weight rows per block of the lane form
_LANES_ONLY: weakref.WeakSet[PackedLinear] = weakref.WeakSet()  # weights holding their lane form only


def _hold_rows_everywhere() -> None:
    for linear in list(_LANES_ONLY):
        linear.hold_rows()


when_float32(_hold_rows_everywhere)


def lane_form(kind: int, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, n_out: int,
              k: int, factors: ScaleFactors | None = None, six_bit: bool = False) -> list[torch.Tensor]:
    """The weight as the native lane tiles read it (`kernels/int8.h`): blocks of 16 rows, each group's codes
    with int32 lane j holding four adjacent codes of row j (int8 codes + 128, as unsigned bytes; with
    `six_bit`, per-16 int8 codes within -32..31 + 32 as six bits: `_six_bit_lanes`); scales and zeros
    [block, scales per row, 16]; or, given their factors, int8 sub-scales and sub-zeros [block, scales per
    row, 16] then float16 super-scales and super-zeros [block, K / 256, 16]. [] where there is no lane
    tile: float32 weights, or a row count that is not a multiple of 16."""
    if kind == KIND_F32 or n_out % LANES:
        return []
    blocks, groups = n_out // LANES, k // GROUP
    per_row = lambda t: t.reshape(blocks, LANES, -1).transpose(1, 2).contiguous()  # [block, count, 16]
    if kind == KIND_Q8 and six_bit:
        c = _six_bit_lanes(codes.reshape(blocks, LANES, groups, 32).to(torch.int16) + 32)
    elif kind == KIND_Q8:
        c = codes.reshape(blocks, LANES, groups, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8) ^ 0x80
    else:
        width = 16 if kind == KIND_Q4 else 20
        g = codes.reshape(blocks, LANES, groups, width)
        nibbles = _nibble_lanes(g[..., :16])
        c = nibbles
        if kind == KIND_Q5:  # bit 4 of each code as 64-bit masks: (low, high) x four dwords, bit 4j + t
            bits = torch.from_numpy(_high_bits(g[..., 16:].numpy()))  # [block x 16 x groups, 32]
            bits = bits.reshape(blocks, LANES, groups, 2, 4, 4).permute(0, 2, 3, 4, 1, 5).reshape(-1, 64)
            masks = torch.from_numpy(np.packbits(bits.numpy(), axis=-1, bitorder="little")).reshape(blocks, groups, 64)
            c = torch.cat([nibbles, masks], dim=-1)
    c = c.contiguous().reshape(-1)
    if factors is not None:
        no_zeros = factors.sub_zeros is None
        return [c, per_row(factors.sub_scales.to(torch.int8)),
                torch.empty(0, dtype=torch.int8) if no_zeros else per_row(factors.sub_zeros.to(torch.int8)),
                per_row(factors.super_scales.to(torch.float16)),  # the file's float16: exact
                torch.empty(0, dtype=torch.float16) if no_zeros else per_row(factors.super_zeros.to(torch.float16))]
    return [c, per_row(scales), per_row(zeros) if zeros.numel() else zeros]


def _nibble_lanes(packed: torch.Tensor) -> torch.Tensor:
    """Packed nibbles [block, 16 rows, group, 16 bytes] (`_pack_nibbles`) in the 4-bit lane layout [block,
    group, 256]: register m (64 bytes) holding bytes 4m..4m+3 of each row, row j's at 4j."""
    blocks, _, groups, _ = packed.shape
    return packed.reshape(blocks, LANES, groups, 4, 4).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 256)


def fits_six_bits(codes: torch.Tensor) -> bool:
    """Whether int8 codes (a Q6_K weight's, or K-quants' fused with it) fit the six-bit lane form."""
    return codes.numel() > 0 and -32 <= int(codes.min()) and int(codes.max()) <= 31


def _six_bit_lanes(q: torch.Tensor) -> torch.Tensor:
    """Codes 0..63 [block, 16 rows, group, 32] as the six-bit lane form, 384 bytes a group: first the 4-bit
    layout of the low four bits (register m: byte 4j + t of row j holds code 4m + t | code 16 + 4m + t << 4),
    then bits 4-5 as two registers, register p byte 4j + t holding those of codes 4m + t (bits 0-1) and
    16 + 4m + t (bits 2-3) for m = 2p, and for m = 2p + 1 (bits 4-7)."""
    blocks, _, groups, _ = q.shape
    nibbles = _nibble_lanes(_pack_nibbles((q & 15).reshape(blocks * LANES, -1)).reshape(blocks, LANES, groups, 16))
    high = (q >> 4).to(torch.uint8).reshape(blocks, LANES, groups, 2, 4, 4)  # [.., first/second 16, m, t]
    first, second = high[..., 0, :, :], high[..., 1, :, :]  # [block, row, group, m, t]
    pairs = [first[..., 2 * p, :] | second[..., 2 * p, :] << 2 | first[..., 2 * p + 1, :] << 4
             | second[..., 2 * p + 1, :] << 6 for p in (0, 1)]  # each [block, row, group, t]
    bits = torch.stack(pairs, dim=2).permute(0, 3, 2, 1, 4).reshape(blocks, groups, 128)
    return torch.cat([nibbles, bits], dim=-1)


# ------------------------------------------------------------------------ GGUF blocks to codes

def _f16(column: np.ndarray) -> np.ndarray:
    return column.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    # Each run of `run` bytes holds 2 * run weights: first the low nibbles, then the high ones.
    qs = qs.reshape(qs.shape[0], -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(0x0F)).reshape(qs.shape[0], -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Bit i of each block's little-endian 32-bit qh (Q5_0, Q5_1) at [block, i], as uint8 0/1."""
    return np.unpackbits(np.ascontiguousarray(qh).reshape(-1, 4), axis=-1, bitorder="little")


def block_codes(raw: np.ndarray, qtype: Q, factors: BlockFactors | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """(codes, scale, zero or None, group) with w = scale * code + zero, from GGUF blocks: codes [B, block]
    (uint8 0..15 for 4-bit types, 0..31 for 5-bit types, int8 otherwise), scale and zero
    [B, block / group]. The layouts are those of the `gguf` package's reference dequantizers. A K-quant's
    scales are the products of its `block_scale_factors` (given, where the caller has them already)."""
    if qtype in K_QUANT_TYPES and factors is None:
        factors = block_scale_factors(raw, qtype)
    if qtype in (Q.Q4_0, Q.Q4_1):
        size = 18 if qtype == Q.Q4_0 else 20
        b = raw.reshape(-1, size)
        scale = _f16(b[:, 0:2])
        zero = -8 * scale if qtype == Q.Q4_0 else _f16(b[:, 2:4])
        return _nibbles(b[:, size - 16:].copy(), 16), scale, zero, 32
    if qtype == Q.Q4_K:
        b = raw.reshape(-1, 144)
        return _nibbles(b[:, 16:].copy(), 32), *_products(factors), 32
    if qtype == Q.Q8_0:
        b = raw.reshape(-1, 34)
        return b[:, 2:].copy().view(np.int8), _f16(b[:, 0:2]), None, 32
    if qtype in (Q.Q5_0, Q.Q5_1):
        size = 22 if qtype == Q.Q5_0 else 24
        b = raw.reshape(-1, size)
        q = _nibbles(b[:, size - 16:].copy(), 16) | (_high_bits(b[:, size - 20:size - 16]) << 4)
        if qtype == Q.Q5_0:
            return q, _f16(b[:, 0:2]), -16 * _f16(b[:, 0:2]), 32
        return q, _f16(b[:, 0:2]), _f16(b[:, 2:4]), 32
    if qtype == Q.Q5_K:
        b = raw.reshape(-1, 176)
        scale, zero = _products(factors)
        low = _nibbles(b[:, 48:].copy(), 32).reshape(-1, 8, 32)
        high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        return (low | (high << 4)).reshape(-1, 256), scale, zero, 32
    if qtype == Q.Q6_K:
        b = raw.reshape(-1, 210)
        low = _nibbles(b[:, :128].copy(), 64).reshape(-1, 4, 32)
        high = (b[:, 128:192].reshape(-1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)) & 3
        # low and high are [2B, 4, 32]: two halves of 128 weights per block
        q = (low | (high << 4)).reshape(-1, 256).astype(np.int8) - 32
        return q, *_products(factors), 16
    raise ValueError(f"no codes for {qtype.name}")


class ScaleFactors(NamedTuple):
    """A K-quant weight's scales and zeros as its file holds them, per row: an int8 sub-scale (and sub-zero)
    per unit (16 or 32 weights) and a super-scale (and super-zero: the file's float16s, as float32) per 256
    weights; a unit's scale is sub_scale * super_scale. The product of an int8 and a float16 needs at most 18
    significant bits, so it is exact in float32: the factored form gives the float32 scales' bits, in 3/8 of
    the bytes or less."""
    sub_scales: torch.Tensor  # int8 [rows, units]
    super_scales: torch.Tensor  # float32 [rows, K / 256]
    sub_zeros: torch.Tensor | None
    super_zeros: torch.Tensor | None


K_QUANT_TYPES = {Q.Q4_K, Q.Q5_K, Q.Q6_K}
# A K-quant's factors per GGUF block, numpy: (sub-scales [B, units], super-scales [B, 1], sub-zeros or None,
# super-zeros or None), as ScaleFactors holds them per row
BlockFactors = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]


def _products(f: BlockFactors) -> tuple[np.ndarray, np.ndarray | None]:
    sub_scales, super_scales, sub_zeros, super_zeros = f
    scale = sub_scales.astype(np.float32) * super_scales
    return scale, None if sub_zeros is None else sub_zeros.astype(np.float32) * super_zeros


def block_scale_factors(raw: np.ndarray, qtype: Q) -> BlockFactors | None:
    """The factors of a K-quant's scales and zeros, per GGUF block (the `gguf` package's layouts); None for the
    other types, whose scale is one float16 per group."""
    from gguf.quants import Q4_K

    if qtype in (Q.Q4_K, Q.Q5_K):
        b = raw.reshape(-1, 144 if qtype == Q.Q4_K else 176)
        sc, mn = Q4_K.get_scale_min(b[:, 4:16].copy())  # 6-bit, 0..63
        return sc.astype(np.int8), _f16(b[:, 0:2]), mn.astype(np.int8), -_f16(b[:, 2:4])
    if qtype == Q.Q6_K:
        b = raw.reshape(-1, 210)
        return b[:, 192:208].copy().view(np.int8), _f16(b[:, 208:210]), None, None
    return None


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K/2] bytes, byte j of each group of 32 = code j | code j+16 << 4."""
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def _pack_5bit(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..31 -> [N, K/32 * 20] bytes: per group of 32 the low 4 bits as `_pack_nibbles`, then
    a little-endian 32-bit word whose bit j is bit 4 of code j."""
    n = codes.shape[0]
    c = codes.to(torch.uint8).reshape(n, -1, 32)
    nibbles = _pack_nibbles((c & 15).reshape(n, -1)).reshape(n, -1, 16)
    high = torch.from_numpy(np.packbits((c >> 4).numpy(), axis=-1, bitorder="little"))  # the word's 4 bytes
    return torch.cat([nibbles, high], dim=-1).reshape(n, -1)


def load_packed(g: GGUFFile, names: Sequence[str], remap, lanes: bool = True) -> PackedLinear:
    """Stack the tensors `names` (fused projections) in one form they all fit exactly: 4-bit nibbles if
    every part is 4-bit, 5-bit codes if every part is 4- or 5-bit, else int8 codes (per 16 if any part
    needs it, zeros if any part has them), else float32 when any part is a float tensor. Packed once per
    file and form, then mapped from `$OUTRIDER_HOME/packed` (`packed_cache`)."""
    if g.identity is None:  # tensors made while the program runs (TensorsInMemory): no file to key an entry by
        return _pack(g, names, remap, lanes)
    picked = [remap(name)(torch.arange(g.tensors[name].shape[0]).unsqueeze(1)).reshape(-1) for name in names]
    parts = [list(names), *picked, lanes, *held_forms()]
    held = packed_cache.cached(g.path, g.identity, parts, lambda: _pack(g, names, remap, lanes).held_tensors())
    return PackedLinear.from_held(held)


def _pack(g: GGUFFile, names: Sequence[str], remap, lanes: bool) -> PackedLinear:
    infos = [g.tensors[name] for name in names]
    k = infos[0].shape[1]
    if any(info.type in FLOAT_TYPES for info in infos):
        weight = torch.cat([remap(name)(g.load(name)) for name in names])
        return PackedLinear(KIND_F32, weight.float(), torch.empty(0), None, 32, weight.shape[0], k)
    parts = []
    for info in infos:
        check_supported(info.type, g.path, info.name)
        raw = g.raw(info.name)
        factors = block_scale_factors(raw, info.type)
        codes, scale, zero, group = block_codes(raw, info.type, factors)
        rows = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a)).reshape(info.shape[0], -1)
        parts.append((rows(codes), rows(scale), rows(zero), group,
                      None if factors is None else [rows(a) for a in factors]))
    factored = lanes and held_forms().factored_scales and all(p[4] is not None for p in parts)
    group = min(p[3] for p in parts)
    with_zero = any(p[2] is not None for p in parts)
    four_bit = all(info.type in INT4_TYPES for info in infos)
    five_bit = all(info.type in INT4_TYPES | INT5_TYPES for info in infos)
    kind = KIND_Q4 if four_bit else KIND_Q5 if five_bit else KIND_Q8
    pack = {KIND_Q4: _pack_nibbles, KIND_Q5: _pack_5bit, KIND_Q8: lambda c: c.to(torch.int8)}[kind]
    codes, scales, zeros, factor_columns = [], [], [], []
    for info, (c, s, z, gsize, f) in zip(infos, parts):
        fix = remap(info.name)
        repeat = gsize // group  # per-32 scales where per-16 are held: each serves two groups of 16

        def per_unit(t, like):  # a part without zeros has zeros of 0
            return fix((torch.zeros_like(like) if t is None else t).repeat_interleave(repeat, dim=1))

        codes.append(fix(pack(c))), scales.append(per_unit(s, s)), zeros.append(per_unit(z, s))
        if factored:
            sub_scales, super_scales, sub_zeros, super_zeros = f
            factor_columns.append((per_unit(sub_scales, sub_scales), fix(super_scales),
                                   per_unit(sub_zeros, sub_scales),
                                   fix(torch.zeros_like(super_scales) if super_zeros is None else super_zeros)))
    codes = torch.cat(codes)  # rows as the maps left them: a map may also select rows (a reduced head)
    factors = None
    if factored:
        sub_scales, super_scales, sub_zeros, super_zeros = (torch.cat(column) for column in zip(*factor_columns))
        factors = ScaleFactors(sub_scales, super_scales, *((sub_zeros, super_zeros) if with_zero else (None, None)))
    return PackedLinear(kind, codes, torch.cat(scales), torch.cat(zeros) if with_zero else None, group,
                        codes.shape[0], k, factors, lanes)


class HeldForms(NamedTuple):
    """Which forms a packed weight is held in, as this build and environment choose them: every choice that
    `PackedLinear` makes beyond the file's tensors, so `packed_cache` keys its entries by all of them.
    Each OUTRIDER_* switch set to 0 leaves its form out, to measure against."""
    lane_tiles: bool  # the lane form (builds with lane tiles; OUTRIDER_LANE_TILES)
    factored_scales: bool  # K-quants' scales factored in it (OUTRIDER_FACTORED_SCALES)
    six_bit_codes: bool  # Q6_K's codes in six bits in it (OUTRIDER_SIX_BIT_LANES)
    int8_activations: bool  # the lane form alone, no row form (`outrider.native.use_activations`)


def held_forms() -> HeldForms:
    kernels = native.load()
    switch = lambda name: os.environ.get(name, "1") != "0"
    return HeldForms(kernels.HAS_LANE_TILES and switch("OUTRIDER_LANE_TILES"),
                     kernels.FACTORED_SCALES and switch("OUTRIDER_FACTORED_SCALES"),
                     kernels.SIX_BIT_LANES and switch("OUTRIDER_SIX_BIT_LANES"), kernels.int8_activations())
