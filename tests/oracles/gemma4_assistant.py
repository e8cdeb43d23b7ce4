"""Tiny Gemma 4 assistants for tests, and transformers' assistant as the oracle that drives them.

`write_assistant_checkpoint` builds a random `Gemma4AssistantForCausalLM` (dense tied head, or the E2B/E4B
centroid-masked head) with a small byte-fallback BPE tokenizer; `assistant_gguf` converts it with llama.cpp's
own `convert_hf_to_gguf.py`. `TransformersAssistant` drives the transformers model the way its
`SinglePositionMultiTokenCandidateGenerator` does: [E_target(token) * sqrt(backbone), hidden] at one constant
position, argmax chained, over a shared KV dictionary.

Two workarounds, both for transformers/llama.cpp as installed, not for our code:
- transformers 5.23's `Gemma4TextConfig.kv_sharing_modes` raises when every layer shares KV, which is exactly what
  an assistant is (`Gemma4AssistantConfig` forces num_kv_shared_layers = num_hidden_layers); while the model is
  built, every layer is given the mode the assistant means, "reuse".
- the vendored converter drops `masked_embedding.*` (llama.cpp computes the dense head); to write the
  centroid head as files carrying it do, the converter runs with that one filter lifted, so the names and
  layout are still llama.cpp's own (`masked_embd_centroids.weight`, `masked_embd_ordering`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import torch

from oracles.llama_cpp import convert_hf_to_gguf, llama_cpp_tree

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A Gemma-style byte-fallback BPE tokenizer (what llama.cpp's Gemma 4 converter reads) of exactly
    `vocab_size` pieces: 4 specials, 256 byte pieces, then letters and filler pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,":
        if len(vocab) < vocab_size:
            vocab[ch] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"▁w{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(folder)


@contextlib.contextmanager
def _every_layer_shares_kv():
    from transformers import Gemma4TextConfig

    original = Gemma4TextConfig.kv_sharing_modes

    def modes(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return original.fget(self)

    Gemma4TextConfig.kv_sharing_modes = property(modes)
    try:
        yield
    finally:
        Gemma4TextConfig.kv_sharing_modes = original


def assistant_config(vocab_size: int = 320, backbone: int = 48, hidden: int = 32, n_layers: int = 4,
                     heads: int = 2, kv_heads: int = 2, global_kv_heads: int = 1, head_dim: int = 16,
                     global_head_dim: int = 32, sliding_window: int = 8, centroids: bool = False,
                     n_centroids: int = 8, centroid_top_k: int = 2, partial_rotary: float = 0.25):
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig

    layer_types = ["sliding_attention"] * (n_layers - 1) + ["full_attention"]
    text = Gemma4TextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, global_head_dim=global_head_dim,
        num_global_key_value_heads=global_kv_heads, attention_k_eq_v=True, sliding_window=sliding_window,
        layer_types=layer_types, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        num_kv_shared_layers=n_layers, max_position_embeddings=512,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": partial_rotary,
                                            "rope_theta": 1_000_000.0}})
    cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=backbone, use_ordered_embeddings=centroids,
                                num_centroids=n_centroids, centroid_intermediate_top_k=centroid_top_k)
    cfg.architectures = ["Gemma4AssistantForCausalLM"]
    return cfg


def build_assistant(config, seed: int = 0):
    """A random assistant whose weights are large enough that its argmax is not a tie: unit-scale norms
    around 1, projections ~N(0, 1/fan_in)-ish, layer scalars in [0.5, 1.5], a random token ordering."""
    from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

    with _every_layer_shares_kv():
        model = Gemma4AssistantForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=gen))
        if model.masked_embedding is not None:
            model.masked_embedding.token_ordering.copy_(torch.randperm(config.get_text_config().vocab_size,
                                                                       generator=gen))
    return model.eval()


def write_assistant_checkpoint(folder: str | os.PathLike, seed: int = 0, **config_kwargs):
    """The transformers model, saved with a tokenizer in `folder`; returns the model."""
    folder = Path(folder)
    config = assistant_config(**config_kwargs)
    model = build_assistant(config, seed)
    model.save_pretrained(folder)
    write_tokenizer(folder, config.get_text_config().vocab_size)
    return model


_KEEP_CENTROIDS = """
import sys
tree = sys.argv.pop(1)
sys.path.insert(0, tree)
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
import convert_hf_to_gguf
from conversion.gemma import Gemma4AssistantModel, Gemma4Model
Gemma4AssistantModel.filter_tensors = classmethod(lambda cls, item: Gemma4Model.filter_tensors.__func__(cls, item))
convert_hf_to_gguf.main()
"""


def assistant_gguf(hf_dir: str | os.PathLike, out: str | os.PathLike, keep_centroids: bool = False,
                   outtype: str = "f32") -> Path:
    """Convert a checkpoint with llama.cpp's converter (centroid tensors kept with `keep_centroids`)."""
    if not keep_centroids:
        return convert_hf_to_gguf(hf_dir, out, outtype=outtype)
    tree = llama_cpp_tree()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("NO_LOCAL_GGUF", None)
    cmd = [sys.executable, "-c", _KEEP_CENTROIDS, str(tree), str(hf_dir), "--outfile", str(out), "--outtype", outtype]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{tail}")
    return Path(out)


