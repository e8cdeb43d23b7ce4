"""Warpers, position-coupled randomness and inverse-CDF sampling (outrider.spec.sampling).

Expected values come from hand formulas (math.exp) or numpy directly, never from the code under test.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from outrider.errors import ConfigError
from outrider.spec.random_streams import PositionRandom
from outrider.spec.sampling import SamplingParams, argmax, argmax_token, sample_at, sample_rows, warp


def _close(got: torch.Tensor, want: list[float], tol: float = 1e-6) -> None:
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(want, abs=tol)


# ------------------------------------------------------------------------------------------------ params


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": -0.2},
        {"top_k": -1},
        {"top_k": 2.5},
        {"seed": -3},
    ],
)
def test_params_rejects_bad_values(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_params_defaults_and_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (0.0, 0, 1.0, None)
    assert p.greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=7).greedy
    with pytest.raises(Exception):
        p.temperature = 1.0  # frozen


# ------------------------------------------------------------------------------------------------ warp

E = math.exp
LOGITS = [2.0, 1.0, 0.0, -1.0]


def test_warp_temperature_only():
    # T = 2: softmax of [1, 0.5, 0, -0.5]
    z = [E(1.0), E(0.5), E(0.0), E(-0.5)]
    s = sum(z)
    _close(warp(torch.tensor(LOGITS), SamplingParams(temperature=2.0)), [v / s for v in z])


def test_warp_top_k_at_half_temperature():
    # T = 0.5 -> [4, 2, 0, -2]; top-k 2 keeps the first two: [e^4, e^2] / (e^4 + e^2)
    s = E(4) + E(2)
    _close(warp(torch.tensor(LOGITS), SamplingParams(0.5, top_k=2)), [E(4) / s, E(2) / s, 0.0, 0.0])


def test_warp_top_k_then_top_p_keeps_one():
    # after top-k 2 at T=0.5 the first token has e^4/(e^4+e^2) = 0.881 >= 0.7: nucleus is that token alone
    assert E(4) / (E(4) + E(2)) > 0.7
    _close(warp(torch.tensor(LOGITS), SamplingParams(0.5, top_k=2, top_p=0.7)), [1.0, 0.0, 0.0, 0.0])


def test_warp_top_p_alone():
    # T = 1: p0 = e^2 / (e^2 + e + 1 + e^-1) = 0.644 < 0.7, p0 + p1 = 0.881 >= 0.7: keep two
    s_all = E(2) + E(1) + E(0) + E(-1)
    assert E(2) / s_all < 0.7 <= (E(2) + E(1)) / s_all
    s = E(2) + E(1)
    _close(warp(torch.tensor(LOGITS), SamplingParams(1.0, top_p=0.7)), [E(2) / s, E(1) / s, 0.0, 0.0])
    # top-p 0.9: 0.881 < 0.9 <= 0.968: keep three
    assert (E(2) + E(1)) / s_all < 0.9 <= (E(2) + E(1) + 1) / s_all
    s3 = E(2) + E(1) + 1
    _close(warp(torch.tensor(LOGITS), SamplingParams(1.0, top_p=0.9)), [E(2) / s3, E(1) / s3, 1 / s3, 0.0])


def test_warp_top_k_then_top_p_keeps_three():
    # T = 0.5, top-k 3: [e^4, e^2, 1] / S; masses before each: 0, 0.867, 0.984 -> top-p 0.99 keeps all three
    s = E(4) + E(2) + 1
    assert (E(4) + E(2)) / s < 0.99
    _close(warp(torch.tensor(LOGITS), SamplingParams(0.5, top_k=3, top_p=0.99)), [E(4) / s, E(2) / s, 1 / s, 0.0])
    # top-p 0.95: 0.867 < 0.95 <= 0.984 -> keeps two
    s2 = E(4) + E(2)
    _close(warp(torch.tensor(LOGITS), SamplingParams(0.5, top_k=3, top_p=0.95)), [E(4) / s2, E(2) / s2, 0.0, 0.0])


def test_warp_order_is_temperature_then_top_k_then_top_p():
    # top-k 2 first renormalises to e^2/(e^2+e) = 0.731 >= 0.7 -> one token; top-p first would keep two
    assert E(2) / (E(2) + E(1)) >= 0.7 > E(2) / (E(2) + E(1) + 1 + E(-1))
    _close(warp(torch.tensor(LOGITS), SamplingParams(1.0, top_k=2, top_p=0.7)), [1.0, 0.0, 0.0, 0.0])
    # temperature before top-p: at T=0.5 p0 = e^4/S = 0.866 >= 0.7 -> one token (at T=1 it would be two)
    assert E(4) / (E(4) + E(2) + 1 + E(-2)) >= 0.7
    _close(warp(torch.tensor(LOGITS), SamplingParams(0.5, top_p=0.7)), [1.0, 0.0, 0.0, 0.0])


def test_warp_top_p_boundary_and_ties():
    # four equal logits: exactly 0.25 each. Mass before the 3rd token is exactly 0.5 >= top_p, so the
    # smallest set with mass >= 0.5 is two tokens; ties go to the lower index
    _close(warp(torch.zeros(4), SamplingParams(1.0, top_p=0.5)), [0.5, 0.5, 0.0, 0.0])
    _close(warp(torch.zeros(4), SamplingParams(1.0, top_p=0.51)), [1 / 3, 1 / 3, 1 / 3, 0.0])


def test_warp_scatters_back_to_vocabulary_order():
    perm = [2, 3, 0, 1]  # logits [0, -1, 2, 1]
    logits = torch.tensor([LOGITS[i] for i in perm])
    s = E(2) + E(1)
    _close(warp(logits, SamplingParams(1.0, top_p=0.7)), [0.0, 0.0, E(2) / s, E(1) / s])
    s2 = E(4) + E(2)
    _close(warp(logits, SamplingParams(0.5, top_k=2)), [0.0, 0.0, E(4) / s2, E(2) / s2])


def test_warp_greedy_is_one_hot_argmax():
    out = warp(torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, -1.0, -2.0, 5.0]]), SamplingParams(0.0, top_k=2, top_p=0.3))
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]  # ties: first index


def test_warp_top_k_at_least_vocab_is_off():
    t = torch.tensor(LOGITS)
    assert torch.equal(warp(t, SamplingParams(1.0, top_k=4)), warp(t, SamplingParams(1.0)))
    assert torch.equal(warp(t, SamplingParams(1.0, top_k=100)), warp(t, SamplingParams(1.0)))


@pytest.mark.parametrize("params", [SamplingParams(0.7), SamplingParams(0.7, 3, 0.8), SamplingParams(1.3, 0, 0.5)])
def test_warp_batched_rows_equal_single_rows_and_sum_to_one(params):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 50, generator=g) * 3
    out = warp(x, params)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert torch.allclose(out.sum(-1), torch.ones(2, 5), atol=1e-5)
    assert (out >= 0).all()
    for i in range(2):
        for j in range(5):
            assert torch.equal(out[i, j], warp(x[i, j], params))
    if params.top_k:
        assert ((out > 0).sum(-1) <= params.top_k).all()


def _top_p_by_full_stable_sort(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The definition read literally (and the code before the sort went): sort the whole row, stable,
    softmax the sorted values, keep the prefix whose preceding mass is below top_p, renormalise, put back."""
    x = x.to(torch.float32) / params.temperature
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    probs = torch.softmax(vals, dim=-1)
    cum = torch.cumsum(probs, dim=-1)
    keep = (cum - probs) < params.top_p
    keep[..., 0] = True
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return torch.zeros_like(x).scatter_(-1, idx, probs / probs.sum(dim=-1, keepdim=True))


