"""Tiny random-weight GGUF models, written on the fly for tests (llama with a byte-level BPE vocab,
gemma3 with a SentencePiece-style vocab, gemma4 with its BPE vocab, and a Gemma 4 assistant matched to a gemma4
target), with gguf's writer alone: no transformers, no converter. Small enough that a forward pass takes well
under a millisecond of compute, yet they exercise every code path of the real architectures: GQA, q/k norms,
the sliding window, tied and untied output heads, quantized tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np

DRAFT_VOCAB = 40  # rows of a reduced tiny MTP head

# GPT-2's printable stand-ins for the 256 byte values, so a byte-level vocab can spell every byte.
def _bytes_to_unicode() -> list[str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _matrix(rng: np.random.Generator, rows: int, cols: int, scale: float = 0.08) -> np.ndarray:
    return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _add(writer, name: str, array: np.ndarray, quantize: bool) -> None:
    import gguf

    if quantize and array.ndim == 2 and array.shape[1] % 32 == 0:
        q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        writer.add_tensor(name, array)


def write_tiny_llama(path: str | Path, seed: int = 0, n_layers: int = 2, hidden: int = 64, heads: int = 4,
                     kv_heads: int = 2, ffn: int = 128, context: int = 256, quantize: bool = True,
                     tied: bool = False, arch: str = "llama", head_dim: int | None = None) -> Path:
    """A llama GGUF with a byte-level vocabulary: 256 byte tokens, a few merges, <s> </s> <|im_end|>. With
    `arch="qwen2"` the same block gains q/k/v biases, with `arch="qwen3"` per-head q/k norms (and `head_dim` may
    differ from hidden / heads), as llama.cpp's converter writes those architectures."""
    import gguf

    rng = np.random.default_rng(seed)
    byte_tokens = _bytes_to_unicode()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens = ["<unk>", "<s>", "</s>", "<|im_end|>"] + byte_tokens + [m.replace(" ", "") for m in merges]
    types = [3, 3, 3, 3] + [1] * (len(tokens) - 4)
    vocab = len(tokens)
    head_dim = head_dim or hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    _add(w, "token_embd.weight", _matrix(rng, vocab, hidden, 0.5), quantize)
    if not tied:
        _add(w, "output.weight", _matrix(rng, vocab, hidden, 0.3), quantize)
    w.add_tensor("output_norm.weight", _norm(rng, hidden))
    for i in range(n_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", _norm(rng, hidden))
        w.add_tensor(p + "ffn_norm.weight", _norm(rng, hidden))
        _add(w, p + "attn_q.weight", _matrix(rng, heads * head_dim, hidden), quantize)
        _add(w, p + "attn_k.weight", _matrix(rng, kv_heads * head_dim, hidden), quantize)
        _add(w, p + "attn_v.weight", _matrix(rng, kv_heads * head_dim, hidden), quantize)
        _add(w, p + "attn_output.weight", _matrix(rng, hidden, heads * head_dim), quantize)
        if arch == "qwen2":
            for name, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim), ("attn_v", kv_heads * head_dim)):
                w.add_tensor(p + name + ".bias", (0.1 * rng.standard_normal(rows)).astype(np.float32))
        if arch == "qwen3":
            w.add_tensor(p + "attn_q_norm.weight", _norm(rng, head_dim))
            w.add_tensor(p + "attn_k_norm.weight", _norm(rng, head_dim))
        _add(w, p + "ffn_gate.weight", _matrix(rng, ffn, hidden), quantize)
        _add(w, p + "ffn_up.weight", _matrix(rng, ffn, hidden), quantize)
        _add(w, p + "ffn_down.weight", _matrix(rng, hidden, ffn), quantize)
    _finish(w)
    return Path(path)


