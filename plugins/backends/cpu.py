"""The CPU backend. Weights stay compact, as the GGUF's own codes with float32 scales and zeros,
and run through Outrider's kernels (`outrider.native`, built on first use) with float32 activations;
`weights = dense` dequantizes everything to `dtype` and runs torch's ops instead."""

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
        "batch_invariant": (bool, True, "with weights=dense: attention in float64, so a verify pass's logits stay "
                            "within ~1e-4 of single steps (torch's matmuls still sum in another order; the "
                            "compact kernels give the same bits by construction)"),
        "threads": (int, 0, "torch intra-op threads; 0 keeps torch's default (one per core)"),
    })
