"""Model architectures, looked up by the GGUF file's `general.architecture`."""

from __future__ import annotations

import warnings

import torch

from outrider.errors import ModelFileError
from outrider.io.gguf import GGUFFile
from outrider.models.gemma3 import Gemma3
from outrider.models.gemma4 import Gemma4
from outrider.models.layers import ATTENTION_DTYPE
from outrider.models.linear import check_weights_mode
from outrider.models.llama import Llama
from outrider.models.qwen import Qwen2, Qwen3
from outrider.native import NativeUnavailable
from outrider.native import load as load_native

ARCHITECTURES = {cls.architecture: cls for cls in (Llama, Qwen2, Qwen3, Gemma3, Gemma4)}
QUANTIZED_ON_GPU = (Llama, Qwen2, Qwen3, Gemma3)  # take linear_form="quantized" (gemma4's experts do not yet)
# relatives of supported architectures that are not: what to use instead, said in the one-line error
KNOWN_UNSUPPORTED = {
    "qwen2moe": " (Qwen MoE models are not supported: use a dense qwen2 model)",
    "qwen3moe": " (Qwen3 MoE models are not supported: use a dense qwen3 model)",
    "qwen2vl": " (Qwen2-VL vision models are not supported: use a text-only qwen2 model)",
    "qwen3vl": " (Qwen3-VL vision models are not supported: use a text-only qwen3 model)",
    "qwen3vlmoe": " (Qwen3-VL vision models are not supported: use a text-only qwen3 model)",
}


def load_model(g: GGUFFile, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               weights: str = "dense", batch_invariant: bool = True):
    """The model in `g`. `weights`: `dense` dequantizes to `dtype` and runs torch ops; `compact` keeps the
    GGUF's codes and runs Outrider's CPU kernels (float32 on the CPU only; see `outrider.models.linear`),
    and falls back to `dense`, with a warning, where the kernels cannot be built; off the CPU it holds
    them for torch's int4/int8 weight-only kernels (`outrider.models.torch_quant`). `batch_invariant`
    (torch ops only; the kernels are batch invariant by construction): attention in float64, so a forward
    over k tokens stays within ~1e-4 of k single steps; not bit for bit, as torch's matmuls sum k rows in
    another order than one (see `layers.attention`)."""
    cls = ARCHITECTURES.get(g.architecture)
    if cls is None:
        hint = KNOWN_UNSUPPORTED.get(g.architecture, "")
        raise ModelFileError(f"{g.path}: unknown architecture '{g.architecture}'{hint}; "
                             f"supported: {', '.join(sorted(ARCHITECTURES))}")
    check_weights_mode(weights)
    native = weights == "compact" and torch.device(device).type == "cpu" and dtype == torch.float32
    if native:
        try:
            load_native()
        except NativeUnavailable as e:
            warnings.warn(f"{e}; using dense float32 weights (slower)", stacklevel=2)
            native = False
    attention_dtype = ATTENTION_DTYPE if batch_invariant else dtype
    # compact weights off the CPU: torch's int4/int8 weight-only kernels (outrider.models.torch_quant), for
    # the architectures that take a linear form; the others run dense there
    if weights == "compact" and torch.device(device).type != "cpu" and cls in QUANTIZED_ON_GPU:
        return cls(g, dtype=dtype, device=device, native=native, attention_dtype=attention_dtype,
                   linear_form="quantized")
    return cls(g, dtype=dtype, device=device, native=native, attention_dtype=attention_dtype)
