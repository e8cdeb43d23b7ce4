"""The ``p-min`` acceptor: a verify-side probability threshold (SharpInference's MTP ``pMin``). LOSSY.

Accept x_i when the lossless rule would accept it OR p_i(x_i) >= p_min, where p_i is the target's warped
distribution (at temperature 0: softmax of the raw logits at T=1). The output can differ from the target
alone. Not to be confused with the drafter-side stop ``--draft-p-min``, which is lossless.
"""

from __future__ import annotations

import math

import torch

from outrider.errors import ConfigError
from outrider.hookspecs import hookimpl
from outrider.sampling import AcceptResult, PositionRandom, SamplingParams

from .greedy import check_round
from .sampled import WarpedRows, sampled_round


class PMinAcceptor:
    """Lossless rule, plus: accept any drafted token the target gives at least ``p_min`` probability."""

    lossless = False
    needs_draft_probs = False

    def __init__(self, p_min: float = 0.1) -> None:
        try:
            value = float(p_min)
        except (TypeError, ValueError):
            raise ConfigError(f"p_min must be a number in [0, 1], got {p_min!r}") from None
        if not math.isfinite(value) or not 0.0 <= value <= 1.0:
            raise ConfigError(f"p_min must be a number in [0, 1], got {p_min!r}")
        self.p_min = value

    def accept(
        self,
        target_logits: torch.Tensor,
        draft_tokens: list[int],
        draft_probs: torch.Tensor | None,
        params: SamplingParams,
        rng: PositionRandom,
        position: int,
    ) -> AcceptResult:
        target_logits = check_round(target_logits, draft_tokens, draft_probs)
        probs = None if params.greedy else WarpedRows(target_logits, params)
        vocab = target_logits.shape[-1]

        def force(i: int) -> bool:
            x = draft_tokens[i]
            if not 0 <= x < vocab:
                return False
            # at temperature 0 the threshold is on the softmax of the raw logits (T = 1)
            row = torch.softmax(target_logits[i].to(torch.float32), dim=-1) if probs is None else probs[i]
            return bool(row[x] >= self.p_min)

        return sampled_round(target_logits, draft_tokens, draft_probs, params, rng, position, probs, force)

    def __repr__(self) -> str:
        return f"PMinAcceptor(p_min={self.p_min})"



@hookimpl
def register_acceptors(register):
    register("p-min", PMinAcceptor, options={"p_min": (float, 0.1, "accept a drafted token when the target gives it at least this probability")})
