"""The draft-length policy, on hand-computed cases."""

from __future__ import annotations

import pytest

from outrider.spec.drafter import DraftKind
from outrider.spec.length_policy import AdaptiveDraftLength, FixedDraftLength


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


def test_prices_drafting_out_when_nothing_is_accepted_and_drafts_the_cap_when_everything_is():
    rising = {n: 1 + 0.05 * (n - 1) for n in range(1, 10)}
    assert policy(0.0, rising).best_length() == 0  # choose() may still look, from the exploring allowance
    assert policy(1.0, rising).choose() == 8


def test_draft_cost_counts_against_long_drafts():
    p = policy(0.8, {n: 1.0 for n in range(1, 10)})
    assert p.choose() == 8
    p.draft_s_per_token = 0.5  # a draft token costs half a verify: rate(k) = E(k) / (1 + k/2), best k = 2
    # k = 1: 1.8 / 1.5 = 1.2; k = 2: 2.44 / 2 = 1.22; k = 3: 2.952 / 2.5 = 1.181
    assert p.choose() == 2


def test_learns_from_rejections_and_tries_again_later():
    verify = lambda n: 1 + 0.05 * (n - 1)  # noqa: E731
    p = AdaptiveDraftLength(cap=8)
    simulate(p, 40, 0.0, 0.0, verify)  # every draft rejected at position 1
    assert p.best_length() == 0
    # the text turns predictable: exploring rounds from 0 find it out
    _, _, chosen = simulate(p, 200, 0.95, 0.0, verify)
    assert sum(chosen[-50:]) / 50 >= 4, chosen


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


def test_a_slow_verify_does_not_price_its_length_out_when_a_longer_one_costs_less():
    # A round costs what a 1.5B target's does on a 2-core CPU: verify(n) = 1 + 0.085 (n - 1), a drafted token
    # 0.07, each position accepted with 0.6. By hand: E(1) = 1.6, E(2) = 1.96, E(3) = 2.176 tokens for costs
    # 1.155, 1.31, 1.465: rates 1.385, 1.496, 1.485, so k = 2 is best. One slow round left verify(3) at 10:
    # k = 2 was never chosen again, so never measured again. Priced no higher than verify(4) once a round has
    # measured that (an exploring round asks for 2k + 1 = 3 tokens), it is.
    verify = lambda n: 1 + 0.085 * (n - 1)  # noqa: E731
    p = AdaptiveDraftLength(cap=8, verify_s={n: verify(n) for n in range(1, 18)}, draft_s_per_token=0.07)
    p.verify_s[3] = 10.0
    assert p.verify_cost(3) == 10.0  # carried costs cap nothing: this generation has measured none
    _, _, chosen = simulate(p, 300, 0.6, 0.07, verify, seed=1)
    assert chosen[-100:].count(2) >= 20, chosen
    assert p.verify_s[3] < 2.0


def test_a_draft_step_clock_bills_a_catch_up_beyond_one_step_as_upkeep():
    from outrider.spec.drafter import DraftStepClock

    clock = DraftStepClock()
    assert clock.charge(0.3, 3) == pytest.approx(0.2)  # no step timed yet: a row's share stands for it
    assert clock.charge(0.1, 1) == 0.0 and clock.step_s == pytest.approx(0.1)
    assert clock.charge(0.25, 3) == pytest.approx(0.15)
    assert clock.charge(0.05, 2) == 0.0  # never below nothing
    clock.teach(0.2)
    assert clock.step_s == pytest.approx(0.1 + 0.3 * 0.1)


def test_each_kind_of_draft_learns_its_own_acceptance_from_its_own_prior():
    # verify(n) = 1 + 0.1 (n - 1). A kind with prior 0.5 gets k = 2 (see the first test); one with prior
    # 0.2: rate(1) = 1.2 / 1.1 = 1.09 > 1, rate(2) = 1.24 / 1.2 = 1.03, so k = 1.
    weak, strong = DraftKind("weak", 0.2), DraftKind("strong", 0.5)
    p = AdaptiveDraftLength(cap=8, verify_s={n: 1 + 0.1 * (n - 1) for n in range(1, 10)}, draft_s_per_token=0.0)
    assert (p.choose(weak), p.choose(strong)) == (1, 2)
    for _ in range(20):  # the weak kind is never accepted: it stops drafting, the strong one is untouched
        p.update(1, 0, 0.0, 1.1, weak)
    assert (p.best_length(weak), p.best_length(strong)) == (0, 2)
    for _ in range(20):  # the strong kind always is: it drafts to the cap, the weak one stays off
        p.update(2, 2, 0.0, 1.2, strong)
    p.verify_s = {n: 1 + 0.1 * (n - 1) for n in range(1, 10)}  # undo the running averages
    assert (p.best_length(weak), p.best_length(strong)) == (0, 8)


