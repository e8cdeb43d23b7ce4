"""Tiny random Gemma 4 checkpoints, made by transformers and converted by llama.cpp's own converter.

One checkpoint per text variant Gemma 4 ships: `dense` (31B-style: sliding and global layers with their own
head dims, proportional RoPE and `attention_k_eq_v` on the global ones), `e2b` (E2B/E4B-style: per-layer input
embeddings, KV-sharing layers, the double-wide MLP on them) and `moe` (26B-A4B-style: a routed expert block beside
the dense MLP). Each comes with a tiny Gemma-style BPE tokenizer (byte fallback, "▁" for spaces) and a Gemma-4-style
chat template, so the converter writes `tokenizer.ggml.model = gemma4` and the template as for the real files.

The vocabulary and chat template are `outrider.testing.gemma4_vocabulary`'s (shared with the tiny gemma4 the
contract suite writes without transformers). Test-only: needs transformers and torch, and `oracles.llama_cpp`
for the converter.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from outrider.testing import gemma4_vocabulary
from outrider.testing.gemma4_vocabulary import CHAT_TEMPLATE, vocabulary

VARIANTS = ("dense", "e2b", "moe")

_COMMON = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, global_head_dim=32, sliding_window=8, max_position_embeddings=512, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0, tie_word_embeddings=True,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1_000_000.0}},
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
)

CONFIGS = {
    # 31B-style: global layers with wider heads, fewer kv heads, K reused as V
    "dense": dict(layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                  attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
                  num_kv_shared_layers=0),
    # E2B-style: per-layer inputs; the last two layers read the kv of the last sliding / global layer before them
    # (per-layer input size 32, not 16: the compact path packs only matrices whose rows are whole 32-groups)
    "e2b": dict(layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention",
                             "sliding_attention", "full_attention"],
                attention_k_eq_v=False, hidden_size_per_layer_input=32, num_kv_shared_layers=2,
                use_double_wide_mlp=True),
    # 26B-A4B-style: a routed expert block beside the dense MLP in every layer
    "moe": dict(layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
                num_kv_shared_layers=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                moe_intermediate_size=32),
}


def write_tokenizer(folder: Path) -> None:
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    tokens, merges = vocabulary()
    tok = GemmaTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=list(merges),
                         additional_special_tokens=["<|turn>", "<turn|>", "<|channel>", "<channel|>"])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)


def write_checkpoint(folder: str | Path, variant: str, seed: int = 0) -> Path:
    """A transformers Gemma4ForCausalLM with random weights (norms and scalars perturbed away from their
    defaults, so that a wrong offset or a skipped scale shows) and the tiny tokenizer, saved in `folder`."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokens, _ = vocabulary()
    config = Gemma4TextConfig(vocab_size=len(tokens), vocab_size_per_layer_input=len(tokens),
                              **_COMMON, **CONFIGS[variant])
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("scale", "per_expert_scale")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15 if "embed" in name else 0.08)
        for layer in model.model.layers:
            layer.layer_scalar.fill_(float(0.7 + 0.6 * torch.rand(())))
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def write_gguf(folder: str | Path, variant: str, outtype: str = "f32") -> Path:
    """The checkpoint for `variant` and its GGUF (`gemma4-<variant>.gguf`) written by llama.cpp's converter."""
    from oracles.llama_cpp import convert_hf_to_gguf

    folder = Path(folder)
    hf_dir = write_checkpoint(folder / f"hf-{variant}", variant)
    return convert_hf_to_gguf(hf_dir, folder / f"gemma4-{variant}-{outtype}.gguf", outtype=outtype)


def cached_fixture(variant: str, outtype: str = "f32") -> tuple[Path, Path]:
    """(transformers checkpoint folder, converted GGUF) for `variant`, built once per machine under
    `$OUTRIDER_HOME/fixtures/` (the converter takes tens of seconds) and keyed by everything they depend on:
    this file and the vocabulary's, the converter's version, transformers' and torch's versions."""
    import torch
    import transformers

    from oracles.llama_cpp import LLAMA_CPP_PYTHON
    from outrider.paths import outrider_home

    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(Path(gemma4_vocabulary.__file__).read_bytes())
    for part in (LLAMA_CPP_PYTHON, transformers.__version__, torch.__version__, variant, outtype):
        digest.update(part.encode())
    folder = outrider_home() / "fixtures" / f"gemma4-{variant}-{outtype}-{digest.hexdigest()[:12]}"
    hf_dir, gguf_path = folder / f"hf-{variant}", folder / f"gemma4-{variant}-{outtype}.gguf"
    build_once(folder, gguf_path, lambda staging: write_gguf(staging, variant, outtype))
    return hf_dir, gguf_path


def build_once(folder: Path, made: Path, build) -> None:
    """A fixture folder built once per machine: `build(staging)` writes a fresh folder beside `folder`, which
    then takes its name whole (if another process finished first, its folder stands). Nothing if `made` is
    there already."""
    import shutil
    import tempfile

    if made.is_file():
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        build(staging)
        try:
            staging.rename(folder)  # whole or not at all
        except OSError:  # another process finished first
            if not made.is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
