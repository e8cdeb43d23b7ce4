"""The speculative decoding loop, for one sequence or many at once.

One round: the certain next token t0 (already sampled, not yet in the target's KV cache) is packed
with the drafter's proposal x1..xk into ONE target forward over [t0, x1..xk]; the acceptor keeps a
prefix of the drafts and emits one more token (recovered or bonus), which is the next round's t0.
Rejected positions are rolled back by truncating the caches. With no drafts this is exactly plain
decoding: one forward, one token. Several sequences step together: each drafts, one ragged target forward
verifies all of them (`Decoder.forward_sequences`, bit for bit each one's own forward), each accepts its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from outrider.errors import OutriderError
from outrider.spec.acceptance import VerifyRound, as_acceptor
from outrider.spec.drafter import Draft, DraftControls, DraftKind, Target, begin_drafting, default_draft_kind
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.length_policy import AdaptiveDraftLength, BatchPricing, FixedDraftLength, PolicyMemory
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


@dataclass
class Sequence:
    """One generation in a runner: what `Runner.start` set up and every `Runner.step` reads and advances. Its
    own cache, sampling stream, penalties, acceptor, draft-length policy, drafter state and counters, so any
    number of them step together and each emits what it would alone."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int  # tokens it may emit: the request's, capped by the room its cache has after the prompt
    stop_ids: frozenset[int]
    cache: Any
    acceptor: Any
    draft_length: Any
    rng: PositionRandom
    penalties: ContextPenalties | None
    stats: GenerationStats
    tokens: list[int] = field(default_factory=list)  # prompt and every certain token; the last is t0
    draft_state: Any = None
    decode_start: float = 0.0
    own_cache: bool = False  # taken from the runner's pool (given back at `finish`), not the runner's own cache
    prefilled: int = 0  # prompt tokens the target has read
    prompt_hidden: list = field(default_factory=list)  # their hidden rows, for a drafter that reads the target
    finished: bool = False  # given to `finish`: a second call is a no-op

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def done(self) -> bool:
        return bool(self.stats.stop_reason)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]


