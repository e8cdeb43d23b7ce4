"""Combined drafters (`--drafter lookup,mtp`): the first member with a draft drafts the round, every member
keeps its state, `--draft-max auto` learns each member's kinds apart, and the output stays plain decoding's."""

from __future__ import annotations

import pytest

from outrider.assembly import drafter_spec
from outrider.errors import ConfigError
from outrider.plugins.acceptors.greedy import GreedyAcceptor
from outrider.plugins.drafters.lookup import LookupDrafter
from outrider.plugins.drafters.mtp.drafter import MTPDrafter
from outrider.registry import default_registry
from outrider.spec.chain import DrafterChain
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.runner import Runner
from outrider.spec.sampling import SamplingParams
from outrider.testing.contracts import DrafterContract
from outrider.testing.fixtures import plain_greedy

# repeats, then fresh text: lookup matches some rounds and not others
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 40, 41, 42, 43]


def test_lookup_then_mtp_equals_plain_greedy_and_both_draft(outrider_contract_fixtures):
    fx = outrider_contract_fixtures
    target = fx.target("llama")
    chain = DrafterChain([LookupDrafter(), MTPDrafter(model=str(fx.tiny_mtp_sidecar_path))], ["lookup", "mtp"])
    chain.setup(target)
    runner = Runner(target, chain, GreedyAcceptor(), DrafterTraits.of(chain, draft_max="auto"), context=256)
    out = list(runner.generate(list(PROMPT), 40, SamplingParams()))
    assert out == plain_greedy(target.model, PROMPT, 40)
    learned = {kind.name.split(":")[0] for kind in runner.draft_length.kinds}
    assert learned == {"lookup", "mtp"}, learned


def test_combination_names():
    registry = default_registry()
    for name in ("lookup,mtp", "lookup+mtp", " lookup , mtp "):
        spec = drafter_spec(registry, name)
        assert spec.name == "lookup,mtp" and {"model", "min_n"} <= set(spec.options)
    assert drafter_spec(registry, "ngram,nextn").name == "lookup,mtp"  # aliases resolve
    with pytest.raises(ConfigError, match="unknown drafter"):
        drafter_spec(registry, "lookup,nope")
    with pytest.raises(ConfigError, match="two or more"):
        drafter_spec(registry, "lookup,")


class TestLookupMTPChainContract(DrafterContract):
    def make_drafter(self):
        return DrafterChain([LookupDrafter(), MTPDrafter(model=str(self.fixtures.tiny_mtp_sidecar_path),
                                                         sample=False)], ["lookup", "mtp"])


class _Member:
    """A member whose draft_kind says `kind` (None: no draft) and counts how often it is asked."""

    def __init__(self, kind, tokens):
        self.kind, self.tokens, self.asked, self.proposed = kind, tokens, 0, 0

    def begin(self, prompt, params, controls):
        return object()

    def draft_kind(self, state, tokens):
        self.asked += 1
        return self.kind

    def propose(self, state, tokens, k):
        from outrider.spec.drafter import Draft

        self.proposed += 1
        return Draft(tokens=self.tokens[:k])


def test_a_round_asks_each_member_once():
    """draft_kind then propose of the same tokens (what the runner does each round): every member is asked
    once, the picked one drafts; a member with an empty draft hands on to the next, which is asked then;
    propose alone (no draft_kind first) still asks each member itself."""
    from outrider.spec.drafter import DraftControls, DraftKind
    from outrider.spec.sampling import SamplingParams

    none, empty, full = _Member(None, []), _Member(DraftKind("e"), []), _Member(DraftKind("f"), [7, 8])
    chain = DrafterChain([none, empty, full], ["none", "empty", "full"])
    state = chain.begin([1, 2], SamplingParams(), DraftControls())
    tokens = [1, 2, 3]
    assert chain.draft_kind(state, tokens).name == "empty:e"
    assert chain.propose(state, tokens, 2).tokens == [7, 8]
    assert (none.asked, empty.asked, full.asked) == (1, 1, 1)
    assert (none.proposed, empty.proposed, full.proposed) == (0, 1, 1)
    assert chain.propose(state, list(tokens), 1).tokens == [7]  # other tokens: each member asked again
    assert (none.asked, empty.asked, full.asked) == (2, 2, 2)
