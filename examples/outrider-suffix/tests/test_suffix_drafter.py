"""The suffix drafter: Outrider's plugin contract (subclassed from outrider.testing), plus its own behaviour."""

from __future__ import annotations

import pytest

pytest.importorskip("outrider_suffix", reason="outrider-suffix is not installed (pip install -e examples/outrider-suffix)")

from outrider_suffix import SuffixDrafter  # noqa: E402

from outrider.api import ConfigError, DraftControls, DrafterContract, SamplingParams  # noqa: E402


class TestSuffixContract(DrafterContract):
    """Every contract check, on the drafter as registered (found through the entry point)."""

    plugin_name = "suffix"


class TestSuffixContractMatchingSingleTokens(DrafterContract):
    """And with the most aggressive options, which draft the most (and the most wrongly)."""

    def make_drafter(self):
        return SuffixDrafter(max_depth=3, min_match=1)


def _begin(drafter, prompt):
    return drafter.begin(prompt, SamplingParams(), DraftControls())


def test_longest_match_in_the_current_request():
    d = SuffixDrafter(max_depth=4, min_match=1)
    s = _begin(d, [])
    # [3, 4] occurs twice: followed by 9 after [1, 3, 4], by 5 after [2, 3, 4]; the longer suffix [2, 3, 4] wins
    assert d.propose(s, [1, 3, 4, 9, 2, 3, 4, 5, 6, 0, 2, 3, 4], 3).tokens == [5, 6, 0]
    assert d.propose(s, [1, 3, 4, 9, 2, 3, 4, 5, 6, 0, 2, 3, 4], 1).tokens == [5]


def test_remembers_earlier_requests():
    d = SuffixDrafter()
    s1 = _begin(d, [10, 11, 12])
    d.propose(s1, [10, 11, 12, 13, 14, 15, 16], 4)  # the first request ends with these tokens
    d.end(s1)  # done: it is now history
    s2 = _begin(d, [20, 12, 13])
    assert d.propose(s2, [20, 12, 13], 4).tokens == [14, 15, 16]
    fresh = SuffixDrafter()
    assert fresh.propose(_begin(fresh, [20, 12, 13]), [20, 12, 13], 4).tokens == []


def test_a_running_request_is_not_history_until_it_ends():
    d = SuffixDrafter()
    s1 = _begin(d, [10, 11, 12])
    d.propose(s1, [10, 11, 12, 13, 14, 15, 16], 4)
    s2 = _begin(d, [20, 12, 13])  # s1 still runs: s2 cannot draft from it
    assert d.propose(s2, [20, 12, 13], 4).tokens == []
    d.end(s1)
    assert d.propose(s2, [20, 12, 13], 4).tokens == [14, 15, 16]


def test_interleaved_requests_each_draft_as_alone():
    a = [1, 2, 5, 6, 1, 2, 5, 6, 1, 2, 5]
    b = [1, 2, 7, 1, 2, 7, 3, 1, 2, 7, 3, 1, 2]  # the same n-grams, other continuations: nothing may leak

    def drafts_alone(tokens):
        d = SuffixDrafter(max_depth=3, min_match=1)
        s = _begin(d, tokens[:2])
        return [d.propose(s, tokens[:n], 3).tokens for n in range(2, len(tokens) + 1)]

    d = SuffixDrafter(max_depth=3, min_match=1)
    sa, sb = _begin(d, a[:2]), _begin(d, b[:2])
    together_a, together_b = [], []
    for n in range(2, max(len(a), len(b)) + 1):  # one round of each in turn, as a batch would
        if n <= len(a):
            together_a.append(d.propose(sa, a[:n], 3).tokens)
        if n <= len(b):
            together_b.append(d.propose_many([sb], [b[:n]], [3])[0].tokens)
    assert together_a == drafts_alone(a)
    assert together_b == drafts_alone(b)
    assert d.history == []  # neither has ended


def test_rollback_forgets_the_rejected_tokens():
    d = SuffixDrafter(max_depth=3, min_match=1)
    s = _begin(d, [])
    d.propose(s, [1, 2, 3, 9, 1, 2], 2)
    d.rollback(s, 3)  # only [1, 2, 3] stands
    d.end(s)
    assert d.history == [[1, 2, 3]]


def test_history_is_bounded():
    d = SuffixDrafter(max_history_tokens=6)
    for request in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        s = _begin(d, request)
        d.propose(s, request, 2)
        d.end(s)
    s = _begin(d, [0])
    assert sum(map(len, d.history)) <= 6
    assert d.propose(s, [0, 1, 2], 2).tokens == []  # the oldest request was dropped
    assert d.propose(s, [0, 1, 2, 9, 10], 2).tokens == [11, 12]


@pytest.mark.parametrize("options", [{"min_match": 0}, {"min_match": 5, "max_depth": 4}, {"max_history_tokens": -1}])
def test_bad_options_are_refused(options):
    with pytest.raises(ConfigError):
        SuffixDrafter(**options)
