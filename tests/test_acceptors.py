"""Acceptors: greedy, sampled (Leviathan/Chen and the one-hot rule) and p-min.

The lossless tests are statistical: many short generations on a toy target/drafter, the distribution of the
first emitted token and of the first two emitted tokens compared with plain sampling from warp(p) by a
chi-square test (outrider.testing.stats: survival function computed there, no scipy). The expected distributions are products of
the warped target tables, computed independently of the acceptors. A deliberately wrong acceptor defined in
this file shows that the same statistic rejects a broken residual.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from outrider.errors import ConfigError
from outrider.plugins.acceptors.greedy import GreedyAcceptor
from outrider.plugins.acceptors.pmin import PMinAcceptor
from outrider.plugins.acceptors.sampled import SampledAcceptor
from outrider.spec.acceptance import Acceptor, AcceptResult, VerifyRound
from outrider.spec.random_streams import PositionRandom
from outrider.spec.sampling import SamplingParams, sample_at, warp
from outrider.testing.stats import chi2_sf, chi2_test, detectable_tv
from outrider.testing.toy import ToyModel

P_THRESHOLD = 1e-4


class Measurement(UserWarning):
    """A number the test measured and reports (shown in pytest's warnings summary)."""


# ------------------------------------------------------------------------------------------------ chi-square


def test_chi2_sf_against_closed_forms():
    for x in (0.1, 1.0, 3.0, 10.0, 40.0, 150.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)  # df 2: exp(-x/2)
        assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-10)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-9)


def test_chi2_sf_against_scipy_if_present():
    special = pytest.importorskip("scipy.special")
    for df in (1, 3, 7, 24, 63):
        for x in (0.5, df * 0.8, df * 1.0, df * 2.5 + 10):
            assert chi2_sf(x, df) == pytest.approx(float(special.chdtrc(df, x)), rel=1e-8)


@pytest.mark.parametrize("n", [400, 2000])  # the contract's q-law check's two sizes
def test_a_planted_bias_of_the_stated_size_is_detected_95_times_in_100(n):
    # The hardest bias of a given total variation for a Pearson test (the same relative error in every cell),
    # planted in a law of 9 cells (the q-law check's two-token law): at the distance detectable_tv states,
    # the test at level 1e-4 rejects in 95% of samples; at 0.8 of it, plainly less often (the bound is no
    # looser than it says).
    q = np.array([0.2, 0.15, 0.1, 0.05, 0.2, 0.12, 0.08, 0.06, 0.04])  # halves of mass 0.5 each
    sign = np.array([1, 1, 1, 1, -1, -1, -1, -1, -1])
    tv = detectable_tv(n, len(q) - 1, P_THRESHOLD)
    rng = np.random.default_rng(n)
    repeats = 1000

    def rejected(distance: float) -> float:
        p = q * (1 + 2 * distance * sign)  # sum |p - q| = 2 distance
        return np.mean([chi2_test(rng.multinomial(n, p), q)[2] <= P_THRESHOLD for _ in range(repeats)])

    at_bound = rejected(tv)
    assert at_bound >= 0.95 - 3 * math.sqrt(0.95 * 0.05 / repeats), (tv, at_bound)
    assert rejected(0.8 * tv) < 0.9, tv


# ------------------------------------------------------------------------------------------------ greedy