def test_a_round_with_nothing_to_draft_teaches_nothing_about_acceptance():
    p = AdaptiveDraftLength(cap=8)
    for _ in range(10):
        p.update(4, 0, 0.0, 1.5)
    before = list(p.estimates().acceptance)
    for _ in range(50):  # the drafter had nothing (kind None), or the policy chose 0: nothing was measured
        p.update(0, 0, 0.0, 1.0, None)
        p.update(0, 0, 0.0, 1.0)
    assert p.estimates().acceptance == before


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


def simulate(p: AdaptiveDraftLength, rounds: int, acceptance: float, draft_s: float, verify, seed: int = 0,
             first_draft_s: float | None = None, go_on: float = 1.0) -> tuple[float, int, list[int]]:
    """Rounds of a world where each drafted position is accepted with probability `acceptance` and a draft
    token costs `draft_s`; with `go_on` < 1 the drafter goes on at each position with that probability, else it
    stops there after a draft step that showed the stop (the verify is over what it drafted). Returns (seconds,
    tokens, chosen lengths)."""
    import random
    rng = random.Random(seed)
    seconds, tokens, chosen, drafted_before = 0.0, 0, [], False
    for _ in range(rounds):
        k = p.choose()
        drafted = k
        if go_on < 1.0:
            drafted = 0
            while drafted < k and rng.random() < go_on:
                drafted += 1
        accepted = 0
        while accepted < drafted and rng.random() < acceptance:
            accepted += 1
        step_s = draft_s if drafted_before or first_draft_s is None or k == 0 else first_draft_s
        cost = step_s * (drafted + (drafted < k))
        drafted_before |= k > 0
        p.update(drafted, accepted, cost, verify(drafted + 1), asked=k)
        seconds += cost + verify(drafted + 1)
        tokens += accepted + 1
        chosen.append(k)
    return seconds, tokens, chosen


def test_exploring_from_zero_costs_at_most_its_budget():
    # Nothing is ever accepted: plain decoding (1 token per second here) is the best there is. Exploring
    # rounds from 0 each lose a draft and a longer verify; together at most explore_budget (1%) of the run and
    # the allowance's three rejected looks.
    p = AdaptiveDraftLength(cap=8)
    seconds, tokens, chosen = simulate(p, 3000, 0.0, 0.3, lambda n: 1 + 0.1 * (n - 1))
    explored = sum(1 for k in chosen[200:] if k)
    assert explored >= 10, explored  # it does keep exploring
    assert tokens / seconds >= 1 / (1 + p.explore_budget) - 0.002, tokens / seconds


def test_one_slow_first_draft_does_not_decide_a_generation():
    # Drafting pays (acceptance 0.8, a draft token 0.2 of a verify), but the first draft is slow (a cold
    # start: 1.5 verifies a token), which prices drafting out; only measuring drafting again from 0 finds
    # that out: it must draft again long before the run ends.
    verify = lambda n: 1 + 0.1 * (n - 1)  # noqa: E731
    p = AdaptiveDraftLength(cap=8)
    simulate(p, 1, 0.8, 0.2, verify, first_draft_s=1.5)
    assert p.best_length() == 0  # the slow first draft did price drafting out
    _, _, chosen = simulate(p, 399, 0.8, 0.2, verify)
    late = chosen[-200:]
    assert sum(late) / len(late) >= 2, chosen


