"""Outrider's CPU kernels (`outrider.native`) and the packed linear layer that drives them.

Oracles, none of them the kernel itself: the `gguf` package's reference dequantizers (numpy); a float64
torch matmul over their output; `DenseLinear` (plain torch ops) for the fused steps around the matmul;
the same model with `weights="dense"` (torch ops, float64 attention); and, for batch invariance, the
same kernels called one row (one token) at a time, which must agree bit for bit: that equality is what
makes greedy speculative decoding produce exactly the tokens of plain decoding.

gguf can quantize Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 in numpy but not the k-quants (its quantize raises
NotImplementedError for Q4_K, Q5_K, Q6_K), so k-quant blocks are random bytes with small finite f16
scale fields: every such byte string is a valid block.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from outrider import native
from outrider.io.gguf import GGUFFile
from outrider.models import load_model
from outrider.models.linear import KIND_F32, KIND_Q8, DenseLinear, PackedLinear, block_codes
from outrider.models.weight_forms import load_linear
from outrider.native import activations
from outrider.testing.tiny_models import write_tiny_gemma3, write_tiny_llama

NUMPY_QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
QUANT_TYPES = NUMPY_QUANTIZABLE + K_QUANTS
CODE_BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5, Q.Q6_K: 6, Q.Q8_0: 8}
ALL_TYPES = QUANT_TYPES + [Q.F16, Q.F32]
ROWS, COLS = 96, 256  # the main test weight: [rows, cols], rows first as torch holds it
LONG_COLS = 768  # K-quant weights `k.TYPE` [32, 768]: three 256-weight super-blocks a row
SMALL_ROWS, SMALL_COLS = 40, 224  # rows not a multiple of 16; seven groups of 32 (block-32 types only): a
# four-group step, a two-group step and a lone group in the AVX512-VNNI int8 tile


def _ids(types):
    return [t.name for t in types]


@pytest.fixture(scope="module")
def kernels():
    """The kernels with float32 activations (the exact mode most tests here hold to float64's tolerance);
    the int8 tests below switch modes with `activations`."""
    try:
        module = native.load()
    except native.NativeUnavailable as e:  # no compiler here: the CPU backend falls back to torch
        pytest.skip(str(e))
    with activations("float32"):
        yield module


@pytest.fixture
def int8_kernels(kernels):
    if not kernels.HAS_INT8_KERNELS:
        pytest.skip("this build has no int8 kernels (no AVX2)")
    with activations("int8"):
        yield kernels


# ------------------------------------------------------------------------------------ shared codes


def test_python_codes_are_the_ones_the_compiled_kernels_export(kernels):
    """outrider.native.codes is Python's copy of the kernels' codes (the torch path runs without the
    module): every table must equal what the kernels export, or a weight kind, activation or kv mode
    would be read as another."""
    from outrider.native import codes

    assert codes.WEIGHT_KINDS == kernels.WEIGHT_KINDS
    assert codes.ACTIVATIONS == kernels.ACTIVATIONS
    assert codes.KV_MODES == kernels.KV_MODES
    assert codes.KEY_BLOCK == kernels.KEY_BLOCK


def test_layer_stack_takes_its_linears_and_layers_by_name_only(kernels):
    """LayerStack's linears are HeldLinear objects built by keyword, and add() takes keywords only: a
    positional call, which could put scales where zeros go or q_norm where k_norm goes, is refused."""
    w = PackedLinear(KIND_F32, torch.randn(8, 32), torch.empty(0), None, 32, 8, 32)
    held = w.held()
    assert (held.kind, held.group, held.n_out, held.k) == (KIND_F32, 32, 8, 32)
    assert held.codes.data_ptr() == w.codes.data_ptr() and held.scales.data_ptr() == w.scales.data_ptr()
    with pytest.raises(TypeError):
        kernels.HeldLinear(KIND_F32, w.codes, w.scales, w.zeros, 32, 8, 32)
    stack = kernels.LayerStack(n_heads=1, n_kv=1, head_dim=8, eps=1e-6, scale=1.0, act=0)
    with pytest.raises(TypeError):
        stack.add(held, held, held, held, None, None, None, None, None, None, torch.ones(4), torch.ones(4), 0)


# ------------------------------------------------------------------------------------ GGUF blocks


def _set_f16(raw: np.ndarray, byte: int, values: np.ndarray) -> None:
    raw[:, byte:byte + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _random_kquant_blocks(rng: np.random.Generator, qtype: Q, n_blocks: int) -> np.ndarray:
    """Random valid blocks: random bytes, then the f16 scale fields set to small finite values of both signs."""
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    sign = lambda: rng.choice([-1.0, 1.0], n_blocks)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin, 12 bytes of 6-bit scales/mins, ...
        _set_f16(raw, 0, sign() * rng.uniform(2e-4, 2e-3, n_blocks))
        _set_f16(raw, 2, sign() * rng.uniform(2e-4, 2e-3, n_blocks))
    else:  # Q6_K: ql, qh, 16 int8 scales, d last
        _set_f16(raw, 208, sign() * rng.uniform(2e-5, 2e-4, n_blocks))
    return raw


def _q6_k_power_of_two_scales(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Q6_K whose 16 int8 sub-block scales are +-2^i, so every per-16 scale d * sc is an exact float16, as
    the file's own d is: a fused tensor then has per-16 scales of both kinds."""
    raw = _random_kquant_blocks(rng, Q.Q6_K, rows * cols // 256)
    powers = rng.choice([-1, 1], (raw.shape[0], 16)) * (2 ** rng.integers(0, 7, (raw.shape[0], 16)))
    raw[:, 192:208] = powers.astype(np.int8).view(np.uint8)
    return raw.reshape(rows, -1)


def _quantized(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Raw GGUF bytes [rows, bytes per row] of a random weight in `qtype`."""
    if qtype in K_QUANTS:
        block, _ = gguf.GGML_QUANT_SIZES[qtype]
        return _random_kquant_blocks(rng, qtype, rows * cols // block).reshape(rows, -1)
    source = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    return gguf.quants.quantize(source, qtype)


def _reference_weight(stored: np.ndarray, qtype: Q) -> np.ndarray:
    """What the file means, per the gguf package: float64 [rows, cols]."""
    if qtype == Q.F32:
        return stored.astype(np.float64)
    if qtype == Q.F16:
        return stored.astype(np.float32).astype(np.float64)
    return gguf.quants.dequantize(stored, qtype).astype(np.float64)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=_ids(QUANT_TYPES))
def test_block_codes_reproduce_the_gguf_dequantizer(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    raw = _quantized(rng, qtype, 8, 512)
    expected = gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(-1)
    codes, scale, zero, group = block_codes(raw.reshape(-1), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = raw.size // size
    assert group == (16 if qtype == Q.Q6_K else 32)
    assert codes.shape == (n_blocks, block)
    assert scale.shape == (n_blocks, block // group)
    # integer codes spanning no more values than the format's bits (offsets may be folded into the zero)
    assert np.issubdtype(codes.dtype, np.integer)
    assert int(codes.max()) - int(codes.min()) <= 2 ** CODE_BITS[qtype] - 1
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
        assert codes.min() >= 0 and codes.max() <= 15
    per_weight = lambda a: np.repeat(a.astype(np.float64), group, axis=1)
    got = per_weight(scale) * codes.astype(np.float64)
    if zero is not None:
        got = got + per_weight(zero)
    np.testing.assert_allclose(got.reshape(-1), expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    assert np.abs(expected).max() > 0.05  # the blocks are not degenerate


# ------------------------------------------------------------------------------------ packed linear


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """One GGUF file holding a [96, 256] weight per type (`w.TYPE`), a [40, 224] weight per block-32 type
    (`v.TYPE`), a [32, 768] weight per K-quant (`k.TYPE`: three super-blocks a row), a [96, 256] Q6_K weight
    with power-of-two sub-block scales (`p.Q6_K`), and their float64 meanings per the gguf package."""
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("native") / "weights.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    reference = {}
    for qtype in ALL_TYPES:
        shapes = [("w", ROWS, COLS)]
        if qtype not in K_QUANTS:
            shapes.append(("v", SMALL_ROWS, SMALL_COLS))
        else:
            shapes.append(("k", 32, LONG_COLS))
        for prefix, rows, cols in shapes:
            name = f"{prefix}.{qtype.name}"
            if qtype in (Q.F32, Q.F16):
                stored = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32 if qtype == Q.F32 else np.float16)
                writer.add_tensor(name, stored)
            else:
                stored = _quantized(rng, qtype, rows, cols)
                writer.add_tensor(name, stored, raw_dtype=qtype)
            reference[name] = torch.from_numpy(_reference_weight(stored, qtype))
            assert reference[name].shape == (rows, cols)
    stored = _q6_k_power_of_two_scales(rng, ROWS, COLS)
    writer.add_tensor("p.Q6_K", stored, raw_dtype=Q.Q6_K)
    reference["p.Q6_K"] = torch.from_numpy(_reference_weight(stored, Q.Q6_K))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path), reference


def _packed(g, names, row_maps=None):
    lin = load_linear(g, names, packed=True, dtype=torch.float32, device="cpu", row_maps=row_maps)
    assert isinstance(lin, PackedLinear)
    return lin


def _dense(g, names):
    lin = load_linear(g, names, packed=False, dtype=torch.float32, device="cpu")
    assert isinstance(lin, DenseLinear)
    return lin


def _assert_matmul_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 accumulation against a float64 oracle: rounding level relative to the output's scale; one
    wrong weight in a row moves that output by ~1/sqrt(K) of its size, far beyond this."""
    assert got.dtype == torch.float32 and got.shape == expected.shape
    scale = expected.abs().max().item()
    assert scale > 0.1
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-6 * scale)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=_ids(ALL_TYPES))
def test_packed_linear_matches_float64_matmul_of_the_reference_weight(kernels, weights, qtype):
    g, reference = weights
    gen = torch.Generator().manual_seed(int(qtype))
    names = [f"w.{qtype.name}"] + ([] if qtype in K_QUANTS else [f"v.{qtype.name}"])
    names += ["p.Q6_K"] if qtype == Q.Q6_K else []
    for name in names:
        lin, w = _packed(g, [name]), reference[name]
        # single rows, a partial tile, a full tile (8 with AVX-512), tile + rest; as a prompt, 13 rows and
        # more take the panel path (AVX-512)
        for t in (1, 5, 8, 13, 40, 70):
            x = torch.randn(t, w.shape[1], generator=gen)
            _assert_matmul_close(lin(x), x.double() @ w.T)
            _assert_matmul_close(lin(x, prompt=True), x.double() @ w.T)
        # 3-D input: rows are everything but the last dimension
        x = torch.randn(2, 3, w.shape[1], generator=gen)
        _assert_matmul_close(lin(x), x.double() @ w.T)
        # the row gather a tied embedding uses
        ids = torch.tensor([0, 3, w.shape[0] - 1, 3])
        torch.testing.assert_close(lin.rows(ids).double(), w[ids], rtol=0, atol=1e-6 * w.abs().max().item())


FUSED = [  # stacked tensors of different types with the same column count: each must fit one held form
    ["w.Q4_0", "w.Q6_K"],            # 4-bit with zeros, 6-bit per-16 scales without
    ["w.Q4_0", "w.Q4_K", "w.Q4_1"],  # all 4-bit
    ["w.Q5_0", "w.Q5_1", "w.Q4_0"],  # 5- and 4-bit
    ["w.Q5_K", "w.Q4_K"],            # 5- and 4-bit k-quants
    ["w.Q8_0", "w.Q5_1", "w.Q5_0"],  # 8-bit without zeros, 5-bit
    ["w.Q6_K", "w.Q8_0"],            # per-16 and per-32 scales, no zeros
    ["p.Q6_K", "w.Q4_0"],            # per-16 scales exact in float16, with 4-bit
    ["w.F16", "w.Q4_0"],             # a float part
]


@pytest.mark.parametrize("names", FUSED, ids=["+".join(n[2:] for n in names) for names in FUSED])
def test_fused_tensors_of_different_types_give_the_concatenated_product(kernels, weights, names):
    g, reference = weights
    gen = torch.Generator().manual_seed(len(names))
    w = torch.cat([reference[name] for name in names])
    lin = _packed(g, names)
    for t in (1, 6, 11):
        x = torch.randn(t, COLS, generator=gen)
        _assert_matmul_close(lin(x), x.double() @ w.T)
    # a row map (llama's q/k un-permutation) reorders one part's rows in whatever form it is held
    perm = torch.randperm(ROWS, generator=gen)
    lin = _packed(g, names, row_maps={names[-1]: lambda rows: rows[perm]})
    w = torch.cat([reference[name] for name in names[:-1]] + [reference[names[-1]][perm]])
    x = torch.randn(7, COLS, generator=gen)
    _assert_matmul_close(lin(x), x.double() @ w.T)


# ------------------------------------------------------------------------ fused pre and post steps


def _norm_weight(gen, n):
    return 1.0 + 0.2 * torch.randn(n, generator=gen)


def _call_cases(gen, t, rows, cols):
    """(label, x, keyword arguments) for each combination the models use, and a few more."""
    x = torch.randn(t, cols, generator=gen)
    x2 = torch.randn(t, 2 * cols, generator=gen)
    res = torch.randn(t, rows, generator=gen)
    in_norm, out_norm = _norm_weight(gen, cols), _norm_weight(gen, rows)
    return [
        ("in_norm", 3.0 * x, dict(in_norm=in_norm, eps=1e-5)),
        ("silu", x2, dict(act="silu")),
        ("gelu_tanh", x2, dict(act="gelu_tanh")),
        ("residual", x, dict(residual=res)),
        ("out_norm+residual", x, dict(out_norm=out_norm, residual=res, eps=1e-6)),
        ("softcap", 4.0 * x, dict(softcap=1.5)),
        ("in_norm+out_norm+residual+softcap", x, dict(in_norm=in_norm, out_norm=out_norm, residual=res,
                                                      eps=1e-6, softcap=1.0)),
        ("gelu_tanh+out_norm+residual", x2, dict(act="gelu_tanh", out_norm=out_norm, residual=res, eps=1e-6)),
        ("silu+residual+softcap", 2.0 * x2, dict(act="silu", residual=res, softcap=0.5)),
    ]


FUSED_STEP_NAMES = [["w.Q4_K"], ["w.Q4_0", "v.Q4_0"], ["w.Q5_K"], ["w.Q5_0", "v.Q5_0"], ["w.Q8_0", "v.Q8_0"],
                    ["w.Q6_K", "p.Q6_K"], ["w.Q5_1", "v.Q5_1"], ["w.F32", "v.F32"]]


@pytest.mark.parametrize("names", FUSED_STEP_NAMES, ids=[n[0][2:] for n in FUSED_STEP_NAMES])
def test_fused_steps_match_dense_linear(kernels, weights, names):
    g, _ = weights
    gen = torch.Generator().manual_seed(11 + len(names[0]))
    for name in names:
        rows, cols = g.tensors[name].shape
        packed, dense = _packed(g, [name]), _dense(g, [name])
        for t in (1, 9):
            for label, x, kwargs in _call_cases(gen, t, rows, cols):
                got, expected = packed(x, **kwargs), dense(x, **kwargs)
                assert got.shape == expected.shape == (t, rows), label
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{label}: {m}")
                if "softcap" in kwargs:
                    cap = kwargs["softcap"]
                    assert 0.8 * cap < got.abs().max() <= cap, label  # the cap did bite


def test_in_norm_and_act_together_match_dense_linear(kernels, weights):
    g, _ = weights
    gen = torch.Generator().manual_seed(5)
    packed, dense = _packed(g, ["w.Q8_0"]), _dense(g, ["w.Q8_0"])
    x = 3.0 * torch.randn(4, 2 * COLS, generator=gen)
    kwargs = dict(in_norm=_norm_weight(gen, 2 * COLS), eps=1e-6, act="silu")
    torch.testing.assert_close(packed(x, **kwargs), dense(x, **kwargs), rtol=1e-4, atol=1e-4)


def test_non_contiguous_residual_matches_dense_linear(kernels, weights):
    g, _ = weights
    gen = torch.Generator().manual_seed(6)
    packed, dense = _packed(g, ["w.Q8_0"]), _dense(g, ["w.Q8_0"])
    x = torch.randn(4, COLS, generator=gen)
    residual = torch.randn(4, 2 * ROWS, generator=gen)[:, ::2]  # a strided view
    assert not residual.is_contiguous()
    torch.testing.assert_close(packed(x, residual=residual), dense(x, residual=residual), rtol=1e-4, atol=1e-4)


@pytest.mark.torch_threads(2)  # the column blocks must be split across threads
def test_wide_output_steps_split_across_threads_match_dense_linear_and_one_row_calls(kernels):
    """A row wider than the kernel's block of post-step columns (Gemma 3's 262k-wide softcapped head) has
    its residual and softcap done in column blocks on all threads: against torch's ops on the same
    weight, and bit for bit against one-row calls. 40_008 columns: two full blocks and a ragged end."""
    gen = torch.Generator().manual_seed(23)
    n_out, k = 40_008, 64
    weight = torch.randn(n_out, k, generator=gen) / 4
    packed = PackedLinear(KIND_F32, weight, torch.empty(0), None, 32, n_out, k)
    dense = DenseLinear(weight)
    x, res = torch.randn(3, k, generator=gen), torch.randn(3, n_out, generator=gen)
    for kwargs in (dict(softcap=2.0), dict(residual=res, softcap=3.0), dict(residual=res)):
        got = packed(x, **kwargs)
        torch.testing.assert_close(got, dense(x, **kwargs), rtol=1e-4, atol=1e-4)
        rows = [packed(x[i:i + 1], **{**kwargs, **({"residual": res[i:i + 1]} if "residual" in kwargs else {})})
                for i in range(3)]
        assert torch.equal(got, torch.cat(rows)), kwargs


@pytest.mark.parametrize("k", [2048, 4096])
def test_tiles_too_wide_for_l1_walk_k_in_blocks_with_the_same_bits(kernels, k):
    """8 rows of K = 2048 (4 of K = 4096) are more x than the kernel keeps per tile, so it walks K in
    blocks: every row still equals its one-row call bit for bit, and float64's product."""
    gen = torch.Generator().manual_seed(k)
    n_out = 37  # not a multiple of the block of weight rows
    weight = torch.randn(n_out, k, generator=gen) / 8
    lin = PackedLinear(KIND_F32, weight, torch.empty(0), None, 32, n_out, k)
    x = torch.randn(12, k, generator=gen)
    one_by_one = torch.cat([lin(x[i:i + 1]) for i in range(12)])
    for t in (4, 8, 9, 12):
        together = lin(x[:t])
        assert torch.equal(together, one_by_one[:t]), (t, (together - one_by_one[:t]).abs().max().item())
        _assert_matmul_close(together, x[:t].double() @ weight.double().T)


# -------------------------------------------------------------------------------- row independence


ROW_NAMES = ["w.Q4_0", "w.Q4_K", "w.Q5_0", "w.Q5_K", "w.Q8_0", "w.Q5_1", "w.Q6_K", "p.Q6_K", "w.F32"]


@pytest.mark.parametrize("mode", ["float32", "int8"])
@pytest.mark.parametrize("name", ROW_NAMES)
def test_each_output_row_is_bitwise_independent_of_the_others(kernels, weights, name, mode):
    """lin(x) for the first T of 40 rows equals those rows' one-row calls exactly, for every T in 1..40
    (full tiles of 16, 8 or 4 rows, and every remainder), with and without the fused steps, with float32 and
    with int8 activations (each row quantized on its own). Only calls marked `prompt` may sum in another
    order."""
    if mode == "int8" and not kernels.HAS_INT8_KERNELS:
        pytest.skip("this build has no int8 kernels (no AVX2)")
    with activations(mode):
        _check_rows_independent(weights, name)


def _check_rows_independent(weights, name):
    g, _ = weights
    gen = torch.Generator().manual_seed(17 + ROW_NAMES.index(name))
    lin = _packed(g, [name])
    in_norm, out_norm = _norm_weight(gen, COLS), _norm_weight(gen, ROWS)
    # up to 40 rows: a verify pass of a fixed draft length longer than the auto cap is still exact
    x, x2 = torch.randn(40, COLS, generator=gen), torch.randn(40, 2 * COLS, generator=gen)
    res = torch.randn(40, ROWS, generator=gen)
    calls = [
        ("plain", x, {}, False),
        ("in_norm", x, dict(in_norm=in_norm, eps=1e-6), False),
        ("gelu_tanh+out_norm+residual", x2, dict(act="gelu_tanh", out_norm=out_norm, eps=1e-6), True),
        ("silu+residual+softcap", x2, dict(act="silu", softcap=1.0), True),
    ]
    for label, inp, kwargs, with_residual in calls:
        call = lambda a, b: lin(inp[a:b], **kwargs, **({"residual": res[a:b]} if with_residual else {}))
        one_by_one = torch.cat([call(i, i + 1) for i in range(40)])
        for t in range(1, 41):
            together = call(0, t)
            assert torch.equal(together, one_by_one[:t]), (label, t, (together - one_by_one[:t]).abs().max().item())


# ------------------------------------------------------------------------------------ int8 activations


def _as_the_int8_kernels_see_it(x: torch.Tensor) -> torch.Tensor:
    """x as the rule the int8 kernels implement quantizes it (llama.cpp's Q8_0), written here in numpy: per
    row and block of 32, d = amax / 127 and q = round-half-even(x * (127 / amax)) in float32; float64 d * q."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    return torch.from_numpy((q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=_ids(QUANT_TYPES))
def test_int8_activations_match_float64_within_the_quantization_bound(int8_kernels, weights, qtype):
    """Two oracles, neither the kernel: (1) float64's product of the gguf reference weight with x quantized
    by the rule, to float32 rounding (the integer dot products are exact; scales and sums round); (2) the
    exact product, within what the rule allows: each x moves by at most d / 2 = amax / 254 of its block, so
    output n moves by at most sum over blocks of amax / 254 * sum |w| (plus that rounding)."""
    g, reference = weights
    gen = torch.Generator().manual_seed(300 + int(qtype))
    names = [f"w.{qtype.name}"] + ([] if qtype in K_QUANTS else [f"v.{qtype.name}"])
    names += ["p.Q6_K"] if qtype == Q.Q6_K else []
    for name in names:
        lin, w = _packed(g, [name]), reference[name]
        for t in (1, 3, 4, 7, 11):
            x = torch.randn(t, w.shape[1], generator=gen) * torch.linspace(0.1, 3.0, w.shape[1])  # uneven blocks
            got = lin(x)
            _assert_matmul_close(got, _as_the_int8_kernels_see_it(x) @ w.T)
            got = got.double()
            exact = x.double() @ w.T
            step = x.abs().reshape(t, -1, 32).amax(-1, keepdim=True).double() / 254
            bound = step.expand(t, w.shape[1] // 32, 32).reshape(t, -1) @ w.abs().T
            slack = 2e-6 * exact.abs().max().item()
            assert ((got - exact).abs() <= bound + slack).all(), name
            assert (got - exact).abs().max() > 1e-4 * exact.abs().max()  # int8 did run: not float32's error


@pytest.mark.parametrize("names", FUSED, ids=["+".join(n[2:] for n in names) for names in FUSED])
def test_int8_activations_on_fused_tensors_of_different_types(int8_kernels, weights, names):
    """The held forms only fused tensors take (int8 codes with zeros, per 32 and per 16): against float64
    of the gguf references with x quantized by the rule, odd group counts included (224 columns: 7 groups)."""
    g, reference = weights
    gen = torch.Generator().manual_seed(len(names) + 50)
    w = torch.cat([reference[name] for name in names])
    lin = _packed(g, names)
    # a float part makes the whole tensor float32, which keeps float activations
    seen = (lambda x: x.double()) if any("F16" in name for name in names) else _as_the_int8_kernels_see_it
    for t in (1, 5, 9):
        x = torch.randn(t, COLS, generator=gen)
        _assert_matmul_close(lin(x), seen(x) @ w.T)
    small = [f"v.{name[2:]}" for name in names]
    if all(name in reference for name in small):
        w, lin = torch.cat([reference[name] for name in small]), _packed(g, small)
        x = torch.randn(7, SMALL_COLS, generator=gen)
        _assert_matmul_close(lin(x), seen(x) @ w.T)


@pytest.mark.torch_threads(2)
@pytest.mark.parametrize("name", ["w.Q4_0", "w.Q5_K", "w.Q8_0", "w.Q6_K"])
def test_int8_rows_do_not_depend_on_the_thread_count(int8_kernels, weights, name):
    """Output rows are split across threads, never an output's sum: one and two threads, and every tile
    size, give the same bits."""
    g, _ = weights
    lin = _packed(g, [name])
    x = torch.randn(11, COLS, generator=torch.Generator().manual_seed(2))
    two = lin(x)
    torch.set_num_threads(1)
    one = torch.cat([lin(x[i:i + 1]) for i in range(11)])
    assert torch.equal(one, two)
    assert torch.equal(lin(x[:8]), two[:8])


@pytest.mark.torch_threads(2)
@pytest.mark.parametrize("name", ["w.Q4_0", "w.Q4_K", "w.Q8_0"])
def test_a_weight_pinned_to_a_mode_and_threads_gives_that_mode_s_bits_whatever_the_process_s(kernels, weights, name):
    """`PackedLinear.pin(int8, threads)` (a draft model beside its target): each call takes the pinned
    activations and at most the pinned threads, so its rows are the bits the process-wide mode gives, the
    other mode's process setting notwithstanding, and one thread changes no bit."""
    if not kernels.HAS_INT8_KERNELS:
        pytest.skip("this build has no int8 kernels (no AVX2)")
    g, _ = weights
    lin = _packed(g, [name])  # made under float32: both forms held
    x = torch.randn(9, COLS, generator=torch.Generator().manual_seed(4))
    floats = lin(x)
    with activations("int8"):
        ints = lin(x)
        lin.pin(False, 1)
        assert torch.equal(lin(x), floats)
    lin.pin(True, 1)
    assert torch.equal(lin(x), ints)
    assert not torch.equal(ints, floats)  # the two modes differ here, so the checks above tell them apart
    lin.pin(None, 0)
    assert torch.equal(lin(x), floats)


LANE_NAMES = ["w.Q4_1", "w.Q4_K", "w.Q5_0", "w.Q5_K", "w.Q8_0", "w.Q6_K"]


AMX_NAMES = [[n] for n in LANE_NAMES] + [LANE_NAMES] + [n for n in FUSED if all(m[2:4] != "F1" for m in n)]


@pytest.mark.parametrize("names", AMX_NAMES, ids=["+".join(n[2:] for n in names) for names in AMX_NAMES])
def test_amx_tiles_give_every_row_the_dpbusd_tiles_bits(int8_kernels, weights, names):
    """On a CPU with AMX (Intel since Sapphire Rapids) lane tiles of 16 rows take TDPBSUD. Its integer sums
    are the dpbusd chains' and the float steps after them the same, so for every row count (1-40: 16-row
    tiles and every remainder, all on AMX here) AMX gives the bits of the dpbusd tiles, and so of one-row
    steps; and both agree with float64 of the gguf reference weight times x quantized by the rule."""
    if not int8_kernels.HAS_AMX_TILES:
        pytest.skip("no AMX tiles: the build or the CPU (or the OS) has none")
    g, reference = weights
    lin, w = _packed(g, names), torch.cat([reference[n] for n in names])
    x = torch.randn(40, COLS, generator=torch.Generator().manual_seed(23)) * torch.linspace(0.1, 3.0, COLS)
    before = int8_kernels.set_amx_min_rows(0)
    try:
        dpbusd = [lin(x[:t]) for t in range(1, 41)]
        int8_kernels.set_amx_min_rows(1)  # every tile, one row too
        for t in range(1, 41):
            assert torch.equal(lin(x[:t]), dpbusd[t - 1]), t
    finally:
        int8_kernels.set_amx_min_rows(before)
    _assert_matmul_close(dpbusd[-1], _as_the_int8_kernels_see_it(x) @ w.T)


def test_amx_tiles_are_refused_where_there_are_none(int8_kernels):
    if int8_kernels.HAS_AMX_TILES:
        pytest.skip("this CPU has AMX tiles")
    assert int8_kernels.set_amx_min_rows(0) == 0
    with pytest.raises(RuntimeError, match="AMX tiles"):
        int8_kernels.set_amx_min_rows(4)


def test_amx_row_counts_are_checked(int8_kernels):
    for rows in (-1, 17):
        with pytest.raises(RuntimeError, match="from 1 to 16 rows"):
            int8_kernels.set_amx_min_rows(rows)


def test_the_product_rate_probe_times_the_work_it_names(kernels):
    """benchmarks/activations.py --floor divides by this rate, so a rate the compiler inflated (products of
    unchanging operands folded or hoisted out of the loop, as a first version's were) would give a floor
    below what the work costs. Each group's float step is added work, so with it the rate must not rise far:
    products hoisted out of the loop would leave the float steps alone, several times faster, while a core
    that schedules the mixed loop better can run it somewhat faster, within 1.5x. Best of three interleaved
    runs each, so a clock ramp or a busy neighbour does not decide it; and no core gives more than 4 steps of
    64 products a cycle at 6 GHz."""
    probe = native.product_rate_probe()  # built apart from the kernels' module, with its flags
    if not kernels.HAS_INT8_KERNELS:
        assert probe(0.01, False, False) == 0.0
        return
    probe(0.05, False, False)  # the clock ramps up before anything is compared
    for signed in (False, True):
        runs = [(probe(0.05, signed, False), probe(0.05, signed, True)) for _ in range(3)]
        products = max(plain for plain, _ in runs)
        with_float_steps = max(mixed for _, mixed in runs)
        assert 0 < with_float_steps <= 1.5 * products
        assert products <= 4 * 64 * 6e9


@pytest.mark.parametrize("name", LANE_NAMES + [LANE_NAMES])
def test_a_weight_held_for_int8_gives_the_row_form_back_exactly(int8_kernels, weights, name):
    """With int8 activations a weight is held in its lane form only (where the build has lane tiles). Its row
    lookups, and its row form when float32 activations are set, must be the file's weight as a weight
    loaded for float32 holds it, bit for bit; and the int8 product must not depend on which was loaded first."""
    if not int8_kernels.HAS_LANE_TILES or os.environ.get("OUTRIDER_LANE_TILES") == "0":
        pytest.skip("no lane tiles: this build has none, or OUTRIDER_LANE_TILES=0")
    g, reference = weights
    names = name if isinstance(name, list) else [name]
    lanes_only = _packed(g, names)
    assert lanes_only.lanes and lanes_only.codes.numel() == 0
    with activations("float32"):
        rows_too = _packed(g, names)
    assert rows_too.codes.numel() > 0
    x = torch.randn(5, COLS, generator=torch.Generator().manual_seed(9))
    _assert_matmul_close(lanes_only(x), _as_the_int8_kernels_see_it(x) @ torch.cat([reference[n] for n in names]).T)
    assert torch.equal(lanes_only(x), rows_too(x))  # both int8, both lane tiles
    assert lanes_only.tensors() == lanes_only.lanes  # what a forward reads, for the bandwidth figures
    ids = torch.tensor([0, 17, 95, 17, 40])
    assert torch.equal(lanes_only.rows(ids), rows_too.rows(ids))
    torch.testing.assert_close(lanes_only.rows(ids).double(), torch.cat([reference[n] for n in names])[ids],
                               rtol=0, atol=1e-6)
    held = lanes_only.held()
    with activations("float32"):  # the row form comes back, in place: the held copy sees it too
        assert torch.equal(lanes_only.codes, rows_too.codes) and torch.equal(lanes_only.scales, rows_too.scales)
        assert torch.equal(lanes_only.zeros, rows_too.zeros)
        assert held.codes.data_ptr() == lanes_only.codes.data_ptr()
        assert torch.equal(lanes_only(x), rows_too(x))
        assert [t.data_ptr() for t in lanes_only.tensors()] == [t.data_ptr() for t in
                                                                (lanes_only.codes, lanes_only.scales, lanes_only.zeros)]


FACTORED_NAMES = [["k.Q4_K"], ["k.Q5_K"], ["k.Q6_K"], ["p.Q6_K"], ["k.Q5_K", "k.Q4_K"], ["k.Q4_K", "k.Q6_K"],
                  ["k.Q6_K", "k.Q5_K", "k.Q4_K"]]


@pytest.mark.parametrize("names", FACTORED_NAMES, ids=["+".join(names) for names in FACTORED_NAMES])
def test_factored_k_quant_scales_give_the_float32_scales_bits(int8_kernels, weights, names, monkeypatch):
    """Where the build reads them so (lane tiles with F16C), a K-quant's lane form holds its scales and zeros as the
    file does: int8 sub-scales per unit times a float16 super-scale per 256 weights of a row, fused tensors of
    mixed K-quants too, their rows selected and reordered by row maps (a reduced head, llama's q/k order).
    Every such product is exact in float32, so for every row count (1-40: one-row steps, the tiles and their
    remainders) the products are the bits of the same weight with float32 scales and zeros, in 3/8 of their
    bytes or less; a fusion with a non-K-quant keeps float32 scales."""
    if not int8_kernels.FACTORED_SCALES or os.environ.get("OUTRIDER_LANE_TILES") == "0":
        pytest.skip("this build's lane tiles read float32 scales only, or OUTRIDER_LANE_TILES=0")
    monkeypatch.delenv("OUTRIDER_FACTORED_SCALES", raising=False)
    g, reference = weights
    gen = torch.Generator().manual_seed(len(names))
    # the first part's rows reordered (k.TYPE: all 32) or also selected (p.Q6_K: 48 of 96)
    chosen = torch.randperm(reference[names[0]].shape[0], generator=gen)[:max(32, reference[names[0]].shape[0] // 2)]
    maps = {names[0]: lambda rows: rows[chosen]}
    if len(names) > 1:
        perm = torch.randperm(reference[names[-1]].shape[0], generator=gen)
        maps[names[-1]] = lambda rows: rows[perm]
    mapped = lambda n: maps.get(n, lambda rows: rows)(reference[n])
    with activations("float32"):
        rows_too = _packed(g, names, row_maps=maps)  # its row form: float32 scales, the plain form's source
    factored = _packed(g, names, row_maps=maps)
    plain = PackedLinear(rows_too.kind, rows_too.codes, rows_too.scales,
                         rows_too.zeros if rows_too.zeros.numel() else None, rows_too.group, rows_too.n_out,
                         rows_too.k)
    assert len(factored.lanes) == 5 and factored.lanes[1].dtype == torch.int8 and len(plain.lanes) == 3
    assert factored.lanes[2].numel() == plain.lanes[2].numel()  # zeros where the plain form has them
    cols = factored.k
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(31)) * torch.linspace(0.1, 3.0, cols)
    for t in range(1, 41):
        assert torch.equal(factored(x[:t]), plain(x[:t])), t
    _assert_matmul_close(factored(x), _as_the_int8_kernels_see_it(x) @ torch.cat([mapped(n) for n in names]).T)
    scale_bytes = lambda lanes: sum(t.numel() * t.element_size() for t in lanes[1:])
    assert scale_bytes(factored.lanes) * 8 <= scale_bytes(plain.lanes) * 3
    assert len(_packed(g, ["w.Q4_K", "w.Q4_1"]).lanes) == 3
    ids = torch.tensor([0, 15, 16, factored.n_out - 1, 17, 16])  # both halves of two blocks
    assert torch.equal(factored.rows(ids), rows_too.rows(ids))  # the row form back from the factors


SIX_BIT_NAMES = [["k.Q6_K"], ["p.Q6_K"], ["w.Q6_K"], ["k.Q4_K", "k.Q6_K"], ["k.Q6_K", "k.Q5_K", "k.Q4_K"],
                 ["w.Q6_K", "w.Q4_0"]]


@pytest.mark.parametrize("names", SIX_BIT_NAMES, ids=["+".join(names) for names in SIX_BIT_NAMES])
def test_six_bit_lanes_give_the_eight_bit_lanes_bits(int8_kernels, weights, names, monkeypatch):
    """Where the build reads them (lane tiles with F16C), int8 codes within -32..31 (Q6_K's, and K-quants fused
    with it) are held in six bits, as the file holds them: their integer sums are the int8 codes' to the
    integer, so for every row count (1-40) the products are the bits of the eight-bit form, in 3/4 of its
    code bytes, and the row form comes back exactly; codes beyond six bits (Q8_0) keep eight."""
    if not int8_kernels.SIX_BIT_LANES or os.environ.get("OUTRIDER_LANE_TILES") == "0":
        pytest.skip("this build's lane tiles read eight-bit codes only, or OUTRIDER_LANE_TILES=0")
    monkeypatch.delenv("OUTRIDER_SIX_BIT_LANES", raising=False)
    g, reference = weights
    six = _packed(g, names)
    monkeypatch.setenv("OUTRIDER_SIX_BIT_LANES", "0")
    eight = _packed(g, names)
    with activations("float32"):
        rows_too = _packed(g, names)
    assert six.kind == eight.kind == KIND_Q8
    assert six.lanes[0].numel() * 4 == eight.lanes[0].numel() * 3
    cols = six.k
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(37)) * torch.linspace(0.1, 3.0, cols)
    for t in range(1, 41):
        assert torch.equal(six(x[:t]), eight(x[:t])), t
    _assert_matmul_close(six(x), _as_the_int8_kernels_see_it(x) @ torch.cat([reference[n] for n in names]).T)
    ids = torch.tensor([0, 17, 31, 17, 5])
    assert torch.equal(six.rows(ids), rows_too.rows(ids))
    monkeypatch.delenv("OUTRIDER_SIX_BIT_LANES")
    assert _packed(g, ["w.Q6_K", "w.Q8_0"]).lanes[0].numel() == 2 * ROWS * COLS  # a byte a code


def test_a_weight_made_inside_an_int8_block_takes_its_rows_when_the_block_ends(int8_kernels, weights):
    """`activations("int8")` as a block returns to float32 the way use_activations does, so a weight loaded
    inside it (held in its lane form only) gets its row form back and still runs, with float32's result."""
    if not int8_kernels.HAS_LANE_TILES or os.environ.get("OUTRIDER_LANE_TILES") == "0":
        pytest.skip("no lane tiles: this build has none, or OUTRIDER_LANE_TILES=0")
    g, reference = weights
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(4))
    with activations("float32"):
        with activations("int8"):
            lin = _packed(g, ["w.Q4_K"])
            assert lin.codes.numel() == 0
        assert lin.codes.numel() > 0
        _assert_matmul_close(lin(x), x.double() @ reference["w.Q4_K"].T)


