"""The speculative decoding loop.

One round: the certain next token t0 (already sampled, not yet in the target's KV cache) is packed
with the drafter's proposal x1..xk into ONE target forward over [t0, x1..xk]; the acceptor keeps a
prefix of the drafts and emits one more token (recovered or bonus), which is the next round's t0.
Rejected positions are rolled back by truncating the caches. With no drafts this is exactly plain
decoding: one forward, one token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from outrider.errors import OutriderError
from outrider.spec.acceptance import VerifyRound, as_acceptor
from outrider.spec.drafter import Draft, DraftControls, Target, begin_drafting, default_draft_kind
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.length_policy import AdaptiveDraftLength, FixedDraftLength
from outrider.spec.penalties import ContextPenalties
from outrider.spec.random_streams import PositionRandom
from outrider.spec.sampling import SamplingParams


@dataclass
class GenerationStats:
    """Counters for one generation; names and definitions follow docs/acceptance.md
    (Metrics): a round is one verify forward, `drafted` and
    `accepted` count draft tokens (the recovered or bonus token is in neither), acceptance_rate =
    accepted / drafted, mean_acceptance_length = 1 + accepted / rounds (tokens emitted per round)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # rounds that drafted at least j+1 tokens
    accepted_at: list[int] = field(default_factory=list)  # rounds that accepted draft position j+1
    draft_lengths: list[int] = field(default_factory=list)  # tokens drafted, per round
    chosen_lengths: list[int] = field(default_factory=list)  # tokens asked of the drafter, per round
    chosen_by_kind: dict[str, list[int]] = field(default_factory=dict)  # the same, per kind of draft
    stop_reason: str = ""

    def record_round(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.draft_lengths.append(drafted)
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for j in range(drafted):
            self.drafted_at[j] += 1
        for j in range(accepted):
            self.accepted_at[j] += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "decode_tokens_per_s": round(self.generated_tokens / self.decode_s, 3) if self.decode_s else 0.0,
            "prefill_tokens_per_s": round(self.prompt_tokens / self.prefill_s, 3) if self.prefill_s else 0.0,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 6) if self.drafted else 0.0,
            "mean_acceptance_length": round(1 + self.accepted / self.rounds, 6) if self.rounds else 0.0,
            "per_position": [round(a / d, 6) for a, d in zip(self.accepted_at, self.drafted_at)],
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
            "chosen_draft_lengths": _histogram(self.chosen_lengths),
            "chosen_draft_lengths_by_kind": {name: _histogram(v) for name, v in sorted(self.chosen_by_kind.items())},
            "stop_reason": self.stop_reason,
        }


@dataclass(frozen=True)
class Round:
    """One target forward and what it made certain. Round 0 is the prefill: the prompt's forward and its
    one token. Every later round verified `drafted` tokens (0: a plain step), kept `accepted` of them
    and emitted one more (recovered, or bonus when all were kept), so `tokens` holds accepted + 1 ids,
    fewer when a stop token or the length limit cut the round short."""

    index: int
    tokens: list[int]
    drafted: int = 0
    accepted: int = 0
    kind: str | None = None  # the kind of draft (DraftKind.name); None for the prefill, or when the drafter had none
    chosen: int = 0  # the draft length asked of the drafter
    draft_s: float = 0.0
    verify_s: float = 0.0  # the forward and the acceptor (round 0: the prefill)


