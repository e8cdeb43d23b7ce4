"""Tokenizers built from a GGUF file's metadata alone.

A GGUF file has no `tokenizer.json`; it stores the vocabulary under llama.cpp's keys. We support the three
vocabulary kinds (`tokenizer.ggml.model`) that cover most models:

- "gpt2": byte-level BPE. Tokens are spelled in GPT-2's printable byte alphabet and the merges are in the file.
- "gemma4": Gemma 4's BPE over raw UTF-8 with the merges in the file, spaces spelled "▁", byte fallback, and the
  text split only at runs of newlines (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_GEMMA4`).
- "llama": SentencePiece BPE with scores and `<0xXX>` byte fallback. The file has no merges; llama.cpp merges
  the adjacent pair whose concatenation is the highest-scoring token. A BPE whose merges are "every split of
  every token into two tokens, ranked by the merged token's score" does the same thing, so we derive those.

Encoding runs in the `tokenizers` library (Rust). We follow llama.cpp's rules, since GGUF files are made for
it: control tokens (`<|im_start|>`, `<start_of_turn>`) are matched whole in the text when `parse_special`,
user-defined tokens (Gemma's runs of "\\n", HTML tags) are always matched whole.

Decoding is ours and works on bytes: each token maps to the bytes it stands for, so a streaming decoder can
hold back half a UTF-8 character until the token that completes it arrives.
"""

from __future__ import annotations

import codecs
import enum
import functools
import hashlib
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers

from outrider.errors import ModelFileError

if TYPE_CHECKING:
    from outrider.io.gguf import GGUFFile

SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")


class TokenType(enum.IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Control tokens that end a turn although the file does not name them as eos/eot; llama.cpp's list.
_END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
    "<|endoftext|>", "<|end_of_text|>", "<eos>",
})

# `tokenizer.ggml.pre` values whose text splitting llama.cpp starts with "each digit alone" (`\p{N}`) before
# the GPT-2 regex. SmolLM2's own tokenizer.json says the same: Digits(individual_digits) then ByteLevel.
_DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r"})

# Llama 3's split regex, for the llama3-style `pre` values; these vocabularies also skip merging a word
# that is itself a token (`ignore_merges`), as llama.cpp does for them.
_LLAMA3_PRES = frozenset({"llama3", "llama-v3", "llama-bpe"})
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2's (and Qwen2.5's, Qwen3's) split regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2): Llama 3's with each
# digit alone; its vocabularies merge every word (no `ignore_merges`).
_QWEN2_PRES = frozenset({"qwen2"})
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

SPM_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space

# Deriving the merges of a 262k-token SentencePiece vocabulary takes seconds; builds slower than this are
# saved under $OUTRIDER_HOME/tokenizers and loaded from there next time.
_CACHE_BUILDS_SLOWER_THAN_S = 1.0
# Part of the cache key: bump it whenever the way we build a backend changes.
_BUILD_VERSION = "1"


