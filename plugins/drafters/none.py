"""The `none` drafter: proposes nothing, so every round is one plain decoding step."""

from __future__ import annotations

from outrider.drafting import Draft, DrafterBase
from outrider.hookspecs import hookimpl


class NoDrafter(DrafterBase):
    def propose(self, tokens: list[int], k: int) -> Draft:
        return Draft()


@hookimpl
def register_drafters(register):
    register("none", NoDrafter, aliases=("plain",))
