"""Qwen2 / Qwen2.5 and Qwen3 (dense) as llama.cpp reads them from GGUF: llama's block, with NEOX rotary as
the converter writes it (no q/k row permutation). Qwen2 adds biases to the q, k and v projections; Qwen3
drops them and RMS-normalizes each head of q and k before rotary."""

from __future__ import annotations

import torch

from outrider.errors import ModelFileError
from outrider.io.gguf import GGUFFile
from outrider.models.llama import Llama
from outrider.models.stack import LayerWeights
from outrider.models.weight_forms import load_linear


class _Layer:
    def __init__(self, g: GGUFFile, i: int, packed: bool | str, dtype: torch.dtype, device):
        p = f"blk.{i}."
        linear = lambda *names: load_linear(g, [p + n + ".weight" for n in names], packed, dtype, device)
        vector = lambda name: g.load(p + name).to(dtype).to(device) if p + name in g.tensors else None
        self.wqkv = linear("attn_q", "attn_k", "attn_v")
        self.wo = linear("attn_output")
        self.w_gate_up = linear("ffn_gate", "ffn_up")
        self.w_down = linear("ffn_down")
        self.attn_norm, self.ffn_norm = vector("attn_norm.weight"), vector("ffn_norm.weight")
        self.q_norm, self.k_norm = vector("attn_q_norm.weight"), vector("attn_k_norm.weight")
        biases = [vector(f"attn_{n}.bias") for n in "qkv"]
        if any(b is not None for b in biases) and any(b is None for b in biases):
            raise ModelFileError(f"{g.path}: blk.{i} has a bias on some of q, k, v but not all; "
                                 "this file is not a Qwen2 checkpoint as llama.cpp writes one")
        self.qkv_bias = torch.cat(biases) if biases[0] is not None else None

    def tensors(self) -> list[torch.Tensor]:
        out = self.wqkv.tensors() + self.wo.tensors() + self.w_gate_up.tensors() + self.w_down.tensors()
        return out + [t for t in (self.attn_norm, self.ffn_norm, self.q_norm, self.k_norm, self.qkv_bias)
                      if t is not None]


class Qwen2(Llama):
    architecture = "qwen2"

    def _refuse_variants(self, g: GGUFFile) -> None:
        if any("_exps" in name for name in g.tensors):
            raise ModelFileError(f"{g.path}: {self.architecture} with experts is not supported (a MoE file should "
                                 f"say {self.architecture}moe); use a dense {self.architecture} model")
        self._check_layer_form(g)

    def _check_layer_form(self, g: GGUFFile) -> None:
        if "blk.0.attn_q.bias" not in g.tensors:
            raise ModelFileError(f"{g.path}: a qwen2 file without q/k/v biases; if it is a Qwen3 model, its "
                                 "general.architecture should say qwen3")

    def _layer(self, g: GGUFFile, i: int, form: bool | str) -> _Layer:
        return _Layer(g, i, form, self.dtype, self.device)

    def _weights(self, l: _Layer) -> LayerWeights:
        return LayerWeights(l.wqkv, l.wo, l.w_gate_up, l.w_down, l.attn_norm, l.ffn_norm, self.rotary,
                            q_norm=l.q_norm, k_norm=l.k_norm, qkv_bias=l.qkv_bias)


class Qwen3(Qwen2):
    architecture = "qwen3"

    def _check_layer_form(self, g: GGUFFile) -> None:
        if "blk.0.attn_q_norm.weight" not in g.tensors or "blk.0.attn_q.bias" in g.tensors:
            raise ModelFileError(f"{g.path}: a qwen3 file needs per-head q/k norms and no q/k/v biases "
                                 "(that is qwen2's form); check general.architecture")
