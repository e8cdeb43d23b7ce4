"""What a drafter gives and needs, and how long its drafts may be: settled once, when its runner is assembled.

Three things say what a drafter does: the capabilities its registration declares (`register(...,
capabilities=...)`, by default the factory's class attributes), the instance's attributes of the same
names, which win (an option may switch one: draft-model's `sample` gives q), and the optional methods it
has (`draft_kind`, `observe`). `DrafterTraits.of` reads them from the created instance once; the runner, the
server and the reports read its fields, and nothing asks the drafter again in the middle of a generation.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from outrider.errors import ConfigError
from outrider.registry import as_the_instance_has_them
from outrider.spec.drafter import NEEDS_TARGET_HIDDEN, NEEDS_TARGET_KV


@dataclass(frozen=True)
class DrafterTraits:
    # every round that drafts at a temperature above 0 carries q: what an acceptor that needs q asks
    gives_draft_probs: bool = False
    # some rounds may carry q (a chain with one sampling member); then a seeded run's tokens depend on the
    # draft lengths, so `--draft-max auto` must not choose them from timings
    may_give_draft_probs: bool = False
    needs: frozenset[str] = frozenset()
    says_draft_kind: bool = False  # it has draft_kind(tokens); a drafter that has not drafts one kind
    observes: bool = False  # it has observe(hidden, start, cache)
    draft_max: int | str = "auto"  # tokens a round may ask of it, or "auto": chosen each round
    # its propose_many drafts every sequence in one draft forward a position: a step's drafting costs the depth of
    # its deepest draft, not the sum of its drafts (how BatchPricing prices it)
    drafts_in_lockstep: bool = False
    # every declared capability as this instance has it (target_architecture too): what the reports show
    capabilities: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), compare=False)

    @property
    def reads_the_target(self) -> bool:
        """Whether the runner shows the drafter the target's hidden states and KV cache (`observe`)."""
        return bool(self.needs & {NEEDS_TARGET_HIDDEN, NEEDS_TARGET_KV})

    @classmethod
    def of(cls, drafter: Any, declared: Mapping[str, Any] | None = None,
           draft_max: int | str = "auto") -> DrafterTraits:
        """`drafter`'s traits, its attributes winning over the `declared` capabilities (its registration's;
        None where it was not registered, as for a drafter made directly). A drafter written to the old,
        one-sequence API is refused here, once, with the fix."""
        check_drafter_api(drafter)
        declared = dict(declared or {})
        values = as_the_instance_has_them({"gives_draft_probs": False, "needs": frozenset(), **declared}, drafter)
        gives = bool(values["gives_draft_probs"])
        may = bool(getattr(drafter, "may_give_draft_probs", declared.get("may_give_draft_probs", gives)))
        return cls(gives_draft_probs=gives, may_give_draft_probs=may or gives, needs=frozenset(values["needs"]),
                   says_draft_kind=callable(getattr(drafter, "draft_kind", None)),
                   observes=callable(getattr(drafter, "observe", None)), draft_max=draft_max,
                   drafts_in_lockstep=bool(getattr(drafter, "drafts_in_lockstep", False)),
                   capabilities=MappingProxyType(as_the_instance_has_them(declared, drafter)))


# method: (its parameters in the per-sequence API, its parameters in the one-sequence API before it)
_PER_SEQUENCE = {"propose": ("state, tokens, k", 2), "rollback": ("state, length", 1),
                 "draft_kind": ("state, tokens", 1), "observe": ("state, hidden, start, cache", 3)}


def _positional(method: Any) -> int | None:
    """How many positional parameters a bound method takes; None where it takes any number (*args)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def check_drafter_api(drafter: Any) -> None:
    """Refuse, in one line naming the fix, a drafter whose methods take the one-sequence API's arguments
    (`propose(tokens, k)`, `rollback(length)`, ...): since the drafter API became per sequence, `begin` returns a
    state that each of them takes first."""
    for name, (new, old_count) in _PER_SEQUENCE.items():
        method = getattr(drafter, name, None)
        if callable(method) and _positional(method) == old_count:
            raise ConfigError(
                f"drafter {type(drafter).__name__} is written to the old one-sequence drafter API ({name} takes "
                f"{old_count} argument{'s' if old_count > 1 else ''}); make begin(prompt, params, controls) return "
                f"a per-sequence state (DrafterBase.begin's, or a DraftState subclass) and define {name}(self, "
                f"{new}): see docs/plugins.md, 'Drafters'")
