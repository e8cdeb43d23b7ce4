"""The ``sampled`` acceptor: speculative sampling (Leviathan et al. 2023, Chen et al. 2023), lossless at any
temperature. At temperature 0 it is exactly the ``greedy`` acceptor."""

from __future__ import annotations

from collections.abc import Callable

import torch

from outrider.hookspecs import hookimpl
from outrider.sampling import AcceptResult, PositionRandom, SamplingParams, sample_at, warp

from .greedy import check_round, greedy_round


class WarpedRows:
    """warp(target_logits[i], params) for the rows asked for, each warped once: a round pays for the rows
    up to its first rejection, not for all k + 1 (a row warps to the same bits alone as in a batch)."""

    def __init__(self, target_logits: torch.Tensor, params: SamplingParams) -> None:
        self.logits, self.params = target_logits, params
        self._rows: dict[int, torch.Tensor] = {}

    def __getitem__(self, i: int) -> torch.Tensor:
        row = self._rows.get(i)
        if row is None:
            row = self._rows[i] = warp(self.logits[i], self.params)
        return row


def sampled_round(
    target_logits: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    rng: PositionRandom,
    position: int,
    probs: WarpedRows | None = None,
    force: Callable[[int], bool] | None = None,
) -> AcceptResult:
    """One verify round by the lossless rule; ``force(i)`` True additionally accepts x_i (lossy).

    ``probs`` gives warp(target_logits[i], params) if the caller already has some rows.
    """
    if params.greedy:
        return greedy_round(target_logits, draft_tokens, force)
    k = len(draft_tokens)
    p = WarpedRows(target_logits, params) if probs is None else probs
    vocab = target_logits.shape[-1]

    if draft_probs is None:
        # Deterministic drafter, q_i one-hot at x_i. Sample t_i ~ p_i with the draw plain decoding would use
        # at that position; accept iff t_i == x_i (probability p_i(x_i)). At the first mismatch t_i is
        # distributed as p_i without x_i, renormalised: the one-hot residual. Same seed => same output as
        # plain sampling.
        for i, x in enumerate(draft_tokens):
            t = sample_at(p[i], rng.uniform(position + i))
            if t != x and not (force is not None and force(i)):
                return AcceptResult(tokens=list(draft_tokens[:i]) + [t], accepted=i)  # recovered
        bonus = sample_at(p[k], rng.uniform(position + k))
        return AcceptResult(tokens=list(draft_tokens) + [bonus], accepted=k)

    # Drafter with q: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) (reject if q_i(x_i) == 0); at
    # the first rejection sample from norm(max(0, p_i - q_i)); all accepted: bonus from p_{k+1}.
    for i, x in enumerate(draft_tokens):
        if force is not None and force(i):
            continue
        if 0 <= x < vocab:
            qx = float(draft_probs[i, x].to(torch.float32))  # python floats: float64 arithmetic below
            if qx > 0.0 and rng.uniform_aux(position + i) * qx <= float(p[i][x]):
                continue  # u <= p/q
        q = draft_probs[i].to(device=p[i].device, dtype=torch.float32)
        residual = torch.clamp(p[i] - q, min=0.0)
        if not float(residual.sum()) > 0.0:
            residual = p[i]
        recovered = sample_at(residual, rng.uniform(position + i))
        return AcceptResult(tokens=list(draft_tokens[:i]) + [recovered], accepted=i)
    bonus = sample_at(p[k], rng.uniform(position + k))
    return AcceptResult(tokens=list(draft_tokens) + [bonus], accepted=k)


class SampledAcceptor:
    """Speculative sampling: the emitted sequence is distributed exactly as plain sampling from the target.

    With a deterministic drafter (no q) it uses the one-hot rule with the same per-position draws as plain
    decoding, so the output is identical to plain sampling with the same seed.
    """

    lossless = True
    needs_draft_probs = False

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
        return sampled_round(target_logits, draft_tokens, draft_probs, params, rng, position)

    def __repr__(self) -> str:
        return "SampledAcceptor()"



@hookimpl
def register_acceptors(register):
    register("sampled", SampledAcceptor, options={})
