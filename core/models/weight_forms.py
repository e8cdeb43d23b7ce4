"""Which form a linear layer's weights are held in: packed codes for the native kernels, torch's int4/int8
weight-only forms (the GPU's compact weights), or dense floats. The one place that knows all three."""

from __future__ import annotations

from typing import Sequence

import torch

from outrider.io.gguf import GGUFFile
from outrider.models.linear import GROUP, DenseLinear, RowMap, load_packed
from outrider.models.torch_quant import load_quantized_linear


def load_linear(g: GGUFFile, names: Sequence[str], packed: bool | str, dtype: torch.dtype,
                device: torch.device | str, row_maps: dict[str, RowMap] | None = None, lanes: bool = True):
    """One linear layer from the GGUF tensors `names`, their rows stacked in order (fused projections):
    a `PackedLinear` when `packed` is True or "native" (and the shape allows), torch's int4/int8
    weight-only forms when it is "quantized" (`outrider.models.torch_quant`, the GPU's compact weights),
    else a `DenseLinear` in `dtype`. `row_maps` reorders a tensor's rows (llama's q/k un-permutation) in
    whatever form it is held. `lanes=False`: a table only read by rows, whose packed form needs no lane tiles."""
    remap = lambda name: (row_maps or {}).get(name, lambda rows: rows)
    if packed == "quantized":
        return load_quantized_linear(g, names, dtype, device, remap)
    if packed in (True, "native") and g.tensors[names[0]].shape[1] % GROUP == 0:
        return load_packed(g, names, remap, lanes)
    weight = torch.cat([remap(name)(g.load(name)) for name in names])
    return DenseLinear(weight.to(dtype).to(device))