def _histogram(values: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in sorted(values):
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


class Runner:
    """A target model, a drafter and an acceptor, assembled once and reused across generations. `traits` are
    the drafter's (`DrafterTraits.of(drafter, ...)`): the runner reads them, never the drafter's attributes."""

    def __init__(self, target: Target, drafter: Any, acceptor: Any, traits: DrafterTraits,
                 controls: DraftControls | None = None, context: int | None = None):
        self.target, self.drafter, self.acceptor, self.traits = target, drafter, as_acceptor(acceptor), traits
        self.draft_length = AdaptiveDraftLength() if traits.draft_max == "auto" \
            else FixedDraftLength(int(traits.draft_max))
        self.controls = controls or DraftControls()
        self.vocab_size = target.model.config.vocab_size
        self.context = min(context or target.model.config.context_length, target.model.config.context_length)
        self.cache = target.model.new_cache(self.context)
        self.device = getattr(target.model, "device", torch.device("cpu"))
        self.stats = GenerationStats()
        self.last_tokens: list[int] = []  # the latest generation's prompt and output: what idle work reads

    def generate(self, prompt: list[int], max_tokens: int, params: SamplingParams,
                 stop_ids: set[int] | frozenset[int] = frozenset()) -> Iterator[int]:
        """Yield generated token ids as they become certain; `self.stats` is complete when the loop ends."""
        for round_ in self.rounds(prompt, max_tokens, params, stop_ids):
            yield from round_.tokens

    def rounds(self, prompt: list[int], max_tokens: int, params: SamplingParams,
               stop_ids: set[int] | frozenset[int] = frozenset()) -> Iterator[Round]:
        """Yield one `Round` per target forward: first the prefill's (its one token), then one per verify.
        A round's tokens stop at a stop token or at `max_tokens`; `self.stats` counts every round yielded
        and is complete when the loop ends."""
        if not prompt:
            raise OutriderError("the prompt is empty and the model adds no BOS token; give a non-empty prompt")
        if len(prompt) >= self.context:
            raise OutriderError(f"prompt is {len(prompt)} tokens but the context holds {self.context}; "
                                "shorten the prompt or raise --context")
        self.stats = stats = GenerationStats(prompt_tokens=len(prompt))
        if isinstance(self.draft_length, AdaptiveDraftLength):
            self.draft_length.begin_generation(timed=not self.lengths_change_the_output(params))
        rng = PositionRandom(params.seed)
        model, cache, acceptor, drafter = self.target.model, self.cache, self.acceptor, self.drafter
        shows_hidden = self.traits.reads_the_target
        max_tokens = min(max_tokens, self.context - len(prompt))

        t = time.perf_counter()
        cache.truncate(0)
        out = model.forward(torch.tensor(prompt, device=self.device), 0, cache, last_only=True,
                            hidden=shows_hidden)
        logits, hidden = out if shows_hidden else (out, None)
        logits = logits.float().cpu()
        penalties = ContextPenalties(params, prompt) if params.penalizes else None
        if penalties is not None:
            logits = penalties.apply(logits, [])
        first = acceptor.accept(VerifyRound(logits, [], None, params, rng, len(prompt))).tokens[0]
        state = begin_drafting(drafter, prompt, params, self.controls)  # a draft model's own prefill: part of this one
        try:
            yield from self._decode(state, prompt, first, max_tokens, params, stop_ids, rng, penalties, hidden, t)
        finally:
            end = getattr(drafter, "end", None)
            if end is not None:
                end(state)

    def _decode(self, state: Any, prompt: list[int], first: int, max_tokens: int, params: SamplingParams,
                stop_ids: set[int] | frozenset[int], rng: PositionRandom, penalties: ContextPenalties | None,
                hidden: torch.Tensor | None, t: float) -> Iterator[Round]:
        model, cache, acceptor, drafter, stats = self.target.model, self.cache, self.acceptor, self.drafter, self.stats
        says_kind = self.traits.says_draft_kind
        observe = drafter.observe if self.traits.reads_the_target else None
        if observe is not None:
            observe(state, hidden, 0, cache)
        stats.prefill_s = time.perf_counter() - t

        tokens = self.last_tokens = list(prompt) + [first]
        if penalties is not None:
            penalties.extend([first])
        stats.generated_tokens = 1
        if first in stop_ids:
            stats.stop_reason = "eog"
        decode_start = time.perf_counter()
        yield Round(index=0, tokens=[first], verify_s=stats.prefill_s)
        while not stats.stop_reason:
            if stats.generated_tokens >= max_tokens:
                stats.stop_reason = "length"
                break
            n = len(tokens) - 1  # position of t0, the last token, which the target has not seen yet
            t = time.perf_counter()
            kind = drafter.draft_kind(state, tokens) if says_kind else default_draft_kind(tokens)
            chosen = self.draft_length.choose(kind) if kind is not None else 0
            k = min(chosen, max_tokens - stats.generated_tokens - 1, self.context - len(tokens))
            draft = self._clean(drafter.propose(state, tokens, k), k) if k > 0 else Draft()
            t_drafted = time.perf_counter()
            upkeep = min(max(draft.upkeep_s, 0.0), t_drafted - t)
            batch = torch.tensor([tokens[-1], *draft.tokens], device=self.device)
            out = model.forward(batch, n, cache, hidden=observe is not None)
            logits, hidden = out if observe is not None else (out, None)
            logits = logits.float().cpu()
            if penalties is not None:  # row i's penalties count x_1..x_i: plain decoding's at that position
                logits = penalties.apply(logits, draft.tokens)
            result = acceptor.accept(VerifyRound(logits, draft.tokens, draft.probs, params, rng, n + 1))
            t_verified = time.perf_counter()
            stats.draft_s += t_drafted - t
            stats.verify_s += t_verified - t_drafted
            stats.record_round(len(draft.tokens), result.accepted)
            stats.chosen_lengths.append(chosen)
            if kind is not None:
                stats.chosen_by_kind.setdefault(kind.name, []).append(chosen)
            # a draft's price is what drafting it took, less what the drafter spent keeping up with the target
            self.draft_length.update(len(draft.tokens), result.accepted, t_drafted - t - upkeep, t_verified - t_drafted,
                                     kind, upkeep, asked=k)
            cache.truncate(n + 1 + result.accepted)
            drafter.rollback(state, n + 1 + result.accepted)
            if observe is not None:  # t0 and the accepted drafts: the rows whose tokens are now certain
                observe(state, hidden[: result.accepted + 1], n, cache)
            certain = []
            for token in result.tokens:
                certain.append(token)
                stats.generated_tokens += 1
                if token in stop_ids:
                    stats.stop_reason = "eog"
                    break
                if stats.generated_tokens >= max_tokens:
                    stats.stop_reason = "length"
                    break
            tokens.extend(certain)
            if penalties is not None:
                penalties.extend(certain)
            stats.decode_s = time.perf_counter() - decode_start
            yield Round(index=stats.rounds, tokens=certain, drafted=len(draft.tokens), accepted=result.accepted,
                        kind=kind.name if kind is not None else None, chosen=chosen,
                        draft_s=t_drafted - t, verify_s=t_verified - t_drafted)
        stats.decode_s = time.perf_counter() - decode_start

    def idle(self) -> bool:
        """One unit of the drafter's work that waits for a free moment (`drafter.learn`'s training on the latest
        generation's tokens), for a host with nothing else to do; whether there is more. Never inside a generation."""
        work = getattr(self.drafter, "idle", None)
        return bool(work(self.last_tokens)) if work is not None else False

    def lengths_change_the_output(self, params: SamplingParams) -> bool:
        """Whether the draft lengths change which tokens a reproducible run (seeded, or greedy) emits: then
        `--draft-max auto` must not choose them from timings. A lossless acceptor with a drafter that gives no
        q emits plain decoding's tokens whatever is drafted; with q, a drafted position is decided by the
        Leviathan rule, an undrafted one by plain sampling; a lossy acceptor keeps what was drafted."""
        if params.seed is None and not params.greedy:
            return False  # not reproducible anyway
        gives_q = self.traits.may_give_draft_probs and not params.greedy
        return gives_q or not getattr(self.acceptor, "lossless", True)

    def _clean(self, draft: Draft, k: int) -> Draft:
        """Keep a misbehaving drafter from crashing the target: at most k ids, all inside the vocabulary (its
        `upkeep_s` is kept whatever is dropped: the time was spent)."""
        upkeep = float(draft.upkeep_s)
        ids = [int(x) for x in draft.tokens[:k]]
        for i, x in enumerate(ids):
            if not 0 <= x < self.vocab_size:
                ids = ids[:i]
                break
        # --draft-min drops short drafts whose tokens the context fixes (argmax, lookup); a draft sampled from q
        # is kept whatever its length: its length depends on the tokens drawn, so dropping it would too
        shortest = max(self.controls.draft_min, 1) if draft.probs is None else 1
        if len(ids) < shortest:
            return Draft(upkeep_s=upkeep)
        probs = draft.probs
        if probs is not None:
            probs = probs[: len(ids)].float().cpu()
            if probs.shape[-1] < self.vocab_size:
                probs = torch.nn.functional.pad(probs, (0, self.vocab_size - probs.shape[-1]))
            if probs.shape != (len(ids), self.vocab_size):
                probs = None
        return Draft(ids, probs, upkeep_s=upkeep)
