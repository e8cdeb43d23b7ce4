"""The draft-length policy, on hand-computed cases."""

from __future__ import annotations

from outrider.spec.drafter import DraftKind
from outrider.spec.length_policy import AdaptiveDraftLength


def policy(acceptance: float, verify: dict[int, float], cap: int = 8) -> AdaptiveDraftLength:
    p = AdaptiveDraftLength(cap=cap, verify_s=dict(verify), draft_s_per_token=0.0)
    p.estimates().acceptance = [acceptance] * cap
    return p


def test_picks_the_length_with_the_best_tokens_per_second():
    # a = 0.5, verify(n) = 1 + 0.1 (n - 1): rate(k) = (2 - 0.5^k) / (1 + 0.1 k)
    # k = 0: 1.000, 1: 1.364, 2: 1.458, 3: 1.442, 4: 1.384  ->  2
    p = policy(0.5, {n: 1 + 0.1 * (n - 1) for n in range(1, 10)})
    assert p.choose() == 2
    assert abs(p.expected_tokens(3) - 1.875) < 1e-12


def test_never_drafts_when_nothing_is_accepted_and_always_when_everything_is():
    rising = {n: 1 + 0.05 * (n - 1) for n in range(1, 10)}
    assert policy(0.0, rising).choose() == 0
    assert policy(1.0, rising).choose() == 8


def test_draft_cost_counts_against_long_drafts():
    p = policy(0.8, {n: 1.0 for n in range(1, 10)})
    assert p.choose() == 8
    p.draft_s_per_token = 0.5  # a draft token costs half a verify: rate(k) = E(k) / (1 + k/2), best k = 2
    # k = 1: 1.8 / 1.5 = 1.2; k = 2: 2.44 / 2 = 1.22; k = 3: 2.952 / 2.5 = 1.181
    assert p.choose() == 2


def test_learns_from_rejections_and_tries_again_later():
    p = AdaptiveDraftLength(cap=8)
    p.update(0, 0, 0.0, 1.0)
    p.update(4, 4, 0.0, 1.05)
    assert p.choose() > 0
    for _ in range(20):  # every draft rejected at position 1
        p.update(4, 0, 0.0, 1.05)
    assert p.choose() == 0
    for _ in range(200):  # rounds without drafts: estimates drift back towards the prior
        p.update(0, 0, 0.0, 1.0)
    assert p.choose() > 0


def test_unmeasured_lengths_are_interpolated():
    p = AdaptiveDraftLength(verify_s={1: 1.0, 5: 2.0})
    assert abs(p.verify_cost(3) - 1.5) < 1e-12
    assert p.verify_cost(9) > 2.0


def test_an_always_right_drafter_gets_to_draft_past_what_it_has_tried():
    # Positions 1-3 always accepted, 4 and beyond never reached; verify(n) = 1 + 0.2 (n - 1).
    # With the prior (0.6) there: rate(3) = 4 / 1.6 = 2.50, rate(4) = 4.6 / 1.8 = 2.56,
    # rate(5) = 4.96 / 2.0 = 2.48, so k = 4 and position 5 would never be tried.
    # Taking the deepest measured position's 1.0: rate(k) = (k + 1) / (1 + 0.2 k) grows with k: the cap, 8.
    p = AdaptiveDraftLength(cap=8, verify_s={n: 1 + 0.2 * (n - 1) for n in range(1, 10)}, draft_s_per_token=0.0)
    for _ in range(10):
        p.update(3, 3, 0.0, 1.6)
    p.verify_s = {n: 1 + 0.2 * (n - 1) for n in range(1, 10)}  # undo the running average of n = 4
    assert p.choose() == 8


def test_a_stale_high_cost_is_measured_again():
    # One slow round priced n = 8 at 10x; interpolated, k = 1 (n = 2) looks best for good. Every eighth
    # round asks for 2k + 1 = 3 tokens, so the costs past n = 2 are measured again.
    p = AdaptiveDraftLength(cap=8, verify_s={1: 1.0, 2: 1.1, 8: 10.0}, draft_s_per_token=0.0)
    chosen = []
    for _ in range(8):
        k = p.choose()
        chosen.append(k)
        p.update(k, k, 0.0, 1.0 + 0.1 * k)
    assert chosen[:7] == [1] * 7 and chosen[7] == 3


