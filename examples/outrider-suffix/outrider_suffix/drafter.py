"""The `suffix` drafter: propose what followed the longest matching suffix, in this request or an earlier one.

Two kinds of index map every n-gram (min_match <= n <= max_depth) to where it was last followed by a token:
one per sequence, over that request's own tokens, kept up to date incrementally in its `SuffixState`; and one
on the drafter, over the requests it served before (the drafter lives as long as the runner, which is reused
across generations and drafts for several sequences at once). The longest match wins; on equal length the
current request wins, being the more specific evidence. A round costs at most max_depth dictionary look-ups,
however much history there is.

What a sequence sees stays in its state, so interleaved sequences each get the drafts they would get alone;
only `end` changes what they share, by adding the finished request to the history. Rollback needs no work
in practice: the runner only ever passes accepted tokens in `tokens`, and a sequence's index is rebuilt
whenever `tokens` stops being an extension of what it indexed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from outrider.api import ConfigError, Draft, DrafterBase, DraftState

# an n-gram -> (sequence id, position of its continuation); the id is -1 for the current request
NgramIndex = dict[tuple[int, ...], tuple[int, int]]


def _index_ngrams(index: NgramIndex, seq: list[int], seq_id: int, start: int, min_n: int, max_n: int) -> None:
    """Map each n-gram ending at i - 1 (i >= start) to (seq_id, i), the position of its continuation."""
    for i in range(max(start, 1), len(seq)):
        for n in range(min_n, min(max_n, i) + 1):
            index[tuple(seq[i - n:i])] = (seq_id, i)


@dataclass
class SuffixState(DraftState):
    """One request: the tokens it has shown the drafter so far, and their n-gram index."""

    seen: list[int] = field(default_factory=list)
    index: NgramIndex = field(default_factory=dict)


class SuffixDrafter(DrafterBase):
    """Deterministic (gives no draft probabilities); learns from every request it sees to its end."""

    State = SuffixState  # what DrafterBase.begin makes for each request: nothing seen yet

    def __init__(self, max_depth: int = 8, min_match: int = 2, max_history_tokens: int = 1_000_000):
        if not 1 <= min_match <= max_depth:
            raise ConfigError(f"suffix drafter needs 1 <= min_match <= max_depth, got min_match={min_match} "
                              f"max_depth={max_depth}")
        if max_history_tokens < 0:
            raise ConfigError(f"max_history_tokens must be >= 0, got {max_history_tokens}")
        self.max_depth, self.min_match, self.max_history_tokens = max_depth, min_match, max_history_tokens
        self.history: list[list[int]] = []  # earlier requests, oldest first
        self._history_index: NgramIndex = {}

    def end(self, state: SuffixState) -> None:
        """The request is done: what it showed the drafter becomes history for the requests after it."""
        self.remember(state.seen)
        state.seen, state.index = [], {}

    def remember(self, tokens: list[int]) -> None:
        """Add a finished request (prompt + output) to the history; the runner's requests are added at `end`."""
        if len(tokens) < 2 or self.max_history_tokens == 0:
            return
        self.history.append(list(tokens[-self.max_history_tokens:]))
        total = sum(map(len, self.history))
        if total > self.max_history_tokens:
            while total > self.max_history_tokens:
                total -= len(self.history.pop(0))
            self._history_index = {}
            for seq_id, seq in enumerate(self.history):
                _index_ngrams(self._history_index, seq, seq_id, 0, self.min_match, self.max_depth)
        else:
            _index_ngrams(self._history_index, self.history[-1], len(self.history) - 1, 0, self.min_match,
                          self.max_depth)

    def rollback(self, state: SuffixState, length: int) -> None:
        if length < len(state.seen):  # tokens it indexed are gone (the runner never does this): keep the rest
            state.seen, state.index = state.seen[:length], {}
            _index_ngrams(state.index, state.seen, -1, 0, self.min_match, self.max_depth)

    def _extend_current(self, state: SuffixState, tokens: list[int]) -> None:
        if tokens[:len(state.seen)] != state.seen:  # not an extension of what it indexed: start over
            state.seen, state.index = [], {}
        _index_ngrams(state.index, tokens, -1, len(state.seen), self.min_match, self.max_depth)
        state.seen = list(tokens)

    def propose(self, state: SuffixState, tokens: list[int], k: int) -> Draft:
        if k <= 0 or not tokens:
            return Draft()
        self._extend_current(state, tokens)
        for n in range(min(self.max_depth, len(tokens)), self.min_match - 1, -1):
            key = tuple(tokens[-n:])
            for index in (state.index, self._history_index):
                hit = index.get(key)
                if hit is not None:
                    seq_id, start = hit
                    seq = tokens if seq_id < 0 else self.history[seq_id]
                    return Draft(list(seq[start:start + k]))
        return Draft()