def test_int8_activations_carry_a_nan_to_its_row_only(int8_kernels, weights):
    """A NaN among the activations makes its own row's outputs NaN, as float32 arithmetic would (the
    block's maximum alone would drop it), and leaves the other rows exactly as they were."""
    g, _ = weights
    lin = _packed(g, ["w.Q4_0"])
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(4))
    clean = lin(x)
    x[1, 40] = float("nan")
    got = lin(x)
    assert torch.isnan(got[1]).all()
    assert torch.equal(got[0], clean[0]) and torch.equal(got[2], clean[2])


def test_int8_activations_leave_float_weights_in_float32(int8_kernels, weights):
    g, reference = weights
    lin, w = _packed(g, ["w.F32"]), reference["w.F32"]
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(1))
    _assert_matmul_close(lin(x), x.double() @ w.T)


def test_activation_modes_are_checked(kernels):
    from outrider.errors import ConfigError
    from outrider.plugins.backends.cpu import CPUBackend

    with pytest.raises(ConfigError, match="choose one of"):
        native.use_activations("int4")

    with pytest.raises(ConfigError, match="auto, int8, float32"):
        CPUBackend(activations="bf16")


# ------------------------------------------------------------------------------------- tiny models


MODEL_CASES = [("llama", True), ("llama", False), ("gemma3", True), ("gemma3", False)]
WINDOW = 6  # gemma3's local layers: smaller than every sequence below


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_native")
    paths = {}
    for arch, quantize in MODEL_CASES:
        path = folder / f"{arch}_{'q8' if quantize else 'f32'}.gguf"
        if arch == "llama":
            paths[arch, quantize] = write_tiny_llama(path, seed=3, quantize=quantize)
        else:
            paths[arch, quantize] = write_tiny_gemma3(path, seed=3, window=WINDOW, quantize=quantize)
    return paths


