"""The GPU backend's compact weights (`outrider.models.torch_quant`), tested on the CPU through torch's CPU
builds of the same weight-only kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`).

The repacking (GGUF codes -> the int4 kernel's (q - 8) * scale + zero convention, and the int8 per-row
requantization) is what can go wrong, and it is the same code on both devices; only torch's final packer
call differs. Oracle: the `gguf` package's reference dequantizer, then a float64 matmul. 4-bit types must
match to float32 rounding (their codes are kept); the others within the int8 requantization bound derived
by hand: every weight moves by at most half its row's step (max |w_row| / 127), so an output moves by at
most sum_k |x_k| * step / 2.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from outrider.io.gguf import GGUFFile
from outrider.models.linear import DenseLinear
from outrider.models.torch_quant import Int4Linear, Int8Linear, int4_inner_k_tiles
from outrider.models.weight_forms import load_linear

ROWS, COLS = 40, 256  # rows not a multiple of 16: the packer's padding is exercised
INT4 = [Q.Q4_0, Q.Q4_1, Q.Q4_K]
OTHER = [Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q5_K, Q.Q6_K, Q.F16]
K_QUANTS = {Q.Q4_K, Q.Q5_K, Q.Q6_K}


def _set_f16(raw: np.ndarray, byte: int, values: np.ndarray) -> None:
    raw[:, byte:byte + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _stored(rng: np.random.Generator, qtype: Q) -> np.ndarray:
    """Raw bytes [rows, bytes per row] of a random weight: gguf quantizes the block-32 types; k-quant blocks
    are random bytes with small finite f16 scale fields (gguf has no k-quant quantizer; any such bytes
    are a valid block)."""
    if qtype == Q.F16:
        return (rng.standard_normal((ROWS, COLS)) * 0.1).astype(np.float16)
    if qtype not in K_QUANTS:
        return gguf.quants.quantize((rng.standard_normal((ROWS, COLS)) * 0.1).astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = ROWS * COLS // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    sign = lambda: rng.choice([-1.0, 1.0], n)
    if qtype == Q.Q6_K:
        _set_f16(raw, 208, sign() * rng.uniform(2e-5, 2e-4, n))
    else:
        _set_f16(raw, 0, sign() * rng.uniform(2e-4, 2e-3, n))
        _set_f16(raw, 2, sign() * rng.uniform(2e-4, 2e-3, n))
    return raw.reshape(ROWS, -1)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A GGUF file with one [40, 256] weight per type (`w.TYPE`) and its float64 meaning per gguf."""
    rng = np.random.default_rng(11)
    path = tmp_path_factory.mktemp("torch-quant") / "weights.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    reference = {}
    for qtype in INT4 + OTHER:
        stored = _stored(rng, qtype)
        if qtype == Q.F16:
            writer.add_tensor(f"w.{qtype.name}", stored)
            reference[qtype] = torch.from_numpy(stored.astype(np.float64))
        else:
            writer.add_tensor(f"w.{qtype.name}", stored, raw_dtype=qtype)
            reference[qtype] = torch.from_numpy(gguf.quants.dequantize(stored, qtype).astype(np.float64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path), reference


def _x(rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, COLS, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("qtype", INT4, ids=lambda t: t.name)
def test_4bit_types_keep_their_codes_in_the_int4_kernel(weights, qtype):
    g, reference = weights
    lin = load_linear(g, [f"w.{qtype.name}"], "quantized", torch.float32, "cpu")
    assert isinstance(lin, Int4Linear)
    x = _x()
    want = x.double() @ reference[qtype].T
    got = lin(x)
    assert got.shape == (5, ROWS)
    tol = 1e-5 * float(want.abs().max()) + 1e-6
    assert float((got.double() - want).abs().max()) <= tol


@pytest.mark.parametrize("qtype", OTHER, ids=lambda t: t.name)
def test_other_types_are_int8_per_row_within_the_requantization_bound(weights, qtype):
    g, reference = weights
    lin = load_linear(g, [f"w.{qtype.name}"], "quantized", torch.float32, "cpu")
    assert isinstance(lin, Int8Linear)
    x = _x()
    w = reference[qtype]
    want = x.double() @ w.T
    step = w.abs().amax(dim=1) / 127
    bound = x.double().abs().sum(dim=1, keepdim=True) * step[None, :] / 2 * 1.001 + 1e-5
    got = lin(x).double()
    assert bool(((got - want).abs() <= bound).all()), f"{qtype.name}: beyond the int8 requantization bound"


def test_fused_4bit_parts_stack_like_the_dense_rows(weights):
    g, reference = weights
    names = ["w.Q4_0", "w.Q4_K", "w.Q4_1"]
    lin = load_linear(g, names, "quantized", torch.float32, "cpu")
    assert isinstance(lin, Int4Linear)
    want = _x().double() @ torch.cat([reference[t] for t in (Q.Q4_0, Q.Q4_K, Q.Q4_1)]).T
    got = lin(_x()).double()
    assert got.shape == (5, 3 * ROWS)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_a_fused_linear_with_a_non_4bit_part_is_int8(weights):
    g, _ = weights
    assert isinstance(load_linear(g, ["w.Q4_0", "w.Q6_K"], "quantized", torch.float32, "cpu"), Int8Linear)


def test_row_maps_reorder_the_int4_rows(weights):
    g, reference = weights
    flip = {"w.Q4_1": lambda rows: rows.flip(0)}
    lin = load_linear(g, ["w.Q4_1"], "quantized", torch.float32, "cpu", row_maps=flip)
    want = _x().double() @ reference[Q.Q4_1].flip(0).T
    assert float((lin(_x()).double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_bfloat16_activations_stay_within_bfloat16_rounding(weights):
    """What the GPU runs: bfloat16 activations, scales and zeros; compared with a float64 matmul of the
    GGUF's weights, the error is bf16 rounding (2^-8 relative) of inputs, scales and outputs."""
    g, reference = weights
    for qtype in (Q.Q4_K, Q.Q8_0):
        lin = load_linear(g, [f"w.{qtype.name}"], "quantized", torch.bfloat16, "cpu")
        x = _x()
        want = x.double() @ reference[qtype].T
        got = lin(x.bfloat16()).double()
        scale = float((x.double().abs() @ reference[qtype].abs().T).max())
        assert float((got - want).abs().max()) <= 3 * 2 ** -8 * scale, qtype.name


def test_the_call_steps_match_dense_linear(weights):
    """in_norm, act, out_norm, residual and softcap around the matmul mean what DenseLinear spells out."""
    g, reference = weights
    lin = load_linear(g, ["w.Q4_0"], "quantized", torch.float32, "cpu")
    dense = DenseLinear(lin(torch.eye(COLS)).T.contiguous())  # the held weight, read back through the kernel
    gen = torch.Generator().manual_seed(5)
    x2 = torch.randn(3, 2 * COLS, generator=gen)
    norm_in, norm_out = 1 + 0.1 * torch.randn(2 * COLS, generator=gen), 1 + 0.1 * torch.randn(ROWS, generator=gen)
    residual = torch.randn(3, ROWS, generator=gen)
    for kwargs in ({"in_norm": norm_in, "eps": 1e-5, "act": "silu"}, {"act": "gelu_tanh", "out_norm": norm_out,
                                                                       "eps": 1e-6, "residual": residual},
                   {"act": "silu", "softcap": 3.0}):
        got, want = lin(x2, **kwargs), dense(x2, **kwargs)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), kwargs


def test_inner_k_tiles_follow_the_kernel_constraint():
    assert int4_inner_k_tiles(2048) == 8 and int4_inner_k_tiles(576) == 4 and int4_inner_k_tiles(96) == 2
    assert int4_inner_k_tiles(80) is None