def test_a_streak_of_misses_early_in_a_first_generation_does_not_leave_it_at_zero():
    # An MTP head's costs on a 1.5B target (a draft token 0.08 of a one-row verify, two rows 1.07, three 1.10):
    # drafting one token pays from an acceptance of 0.15. Right 55% of the time, it starts with six misses in
    # a row, which take the running average to 0.6 x 1/2 x 2/3 x 0.7^4 = 0.048 and the policy to 0; with 1% of
    # the few rounds run so far to spend, one rejected look keeps it there for about twenty rounds. The
    # allowance of three looks must bring it back within a few rounds, on average over 40 such first generations.
    import random
    verify = lambda n: 1 + 0.07 * (n > 1) + 0.03 * max(n - 2, 0)  # noqa: E731
    left_at_zero = []
    for seed in range(40):
        p, rng, chosen = AdaptiveDraftLength(cap=8), random.Random(seed), []
        for i in range(60):
            k = p.choose()
            accepted = 0
            while i >= 6 and accepted < k and rng.random() < 0.55:  # the first six rounds: every draft missed
                accepted += 1
            p.update(k, accepted, 0.08 * k, verify(k + 1))
            chosen.append(k)
            if i == 5:
                assert p.best_length() == 0  # the streak did price drafting out
        left_at_zero.append(chosen[6:].count(0))
    assert sum(left_at_zero) / len(left_at_zero) <= 6, left_at_zero


def test_a_draft_stopped_short_is_priced_as_a_miss_there():
    # A drafter that stops before its first token (its confidence stop) 3 rounds in 4 and is right when it
    # drafts: asked for 1, it yields 1.25 tokens a round for a draft forward (0.3) each round and a 2-row verify
    # (1.1) one round in 4 (1.0 in the others), 1.325 a round, against plain decoding's 1 token for 1.0: not
    # worth it. Seen only through the rounds that drafted it would look always right.
    verify = {n: 1 + 0.1 * (n - 1) for n in range(1, 10)}
    blind, seeing = (AdaptiveDraftLength(cap=8, verify_s=dict(verify)) for _ in range(2))
    for i in range(40):
        drafted = 1 if i % 4 == 0 else 0
        for p, asked in ((blind, None), (seeing, 1)):
            p.update(drafted, drafted, 0.3, verify[drafted + 1], asked=asked)
            p.verify_s = dict(verify)
    assert blind.best_length() > 0
    assert seeing.best_length() == 0
    assert abs(seeing.draft_s_per_token - 0.3) < 1e-9  # each round's draft time is one position's


def tokens_per_s(p, go_on: float, acceptance: float, draft_s: float, verify) -> float:
    seconds, tokens, _ = simulate(p, 4000, acceptance, draft_s, verify, go_on=go_on)
    return tokens / seconds


@pytest.mark.parametrize("go_on, acceptance, draft_s", [(0.75, 1.0, 0.3), (0.8, 0.95, 0.25), (0.6, 0.95, 0.2)])
def test_drafts_that_stop_early_are_priced_at_what_they_cost(go_on, acceptance, draft_s):
    # A drafter whose confidence stop ends a quarter of its drafts at each position: a round asked for k costs
    # the draft steps and the verify rows of where it stopped, not of k, so long asks pay; priced as if every
    # ask were drafted whole, auto would keep to short asks.
    verify = lambda n: 1 + 0.05 * (n - 1)  # noqa: E731
    best_fixed = max(tokens_per_s(FixedDraftLength(k), go_on, acceptance, draft_s, verify) for k in range(9))
    auto = tokens_per_s(AdaptiveDraftLength(cap=8), go_on, acceptance, draft_s, verify)
    assert auto >= 0.93 * best_fixed, (auto, best_fixed)


def test_a_kind_that_knows_its_cost_is_priced_by_it_before_any_timing():
    # Untimed model: verify(n) = 1 + 0.03 (n - 1), prior 0.6. A token at 0.1 (the default): rate(1) = 1.6 / 1.13
    # = 1.42, rate(2) = 1.96 / 1.26 = 1.56, ... drafting pays. At 0.5 (a draft model half the target's bytes):
    # rate(1) = 1.6 / 1.53 = 1.046, rate(2) = 1.96 / 2.06 = 0.951: one token. At 0.7: 1.6 / 1.73 = 0.92: none.
    p = AdaptiveDraftLength(cap=8, timed=False)
    assert p.best_length(DraftKind("unknown")) > 1
    assert p.best_length(DraftKind("half", cost=0.5)) == 1
    assert p.best_length(DraftKind("dear", cost=0.7)) == 0
    # timed, before its first draft is timed: cost x the one-token verify measured (2 s): 1.6 / (2.06 + 1.4) < 1/2
    q = AdaptiveDraftLength(cap=8, verify_s={1: 2.0})
    assert q.best_length(DraftKind("dear", cost=0.7)) == 0 and q.best_length(DraftKind("unknown")) > 0


