"""Plain decoding with llama.cpp's repeat, presence and frequency penalties, written as the obvious loop: a fresh
full forward per token, the window counted afresh from the whole context with a Counter, the formula applied
token by token. Shares nothing with outrider.spec.penalties."""

from __future__ import annotations

from collections import Counter

import torch

from outrider.spec.random_streams import PositionRandom
from outrider.spec.sampling import SamplingParams, sample_at, warp


def penalised_next_logits(model, context: list[int], params: SamplingParams) -> torch.Tensor:
    logits = model.forward(torch.tensor(context), 0, model.new_cache(len(context)))[-1].float().clone()
    if params.repeat_last_n == 0:
        return logits
    window = context if params.repeat_last_n < 0 else context[-params.repeat_last_n:]
    for token, count in Counter(window).items():
        value = logits[token]
        value = value / params.repeat_penalty if value > 0 else value * params.repeat_penalty
        logits[token] = value - (count * params.frequency_penalty + params.presence_penalty)
    return logits


def plain_greedy_penalised(model, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(penalised_next_logits(model, tokens, params).argmax()))
    return tokens[len(prompt):]


def plain_sampled_penalised(model, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """The token at position i is sample_at(warp(penalised p_i), rng.uniform(i)): the PositionRandom rule."""
    rng = PositionRandom(params.seed)
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(sample_at(warp(penalised_next_logits(model, tokens, params), params), rng.uniform(len(tokens))))
    return tokens[len(prompt):]