@pytest.mark.parametrize("vocab", [2048, 3001, 49152])
def test_warp_top_p_is_the_full_stable_sort_bit_for_bit(vocab):
    """warp sorts only values and orders only the kept tokens; the result is the full sort's, bit for bit,
    with ties (logits on a coarse grid, as a quantized model gives them) cut by the top-p boundary too."""
    g = torch.Generator().manual_seed(vocab)
    peaked = torch.randn(4, vocab, generator=g) * 2
    peaked[torch.arange(4), torch.randint(0, vocab, (4,), generator=g)] += 9.0
    tied = torch.round(torch.randn(4, vocab, generator=g) * 3) / 2  # a few dozen distinct values
    flat = torch.randn(2, vocab, generator=g) * 0.1
    for x in (peaked, tied, flat):
        for params in (SamplingParams(0.7, top_p=0.9), SamplingParams(1.0, top_p=0.95),
                       SamplingParams(0.3, top_p=0.5), SamplingParams(1.5, top_p=0.999)):
            want = _top_p_by_full_stable_sort(x, params)
            assert torch.equal(warp(x, params), want), params
            assert all(torch.equal(warp(x[i], params), want[i]) for i in range(x.shape[0])), params


@pytest.mark.torch_threads(2)  # a lone row's sums may be split across threads; a batch's are not
def test_warp_top_p_of_a_wide_row_alone_equals_it_in_a_batch_on_two_threads():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 70_000, generator=g) * 2
    for params in (SamplingParams(0.7, top_p=0.9), SamplingParams(0.7), SamplingParams(0.7, top_k=40, top_p=0.9)):
        batch = warp(x, params)
        assert all(torch.equal(warp(x[i], params), batch[i]) for i in range(3)), params