class Runner:
    """A target model, a drafter and an acceptor, assembled once and reused across generations. `traits` are
    the drafter's (`DrafterTraits.of(drafter, ...)`): the runner reads them, never the drafter's attributes.

    One generation is `rounds` (or `generate`); several at once are `start` each, `step` them together (one
    ragged target forward verifies every sequence's draft) and `finish` each: `rounds` is the one-sequence case of
    the same calls, so what binds one binds the other."""

    def __init__(self, target: Target, drafter: Any, acceptor: Any, traits: DrafterTraits,
                 controls: DraftControls | None = None, context: int | None = None):
        self.target, self.drafter, self.acceptor, self.traits = target, drafter, as_acceptor(acceptor), traits
        self.memory = PolicyMemory()  # what finished generations measured: where a new sequence's policy starts
        self.draft_length = self.new_draft_length()  # one user's stream of generations (`rounds`): it carries its own
        self.controls = controls or DraftControls()
        self.vocab_size = target.model.config.vocab_size
        self.context = min(context or target.model.config.context_length, target.model.config.context_length)
        self.cache = target.model.new_cache(self.context)
        self.device = getattr(target.model, "device", torch.device("cpu"))
        self.stats = GenerationStats()
        self.last_tokens: list[int] = []  # the latest generation's prompt and output: what idle work reads
        self._free_caches: list[Any] = []  # caches of finished sequences started without the runner's own
        self.batch_pricing = BatchPricing()  # what a forward over R rows costs: draft lengths of a batch's step
        self._end = getattr(drafter, "end", None)
        self._propose_many = getattr(drafter, "propose_many", None)
        self._catch_up_rows = getattr(drafter, "catch_up_rows", None)
        self.typical_output: float | None = None  # tokens a generation runs to, a running mean over finished ones

    def set_slots(self, slots: int, context: int) -> None:
        """Serve `slots` sequences at once, each in a cache of `context` positions, all of them allocated now (as
        llama-server claims its whole cache at start): a server's memory is known before its first request."""
        self.context = min(context, self.target.model.config.context_length)
        self.cache = self.target.model.new_cache(self.context) if slots == 1 else None
        self._free_caches = [self.target.model.new_cache(self.context) for _ in range(slots)]

    def new_draft_length(self) -> Any:
        """A draft-length policy as `--draft-max` asks; for auto, one that starts from what finished generations
        measured (`PolicyMemory`)."""
        return self.memory.new_policy() if self.traits.draft_max == "auto" else FixedDraftLength(int(self.traits.draft_max))

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
        seq, first = self.start(prompt, max_tokens, params, stop_ids, cache=self.cache, draft_length=self.draft_length)
        self.stats = seq.stats
        try:
            yield first
            while not seq.done:
                yield self.step([seq])[0]
        finally:
            self.finish(seq)

    def generate_many(self, prompts: list[list[int]], max_tokens: int, params: list[SamplingParams],
                      stop_ids: set[int] | frozenset[int] = frozenset()) -> list[Sequence]:
        """Several generations run as one batch to their ends (the offline batch job of vLLM's `LLM.generate`): each
        prompt started, every running one stepped together until all are done. Each sequence's tokens are what
        `generate` gives it alone; `self.stats` is the last one's."""
        seqs = []
        try:
            for prompt, p in zip(prompts, params):
                seqs.append(self.start(prompt, max_tokens, p, stop_ids, draft_length=self.draft_length
                                       if len(prompts) == 1 else None)[0])
            while running := [s for s in seqs if not s.done]:
                self.step(running)
        finally:
            for seq in seqs:
                self.finish(seq)
        if seqs:
            self.stats = seqs[-1].stats
        return seqs

    def start(self, prompt: list[int], max_tokens: int, params: SamplingParams,
              stop_ids: set[int] | frozenset[int] = frozenset(), cache: Any = None, acceptor: Any = None,
              draft_length: Any = None) -> tuple[Sequence, Round]:
        """A new sequence, prefilled: `admit`, then `prefill` of its whole prompt; its first token is round 0."""
        seq = self.admit(prompt, max_tokens, params, stop_ids, cache, acceptor, draft_length)
        while (first := self.prefill(seq)) is None:
            pass
        return seq, first

    def admit(self, prompt: list[int], max_tokens: int, params: SamplingParams,
              stop_ids: set[int] | frozenset[int] = frozenset(), cache: Any = None, acceptor: Any = None,
              draft_length: Any = None) -> Sequence:
        """A new sequence, its prompt not yet read (`prefill` reads it). `cache`: a KV cache of `self.context`
        positions to use (None: one from the runner's pool); `acceptor`: the sequence's own (None: the runner's);
        `draft_length`: a policy (None: a new one; `rounds` gives the runner's, which carries its costs from one
        generation to the next). Every admitted sequence is given to `finish`."""
        if not prompt:
            raise OutriderError("the prompt is empty and the model adds no BOS token; give a non-empty prompt")
        if len(prompt) >= self.context:
            raise OutriderError(f"prompt is {len(prompt)} tokens but the context holds {self.context}; "
                                "shorten the prompt or raise --context")
        own_cache = cache is None
        if own_cache:
            cache = self._free_caches.pop() if self._free_caches else self.target.model.new_cache(self.context)
        acceptor = as_acceptor(acceptor) if acceptor is not None else self.acceptor
        draft_length = draft_length if draft_length is not None else self.new_draft_length()
        if isinstance(draft_length, AdaptiveDraftLength):
            draft_length.begin_generation(timed=not self.lengths_change_the_output(params, acceptor))
        penalties = ContextPenalties(params, prompt) if params.penalizes else None
        cache.truncate(0)
        return Sequence(list(prompt), params, min(max_tokens, self.context - len(prompt)), frozenset(stop_ids),
                        cache, acceptor, draft_length, PositionRandom(params.seed), penalties,
                        GenerationStats(prompt_tokens=len(prompt)), own_cache=own_cache)

    def prefill(self, seq: Sequence, rows: int | None = None) -> Round | None:
        """Read up to `rows` more of the sequence's prompt (None: the rest); once it is all read, its first token,
        its drafter state and round 0, else None. A host that reads a long prompt a chunk at a time (a multiple of
        PREFILL_CHUNK, so the rows' sums are those of one prefill) steps the running sequences in between."""
        model, drafter, shows_hidden = self.target.model, self.drafter, self.traits.reads_the_target
        prompt, done = seq.prompt, seq.prefilled
        end = len(prompt) if rows is None else min(len(prompt), done + rows)
        t = time.perf_counter()
        try:
            ids = torch.tensor(prompt[done:end], device=self.device)
            extend = getattr(model, "extend", None)
            if end < len(prompt) and extend is not None:  # not the last piece: no output head
                hidden = extend(ids, done, seq.cache, hidden=shows_hidden)
            else:
                out = model.forward(ids, done, seq.cache, last_only=True, hidden=shows_hidden)
                logits, hidden = out if shows_hidden else (out, None)
            if shows_hidden:
                seq.prompt_hidden.append(hidden)
            seq.prefilled = end
            seq.stats.prefill_s += time.perf_counter() - t
            if end < len(prompt):
                return None
            t = time.perf_counter()
            logits = logits.float().cpu()
            if seq.penalties is not None:
                logits = seq.penalties.apply(logits, [])
            first = seq.acceptor.accept(VerifyRound(logits, [], None, seq.params, seq.rng, len(prompt))).tokens[0]
            seq.draft_state = begin_drafting(drafter, prompt, seq.params, self.controls)  # a draft model's prefill too
            if shows_hidden:
                hidden, seq.prompt_hidden = torch.cat(seq.prompt_hidden), []
                drafter.observe(seq.draft_state, hidden, 0, seq.cache)
        except BaseException:
            self.finish(seq)
            raise
        stats = seq.stats
        stats.prefill_s += time.perf_counter() - t
        seq.tokens = list(prompt) + [first]
        if seq.penalties is not None:
            seq.penalties.extend([first])
        stats.generated_tokens = 1
        if first in seq.stop_ids:
            stats.stop_reason = "eog"
        elif stats.generated_tokens >= seq.max_tokens:
            stats.stop_reason = "length"
        seq.decode_start = time.perf_counter()
        return Round(index=0, tokens=[first], verify_s=stats.prefill_s)

    def finish(self, seq: Sequence) -> None:
        """The sequence is done (or abandoned): its drafter state ended, a pooled cache given back, and its tokens
        are what idle work reads next (the drafter's `end` keeps what it learns from). Twice is once."""
        if seq.finished:
            return
        seq.finished = True
        if seq.tokens:
            self.last_tokens = seq.tokens
            if not seq.prefilling:
                made, mean = seq.stats.generated_tokens, self.typical_output
                self.typical_output = made if mean is None else mean + 0.2 * (made - mean)
                if isinstance(seq.draft_length, AdaptiveDraftLength):
                    self.memory.remember(seq.draft_length)
        if seq.draft_state is not None and self._end is not None:
            self._end(seq.draft_state)
        seq.draft_state = None
        if seq.own_cache:
            seq.own_cache = False
            self._free_caches.append(seq.cache)

    def step(self, seqs: list[Sequence], waited_on: bool = False) -> list[Round]:
        """One round of every sequence in `seqs` (none of them done): each drafts (`propose_many` over those that
        draft, where more than one does), ONE target forward verifies every sequence's t0 and draft (a ragged
        batch, each over its own cache), and each accepts, rolls back and commits its own. A `Round` per sequence,
        in order; a sequence's round is what its own `rounds` would give. `waited_on`: a request outside the step
        waits for it (a host reads its prompt between steps, or expects it any moment): the sequences whose
        lengths the timings choose draft nothing, as a plain step is the shortest wait (`_hurry`)."""
        drafter, traits, model = self.drafter, self.traits, self.target.model
        kinds, chosen, ks, deciding = [], [], [], []
        t = t_step = time.perf_counter()
        for seq in seqs:
            kind = drafter.draft_kind(seq.draft_state, seq.tokens) if traits.says_draft_kind \
                else default_draft_kind(seq.tokens)
            c = seq.draft_length.choose(kind) if kind is not None else 0
            kinds.append(kind)
            chosen.append(c)
            ks.append(min(c, self._room(seq)))
            now = time.perf_counter()
            deciding.append(now - t)
            t = now
        catch_up = [self._rows_to_catch_up(seq) if kind is not None else 0 for seq, kind in zip(seqs, kinds)]
        batched = len(seqs) > 1
        if waited_on:
            self._hurry(seqs, kinds, chosen, ks)
        elif batched:
            self._price_for_the_batch(seqs, kinds, chosen, ks, catch_up)
        drafts, proposing = self._drafts(seqs, ks, catch_up)
        draft_s = [a + b for a, b in zip(deciding, proposing)]
        t_drafted = time.perf_counter()
        batches = [torch.tensor([seq.tokens[-1], *d.tokens], device=self.device) for seq, d in zip(seqs, drafts)]
        starts = [len(seq.tokens) - 1 for seq in seqs]  # t0's positions: the target has not seen t0 yet
        shows_hidden = traits.reads_the_target
        if len(seqs) == 1:
            out = model.forward(batches[0], starts[0], seqs[0].cache, hidden=shows_hidden)
        else:
            out = model.forward_sequences(torch.cat(batches), [len(b) for b in batches], starts,
                                          [seq.cache for seq in seqs], hidden=shows_hidden)
        self.batch_pricing.observe(sum(len(b) for b in batches), time.perf_counter() - t_drafted)
        logits, hidden = out if shows_hidden else (out, None)
        logits = logits.float().cpu()
        rounds, row = [], 0
        for seq, draft, kind, c, k, d_s, n in zip(seqs, drafts, kinds, chosen, ks, draft_s, starts):
            rows = len(draft.tokens) + 1
            rounds.append(self._commit(seq, draft, kind, c, k, d_s, n, logits[row:row + rows],
                                       hidden[row:row + rows] if hidden is not None else None, t_drafted,
                                       alone=len(seqs) == 1))
            row += rows
        if batched:
            self.batch_pricing.observe_step(len(seqs), any(ks), sum(len(r.tokens) for r in rounds),
                                            time.perf_counter() - t_step)
        return rounds

    def _drafts(self, seqs: list[Sequence], ks: list[int], catch_up: list[int]) -> tuple[list[Draft], list[float]]:
        """Each sequence's cleaned draft (none where k is 0) and the seconds its proposing took: one by one, or,
        where several draft, in one `propose_many` whose time is shared out by the tokens asked. A lockstep
        drafter's time less its upkeep (catch-ups, a prompt read) is what its deepest draft's depth cost, and the
        upkeep over the `catch_up` rows read is what a row of it costs."""
        asked = [i for i, k in enumerate(ks) if k > 0]
        drafts = [Draft() for _ in seqs]
        start = t = time.perf_counter()
        if len(asked) > 1 and self._propose_many is not None:
            got = self._propose_many([seqs[i].draft_state for i in asked], [seqs[i].tokens for i in asked],
                                     [ks[i] for i in asked])
            for i, draft in zip(asked, got):
                drafts[i] = self._clean(draft, ks[i])
            took, total = time.perf_counter() - t, sum(ks[i] for i in asked)
            spent = [took * k / total if k > 0 else 0.0 for k in ks]
        else:
            spent = [0.0] * len(seqs)
            for i in asked:
                drafts[i] = self._clean(self.drafter.propose(seqs[i].draft_state, seqs[i].tokens, ks[i]), ks[i])
                now = time.perf_counter()
                spent[i], t = now - t, now
        upkeep = sum(drafts[i].upkeep_s for i in asked)
        if asked and self.traits.drafts_in_lockstep:
            self.batch_pricing.observe_draft(max(ks), max(time.perf_counter() - start - upkeep, 0.0))
        self.batch_pricing.observe_catch_up(sum(catch_up[i] for i in asked), upkeep)
        return drafts, spent

    def _rows_to_catch_up(self, seq: Sequence) -> int:
        """Rows the drafter reads before it drafts `seq` again (`catch_up_rows`: its prompt, tokens accepted while it
        did not draft); 0 for a drafter that keeps up every round, or says nothing."""
        return int(self._catch_up_rows(seq.draft_state, seq.tokens)) if self._catch_up_rows is not None else 0

    def _horizon(self, seq: Sequence) -> int:
        """Tokens `seq` has left to draft in: its limit's, at most what generations typically run to beyond where it
        is (a sequence past that is priced on its limit: it is one of the long ones)."""
        left = seq.max_tokens - seq.stats.generated_tokens
        typical, made = self.typical_output, seq.stats.generated_tokens
        return left if typical is None or made >= typical else min(left, max(1, round(typical - made)))

    def _room(self, seq: Sequence) -> int:
        """The most tokens `seq` may draft this round: one short of its length limit, within its cache."""
        return min(seq.max_tokens - seq.stats.generated_tokens - 1, self.context - len(seq.tokens))

    @staticmethod
    def _timings_choose(seq: Sequence, kind: DraftKind | None) -> bool:
        """Whether `seq` drafts this round and measured costs choose how far: an auto-length policy that is timed
        (its lengths do not change its output), not a fixed --draft-max."""
        return kind is not None and isinstance(seq.draft_length, AdaptiveDraftLength) and seq.draft_length.timed

    def _hurry(self, seqs: list[Sequence], kinds: list, chosen: list[int], ks: list[int]) -> None:
        """No draft for any timed auto-length sequence of a step someone waits on. A deep draft is priced by what
        its own sequences gain, and a step of one sequence drafts as deep as one user would (many times a plain
        step's time); the request held up meanwhile gains nothing, and the batch it joins afterwards is where the
        throughput is. Sequences whose lengths change their output (untimed policies) and a fixed --draft-max keep
        what they chose."""
        for j, (seq, kind) in enumerate(zip(seqs, kinds)):
            if self._timings_choose(seq, kind):
                chosen[j] = ks[j] = 0
                seq.draft_length.exploring = False  # not a look: a plain round asked for

    def _price_for_the_batch(self, seqs: list[Sequence], kinds: list, chosen: list[int], ks: list[int],
                             catch_up: list[int]) -> None:
        """Each timed auto-length sequence's draft length chosen for the batch (`BatchPricing`), in place of what
        its own policy priced alone. Not a sequence whose lengths change its output (a seeded run with q, a lossy
        acceptor: its policy is untimed, so its lengths follow its seeded history whatever else runs), nor a fixed
        --draft-max, nor an exploring round of a drafter with nothing to catch up (a look costs the batch a draft; one
        with rows to read first would cost it the read too, which only the batch's pricing weighs). `catch_up`: each
        sequence's rows to read before it drafts."""
        priced = [j for j, (seq, kind) in enumerate(zip(seqs, kinds))
                  if self._timings_choose(seq, kind) and (not seq.draft_length.exploring or catch_up[j])]
        if not priced:
            return
        if self.batch_pricing.drafting_pays(len(seqs)):
            others = [j for j in range(len(seqs)) if j not in priced]
            plans = [(seqs[j].draft_length, kinds[j], min(seqs[j].draft_length.cap, self._room(seqs[j])))
                     for j in priced]
            lengths = self.batch_pricing.choose(plans, sum(1 + ks[j] for j in others),
                                                lockstep=self.traits.drafts_in_lockstep,
                                                other_depth=max((ks[j] for j in others), default=0),
                                                catch_up=[(catch_up[j], self._horizon(seqs[j])) for j in priced])
            if lengths is None:
                return
        else:  # this batch size's own record says drafting lost
            lengths = [0] * len(priced)
        for j, k in zip(priced, lengths):
            chosen[j] = ks[j] = k
            seqs[j].draft_length.exploring = False  # the batch's choice, not a look: priced as a round, not a loss

    def _commit(self, seq: Sequence, draft: Draft, kind: DraftKind | None, chosen: int, k: int, draft_s: float,
                n: int, logits: torch.Tensor, hidden: torch.Tensor | None, t_drafted: float, alone: bool = True) -> Round:
        stats, penalties = seq.stats, seq.penalties
        upkeep = min(max(draft.upkeep_s, 0.0), draft_s)
        if penalties is not None:  # row i's penalties count x_1..x_i: plain decoding's at that position
            logits = penalties.apply(logits, draft.tokens)
        result = seq.acceptor.accept(VerifyRound(logits, draft.tokens, draft.probs, seq.params, seq.rng, n + 1))
        t_verified = time.perf_counter()
        verify_s = t_verified - t_drafted
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        stats.record_round(len(draft.tokens), result.accepted)
        stats.chosen_lengths.append(chosen)
        if kind is not None:
            stats.chosen_by_kind.setdefault(kind.name, []).append(chosen)
        # a draft's price is what drafting it took, less what the drafter spent keeping up with the target
        seq.draft_length.update(len(draft.tokens), result.accepted, draft_s - upkeep, verify_s, kind, upkeep, asked=k,
                                learn_verify=alone)
        seq.cache.truncate(n + 1 + result.accepted)
        self.drafter.rollback(seq.draft_state, n + 1 + result.accepted)
        if hidden is not None:  # t0 and the accepted drafts: the rows whose tokens are now certain
            self.drafter.observe(seq.draft_state, hidden[: result.accepted + 1], n, seq.cache)
        certain = []
        for token in result.tokens:
            certain.append(token)
            stats.generated_tokens += 1
            if token in seq.stop_ids:
                stats.stop_reason = "eog"
                break
            if stats.generated_tokens >= seq.max_tokens:
                stats.stop_reason = "length"
                break
        seq.tokens.extend(certain)
        if penalties is not None:
            penalties.extend(certain)
        if not stats.stop_reason and stats.generated_tokens >= seq.max_tokens:
            stats.stop_reason = "length"
        stats.decode_s = time.perf_counter() - seq.decode_start
        return Round(index=stats.rounds, tokens=certain, drafted=len(draft.tokens), accepted=result.accepted,
                     kind=kind.name if kind is not None else None, chosen=chosen, draft_s=draft_s, verify_s=verify_s)

    def idle(self) -> bool:
        """One unit of the drafter's work that waits for a free moment (`drafter.learn`'s training on the latest
        generation's tokens), for a host with nothing else to do; whether there is more. Never inside a generation."""
        work = getattr(self.drafter, "idle", None)
        return bool(work(self.last_tokens)) if work is not None else False

    def lengths_change_the_output(self, params: SamplingParams, acceptor: Any = None) -> bool:
        """Whether the draft lengths change which tokens a reproducible run (seeded, or greedy) emits: then
        `--draft-max auto` must not choose them from timings. A lossless acceptor with a drafter that gives no
        q emits plain decoding's tokens whatever is drafted; with q, a drafted position is decided by the
        Leviathan rule, an undrafted one by plain sampling; a lossy acceptor keeps what was drafted."""
        if params.seed is None and not params.greedy:
            return False  # not reproducible anyway
        gives_q = self.traits.may_give_draft_probs and not params.greedy
        return gives_q or not getattr(acceptor if acceptor is not None else self.acceptor, "lossless", True)

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
