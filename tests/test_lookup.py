"""The lookup drafter on hand-checked sequences: what it proposes, and the kind of draft it names."""

from __future__ import annotations

from outrider.plugins.drafters.lookup import LookupDrafter
from outrider.spec.drafter import DraftControls, DraftKind
from outrider.spec.sampling import SamplingParams


def _begun(d):
    return d.begin([], SamplingParams(), DraftControls())


def test_the_longest_earlier_match_gives_the_draft_and_its_length_the_kind():
    d = LookupDrafter(min_n=2, max_n=4)
    s = _begun(d)
    # ends with 8 2 3 4: no earlier 8 2 3 4, but 2 3 4 (positions 1-3), followed by 5 8 2
    tokens = [1, 2, 3, 4, 5, 8, 2, 3, 4]
    assert d.draft_kind(s, tokens) == DraftKind("3-gram", 0.6)
    assert d.propose(s, tokens, 3).tokens == [5, 8, 2]
    # ends with 1 5 6: only 5 6 was seen before, followed by 7
    tokens = [5, 6, 7, 1, 5, 6]
    assert d.draft_kind(s, tokens) == DraftKind("2-gram", 0.4)
    assert d.propose(s, tokens, 4).tokens == [7, 1, 5, 6]
    # a 4-gram match: the prior is capped at 0.8
    tokens = [9, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert d.draft_kind(s, tokens) == DraftKind("4-gram", 0.8)


def test_no_match_is_no_kind_and_no_draft():
    d = LookupDrafter(min_n=2, max_n=4)
    s = _begun(d)
    for tokens in ([], [4], [1, 2, 3], [1, 2, 1, 3]):
        assert d.draft_kind(s, tokens) is None
        assert d.propose(s, tokens, 4).tokens == []
