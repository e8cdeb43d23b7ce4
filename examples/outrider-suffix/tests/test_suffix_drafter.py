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
    drafter.begin(prompt, SamplingParams(), DraftControls())


def test_longest_match_in_the_current_request():
    d = SuffixDrafter(max_depth=4, min_match=1)
    _begin(d, [])
    # [3, 4] occurs twice: followed by 9 after [1, 3, 4], by 5 after [2, 3, 4]; the longer suffix [2, 3, 4] wins
    assert d.propose([1, 3, 4, 9, 2, 3, 4, 5, 6, 0, 2, 3, 4], 3).tokens == [5, 6, 0]
    assert d.propose([1, 3, 4, 9, 2, 3, 4, 5, 6, 0, 2, 3, 4], 1).tokens == [5]


def test_remembers_earlier_requests():
    d = SuffixDrafter()
    _begin(d, [10, 11, 12])
    d.propose([10, 11, 12, 13, 14, 15, 16], 4)  # the first request ends with these tokens
    _begin(d, [20, 12, 13])  # a new request: the previous one is now history
    assert d.propose([20, 12, 13], 4).tokens == [14, 15, 16]
    fresh = SuffixDrafter()
    _begin(fresh, [20, 12, 13])
    assert fresh.propose([20, 12, 13], 4).tokens == []


def test_history_is_bounded():
    d = SuffixDrafter(max_history_tokens=6)
    for request in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        _begin(d, request)
        d.propose(request, 2)
    _begin(d, [0])
    assert sum(map(len, d.history)) <= 6
    assert d.propose([0, 1, 2], 2).tokens == []  # the oldest request was dropped
    assert d.propose([0, 1, 2, 9, 10], 2).tokens == [11, 12]


@pytest.mark.parametrize("options", [{"min_match": 0}, {"min_match": 5, "max_depth": 4}, {"max_history_tokens": -1}])
def test_bad_options_are_refused(options):
    with pytest.raises(ConfigError):
        SuffixDrafter(**options)
