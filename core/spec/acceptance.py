"""One verify round and the acceptor protocol: what an acceptor decides over, what it returns, and the
lossless rules built-in and third-party acceptors share.

A round is one target forward over [t0, x1..xk]: row i of its logits is the target's p_{i+1}, the
distribution at the position where draft x_{i+1} stands (row k: the bonus position after x_k). The acceptor
keeps a prefix of the drafts and emits one more token: the *recovered* token where the first rejected draft
stood, or the *bonus* token when every draft was kept. The rules (docs/acceptance.md,
restated): at temperature 0 keep x_i while it is the argmax of p_i; above
it, with a deterministic drafter keep x_i iff the token sampled from p_i with the position's own draw
(``rng.uniform(pos)``) is x_i, and with a drafter that gives q keep x_i with probability
min(1, p_i(x_i) / q_i(x_i)) (``rng.uniform_aux(pos)``), recovering from norm(max(0, p_i - q_i)).

Modelled on vLLM's SpecDecodeMetadata: one object instead of six positional arguments, so a new field
(tree drafts, a batch) does not change every acceptor's signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from outrider.errors import ConfigError
from outrider.spec.random_streams import PositionRandom
from outrider.spec.sampling import SamplingParams, argmax_token, sample_at, sample_logits, warp

__all__ = ["VerifyRound", "AcceptResult", "Acceptor", "greedy_round", "sampled_round"]


@dataclass
class AcceptResult:
    """What one verify round emits."""

    tokens: list[int]  # accepted drafts, then one recovered or bonus token
    accepted: int  # number of drafted tokens kept (0..k); len(tokens) == accepted + 1


@dataclass(frozen=True)
class VerifyRound:
    """Everything an acceptor decides over, for one round of one sequence. Shapes are checked on creation."""

    # [k+1, V] logits p_1..p_{k+1} (float32, CPU from the runner), after the params' repeat/presence/frequency
    # penalties, row i's counting x_1..x_i (outrider.spec.penalties); the model's own when the params set none
    target_logits: torch.Tensor
    draft_tokens: list[int]  # x1..xk (may be empty: then one token from p_1; ids may be out of range)
    draft_probs: torch.Tensor | None  # [k, V] warped q_i, or None = deterministic drafter
    params: SamplingParams
    rng: PositionRandom
    position: int  # absolute position of x1 (the token row 0 predicts); row i is position + i
    _warped: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        k = len(self.draft_tokens)
        logits = self.target_logits
        if logits.dim() == 1:
            logits = logits.unsqueeze(0)
            object.__setattr__(self, "target_logits", logits)
        if logits.dim() != 2 or logits.shape[0] != k + 1:
            raise ValueError(f"target_logits must be [k+1, V] = [{k + 1}, V] for {k} drafted tokens, "
                             f"got shape {tuple(self.target_logits.shape)}")
        if self.draft_probs is not None and tuple(self.draft_probs.shape) != (k, logits.shape[1]):
            raise ValueError(f"draft_probs must be [k, V] = [{k}, {logits.shape[1]}], "
                             f"got shape {tuple(self.draft_probs.shape)}")

    @property
    def k(self) -> int:
        return len(self.draft_tokens)

    @property
    def vocab(self) -> int:
        return self.target_logits.shape[-1]

    def in_vocabulary(self, i: int) -> bool:
        """Whether draft x_{i+1} is a token id of this vocabulary (a misbehaving drafter may give others)."""
        return 0 <= self.draft_tokens[i] < self.vocab

    def target_probs(self, i: int) -> torch.Tensor:
        """warp(target_logits[i], params), warped on first use: a round pays for the rows up to its first
        rejection, not for all k + 1 (a row warps to the same bits alone as in a batch)."""
        row = self._warped.get(i)
        if row is None:
            row = self._warped[i] = warp(self.target_logits[i], self.params)
        return row

    def sample_target(self, i: int, u: float) -> int:
        """``sample_at(target_probs(i), u)``: row i's token for the draw u, found without warping the row
        (`sample_logits`); every round and plain decoding draw through it, so they agree token for token."""
        return sample_logits(self.target_logits[i], self.params, u)

    def recovered(self, i: int, token: int) -> AcceptResult:
        """Draft x_{i+1} was rejected: keep x_1..x_i, then the recovered token in its place."""
        return AcceptResult(tokens=[*self.draft_tokens[:i], int(token)], accepted=i)

    def bonus(self, token: int) -> AcceptResult:
        """Every draft was kept: all of them, then the bonus token from the last row."""
        return AcceptResult(tokens=[*self.draft_tokens, int(token)], accepted=self.k)


@runtime_checkable
class Acceptor(Protocol):
    """Decides which drafted tokens to keep, given ONE target forward over [t0, x1..xk]."""

    lossless: bool
    needs_draft_probs: bool  # True if it only works when the drafter gives q

    def accept(self, verify: VerifyRound) -> AcceptResult: ...


# ------------------------------------------------------------------------------------------------------
# The lossless rules. ``force(i)`` True also keeps x_{i+1} (a lossy acceptor's extra rule, e.g. p-min).


def greedy_round(verify: VerifyRound, force: Callable[[int], bool] | None = None) -> AcceptResult:
    """Keep x_i while it is the argmax of p_i; recovered and bonus tokens are the argmax. Rows after the
    first rejection are never looked at."""
    for i, x in enumerate(verify.draft_tokens):
        top = argmax_token(verify.target_logits[i])
        if top != x and not (force is not None and force(i)):
            return verify.recovered(i, top)
    return verify.bonus(argmax_token(verify.target_logits[verify.k]))


def sampled_round(verify: VerifyRound, force: Callable[[int], bool] | None = None) -> AcceptResult:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): the emitted tokens are distributed
    as plain sampling from warp(p); at temperature 0 it is :func:`greedy_round`."""
    if verify.params.greedy:
        return greedy_round(verify, force)
    p, rng, pos = verify.target_probs, verify.rng, verify.position
    if verify.draft_probs is None:
        # Deterministic drafter, q_i one-hot at x_i. Sample t_i ~ p_i with the draw plain decoding would use
        # at that position; keep x_i iff t_i == x_i (probability p_i(x_i)). At the first mismatch t_i is
        # distributed as p_i without x_i, renormalised: the one-hot residual. Same seed => same output as
        # plain sampling.
        for i, x in enumerate(verify.draft_tokens):
            t = verify.sample_target(i, rng.uniform(pos + i))
            if t != x and not (force is not None and force(i)):
                return verify.recovered(i, t)
        return verify.bonus(verify.sample_target(verify.k, rng.uniform(pos + verify.k)))

    # Drafter with q: keep x_i with probability min(1, p_i(x_i) / q_i(x_i)) (reject if q_i(x_i) == 0); at
    # the first rejection sample from norm(max(0, p_i - q_i)); all kept: the bonus from p_{k+1}.
    for i, x in enumerate(verify.draft_tokens):
        if force is not None and force(i):
            continue
        if verify.in_vocabulary(i):
            qx = float(verify.draft_probs[i, x].to(torch.float32))  # python floats: float64 arithmetic below
            if qx > 0.0 and rng.uniform_aux(pos + i) * qx <= float(p(i)[x]):
                continue  # u <= p/q
        q = verify.draft_probs[i].to(device=p(i).device, dtype=torch.float32)
        residual = torch.clamp(p(i) - q, min=0.0)
        if not float(residual.sum()) > 0.0:
            residual = p(i)
        return verify.recovered(i, sample_at(residual, rng.uniform(pos + i)))
    return verify.bonus(verify.sample_target(verify.k, rng.uniform(pos + verify.k)))


def takes_several_arguments(acceptor: Any) -> bool:
    """Whether ``acceptor.accept`` needs more than the one VerifyRound."""
    try:
        parameters = inspect.signature(acceptor.accept).parameters.values()
    except (TypeError, ValueError):  # a callable whose signature cannot be read: assume the current form
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in positional and p.default is p.empty) > 1


def as_acceptor(acceptor: Any) -> Any:
    """The acceptor itself; one whose ``accept`` takes several arguments is refused in one line that names
    the fix, before any round (it would fail there with a TypeError)."""
    if takes_several_arguments(acceptor):
        raise ConfigError(f"{type(acceptor).__name__}.accept takes several arguments; an acceptor takes one "
                          "outrider.spec.acceptance.VerifyRound: write accept(self, verify) (see docs/plugins.md)")
    return acceptor