def test_argmax_matches_torch_on_ties_nan_and_half_precision():
    rows = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("nan"), 1.0, float("nan"), 2.0], [-5.0, -5.0, -5.0, -5.0]])
    for x in (rows, rows.to(torch.float16), rows.to(torch.bfloat16), rows.t().contiguous().t()):
        assert argmax(x).tolist() == [1, 0, 0]  # first index on ties; a NaN counts as the maximum
        assert [argmax_token(r) for r in x] == [1, 0, 0]
    g = torch.Generator().manual_seed(2)
    wide = torch.round(torch.randn(5, 50_000, generator=g) * 4)
    assert torch.equal(argmax(wide), torch.argmax(wide, dim=-1))


def test_sample_at_equals_the_whole_row_float64_cumsum():
    """sample_at sums only the nonzero entries; the token is the one the whole-row float64 running sum picks."""
    g = torch.Generator().manual_seed(4)
    for _ in range(40):
        row = torch.softmax(torch.randn(5000, generator=g) * 3, dim=-1)
        row[torch.rand(5000, generator=g) < 0.9] = 0.0  # a top-p row: mostly zeros
        cum = torch.cumsum(row.double(), dim=0)
        for u in (*torch.rand(20, generator=g, dtype=torch.float64).tolist(), 0.0, float(np.nextafter(1.0, 0.0))):
            i = int(torch.searchsorted(cum, u * cum[-1], right=True))
            want = i if i < 5000 else int(torch.nonzero(row)[-1])
            assert sample_at(row, u) == want


def test_warp_accepts_half_precision():
    x = torch.tensor(LOGITS, dtype=torch.bfloat16)
    out = warp(x, SamplingParams(1.0))
    assert out.dtype == torch.float32
    s = sum(E(v) for v in LOGITS)
    _close(out, [E(v) / s for v in LOGITS], tol=1e-5)


# ------------------------------------------------------------------------------------------------ randomness


