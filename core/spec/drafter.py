"""What a drafter is, and what it is given.

A drafter is a plain object that drafts for many sequences at once: its weights and whatever it shares across
sequences (a history of requests) live on the instance, and everything of one sequence lives in the
`DraftState` that `begin` returns, which every later call for that sequence takes first (llama.cpp's
speculative.cpp keys every call by its sequence the same way). One instance over shared weights, not one
instance per sequence: a batched `propose_many` then sees every running sequence's state in one call, so a
draft model or an MTP head can draft for all of them in one forward.

Once, when the runner is assembled, `setup(target)` hands it the target (model, tokenizer, GGUF file,
backend). Per sequence, `begin(prompt, params, controls)` returns its state (`DrafterBase.begin` makes one with
the sampling settings, the controls and the sequence's own draft stream; a drafter with more to keep subclasses
`DraftState` and names it in `State`). Each round, `propose(state, tokens, k)` returns at most k tokens that
should follow `tokens` (the whole sequence so far, ending with a token the target has not yet seen), and
`rollback(state, length)` says that only the first `length` tokens of what it saw are still valid. When the
sequence is done (finished, cancelled or failed), `end(state)` lets go of what it holds (a KV cache back to a
pool); nothing is called with that state after it.
Optionally, `draft_kind(state, tokens)`, asked before `propose`, says what kind of draft this round's would be
(`DraftKind`), or `None` when it would be empty: `--draft-max auto` learns each kind's acceptance apart.
`propose_many(states, tokens, ks)` drafts for several sequences in one call (`DrafterBase`'s asks `propose` of
each in turn); its drafts must be those `propose` would give each sequence alone. `catch_up_rows(state, tokens)`
says how many rows the next `propose` reads before it drafts (a draft model's unread prompt, the tokens accepted
while it drafted nothing), so a batch prices that read before it asks.

A drafter that declares `target_hidden` or `target_kv` in `needs` (an MTP head, Gemma 4's assistant) is
shown what the target computed, with no second forward: after the prompt, and after every round once
the rejected positions are rolled back, `observe(state, hidden, start, cache)` gives the final-normed hidden
states [m, hidden_size] of the rows at positions start..start+m-1 whose tokens are now certain (every
prompt row; then t0 and the accepted drafts of each round), and the target's KV cache of that sequence, which
holds exactly positions [0, start+m) then. The cache is the target's own: read it, never write or truncate it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from outrider.errors import OutriderError
from outrider.spec.random_streams import PositionRandom
from outrider.spec.sampling import SamplingParams, argmax_token, sample_at, warp

# What a drafter may need from the target, declared in its `needs` capability.
NEEDS_DRAFT_MODEL = "draft_model"
NEEDS_TARGET_HIDDEN = "target_hidden"
NEEDS_TARGET_KV = "target_kv"
NEEDS_MTP_HEAD = "mtp_head"  # an MTP (nextn) head: in the target's file, a sidecar, or `outrider distill`'s cache


@dataclass
class Target:
    model: Any
    tokenizer: Any
    gguf: Any
    backend: Any


@dataclass
class DraftControls:
    draft_min: int = 0  # a proposal shorter than this is dropped (nothing is drafted)
    draft_p_min: float = 0.0  # drafter-side stop: no token whose draft probability is below this


@dataclass(frozen=True)
class DraftKind:
    """How a round's draft would be made, known before it is made (for the lookup drafter: the length of
    the matched n-gram). `--draft-max auto` keeps a separate acceptance estimate per kind, starting from
    `prior` (the assumed chance that each drafted position is accepted), so a weak kind of draft is not
    priced like a strong one."""

    name: str
    prior: float = 0.6
    # a drafted token's cost in one-token target forwards, where the drafter can tell before any timing (a
    # draft model: the share of the target's bytes a step reads); None: unknown
    cost: float | None = None


DEFAULT_KIND = DraftKind("draft")  # for drafters that do not say


def default_draft_kind(tokens: list[int]) -> DraftKind:
    """What is asked in place of `draft_kind` of a drafter that has none: every round is one kind."""
    return DEFAULT_KIND


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [len(tokens), vocab] q rows, only if the drafter sampled from them
    # seconds of the propose spent keeping up with the target rather than drafting (what a catch-up forward of
    # rows accepted in other rounds took beyond the draft step it also made: `DraftStepClock`; an MTP head's
    # learning): `--draft-max auto` does not bill it per drafted token
    upkeep_s: float = 0.0


@dataclass
class DraftStepClock:
    """A drafter's running cost of one draft step, a forward of one row. A drafter that catches up with the
    target's accepted tokens in the same forward that makes its first draft (a draft model, an MTP head) bills
    that forward as one draft step and only the rest as upkeep: on a CPU a forward's cost grows little with its
    rows (the weights are read once), so the catch-up of several rows costs about one step more than drafting
    nothing, and a round that drafts nothing saves that step, its rows joining the next catch-up."""

    smoothing: float = 0.3  # as auto's running averages: a slow step moves the estimate, one does not decide it
    step_s: float | None = None

    def teach(self, took: float) -> None:
        """A one-row forward took `took` seconds."""
        self.step_s = took if self.step_s is None else self.step_s + self.smoothing * (took - self.step_s)

    def charge(self, took: float, rows: int) -> float:
        """The upkeep in a forward of `rows` rows that took `took` seconds and made a draft step; a one-row
        forward is all drafting, and teaches the step's cost. Before any has, a row's share stands for the step
        (an MTP head's first catch-up carries the prompt): cheap, so a cold start does not price drafting out,
        and the length it picks is timed again."""
        if rows == 1:
            self.teach(took)
            return 0.0
        return max(took - (self.step_s if self.step_s is not None else took / rows), 0.0)


@dataclass
class DraftState:
    """One sequence's drafting state: what `begin` returns and every later call for that sequence takes. The
    base holds what every drafter needs: the sequence's sampling settings, its drafter-side controls and its
    own draft stream (never the acceptor's two: seeded runs repeat their drafts, an unseeded one draws afresh;
    a fixed stream would make each context's draft a constant, not x ~ q). A drafter with more to keep per
    sequence subclasses it (fields with defaults) and names the subclass in its `State`."""

    params: SamplingParams
    controls: DraftControls
    draws: PositionRandom


class Drafter(Protocol):
    gives_draft_probs: bool
    needs: frozenset[str]

    def setup(self, target: Target) -> None: ...

    def begin(self, prompt: list[int], params: SamplingParams, controls: DraftControls) -> DraftState: ...

    def propose(self, state: DraftState, tokens: list[int], k: int) -> Draft: ...

    def rollback(self, state: DraftState, length: int) -> None: ...

    # optional: def end(self, state) -> None  (the sequence is done: let go of what its state holds)
    # optional: def draft_kind(self, state, tokens: list[int]) -> DraftKind | None
    # optional: def propose_many(self, states, tokens: list[list[int]], ks: list[int]) -> list[Draft]
    # optional: def catch_up_rows(self, state, tokens: list[int]) -> int  (rows the next propose reads first)
    # optional: def idle(self, tokens: list[int]) -> bool  (one unit of deferred work between generations, on the
    #   latest generation's prompt and output `tokens`, whatever drafted them; whether more is left)
    # with needs target_hidden / target_kv: def observe(self, state, hidden: torch.Tensor, start: int, cache) -> None


class DrafterBase:
    """Defaults for the parts of the protocol most drafters do not need."""

    gives_draft_probs = False
    needs: frozenset[str] = frozenset()
    drafts_in_lockstep = False  # propose_many is propose of each in turn
    State: type[DraftState] = DraftState  # what `begin` makes: a subclass's own, with its per-sequence fields

    def setup(self, target: Target) -> None:
        self.target = target

    def begin(self, prompt: list[int], params: SamplingParams, controls: DraftControls) -> DraftState:
        return self.State(params, controls, PositionRandom(params.seed))

    def rollback(self, state: DraftState, length: int) -> None:
        pass

    def end(self, state: DraftState) -> None:
        pass

    def draft_kind(self, state: DraftState, tokens: list[int]) -> DraftKind | None:
        return DEFAULT_KIND

    def catch_up_rows(self, state: DraftState, tokens: list[int]) -> int:
        """Rows of `tokens` the next `propose` must read before it drafts (none: this drafter keeps up as it goes)."""
        return 0

    def propose_many(self, states: list[DraftState], tokens: list[list[int]], ks: list[int]) -> list[Draft]:
        """One draft per sequence; a drafter that can draft for several in one forward overrides this."""
        return [self.propose(state, t, k) for state, t, k in zip(states, tokens, ks)]

    def draft_from_logits(self, state: DraftState, k: int, next_logits: Callable[[list[int]], torch.Tensor],
                          tokens: list[int], sample: bool) -> Draft:
        """`draft_loop` with what `begin` gave the sequence: its sampling settings, controls and draft stream, the
        first draft standing after `tokens`."""
        return draft_loop(k, next_logits, state.params, state.controls, sample, state.draws, len(tokens))


def begin_drafting(drafter: Any, prompt: list[int], params: SamplingParams, controls: DraftControls) -> Any:
    """A new sequence's drafting state, from `drafter.begin`; a drafter whose `begin` returns nothing is one of the
    one-sequence API, which kept the sequence on itself: refused in one line with the fix."""
    state = drafter.begin(list(prompt), params, controls)
    if state is None:
        raise OutriderError(f"drafter {type(drafter).__name__}'s begin returned None; return the sequence's state "
                            "(DrafterBase.begin's, or a DraftState subclass) and take it as the first argument of "
                            "propose, rollback, draft_kind and observe: see docs/plugins.md, 'Drafters'")
    return state


def draft_loop(k: int, next_logits: Callable[[list[int]], torch.Tensor], params: SamplingParams, controls: DraftControls,
               sample: bool, draws: PositionRandom, position: int) -> Draft:
    """The draft loop of every drafter that drafts position by position from a model (draft-model, mtp,
    gemma-assistant; a third-party drafter may use it too). `next_logits(drafted)` returns the logits row
    [vocab] (float32, CPU) for the position after the tokens drafted so far (first with []).

    Each position: q = warp(logits, params) when `sample` at a temperature above 0, else the softmax; the
    round stops *before* a token is drawn when q's largest probability is below `controls.draft_p_min`
    (llama.cpp's rule), so whether a position is drafted depends on what came before it, never on the token
    drawn there, and the sampled acceptor's min(1, p/q) stays exact; then the token is drawn from q with the
    drafter stream's draw for its absolute position (`draws.uniform_draft`; the first draft stands at
    `position`) and q is returned as its row, or it is the argmax (no rows: the acceptor's one-hot rule)."""
    drafted: list[int] = []
    rows: list[torch.Tensor] = []
    for _ in range(k):
        token, q = draft_position(next_logits(drafted), params, controls, sample, draws, position + len(drafted))
        if token is None:
            break
        drafted.append(token)
        if q is not None:
            rows.append(q)
    return Draft(drafted, torch.stack(rows) if rows else None)


def draft_position(logits: torch.Tensor, params: SamplingParams, controls: DraftControls, sample: bool,
                   draws: PositionRandom, position: int) -> tuple[int | None, torch.Tensor | None]:
    """One position of `draft_loop`, for a drafter that drafts several sequences in lockstep (`propose_many`): the
    token drafted at absolute `position` from its logits row and its q row (None for an argmax draft), or (None,
    None) where the round stops before it."""
    if sample and not params.greedy:
        q = warp(logits, params)
        if controls.draft_p_min > 0 and float(q.max()) < controls.draft_p_min:
            return None, None
        return sample_at(q, draws.uniform_draft(position)), q
    top = argmax_token(logits)
    if controls.draft_p_min > 0 and float(torch.exp(logits[top] - torch.logsumexp(logits, -1))) < controls.draft_p_min:
        return None, None
    return top, None