@functools.cache
def gpt2_byte_to_char() -> dict[int, str]:
    """GPT-2's `bytes_to_unicode`: every byte as a printable character (printable ASCII/Latin-1 stand for
    themselves, the rest are shifted to U+0100 and up), so byte-level tokens can be written as strings."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


@functools.cache
def _gpt2_char_to_byte() -> dict[str, int]:
    return {char: byte for byte, char in gpt2_byte_to_char().items()}


class Tokenizer:
    """Text <-> token ids for one GGUF model. Build it with `Tokenizer.from_gguf(gguf_file)`."""

    def __init__(self, *, model: str, tokens: list[str], token_types: list[int], backend: tokenizers.Tokenizer,
                 bos_id: int | None, eos_id: int | None, eog_ids: frozenset[int], add_bos: bool, add_eos: bool,
                 add_space_prefix: bool):
        self.model = model  # "gpt2" or "llama", the file's vocabulary kind
        self._tokens = tokens
        self._token_types = token_types
        self._backend = backend
        self._backend_lock = threading.Lock()  # encode toggles a flag on the shared backend
        self._bos_id, self._eos_id, self._eog_ids = bos_id, eos_id, eog_ids
        self._add_bos, self._add_eos = add_bos, add_eos
        # SentencePiece vocabularies that prepend "▁" to the text drop that space again when decoding.
        self._strip_first_space = add_space_prefix
        self._token_bytes = _token_bytes_table(model, tokens, token_types)

    # ---- building ---------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile) -> Tokenizer:
        meta = gguf_file.metadata
        model = meta.get("tokenizer.ggml.model")
        if model not in SUPPORTED_MODELS:
            raise ModelFileError(
                f"{gguf_file.path}: tokenizer type {model!r} (tokenizer.ggml.model) is not supported; "
                f"use a model whose vocabulary is one of: {', '.join(SUPPORTED_MODELS)}")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFileError(f"{gguf_file.path}: the file has no vocabulary (tokenizer.ggml.tokens); "
                                 "re-convert the model with llama.cpp's convert_hf_to_gguf.py")
        tokens = list(tokens)
        token_types = list(meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens))
        if len(token_types) != len(tokens):
            raise ModelFileError(f"{gguf_file.path}: tokenizer.ggml.token_type has {len(token_types)} entries for "
                                 f"{len(tokens)} tokens; the file is corrupt, fetch or convert it again")

        if model == "gpt2":
            merges = meta.get("tokenizer.ggml.merges")
            if not merges:
                raise ModelFileError(f"{gguf_file.path}: byte-level vocabulary without tokenizer.ggml.merges; "
                                     "re-convert the model with llama.cpp's convert_hf_to_gguf.py")
            pre = str(meta.get("tokenizer.ggml.pre", "default"))
            backend = _build_byte_level_backend(tokens, token_types, list(merges), pre)
            add_space_prefix = False
        elif model == "gemma4":
            merges = meta.get("tokenizer.ggml.merges")
            if not merges:
                raise ModelFileError(f"{gguf_file.path}: gemma4 vocabulary without tokenizer.ggml.merges; "
                                     "re-convert the model with llama.cpp's convert_hf_to_gguf.py")
            backend = _build_gemma4_backend(tokens, token_types, list(merges))
            add_space_prefix = False
        else:
            scores = meta.get("tokenizer.ggml.scores")
            if scores is None or len(scores) != len(tokens):
                # Without scores the vocabulary order is the merge priority (earlier is better).
                scores = [-float(index) for index in range(len(tokens))]
            add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            backend = _cached_build(
                _cache_key(model, tokens, token_types, scores, add_space_prefix),
                lambda: _build_sentencepiece_backend(tokens, token_types, scores, add_space_prefix))

        bos_id = _optional_id(meta, "tokenizer.ggml.bos_token_id", len(tokens))
        eos_id = _optional_id(meta, "tokenizer.ggml.eos_token_id", len(tokens))
        eog_ids = {eos_id} if eos_id is not None else set()
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if (token_id := _optional_id(meta, key, len(tokens))) is not None:
                eog_ids.add(token_id)
        for text in _END_OF_GENERATION_TEXTS:
            token_id = _index_or_none(tokens, text)
            if token_id is not None and token_types[token_id] == TokenType.CONTROL:
                eog_ids.add(token_id)
        # llama.cpp adds BOS to SentencePiece vocabularies whose file does not say otherwise, not to gpt2 ones,
        # and always to gemma4 ones (its workaround for files written with add_bos_token = false).
        add_bos = model == "gemma4" or bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama"))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        return cls(model=model, tokens=tokens, token_types=token_types, backend=backend, bos_id=bos_id,
                   eos_id=eos_id, eog_ids=frozenset(eog_ids), add_bos=add_bos, add_eos=add_eos,
                   add_space_prefix=add_space_prefix)

    # ---- properties -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def eog_ids(self) -> frozenset[int]:
        """Tokens that end generation: eos, eot/eom if the file names them, and end-of-turn control tokens."""
        return self._eog_ids

    @property
    def add_bos(self) -> bool:
        """Whether `encode` prepends BOS by default (the file's `tokenizer.ggml.add_bos_token`)."""
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    @property
    def tokens(self) -> list[str]:
        """Token strings as the file spells them."""
        return self._tokens

    def token_type(self, token_id: int) -> TokenType:
        return TokenType(self._token_types[token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token contributes to decoded text; b"" for control tokens."""
        if not 0 <= token_id < len(self._token_bytes):
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {len(self._token_bytes)})")
        return self._token_bytes[token_id]

    # ---- encoding and decoding --------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
               add_eos: bool | None = None) -> list[int]:
        """Token ids for `text`.

        add_bos: None follows the file, except that no second BOS is added when the text already starts with
            one (chat templates write it themselves); True/False force it.
        parse_special: match control tokens written in the text (`<|im_start|>`) as those tokens; when False
            they are tokenized as plain text. User-defined tokens are always matched.
        add_eos: None appends EOS when the file asks for it (`tokenizer.ggml.add_eos_token`); True/False force it.
        """
        with self._backend_lock:
            self._backend.encode_special_tokens = not parse_special
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self._add_bos and not (ids and ids[0] == self._bos_id)
        if add_bos and self._bos_id is not None:
            ids.insert(0, self._bos_id)
        if (self._add_eos if add_eos is None else add_eos) and self._eos_id is not None:
            ids.append(self._eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; control tokens contribute nothing, invalid UTF-8 becomes U+FFFD."""
        stream = self.stream_decoder()
        return "".join(stream.push(token_id) for token_id in ids) + stream.flush()

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.model!r}, vocab_size={self.vocab_size}, bos_id={self._bos_id}, " \
               f"eos_id={self._eos_id}, add_bos={self._add_bos})"


class StreamDecoder:
    """Turns tokens into text one at a time, as they are generated.

    `push` returns only complete characters: a token that ends in the middle of a multi-byte UTF-8 character
    (byte-fallback tokens, byte-level pieces of an emoji) leaves those bytes pending until the rest arrives.
    The concatenated output of `push`... + `flush()` equals `Tokenizer.decode` of the same ids.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_first_space = tokenizer._strip_first_space

    def push(self, token_id: int) -> str:
        piece = self._tokenizer.token_bytes(token_id)
        if self._strip_first_space and piece:
            self._strip_first_space = False
            piece = piece.removeprefix(b" ")
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Whatever is still pending (an unfinished character comes out as U+FFFD); the decoder is reset."""
        rest = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        self._strip_first_space = self._tokenizer._strip_first_space
        return rest


# ---- backends -------------------------------------------------------------------------------------


def _build_byte_level_backend(tokens: list[str], token_types: list[int], merges: list[str],
                              pre: str) -> tokenizers.Tokenizer:
    """GPT-2-style byte-level BPE: tokens and merges straight from the file."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merge_pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")  # byte-level tokens spell a space as "Ġ", so one real space
        merge_pairs.append((left, right))
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab=vocab, merges=merge_pairs, ignore_merges=pre in _LLAMA3_PRES))
    byte_level_without_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    gpt2_split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    if pre in _DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2_split])
    elif pre in _LLAMA3_PRES | _QWEN2_PRES:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level_without_regex])
    else:
        backend.pre_tokenizer = gpt2_split
    _add_whole_tokens(backend, tokens, token_types, user_defined_normalized=False)
    return backend


def _build_gemma4_backend(tokens: list[str], token_types: list[int], merges: list[str]) -> tokenizers.Tokenizer:
    """Gemma 4: BPE with the file's merges on raw UTF-8 (not GPT-2's byte alphabet), spaces turned into "▁"
    first, unknown characters as `<0xXX>` byte tokens, and no word splitting except at runs of newlines."""
    vocab = {token: index for index, token in enumerate(tokens)}
    # "left right", split at the first space after the first character, as llama.cpp reads them
    cuts = [merge.find(" ", 1) for merge in merges]
    merge_pairs = [(merge[:cut], merge[cut + 1:]) for merge, cut in zip(merges, cuts) if cut > 0]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merge_pairs, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", SPM_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    _add_whole_tokens(backend, tokens, token_types, user_defined_normalized=False)
    return backend


def _build_sentencepiece_backend(tokens: list[str], token_types: list[int], scores: list[float],
                                 add_space_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece BPE with byte fallback, as llama.cpp runs it, with merges derived from the scores."""
    # llama.cpp's converter writes user-defined tokens with "▁" turned back into real spaces (Gemma's runs of
    # two or more spaces are stored as "  "). Spell them as SentencePiece does, so they line up with the
    # normalized text they are matched against.
    spellings = [token.replace(" ", SPM_SPACE) if kind == TokenType.USER_DEFINED else token
                 for token, kind in zip(tokens, token_types)]
    vocab = {token: index for index, token in enumerate(spellings)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab=vocab, merges=_derive_merges(spellings, token_types, scores, vocab), byte_fallback=True))
    to_spm_spaces = normalizers.Replace(" ", SPM_SPACE)
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend(SPM_SPACE), to_spm_spaces])
                          if add_space_prefix else to_spm_spaces)
    # No pre-tokenizer: SentencePiece merges across the whole text between whole-matched tokens.
    _add_whole_tokens(backend, spellings, token_types, user_defined_normalized=True)
    return backend