def test_position_random_equals_one_big_numpy_draw():
    n = 3 * PositionRandom.CHUNK + 17
    want = np.random.default_rng(1234).random(n)
    r = PositionRandom(1234)
    got = [r.uniform(i) for i in range(n)]
    assert got == want.tolist()
    # asked out of order (far position first) -> same values
    r2 = PositionRandom(1234)
    order = [n - 1, 5, 2 * PositionRandom.CHUNK + 3, 0, PositionRandom.CHUNK]
    assert [r2.uniform(i) for i in order] == [float(want[i]) for i in order]


def test_position_random_aux_and_draft_streams():
    n = 2500
    r = PositionRandom(99)
    aux = [r.uniform_aux(i) for i in range(n)]
    drf = [r.uniform_draft(i) for i in range(n)]
    main = [r.uniform(i) for i in range(n)]
    assert aux == np.random.default_rng([99, 1]).random(n).tolist()
    assert drf == np.random.default_rng([99, 2]).random(n).tolist()
    # independent-looking streams: correlation ~ N(0, 1/n)
    for a, b in [(main, aux), (main, drf), (aux, drf)]:
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(n)


def test_position_random_seed_none_is_reported_and_reproducible():
    r = PositionRandom(None)
    assert isinstance(r.seed, int) and r.seed >= 0
    again = PositionRandom(r.seed)
    assert [r.uniform(i) for i in range(10)] == [again.uniform(i) for i in range(10)]
    assert [PositionRandom(1).uniform(i) for i in range(10)] != [PositionRandom(2).uniform(i) for i in range(10)]


def test_position_random_rejects_bad_input():
    with pytest.raises(ValueError):
        PositionRandom(0).uniform(-1)
    with pytest.raises(ConfigError):
        PositionRandom(-5)


# ------------------------------------------------------------------------------------------------ sample_at


def test_sample_at_vocabulary_order_and_edges():
    p = torch.tensor([0.2, 0.5, 0.3])
    assert [sample_at(p, u) for u in (0.0, 0.1, 0.3, 0.65, 0.75, 0.999)] == [0, 0, 1, 1, 2, 2]
    one = torch.tensor([0.0, 0.0, 1.0, 0.0])
    below_one = float(np.nextafter(1.0, 0.0))
    assert sample_at(one, 0.0) == 2 and sample_at(one, below_one) == 2
    # zero-probability tokens are never chosen, even at the ends of [0, 1)
    head_zero = torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0])
    assert sample_at(head_zero, 0.0) == 2
    assert sample_at(head_zero, below_one) == 3
    # unnormalised rows are fine
    assert sample_at(torch.tensor([2.0, 6.0, 2.0]), 0.5) == 1
    assert sample_at(torch.tensor([2.0, 6.0, 2.0]), 0.85) == 2


def test_sample_at_refuses_rows_it_cannot_sample():
    for bad in ([0.0, 0.0, 0.0], [float("nan"), 0.5, 0.5], [float("inf"), 1.0, 0.0], [0.5, -0.25, 0.75]):
        with pytest.raises(ValueError):
            sample_at(torch.tensor(bad), 0.5)
        with pytest.raises(ValueError):
            sample_rows(torch.tensor([bad, [0.5, 0.25, 0.25]]), [0.5, 0.5])


def test_sample_at_is_exact_inverse_cdf_on_a_grid():
    # with u on a regular grid of N points, token i is hit round(p_i * N) times up to +-1
    probs = np.array([0.1, 0.0, 0.25, 0.05, 0.0, 0.4, 0.2])
    n = 5000
    counts = np.zeros(len(probs))
    pt = torch.tensor(probs, dtype=torch.float32)
    for j in range(n):
        counts[sample_at(pt, (j + 0.5) / n)] += 1
    assert counts[probs == 0].sum() == 0
    assert np.abs(counts - probs * n).max() <= 2


