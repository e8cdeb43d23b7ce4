"""Drafters that read the target (needs target_hidden / target_kv) are shown, through `observe`, the hidden
states of exactly the rows whose tokens are certain, and the target's cache holding exactly those positions.

Oracle: a fresh forward of the target over the whole certain sequence (its own cache, `hidden=True`), row by
row, compared with what the runner handed over; positions are checked against the emitted tokens.
"""

from __future__ import annotations

import pytest
import torch

from outrider.assembly import check_pair
from outrider.errors import ConfigError
from outrider.plugins.acceptors.greedy import GreedyAcceptor
from outrider.registry import PluginSpec
from outrider.spec.drafter import NEEDS_TARGET_HIDDEN, NEEDS_TARGET_KV, Draft, DrafterBase
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.runner import Runner
from outrider.spec.sampling import SamplingParams
from outrider.testing.fixtures import ContractFixtures, plain_greedy

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


class RecordingDrafter(DrafterBase):
    """Proposes the known continuation, spoiling its last token every other round (so rounds accept all,
    some or none of their drafts), and records what it observes."""

    needs = frozenset({NEEDS_TARGET_HIDDEN, NEEDS_TARGET_KV})

    def __init__(self, truth: list[int]):
        self.truth, self.rounds = truth, 0

    def begin(self, prompt, params, controls):
        self.seen: list[tuple[int, torch.Tensor, int]] = []  # (start, hidden rows, cache length then)
        self.next_start = 0
        return super().begin(prompt, params, controls)

    def observe(self, state, hidden, start, cache):
        assert start == self.next_start, f"observe(start={start}) but the rows before it ended at {self.next_start}"
        self.seen.append((start, hidden.clone(), cache.length))
        self.next_start = start + hidden.shape[0]

    def propose(self, state, tokens, k):
        self.rounds += 1
        draft = self.truth[len(tokens):len(tokens) + k]
        if draft and self.rounds % 2:
            draft[-1] = (draft[-1] + 1) % 32
        return Draft(draft)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return ContractFixtures(tmp_path_factory.mktemp("target-state"))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_observe_gets_every_certain_row_once_with_the_cache_holding_exactly_them(fixtures, arch):
    target = fixtures.target(arch)
    plain = plain_greedy(target.model, PROMPT, 24)
    drafter = RecordingDrafter(PROMPT + plain)
    drafter.setup(target)
    runner = Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=3), context=256)
    out = list(runner.generate(PROMPT, 24, SamplingParams()))
    assert out == plain  # reading the target changes nothing it emits
    assert runner.stats.accepted > 0 and runner.stats.accepted < runner.stats.drafted  # both paths exercised

    for start, rows, length in drafter.seen:
        assert length == start + rows.shape[0], f"cache held {length} positions when rows {start}.. were observed"
    # every certain position but the last emitted token (not yet seen by the target) was observed once
    assert drafter.next_start == len(PROMPT) + len(out) - 1

    sequence = torch.tensor(PROMPT + out[:-1])
    model = target.model
    _, want = model.forward(sequence, 0, model.new_cache(len(sequence)), hidden=True)
    got = torch.cat([rows for _, rows, _ in drafter.seen])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_drafter_needing_the_target_without_observe_is_refused_at_assembly():
    class Starving(DrafterBase):
        needs = frozenset({NEEDS_TARGET_HIDDEN})

        def propose(self, state, tokens, k):
            return Draft()

    drafter = PluginSpec("drafter", "starving", Starving, capabilities={"needs": Starving.needs})
    acceptor = PluginSpec("acceptor", "greedy", GreedyAcceptor)
    with pytest.raises(ConfigError, match="observe"):
        check_pair(drafter, acceptor, DrafterTraits.of(Starving(), drafter.capabilities), SamplingParams())
