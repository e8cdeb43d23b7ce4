"""Combining drafters: `--drafter lookup,mtp` (or `lookup+mtp`, the spelling `outrider bench` uses in its
list of configurations). Each round the first drafter that has something to propose drafts it: the lookup
drafter where an n-gram matches, the MTP head elsewhere. Every member sees every call that keeps its state
(begin, rollback, observe, end), whether or not it drafted: a chain's sequence state holds one state per
member. Each member's kinds of draft are named after it, so
`--draft-max auto` learns each one's acceptance apart."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from outrider.registry import PluginSpec
from outrider.spec.drafter import (Draft, DraftControls, DraftKind, DraftState, Target, begin_drafting,
                                   default_draft_kind)
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.random_streams import PositionRandom
from outrider.spec.sampling import SamplingParams

SEPARATORS = ",+"


def is_chain(name: str) -> bool:
    return any(sep in name for sep in SEPARATORS)


def chain_names(name: str) -> list[str]:
    for sep in SEPARATORS[1:]:
        name = name.replace(sep, SEPARATORS[0])
    return [part.strip() for part in name.split(SEPARATORS[0]) if part.strip()]


@dataclass
class ChainState(DraftState):
    members: list[Any] = field(default_factory=list)  # each member's own state of this sequence
    picked: tuple[list[int], int, int] | None = None  # (tokens, their length, member) draft_kind chose


class DrafterChain:
    def __init__(self, drafters: list[Any], names: list[str], traits: list[DrafterTraits] | None = None):
        """`traits`: each member's (`DrafterTraits.of` it and its registration's capabilities); None: read
        from the members alone."""
        self.drafters, self.names = drafters, names
        self._traits = traits or [DrafterTraits.of(d) for d in drafters]
        self.needs = frozenset().union(*(t.needs for t in self._traits))
        # what its rounds give: q in every round (what an acceptor that needs q asks), or in some rounds
        # (what makes a seeded run's tokens depend on the draft lengths, so `auto` must not time them)
        self.gives_draft_probs = all(t.gives_draft_probs for t in self._traits)
        self.drafts_in_lockstep = any(t.drafts_in_lockstep for t in self._traits)  # its sequences share a depth
        self.may_give_draft_probs = any(t.may_give_draft_probs for t in self._traits)
        self._kinds: dict[tuple[int, DraftKind], DraftKind] = {}
        self._member_kinds = [d.draft_kind if t.says_draft_kind else None for d, t in zip(drafters, self._traits)]
        self._ends = [getattr(d, "end", None) for d in drafters]
        if any(t.reads_the_target for t in self._traits):
            self.observe = self._observe

    def setup(self, target: Target) -> None:
        for d in self.drafters:
            d.setup(target)

    def begin(self, prompt: list[int], params: SamplingParams, controls: DraftControls) -> ChainState:
        members = [begin_drafting(d, prompt, params, controls) for d in self.drafters]
        return ChainState(params, controls, PositionRandom(params.seed), members)

    def rollback(self, state: ChainState, length: int) -> None:
        for d, s in zip(self.drafters, state.members):
            d.rollback(s, length)

    def end(self, state: ChainState) -> None:
        for end, s in zip(self._ends, state.members):
            if end is not None:
                end(s)

    def idle(self, tokens: list[int]) -> bool:
        """A unit of deferred work of each member that has some, until one says more is left; whether any is."""
        for d in self.drafters:
            work = getattr(d, "idle", None)
            if work is not None and work(tokens):
                return True
        return False

    def _observe(self, state: ChainState, hidden, start: int, cache) -> None:
        for d, t, s in zip(self.drafters, self._traits, state.members):
            if t.reads_the_target:
                d.observe(s, hidden, start, cache)

    def _kind_of(self, state: ChainState, i: int, tokens: list[int]) -> DraftKind | None:
        ask = self._member_kinds[i]
        return ask(state.members[i], tokens) if ask is not None else default_draft_kind(tokens)

    def draft_kind(self, state: ChainState, tokens: list[int]) -> DraftKind | None:
        state.picked = None
        for i in range(len(self.drafters)):
            kind = self._kind_of(state, i, tokens)
            if kind is not None:
                state.picked = (tokens, len(tokens), i)
                key = (i, kind)
                if key not in self._kinds:
                    self._kinds[key] = DraftKind(f"{self.names[i]}:{kind.name}", kind.prior)
                return self._kinds[key]
        return None

    def _picked(self, state: ChainState, tokens: list[int]) -> int | None:
        """The member draft_kind picked for these very tokens: the members before it have no draft, and it has, so
        neither is asked again (a lookup member's match ran thrice a round); None: each member is asked."""
        member = self._pick_of(state, tokens)
        state.picked = None
        return member

    @staticmethod
    def _pick_of(state: ChainState, tokens: list[int]) -> int | None:
        picked = state.picked
        return picked[2] if picked and picked[0] is tokens and picked[1] == len(tokens) else None

    def catch_up_rows(self, state: ChainState, tokens: list[int]) -> int:
        """The rows the member this round's `draft_kind` picked reads before it drafts (all members', where none was
        picked for these tokens); the pick stays for `propose`."""
        member = self._pick_of(state, tokens)
        members = range(len(self.drafters)) if member is None else [member]
        return sum(int(self.drafters[i].catch_up_rows(state.members[i], tokens)) for i in members
                   if hasattr(self.drafters[i], "catch_up_rows"))

    def propose(self, state: ChainState, tokens: list[int], k: int) -> Draft:
        first = self._picked(state, tokens)
        upkeep = 0.0  # what the members asked spent keeping up with the target (not drafting)
        for i in range(first or 0, len(self.drafters)):
            if i != first and self._kind_of(state, i, tokens) is None:
                continue
            draft = self.drafters[i].propose(state.members[i], tokens, k)
            upkeep += draft.upkeep_s
            if draft.tokens:
                draft.upkeep_s = upkeep
                return draft
        return Draft(upkeep_s=upkeep)

    def propose_many(self, states: list[ChainState], tokens: list[list[int]], ks: list[int]) -> list[Draft]:
        """Each sequence's draft as `propose` gives it, the sequences that ask the same member asked of it in one
        call (its own `propose_many`: one draft forward of an MTP head for all of them); a member's empty draft
        passes a sequence on to the next member, as in `propose`."""
        drafts: list[Draft | None] = [None] * len(states)
        upkeep = [0.0] * len(states)
        first = [self._picked(s, t) for s, t in zip(states, tokens)]
        for i, member in enumerate(self.drafters):
            here = [j for j in range(len(states)) if drafts[j] is None and (first[j] or 0) <= i
                    and (first[j] == i or self._kind_of(states[j], i, tokens[j]) is not None)]
            if not here:
                continue
            got = member.propose_many([states[j].members[i] for j in here], [tokens[j] for j in here],
                                      [ks[j] for j in here]) if hasattr(member, "propose_many") else \
                [member.propose(states[j].members[i], tokens[j], ks[j]) for j in here]
            for j, draft in zip(here, got):
                upkeep[j] += draft.upkeep_s
                if draft.tokens:
                    draft.upkeep_s = upkeep[j]
                    drafts[j] = draft
        return [d if d is not None else Draft(upkeep_s=u) for d, u in zip(drafts, upkeep)]


def chain_spec(specs: list[PluginSpec]) -> PluginSpec:
    """One drafter spec for the members `specs`: their options merged (an option goes to every member that
    declares it), needs united, draft probabilities always if every member gives them, sometimes if any does."""
    options: dict[str, Any] = {}
    for spec in specs:
        for name, option in spec.options.items():
            options.setdefault(name, option)
    names = [spec.name for spec in specs]

    def factory(**settings: Any) -> DrafterChain:
        members = [spec.factory(**{k: v for k, v in settings.items() if k in spec.options}) for spec in specs]
        return DrafterChain(members, names, [DrafterTraits.of(m, spec.capabilities) for m, spec in zip(members, specs)])

    capabilities = {
        "needs": frozenset().union(*(spec.capabilities.get("needs", frozenset()) for spec in specs)),
        "gives_draft_probs": all(spec.capabilities.get("gives_draft_probs", False) for spec in specs),
        "may_give_draft_probs": any(spec.capabilities.get("may_give_draft_probs",
                                                          spec.capabilities.get("gives_draft_probs", False))
                                    for spec in specs),
    }
    return PluginSpec("drafter", ",".join(names), factory, (), options, capabilities,
                      " + ".join(sorted({spec.package for spec in specs})))