def test_each_kind_of_draft_learns_its_own_acceptance_from_its_own_prior():
    # verify(n) = 1 + 0.1 (n - 1). A kind with prior 0.5 gets k = 2 (see the first test); one with prior
    # 0.2: rate(1) = 1.2 / 1.1 = 1.09 > 1, rate(2) = 1.24 / 1.2 = 1.03, so k = 1.
    weak, strong = DraftKind("weak", 0.2), DraftKind("strong", 0.5)
    p = AdaptiveDraftLength(cap=8, verify_s={n: 1 + 0.1 * (n - 1) for n in range(1, 10)}, draft_s_per_token=0.0)
    assert (p.choose(weak), p.choose(strong)) == (1, 2)
    for _ in range(20):  # the weak kind is never accepted: it stops drafting, the strong one is untouched
        p.update(1, 0, 0.0, 1.1, weak)
    assert (p.choose(weak), p.choose(strong)) == (0, 2)
    for _ in range(20):  # the strong kind always is: it drafts to the cap, the weak one stays off
        p.update(2, 2, 0.0, 1.2, strong)
    p.verify_s = {n: 1 + 0.1 * (n - 1) for n in range(1, 10)}  # undo the running averages
    assert (p.choose(weak), p.choose(strong)) == (0, 8)


def test_a_round_with_nothing_to_draft_teaches_nothing_about_acceptance():
    p = AdaptiveDraftLength(cap=8)
    for _ in range(10):
        p.update(4, 0, 0.0, 1.5)
    before = list(p.estimates().acceptance)
    for _ in range(50):  # the drafter had nothing (kind None): no drift back to the prior either
        p.update(0, 0, 0.0, 1.0, None)
    assert p.estimates().acceptance == before
    p.update(0, 0, 0.0, 1.0)  # a round that could have drafted and did not: drift towards the prior 0.6
    assert p.estimates().acceptance[0] == before[0] + p.recovery * (0.6 - before[0])


def test_each_kind_of_draft_has_its_own_cost():
    """A chain's lookup drafts are nearly free and its MTP drafts cost head forwards: priced apart, lookup
    drafts long and MTP short at the same acceptance (one running cost for both priced them alike)."""
    cheap, dear = DraftKind("lookup:4", prior=0.8), DraftKind("mtp", prior=0.8)
    p = AdaptiveDraftLength(cap=8, verify_s={n: 1.0 for n in range(1, 10)})
    for kind in (cheap, dear):
        p.estimates(kind).acceptance = [0.8] * 8
        p.estimates(kind).reached = [1] * 8
    p.update(4, 3, 0.0, 1.0, cheap)  # 0 s per drafted token
    p.update(4, 3, 2.0, 1.0, dear)  # 0.5 s per drafted token: best k = 2 (test_draft_cost_counts_against_long_drafts)
    p.estimates(cheap).acceptance = p.estimates(dear).acceptance = [0.8] * 8
    p.rounds = 0  # not an exploring round
    assert p.choose(cheap) == 8
    assert p.choose(dear) == 2


def test_a_position_reached_for_the_first_time_starts_from_what_it_was_priced_at():
    # Positions 1-3 accepted in 10 rounds (estimates ~0.99), then one exploring round drafts 7 and all are
    # accepted. Positions 4-7, priced at ~0.99 while unreached, must not fall back to the prior (0.6) on being
    # reached: from the prior one hit gives 0.72 each, and with verify(n) = 1 + 0.2 (n - 1), no draft cost,
    # rate(k) = E(k) / (1 + 0.2 k) peaks at k = 4 (3: 2.459, 4: 2.572, 5: 2.566); from ~0.99 it grows to the cap.
    costs = {n: 1 + 0.2 * (n - 1) for n in range(1, 10)}
    p = AdaptiveDraftLength(cap=8, verify_s=dict(costs), draft_s_per_token=0.0)
    for _ in range(10):
        p.update(3, 3, 0.0, 1.6)
    p.update(7, 7, 0.0, 2.2)
    p.verify_s = dict(costs)
    assert min(p.estimates().acceptance[3:7]) > 0.95, p.estimates().acceptance
    assert p.choose() == 8


def test_a_new_position_learns_in_a_few_rounds_not_ten():
    # From the prior 0.6 with the running average's weight 0.3, three misses leave 0.6 x 0.7^3 = 0.21; with the
    # first observations weighed 1/2, 1/3, then max(1/4, 0.3): 0.6 x 1/2 x 2/3 x 0.7 = 0.14. Three hits:
    # 1 - 0.4 x 1/2 x 2/3 x 0.7 = 0.9067 (running average alone: 0.863).
    p = AdaptiveDraftLength(cap=4)
    for _ in range(3):
        p.update(1, 0, 0.0, 1.0)
    assert abs(p.estimates().acceptance[0] - 0.14) < 1e-12
    q = AdaptiveDraftLength(cap=4)
    for _ in range(3):
        q.update(1, 1, 0.0, 1.0)
    assert abs(q.estimates().acceptance[0] - (1 - 0.4 * 0.7 / 3)) < 1e-12
