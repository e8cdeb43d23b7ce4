"""llama-server's min_p and repeat/presence/frequency penalties (with repeat_last_n), exact under speculation.

Oracles: numbers worked out by hand (math.exp) for the filter and the formula; plain decoding with the
penalties written as the obvious loop (tests/oracles/penalties.py: a fresh forward per token, the window
counted afresh) for what speculation emits; the model's own tempered softmax for the min-p set.
"""

from __future__ import annotations

import math

import pytest
import torch

from oracles.penalties import plain_greedy_penalised, plain_sampled_penalised
from outrider.errors import ConfigError
from outrider.plugins.acceptors.greedy import GreedyAcceptor
from outrider.plugins.acceptors.sampled import SampledAcceptor
from outrider.plugins.drafters.draft_model import DraftModelDrafter
from outrider.plugins.drafters.lookup import LookupDrafter
from outrider.plugins.drafters.none import NoDrafter
from outrider.spec.drafter import Draft, DrafterBase
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.penalties import ContextPenalties
from outrider.spec.runner import Runner
from outrider.spec.sampling import SamplingParams, warp
from outrider.testing.fixtures import cpu_target, plain_greedy
from outrider.testing.toy import model_next_logits
from outrider.testing.tiny_models import write_tiny_llama

E = math.exp


# ------------------------------------------------------------------------------------------------ params


@pytest.mark.parametrize("kwargs", [{"min_p": -0.1}, {"min_p": 1.5}, {"min_p": float("nan")},
                                    {"repeat_penalty": 0.0}, {"repeat_penalty": -1.0},
                                    {"repeat_penalty": float("inf")}, {"presence_penalty": float("nan")},
                                    {"frequency_penalty": float("inf")}, {"repeat_last_n": -2},
                                    {"repeat_last_n": 1.5}])
def test_params_reject_bad_values_naming_the_field(kwargs):
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_penalties_are_off_unless_one_changes_a_logit():
    assert not SamplingParams().penalizes
    assert not SamplingParams(repeat_penalty=1.5, repeat_last_n=0).penalizes  # llama.cpp's 0: off
    assert SamplingParams(repeat_penalty=1.1).penalizes
    assert SamplingParams(presence_penalty=-0.5, repeat_last_n=-1).penalizes
    assert SamplingParams(frequency_penalty=0.1).penalizes


# ------------------------------------------------------------------------------------------------ min_p

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0])


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_probable():
    # at T = 1, p_i / p_max = e^(l_i - 2): 1, e^-1 = 0.368, e^-2 = 0.135, e^-3 = 0.050
    got = warp(LOGITS, SamplingParams(1.0, min_p=0.3))
    assert got.tolist() == pytest.approx([E(2) / (E(2) + E(1)), E(1) / (E(2) + E(1)), 0, 0], abs=1e-6)
    got = warp(LOGITS, SamplingParams(1.0, min_p=0.1))
    z = E(2) + E(1) + E(0)
    assert got.tolist() == pytest.approx([E(2) / z, E(1) / z, E(0) / z, 0], abs=1e-6)
    assert warp(LOGITS, SamplingParams(1.0, min_p=1.0)).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert torch.equal(warp(LOGITS, SamplingParams(1.0, min_p=0.0)), warp(LOGITS, SamplingParams(1.0)))


def test_min_p_is_measured_after_temperature_as_transformers_and_vllm_order_it():
    # at T = 2 the tempered ratios are e^-0.5 = 0.61 and e^-1 = 0.37, both >= 0.3, e^-1.5 = 0.22 is not;
    # untempered only token 1 would pass (llama.cpp's order)
    got = warp(LOGITS, SamplingParams(2.0, min_p=0.3))
    z = E(1) + E(0.5) + E(0)
    assert got.tolist() == pytest.approx([E(1) / z, E(0.5) / z, E(0) / z, 0], abs=1e-6)


