"""Gemma 4's assistant (`general.architecture = gemma4-assistant`) as llama.cpp reads it: a small Q-only
transformer that drafts from the target's state. It has no KV of its own: each layer's queries attend over
the target's cached keys and values (sliding layers over the target's last sliding layer, global layers
over its last global layer). Its input row is the target's scaled token embedding next to a hidden state of
the target's width (the target's final-normed hidden, then its own projected output when chaining), and its
output is logits plus the next such hidden state.

Follows llama.cpp's `src/models/gemma4-assistant.cpp` and `conversion/gemma.py` (`Gemma4AssistantModel`).
The E2B/E4B centroid-masked head (transformers'
`Gemma4AssistantMaskedEmbedder`) is computed when the file carries it, unless the dense head is asked for
(llama.cpp ignores those tensors and always computes the dense tied head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from outrider.errors import ModelFileError
from outrider.io.gguf import GGUFFile
from outrider.models.linear import rms_norm

ARCHITECTURE = "gemma4-assistant"
HEADS = ("auto", "dense", "centroids")
DEFAULT_CENTROID_TOP_K = 32  # transformers' centroid_intermediate_top_k default; GGUF files do not record it


@dataclass(frozen=True)
class Gemma4AssistantConfig:
    vocab_size: int
    hidden_size: int  # the assistant's own width
    backbone_hidden_size: int  # the target's hidden size (embedding_length_out)
    n_layers: int
    n_heads: tuple[int, ...]
    n_kv_heads: tuple[int, ...]  # per layer: must match the target layer it reads
    head_dim: int  # global layers
    head_dim_swa: int
    n_rot: int
    n_rot_swa: int
    rope_base: float
    rope_base_swa: float
    sliding_window: int
    is_swa: tuple[bool, ...]
    ffn_size: tuple[int, ...]
    eps: float
    context_length: int
    has_centroids: bool

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Gemma4AssistantConfig":
        if g.architecture != ARCHITECTURE:
            underscore = g.architecture == "gemma4_assistant"
            hint = " (write it with a hyphen: llama.cpp rejects the underscore name)" if underscore else ""
            raise ModelFileError(f"{g.path}: architecture '{g.architecture}' is not a Gemma 4 assistant "
                                 f"('{ARCHITECTURE}'){hint}; pass the assistant's GGUF as --draft-model")
        n_layers = int(g.require("block_count"))
        per_layer = lambda v: tuple(int(x) for x in v) if isinstance(v, list) else (int(v),) * n_layers
        hidden, backbone = int(g.require("embedding_length")), int(g.require("embedding_length_out"))
        if hidden == backbone:
            raise ModelFileError(f"{g.path}: embedding_length_out ({backbone}) must carry the target's hidden size and "
                                 "differ from embedding_length; re-convert with llama.cpp's convert_hf_to_gguf.py")
        nextn = int(g.arch_key("nextn_predict_layers", n_layers))
        if nextn != n_layers:
            raise ModelFileError(f"{g.path}: nextn_predict_layers ({nextn}) != block_count ({n_layers}); "
                                 "re-convert with llama.cpp's convert_hf_to_gguf.py")
        pattern = g.require("attention.sliding_window_pattern")
        if not isinstance(pattern, list) or len(pattern) != n_layers:
            raise ModelFileError(f"{g.path}: attention.sliding_window_pattern must list one bool per layer")
        head_dim = int(g.require("attention.key_length"))
        head_dim_swa = int(g.require("attention.key_length_swa"))
        if int(g.arch_key("attention.value_length", head_dim)) != head_dim or \
                int(g.arch_key("attention.value_length_swa", head_dim_swa)) != head_dim_swa:
            raise ModelFileError(f"{g.path}: key and value lengths differ; a Gemma 4 assistant needs them equal")
        is_swa = tuple(bool(p) for p in pattern)
        if not all(is_swa) and "rope_freqs.weight" not in g.tensors:
            raise ModelFileError(f"{g.path}: rope_freqs.weight is missing but a global layer needs it; "
                                 "re-convert with llama.cpp's convert_hf_to_gguf.py")
        heads = per_layer(g.require("attention.head_count"))
        return cls(
            vocab_size=g.tensors["token_embd.weight"].shape[0],
            hidden_size=hidden, backbone_hidden_size=backbone, n_layers=n_layers,
            n_heads=heads, n_kv_heads=per_layer(g.arch_key("attention.head_count_kv", list(heads))),
            head_dim=head_dim, head_dim_swa=head_dim_swa,
            n_rot=int(g.arch_key("rope.dimension_count", head_dim)),
            n_rot_swa=int(g.arch_key("rope.dimension_count_swa", head_dim_swa)),
            rope_base=float(g.arch_key("rope.freq_base", 1_000_000.0)),
            rope_base_swa=float(g.arch_key("rope.freq_base_swa", 10_000.0)),
            sliding_window=int(g.require("attention.sliding_window")),
            is_swa=is_swa, ffn_size=per_layer(g.require("feed_forward_length")),
            eps=float(g.require("attention.layer_norm_rms_epsilon")),
            context_length=int(g.require("context_length")),
            has_centroids="masked_embd_centroids.weight" in g.tensors and "masked_embd_ordering" in g.tensors,
        )


def rope_neox(x: torch.Tensor, pos: int, n_rot: int, base: float, factors: torch.Tensor | None) -> torch.Tensor:
    """x [T, heads, d] at position `pos`: pairs (i, i + n_rot/2) rotated, dims from n_rot on passed through."""
    half = n_rot // 2
    inv = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)
    if factors is not None:
        inv = inv / factors[:half].double()
    angle = pos * inv
    cos, sin = angle.cos().to(x.dtype).to(x.device), angle.sin().to(x.dtype).to(x.device)
    a, b, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


class _Layer:
    def __init__(self, g: GGUFFile, i: int, dtype: torch.dtype, device):
        p = f"blk.{i}."
        load = lambda name: g.load(p + name + ".weight").to(dtype).to(device)
        self.attn_norm, self.wq, self.q_norm = load("attn_norm"), load("attn_q"), load("attn_q_norm")
        self.wo, self.post_attn_norm = load("attn_output"), load("post_attention_norm")
        self.ffn_norm, self.post_ffn_norm = load("ffn_norm"), load("post_ffw_norm")
        self.w_gate, self.w_up, self.w_down = load("ffn_gate"), load("ffn_up"), load("ffn_down")
        self.out_scale = load("layer_output_scale")


class Gemma4Assistant:
    architecture = ARCHITECTURE

    def __init__(self, g: GGUFFile, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 head: str = "auto", centroid_top_k: int = DEFAULT_CENTROID_TOP_K):
        self.config = cfg = Gemma4AssistantConfig.from_gguf(g)
        self.dtype, self.device = dtype, torch.device(device)
        if head not in HEADS:
            raise ModelFileError(f"unknown assistant head '{head}'; choose one of: {', '.join(HEADS)}")
        if head == "centroids" and not cfg.has_centroids:
            raise ModelFileError(f"{g.path}: the centroid head was asked for but the file has no "
                                 "masked_embd_centroids / masked_embd_ordering; use head = dense (or auto)")
        self.centroids_on = cfg.has_centroids and head != "dense"
        load = lambda name: g.load(name).to(dtype).to(self.device)
        self.head_weight, self.output_norm = load("token_embd.weight"), load("output_norm.weight")
        self.pre_projection = load("nextn.pre_projection.weight")  # [hidden, 2 * backbone]
        self.post_projection = load("nextn.post_projection.weight")  # [backbone, hidden]
        self.rope_factors = g.load("rope_freqs.weight") if "rope_freqs.weight" in g.tensors else None
        self.layers = [_Layer(g, i, dtype, self.device) for i in range(cfg.n_layers)]
        self.embed_scale = math.sqrt(cfg.backbone_hidden_size)
        if self.centroids_on:
            self.centroids = load("masked_embd_centroids.weight")  # [n_centroids, hidden]
            ordering = g.load("masked_embd_ordering").round().long().to(self.device)
            n_centroids = self.centroids.shape[0]
            if cfg.vocab_size % n_centroids or ordering.numel() != cfg.vocab_size:
                raise ModelFileError(f"{g.path}: masked_embd_ordering ({ordering.numel()} ids) does not split the "
                                     f"{cfg.vocab_size}-token vocabulary into {n_centroids} centroids; "
                                     "use head = dense")
            self.tokens_per_centroid = ordering.view(n_centroids, cfg.vocab_size // n_centroids)
            self.centroid_top_k = min(int(centroid_top_k), n_centroids)

    def input_rows(self, target_embedding_rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The assistant's input [T, 2*backbone]: the target's raw embedding rows scaled by sqrt(backbone),
        then the hidden state (this order; llama.cpp's ggml_concat(x, h))."""
        x = target_embedding_rows.to(self.dtype) * self.embed_scale
        return torch.cat([x, hidden.to(self.dtype)], dim=-1)

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, pos: int, kv: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        """(logits [T, vocab] float32, next hidden [T, backbone]) for input rows `inputs` (`input_rows`), every
        row at position `pos`. `kv["swa"]` / `kv["full"]` are the target's keys and values [kv_heads, P, d] of
        positions 0..P-1 (P = pos: the row's token is not in the target's cache yet); sliding layers see the
        keys with pos - key_pos < sliding_window, as llama.cpp masks them."""
        cfg = self.config
        cur = F.linear(inputs.to(self.dtype), self.pre_projection)
        t = cur.shape[0]
        for i, layer in enumerate(self.layers):
            swa = cfg.is_swa[i]
            hd = cfg.head_dim_swa if swa else cfg.head_dim
            keys, values = kv["swa" if swa else "full"]
            if swa:
                first = max(0, pos - cfg.sliding_window + 1)
                keys, values = keys[:, first:pos], values[:, first:pos]
            else:
                keys, values = keys[:, :pos], values[:, :pos]
            q = F.linear(rms_norm(cur, layer.attn_norm, cfg.eps), layer.wq).view(t, cfg.n_heads[i], hd)
            q = rms_norm(q, layer.q_norm, cfg.eps)
            if swa:
                q = rope_neox(q, pos, cfg.n_rot_swa, cfg.rope_base_swa, None)
            else:
                q = rope_neox(q, pos, cfg.n_rot, cfg.rope_base, self.rope_factors)
            keys, values = keys.to(self.dtype), values.to(self.dtype)
            o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                               scale=1.0, enable_gqa=q.shape[1] != keys.shape[0])
            o = F.linear(o[0].transpose(0, 1).reshape(t, -1), layer.wo)
            attn_out = rms_norm(o, layer.post_attn_norm, cfg.eps) + cur
            f = rms_norm(attn_out, layer.ffn_norm, cfg.eps)
            f = F.linear(F.gelu(F.linear(f, layer.w_gate), approximate="tanh") * F.linear(f, layer.w_up), layer.w_down)
            cur = (rms_norm(f, layer.post_ffn_norm, cfg.eps) + attn_out) * layer.out_scale
        hn = rms_norm(cur, self.output_norm, cfg.eps)
        logits = self._centroid_logits(hn) if self.centroids_on else F.linear(hn, self.head_weight)
        return logits.float(), F.linear(hn, self.post_projection)

    def _centroid_logits(self, hn: torch.Tensor) -> torch.Tensor:
        """transformers' masked embedder: only the tokens of the top-k centroids get their dot product; every
        other token gets (the smallest of those, per row) - 1."""
        top = F.linear(hn, self.centroids).topk(self.centroid_top_k, dim=-1).indices  # [T, k]
        ids = self.tokens_per_centroid[top].reshape(hn.shape[0], -1)  # [T, k * tokens_per_centroid]
        chosen = torch.einsum("td,tnd->tn", hn, self.head_weight[ids])
        out = (chosen.min(dim=-1, keepdim=True).values - 1.0).expand(-1, self.config.vocab_size).clone()
        return out.scatter_(-1, ids, chosen)