# hand-made target rows with argmax 1, 3, 0, 4
ROWS = torch.tensor(
    [
        [0.0, 5.0, 1.0, 2.0, 3.0],
        [1.0, 0.0, 2.0, 4.0, -1.0],
        [3.0, 1.0, 2.0, 0.0, 2.5],
        [0.0, 1.0, 2.0, 3.0, 9.0],
    ]
)
GREEDY_CASES = [
    ([1, 3, 0], [1, 3, 0, 4], 3),  # all accepted -> bonus argmax p4
    ([1, 2, 0], [1, 3], 1),  # mismatch at 2 -> recovered argmax p2
    ([2, 3, 0], [1], 0),  # mismatch at 1
    ([1, 3, 1], [1, 3, 0], 2),  # mismatch at 3
    ([], [1], 0),  # empty draft: one token from p1
    ([7, -1, 99], [1], 0),  # out-of-vocabulary ids: rejected, no crash
    ([1, 3, 5], [1, 3, 0], 2),
]
GREEDY_LIKE = [
    ("greedy", lambda: GreedyAcceptor(), SamplingParams(0.0)),
    ("greedy-ignores-T", lambda: GreedyAcceptor(), SamplingParams(0.9, top_k=2)),
    ("sampled-T0", lambda: SampledAcceptor(), SamplingParams(0.0)),
    ("pmin1-T0", lambda: PMinAcceptor(1.0), SamplingParams(0.0)),
]


@pytest.mark.parametrize("name,make,params", GREEDY_LIKE, ids=[g[0] for g in GREEDY_LIKE])
@pytest.mark.parametrize("drafts,tokens,accepted", GREEDY_CASES)
@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_rule_on_hand_made_logits(name, make, params, drafts, tokens, accepted, with_q):
    k = len(drafts)
    q = torch.full((k, 5), 0.2) if with_q else None
    res = make().accept(VerifyRound(ROWS[: k + 1], drafts, q, params, PositionRandom(0), 10))
    assert isinstance(res, AcceptResult)
    assert (res.tokens, res.accepted) == (tokens, accepted)


def test_round_shape_errors():
    for acc in (GreedyAcceptor(), SampledAcceptor(), PMinAcceptor()):
        with pytest.raises(ValueError):
            acc.accept(VerifyRound(ROWS, [1, 3], None, SamplingParams(0.7), PositionRandom(0), 1))  # 4 rows for k=2
        with pytest.raises(ValueError):
            acc.accept(VerifyRound(ROWS[:3], [1, 3], torch.ones(3, 5) / 5, SamplingParams(0.7), PositionRandom(0), 1))


def test_leviathan_uses_the_documented_draws():
    # the recovered token is drawn from norm(max(0, p - q)) with rng.uniform(its position), the acceptance
    # test uses rng.uniform_aux, the bonus uses rng.uniform(position + k)
    params = SamplingParams(1.0)
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5], [1.0, 0.0, 0.0, 2.0, 1.0], [0.3, 0.2, 0.1, 0.0, 2.0]])
    p = np.exp(logits.double().numpy())
    p /= p.sum(-1, keepdims=True)
    acc = SampledAcceptor()
    for seed in range(20):
        rng = PositionRandom(seed)
        # q == p: every draft accepted (u <= 1), bonus from p_3 at position 7 + 2
        q = torch.tensor(p, dtype=torch.float32)[:2]
        res = acc.accept(VerifyRound(logits, [2, 3], q, params, rng, 7))
        cum = np.cumsum(p[2])
        assert res.accepted == 2 and res.tokens[2] == int(np.searchsorted(cum, rng.uniform(9) * cum[-1], side="right"))
        # q puts its mass where p is small: x = 3 at row 0 has p/q = p(3)/0.9, accept iff u_aux <= that
        qrow = np.array([0.025, 0.025, 0.025, 0.9, 0.025])
        res = acc.accept(VerifyRound(logits[:2], [3], torch.tensor(qrow[None], dtype=torch.float32), params, rng, 7))
        if rng.uniform_aux(7) <= p[0, 3] / 0.9:
            assert res.accepted == 1
        else:
            resid = np.maximum(p[0] - qrow, 0)
            cum = np.cumsum(resid)
            want = int(np.searchsorted(cum, rng.uniform(7) * cum[-1], side="right"))
            assert (res.tokens, res.accepted) == ([want], 0)