def test_costs_from_a_slowed_generation_do_not_price_drafting_out_of_the_next():
    # Generation 1: another process slows the drafter (a draft token costs 3 verifies): drafting loses, so
    # the policy stops, and its exploring rounds spend their budget. Generation 2: the machine is calm (a
    # draft token 0.2, acceptance 0.8, where drafting pays: test_one_slow_first_draft_does_not_decide_a_generation).
    # Carried as a running average that only exploring rounds update, the slow draft cost would keep it from
    # drafting for all of generation 2; with no look at its start, it would wait on the exploring budget.
    verify = lambda n: 1 + 0.1 * (n - 1)  # noqa: E731
    p = AdaptiveDraftLength(cap=8)
    p.begin_generation()
    simulate(p, 300, 0.8, 3.0, verify)
    assert p.best_length() == 0
    p.begin_generation()
    _, _, chosen = simulate(p, 100, 0.8, 0.2, verify, seed=1)
    assert 0 < chosen[0] and sum(chosen[:50]) / 50 >= 2, chosen


def test_one_look_a_generation_costs_a_round_at_most():
    # Nothing is ever accepted: each generation looks once (one drafted token), and exploring keeps to its
    # budget: 40 generations of 50 rounds lose at most a look's price (a draft and a longer verify, 0.4 s) in
    # each, beyond the budget.
    verify = lambda n: 1 + 0.1 * (n - 1)  # noqa: E731
    p = AdaptiveDraftLength(cap=8)
    seconds = tokens = 0.0
    for generation in range(40):
        p.begin_generation()
        s, t, _ = simulate(p, 50, 0.0, 0.3, verify, seed=generation)
        seconds, tokens = seconds + s, tokens + t
    assert tokens / seconds >= 1 / (1 + p.explore_budget + 0.4 / 50) - 0.002, tokens / seconds


def test_a_slow_first_draft_after_calm_generations_does_not_decide_the_next():
    # Generation 1 measured drafting as paying (a draft token 0.2 of a verify, acceptance 0.8). Generation 2's
    # first draft is slow (a cold start after the server idled: 1.5 verifies a token): replacing the carried
    # cost, it prices drafting out, and exploring (credited by generation 1's won rounds) must measure it again.
    verify = lambda n: 1 + 0.1 * (n - 1)  # noqa: E731
    p = AdaptiveDraftLength(cap=8)
    p.begin_generation()
    simulate(p, 200, 0.8, 0.2, verify)
    p.begin_generation()
    _, _, chosen = simulate(p, 100, 0.8, 0.2, verify, seed=1, first_draft_s=1.5)
    assert sum(chosen[:50]) / 50 >= 2, chosen


def test_an_untimed_generation_explores_as_if_it_were_the_first():
    # A seeded run's lengths must follow its seeded history alone: whatever an earlier timed generation spent
    # or won on exploring (in seconds), an untimed one explores from 0 exactly when a fresh policy would.
    verify = lambda n: 1 + 0.1 * (n - 1)  # noqa: E731
    fresh, used = AdaptiveDraftLength(cap=8), AdaptiveDraftLength(cap=8)
    used.begin_generation()
    simulate(used, 300, 0.3, 0.9, verify, seed=3)
    runs = []
    for p in (fresh, used):
        p.begin_generation(timed=False)
        runs.append(simulate(p, 300, 0.1, 0.3, verify, seed=4)[2])
    assert sum(runs[0]) > 0 and runs[0] == runs[1]


def test_a_timed_generation_after_an_untimed_one_keeps_to_its_budget():
    # An untimed generation counts its time in one-token verifies (1000 rounds: about 1000); a timed one in
    # seconds (a verify here: 10 ms). Carried over, the untimed count would let the timed generation explore on
    # every round (1% of 1000 is worth 2500 of its rejected drafts) where nothing is ever accepted.
    p = AdaptiveDraftLength(cap=8)
    p.begin_generation(timed=False)
    simulate(p, 1000, 0.0, 0.3, lambda n: 1 + 0.1 * (n - 1))
    p.begin_generation(timed=True)
    seconds, tokens, _ = simulate(p, 1000, 0.0, 0.003, lambda n: 0.01 * (1 + 0.1 * (n - 1)))
    assert tokens / seconds >= 100 / (1 + p.explore_budget) - 0.5, tokens / seconds


