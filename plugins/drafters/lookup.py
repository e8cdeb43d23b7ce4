"""The `lookup` drafter (prompt lookup / n-gram): find the longest recent n-gram that matches the end
of the sequence earlier in prompt + output, and propose what followed it there.

An index from each n-gram to the position after its most recent occurrence is kept up to date
incrementally in each sequence's state, so a round costs O(max_n) dictionary look-ups however long the
context is.
Only accepted tokens ever enter `tokens`, so rollback needs no work.

The kind of a round's draft (`draft_kind`) is the length n of the matched n-gram: a longer match is
much more often right. On the bench's prompts (both real models, greedy and sampled) the first drafted
token was accepted after 15-56% of 2-gram matches in open text, and after 92-98% of 4-gram matches in
text that quotes its context. `--draft-max auto` learns each length's acceptance apart, starting from
the prior 0.2 n (at most 0.8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from outrider.errors import ConfigError
from outrider.hookspecs import hookimpl
from outrider.spec.drafter import Draft, DrafterBase, DraftKind, DraftState


@dataclass
class LookupState(DraftState):
    seen: list[int] = field(default_factory=list)  # the tokens indexed so far
    index: dict[tuple[int, ...], int] = field(default_factory=dict)


class LookupDrafter(DrafterBase):
    State = LookupState

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"lookup drafter needs 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._kinds = {n: DraftKind(f"{n}-gram", round(min(0.2 * n, 0.8), 2)) for n in range(min_n, max_n + 1)}

    def rollback(self, state: LookupState, length: int) -> None:
        if length < len(state.seen):  # tokens it indexed are gone (the runner never does this)
            state.seen, state.index = [], {}

    def _extend_index(self, state: LookupState, tokens: list[int]) -> None:
        seen = len(state.seen)
        # Called twice a round: checking the whole prefix would cost O(context). Rollback resets on a
        # shorter context; this catches a caller that skipped it.
        if seen and (len(tokens) < seen or tokens[seen - 1] != state.seen[-1] or tokens[0] != state.seen[0]):
            state.seen, state.index = [], {}
            seen = 0
        # An n-gram ending at i - 1 maps to its continuation position i; the last token has none yet.
        for i in range(max(seen, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, i) + 1):
                state.index[tuple(tokens[i - n:i])] = i
        state.seen.extend(tokens[seen:])

    def _match(self, state: LookupState, tokens: list[int]) -> tuple[int, int] | None:
        """(n, start): the longest n-gram ending `tokens` seen before, and where its continuation starts."""
        self._extend_index(state, tokens)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = state.index.get(tuple(tokens[-n:]))
            if start is not None:
                return n, start
        return None

    def draft_kind(self, state: LookupState, tokens: list[int]) -> DraftKind | None:
        match = self._match(state, tokens) if tokens else None
        return None if match is None else self._kinds[match[0]]

    def propose(self, state: LookupState, tokens: list[int], k: int) -> Draft:
        match = self._match(state, tokens) if k > 0 and tokens else None
        return Draft() if match is None else Draft(tokens[match[1]:match[1] + k])


@hookimpl
def register_drafters(register):
    register("lookup", LookupDrafter, aliases=("ngram", "prompt-lookup"), options={
        "min_n": (int, "shortest n-gram that may match (1-gram matches are mostly wrong in open text)"),
        "max_n": (int, "longest n-gram tried first"),
    })
