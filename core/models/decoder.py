"""What llama and gemma3 share: a token embedding, one `LayerStack` of pre-norm layers, a final norm and an
output head, run in prompt chunks; and the GGUF rope-scaling keys they both read (linear scaling only).
Gemma 4 takes the ends and `forward` from here and brings its own layers and cache."""

from __future__ import annotations

import torch

from outrider.errors import ModelFileError
from outrider.io.gguf import GGUFFile
from outrider.models.kv_cache import KVCache
from outrider.models.layers import PREFILL_CHUNK, Attention, load_ends, run_in_chunks
from outrider.models.linear import PackedLinear, rms_norm
from outrider.models.stack import LayerStack


def rope_freq_scale(g: GGUFFile) -> float:
    """The rotary frequency scale of `g`'s `rope.scaling.*` keys: 1 / factor for linear scaling, 1 without;
    other scalings (yarn, longrope) are refused."""
    scaling = str(g.arch_key("rope.scaling.type", "none"))
    if scaling not in ("none", "linear"):
        raise ModelFileError(f"{g.path}: rope scaling '{scaling}' is not supported for {g.architecture} "
                             "(only linear); use a model without it")
    factor = float(g.arch_key("rope.scaling.factor", 1.0) or 1.0) if scaling == "linear" else 1.0
    return 1.0 / factor


class Decoder:
    """The shared body of a decoder-only model. A subclass sets `config` (with `n_layers`, `context_length`,
    `eps`), `layers` (each with `tensors()`), `attention` and `stack` after `_load_ends`, and may override
    `_embedded` (scaled embeddings) and `logit_softcap`."""

    architecture: str
    activation: str
    logit_softcap = 0.0
    batches = True  # forward_sequences runs several sequences at once (Gemma 4's runs one at a time)
    config: object
    layers: list
    attention: Attention
    stack: LayerStack

    def _load_ends(self, g: GGUFFile, dtype: torch.dtype, device, native: bool, linear_form: str | None) -> str:
        """Set the device, prefill chunking and linear form, and load the embedding, final norm and head;
        the linear form the layers take."""
        self.dtype, self.device = dtype, torch.device(device)
        self.chunk = PREFILL_CHUNK if native else 0
        self.native = native
        self.linear_form = form = linear_form or ("native" if native else "dense")
        self.output, self.embed, self.output_norm = load_ends(g, form, dtype, device)
        return form

    def pin_kernels(self, int8: bool | None, threads: int) -> None:
        """Every forward of this model with int8 (True) or float32 (False) activations (None: the process's
        setting) and at most `threads` of the pool's threads (0: all of them), whatever the process's settings
        are then: a draft model loaded with its own beside its target's. Set where the weights' form was chosen
        for that mode (they were loaded under it)."""
        if isinstance(self.output, PackedLinear):
            self.output.pin(int8, threads)
        self.stack.pin(int8, threads)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        return self.attention.new_cache(self.config.n_layers, max_len or self.config.context_length, self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache, hidden: bool = False,
                last_only: bool = False):
        """Logits [T, vocab] (float32) for tokens at positions start..start+T-1 (only the last row with
        `last_only`, which marks a prompt: see `run_in_chunks`); with `hidden`, also the final-normed
        hidden states [T, hidden_size] of every row, `last_only` or not. Writes the cache and sets its
        length to start+T."""
        h = run_in_chunks(self._hidden, tokens, start, cache, self.chunk, last_only, every_row=hidden)
        logits = self.output(h[-1:] if last_only else h, softcap=self.logit_softcap).float()
        return (logits, h) if hidden else logits

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, start: int, cache: KVCache, hidden: bool = False) -> torch.Tensor | None:
        """A piece of a prompt that is not its end: the cache written for positions start..start+T-1 as `forward`
        with `last_only` writes it, without the output head (no logits are wanted); with `hidden`, the final-normed
        hidden states [T, hidden_size] of its rows."""
        h = run_in_chunks(self._hidden, tokens, start, cache, self.chunk, True, every_row=hidden)
        return h if hidden else None

    @torch.inference_mode()
    def forward_sequences(self, tokens: torch.Tensor, counts: list[int], starts: list[int], caches: list[KVCache],
                          hidden: bool = False, last_rows: bool = False):
        """Logits [N, vocab] (float32) of several independent sequences in one forward (a ragged batch): `tokens` [N]
        holds counts[b] tokens of sequence b, in order, at positions starts[b].. of caches[b], each cache's length
        set to starts[b] + counts[b]; with `hidden`, also the final-normed hidden states [N, hidden_size]. With the
        CPU kernels each row is bit for bit what `forward` of its own sequence's rows gives (a verify pass: not
        `last_only`, whose prompt rows may sum in another order). `last_rows`: the logits of each sequence's last
        row only [B, vocab] (a drafter's catch-up: the output head is most of a small model's step); a sequence
        with no rows has none."""
        if not (len(counts) == len(starts) == len(caches)) or sum(counts) != tokens.shape[0] or min(counts, default=1) < 0:
            raise ValueError(f"forward_sequences: {tokens.shape[0]} tokens, counts {list(counts)}, {len(starts)} starts "
                             f"and {len(caches)} caches do not describe one batch")
        x = self.stack.run_sequences(self._embedded(tokens), counts, starts, caches)
        for cache, start, n in zip(caches, starts, counts):
            cache.length = start + n
        h = rms_norm(x, self.output_norm, self.config.eps)
        rows = h
        if last_rows:
            n = torch.tensor(counts, device=h.device)
            rows = h[(n.cumsum(0) - 1)[n > 0]]
        logits = self.output(rows, softcap=self.logit_softcap).float()
        return (logits, h) if hidden else logits

    def _embedded(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)

    def _hidden(self, tokens: torch.Tensor, start: int, cache: KVCache, prompt: bool) -> torch.Tensor:
        x = self.stack.run(self._embedded(tokens), start, cache, prompt)
        cache.length = start + tokens.shape[0]
        return rms_norm(x, self.output_norm, self.config.eps)

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor the model reads per token (the input embedding is a row gather, so it is left out)."""
        return self.output.tensors() + [self.output_norm] + [t for layer in self.layers for t in layer.tensors()]