def test_min_p_after_top_k_and_top_p_keeps_their_intersection():
    # top-p 0.9 alone keeps three tokens (the two most probable hold 0.88), min-p 0.3 alone two
    z4 = E(2) + E(1) + E(0) + E(-1)
    assert (E(2) + E(1)) / z4 < 0.9
    assert int((warp(LOGITS, SamplingParams(1.0, top_p=0.9)) > 0).sum()) == 3
    got = warp(LOGITS, SamplingParams(1.0, top_p=0.9, min_p=0.3))
    assert got.tolist() == pytest.approx([E(2) / (E(2) + E(1)), E(1) / (E(2) + E(1)), 0, 0], abs=1e-6)
    got = warp(LOGITS, SamplingParams(1.0, top_k=1, min_p=0.01))
    assert got.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_min_p_changes_nothing_at_temperature_zero():
    assert warp(LOGITS, SamplingParams(0.0, min_p=0.99)).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_min_p_rows_alone_equal_rows_in_a_batch():
    x = torch.randn(3, 70, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(0.8, top_k=20, min_p=0.05)
    batch = warp(x, params)
    for i in range(3):
        assert torch.equal(batch[i], warp(x[i], params))


# ------------------------------------------------------------------------------------------------ penalties


def test_penalty_formula_by_hand_row_by_row_with_the_window_sliding_over_the_drafts():
    params = SamplingParams(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, repeat_last_n=3)
    logits = torch.tensor([[2.0, 1.0, -1.0, 3.0]] * 3)
    before = logits.clone()
    got = ContextPenalties(params, [3, 0, 1, 1]).apply(logits, [2, 2])
    want = [
        # window [0, 1, 1]: token 0 (count 1) 2/2 - (0.25 + 0.5); token 1 (count 2) 1/2 - (0.5 + 0.5)
        [0.25, -0.5, -1.0, 3.0],
        # window [1, 1, 2]: token 0 has left it; token 2 (count 1, negative) -1*2 - 0.75
        [2.0, -0.5, -2.75, 3.0],
        # window [1, 2, 2]: token 1 (count 1) 0.5 - 0.75; token 2 (count 2) -2 - (0.5 + 0.5)
        [2.0, -0.25, -3.0, 3.0],
    ]
    assert got.tolist() == want
    assert torch.equal(logits, before)  # the model's logits are left as they were


def test_penalties_over_the_whole_context_and_as_tokens_become_certain():
    params = SamplingParams(repeat_penalty=1.0, presence_penalty=1.0, frequency_penalty=0.5, repeat_last_n=-1)
    penalties = ContextPenalties(params, [1, 1, 1])
    row = torch.tensor([0.0, 4.0, 4.0])
    assert penalties.apply(row, []).tolist() == [0.0, 4.0 - (3 * 0.5 + 1.0), 4.0]
    penalties.extend([2, 1])
    assert penalties.apply(row, []).tolist() == [0.0, 4.0 - (4 * 0.5 + 1.0), 4.0 - (0.5 + 1.0)]
    short = ContextPenalties(SamplingParams(presence_penalty=1.0, repeat_last_n=2), [1, 1, 1])
    short.extend([2, 2])  # the window is [2, 2]: token 1 has left it
    assert short.apply(row, []).tolist() == [0.0, 4.0, 4.0 - (2 * 0.0 + 1.0)]


# ------------------------------------------------------------------------------------------------ under speculation


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sampling-fields")
    return {"target": cpu_target(write_tiny_llama(folder / "llama.gguf", seed=0)),
            "draft_path": write_tiny_llama(folder / "llama_draft.gguf", seed=1, n_layers=1)}


PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
N = 32


class RepeatingDrafter(DrafterBase):
    """Drafts the context's last tokens again (x_i = the token i back from the end, then the last once more):
    a round whose rows repeat what earlier rows drafted, so each row's counts differ from the round's first."""

    def propose(self, state, tokens, k):
        return Draft([tokens[-1 - (i % 2)] for i in range(k)])


class KnownContinuationDrafter(DrafterBase):
    """Drafts the continuation plain decoding with the penalties gives (known in advance): every row must
    count the drafts before it for these drafts to be kept."""

    def __init__(self, continuation):
        self.continuation = continuation

    def propose(self, state, tokens, k):
        done = len(tokens) - len(PROMPT)
        return Draft(self.continuation[done:done + k])


def _run(target, drafter, acceptor, params, n=N, draft_max=4):
    drafter.setup(target)
    runner = Runner(target, drafter, acceptor, DrafterTraits.of(drafter, draft_max=draft_max), context=256)
    return list(runner.generate(PROMPT, n, params)), runner.stats


def _once_per_round(monkeypatch):
    """The mistake the per-row tests must catch: every row of a round penalised with its first row's counts."""
    apply = ContextPenalties.apply

    def first_rows_counts(self, logits, drafts):
        if logits.dim() == 1:
            return apply(self, logits, [])
        return torch.stack([apply(self, row, []) for row in logits])

    monkeypatch.setattr(ContextPenalties, "apply", first_rows_counts)


GREEDY_PENALTIES = [
    SamplingParams(repeat_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5),
    SamplingParams(presence_penalty=2.0, repeat_last_n=3),
    SamplingParams(repeat_penalty=1.3, frequency_penalty=0.7, repeat_last_n=-1, min_p=0.5),
]


@pytest.mark.parametrize("params", GREEDY_PENALTIES)
def test_greedy_with_penalties_under_speculation_is_plain_greedy_with_penalties(tiny, params, monkeypatch):
    target = tiny["target"]
    expected = plain_greedy_penalised(target.model, PROMPT, N, params)
    assert expected != plain_greedy(target.model, PROMPT, N)  # the penalties change this output
    drafters = {"none": NoDrafter, "lookup": lambda: LookupDrafter(min_n=1), "repeating": RepeatingDrafter,
                "known": lambda: KnownContinuationDrafter(expected),
                "draft-model": lambda: DraftModelDrafter(p_min=0.0, model=str(tiny["draft_path"]))}
    for name, new in drafters.items():
        for acceptor in (GreedyAcceptor(), SampledAcceptor()):
            out, stats = _run(target, new(), acceptor, params)
            assert out == expected, (name, type(acceptor).__name__)
            if name not in ("none", "lookup"):  # lookup finds no match in text the penalties keep from repeating
                assert stats.drafted > 0, name
    known, stats = _run(target, KnownContinuationDrafter(expected), GreedyAcceptor(), params)
    assert stats.accepted == stats.drafted  # every row counted the drafts before it
    # a round penalised once, with its first row's counts, keeps a draft the next row should have penalised
    _once_per_round(monkeypatch)
    assert _run(target, drafters["known"](), GreedyAcceptor(), params)[0] != expected


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_sampling_with_penalties_and_min_p_under_speculation_is_plain_sampling(tiny, seed, monkeypatch):
    target = tiny["target"]
    params = SamplingParams(0.9, min_p=0.05, repeat_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                            repeat_last_n=8, seed=seed)
    expected = plain_sampled_penalised(target.model, PROMPT, N, params)
    for new in (NoDrafter, lambda: LookupDrafter(min_n=1), RepeatingDrafter):
        out, stats = _run(target, new(), SampledAcceptor(), params)
        assert out == expected


def test_sampled_with_min_p_never_emits_a_token_outside_the_min_p_set(tiny):
    """A drafter that samples from q (its own min-p law) with the Leviathan rule, at a temperature that gives
    the tokens min-p removes real mass: over many generations each emitted token is checked against the
    model's own softmax at that temperature after its context."""
    target = tiny["target"]
    min_p, generations, n, temperature = 0.3, 30, 6, 2.0

    def outside(params):
        drafter = DraftModelDrafter(p_min=0.0, sample=True, model=str(tiny["draft_path"]))
        drafter.setup(target)
        runner = Runner(target, drafter, SampledAcceptor(), DrafterTraits.of(drafter, draft_max=3), context=64)
        found = drafted = 0
        for s in range(generations):
            out = list(runner.generate(PROMPT, n, params.__class__(**{**params.__dict__, "seed": s})))
            drafted += runner.stats.drafted
            for i, token in enumerate(out):
                p = torch.softmax(model_next_logits(target.model, PROMPT + out[:i]).double() / temperature, dim=-1)
                found += int(p[token] < min_p * p.max())
        assert drafted > 0
        return found

    assert outside(SamplingParams(temperature, min_p=min_p)) == 0
    assert outside(SamplingParams(temperature)) > 0  # without min-p such tokens are drawn: the check can see them
