"""The file a trained head is written to: an MTP-only GGUF in llama.cpp's nextn layout, which `--drafter mtp`
reads as it reads any sidecar (`outrider distill` writes it once, `drafter.learn` again as it learns)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from outrider.models.llama import permute_qk
from outrider.plugins.drafters.mtp.head import NEXTN_NAMES, QKV_BIAS, TrainableHead


def write_sidecar(path: Path, head: TrainableHead, g, vocab_ids: torch.Tensor, matrices: str = "Q8_0") -> int:
    """The trained head as an MTP-only GGUF in llama.cpp's nextn layout (block `n_trunk`); its size in bytes.
    `matrices`: Q8_0 (the default: the drafter reads a byte per weight, where F16 is held as float32 by the CPU
    kernels and a draft would cost four times the bytes) or F16 (exact to the trained head's float16)."""
    import gguf

    def matrix(t: torch.Tensor) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
        if matrices == "Q8_0" and t.shape[1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            return gguf.quants.quantize(t.numpy(), q8), q8
        return t.numpy().astype(np.float16), None

    arch, cfg = head.arch, head.cfg
    b = cfg.n_layers
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    for key, value in g.metadata.items():
        if not key.startswith(arch + ".") or key in (f"{arch}.block_count", f"{arch}.nextn_predict_layers"):
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value) if value >= 0 else w.add_int32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list) and key.endswith("sliding_window_pattern"):
            w.add_array(key, list(value) + [head.layer.window is not None])
    w.add_block_count(b + 1)
    w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    p = f"blk.{b}."
    for name, param in head.w.items():
        t = param.detach().float().cpu()
        if name == QKV_BIAS:  # the trunk's layout: a bias per projection
            q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
            for part, bias in zip("qkv", t.split([q, kv, kv])):
                w.add_tensor(f"{p}attn_{part}.bias", bias.numpy().astype(np.float32))
            continue
        if arch == "llama" and name in ("attn_q", "attn_k"):
            t = permute_qk(cfg.n_heads if name == "attn_q" else cfg.n_kv_heads)(t)
        nextn = name in NEXTN_NAMES
        array, kind = matrix(t) if t.dim() == 2 else (t.numpy().astype(np.float32), None)
        w.add_tensor(p + ("nextn." if nextn else "") + name + ".weight", array, raw_dtype=kind)
    w.add_tensor(p + "nextn.draft_vocab", vocab_ids.numpy().astype(np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path.stat().st_size