def test_sample_at_empirical_frequencies_tv_bound():
    g = np.random.default_rng(7)
    probs = g.dirichlet(np.ones(8))
    n = 40000
    us = g.random(n)
    pt = torch.tensor(probs, dtype=torch.float32)
    counts = np.bincount(sample_rows(pt.expand(n, -1), us.tolist()), minlength=8)
    tv = 0.5 * np.abs(counts / n - probs).sum()
    # E[TV] <= 0.5 * sqrt(V / n); McDiarmid: P(TV > E + t) <= exp(-2 n t^2), t = 4/sqrt(n) -> e^-32
    bound = 0.5 * math.sqrt(8 / n) + 4 / math.sqrt(n)
    assert tv < bound, (tv, bound)


def test_sample_rows_equals_sample_at_per_row():
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(9, 3000, generator=g) * 4, dim=-1)
    us = torch.rand(9, generator=g, dtype=torch.float64).tolist()
    assert sample_rows(probs, us) == [sample_at(probs[i], us[i]) for i in range(9)]
    assert sample_rows(probs[:0], []) == []


def test_greedy_warp_then_sample_is_argmax_for_any_u():
    logits = torch.tensor([0.3, 2.0, -1.0, 1.9])
    p = warp(logits, SamplingParams(0.0))
    assert {sample_at(p, u) for u in (0.0, 0.3, 0.7, float(np.nextafter(1.0, 0.0)))} == {1}


def test_a_temperature_below_the_floor_is_greedy_everywhere():
    """1e-9 cannot be sampled with in float32 (logits / t overflow): it is greedy, as vLLM's rule."""
    from outrider.spec.sampling import GREEDY_BELOW

    logits = torch.tensor([0.5, 2.0, -1.0, 1.9])
    for t in (1e-9, 1e-40, GREEDY_BELOW / 2):
        params = SamplingParams(t)
        assert params.greedy
        assert warp(logits, params).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert not SamplingParams(GREEDY_BELOW).greedy


# ------------------------------------------------------------------------------------------------------
# sample_logits: one row's token without warping it (the CPU kernels' sampler), against a float64 law the
# test computes itself: temperature, then top-k, top-p (the smallest rank prefix holding top_p) and min-p on
# the tempered distribution, then the inverse CDF in vocabulary order.

def oracle_law(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, float]:
    """The sampled law in float64, and the least margin by which a token's mass before it clears top_p
    (a token within rounding of that edge may go either way)."""
    z = logits.astype(np.float64) / params.temperature
    order = np.lexsort((np.arange(z.size), -z))  # z descending, then index: a stable descending sort
    if 0 < params.top_k < z.size:
        order = order[:params.top_k]
    e = np.exp(z - z.max())
    ranked = e[order]
    mass = ranked.sum()
    keep = np.zeros(z.size, dtype=bool)
    margin = math.inf
    if params.top_p < 1.0:
        before = np.cumsum(ranked) - ranked
        margin = float(np.abs(before - params.top_p * mass).min() / mass)
        kept = before < params.top_p * mass
        kept[0] = True
        keep[order[kept]] = True
    else:
        keep[order] = True
    if params.min_p > 0:
        keep &= z >= z.max() + math.log(params.min_p)
    law = np.where(keep, e, 0.0)
    return law / law.sum(), margin


