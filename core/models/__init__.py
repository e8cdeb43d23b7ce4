"""Model architectures, looked up by the GGUF file's `general.architecture`."""

from __future__ import annotations

import torch

from ..errors import ModelFileError
from ..gguf_file import GGUFFile
from .gemma3 import Gemma3
from .llama import Llama

ARCHITECTURES = {cls.architecture: cls for cls in (Llama, Gemma3)}


def load_model(g: GGUFFile, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    cls = ARCHITECTURES.get(g.architecture)
    if cls is None:
        raise ModelFileError(f"{g.path}: unknown architecture '{g.architecture}'; "
                             f"supported: {', '.join(sorted(ARCHITECTURES))}")
    return cls(g, dtype=dtype, device=device)
