"""The `none` drafter: proposes nothing, so every round is one plain decoding step."""

from __future__ import annotations

from outrider.hookspecs import hookimpl
from outrider.spec.drafter import Draft, DrafterBase, DraftKind, DraftState


class NoDrafter(DrafterBase):
    def draft_kind(self, state: DraftState, tokens: list[int]) -> DraftKind | None:
        return None  # so the runner does not weigh draft lengths every round

    def propose(self, state: DraftState, tokens: list[int], k: int) -> Draft:
        return Draft()


@hookimpl
def register_drafters(register):
    register("none", NoDrafter, aliases=("plain",))