ALL_CONFIGS = [
    (GreedyAcceptor(), SamplingParams(0.0), False),
    (SampledAcceptor(), SamplingParams(0.0), True),
    (SampledAcceptor(), SamplingParams(0.8), False),
    (SampledAcceptor(), SamplingParams(0.8), True),
    (SampledAcceptor(), SamplingParams(0.7, 3, 0.8), False),
    (SampledAcceptor(), SamplingParams(0.7, 3, 0.8), True),
    (PMinAcceptor(0.1), SamplingParams(0.0), False),
    (PMinAcceptor(0.1), SamplingParams(0.7, 3, 0.8), True),
    (PMinAcceptor(0.1), SamplingParams(1.0), False),
]


@pytest.mark.parametrize("acc,params,with_q", ALL_CONFIGS)
def test_round_invariants_on_random_rounds(acc, params, with_q):
    g = np.random.default_rng(5)
    tg = torch.Generator().manual_seed(5)
    vocab = 7
    rng = PositionRandom(11)
    seen_accept = 0
    for r in range(300):
        k = int(g.integers(0, 6))
        logits = torch.randn(k + 1, vocab, generator=tg) * 2
        drafts = [int(v) for v in g.integers(-1, vocab + 1, size=k)]  # a few out of range
        q = warp(torch.randn(k, vocab, generator=tg), params) if with_q else None
        res = acc.accept(VerifyRound(logits, drafts, q, params, rng, 3 * r))
        assert 1 <= len(res.tokens) == res.accepted + 1 <= k + 1
        assert res.tokens[: res.accepted] == drafts[: res.accepted]
        assert all(0 <= t < vocab for t in res.tokens)
        assert all(type(t) is int for t in res.tokens)
        if acc.lossless:
            # every emitted token has positive probability under its row of p
            p = warp(logits, params)
            assert all(p[i, t] > 0 for i, t in enumerate(res.tokens))
        seen_accept += res.accepted
    assert seen_accept > 0


# ---------------------------------------------------------------------------------------- toy target and drafter

TOY = ToyModel(seed=3)
TARGET, DRAFT = TOY.target, TOY.draft
expected_distributions = TOY.expected_distributions
simulate = TOY.simulate


class WrongResidualAcceptor:
    """Leviathan acceptance, but at a rejection it resamples from p instead of norm(max(0, p - q))."""

    lossless = True
    needs_draft_probs = True

    def accept(self, verify):
        p, rng, position = warp(verify.target_logits, verify.params), verify.rng, verify.position
        for i, x in enumerate(verify.draft_tokens):
            px, qx = float(p[i, x]), float(verify.draft_probs[i, x])
            if not (qx > 0 and rng.uniform_aux(position + i) <= min(1.0, px / qx)):
                return verify.recovered(i, sample_at(p[i], rng.uniform(position + i)))
        return verify.bonus(sample_at(p[verify.k], rng.uniform(position + verify.k)))


def _check(first, joint, params, label):
    want_first, want_joint = expected_distributions(params)
    out = []
    for name, counts, want in (("first", first, want_first), ("joint", joint, want_joint)):
        stat, df, pval, forbidden = chi2_test(counts, want)
        out.append((name, stat, df, pval, forbidden))
        print(f"{label} {name}: chi2={stat:.1f} df={df} p={pval:.3g} forbidden={forbidden}")
    return out


PARAM_CASES = [
    pytest.param(SamplingParams(0.7, top_k=3, top_p=0.8), id="T0.7-k3-p0.8"),
    pytest.param(SamplingParams(1.0), id="T1.0"),
]


def test_toy_case_is_informative():
    # the filtered case must leave several tokens in play, or the statistical tests below would be weak
    for params in (SamplingParams(0.7, top_k=3, top_p=0.8), SamplingParams(1.0)):
        first, joint = expected_distributions(params)
        assert (first > 0.05).sum() >= 2 and (joint > 0.02).sum() >= 4
        p = warp(TARGET, params)
        q = warp(DRAFT, params)
        assert 0.5 * (p - q).abs().sum(-1).mean() > 0.2  # the drafter is clearly not the target


