"""A drafter's traits are settled once, at assembly, from the created instance: its attributes win over the
registered capabilities, and the runner reads the frozen result, never the drafter's attributes again."""

from __future__ import annotations

import dataclasses

import pytest

from outrider.assembly import assemble
from outrider.config import resolve_config
from outrider.plugins.acceptors.greedy import GreedyAcceptor
from outrider.plugins.drafters.draft_model import DraftModelDrafter
from outrider.plugins.drafters.lookup import LookupDrafter
from outrider.registry import default_registry
from outrider.spec.chain import DrafterChain
from outrider.spec.drafter import DEFAULT_KIND, NEEDS_TARGET_KV, Draft
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.runner import Runner
from outrider.spec.sampling import SamplingParams

SEEDED = SamplingParams(temperature=0.8, seed=3)


class Bare:
    """A drafter with none of the optional parts: no capability attributes, no draft_kind, no observe."""

    def setup(self, target):
        pass

    def begin(self, prompt, params, controls):
        return params

    def propose(self, state, tokens, k):
        return Draft(tokens[-k:])

    def rollback(self, state, length):
        pass


def test_the_instance_wins_over_the_registration_and_the_registration_over_the_defaults():
    assert DrafterTraits.of(Bare()) == DrafterTraits()
    declared = {"gives_draft_probs": True, "needs": frozenset({NEEDS_TARGET_KV}), "target_architecture": "gemma4"}
    traits = DrafterTraits.of(Bare(), declared, draft_max=5)
    assert (traits.gives_draft_probs, traits.may_give_draft_probs, traits.reads_the_target) == (True, True, True)
    assert (traits.draft_max, traits.capabilities["target_architecture"]) == (5, "gemma4")
    switched = Bare()
    switched.gives_draft_probs = False  # an option turned q off on this instance
    assert not DrafterTraits.of(switched, declared).gives_draft_probs
    assert DrafterTraits.of(switched, declared).capabilities["gives_draft_probs"] is False


def test_optional_methods_are_seen_once(outrider_contract_fixtures):
    assert (DrafterTraits.of(Bare()).says_draft_kind, DrafterTraits.of(Bare()).observes) == (False, False)
    assert DrafterTraits.of(LookupDrafter()).says_draft_kind
    chain = DrafterChain([LookupDrafter(), Bare()], ["lookup", "bare"])
    assert not DrafterTraits.of(chain).observes  # no member reads the target: the chain has no observe
    path = str(outrider_contract_fixtures.tiny_draft_llama_path)
    sampling = DrafterChain([LookupDrafter(), DraftModelDrafter(model=path, sample=True)], ["lookup", "draft-model"])
    traits = DrafterTraits.of(sampling)
    assert traits.may_give_draft_probs and not traits.gives_draft_probs


def test_the_traits_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DrafterTraits().gives_draft_probs = True


def test_the_runner_reads_the_traits_not_the_drafter(outrider_contract_fixtures):
    target = outrider_contract_fixtures.target("llama")
    drafter = Bare()
    runner = Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=2), context=64)
    drafter.gives_draft_probs = True  # too late: assembly settled it
    drafter.draft_kind = lambda state, tokens: None  # would stop every draft, if asked
    assert not runner.lengths_change_the_output(SEEDED)
    list(runner.generate([5, 6, 7, 8], 6, SamplingParams()))
    assert runner.stats.drafted > 0 and set(runner.stats.chosen_by_kind) == {DEFAULT_KIND.name}


def test_assembly_settles_the_instance_s_traits_with_draft_max(outrider_contract_fixtures):
    fx = outrider_contract_fixtures
    config = resolve_config({"model": str(fx.tiny_llama_path), "drafter": "draft-model",
                             "draft_model": str(fx.tiny_draft_llama_path), "draft_max": 3, "temperature": 0.8},
                            None, {}, option_flags=[("drafter.sample", "true")])
    runner = assemble(config).runner
    assert runner.traits.draft_max == 3 and runner.draft_length.n == 3
    assert runner.traits.gives_draft_probs  # the registration says False; this instance samples
    assert default_registry().get("drafter", "draft-model").capabilities["gives_draft_probs"] is False
    assert runner.lengths_change_the_output(SEEDED)
