"""Combining drafters: `--drafter lookup,mtp` (or `lookup+mtp`, the spelling `outrider bench` uses in its
list of configurations). Each round the first drafter that has something to propose drafts it: the lookup
drafter where an n-gram matches, the MTP head elsewhere. Every member sees every call that keeps its state
(begin, rollback, observe), whether or not it drafted. Each member's kinds of draft are named after it, so
`--draft-max auto` learns each one's acceptance apart."""

from __future__ import annotations

from typing import Any

from outrider.registry import PluginSpec
from outrider.spec.drafter import Draft, DraftControls, DraftKind, Target, default_draft_kind
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.sampling import SamplingParams

SEPARATORS = ",+"


def is_chain(name: str) -> bool:
    return any(sep in name for sep in SEPARATORS)


def chain_names(name: str) -> list[str]:
    for sep in SEPARATORS[1:]:
        name = name.replace(sep, SEPARATORS[0])
    return [part.strip() for part in name.split(SEPARATORS[0]) if part.strip()]


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
        self.may_give_draft_probs = any(t.may_give_draft_probs for t in self._traits)
        self._kinds: dict[tuple[int, DraftKind], DraftKind] = {}
        self._member_kinds = [d.draft_kind if t.says_draft_kind else default_draft_kind
                              for d, t in zip(drafters, self._traits)]
        self._picked: tuple[list[int], int, int] | None = None  # (tokens, their length, member) draft_kind chose
        if any(t.reads_the_target for t in self._traits):
            self.observe = self._observe

    def setup(self, target: Target) -> None:
        for d in self.drafters:
            d.setup(target)

    def begin(self, prompt: list[int], params: SamplingParams, controls: DraftControls) -> None:
        for d in self.drafters:
            d.begin(list(prompt), params, controls)

    def rollback(self, length: int) -> None:
        for d in self.drafters:
            d.rollback(length)

    def idle(self, tokens: list[int]) -> bool:
        """A unit of deferred work of each member that has some, until one says more is left; whether any is."""
        for d in self.drafters:
            work = getattr(d, "idle", None)
            if work is not None and work(tokens):
                return True
        return False

    def _observe(self, hidden, start: int, cache) -> None:
        for d, t in zip(self.drafters, self._traits):
            if t.reads_the_target:
                d.observe(hidden, start, cache)

    def draft_kind(self, tokens: list[int]) -> DraftKind | None:
        self._picked = None
        for i, ask in enumerate(self._member_kinds):
            kind = ask(tokens)
            if kind is not None:
                self._picked = (tokens, len(tokens), i)
                key = (i, kind)
                if key not in self._kinds:
                    self._kinds[key] = DraftKind(f"{self.names[i]}:{kind.name}", kind.prior)
                return self._kinds[key]
        return None

    def propose(self, tokens: list[int], k: int) -> Draft:
        # the runner asked draft_kind of these very tokens first: the members before the one it picked have
        # no draft, and that one has, so neither is asked again (a lookup member's match ran thrice a round)
        picked, self._picked = self._picked, None
        first = picked[2] if picked and picked[0] is tokens and picked[1] == len(tokens) else None
        upkeep = 0.0  # what the members asked spent keeping up with the target (not drafting)
        for i in range(first or 0, len(self.drafters)):
            if i != first and self._member_kinds[i](tokens) is None:
                continue
            draft = self.drafters[i].propose(tokens, k)
            upkeep += draft.upkeep_s
            if draft.tokens:
                draft.upkeep_s = upkeep
                return draft
        return Draft(upkeep_s=upkeep)


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
