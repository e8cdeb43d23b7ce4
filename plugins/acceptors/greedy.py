"""The ``greedy`` acceptor: keep drafted tokens while they equal the target's argmax (lossless at T=0)."""

from __future__ import annotations

from outrider.hookspecs import hookimpl
from outrider.spec.acceptance import AcceptResult, VerifyRound, greedy_round


class GreedyAcceptor:
    """Accept x_i iff it is the target's argmax; emit the argmax at the first mismatch, or the bonus argmax.

    Output is token-for-token the target's greedy decoding. It ignores the temperature.
    """

    lossless = True
    needs_draft_probs = False
    greedy_only = True  # lossless at temperature 0 only

    def accept(self, verify: VerifyRound) -> AcceptResult:
        return greedy_round(verify)

    def __repr__(self) -> str:
        return "GreedyAcceptor()"


@hookimpl
def register_acceptors(register):
    register("greedy", GreedyAcceptor, options={})