def test_batch_pricing_drafts_where_a_row_is_cheap_and_not_where_it_costs_a_step():
    """Hand-checked: with a forward whose cost does not grow with its rows (the weights' reading is all of it)
    and free drafts, every drafted token adds expected tokens at no cost, so each sequence drafts to its limit;
    with every row costing a whole step and drafts accepted half the time, a token adds 0.5 tokens for a step's
    cost, below the plain rate of one token a step: nobody drafts. Before any forward is timed: no say."""
    from outrider.spec.drafter import DraftKind
    from outrider.spec.length_policy import AdaptiveDraftLength, BatchPricing

    likely, even = DraftKind("likely", 0.9), DraftKind("even", 0.5)
    fresh = BatchPricing()
    assert fresh.choose([(AdaptiveDraftLength(), likely, 4)]) is None
    flat = BatchPricing()
    for rows in (1, 4, 32):
        flat.observe(rows, 0.05)
    policies = [AdaptiveDraftLength(draft_s_per_token=0.0) for _ in range(3)]
    assert flat.choose([(p, likely, limit) for p, limit in zip(policies, (4, 2, 0))]) == [4, 2, 0]
    steep = BatchPricing()
    for rows in (1, 2, 3, 8, 32):
        steep.observe(rows, 0.05 * rows)
    assert steep.choose([(p, even, 4) for p in policies]) == [0, 0, 0]


def _two_sure_sequences():
    """A pricing whose forward costs 1 s whatever its rows, a lockstep drafter at 0.3 s a depth, and two sequences
    whose drafts (0.3 s a token) are accepted 0.9 of the time at every position, measured there (so none is assumed
    from the deepest)."""
    from outrider.spec.drafter import DraftKind
    from outrider.spec.length_policy import AdaptiveDraftLength, BatchPricing

    sure = DraftKind("sure", 0.9)
    pricing = BatchPricing()
    for rows in (1, 2, 40):
        pricing.observe(rows, 1.0)
    pricing.observe_draft(2, 0.6)
    policies = [AdaptiveDraftLength(draft_s_per_token=0.3, draft_s_per_token_by_kind={sure: 0.3}) for _ in range(2)]
    for p in policies:
        est = p.estimates(sure)
        est.acceptance[:] = [0.9] * len(est.acceptance)
        est.reached[:] = [100] * len(est.reached)
    return pricing, [(p, sure, 16) for p in policies]


def test_lockstep_batch_pricing_pays_each_depth_once():
    """Hand-checked: two sequences whose drafts are accepted 0.9 of the time at every position, a forward whose
    cost does not grow with its rows (1 s), and a lockstep drafter whose every depth costs 0.3 s for both. Both
    drafting to depth d yields 2 + 2 * sum_{i<=d} 0.9^i tokens for 1 + 0.3 d seconds: 8.19 / 2.2 = 3.72 at d = 4,
    9.37 / 2.5 = 3.748 at d = 5, 10.43 / 2.8 = 3.72 at d = 6, against 2 / 1 plain: depth 5 each. Priced per token
    (0.3 s a token, as a drafter that is not lockstep pays), two each: 5.42 / 2.2 = 2.464 against 6.15 / 2.5 = 2.460
    with a third for either."""
    pricing, plans = _two_sure_sequences()
    assert pricing.choose(plans, lockstep=True) == [5, 5]
    assert pricing.choose(plans) == [2, 2]
    # a depth the step's other sequences already draft to is paid for: each token there costs only its row (none
    # here): 2 + 2 * sum_{i<=8} 0.9^i = 12.25 tokens in 1 s, where a ninth depth would add 0.77 for 0.3 s
    assert pricing.choose(plans, other_rows=9, lockstep=True, other_depth=8) == [8, 8]


