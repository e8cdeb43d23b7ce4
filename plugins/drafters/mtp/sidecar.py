"""A trained head as llama.cpp's nextn layout: written to a file (an MTP-only GGUF, which `--drafter mtp` reads
as it reads any sidecar; `outrider distill` writes it once, `drafter.learn` on exit) or held in memory
(`drafter.learn` swapping in the head it trains while it drafts). Both come from one tensor list, so the head
drafting in memory is the head the file holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from outrider.errors import ConfigError, ModelFileError
from outrider.io.gguf import TensorsInMemory
from outrider.models.llama import permute_qk
from outrider.plugins.drafters.mtp.head import NEXTN_NAMES, QKV_BIAS, TrainableHead

Q8_BLOCK = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][0]  # weights a block
# a head's matrices, as `outrider distill --matrices` names them: Q4_0 (the default: a draft reads about half the
# bytes of Q8_0 and, in docs/bench/mtp.md, was accepted as often), Q8_0, F16 (exact to the trained head's float16)
MATRICES = ("Q4_0", "Q8_0", "F16")
DEFAULT_MATRICES = MATRICES[0]
QUANTIZED = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)  # written as their raw blocks


def quantize_q8_0(t: torch.Tensor, chunk_rows: int = 256) -> np.ndarray:
    """ggml's Q8_0 blocks of a matrix [N, K] (K a multiple of 32) as raw bytes [N, K / 32 * 34]: per 32 weights a
    float16 scale d = max|w| / 127, then round(w / d) as int8, rounded half away from zero; gguf-py's quantizer,
    bit for bit, in torch and a few hundred rows at a time (in place, where whole-matrix temporaries cost more in
    page faults than in arithmetic): a rebuild of the learning head quantizes every matrix of it."""
    t = t.detach().float().cpu()
    n, k = t.shape
    out = torch.empty(n, k // Q8_BLOCK, 2 + Q8_BLOCK, dtype=torch.uint8)
    for i in range(0, n, chunk_rows):
        blocks = t[i:i + chunk_rows].reshape(-1, k // Q8_BLOCK, Q8_BLOCK)
        lo, hi = torch.aminmax(blocks, dim=-1, keepdim=True)
        d = torch.maximum(hi, -lo).abs_() / 127  # abs_: of a block of zeros, max(0, -0) may be -0
        x = blocks * torch.where(d == 0, torch.zeros_like(d), 1 / d)
        a = x.abs()
        whole = a.floor()
        whole.add_(a.sub_(whole).mul_(2).floor_()).copysign_(x)  # ggml's roundf, without a + 0.5's own rounding
        out[i:i + chunk_rows, :, :2] = d.half().view(torch.uint8)
        out[i:i + chunk_rows, :, 2:] = whole.to(torch.int8).view(torch.uint8)
    return out.reshape(n, -1).numpy()


def sidecar_metadata(head: TrainableHead, g) -> dict[str, Any]:
    """The target's architecture keys, as one MTP block past its trunk would have them."""
    arch = head.arch
    out: dict[str, Any] = {}
    for key, value in g.metadata.items():
        if not key.startswith(arch + ".") or key in (f"{arch}.block_count", f"{arch}.nextn_predict_layers"):
            continue
        if isinstance(value, (bool, int, float, str)):
            out[key] = value
        elif isinstance(value, list) and key.endswith("sliding_window_pattern"):
            out[key] = list(value) + [head.layer.window is not None]
    out[f"{arch}.block_count"] = head.cfg.n_layers + 1
    out[f"{arch}.nextn_predict_layers"] = 1
    return out


def sidecar_tensors(head: TrainableHead, vocab_ids: torch.Tensor, matrices: str = DEFAULT_MATRICES
                    ) -> dict[str, tuple[np.ndarray, GGMLQuantizationType, tuple[int, ...]]]:
    """{name: (stored bytes or values, type, shape)} of block `n_trunk`, its matrices in `matrices` (`MATRICES`;
    the CPU kernels hold F16 as float32, so a draft from it reads about seven times Q4_0's bytes). Q4_0's blocks
    are gguf-py's (its quantizer is quick enough for the few matrices of a head); Q8_0's are ours, bit for bit the
    same, since a rebuild of the learning head makes them often."""
    if matrices not in MATRICES:
        raise ConfigError(f"matrices {matrices!r}: a head's matrices are written as one of {', '.join(MATRICES)}")
    cfg, b = head.cfg, head.cfg.n_layers
    p = f"blk.{b}."
    out = {}
    kind = GGMLQuantizationType[matrices]

    def add(name: str, t: torch.Tensor) -> None:
        if t.dim() == 2 and kind in QUANTIZED and t.shape[1] % GGML_QUANT_SIZES[kind][0] == 0:
            blocks = quantize_q8_0(t) if kind == GGMLQuantizationType.Q8_0 else quantize(t.numpy(), kind)
            out[name] = (blocks, kind, tuple(t.shape))
        elif t.dim() == 2:
            out[name] = (t.numpy().astype(np.float16), GGMLQuantizationType.F16, tuple(t.shape))
        else:
            out[name] = (t.numpy().astype(np.float32), GGMLQuantizationType.F32, tuple(t.shape))

    for name, param in head.w.items():
        t = param.detach().float().cpu()
        if name == QKV_BIAS:  # the trunk's layout: a bias per projection
            q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
            for part, bias in zip("qkv", t.split([q, kv, kv])):
                add(f"{p}attn_{part}.bias", bias)
            continue
        if head.arch == "llama" and name in ("attn_q", "attn_k"):
            t = permute_qk(cfg.n_heads if name == "attn_q" else cfg.n_kv_heads)(t)
        add(p + ("nextn." if name in NEXTN_NAMES else "") + name + ".weight", t)
    ids = vocab_ids.numpy().astype(np.int32)
    out[p + "nextn.draft_vocab"] = (ids, GGMLQuantizationType.I32, ids.shape)
    return out


def write_sidecar(path: Path, head: TrainableHead, g, vocab_ids: torch.Tensor, matrices: str = DEFAULT_MATRICES) -> int:
    """The trained head as an MTP-only GGUF in llama.cpp's nextn layout (block `n_trunk`); its size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    w = GGUFWriter(str(tmp), head.arch)
    for key, value in sidecar_metadata(head, g).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value) if value >= 0 else w.add_int32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, (array, kind, _) in sidecar_tensors(head, vocab_ids, matrices).items():
        w.add_tensor(name, array, raw_dtype=kind if kind in QUANTIZED else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path.stat().st_size


def head_in_memory(head: TrainableHead, g, vocab_ids: torch.Tensor, name: str, matrices: str = DEFAULT_MATRICES
                   ) -> TensorsInMemory:
    """What `write_sidecar` would write, read back without the file (`name` stands for its path in messages)."""
    metadata = {"general.architecture": head.arch, **sidecar_metadata(head, g)}  # the writer's own first key
    return TensorsInMemory(name, metadata, sidecar_tensors(head, vocab_ids, matrices))


def matrices_of(sidecar, block: int) -> str:
    """The type a sidecar holds its head's matrices in (that of block `block`'s FFN up projection), by name:
    one of `MATRICES` for a head distill wrote, any GGUF type for another."""
    name = f"blk.{block}.ffn_up.weight"
    if name not in sidecar.tensors:
        raise ModelFileError(f"{sidecar.path}: no {name}; pass the MTP sidecar of this target")
    return sidecar.tensors[name].type.name
