"""Perplexity as llama-perplexity measures it, so the two print comparable figures for one file and text.

The text is tokenized once (BOS where the file asks for it, control tokens as plain text), cut into chunks of
`n_ctx` tokens, and each chunk evaluated from an empty cache with its first token replaced by BOS; only the
second half of each chunk is scored, so every scored token sees at least n_ctx/2 tokens of context. The
uncertainty is llama-perplexity's: the standard error of the mean negative log-likelihood, times the
perplexity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from outrider.errors import ConfigError


@dataclass
class PerplexityResult:
    perplexity: float
    uncertainty: float  # +/- one standard error, as llama-perplexity prints it
    tokens_scored: int
    n_ctx: int
    chunks: int
    seconds: float
    running: list[float] = field(default_factory=list)  # the estimate after each chunk: llama-perplexity's [i]x

    def as_dict(self) -> dict:
        return {"perplexity": self.perplexity, "uncertainty": self.uncertainty, "tokens_scored": self.tokens_scored,
                "n_ctx": self.n_ctx, "chunks": self.chunks, "seconds": round(self.seconds, 3),
                "running": self.running}


def text_tokens(tokenizer, text: str) -> list[int]:
    """llama-perplexity's tokenization: `common_tokenize(text, add_special=true, parse_special=false)`."""
    return tokenizer.encode(text, add_bos=tokenizer.add_bos, parse_special=False, add_eos=False)


def perplexity(model, tokenizer, text: str, n_ctx: int = 512, max_chunks: int | None = None,
               on_chunk: Callable[[int, int, float], None] | None = None) -> PerplexityResult:
    """The perplexity of `model` over `text`. `on_chunk(done, total, estimate)` is called after each chunk."""
    if n_ctx < 4 or n_ctx % 2:
        raise ConfigError(f"--ctx-size {n_ctx}: perplexity needs an even context of at least 4 tokens, e.g. 512")
    if n_ctx > model.config.context_length:
        raise ConfigError(f"--ctx-size {n_ctx} is beyond the model's context of {model.config.context_length}; "
                          "give a smaller one")
    tokens = text_tokens(tokenizer, text)
    if len(tokens) < 2 * n_ctx:
        raise ConfigError(f"the text tokenizes to {len(tokens)} tokens; a context of {n_ctx} needs at least "
                          f"{2 * n_ctx}: give a longer text or a smaller --ctx-size")
    total = len(tokens) // n_ctx
    if max_chunks is not None and max_chunks > 0:
        total = min(total, max_chunks)
    first = n_ctx // 2
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    cache = model.new_cache(n_ctx)
    nll = nll2 = 0.0
    count = 0
    running = []
    started = time.perf_counter()
    for i in range(total):
        chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
        if bos is not None:
            chunk[0] = bos
        ids = torch.tensor(chunk, dtype=torch.long, device=model.device)
        # the first half is context only: a prompt pass, which pays the output head for no row
        model.forward(ids[:first], 0, cache, last_only=True)
        logits = model.forward(ids[first:-1], first, cache)
        log_probs = torch.log_softmax(logits.double().cpu(), dim=-1)
        picked = log_probs.gather(1, ids[first + 1:].cpu().unsqueeze(1)).squeeze(1)
        nll -= picked.sum().item()
        nll2 += (picked * picked).sum().item()
        count += picked.numel()
        running.append(math.exp(nll / count))
        if on_chunk is not None:
            on_chunk(i + 1, total, running[-1])
    mean = nll / count
    variance = nll2 / count - mean * mean
    ppl = math.exp(mean)
    uncertainty = math.sqrt(variance / (count - 1)) * ppl if variance > 0 and count > 1 else 0.0
    return PerplexityResult(ppl, uncertainty, count, n_ctx, total, time.perf_counter() - started, running)
