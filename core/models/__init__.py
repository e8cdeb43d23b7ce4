"""Model architectures, looked up by the GGUF file's `general.architecture`."""

from __future__ import annotations

import torch

from ..errors import ModelFileError
from ..gguf_file import GGUFFile
from .gemma3 import Gemma3
from .layers import ATTENTION_DTYPE
from .linear import check_weights_mode
from .llama import Llama

ARCHITECTURES = {cls.architecture: cls for cls in (Llama, Gemma3)}


def load_model(g: GGUFFile, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               weights: str = "dense", batch_invariant: bool = True):
    """The model in `g`. `weights`: `dense` dequantizes to `dtype`; `compact` keeps 4-bit types as int4 and
    other quantized types as int8 (see `outrider.models.linear`). `batch_invariant`: attention in float64,
    so a forward over k tokens gives bit for bit the logits of k single steps (see `layers.attention`)."""
    cls = ARCHITECTURES.get(g.architecture)
    if cls is None:
        raise ModelFileError(f"{g.path}: unknown architecture '{g.architecture}'; "
                             f"supported: {', '.join(sorted(ARCHITECTURES))}")
    check_weights_mode(weights)
    attention_dtype = ATTENTION_DTYPE if batch_invariant else dtype
    return cls(g, dtype=dtype, device=device, weights=weights, attention_dtype=attention_dtype)
