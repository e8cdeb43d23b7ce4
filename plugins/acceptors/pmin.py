"""The ``p-min`` acceptor: a verify-side probability threshold (SharpInference's MTP ``pMin``). LOSSY.

Accept x_i when the lossless rule would accept it OR p_i(x_i) >= p_min, where p_i is the target's warped
distribution (at temperature 0: softmax of the raw logits at T=1). The output can differ from the target
alone. Not to be confused with the drafter-side stop ``--draft-p-min``, which is lossless: it ends a draft
where the drafter's largest probability is below the threshold, before that position's token is drawn
(``outrider.spec.drafter.draft_loop``).
"""

from __future__ import annotations

import math

import torch

from outrider.errors import ConfigError
from outrider.hookspecs import hookimpl
from outrider.spec.acceptance import AcceptResult, VerifyRound, sampled_round


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

    def accept(self, verify: VerifyRound) -> AcceptResult:
        def force(i: int) -> bool:
            if not verify.in_vocabulary(i):
                return False
            if verify.params.greedy:  # the threshold is then on the softmax of the raw logits (T = 1)
                row = torch.softmax(verify.target_logits[i].to(torch.float32), dim=-1)
            else:
                row = verify.target_probs(i)
            p = row[verify.draft_tokens[i]]
            return bool(p > 0 and p >= self.p_min)  # at p_min 0, still never a token the warped law forbids

        return sampled_round(verify, force)

    def __repr__(self) -> str:
        return f"PMinAcceptor(p_min={self.p_min})"



@hookimpl
def register_acceptors(register):
    register("p-min", PMinAcceptor, options={"p_min": (float, "accept a drafted token when the target gives it at least this probability")})