def write_tiny_gemma3(path: str | Path, seed: int = 0, n_layers: int = 6, hidden: int = 64, heads: int = 4,
                      kv_heads: int = 1, head_dim: int = 32, ffn: int = 128, window: int = 8, context: int = 256,
                      quantize: bool = True, pattern: list[bool] | None = None, final_softcap: float = 0.0) -> Path:
    """A gemma3 GGUF (five local layers with a small window, then a global one) with an SPM-style vocab;
    `pattern` writes which layers are local as a list, `final_softcap` the final logit softcapping."""
    import gguf

    rng = np.random.default_rng(seed)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁", "▁t", "he", "▁the", "in", "▁a", "e", "t", "h", "a", "i", "n"]
    tokens = specials + byte_tokens + pieces
    types = [3] * len(specials) + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(window)
    if pattern is not None:
        w.add_array("gemma3.attention.sliding_window_pattern", [bool(p) for p in pattern])
    if final_softcap:
        w.add_float32("gemma3.final_logit_softcapping", final_softcap)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    _add(w, "token_embd.weight", _matrix(rng, vocab, hidden, 0.3), quantize)
    w.add_tensor("output_norm.weight", _norm(rng, hidden))
    for i in range(n_layers):
        p = f"blk.{i}."
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(p + norm + ".weight", _norm(rng, hidden))
        w.add_tensor(p + "attn_q_norm.weight", _norm(rng, head_dim))
        w.add_tensor(p + "attn_k_norm.weight", _norm(rng, head_dim))
        _add(w, p + "attn_q.weight", _matrix(rng, heads * head_dim, hidden), quantize)
        _add(w, p + "attn_k.weight", _matrix(rng, kv_heads * head_dim, hidden), quantize)
        _add(w, p + "attn_v.weight", _matrix(rng, kv_heads * head_dim, hidden), quantize)
        _add(w, p + "attn_output.weight", _matrix(rng, hidden, heads * head_dim), quantize)
        _add(w, p + "ffn_gate.weight", _matrix(rng, ffn, hidden), quantize)
        _add(w, p + "ffn_up.weight", _matrix(rng, ffn, hidden), quantize)
        _add(w, p + "ffn_down.weight", _matrix(rng, hidden, ffn), quantize)
    _finish(w)
    return Path(path)