@pytest.mark.parametrize("params", PARAM_CASES)
@pytest.mark.parametrize("drafter", ["q", "argmax"])
def test_sampled_is_lossless(params, drafter):
    n = 6000 if drafter == "q" else 5000
    first, joint, rate = simulate(SampledAcceptor(), params, drafter, n, seed=101)
    print(f"acceptance rate {rate:.3f}")
    assert 0.1 < rate < 0.95  # both acceptances and rejections happen
    for name, stat, df, pval, forbidden in _check(first, joint, params, f"sampled/{drafter}"):
        assert forbidden == 0, f"{name}: emitted tokens the target's warped distribution forbids"
        assert pval > P_THRESHOLD, f"{name}: chi2={stat:.1f} df={df} p={pval:.3g}"


def test_wrong_residual_is_detected():
    params = SamplingParams(0.7, top_k=3, top_p=0.8)
    first, joint, _ = simulate(WrongResidualAcceptor(), params, "q", 5000, seed=101)
    res = _check(first, joint, params, "wrong-residual")
    assert min(r[3] for r in res) < P_THRESHOLD, res


def test_soft_q_with_argmax_drafting_is_detected():
    # the classic bug: drafting by argmax but handing the acceptor a soft q
    params = SamplingParams(1.0)
    first, joint, _ = simulate(SampledAcceptor(), params, "argmax-soft-q", 4000, seed=202)
    res = _check(first, joint, params, "soft-q/argmax")
    assert min(r[3] for r in res) < P_THRESHOLD, res


# ---------------------------------------------------------------------------------------- same seed, same output

VT = 8