class TransformersAssistant:
    """transformers' assistant driven as its candidate generator drives it, over a given shared KV."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def draft(self, embed, token: int, hidden: torch.Tensor, pos: int,
              kv: dict[str, tuple[torch.Tensor, torch.Tensor]], k: int):
        """(logits rows [k, vocab], k drafted ids). `embed(ids)` is the target's scaled input embedding
        (E[ids] * sqrt(backbone)); `kv` maps "sliding_attention"/"full_attention" to (K, V) [kv_heads, S, d]."""
        shared = {name: (kk[None].float(), vv[None].float()) for name, (kk, vv) in kv.items()}
        position_ids = torch.tensor([[pos]])
        last_token, last_hidden = torch.tensor([[token]]), hidden.reshape(1, 1, -1).float()
        rows, ids = [], []
        for _ in range(k):
            inputs = torch.cat([embed(last_token).float(), last_hidden], dim=-1)
            out = self.model(inputs_embeds=inputs, position_ids=position_ids, shared_kv_states=shared, use_cache=False)
            last_token = out.logits.argmax(dim=-1)
            last_hidden = out.last_hidden_state
            rows.append(out.logits[0, -1])
            ids.append(int(last_token))
        return torch.stack(rows), ids


def matching_config(target_gguf: str | os.PathLike, centroids: bool = False) -> dict:
    """`assistant_config` arguments for an assistant that pairs with the Gemma 4 target in `target_gguf`: its
    hidden size as backbone, its vocabulary, its last sliding / global layers' kv heads and head dims."""
    from outrider.io.gguf import GGUFFile

    g = GGUFFile(target_gguf)
    pattern = [bool(p) for p in g.require("attention.sliding_window_pattern")]
    n = len(pattern)
    kv = g.require("attention.head_count_kv")
    kv = list(kv) if isinstance(kv, list) else [kv] * n
    shared = int(g.arch_key("attention.shared_kv_layers", 0) or 0)
    producers = range(n - shared)  # KV-sharing layers read the last earlier layer of their kind
    last_swa = max(i for i in producers if pattern[i])
    last_full = max(i for i in producers if not pattern[i])
    vocab = g.tensors["token_embd.weight"].shape[0]
    n_centroids = 8 if vocab % 8 == 0 else next(c for c in (7, 6, 5, 3, 2) if vocab % c == 0)
    return dict(vocab_size=vocab, backbone=int(g.require("embedding_length")), hidden=32, n_layers=4, heads=2,
                kv_heads=int(kv[last_swa]), global_kv_heads=int(kv[last_full]),
                head_dim=int(g.require("attention.key_length_swa")),
                global_head_dim=int(g.require("attention.key_length")),
                sliding_window=int(g.require("attention.sliding_window")), centroids=centroids,
                n_centroids=n_centroids, centroid_top_k=2)


def cached_assistant(target_gguf: str | os.PathLike | None, head: str = "dense", seed: int = 0,
                     **overrides) -> tuple[Path, Path]:
    """(transformers checkpoint folder, converted GGUF) of an assistant matched to `target_gguf` (None: of
    `assistant_config`'s defaults), but for `overrides` of `assistant_config` arguments, built once per machine under
    `$OUTRIDER_HOME/fixtures/` and keyed by this file, the target file, the converter's, transformers' and
    torch's versions (the converter takes tens of seconds)."""
    import hashlib

    import transformers

    from oracles.gemma4_fixtures import build_once
    from oracles.llama_cpp import LLAMA_CPP_PYTHON
    from outrider.paths import outrider_home

    digest = hashlib.sha256(Path(__file__).read_bytes())
    if target_gguf is not None:
        digest.update(hashlib.sha256(Path(target_gguf).read_bytes()).digest())
    for part in (LLAMA_CPP_PYTHON, transformers.__version__, torch.__version__, head, str(seed),
                 repr(sorted(overrides.items()))):
        digest.update(part.encode())
    folder = outrider_home() / "fixtures" / f"gemma4-assistant-{head}-{digest.hexdigest()[:12]}"
    hf_dir, gguf_path = folder / "hf", folder / "assistant.gguf"

    def build(staging: Path) -> None:
        centroids = head == "centroids"
        matched = matching_config(target_gguf, centroids) if target_gguf is not None else {"centroids": centroids}
        write_assistant_checkpoint(staging / "hf", seed=seed, **{**matched, **overrides})
        assistant_gguf(staging / "hf", staging / "assistant.gguf", keep_centroids=centroids)

    build_once(folder, gguf_path, build)
    return hf_dir, gguf_path


def load_transformers_assistant(hf_dir: str | os.PathLike):
    from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

    with _every_layer_shares_kv():
        return Gemma4AssistantForCausalLM.from_pretrained(hf_dir).eval()