def write_tiny_mtp_sidecar(path: str | Path, arch: str, target_path: str | Path, seed: int = 0, reduced: bool = False,
                           ids: list[int] | None = None) -> Path:
    """An MTP-only sidecar GGUF for the tiny model at `target_path`, in llama.cpp's nextn layout: the trunk's
    metadata with block_count + 1 and nextn_predict_layers 1, and only the blk.{n_trunk}.* tensors (a decoder
    block of the trunk's kind and the nextn tensors), float32. With `reduced`, a shared head over `ids` (or
    DRAFT_VOCAB random ones) and Outrider's `draft_vocab` mapping its rows to target ids."""
    import gguf

    reader = gguf.GGUFReader(str(target_path))
    meta = {f.name: f.contents() for f in reader.fields.values()}
    vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[1])
    hidden, heads = int(meta[f"{arch}.embedding_length"]), int(meta[f"{arch}.attention.head_count"])
    kv, ffn = int(meta[f"{arch}.attention.head_count_kv"]), int(meta[f"{arch}.feed_forward_length"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    n_trunk = int(meta[f"{arch}.block_count"])
    rng = np.random.default_rng(seed)
    mat = lambda r, c, s=0.15: (rng.standard_normal((r, c)) * s).astype(np.float32)
    norm = lambda n: (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():  # the trunk's own keys, as a converter writing mtp_only files keeps them
        if key.startswith(f"{arch}.") and key not in (f"{arch}.block_count",):
            if isinstance(value, float):
                w.add_float32(key, value)
            elif isinstance(value, int):
                w.add_uint32(key, value)
    w.add_block_count(n_trunk + 1)
    w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    p = f"blk.{n_trunk}."
    w.add_tensor(p + "attn_norm.weight", norm(hidden))
    w.add_tensor(p + "ffn_norm.weight", norm(hidden))
    w.add_tensor(p + "attn_q.weight", mat(heads * head_dim, hidden))
    w.add_tensor(p + "attn_k.weight", mat(kv * head_dim, hidden))
    w.add_tensor(p + "attn_v.weight", mat(kv * head_dim, hidden))
    w.add_tensor(p + "attn_output.weight", mat(hidden, heads * head_dim))
    w.add_tensor(p + "ffn_gate.weight", mat(ffn, hidden))
    w.add_tensor(p + "ffn_up.weight", mat(ffn, hidden))
    w.add_tensor(p + "ffn_down.weight", mat(hidden, ffn))
    if arch == "gemma3":
        for name in ("post_attention_norm", "post_ffw_norm"):
            w.add_tensor(p + name + ".weight", norm(hidden))
        w.add_tensor(p + "attn_q_norm.weight", norm(head_dim))
        w.add_tensor(p + "attn_k_norm.weight", norm(head_dim))
    w.add_tensor(p + "nextn.eh_proj.weight", mat(hidden, 2 * hidden))
    w.add_tensor(p + "nextn.enorm.weight", norm(hidden))
    w.add_tensor(p + "nextn.hnorm.weight", norm(hidden))
    if reduced:
        w.add_tensor(p + "nextn.shared_head_norm.weight", norm(hidden))
        ids = np.sort(rng.permutation(vocab)[:DRAFT_VOCAB]) if ids is None else np.array(ids)
        w.add_tensor(p + "nextn.shared_head_head.weight", mat(len(ids), hidden, 0.5))
        w.add_tensor(p + "nextn.draft_vocab", ids.astype(np.int32))
    _finish(w)
    return Path(path)


def add_gemma4_hparams(w, *, n_layers: int, context: int, hidden: int, heads: int, kv_heads: int | list[int],
                       hd_swa: int, hd_full: int, window: int, first_shared: int, per_layer_input: int,
                       ffns: list[int], local: list[bool]) -> None:
    """The `gemma4.*` hyperparameters as llama.cpp's converter writes them (shared by the tiny fixture and the
    synthetic E2B benchmark): RoPE bases 1e6 / 1e4, eps 1e-6, final softcap 30."""
    a = "gemma4."
    for key, value in [("block_count", n_layers), ("context_length", context), ("embedding_length", hidden),
                       ("attention.head_count", heads), ("attention.key_length", hd_full),
                       ("attention.value_length", hd_full), ("attention.sliding_window", window),
                       ("attention.shared_kv_layers", n_layers - first_shared),
                       ("embedding_length_per_layer_input", per_layer_input), ("attention.key_length_swa", hd_swa),
                       ("attention.value_length_swa", hd_swa), ("rope.dimension_count", hd_full),
                       ("rope.dimension_count_swa", hd_swa)]:
        w.add_uint32(a + key, value)
    for key, value in [("rope.freq_base", 1_000_000.0), ("rope.freq_base_swa", 10_000.0),
                       ("attention.layer_norm_rms_epsilon", 1e-6), ("final_logit_softcapping", 30.0)]:
        w.add_float32(a + key, value)
    w.add_array(a + "feed_forward_length", ffns)
    if isinstance(kv_heads, int):
        w.add_uint32(a + "attention.head_count_kv", kv_heads)
    else:
        w.add_array(a + "attention.head_count_kv", kv_heads)
    w.add_array(a + "attention.sliding_window_pattern", local)


def write_tiny_gemma4(path: str | Path, seed: int = 0, hidden: int = 64, heads: int = 4, ffn: int = 96,
                      window: int = 8, context: int = 256, per_layer_input: int = 32, quantize: bool = True) -> Path:
    """A gemma4 GGUF written with llama.cpp's converter's keys and tensor names (checked against converted
    files in tests/test_gemma4.py), without transformers or the converter: six layers (sliding x3, global,
    sliding, global) with head dims 16 / 32 and 2 / 1 kv heads, `attention_k_eq_v` on the global layers,
    proportional RoPE, per-layer input embeddings, and the last two layers sharing the K/V of layers 2 and 3
    with a double-wide MLP."""
    import gguf

    from outrider.testing.gemma4_vocabulary import CHAT_TEMPLATE, SPECIALS, vocabulary

    rng = np.random.default_rng(seed)
    tokens, merges = vocabulary()
    visible = {"<|channel>", "<channel|>"}  # the converter's always-rendered tokens
    types = [4 if t in visible else 3 if t in SPECIALS else 6 if t.startswith("<0x") else 1 for t in tokens]
    vocab, n_layers, hd_swa, hd_full, first_shared = len(tokens), 6, 16, 32, 4
    local = [True, True, True, False, True, False]
    kv_heads = [2 if is_local else 1 for is_local in local]
    ffns = [ffn if i < first_shared else 2 * ffn for i in range(n_layers)]
    w = gguf.GGUFWriter(str(path), "gemma4")
    add_gemma4_hparams(w, n_layers=n_layers, context=context, hidden=hidden, heads=heads, kv_heads=kv_heads,
                       hd_swa=hd_swa, hd_full=hd_full, window=window, first_shared=first_shared,
                       per_layer_input=per_layer_input, ffns=ffns, local=local)
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0] * vocab)
    w.add_token_types(types)
    w.add_token_merges([f"{left} {right}" for left, right in merges])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_uint32("tokenizer.ggml.mask_token_id", 4)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    n_rot = int(hd_full * 0.25 / 2)  # proportional RoPE: the rest of each half does not rotate
    w.add_tensor("rope_freqs.weight", np.array([1.0] * n_rot + [1e30] * (hd_full // 2 - n_rot), dtype=np.float32))
    _add(w, "token_embd.weight", _matrix(rng, vocab, hidden, 0.3), quantize)
    _add(w, "per_layer_token_embd.weight", _matrix(rng, vocab, n_layers * per_layer_input, 0.3), quantize)
    _add(w, "per_layer_model_proj.weight", _matrix(rng, n_layers * per_layer_input, hidden), quantize)
    w.add_tensor("per_layer_proj_norm.weight", _norm(rng, per_layer_input))
    w.add_tensor("output_norm.weight", _norm(rng, hidden))
    for i in range(n_layers):
        p, hd, kv = f"blk.{i}.", hd_swa if local[i] else hd_full, kv_heads[i]
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "post_norm"):
            w.add_tensor(p + norm + ".weight", _norm(rng, hidden))
        w.add_tensor(p + "attn_q_norm.weight", _norm(rng, hd))
        _add(w, p + "attn_q.weight", _matrix(rng, heads * hd, hidden), quantize)
        if i < first_shared:
            w.add_tensor(p + "attn_k_norm.weight", _norm(rng, hd))
            _add(w, p + "attn_k.weight", _matrix(rng, kv * hd, hidden), quantize)
            if local[i]:  # the global layers reuse K as V
                _add(w, p + "attn_v.weight", _matrix(rng, kv * hd, hidden), quantize)
        _add(w, p + "attn_output.weight", _matrix(rng, hidden, heads * hd), quantize)
        _add(w, p + "ffn_gate.weight", _matrix(rng, ffns[i], hidden), quantize)
        _add(w, p + "ffn_up.weight", _matrix(rng, ffns[i], hidden), quantize)
        _add(w, p + "ffn_down.weight", _matrix(rng, hidden, ffns[i]), quantize)
        _add(w, p + "inp_gate.weight", _matrix(rng, per_layer_input, hidden), quantize)
        _add(w, p + "proj.weight", _matrix(rng, hidden, per_layer_input), quantize)
        w.add_tensor(p + "layer_output_scale.weight", np.array([0.7 + 0.6 * rng.random()], dtype=np.float32))
    _finish(w)
    return Path(path)


ASSISTANT_ARCH = "gemma4-assistant"


def write_tiny_gemma4_assistant(path: str | Path, target_path: str | Path, seed: int = 0, hidden: int = 32,
                                n_layers: int = 4, heads: int = 2) -> Path:
    """A Gemma 4 assistant GGUF (`gemma4-assistant`, dense tied head, float32) matched to the gemma4 target at
    `target_path`, written with llama.cpp's converter's keys and tensor names (checked against a converted
    assistant in tests/test_gemma4_assistant.py) without transformers or the converter. Matched as the
    converted fixtures are (tests/oracles/gemma4_assistant.py, `matching_config`): the target's hidden size as
    `embedding_length_out`, its vocabulary, and per layer the kv heads and head dim of the target layer it
    reads (sliding layers: the target's last sliding KV-producing layer; the one global layer, last: its last
    global one), its sliding window, RoPE bases and `rope_freqs`. `n_layers - 1` sliding layers then a global
    one, `hidden` wide, MLP 2 * hidden. Weights as the oracle draws them: norms about 1, matrices
    N(0, 1/fan_in), layer output scales in [0.5, 1.5]."""
    import gguf

    from outrider.io.gguf import GGUFFile

    target = GGUFFile(target_path)
    try:
        if target.architecture != "gemma4":
            raise ValueError(f"{target_path}: a Gemma 4 assistant pairs with a gemma4 target, not "
                             f"'{target.architecture}'")
        pattern = [bool(p) for p in target.require("attention.sliding_window_pattern")]
        n_target = len(pattern)
        kv = target.require("attention.head_count_kv")
        kv = [int(x) for x in kv] if isinstance(kv, list) else [int(kv)] * n_target
        producers = range(n_target - int(target.arch_key("attention.shared_kv_layers", 0) or 0))
        last_swa = max(i for i in producers if pattern[i])
        last_full = max(i for i in producers if not pattern[i])
        hd_swa, hd_full = int(target.require("attention.key_length_swa")), int(target.require("attention.key_length"))
        backbone, vocab = int(target.require("embedding_length")), target.tensors["token_embd.weight"].shape[0]
        rope_freqs = (target.load("rope_freqs.weight").numpy().astype(np.float32)
                      if "rope_freqs.weight" in target.tensors else None)
        meta = target.metadata
        context = int(target.require("context_length"))
        window = int(target.require("attention.sliding_window"))
        eps = float(target.arch_key("attention.layer_norm_rms_epsilon", 1e-6))
        bases = (float(target.arch_key("rope.freq_base", 1_000_000.0)),
                 float(target.arch_key("rope.freq_base_swa", 10_000.0)))
        tokenizer = {k: meta[k] for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                                          "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                          "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id")
                     if k in meta}
    finally:
        target.close()
    if rope_freqs is None:  # proportional RoPE with partial_rotary_factor 0.25, as the converter writes it
        n_rot = int(hd_full * 0.25 / 2)
        rope_freqs = np.array([1.0] * n_rot + [1e30] * (hd_full // 2 - n_rot), dtype=np.float32)

    local = [True] * (n_layers - 1) + [False]
    kv_heads = [kv[last_swa] if is_local else kv[last_full] for is_local in local]
    ffn = 2 * hidden
    rng = np.random.default_rng(seed)
    mat = lambda rows, cols: (rng.standard_normal((rows, cols)) / cols ** 0.5).astype(np.float32)
    norm = lambda n: (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    a = ASSISTANT_ARCH + "."
    w = gguf.GGUFWriter(str(path), ASSISTANT_ARCH)
    for key, value in [("block_count", n_layers), ("context_length", context), ("embedding_length", hidden),
                       ("feed_forward_length", ffn), ("attention.head_count", heads),
                       ("attention.key_length", hd_full), ("attention.value_length", hd_full),
                       ("attention.sliding_window", window), ("attention.shared_kv_layers", n_layers),
                       ("embedding_length_per_layer_input", 0), ("attention.key_length_swa", hd_swa),
                       ("attention.value_length_swa", hd_swa), ("rope.dimension_count", hd_full),
                       ("rope.dimension_count_swa", hd_swa), ("embedding_length_out", backbone),
                       ("nextn_predict_layers", n_layers)]:
        w.add_uint32(a + key, value)
    for key, value in [("rope.freq_base", bases[0]), ("rope.freq_base_swa", bases[1]),
                       ("attention.layer_norm_rms_epsilon", eps)]:
        w.add_float32(a + key, value)
    if len(set(kv_heads)) == 1:  # the converter writes one number when every layer has the same
        w.add_uint32(a + "attention.head_count_kv", kv_heads[0])
    else:
        w.add_array(a + "attention.head_count_kv", kv_heads)
    w.add_array(a + "attention.sliding_window_pattern", local)
    # the target's vocabulary: an assistant shares its target's tokenizer
    w.add_tokenizer_model("gemma4")
    if "tokenizer.ggml.tokens" in tokenizer:
        w.add_token_list(tokenizer["tokenizer.ggml.tokens"])
        w.add_token_scores(tokenizer.get("tokenizer.ggml.scores", [-1000.0] * vocab))
        w.add_token_types(tokenizer.get("tokenizer.ggml.token_type", [1] * vocab))
    for key, add in [("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("unknown_token_id", w.add_unk_token_id), ("padding_token_id", w.add_pad_token_id)]:
        if "tokenizer.ggml." + key in tokenizer:
            add(int(tokenizer["tokenizer.ggml." + key]))
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)

    w.add_tensor("rope_freqs.weight", rope_freqs)
    w.add_tensor("token_embd.weight", mat(vocab, hidden))  # tied: the dense head too
    for i, is_local in enumerate(local):
        p, hd = f"blk.{i}.", hd_swa if is_local else hd_full
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(p + name + ".weight", norm(hidden))
        w.add_tensor(p + "attn_q_norm.weight", norm(hd))
        w.add_tensor(p + "attn_q.weight", mat(heads * hd, hidden))  # Q only: K and V are the target's
        w.add_tensor(p + "attn_output.weight", mat(hidden, heads * hd))
        w.add_tensor(p + "ffn_gate.weight", mat(ffn, hidden))
        w.add_tensor(p + "ffn_up.weight", mat(ffn, hidden))
        w.add_tensor(p + "ffn_down.weight", mat(hidden, ffn))
        w.add_tensor(p + "layer_output_scale.weight", np.array([0.5 + rng.random()], dtype=np.float32))
    w.add_tensor("output_norm.weight", norm(hidden))
    w.add_tensor("nextn.pre_projection.weight", mat(hidden, 2 * backbone))  # [E_target(t) * sqrt(backbone), h]
    w.add_tensor("nextn.post_projection.weight", mat(backbone, hidden))  # back to the target's width
    _finish(w)
    return Path(path)


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
