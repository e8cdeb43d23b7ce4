"""outrider-suffix: the `suffix` drafter, registered through the `outrider` entry-point group."""

from __future__ import annotations

from outrider.api import hookimpl

from .drafter import SuffixDrafter, SuffixState

__all__ = ["SuffixDrafter", "SuffixState", "register_drafters"]


@hookimpl
def register_drafters(register):
    register("suffix", SuffixDrafter, aliases=("suffix-cache",), options={
        "max_depth": (int, "longest suffix matched (tokens); longer matches are tried first"),
        "min_match": (int, "shortest suffix that may match; 1 drafts more often but more wrongly"),
        "max_history_tokens": (int, "tokens of earlier requests remembered; oldest dropped first"),
    })
