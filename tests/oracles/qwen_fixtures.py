"""Tiny random Qwen2 and Qwen3 checkpoints, made by transformers and converted by llama.cpp's own converter.

`qwen2` has q/k/v biases and a separate output head; `qwen3` has per-head q/k norms, a head_dim that is not
hidden / heads, and a tied head. Each comes with a tiny byte-level BPE vocabulary (trained here by the
`tokenizers` library over a few lines of text, Qwen2's split regex in front) with Qwen's special tokens and
ChatML template, so the converter writes `tokenizer.ggml.model = gpt2` and the template as for real files;
the pre-tokenizer name (`qwen2`) is given to the converter, which cannot detect it from a tiny vocabulary.
Test-only: needs transformers and torch, and `oracles.llama_cpp` for the converter.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from oracles.gemma4_fixtures import build_once

VARIANTS = ("qwen2", "qwen3")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
                  "<|fim_suffix|>"]
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # Qwen2's tokenizer.json, as published with the models
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
CORPUS = [
    "def quicksort(values):\n    if len(values) <= 1:\n        return values\n",
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock, isn't it?",
    "for i in range(10):\n\tprint(i, 'hello world')\r\n",
    "Der schnelle braune Fuchs. Le renard brun rapide. 日本語のテキスト。 Привет, мир!",
    "    indented   spaces\n\n\n  and    more   whitespace   ",
]

_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
               bos_token_id=0, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "qwen2": dict(tie_word_embeddings=False),
    "qwen3": dict(tie_word_embeddings=True, head_dim=32, attention_bias=False),
}


def write_tokenizer(folder: Path) -> int:
    """The tiny tokenizer in `folder`; returns its vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, additional_special_tokens=SPECIAL_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return len(tok)


def write_checkpoint(folder: str | Path, variant: str, seed: int = 0, n_layers: int | None = None) -> Path:
    """A transformers Qwen2/Qwen3ForCausalLM with random weights (norms perturbed away from one and biases away
    from zero, so a skipped norm or bias shows) and the tiny tokenizer, saved in `folder`. With `n_layers`, the
    same model cut to its first layers: a draft model that shares the full one's embedding, head and first layers,
    so its q is near the full model's p without equalling it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder)
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[variant]
    special = dict(bos_token_id=vocab - len(SPECIAL_TOKENS), eos_token_id=vocab - len(SPECIAL_TOKENS) + 2,
                   pad_token_id=vocab - len(SPECIAL_TOKENS))
    config = config_cls(vocab_size=vocab, **{**_COMMON, **special}, **CONFIGS[variant])
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15 if "embed" in name else 0.08)
    if n_layers is not None:
        model.model.layers = model.model.layers[:n_layers]
        model.config.num_hidden_layers = n_layers
        model.config.layer_types = model.config.layer_types[:n_layers]
    model.save_pretrained(folder)
    return folder


def write_gguf(folder: str | Path, variant: str, outtype: str = "f32", n_layers: int | None = None) -> Path:
    """The checkpoint for `variant` and its GGUF (`<variant>-<outtype>.gguf`) written by llama.cpp's converter."""
    from oracles.llama_cpp import convert_hf_to_gguf

    folder = Path(folder)
    hf_dir = write_checkpoint(folder / f"hf-{variant}", variant, n_layers=n_layers)
    return convert_hf_to_gguf(hf_dir, folder / f"{variant}-{outtype}.gguf", outtype=outtype, pre="qwen2")


def cached_fixture(variant: str, outtype: str = "f32", n_layers: int | None = None) -> tuple[Path, Path]:
    """(transformers checkpoint folder, converted GGUF) for `variant`, built once per machine under
    `$OUTRIDER_HOME/fixtures/`, keyed by this file, the converter's, transformers' and torch's versions; with
    `n_layers`, the draft model cut from it (write_checkpoint)."""
    import tokenizers
    import torch
    import transformers

    from oracles.llama_cpp import LLAMA_CPP_PYTHON
    from outrider.paths import outrider_home

    digest = hashlib.sha256(Path(__file__).read_bytes())
    for part in (LLAMA_CPP_PYTHON, transformers.__version__, torch.__version__, tokenizers.__version__, variant,
                 outtype, str(n_layers)):
        digest.update(part.encode())
    cut = "" if n_layers is None else f"-{n_layers}layers"
    folder = outrider_home() / "fixtures" / f"{variant}{cut}-{outtype}-{digest.hexdigest()[:12]}"
    hf_dir, gguf_path = folder / f"hf-{variant}", folder / f"{variant}-{outtype}.gguf"
    build_once(folder, gguf_path, lambda staging: write_gguf(staging, variant, outtype, n_layers))
    return hf_dir, gguf_path