def test_a_sequence_with_a_read_to_catch_up_enters_drafting_only_where_the_read_is_won_back():
    """Hand-checked, on the set-up above (a flat 1 s forward, 0.3 s a depth, acceptance 0.9 everywhere), where the
    second sequence's drafter must first read 100 rows at 0.01 s a row (1 s) and the sequence has `horizon` tokens
    left, half of which must win the read back: each token it emits drafting bears 1 s / (horizon / 2). Brute force
    over both lengths, tokens 2 + S_a + S_b (S_d = sum_{i<=d} 0.9^i) for 1 + 0.3 max(a, b) + tax (1 + S_b) seconds
    (tax only where b > 0): at 20 tokens left (tax 0.1) both draft to 5, 9.371 / 2.969 = 3.157; at 2 left (tax 1)
    the read never pays and the first drafts alone to 3, 4.439 / 1.9 = 2.336 (against 4.310 / 1.9 = 2.268 at its
    depth 3 with both drafting 2). Priced per token (0.3 s each, no lockstep) a read of 0.1 a token already keeps
    the second out: 4.439 / 1.9 = 2.336 for [3, 0] against [2, 2]'s 5.42 / (2.2 + 0.1 * 2.71) = 2.193."""
    pricing, plans = _two_sure_sequences()
    # no read timed yet: nothing is charged, so that one is
    assert pricing.choose(plans, lockstep=True, catch_up=[(0, 100), (100, 2)]) == [5, 5]
    pricing.observe_catch_up(100, 1.0)
    assert pricing.catch_up_row_s == 0.01
    assert pricing.choose(plans, lockstep=True, catch_up=[(0, 100), (100, 20)]) == [5, 5]
    assert pricing.choose(plans, lockstep=True, catch_up=[(0, 100), (100, 2)]) == [3, 0]
    assert pricing.choose(plans, catch_up=[(0, 100), (0, 100)]) == [2, 2]
    assert pricing.choose(plans, catch_up=[(0, 100), (100, 20)]) == [3, 0]


def test_a_new_policy_starts_from_the_costs_finished_generations_measured():
    """PolicyMemory: a timed generation that measured a verify of 3 rows at 0.05 s and a draft token at 0.01 s gives
    the next policy those costs, carried (its own first measurement replaces them), and the kind's prior, not the
    acceptance it measured (the next request is another text). An untimed generation teaches nothing."""
    from outrider.spec.drafter import DraftKind
    from outrider.spec.length_policy import PolicyMemory

    kind = DraftKind("draft", 0.6)
    memory = PolicyMemory()
    first = memory.new_policy()
    first.begin_generation()
    first.update(1, 1, 0.01, 0.05, kind)  # a draft of 1 token in 0.01 s, its verify of 2 rows in 0.05 s
    first.update(2, 2, 0.02, 0.05, kind)  # 2 tokens in 0.02 s, 3 rows in 0.05 s
    memory.remember(first)

    second = memory.new_policy()
    second.begin_generation()
    assert second.verify_s == {2: 0.05, 3: 0.05}
    assert second.draft_s_per_token_by_kind == {kind: 0.01} and second.draft_s_per_token == 0.01
    assert not second.measured  # carried, so the first measurement replaces it
    assert second.estimates(kind).acceptance[:2] == [0.6, 0.6]

    untimed = memory.new_policy()
    untimed.begin_generation(timed=False)
    untimed.update(1, 0, 5.0, 5.0, kind)
    memory.remember(untimed)
    assert memory.verify_s == {2: 0.05, 3: 0.05}


def test_a_batch_size_whose_drafting_steps_gave_less_than_plain_ones_stops_drafting_and_tries_again_later():
    """The batch's own record overrules its estimates: at 4 sequences, 8 drafting steps of 10 tokens in 0.2 s (50
    tokens/s) against 8 plain steps of 4 tokens in 0.05 s (80/s) rule drafting out at 4, not at 2; after
    RETRY_STEPS plain steps at 4 it is tried again on a fresh record; where drafting gave more (10 tokens in 0.1 s,
    100/s) it stays. Fewer than MIN_STEPS of either decide nothing."""
    from outrider.spec.length_policy import BatchPricing

    pricing = BatchPricing()
    for _ in range(BatchPricing.MIN_STEPS - 1):
        pricing.observe_step(4, True, 10, 0.2)
        pricing.observe_step(4, False, 4, 0.05)
    assert pricing.drafting_pays(4)
    pricing.observe_step(4, True, 10, 0.2)
    pricing.observe_step(4, False, 4, 0.05)
    assert not pricing.drafting_pays(4) and pricing.drafting_pays(2)
    for _ in range(BatchPricing.RETRY_STEPS - 1):
        pricing.observe_step(4, False, 4, 0.05)
    assert not pricing.drafting_pays(4)
    pricing.observe_step(4, False, 4, 0.05)
    assert pricing.drafting_pays(4)
    for _ in range(BatchPricing.MIN_STEPS):
        pricing.observe_step(4, True, 10, 0.1)
    assert pricing.drafting_pays(4)
