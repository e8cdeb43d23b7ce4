"""The `suffix` drafter: propose what followed the longest matching suffix, in this request or an earlier one.

Two indexes map every n-gram (min_match <= n <= max_depth) to where it was last followed by a token: one
over the current request's tokens, kept up to date incrementally, and one over the requests this drafter
served before (it lives as long as the runner, which is reused across generations). The longest match
wins; on equal length the current request wins, being the more specific evidence. A round costs at most
max_depth dictionary look-ups, however much history there is.

Rollback needs no work: the runner only ever passes accepted tokens in `tokens`, and the current index is
rebuilt whenever `tokens` stops being an extension of what was indexed.
"""

from __future__ import annotations

from outrider.api import ConfigError, Draft, DraftControls, DrafterBase, SamplingParams


def _index_ngrams(index: dict[tuple[int, ...], tuple[int, int]], seq: list[int], seq_id: int, start: int,
                  min_n: int, max_n: int) -> None:
    """Map each n-gram ending at i - 1 (i >= start) to (seq_id, i), the position of its continuation."""
    for i in range(max(start, 1), len(seq)):
        for n in range(min_n, min(max_n, i) + 1):
            index[tuple(seq[i - n:i])] = (seq_id, i)


class SuffixDrafter(DrafterBase):
    """Deterministic (gives no draft probabilities); learns from every request it sees."""

    def __init__(self, max_depth: int = 8, min_match: int = 2, max_history_tokens: int = 1_000_000):
        if not 1 <= min_match <= max_depth:
            raise ConfigError(f"suffix drafter needs 1 <= min_match <= max_depth, got min_match={min_match} "
                              f"max_depth={max_depth}")
        if max_history_tokens < 0:
            raise ConfigError(f"max_history_tokens must be >= 0, got {max_history_tokens}")
        self.max_depth, self.min_match, self.max_history_tokens = max_depth, min_match, max_history_tokens
        self.history: list[list[int]] = []  # earlier requests, oldest first
        self._history_index: dict[tuple[int, ...], tuple[int, int]] = {}
        self._reset_current()

    def _reset_current(self) -> None:
        self._seen: list[int] = []
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}

    def begin(self, prompt: list[int], params: SamplingParams, controls: DraftControls) -> None:
        super().begin(prompt, params, controls)
        self.remember(self._seen)
        self._reset_current()

    def remember(self, tokens: list[int]) -> None:
        """Add a finished request (prompt + output) to the history; the runner's requests are added at `begin`."""
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

    def _extend_current(self, tokens: list[int]) -> None:
        if tokens[:len(self._seen)] != self._seen:  # not an extension of what we indexed: start over
            self._reset_current()
        _index_ngrams(self._index, tokens, -1, len(self._seen), self.min_match, self.max_depth)
        self._seen = list(tokens)

    def propose(self, tokens: list[int], k: int) -> Draft:
        if k <= 0 or not tokens:
            return Draft()
        self._extend_current(tokens)
        for n in range(min(self.max_depth, len(tokens)), self.min_match - 1, -1):
            key = tuple(tokens[-n:])
            for index in (self._index, self._history_index):
                hit = index.get(key)
                if hit is not None:
                    seq_id, start = hit
                    seq = tokens if seq_id < 0 else self.history[seq_id]
                    return Draft(list(seq[start:start + k]))
        return Draft()
