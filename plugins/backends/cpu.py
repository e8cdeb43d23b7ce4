"""The CPU backend: torch on the host, float32 by default, bfloat16 selectable."""

from __future__ import annotations

import torch

from outrider.backend import DTYPES, Backend
from outrider.hookspecs import hookimpl


class CPUBackend(Backend):
    device = torch.device("cpu")

    def __init__(self, dtype: str = "float32", threads: int = 0):
        super().__init__(dtype)
        if threads > 0:
            torch.set_num_threads(threads)


@hookimpl
def register_backends(register):
    register("cpu", CPUBackend, options={
        "dtype": (str, "float32", f"weights and activations: {', '.join(DTYPES)}"),
        "threads": (int, 0, "torch intra-op threads; 0 keeps torch's default (one per core)"),
    })