def language_model_row(vocab: int, seed: int) -> torch.Tensor:
    """Logits shaped like a model's: a broad low floor and a few hundred tokens well above it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * 2.0
    top = torch.randint(vocab, (300,), generator=g)
    x[top] += 6.0 + torch.rand(300, generator=g) * 6.0
    return x


KERNEL_PARAMS = [SamplingParams(0.8), SamplingParams(1.0, top_p=0.95), SamplingParams(0.7, min_p=0.05),
                 SamplingParams(0.7, top_k=40, top_p=0.95, min_p=0.05), SamplingParams(1.3, top_k=5),
                 SamplingParams(0.5, top_p=0.6), SamplingParams(1.0, top_k=2000, top_p=0.9)]


@pytest.mark.parametrize("params", KERNEL_PARAMS, ids=str)
def test_sample_logits_draws_the_token_whose_interval_holds_u(params):
    """u at the middle of each kept token's interval of the float64 law picks that token: the kept set, its
    vocabulary order and the interval widths are all the law's (a wrong filter, order or normalisation fails)."""
    from outrider.native import NativeUnavailable, load
    from outrider.spec.sampling import sample_logits

    try:
        load()
    except NativeUnavailable as e:
        pytest.skip(str(e))
    rows = ((x, *oracle_law(x.numpy(), params)) for x in (language_model_row(262_144, seed) for seed in range(20)))
    # rows with no token within rounding of top-p's edge (a float32 sum of the row moves it by ~1e-5)
    rows = list(itertools.islice(((x, law) for x, law, margin in rows if margin > 1e-5), 3))
    assert len(rows) == 3
    for logits, law in rows:
        kept = np.flatnonzero(law)
        cum = np.cumsum(law[kept])
        starts = np.concatenate([[0.0], cum[:-1]])
        wide = law[kept] > 1e-5  # an interval far wider than float32's rounding of the sums
        for token, start, end in list(zip(kept[wide], starts[wide], cum[wide]))[:200]:
            assert sample_logits(logits, params, (start + end) / 2) == token
        assert sample_logits(logits, params, 0.0) == kept[0]
        assert sample_logits(logits, params, 1.0 - 1e-12) == kept[-1]


def test_sample_logits_follows_the_law_and_falls_back_to_the_reference():
    from outrider.native import NativeUnavailable, load
    from outrider.spec.sampling import sample_logits
    from outrider.testing.stats import chi2_test

    try:
        load()
    except NativeUnavailable as e:
        pytest.skip(str(e))
    params = SamplingParams(1.0, top_p=0.9, min_p=0.001)
    logits = language_model_row(262_144, 7)
    law, _ = oracle_law(logits.numpy(), params)
    us = np.random.default_rng(0).random(4000)
    counts = np.bincount([sample_logits(logits, params, float(u)) for u in us], minlength=law.size)
    _, _, p_value, forbidden = chi2_test(counts, law)
    assert forbidden == 0 and p_value > 1e-3
    # what the kernel cannot decide goes to the reference: the same error, the argmax at temperature 0,
    # a small vocabulary drawn as sample_at(warp) draws it
    nan_row = logits.clone()
    nan_row[3] = float("nan")
    with pytest.raises(ValueError):
        sample_logits(nan_row, params, 0.5)
    assert sample_logits(logits, SamplingParams(0.0), 0.5) == int(logits.argmax())
    small = language_model_row(1000, 1)
    for u in (0.1, 0.5, 0.9):
        assert sample_logits(small, params, u) == sample_at(warp(small, params), u)


def test_sample_logits_never_draws_a_token_without_probability():
    """Masked logits (-FLT_MAX, -inf once tempered) and exps that underflow: such tokens have no probability in
    the reference and are never drawn, whatever the filters and u, even at u's edges."""
    from outrider.native import NativeUnavailable, load
    from outrider.spec.sampling import sample_logits

    try:
        load()
    except NativeUnavailable as e:
        pytest.skip(str(e))
    logits = language_model_row(262_144, 3)
    masked = torch.zeros(logits.shape[0], dtype=torch.bool)
    masked[::3] = True
    masked[-1] = True  # the last token too, where a fallback to the row's end would land
    logits[masked] = -3.4e38
    for params in (SamplingParams(0.5, top_k=1000, top_p=0.9), SamplingParams(0.5, top_p=0.999999),
                   SamplingParams(0.5), SamplingParams(0.5, top_k=200_000), SamplingParams(0.5, min_p=1e-30)):
        for u in (0.0, 0.3, 0.999999999, 1.0 - 1e-16):
            token = sample_logits(logits, params, u)
            assert not masked[token], (params, u, token)