def _compact(path):
    model = load_model(GGUFFile(path), weights="compact")
    # the kernels, not the dense fallback, run every step (else these tests would compare torch with itself)
    assert isinstance(model.output, PackedLinear)
    assert all(isinstance(lin, PackedLinear) for layer in model.layers
               for lin in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
    assert model.attention.kernels is not None
    return model


def _tokens(n, vocab, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch,quantize", MODEL_CASES, ids=[f"{a}-{'q8' if q else 'f32'}" for a, q in MODEL_CASES])
def test_compact_logits_match_dense_logits(kernels, tiny_models, arch, quantize):
    path = tiny_models[arch, quantize]
    compact, dense = _compact(path), load_model(GGUFFile(path), weights="dense")
    assert isinstance(dense.output, DenseLinear)
    vocab = compact.config.vocab_size
    for n in (40, 70):  # 70 > the 64-row prefill chunk of the packed path
        tokens = _tokens(n, vocab, seed=n)
        got = compact.forward(tokens, 0, compact.new_cache(96))
        expected = dense.forward(tokens, 0, dense.new_cache(96))
        assert got.shape == expected.shape == (n, vocab)
        assert expected.abs().max() > 1.0
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
        # and continuing from a cache: 5 more tokens after the n
        more = _tokens(5, vocab, seed=n + 1)
        cache_c, cache_d = compact.new_cache(96), dense.new_cache(96)
        compact.forward(tokens, 0, cache_c)
        dense.forward(tokens, 0, cache_d)
        torch.testing.assert_close(compact.forward(more, n, cache_c), dense.forward(more, n, cache_d),
                                   rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode", ["float32", "int8"])
@pytest.mark.parametrize("arch,quantize", MODEL_CASES, ids=[f"{a}-{'q8' if q else 'f32'}" for a, q in MODEL_CASES])
def test_compact_batched_forward_equals_single_token_forwards_bitwise(kernels, tiny_models, arch, quantize, mode):
    """A verify pass over k tokens gives exactly the logits of k decoding steps (k = 3, 9, 17), and after
    rolling the cache back into the block, the next step is exactly plain decoding's; with float32 and with
    int8 activations."""
    if mode == "int8" and not kernels.HAS_INT8_KERNELS:
        pytest.skip("this build has no int8 kernels (no AVX2)")
    with activations(mode):
        _check_verify_equals_steps(_compact(tiny_models[arch, quantize]))


def _check_verify_equals_steps(model):
    # positions 50..66: past the gemma3 window, and across the kernel's 64-position key block
    vocab, prefix_len, longest = model.config.vocab_size, 50, 17
    prefix = _tokens(prefix_len, vocab, seed=1)
    block = _tokens(longest, vocab, seed=2)
    replacement = _tokens(1, vocab, seed=3)
    max_len = prefix_len + longest + 8

    # plain decoding: the prefix, then one token per forward
    plain_cache = model.new_cache(max_len)
    model.forward(prefix, 0, plain_cache)
    single = torch.cat([model.forward(block[i:i + 1], prefix_len + i, plain_cache) for i in range(longest)])
    assert single.shape == (longest, vocab)

    # verify passes of k drafted tokens after the same prefix, each rolled back before the next
    cache = model.new_cache(max_len)
    model.forward(prefix, 0, cache)
    for k in (17, 9, 3):  # longest first, so each rollback below only shortens the plain cache
        batched = model.forward(block[:k], prefix_len, cache)
        assert torch.equal(batched, single[:k]), (k, (batched - single[:k]).abs().max().item())
        # keep j of the k drafted tokens, then decode a different one: exactly plain decoding's step
        j = k // 2
        cache.truncate(prefix_len + j)
        after_rollback = model.forward(replacement, prefix_len + j, cache)
        plain_cache.truncate(prefix_len + j)
        plain = model.forward(replacement, prefix_len + j, plain_cache)
        assert torch.equal(after_rollback, plain), (k, j, (after_rollback - plain).abs().max().item())
        cache.truncate(prefix_len)


@pytest.mark.parametrize("window", [0, 5])
def test_attention_with_three_heads_per_kv_group_matches_float64_and_single_queries(kernels, window):
    """Heads of one kv group share a work item in groups of up to four, chosen by how many tokens the call
    has; with three heads per group (SmolLM2's shape, not the tiny models') a 6-token call and six
    1-token calls group them differently. Oracles: the single calls, bit for bit, and float64 torch
    attention (rotary, causal, optionally windowed)."""
    from outrider.models.kv_cache import KVCache
    from outrider.models.layers import Rotary

    n_heads, n_kv, d, prompt_len, t_len = 6, 2, 32, 9, 6
    end = prompt_len + t_len
    rotary = Rotary(d, 10000.0, 128)
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(end, (n_heads + 2 * n_kv) * d, generator=gen)

    def new_caches():
        cache = KVCache(1, n_kv, d, 64, keys_transposed=True)
        return cache.keys[0], cache.values[0]

    call = lambda rows, start, cache: kernels.attend(rows.contiguous(), *cache, start, n_heads, n_kv, d, rotary.cos,
                                                     rotary.sin, None, None, 1e-6, window, d ** -0.5, 0, False)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # the grouping depends on the thread count; two threads split it differently
    try:
        batched_cache, single_cache = new_caches(), new_caches()
        call(qkv[:prompt_len], 0, batched_cache)
        call(qkv[:prompt_len], 0, single_cache)
        batched = call(qkv[prompt_len:], prompt_len, batched_cache)
        single = torch.cat([call(qkv[p:p + 1], p, single_cache) for p in range(prompt_len, end)])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(batched, single), (batched - single).abs().max().item()

    x = qkv.double().view(end, n_heads + 2 * n_kv, d)
    cos, sin = rotary.cos[:end, None].double(), rotary.sin[:end, None].double()
    rotate = lambda t: t * cos + torch.roll(t, d // 2, dims=-1) * sin
    q, k, v = rotate(x[:, :n_heads]), rotate(x[:, n_heads:n_heads + n_kv]), x[:, n_heads + n_kv:]
    k, v = k.repeat_interleave(n_heads // n_kv, dim=1), v.repeat_interleave(n_heads // n_kv, dim=1)
    pos = torch.arange(end)
    visible = pos[None, :] <= pos[:, None]
    if window:
        visible &= pos[:, None] - pos[None, :] < window
    scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    expected = torch.einsum("hqk,khd->qhd", probs, v).reshape(end, n_heads * d)[prompt_len:]
    torch.testing.assert_close(batched.double(), expected, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------ other CPU levels


def _cpu_has(flag: str) -> bool:
    return flag in native.cpu_flags().split()


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 CPU levels")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64", pytest.param(
    "x86-64-v3 -mavxvnni", marks=pytest.mark.skipif(not _cpu_has("avx_vnni"), reason="the CPU has no AVX-VNNI")),
    pytest.param("native --param avoid-fma-max-bits=512", marks=pytest.mark.skipif(
        not native.compiler_is_gcc(), reason="a GCC tuning parameter"))])
def test_kernels_built_for_other_cpu_levels_pass_the_fast_tests(march):
    """The AVX2 build (CPUs without AVX-512, like some of our machines), the AVX2 build with AVX-VNNI's
    256-bit dpbusd (Intel since Alder Lake) and the portable build (no x86 intrinsics, no F16C) take code
    paths that -march=native skips here: run this file's fast tests on them. The last build leaves
    multiply-adds in accumulation chains of up to 512 bits unfused, as (by its same five failures) GCC 13's
    Sapphire Rapids tuning does; attention's bits then depended on how many heads a call grouped, until the
    kernels' own flags (cflags) overrode it."""
    env = dict(os.environ, OUTRIDER_NATIVE_MARCH=march)
    done = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-m", "not slow", "-p", "no:cacheprovider"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


LOGITS_OF_A_BUILD = """
import sys, torch
from outrider.io.gguf import GGUFFile
from outrider.plugins.backends.cpu import CPUBackend
from outrider import native
torch.set_num_threads(1)
model = CPUBackend().load_model(GGUFFile(sys.argv[1]))
cache = model.new_cache(64)
tokens = torch.arange(3, 3 + 24) * 7 % 1000
with native.activations("int8"):
    model.forward(tokens[:16], 0, cache)
    torch.save((model.forward(tokens[16:], 16, cache), native.load().HAS_DPBUSD256), sys.argv[2])
"""


@pytest.mark.slow
@pytest.mark.skipif(not _cpu_has("avx_vnni"), reason="the CPU has no AVX-VNNI")
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_avx_vnni_gives_the_avx2_builds_bits(which, smollm2_path, gemma3_path, tmp_path):
    """AVX-VNNI's dpbusd replaces maddubs + madd in the AVX2 int8 tiles: the integer sums are the same, so an
    8-row verify pass over a real model (Q4_1 and Q8_0; Q4_K, Q5_K and Q6_K) gives the same bits in both builds."""
    path = {"smollm2": smollm2_path, "gemma3": gemma3_path}[which]
    out = {}
    for march in ("x86-64-v3", "x86-64-v3 -mavxvnni"):
        out[march] = tmp_path / f"{march.replace(' ', '_')}.pt"
        done = subprocess.run([sys.executable, "-c", LOGITS_OF_A_BUILD, str(path), str(out[march])],
                              env=dict(os.environ, OUTRIDER_NATIVE_MARCH=march), capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
    (plain, plain_dpbusd), (vnni, vnni_dpbusd) = (torch.load(p) for p in out.values())
    assert (plain_dpbusd, vnni_dpbusd) == (False, True)  # each build took the path it is named for
    assert plain.shape == (8, plain.shape[1]) and torch.isfinite(plain).all()
    assert torch.equal(plain, vnni)


# Instruction sets a default build takes where the CPU has them: AVX-VNNI's 256-bit dpbusd (Intel since Alder
# Lake, the path of most recent laptops) and AMX tiles with AVX512-VNNI (Xeons since Sapphire Rapids). Their
# bit-exactness tests run only where the CPU has them; this compiles each wherever the compiler can target it,
# so a change that breaks one cannot pass on a machine without it.
COMPILE_ONLY = {
    "avx-vnni (x86-64-v3 -mavxvnni)": ("-march=x86-64-v3", "-mavxvnni"),
    "amx + avx512-vnni (sapphirerapids)": ("-march=sapphirerapids",),
}


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction sets")
@pytest.mark.parametrize("label", COMPILE_ONLY)
def test_every_default_kernel_path_compiles_here(label, tmp_path):
    import sysconfig

    from torch.utils import cpp_extension

    march = COMPILE_ONLY[label]
    flags = [f for f in native.cflags() if not f.startswith("-march")]
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    probe = subprocess.run([native._compiler(), *march, "-E", "-dM", "-x", "c++", "/dev/null"], capture_output=True,
                           text=True)
    if probe.returncode != 0:
        pytest.skip(f"the compiler cannot target {label}: {probe.stderr.strip()[:200]}")
    wanted = {"avx-vnni (x86-64-v3 -mavxvnni)": ["__AVXVNNI__"],
              "amx + avx512-vnni (sapphirerapids)": ["__AMX_INT8__", "__AMX_TILE__", "__AVX512VNNI__"]}[label]
    assert all(f"#define {m} " in probe.stdout for m in wanted), f"{label} does not define {wanted}"

    def compile_one(source):
        # -O0: what is checked here is that each path compiles (intrinsics inline into their callers at any
        # level); the optimised code is tested by the bit-exactness tests on CPUs that have these instructions
        command = [native._compiler(), *flags, *march, "-O0", "-std=c++20", "-fPIC",
                   "-DTORCH_EXTENSION_NAME=compile_check", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes, "-c",
                   str(source), "-o", str(tmp_path / f"{source.stem}.o")]
        return source, subprocess.run(command, capture_output=True, text=True, timeout=900)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for source, built in pool.map(compile_one, native.sources()):
            assert built.returncode == 0, source.name + ": " + built.stderr[-3000:]
