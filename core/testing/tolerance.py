"""How close a backend's logits must be to the float32 reference's: float32 noise for float32 backends, and for
16-bit ones a bound derived from an oracle (transformers' own model of each fixture in float64 against the same
model in bfloat16), not from the drift of the code under test. The contract suite reads the recorded table, so
it runs without transformers; tests/test_bf16_bound.py re-measures it (tests/oracles/bf16_error.py)."""

from __future__ import annotations

import torch

# max |logits in bfloat16 - logits in float64| of transformers' model of each tiny fixture (the GGUF's weights,
# dequantized by gguf), over the backend checks' inputs (`tests/oracles/bf16_error.py`, `oracle_inputs`): what
# an honest bfloat16 implementation of that model is off by. Gemma 4's is ten times the others' because the
# tiny model amplifies small perturbations: rounding only its weights to bfloat16 moves its logits as much; it is
# also the one whose error moves with the CPU's bfloat16 kernels (an AMX Xeon's and an AVX512-BF16 EPYC's torch
# round apart), so its entry sits between the two, within the re-measurement's margin of each.
BF16_ORACLE_ERROR = {"llama": 0.0686, "qwen2": 0.0737, "qwen3": 0.174, "gemma3": 0.154, "gemma4": 0.80}
# Another implementation rounds in another order (its own matmul blocking, fused kernels, attention in float32
# or not): the built-in CPU backend's bfloat16 path is within 0.8-1.2x of the oracle's error on every fixture
# (tests/test_bf16_bound.py), so twice the oracle's error leaves room for kernels that round elsewhere.
BF16_FACTOR = 2.0
FLOAT32_RELATIVE = 1e-3  # float32 summed in another order, relative to the largest logit; also the floor


def bf16_bound(arch: str, reference: torch.Tensor) -> float:
    """The most a bfloat16 (or float16, which rounds less) backend's logits may differ from the float32
    reference's on the tiny `arch` fixture: BF16_FACTOR x the oracle's bfloat16 error, never below float32 noise."""
    if arch not in BF16_ORACLE_ERROR:
        raise KeyError(f"no recorded bfloat16 oracle error for architecture {arch!r} (have "
                       f"{', '.join(BF16_ORACLE_ERROR)}): measure it with tests/oracles/bf16_error.py")
    return max(BF16_FACTOR * BF16_ORACLE_ERROR[arch], float32_bound(reference))


def float32_bound(reference: torch.Tensor) -> float:
    return FLOAT32_RELATIVE * max(1.0, float(reference.abs().max()))


def logit_tolerance(dtype: torch.dtype, arch: str, reference: torch.Tensor) -> float:
    """The tolerance for a backend computing in `dtype` on the `arch` fixture against `reference` logits."""
    return float32_bound(reference) if dtype in (torch.float32, torch.float64) else bf16_bound(arch, reference)
