"""The CPU backend: torch on the host. Weights stay compact (GGUF 4-bit types as int4, other quantized
types as int8, run by torch's weight-only kernels) and activations are float32; `weights = dense`
dequantizes everything to `dtype` instead, for exact float32 arithmetic."""

from __future__ import annotations

import torch

from outrider.backend import DTYPES, Backend
from outrider.models.linear import WEIGHT_MODES
from outrider.hookspecs import hookimpl


class CPUBackend(Backend):
    device = torch.device("cpu")

    def __init__(self, dtype: str = "float32", weights: str = "compact", batch_invariant: bool = True,
                 threads: int = 0):
        super().__init__(dtype, weights, batch_invariant)
        if threads > 0:
            torch.set_num_threads(threads)


@hookimpl
def register_backends(register):
    register("cpu", CPUBackend, options={
        "dtype": (str, "float32", f"weights and activations: {', '.join(DTYPES)}"),
        "weights": (str, "compact", f"how weights are held: {', '.join(WEIGHT_MODES)} (see README, Numerics)"),
        "batch_invariant": (bool, True, "attention in float64, so verify passes give bit for bit the logits of "
                            "single steps and greedy speculation equals plain decoding; false is 5-20% faster "
                            "past a few hundred tokens of context, and may part from plain decoding at near-ties"),
        "threads": (int, 0, "torch intra-op threads; 0 keeps torch's default (one per core)"),
    })
