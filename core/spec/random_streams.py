"""Position-coupled random streams: one U[0,1) draw per absolute sequence position and purpose, from one
seed, so that a token drawn at position n is the same draw whether plain decoding or a verify round makes
it (docs/acceptance.md)."""

from __future__ import annotations

import secrets

import numpy as np

from outrider.errors import ConfigError

__all__ = ["PositionRandom"]



class _Stream:
    """U[0,1) draws from one numpy Generator, indexed by position, generated lazily in chunks."""

    __slots__ = ("_rng", "_chunks", "_chunk")

    def __init__(self, seed_material, chunk: int) -> None:
        self._rng = np.random.default_rng(seed_material)
        self._chunks: list[np.ndarray] = []
        self._chunk = chunk

    def __call__(self, pos: int) -> float:
        if pos < 0:
            raise ValueError(f"position must be >= 0, got {pos}")
        c, off = divmod(pos, self._chunk)
        while len(self._chunks) <= c:
            self._chunks.append(self._rng.random(self._chunk))
        return float(self._chunks[c][off])


class PositionRandom:
    """Deterministic U[0,1) draws, one per absolute sequence position, from a single seed.

    ``uniform(pos)`` is draw number ``pos`` of ``numpy.random.default_rng(seed).random(...)``; it is what
    plain decoding and the emitted/recovered/bonus tokens of the acceptors use. ``uniform_aux(pos)`` is an
    independent stream (``default_rng([seed, 1])``) for the Leviathan acceptance test. ``uniform_draft(pos)``
    is a third independent stream (``default_rng([seed, 2])``) for drafters that sample (the built-in ones draw
    through ``outrider.spec.drafter.draft_loop``): a drafter must NOT sample its proposals with
    ``uniform``/``uniform_aux``, or the guarantee of the acceptance rule is lost.
    Draws do not depend on the order in which positions are asked for.
    """

    CHUNK = 1024

    def __init__(self, seed: int | None = None) -> None:
        if seed is None:
            seed = secrets.randbits(32)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
        self.seed = int(seed)
        self._main = _Stream(self.seed, self.CHUNK)
        self._aux: _Stream | None = None
        self._draft: _Stream | None = None

    def uniform(self, pos: int) -> float:
        return self._main(pos)

    def uniform_aux(self, pos: int) -> float:
        if self._aux is None:
            self._aux = _Stream([self.seed, 1], self.CHUNK)
        return self._aux(pos)

    def uniform_draft(self, pos: int) -> float:
        if self._draft is None:
            self._draft = _Stream([self.seed, 2], self.CHUNK)
        return self._draft(pos)

    def __repr__(self) -> str:
        return f"PositionRandom(seed={self.seed})"