def _derive_merges(spellings: list[str], token_types: list[int], scores: list[float],
                   vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge; best merged-token score first.

    llama.cpp's SentencePiece tokenizer repeatedly joins the adjacent pair whose concatenation is the
    highest-scoring token (leftmost on ties); BPE with these merges in this order does the same. Only normal
    (and unused) tokens are merge results: control and byte tokens are never formed from text, and user-defined
    tokens are matched whole before BPE runs, as in SentencePiece. Same merged token: lower-ranked left piece first.
    """
    mergeable = (TokenType.NORMAL, TokenType.UNUSED)
    ranked = []  # (-score, merged id, left id, left, right)
    for merged_id, token in enumerate(spellings):
        if len(token) < 2 or token_types[merged_id] not in mergeable:
            continue
        neg_score = -scores[merged_id]
        for cut in range(1, len(token)):
            left_id = vocab.get(token[:cut])
            if left_id is not None and token[cut:] in vocab:
                ranked.append((neg_score, merged_id, left_id, token[:cut], token[cut:]))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _add_whole_tokens(backend: tokenizers.Tokenizer, spellings: list[str], token_types: list[int],
                      user_defined_normalized: bool) -> None:
    """Register control/unknown tokens (matched when parse_special) and user-defined tokens (always matched).

    Their spellings are in the model's vocabulary, so `tokenizers` keeps their ids instead of adding new ones.
    """
    special = [AddedToken(text, special=True, normalized=False)
               for text, kind in zip(spellings, token_types)
               if text and kind in (TokenType.CONTROL, TokenType.UNKNOWN)]
    user_defined = [AddedToken(text, special=False, normalized=user_defined_normalized)
                    for text, kind in zip(spellings, token_types)
                    if text and kind == TokenType.USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if user_defined:
        backend.add_tokens(user_defined)


# ---- cache of built backends ----------------------------------------------------------------------


def _cache_key(model: str, tokens: list[str], token_types: list[int], scores: list[float],
               add_space_prefix: bool) -> str:
    """sha1 of everything the build depends on: the tokens and what the merges are derived from."""
    digest = hashlib.sha1(f"{_BUILD_VERSION}|{model}|{add_space_prefix}|".encode())
    digest.update("\0".join(tokens).encode("utf-8", errors="surrogatepass"))
    digest.update(np.asarray(token_types, dtype=np.int32).tobytes())
    digest.update(np.asarray(scores, dtype=np.float32).tobytes())
    return digest.hexdigest()


def _tokenizer_cache_dir() -> Path:
    from outrider.paths import outrider_home
    return outrider_home() / "tokenizers"


def _cached_build(key: str, build: Callable[[], tokenizers.Tokenizer]) -> tokenizers.Tokenizer:
    path = _tokenizer_cache_dir() / f"{key}.json"
    if path.is_file():
        try:
            return tokenizers.Tokenizer.from_str(path.read_text(encoding="utf-8"))
        except Exception:  # a truncated or foreign file: build again and overwrite it
            pass
    started = time.perf_counter()
    backend = build()
    if time.perf_counter() - started > _CACHE_BUILDS_SLOWER_THAN_S:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(backend.to_str(), encoding="utf-8")
            os.replace(partial, path)  # atomic, so a concurrent reader never sees half a file
        except OSError:
            pass  # a read-only home only costs the rebuild next time
    return backend


# ---- decoding table -------------------------------------------------------------------------------


def _token_bytes_table(model: str, tokens: list[str], token_types: list[int]) -> list[bytes]:
    """The bytes each token decodes to, following llama.cpp's `token_to_piece` (special tokens not rendered)."""
    if model == "gpt2":
        char_to_byte = _gpt2_char_to_byte()
        # Characters outside the byte alphabet should not occur in normal tokens; keep them as their UTF-8.
        table = [b"".join(bytes([char_to_byte[c]]) if c in char_to_byte else c.encode() for c in token)
                 for token in tokens]
    else:
        table = [token.replace(SPM_SPACE, " ").encode() for token in tokens]
    for token_id, kind in enumerate(token_types):  # the few tokens that are not normal text
        if kind == TokenType.NORMAL:
            continue
        token = tokens[token_id]
        if kind == TokenType.USER_DEFINED:
            table[token_id] = token.encode()  # stored as plain text (with real spaces)
        elif kind == TokenType.BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            table[token_id] = bytes([int(token[3:5], 16)])
        else:  # control, unknown, unused: markers, not text
            table[token_id] = b""
    return table


def _index_or_none(items: list[str], value: str) -> int | None:
    try:
        return items.index(value)
    except ValueError:
        return None


def _optional_id(meta: dict, key: str, vocab_size: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < vocab_size else None
