"""The `lookup` drafter (prompt lookup / n-gram): find the longest recent n-gram that matches the end
of the sequence earlier in prompt + output, and propose what followed it there.

An index from each n-gram to the position after its most recent occurrence is kept up to date
incrementally, so a round costs O(max_n) dictionary look-ups however long the context is.
Only accepted tokens ever enter `tokens`, so rollback needs no work.
"""

from __future__ import annotations

from outrider.drafting import Draft, DrafterBase, DraftControls
from outrider.errors import ConfigError
from outrider.hookspecs import hookimpl
from outrider.sampling import SamplingParams


class LookupDrafter(DrafterBase):
    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"lookup drafter needs 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._reset()

    def _reset(self) -> None:
        self._seen: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}

    def begin(self, prompt: list[int], params: SamplingParams, controls: DraftControls) -> None:
        super().begin(prompt, params, controls)
        self._reset()

    def _extend_index(self, tokens: list[int]) -> None:
        if tokens[:len(self._seen)] != self._seen:  # not an extension of what we indexed: start over
            self._reset()
        # An n-gram ending at i - 1 maps to its continuation position i; the last token has none yet.
        for i in range(max(len(self._seen), 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._index[tuple(tokens[i - n:i])] = i
        self._seen = list(tokens)

    def propose(self, tokens: list[int], k: int) -> Draft:
        if k <= 0 or not tokens:
            return Draft()
        self._extend_index(tokens)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self._index.get(tuple(tokens[-n:]))
            if start is not None:
                return Draft(tokens[start:start + k])
        return Draft()


@hookimpl
def register_drafters(register):
    register("lookup", LookupDrafter, aliases=("ngram", "prompt-lookup"), options={
        "min_n": (int, 2, "shortest n-gram that may match (1-gram matches are mostly wrong in open text)"),
        "max_n": (int, 4, "longest n-gram tried first"),
    })
