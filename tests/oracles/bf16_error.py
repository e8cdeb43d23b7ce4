"""How far an honest bfloat16 implementation of each contract fixture is from the truth: transformers' own
model of the fixture's architecture, in float64 and in bfloat16, on the inputs the backend checks use.

The fixtures are GGUF files written by `outrider.testing.tiny_models`; transformers' GGUF loader does not
read all of them as llama.cpp does (it refuses Gemma 4's per-layer feed-forward lengths and Qwen 3's head
dim, and its gemma3 is logits apart from llama.cpp's reading), so the model is built here from the file: the
configuration from its metadata, the weights dequantized by `gguf` itself and renamed as llama.cpp's converter
names them, with the converter's two value transforms undone (llama's Q/K row permutation, Gemma 3's
norms stored as `1 + w`). Test-only: needs transformers and gguf.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# The backend checks' inputs (core/testing/checks.py `matches_the_cpu_reference`: 12 ids of seed 4) and the
# GPU parity test's (tests/test_cuda_backend.py: blocks of 12, 1, 3, 16 ids of seeds 0-3, one sequence).
CONTRACT_IDS = (12, 4)
PARITY_BLOCKS = ((12, 0), (1, 1), (3, 2), (16, 3))


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def oracle_inputs(vocab: int) -> list[torch.Tensor]:
    """The id sequences the recorded bfloat16 errors are measured on."""
    return [_ids(CONTRACT_IDS[0], vocab, CONTRACT_IDS[1]),
            torch.cat([_ids(n, vocab, seed) for n, seed in PARITY_BLOCKS])]


def _gguf_tensors(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {f.name: f.contents() for f in reader.fields.values()}
    tensors = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists the fastest dimension first
        tensors[t.name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64)).reshape(shape)
    return meta, tensors


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of convert_hf_to_gguf's LlamaModel.permute (rows of each head: halves to pairs)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


_LAYER_NAMES = {  # GGUF name in a block -> transformers' name in `model.layers.{i}.`
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "post_norm": "post_per_layer_input_norm",
    "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
              "per_layer_token_embd": "model.embed_tokens_per_layer",
              "per_layer_model_proj": "model.per_layer_model_projection",
              "per_layer_proj_norm": "model.per_layer_projection_norm"}


def _state_dict(tensors: dict[str, torch.Tensor], layer_names: dict[str, str]) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in tensors.items():
        stem, leaf = name.rsplit(".", 1)
        if name == "rope_freqs.weight":
            continue  # carried by the configuration's partial rotary factor
        if stem.startswith("blk."):
            _, i, part = stem.split(".", 2)
            if part == "layer_output_scale":  # a bare parameter in transformers
                out[f"model.layers.{i}.layer_scalar"] = value
            else:
                out[f"model.layers.{i}.{layer_names[part]}.{leaf}"] = value
        else:
            out[f"{_TOP_NAMES[stem]}.{leaf}"] = value
    return out


def transformers_model(path: str | Path, dtype: torch.dtype = torch.float64):
    """transformers' model of the fixture GGUF at `path`, its weights in `dtype`, in eval mode."""
    import transformers

    meta, tensors = _gguf_tensors(Path(path))
    arch = meta["general.architecture"]
    key = lambda k, default=None: meta.get(f"{arch}.{k}", default)
    vocab, tied = tensors["token_embd.weight"].shape[0], "output.weight" not in tensors
    common = dict(vocab_size=vocab, hidden_size=key("embedding_length"), num_hidden_layers=key("block_count"),
                  num_attention_heads=key("attention.head_count"), rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
                  max_position_embeddings=key("context_length"), tie_word_embeddings=tied)
    heads = key("attention.head_count")
    if arch in ("llama", "qwen2", "qwen3"):
        kv_heads, head_dim = key("attention.head_count_kv"), key("attention.key_length")
        config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                        "qwen3": transformers.Qwen3Config}[arch]
        config = config_class(**common, intermediate_size=key("feed_forward_length"), num_key_value_heads=kv_heads,
                              head_dim=head_dim, rope_parameters={"rope_type": "default",
                                                                  "rope_theta": key("rope.freq_base")})
        if arch == "llama":
            for i in range(key("block_count")):
                for name, n in (("attn_q", heads), ("attn_k", kv_heads)):
                    w = f"blk.{i}.{name}.weight"
                    tensors[w] = _unpermute(tensors[w], n)
        model_class = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                       "qwen3": transformers.Qwen3ForCausalLM}[arch]
        layer_names = _LAYER_NAMES
    elif arch == "gemma3":
        n_layers, head_dim = key("block_count"), key("attention.key_length")
        # tiny_models writes no pattern: llama.cpp's default, five sliding layers then a global one
        config = transformers.Gemma3TextConfig(
            **common, intermediate_size=key("feed_forward_length"), num_key_value_heads=key("attention.head_count_kv"),
            head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=key("attention.sliding_window"),
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": key("rope.freq_base")}},
            final_logit_softcapping=key("final_logit_softcapping") or None, attn_logit_softcapping=None,
            hidden_activation="gelu_pytorch_tanh")
        for name in tensors:
            if name.endswith("norm.weight"):  # the converter stores Gemma 3's norms as 1 + w
                tensors[name] = tensors[name] - 1
        model_class, layer_names = transformers.Gemma3ForCausalLM, _GEMMA_LAYER_NAMES
    elif arch == "gemma4":
        local = [bool(x) for x in key("attention.sliding_window_pattern")]
        kv_heads = [int(x) for x in key("attention.head_count_kv")]
        ffn = [int(x) for x in key("feed_forward_length")]
        n_layers, hd_full = key("block_count"), key("attention.key_length")
        shared = key("attention.shared_kv_layers")
        n_rot = int((tensors["rope_freqs.weight"] < 1e29).sum())  # rotated pairs of a global head
        config = transformers.Gemma4TextConfig(
            **common, intermediate_size=ffn[0], use_double_wide_mlp=ffn[-1] == 2 * ffn[0],
            num_key_value_heads=max(k for k, is_local in zip(kv_heads, local) if is_local),
            num_global_key_value_heads=max(k for k, is_local in zip(kv_heads, local) if not is_local),
            attention_k_eq_v=not any(f"blk.{i}.attn_v.weight" in tensors for i, l in enumerate(local) if not l),
            head_dim=key("attention.key_length_swa"), global_head_dim=hd_full,
            sliding_window=key("attention.sliding_window"), num_kv_shared_layers=shared,
            layer_types=["sliding_attention" if is_local else "full_attention" for is_local in local],
            hidden_size_per_layer_input=key("embedding_length_per_layer_input"), vocab_size_per_layer_input=vocab,
            final_logit_softcapping=key("final_logit_softcapping") or None, hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": key("rope.freq_base_swa")},
                             "full_attention": {"rope_type": "proportional", "rope_theta": key("rope.freq_base"),
                                                "partial_rotary_factor": 2 * n_rot / hd_full}},
            pad_token_id=0, eos_token_id=1, bos_token_id=2)
        model_class, layer_names = transformers.Gemma4ForCausalLM, _GEMMA_LAYER_NAMES
    else:
        raise ValueError(f"no transformers oracle for architecture {arch!r}")
    model = model_class(config).to(torch.float64).eval()
    state = _state_dict(tensors, layer_names)
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m and not m.endswith("inv_freq")]
    if missing or unexpected:
        raise AssertionError(f"{path}: transformers' {model_class.__name__} lacks {unexpected} and was not given {missing}")
    return model.to(dtype)


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[None]).logits[0].double()


def bf16_error(path: str | Path) -> float:
    """max |logits in bfloat16 - logits in float64| of transformers' model of the fixture, over `oracle_inputs`."""
    truth, bf16 = transformers_model(path, torch.float64), transformers_model(path, torch.bfloat16)
    vocab = truth.config.vocab_size
    return max(float((logits(bf16, ids) - logits(truth, ids)).abs().max()) for ids in oracle_inputs(vocab))
