"""Built-in acceptors. Each module exposes NAME, DESCRIPTION, OPTIONS ({name: (type, default, help)}) and
ACCEPTOR (the class, constructed with the options as keyword arguments)."""

from . import greedy, pmin, sampled
from .greedy import GreedyAcceptor
from .pmin import PMinAcceptor
from .sampled import SampledAcceptor

BUILTIN = {m.NAME: m for m in (greedy, sampled, pmin)}

__all__ = ["GreedyAcceptor", "SampledAcceptor", "PMinAcceptor", "BUILTIN"]