def _toy_model(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits indexed by the last token, and a drafter table that agrees with it only partly."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(VT, VT, generator=g) * 1.5
    draft = target + torch.randn(VT, VT, generator=g) * 0.8
    return target, draft


def plain_decode(target: torch.Tensor, params: SamplingParams, seed: int, prompt_last: int, start: int, n: int):
    rng = PositionRandom(seed)
    out, last = [], prompt_last
    for pos in range(start, start + n):
        last = sample_at(warp(target[last], params), rng.uniform(pos))
        out.append(last)
    return out


def speculative_decode(acceptor, target, draft, params, seed, prompt_last, start, n):
    """Deterministic drafter (argmax of its table), k varying 0..4, sometimes an out-of-vocabulary id."""
    rng = PositionRandom(seed)
    out, last, pos, rnd = [], prompt_last, start, 0
    stats = {"accepted": 0, "rejected": 0}
    while len(out) < n:
        k = rnd % 5
        drafts, ctx = [], last
        for j in range(k):
            x = int(draft[ctx].argmax())
            if (rnd + j) % 11 == 7:
                x = VT + 3  # garbage id from a broken drafter: must be rejected, not crash
            drafts.append(x)
            ctx = x if x < VT else 0
        rows = torch.stack([target[last]] + [target[x if x < VT else 0] for x in drafts])
        res = acceptor.accept(VerifyRound(rows, drafts, None, params, rng, pos))
        stats["accepted"] += res.accepted
        stats["rejected"] += int(res.accepted < k and drafts[res.accepted] < VT)  # a real disagreement
        out.extend(res.tokens)
        pos += len(res.tokens)
        last = out[-1]
        rnd += 1
    return out[:n], stats


SAME_SEED_CASES = [
    (SampledAcceptor(), SamplingParams(0.7, top_k=3, top_p=0.8)),
    (SampledAcceptor(), SamplingParams(1.0)),
    (SampledAcceptor(), SamplingParams(1.3, top_k=5)),
    (SampledAcceptor(), SamplingParams(0.9, top_p=0.6)),
    (SampledAcceptor(), SamplingParams(0.0)),
    (GreedyAcceptor(), SamplingParams(0.0)),
    (PMinAcceptor(1.0), SamplingParams(0.8)),  # threshold never fires below p = 1: same as sampled
]


@pytest.mark.parametrize("acc,params", SAME_SEED_CASES)
def test_same_seed_same_output_as_plain_sampling(acc, params):
    target, draft = _toy_model(9)
    total = {"accepted": 0, "rejected": 0}
    outputs = set()
    for seed in range(6):
        want = plain_decode(target, params, seed, prompt_last=2, start=5, n=60)
        got, stats = speculative_decode(acc, target, draft, params, seed, prompt_last=2, start=5, n=60)
        assert got == want, f"seed {seed}"
        outputs.add(tuple(want))
        for key in total:
            total[key] += stats[key]
    assert total["accepted"] > 20 and total["rejected"] > 20, total  # the drafter is sometimes right, sometimes wrong
    if not params.greedy:
        assert len(outputs) == 6  # the seed matters


def test_same_seed_differs_when_the_rule_is_wrong():
    # control: an acceptor that accepts every draft does NOT reproduce plain sampling
    class AcceptAll:
        lossless = False
        needs_draft_probs = False

        def accept(self, verify):
            k = verify.k
            return verify.bonus(sample_at(warp(verify.target_logits[k], verify.params), verify.rng.uniform(verify.position + k)))

    target, draft = _toy_model(9)
    params = SamplingParams(0.7, top_k=3, top_p=0.8)
    want = plain_decode(target, params, 0, 2, 5, 60)
    got, _ = speculative_decode(AcceptAll(), target, draft, params, 0, 2, 5, 60)
    assert got != want


# ------------------------------------------------------------------------------------------------ p-min


def test_pmin_options_and_validation():
    acc = PMinAcceptor()
    assert acc.p_min == 0.1 and acc.lossless is False and acc.needs_draft_probs is False
    assert PMinAcceptor("0.25").p_min == 0.25  # options may arrive as strings
    for bad in (-0.1, 1.5, "abc", float("nan"), None):
        with pytest.raises(ConfigError):
            PMinAcceptor(bad)


def test_pmin_greedy_accepts_a_probable_non_argmax_token():
    logits = torch.tensor([[2.0, 1.8, -5.0, -5.0], [0.0, 0.0, 3.0, 0.0]])  # softmax(x=1) ~ 0.45
    params = SamplingParams(0.0)
    assert GreedyAcceptor().accept(VerifyRound(logits, [1], None, params, PositionRandom(0), 1)).tokens == [0]
    res = PMinAcceptor(0.1).accept(VerifyRound(logits, [1], None, params, PositionRandom(0), 1))
    assert (res.tokens, res.accepted) == ([1, 2], 1)
    res = PMinAcceptor(0.5).accept(VerifyRound(logits, [1], None, params, PositionRandom(0), 1))
    assert (res.tokens, res.accepted) == ([0], 0)


def test_pmin_at_zero_never_emits_a_token_the_warped_law_forbids():
    # top-k 1 leaves the argmax alone: p-min 0 must not force a draft the warped law gives 0
    logits = torch.tensor([[2.0, 1.8, -5.0, -5.0], [0.0, 0.0, 3.0, 0.0]])
    params = SamplingParams(1.0, top_k=1)
    for seed in range(20):
        res = PMinAcceptor(0.0).accept(VerifyRound(logits, [1], None, params, PositionRandom(seed), 1))
        assert (res.tokens, res.accepted) == ([0], 0), (seed, res)
    masked = torch.tensor([[2.0, float("-inf"), 0.0, 0.0], [0.0, 0.0, 3.0, 0.0]])  # greedy: a logit of -inf
    res = PMinAcceptor(0.0).accept(VerifyRound(masked, [1], None, SamplingParams(0.0), PositionRandom(0), 1))
    assert (res.tokens, res.accepted) == ([0], 0), res


def test_pmin_deviation_from_target_is_measured():
    # built for it: the target gives the drafted token 0.3 (not the argmax), the drafter always proposes
    # it; p-min 0.1 accepts it every time, so the first token is that token with probability 1 instead of 0.3
    probs = np.array([0.45, 0.3, 0.12, 0.08, 0.03, 0.02])
    logits = torch.tensor(np.log(probs), dtype=torch.float32)
    rows = torch.stack([logits, logits])
    params = SamplingParams(1.0)
    n = 6000
    results = {}
    for name, acc in (("p-min", PMinAcceptor(0.1)), ("sampled", SampledAcceptor())):
        counts = np.zeros(6)
        for s in range(n):
            counts[acc.accept(VerifyRound(rows, [1], None, params, PositionRandom(s), 1)).tokens[0]] += 1
        results[name] = 0.5 * np.abs(counts / n - probs).sum()
    analytic = 1 - probs[1]
    msg = (
        f"p-min(0.1) first-token TV distance from the target: {results['p-min']:.3f} "
        f"(analytic {analytic:.3f}); sampled on the same case: {results['sampled']:.3f}"
    )
    print(msg)
    warnings.warn(msg, Measurement)
    assert results["p-min"] > 0.5 and abs(results["p-min"] - analytic) < 0.03
    assert results["sampled"] < 4 / math.sqrt(n)

    # the same on the toy model with a sampling drafter: how far does p-min drift on an ordinary case?
    tparams = SamplingParams(1.0)
    first, joint, rate = simulate(PMinAcceptor(0.1), tparams, "q", 4000, seed=303)
    want_first, want_joint = expected_distributions(tparams)
    tv_first = 0.5 * np.abs(first / first.sum() - want_first).sum()
    tv_joint = 0.5 * np.abs(joint / joint.sum() - want_joint).sum()
    msg2 = (
        f"p-min(0.1) on the toy model (T1.0, q drafter): TV first {tv_first:.3f}, joint {tv_joint:.3f}, "
        f"acceptance {rate:.3f}"
    )
    print(msg2)
    warnings.warn(msg2, Measurement)
    assert tv_first > 0


# ------------------------------------------------------------------------------------------------ registry data


def test_registered_with_capabilities_and_options():
    from outrider.registry import build_registry

    registry = build_registry(third_party=False)
    for name, cls in (("greedy", GreedyAcceptor), ("sampled", SampledAcceptor), ("p-min", PMinAcceptor)):
        spec = registry.get("acceptor", name)
        assert spec.factory is cls
        assert isinstance(spec.create(), Acceptor)
    assert GreedyAcceptor.lossless and SampledAcceptor.lossless and not PMinAcceptor.lossless
    assert registry.get("acceptor", "p-min").capabilities["lossless"] is False
    assert set(registry.get("acceptor", "p-min").options) == {"p_min"}
    assert registry.get("acceptor", "p-min").options["p_min"].default == 0.1


class PositionalGreedy:
    """An acceptor whose accept takes (target_logits, draft_tokens, draft_probs, params, rng, position)."""

    lossless, needs_draft_probs = True, False

    def accept(self, target_logits, draft_tokens, draft_probs, params, rng, position):
        return AcceptResult([int(target_logits[0].argmax())], 0)


def test_an_acceptor_taking_several_arguments_is_refused_in_one_line(outrider_contract_fixtures):
    from outrider.plugins.drafters.lookup import LookupDrafter
    from outrider.spec.drafter_traits import DrafterTraits
    from outrider.spec.runner import Runner

    drafter = LookupDrafter()
    with pytest.raises(ConfigError, match=r"write accept\(self, verify\)"):
        Runner(outrider_contract_fixtures.target("llama"), drafter, PositionalGreedy(),
               DrafterTraits.of(drafter, draft_max=4), context=256)
    for acceptor in (GreedyAcceptor(), SampledAcceptor(), PMinAcceptor()):
        Runner(outrider_contract_fixtures.target("llama"), drafter, acceptor, DrafterTraits.of(drafter, draft_max=4),
               context=256)
