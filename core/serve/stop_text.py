"""Stop strings, matched on decoded text as it streams.

Text that could be the start of a stop string is held back until the next tokens settle it, so a streamed
response never sends text that the finished one would have cut: the pieces `take` returns always
concatenate to the non-streamed text.
"""

from __future__ import annotations


class StopText:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0  # text[:sent] has been handed out
        self.stopped = False

    def feed(self, piece: str) -> None:
        if not self.stopped:
            self.text += piece

    def take(self, final: bool = False) -> str:
        """The text that is now certain; after a stop string is seen, `stopped` is set and the text ends
        just before it."""
        if self.stopped:
            return ""
        # every occurrence that begins before `sent` would have been seen or held back earlier
        hits = [i for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if hits:
            end, self.stopped = min(hits), True
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held()
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def _held(self) -> int:
        """Length of the longest tail of the unsent text that is a proper prefix of a stop string."""
        unsent = len(self.text) - self.sent
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, unsent), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best
