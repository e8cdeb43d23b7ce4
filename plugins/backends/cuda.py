"""The CUDA backend: torch on an NVIDIA GPU, bfloat16 activations.

By default weights stay compact (the GGUF's 4-bit codes in torch's int4 weight-only kernel, other types
int8 per row: `outrider.models.torch_quant`) and decode/verify steps of up to 16 tokens are captured as
CUDA graphs over a preallocated cache (`outrider.models.static_step`). `weights = dense, graphs = false` is
the earlier path: every weight dequantized to bfloat16, torch's eager ops, a Python loop per layer.

Speculation on this backend is argmax-stable, not bit-exact: a verify pass over k + 1 rows may sum in
another order than a one-row step, so greedy speculative output equals plain greedy decoding except where
the target's top two logits are within the margin `outrider.testing.argmax_stable` states and measures.
"""

from __future__ import annotations

import torch

from outrider.errors import ConfigError
from outrider.hookspecs import hookimpl
from outrider.models.backend import DTYPES, Backend
from outrider.models.linear import WEIGHT_MODES
from outrider.models.static_step import STATIC_ARCHITECTURES, StaticStepModel


class CUDABackend(Backend):
    def __init__(self, dtype: str = "bfloat16", device: int = 0, batch_invariant: bool = False,
                 weights: str = "compact", graphs: bool = True):
        if not torch.cuda.is_available():
            raise ConfigError("backend 'cuda' needs a CUDA GPU and a CUDA build of torch; use --backend cpu")
        super().__init__(dtype, weights=weights, batch_invariant=batch_invariant)
        if weights == "compact" and self.dtype != torch.bfloat16:
            raise ConfigError("compact weights on CUDA run torch's int4 kernel, which takes bfloat16 activations; "
                              "use -o backend.dtype bfloat16, or -o backend.weights dense")
        self.device = torch.device("cuda", device)
        self.graphs = graphs

    def load_model(self, g):
        model = super().load_model(g)
        if self.graphs and model.architecture in STATIC_ARCHITECTURES:
            return StaticStepModel(model, graphs=True)
        return model


@hookimpl
def register_backends(register):
    register("cuda", CUDABackend, aliases=("gpu",), options={
        "dtype": (str, f"activations (and dense weights): {', '.join(DTYPES)}"),
        "device": (int, "CUDA device index"),
        "batch_invariant": (bool, "attention in float64 (see the cpu backend); the weight kernels still "
                            "vary with the number of rows, so on the GPU this alone does not make verify passes "
                            "exact"),
        "weights": (str, f"how weights are held: {', '.join(WEIGHT_MODES)} (compact: GGUF 4-bit codes "
                    "in torch's int4 kernel, other types int8 per row; dense: bfloat16)"),
        "graphs": (bool, "decode/verify steps of up to 16 tokens as CUDA graphs over a static cache"),
    })
