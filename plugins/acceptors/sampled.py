"""The ``sampled`` acceptor: speculative sampling (Leviathan et al. 2023, Chen et al. 2023), lossless at any
temperature. At temperature 0 it is exactly the ``greedy`` acceptor."""

from __future__ import annotations

import torch

from outrider.hookspecs import hookimpl
from outrider.sampling import AcceptResult, PositionRandom, SamplingParams, sample_at, sample_rows, warp

from .greedy import check_round, greedy_round


def draft_rows(draft_tokens: list[int], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids clamped into [0, V), mask of the ids that were in range) for gathering p_i(x_i)."""
    xs = torch.tensor(draft_tokens, dtype=torch.long, device=device)
    valid = (xs >= 0) & (xs < vocab)
    return xs.clamp(0, vocab - 1), valid


def sampled_round(
    target_logits: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    rng: PositionRandom,
    position: int,
    probs: torch.Tensor | None = None,
    force: torch.Tensor | None = None,
) -> AcceptResult:
    """One verify round by the lossless rule; ``force[i]`` (bool [k]) additionally accepts x_i (lossy).

    ``probs`` is warp(target_logits, params) if the caller already has it.
    """
    if params.greedy:
        return greedy_round(target_logits, draft_tokens, force)
    k = len(draft_tokens)
    p = warp(target_logits, params) if probs is None else probs
    vocab = p.shape[-1]

    if draft_probs is None:
        # Deterministic drafter, q_i one-hot at x_i. Sample t_i ~ p_i with the draw plain decoding would use
        # at that position; accept iff t_i == x_i (probability p_i(x_i)). At the first mismatch t_i is
        # distributed as p_i without x_i, renormalised: the one-hot residual. Same seed => same output as
        # plain sampling.
        us = [rng.uniform(position + i) for i in range(k + 1)]
        t = sample_rows(p, us)  # every row at once; rows past the first rejection are not used
        ok = [t[i] == x for i, x in enumerate(draft_tokens)]
        if force is not None:
            ok = [a or b for a, b in zip(ok, force.tolist())]
        n = k
        for i, a in enumerate(ok):
            if not a:
                n = i
                break
        return AcceptResult(tokens=list(draft_tokens[:n]) + [t[n]], accepted=n)

    # Drafter with q: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) (reject if q_i(x_i) == 0); at
    # the first rejection sample from norm(max(0, p_i - q_i)); all accepted: bonus from p_{k+1}.
    n = k
    if k:
        q = draft_probs.to(device=p.device, dtype=torch.float32)
        valid = [0 <= x < vocab for x in draft_tokens]
        idx = torch.tensor([x if v else 0 for x, v in zip(draft_tokens, valid)], device=p.device).unsqueeze(1)
        px = p[:k].gather(1, idx).squeeze(1).tolist()  # python floats: float64 arithmetic below
        qx = q.gather(1, idx).squeeze(1).tolist()
        forced = force.tolist() if force is not None else [False] * k
        for i in range(k):
            if forced[i]:
                continue
            if valid[i] and qx[i] > 0.0 and rng.uniform_aux(position + i) * qx[i] <= px[i]:
                continue  # u <= p/q
            n = i
            break
    if n < k:
        residual = torch.clamp(p[n] - q[n], min=0.0)
        if not float(residual.sum()) > 0.0:
            residual = p[n]
        tok = sample_at(residual, rng.uniform(position + n))
    else:
        tok = sample_at(p[k], rng.uniform(position + k))
    return AcceptResult(tokens=list(draft_tokens[:n]) + [tok], accepted=n)


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
