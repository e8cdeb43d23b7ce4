"""The ``greedy`` acceptor: keep drafted tokens while they equal the target's argmax (lossless at T=0)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from outrider.hookspecs import hookimpl
from outrider.sampling import AcceptResult, PositionRandom, SamplingParams, argmax_token


def check_round(
    target_logits: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor | None
) -> torch.Tensor:
    """Validate the shapes of one verify round; returns target_logits as [k+1, V]."""
    k = len(draft_tokens)
    if target_logits.dim() == 1:
        target_logits = target_logits.unsqueeze(0)
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(
            f"target_logits must be [k+1, V] = [{k + 1}, V] for {k} drafted tokens, "
            f"got shape {tuple(target_logits.shape)}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_logits.shape[1]):
        raise ValueError(
            f"draft_probs must be [k, V] = [{k}, {target_logits.shape[1]}], got shape {tuple(draft_probs.shape)}"
        )
    return target_logits


def greedy_round(
    target_logits: torch.Tensor, draft_tokens: list[int], force: Callable[[int], bool] | None = None
) -> AcceptResult:
    """Greedy verify: accept x_i iff x_i == argmax p_i (or ``force(i)``); recovered/bonus = argmax.

    Rows after the first rejection are never looked at.
    """
    for i, x in enumerate(draft_tokens):
        top = argmax_token(target_logits[i])
        if top != x and not (force is not None and force(i)):
            return AcceptResult(tokens=list(draft_tokens[:i]) + [top], accepted=i)  # recovered
    bonus = argmax_token(target_logits[len(draft_tokens)])
    return AcceptResult(tokens=list(draft_tokens) + [bonus], accepted=len(draft_tokens))


class GreedyAcceptor:
    """Accept x_i iff it is the target's argmax; emit the argmax at the first mismatch, or the bonus argmax.

    Output is token-for-token the target's greedy decoding. It ignores the temperature.
    """

    lossless = True
    needs_draft_probs = False
    greedy_only = True  # lossless at temperature 0 only

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
        return greedy_round(target_logits, draft_tokens)

    def __repr__(self) -> str:
        return "GreedyAcceptor()"



@hookimpl
def register_acceptors(register):
    register("greedy", GreedyAcceptor, options={})
