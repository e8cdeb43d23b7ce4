"""The CPU backend. Weights stay compact, as the GGUF's own codes with float32 scales and zeros,
and run through Outrider's kernels (`outrider.native`, built on first use); `activations` chooses whether
the kernels quantize activations to int8 first (the fast path on AVX2) or keep them float32.
`weights = dense` dequantizes everything to `dtype` and runs torch's ops instead."""

from __future__ import annotations

import ctypes

import torch

from outrider.hookspecs import hookimpl
from outrider.models.backend import DTYPES, Backend
from outrider.models.linear import WEIGHT_MODES
from outrider.native import check_activations_mode


class CPUBackend(Backend):
    device = torch.device("cpu")

    def __init__(self, dtype: str = "float32", weights: str = "compact", batch_invariant: bool = True,
                 threads: int = 0, activations: str = "auto"):
        super().__init__(dtype, weights, batch_invariant)
        check_activations_mode(activations)  # before any file is read
        self.activations = activations
        if threads > 0:
            torch.set_num_threads(threads)

    def load_model(self, g):
        if self.weights == "compact":
            from outrider import native

            try:
                native.use_activations(self.activations)  # one setting for the process's kernels
            except native.NativeUnavailable:
                pass  # load_model warns and runs dense
        model = super().load_model(g)
        _return_freed_memory()
        return model


def _return_freed_memory() -> None:
    """Loading passes the weights through transient forms (GGUF blocks, codes, the lane form) whose freed
    pages glibc keeps; hand them back, or the process's resident size stays about 20% above what the model
    holds (Gemma 3 270M, native build, int8 activations, loaded alone: 812 -> 675 MB). Elsewhere than glibc, nothing to do."""
    try:
        ctypes.CDLL(None).malloc_trim(0)  # the loaded libc (find_library would run ldconfig per load)
    except (OSError, AttributeError):
        pass


@hookimpl
def register_backends(register):
    register("cpu", CPUBackend, options={
        "dtype": (str, f"weights and activations: {', '.join(DTYPES)}"),
        "weights": (str, f"how weights are held: {', '.join(WEIGHT_MODES)} (see docs/numerics.md)"),
        "batch_invariant": (bool, "with weights=dense: attention in float64, so a verify pass's logits stay "
                            "within ~1e-4 of single steps (torch's matmuls still sum in another order; the "
                            "compact kernels give the same bits by construction)"),
        "activations": (str, "with weights=compact: int8 quantizes each activation row per 32 values "
                        "and multiplies in integers (llama.cpp's design; the fast path on AVX2), float32 keeps "
                        "them exact; auto = int8 on AVX2 without AVX-512 and on AVX512-VNNI, float32 elsewhere (see docs/numerics.md)"),
        "threads": (int, "torch intra-op threads; 0 keeps torch's default (one per core)"),
    })
