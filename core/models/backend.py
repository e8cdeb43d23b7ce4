"""What a backend is: where a model's weights live and what precision they compute in.

A backend turns a GGUF file into a model object with `forward(tokens, start, cache, hidden=False)`,
`new_cache(max_len)` and `config` (vocab_size, hidden_size, n_layers, context_length, ...).
Subclasses set `device`; the architectures themselves are shared (`outrider.models`).
"""

from __future__ import annotations

import torch

from outrider.errors import ConfigError
from outrider.io.gguf import GGUFFile
from outrider.models import load_model
from outrider.models.linear import check_weights_mode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16"}


class Backend:
    device: torch.device

    def __init__(self, dtype: str = "float32", weights: str = "dense", batch_invariant: bool = True):
        name = DTYPE_ALIASES.get(dtype, dtype)
        if name not in DTYPES:
            raise ConfigError(f"unknown dtype '{dtype}'; choose one of: {', '.join(DTYPES)}")
        check_weights_mode(weights)  # before any file is read
        self.dtype, self.weights, self.batch_invariant = DTYPES[name], weights, batch_invariant

    def load_model(self, g: GGUFFile):
        return load_model(g, dtype=self.dtype, device=self.device, weights=self.weights,
                          batch_invariant=self.batch_invariant)
