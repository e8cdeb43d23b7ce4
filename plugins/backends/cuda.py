"""The CUDA backend: torch on an NVIDIA GPU, bfloat16 by default."""

from __future__ import annotations

import torch

from outrider.backend import DTYPES, Backend
from outrider.errors import ConfigError
from outrider.hookspecs import hookimpl


class CUDABackend(Backend):
    def __init__(self, dtype: str = "bfloat16", device: int = 0, batch_invariant: bool = False):
        if not torch.cuda.is_available():
            raise ConfigError("backend 'cuda' needs a CUDA GPU and a CUDA build of torch; use --backend cpu")
        super().__init__(dtype, batch_invariant=batch_invariant)
        self.device = torch.device("cuda", device)


@hookimpl
def register_backends(register):
    register("cuda", CUDABackend, aliases=("gpu",), options={
        "dtype": (str, "bfloat16", f"weights and activations: {', '.join(DTYPES)}"),
        "device": (int, 0, "CUDA device index"),
        "batch_invariant": (bool, False, "attention in float64 (see the cpu backend); cuBLAS matmuls still vary "
                            "with the number of rows, so on the GPU this alone does not make verify passes exact"),
    })
