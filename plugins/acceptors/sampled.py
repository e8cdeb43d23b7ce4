"""The ``sampled`` acceptor: speculative sampling (Leviathan et al. 2023, Chen et al. 2023), lossless at any
temperature. At temperature 0 it is exactly the ``greedy`` acceptor."""

from __future__ import annotations

from outrider.hookspecs import hookimpl
from outrider.spec.acceptance import AcceptResult, VerifyRound, sampled_round


class SampledAcceptor:
    """Speculative sampling: the emitted sequence is distributed exactly as plain sampling from the target.

    With a deterministic drafter (no q) it uses the one-hot rule with the same per-position draws as plain
    decoding, so the output is identical to plain sampling with the same seed.
    """

    lossless = True
    needs_draft_probs = False

    def accept(self, verify: VerifyRound) -> AcceptResult:
        return sampled_round(verify)

    def __repr__(self) -> str:
        return "SampledAcceptor()"


@hookimpl
def register_acceptors(register):
    register("sampled", SampledAcceptor, options={})
