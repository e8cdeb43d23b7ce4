"""The plugin contract: every check a backend, drafter or acceptor must pass, as plain functions.

A check takes a :class:`Subject` (how to make fresh instances of the plugin under test, its capabilities,
the shared tiny-model fixtures) and returns normally (pass), raises AssertionError with a readable message
(fail) or raises :class:`CheckSkipped` when one of the plugin's capabilities makes the check meaningless.
Two front ends run them: the pytest classes in `outrider.testing.contracts` and `outrider check NAME`
(`outrider.testing.report`). Expected values come from independent oracles (plain decoding written as
the obvious loop, analytic distributions of toy tables), never from the code under test.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np
import torch

from outrider.errors import OutriderError
from outrider.hookspecs import PLUGIN_KINDS
from outrider.io.gguf import GGUFFile
from outrider.models.layers import PREFILL_CHUNK
from outrider.spec.acceptance import AcceptResult, VerifyRound
from outrider.registry import as_the_instance_has_them
from outrider.spec.drafter import NEEDS_DRAFT_MODEL, Draft, DraftControls
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.random_streams import PositionRandom
from outrider.spec.runner import Runner
from outrider.spec.sampling import SamplingParams, warp
from outrider.testing.fixtures import ARCHITECTURES, ContractFixtures, builtin_plugin
from outrider.testing.stats import chi2_test, detectable_tv, tv_distance
from outrider.testing.tolerance import logit_tolerance
from outrider.testing.toy import CopyingToyModel, ToyModel, exact_law, model_next_logits


class CheckSkipped(Exception):
    """The check does not apply to this plugin (a capability makes it meaningless, or hardware is missing)."""


# A prompt with repeats, so drafters that look things up have something to find.
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7)
E2E_TOKENS = 24
# Per chi-square statistic; four statistics per acceptor, so a correct acceptor is failed with probability
# below 4e-4 (and, the seeds being fixed, the outcome never changes from run to run).
P_THRESHOLD = 1e-4


@dataclass
class Subject:
    """The plugin under test: `make()` returns a fresh, unconfigured instance."""

    kind: str
    name: str
    make: Callable[[], Any]
    capabilities: dict[str, Any] = field(default_factory=dict)
    fixtures: ContractFixtures | None = None
    memo: dict[Any, Any] = field(default_factory=dict)  # loaded models, shared by the checks of one subject

    def new(self) -> Any:
        if self.kind == "backend":
            try:
                return self.make()
            except OutriderError as exc:  # a backend for hardware this machine lacks
                raise CheckSkipped(f"cannot be created on this machine: {exc}") from None
        return self.make()

    def capability(self, key: str, instance: Any = None, default: Any = None) -> Any:
        """The instance's attribute wins (an option may switch a capability), then the registered capability."""
        return as_the_instance_has_them({key: self.capabilities.get(key, default)}, instance)[key]

    def drafter_traits(self, drafter: Any, draft_max: int | str = "auto") -> DrafterTraits:
        """`drafter`'s traits as assembly settles them: its attributes over the registered capabilities."""
        return DrafterTraits.of(drafter, self.capabilities, draft_max)


@dataclass(frozen=True)
class Check:
    kind: str
    name: str
    description: str
    run: Callable[[Subject], None]
    gpu: bool = False


CHECKS: dict[str, list[Check]] = {kind: [] for kind in PLUGIN_KINDS}


def _check(kind: str, gpu: bool = False):
    def register(fn: Callable[[Subject], None]) -> Callable[[Subject], None]:
        CHECKS[kind].append(Check(kind, fn.__name__, (fn.__doc__ or fn.__name__).strip().splitlines()[0], fn, gpu))
        return fn

    return register


# ------------------------------------------------------------------------------------------------ drafters


def _arch(subject: Subject) -> str:
    """The tiny target a drafter is checked against: llama, unless it declares the one it drafts for."""
    return subject.capabilities.get("target_architecture", "llama")


class _TargetFeed:
    """For a drafter that reads the target (`observe`): the target's forwards over one sequence's certain rows,
    as the runner does them, so the drafter is shown the hidden states and cache it would be shown in a run."""

    def __init__(self, subject: Subject, drafter: Any, state: Any):
        self.drafter, self.state, self.model = drafter, state, subject.fixtures.target(_arch(subject)).model
        self.cache = self.model.new_cache(256)
        self.on = subject.drafter_traits(drafter).reads_the_target

    def certain(self, rows: list[int], start: int) -> None:
        """`rows` (at positions start..) are now certain: the runner's forward, truncation and observe."""
        if not self.on or not rows:
            return
        self.cache.truncate(min(self.cache.length, start))
        device = getattr(self.model, "device", torch.device("cpu"))
        _, hidden = self.model.forward(torch.tensor(rows, device=device), start, self.cache, hidden=True)
        self.drafter.observe(self.state, hidden, start, self.cache)


class _Sequence:
    """One sequence through a drafter as the runner drives it: its state from `begin`, and its target feed.
    `propose`, `rollback` and `draft_kind` are the drafter's own, for this sequence."""

    def __init__(self, subject: Subject, drafter: Any, params: SamplingParams, prompt: list[int]):
        self.drafter = drafter
        self.state = drafter.begin(list(prompt), params, DraftControls())
        assert self.state is not None, \
            f"{type(drafter).__name__}.begin returned None: it must return the sequence's state (DrafterBase.begin's)"
        self.feed = _TargetFeed(subject, drafter, self.state)
        self.feed.certain(list(prompt), 0)

    def propose(self, tokens: list[int], k: int) -> Draft:
        return self.drafter.propose(self.state, tokens, k)

    def rollback(self, length: int) -> None:
        self.drafter.rollback(self.state, length)

    def draft_kind(self, tokens: list[int]) -> Any:
        return self.drafter.draft_kind(self.state, tokens)

    def certain(self, rows: list[int], start: int) -> None:
        self.feed.certain(rows, start)


def _set_up(subject: Subject) -> Any:
    """A fresh drafter, set up on its tiny target; one written to the old one-sequence API fails here, in the
    words assembly refuses it with."""
    drafter = subject.new()
    try:
        subject.drafter_traits(drafter)
    except OutriderError as exc:
        raise AssertionError(str(exc)) from None
    drafter.setup(subject.fixtures.target(_arch(subject)))
    return drafter


def _fed_drafter(subject: Subject, params: SamplingParams = GREEDY, prompt: list[int] = PROMPT) -> _Sequence:
    """A drafter set up and begun on `prompt` (and shown it, if it reads the target): the one sequence."""
    return _Sequence(subject, _set_up(subject), params, prompt)



def _vocab(subject: Subject) -> int:
    return subject.fixtures.target(_arch(subject)).model.config.vocab_size


def _valid_ids(draft: Draft, vocab: int) -> list[int]:
    ids = []
    for x in draft.tokens:
        if not isinstance(x, (int, np.integer)) or not 0 <= int(x) < vocab:
            break
        ids.append(int(x))
    return ids


@dataclass
class Round:
    tokens: list[int]
    k: int
    draft: Draft
    kind: Any = None  # what draft_kind(tokens) said before propose, in a session that asked

    def where(self) -> str:
        return f"propose(tokens of length {len(self.tokens)} ending {self.tokens[-3:]}, k={self.k})"


# k per round; 0 included (the runner never asks for k=0 today, but the protocol allows it)
ROUND_KS = (1, 4, 8, 0, 2, 6, 3)
# tokens the simulated target emits after the accepted drafts: keeps the context repetitive
CONTINUATION = (7, 8, 9, 5, 6)


def _session(subject: Subject, params: SamplingParams = GREEDY, ask_kind: bool = False) -> list[Round]:
    """Drive a drafter the way the runner does: (with `ask_kind`, ask draft_kind first,) propose, accept a
    prefix, roll back, append the target's token."""
    session = _Session(subject, _fed_drafter(subject, params), PROMPT, ask_kind)
    while session.more():
        session.round()
    return session.rounds


class _Session:
    """The rounds of `_session`, one at a time, so that several sequences' rounds can be interleaved."""

    def __init__(self, subject: Subject, seq: _Sequence, prompt: list[int], ask_kind: bool = False,
                 ks: tuple[int, ...] = ROUND_KS):
        self.seq, self.vocab, self.ask_kind, self.ks = seq, _vocab(subject), ask_kind, ks
        self.tokens = list(prompt) + [7]
        self.rounds: list[Round] = []

    def more(self) -> bool:
        return len(self.rounds) < len(self.ks)

    def ask(self) -> tuple[list[int], int, Any]:
        """This round's tokens and k, and (with ask_kind) what draft_kind says of them."""
        k = self.ks[len(self.rounds)]
        kind = self.seq.draft_kind(list(self.tokens)) if self.ask_kind else None
        return list(self.tokens), k, kind

    def round(self) -> Round:
        tokens, k, kind = self.ask()
        return self.commit(tokens, k, kind, self.seq.propose(tokens, k))

    def commit(self, tokens: list[int], k: int, kind: Any, draft: Any) -> Round:
        """What the runner does with a proposal: accept 0, 1 or 2 of the drafts, roll back, show the target's rows."""
        if not isinstance(draft, Draft):
            raise AssertionError(f"propose must return an outrider.api.Draft, got {type(draft).__name__}")
        i = len(self.rounds)
        self.rounds.append(Round(tokens, k, draft, kind))
        accepted = _valid_ids(draft, self.vocab)[: min(k, i % 3)]
        self.seq.rollback(len(self.tokens) + len(accepted))
        self.seq.certain(self.tokens[-1:] + accepted, len(self.tokens) - 1)
        self.tokens += accepted + [CONTINUATION[i % len(CONTINUATION)]]
        return self.rounds[-1]


@_check("drafter")
def never_more_than_k_tokens(subject: Subject) -> None:
    """A proposal has at most k tokens (none when k = 0)."""
    for params in (GREEDY, SAMPLED):
        for r in _session(subject, params):
            n = len(r.draft.tokens)
            assert n <= r.k, f"{r.where()} returned {n} tokens, more than k={r.k}: {list(r.draft.tokens)}"


@_check("drafter")
def ids_inside_the_vocabulary(subject: Subject) -> None:
    """Every proposed id is a Python/numpy int in [0, vocab_size)."""
    vocab = _vocab(subject)
    for params in (GREEDY, SAMPLED):
        for r in _session(subject, params):
            bad = [x for x in r.draft.tokens if not isinstance(x, (int, np.integer)) or not 0 <= int(x) < vocab]
            assert not bad, f"{r.where()} proposed ids outside the vocabulary [0, {vocab}): {bad}"


@_check("drafter")
def probability_rows_sum_to_one(subject: Subject) -> None:
    """When it gives draft probabilities: one row per token, non-negative, summing to 1, q(x) > 0."""
    probe = subject.new()
    traits = subject.drafter_traits(probe)
    if not traits.may_give_draft_probs:
        raise CheckSkipped("gives_draft_probs is False: the drafter gives no probabilities")
    always = traits.gives_draft_probs
    vocab = _vocab(subject)
    for r in _session(subject, SAMPLED):
        n, q = len(r.draft.tokens), r.draft.probs
        if n == 0 or (q is None and not always):
            continue
        assert q is not None, f"{r.where()} drafted {n} tokens at temperature {SAMPLED.temperature} but gave no " \
                              "probabilities, though gives_draft_probs is True"
        assert q.dim() == 2 and q.shape[0] == n and q.shape[1] <= vocab, \
            f"{r.where()}: probs must be [{n}, vocab_size={vocab}], got {tuple(q.shape)}"
        q = q.detach().double().cpu()
        assert bool(torch.isfinite(q).all()) and bool((q >= 0).all()), f"{r.where()}: negative or non-finite probs"
        sums = q.sum(-1)
        assert bool(((sums - 1).abs() < 1e-3).all()), f"{r.where()}: probability rows sum to {sums.tolist()}, not 1"
        for i, x in enumerate(r.draft.tokens):
            if 0 <= int(x) < q.shape[1]:
                assert q[i, int(x)] > 0, f"{r.where()}: token {i} ({x}) has draft probability 0 in its own row"


@_check("drafter")
def same_proposal_for_the_same_state(subject: Subject) -> None:
    """Two fresh instances driven identically propose the same; a deterministic one repeats itself after rollback."""
    for params in (GREEDY, SAMPLED):
        a, b = _session(subject, params), _session(subject, params)
        for ra, rb in zip(a, b):
            assert list(ra.draft.tokens) == list(rb.draft.tokens), \
                f"two fresh instances given the same calls (temperature {params.temperature}, seed {params.seed}) " \
                f"differ at {ra.where()}: {list(ra.draft.tokens)} vs {list(rb.draft.tokens)}"
    if subject.drafter_traits(subject.new()).may_give_draft_probs:
        return  # a sampling drafter's repeat draws from the next part of its random stream
    seq = _fed_drafter(subject)
    tokens = PROMPT + [7]
    for k in (4, 1, 8):
        first = list(seq.propose(list(tokens), k).tokens)
        seq.rollback(len(tokens) - 1)  # the last token is unseen again: the same state as before
        again = list(seq.propose(list(tokens), k).tokens)
        assert first == again, f"propose(..., k={k}), rollback({len(tokens) - 1}), the same propose again " \
                               f"gave {first} then {again}"
        seq.rollback(len(tokens))
        seq.certain(tokens[-1:], len(tokens) - 1)
        tokens.append(CONTINUATION[k % len(CONTINUATION)])


@_check("drafter")
def sane_on_an_empty_or_one_token_context(subject: Subject) -> None:
    """An empty or one-token prompt/context gives a valid (possibly empty) proposal, not an exception."""
    vocab = _vocab(subject)
    for prompt, tokens in (([], []), ([], [9]), ([9], [9]), ([9], [9, 9])):
        seq = _fed_drafter(subject, GREEDY, prompt)
        for k in (1, 4):
            where = f"begin(prompt={prompt}), propose({tokens}, k={k})"
            try:
                draft = seq.propose(list(tokens), k)
            except Exception as exc:
                raise AssertionError(f"{where} raised {type(exc).__name__}: {exc}") from exc
            assert isinstance(draft, Draft), f"{where} returned {type(draft).__name__}, not a Draft"
            assert len(draft.tokens) <= k, f"{where} returned {len(draft.tokens)} tokens"
            assert len(_valid_ids(draft, vocab)) == len(draft.tokens), f"{where} proposed ids out of range"
            seq.rollback(max(len(tokens) - 1, 0))  # the same state again for the next k


@_check("drafter")
def consistent_after_rollback(subject: Subject) -> None:
    """After a rollback it proposes what a fresh instance shown only the kept tokens would (with q: the same q).

    A drafter that gives q is run seeded; its tokens may come from a stream the rolled-back drafts advanced,
    so what must match is q: the first row, and every row while the two proposals agree."""
    gives_q = subject.drafter_traits(subject.new()).may_give_draft_probs
    params = SAMPLED if gives_q else GREEDY  # seeded: a sampling drafter's draws are reproducible
    vocab = _vocab(subject)
    for keep in (0, 1, 3):
        a = _fed_drafter(subject, params)
        tokens = PROMPT + [7]
        draft = _valid_ids(a.propose(list(tokens), 4), vocab)
        kept = draft[:keep]
        # the target's own token after the kept drafts: anything but the next draft, so that one is rejected
        rejected = draft[len(kept)] if len(draft) > len(kept) else None
        replacement = next(t for t in (9, 8, 5, 6, 7) if t != rejected)
        a.rollback(len(tokens) + len(kept))
        a.certain(tokens[-1:] + kept, len(tokens) - 1)
        after = tokens + kept + [replacement]
        got = a.propose(list(after), 4)
        b = _fed_drafter(subject, params)
        b.certain(tokens[-1:] + kept, len(tokens) - 1)
        want = b.propose(list(after), 4)
        where = f"after proposing {draft}, keeping {kept} and rolling back to {len(tokens) + len(kept)}, it proposed"
        if not gives_q:
            assert list(got.tokens) == list(want.tokens), \
                f"{where} {list(got.tokens)}; a fresh instance shown only the kept tokens proposes {list(want.tokens)}"
            continue
        # a sampling drafter's draws may come from a stream that the rolled-back drafts advanced, so its
        # tokens may differ; the distributions may not: row 0 always, later rows while the drafts agree
        if got.probs is None or want.probs is None or not len(got.tokens) or not len(want.tokens):
            continue  # nothing drafted, or no q at this state: probability_rows_sum_to_one judges that
        same = 1 + next((i for i, (x, y) in enumerate(zip(got.tokens, want.tokens)) if x != y),
                        min(len(got.tokens), len(want.tokens)))
        rows = min(same, got.probs.shape[0], want.probs.shape[0])
        qa, qb = got.probs[:rows].double().cpu(), want.probs[:rows].double().cpu()
        diff = float((qa - qb).abs().max()) if qa.shape == qb.shape else float("inf")
        assert diff <= 1e-4, f"{where} {list(got.tokens)} with q rows that differ from a fresh instance's " \
                             f"(shown only the kept tokens, same seed {params.seed}: {list(want.tokens)}) by up to " \
                             f"{diff:.3g} in the first {rows} row(s): its state still holds the rejected drafts"


@_check("drafter")
def draft_kind_none_means_an_empty_draft(subject: Subject) -> None:
    """draft_kind(tokens) gives a DraftKind (prior in [0, 1]) or None only where the proposal is empty.

    It is asked before propose; None means the runner skips propose, and asking changes no proposal."""
    from outrider.spec.drafter import DraftKind

    if not callable(getattr(subject.new(), "draft_kind", None)):
        raise CheckSkipped("the drafter has no draft_kind (optional): every round is one kind")
    for params in (GREEDY, SAMPLED):
        for plain, asked in zip(_session(subject, params), _session(subject, params, ask_kind=True)):
            kind, where = asked.kind, f"draft_kind(tokens of length {len(asked.tokens)} ending {asked.tokens[-3:]})"
            assert kind is None or (isinstance(kind, DraftKind) and 0.0 <= kind.prior <= 1.0), \
                f"{where} must return None or an outrider.api.DraftKind with a prior in [0, 1], got {kind!r}"
            assert list(asked.draft.tokens) == list(plain.draft.tokens), \
                f"asking {where} first changed {plain.where()}: {list(asked.draft.tokens)}, " \
                f"not {list(plain.draft.tokens)}"
            assert kind is not None or not asked.draft.tokens, \
                f"{where} said None (nothing to draft), but {asked.where()} proposed {list(asked.draft.tokens)}"


# A second sequence's prompt, with repeats of its own, for the checks that run several sequences through one drafter.
OTHER_PROMPT = [9, 8, 3, 4, 9, 8, 3, 4, 9, 8]


def _same_draft(got: Draft, want: Draft, where: str) -> None:
    assert list(got.tokens) == list(want.tokens), f"{where} {list(got.tokens)}; alone it proposes {list(want.tokens)}"
    if want.probs is None or not len(want.tokens):
        return
    assert got.probs is not None and got.probs.shape == want.probs.shape, \
        f"{where} q rows of shape {None if got.probs is None else tuple(got.probs.shape)}; alone " \
        f"{tuple(want.probs.shape)}"
    diff = float((got.probs.double().cpu() - want.probs.double().cpu()).abs().max())
    assert diff <= 1e-5, f"{where} q rows that differ by up to {diff:.3g} from those it gives alone"


@_check("drafter")
def sequences_interleaved_draft_as_each_alone(subject: Subject) -> None:
    """Two sequences interleaved through one drafter get the drafts each gets alone, by propose and propose_many.

    Each sequence's state is its own (`begin` returns it); the drafter's instance holds only what they share. A
    third sequence begun after both ended drafts as on an instance that ran the two one after the other: what
    `end` frees (a pooled cache) carries nothing over."""
    plans = ((GREEDY, GREEDY), (SAMPLED, replace(SAMPLED, seed=SAMPLED.seed + 1)))
    prompts = (PROMPT, OTHER_PROMPT)
    for params in plans:
        alone = _set_up(subject)
        done = []
        for prompt, p in zip(prompts, params):  # one after the other, each ended only when both are done, as below
            session = _Session(subject, _Sequence(subject, alone, p, prompt), prompt, ask_kind=True)
            while session.more():
                session.round()
            done.append(session)
        if hasattr(alone, "end"):
            for session in done:
                alone.end(session.seq.state)
        want = [session.rounds for session in done]
        third = _Session(subject, _Sequence(subject, alone, params[0], prompts[0]), prompts[0], ask_kind=True)
        while third.more():
            third.round()
        for batched in (False, True):
            if batched and not hasattr(alone, "propose_many"):
                continue
            drafter = _set_up(subject)
            sessions = [_Session(subject, _Sequence(subject, drafter, p, prompt), prompt, ask_kind=True)
                        for prompt, p in zip(prompts, params)]
            call = "propose_many" if batched else "propose"
            for r in range(len(ROUND_KS)):
                order = sessions if r % 2 == 0 else sessions[::-1]  # either may go first
                asked = [s.ask() for s in order]
                if batched:
                    drafts = drafter.propose_many([s.seq.state for s in order], [a[0] for a in asked],
                                                  [a[1] for a in asked])
                    assert len(drafts) == len(order), f"propose_many of {len(order)} sequences gave {len(drafts)} drafts"
                else:
                    drafts = [s.seq.propose(a[0], a[1]) for s, a in zip(order, asked)]
                for s, a, draft in zip(order, asked, drafts):
                    j = sessions.index(s)
                    got = s.commit(*a, draft)
                    where = (f"temperature {params[j].temperature}: sequence {j + 1} of 2 interleaved ({call}), round "
                             f"{r + 1}, {got.where()} proposed")
                    _same_draft(got.draft, want[j][r].draft, where)
                    assert got.kind == want[j][r].kind, \
                        f"temperature {params[j].temperature}: sequence {j + 1} of 2 interleaved, round {r + 1}: " \
                        f"draft_kind said {got.kind!r}, alone {want[j][r].kind!r}"
            if hasattr(drafter, "end"):
                for s in sessions:
                    drafter.end(s.seq.state)
            again = _Session(subject, _Sequence(subject, drafter, params[0], prompts[0]), prompts[0], ask_kind=True)
            for r in range(len(ROUND_KS)):
                got = again.round()
                _same_draft(got.draft, third.rounds[r].draft,
                            f"a sequence begun after two interleaved ones ended, round {r + 1}, {got.where()} proposed")


class _Greedy:
    """The argmax-chain acceptor, written out here so a drafter's check does not depend on a built-in acceptor."""

    lossless, needs_draft_probs = True, False

    def accept(self, verify: VerifyRound) -> AcceptResult:
        top = [int(t) for t in verify.target_logits.argmax(-1)]
        n = 0
        while n < verify.k and verify.draft_tokens[n] == top[n]:
            n += 1
        return AcceptResult(list(verify.draft_tokens[:n]) + [top[n]], n)


def _run(target, drafter, acceptor, params: SamplingParams, traits: DrafterTraits, n: int = E2E_TOKENS,
         prompt: list[int] = PROMPT) -> tuple[list[int], Any]:
    drafter.setup(target)
    runner = Runner(target, drafter, acceptor, traits, context=256)
    return list(runner.generate(list(prompt), n, params)), runner.stats


@_check("drafter")
def greedy_output_equals_plain_decoding(subject: Subject) -> None:
    """End to end with greedy acceptance, the output is identical to plain greedy decoding."""
    fx = subject.fixtures
    want = fx.plain_greedy(_arch(subject), PROMPT, E2E_TOKENS)
    for draft_max in (4, 8):
        drafter = subject.new()
        traits = subject.drafter_traits(drafter, draft_max)
        got, stats = _run(fx.target(_arch(subject)), drafter, _Greedy(), GREEDY, traits)
        assert got == want, f"draft_max {draft_max}: speculative output {got} differs from plain greedy {want} " \
                            f"(first difference at token {_first_difference(got, want)})"


@_check("drafter")
def seeded_sampling_equals_plain_sampling(subject: Subject) -> None:
    """End to end with the sampled acceptor and a seed, a deterministic drafter reproduces plain sampling exactly."""
    SampledAcceptor = builtin_plugin("acceptor", "sampled")

    fx = subject.fixtures
    drafter = subject.new()
    traits = subject.drafter_traits(drafter, draft_max=4)
    got, _ = _run(fx.target(_arch(subject)), drafter, SampledAcceptor(), SAMPLED, traits)
    vocab = _vocab(subject)
    assert len(got) == E2E_TOKENS and all(0 <= t < vocab for t in got), f"bad output {got}"
    if traits.may_give_draft_probs:
        raise CheckSkipped("gives_draft_probs is True: a sampling drafter preserves the distribution, not the tokens")
    want = fx.plain_sampled(_arch(subject), PROMPT, E2E_TOKENS, SAMPLED)
    assert got == want, f"seed {SAMPLED.seed}: speculative output {got} differs from plain sampling {want} " \
                        f"(first difference at token {_first_difference(got, want)})"


# Eight prompts of different lengths and repeats, for the batch check: a round's sequences draft and accept apart.
BATCH_PROMPTS = [PROMPT, OTHER_PROMPT, PROMPT[:5], [7, 7, 7, 3, 4, 7, 7, 7], OTHER_PROMPT[3:], [5, 9] * 5, [3],
                 PROMPT + OTHER_PROMPT]


@_check("drafter")
def a_batch_emits_what_each_sequence_emits_alone(subject: Subject) -> None:
    """End to end: eight prompts run as one batch (one ragged verify forward a round) emit what each emits alone.

    Greedy with the argmax-chain acceptor, and seeded sampling with the sampled acceptor (each sequence its own
    seed), at draft_max 4 and auto; `Runner.generate_many` against `Runner.generate` of each prompt on a fresh runner."""
    SampledAcceptor = builtin_plugin("acceptor", "sampled")

    arch = _arch(subject)
    if arch == "gemma4":
        raise CheckSkipped("its target, Gemma 4, runs one sequence at a time")
    target = subject.fixtures.target(arch)
    for params, draft_max in ((GREEDY, 4), (SAMPLED, 4), (SAMPLED, "auto")):
        each = [replace(params, seed=params.seed + i) if params.seed is not None else params
                for i in range(len(BATCH_PROMPTS))]
        runs = []
        for batched in (False, True):
            drafter = _set_up(subject)
            acceptor = _Greedy() if params.greedy else SampledAcceptor()
            runner = Runner(target, drafter, acceptor, subject.drafter_traits(drafter, draft_max), context=256)
            if batched:
                runs.append([seq.output for seq in runner.generate_many(BATCH_PROMPTS, E2E_TOKENS, each)])
            else:
                runs.append([list(runner.generate(list(p), E2E_TOKENS, q)) for p, q in zip(BATCH_PROMPTS, each)])
        for i, (alone, together) in enumerate(zip(*runs)):
            assert together == alone, \
                f"temperature {params.temperature}, draft_max {draft_max}: prompt {i + 1} of {len(BATCH_PROMPTS)} " \
                f"({BATCH_PROMPTS[i][:6]}...) emitted {together} in a batch, {alone} alone (first difference at " \
                f"token {_first_difference(together, alone)})"


# The losslessness check of drafters that give q: seeded generations on a toy target that copies its context
# (so context-reading drafters are often right and a wrong q moves a lot of mass), with top-k 3 so the exact
# law of the first three tokens has at most 27 cells.
Q_LAW_PARAMS = SamplingParams(1.0, top_k=3)
Q_LAW_GENERATIONS = 400
Q_LAW_TOKENS = 3  # token 1 comes from the prefill; with max_tokens 4, tokens 2 and 3 are drafted in one round
Q_LAW_DF = 3 ** 2 - 1  # the first two tokens' law under top-k 3: at most 9 cells


@_check("drafter")
def lossless_with_its_draft_probabilities(subject: Subject) -> None:
    """Statistical, with q: with the sampled acceptor the output is distributed as plain sampling from the target.

    Seeded generations on a toy target that copies its context (a drafter that reads the target's hidden states:
    the tiny model it drafts for), chi-square against the exact law of the first tokens (p > 1e-4 per statistic)."""
    _q_law(subject, DraftControls(), Q_LAW_GENERATIONS)


# The drafter-side controls must keep the law too: a stop or a drop decided from a token already drawn from q
# biases which tokens are proposed (with q = (.9, .1), p = (.5, .5) and a stop below .5 on the drawn token's q,
# the first token comes out with probability .55). More generations: the bias is a few points of mass.
Q_LAW_CONTROL_GENERATIONS = 2000
# Just above top-k 3's floor (a warped q's largest probability is >= 1/3): flat rows stop, the tiny drafters'
# sharper ones go on, so the stop is exercised both ways and the check sees enough drafts to have power (at
# 0.5 the tiny drafters' rows are too flat: their drafts stop almost always).
Q_LAW_P_MIN = 0.4


@_check("drafter")
def lossless_with_draft_p_min(subject: Subject) -> None:
    """Statistical, with q and --draft-p-min 0.4: the drafter's stop keeps the output distributed as plain sampling.

    As lossless_with_its_draft_probabilities, with DraftControls(draft_p_min=Q_LAW_P_MIN): whether position i is drafted
    may depend on q_i (llama.cpp stops when q_i's largest probability is below p_min), never on the token drawn."""
    _q_law(subject, DraftControls(draft_p_min=Q_LAW_P_MIN), Q_LAW_CONTROL_GENERATIONS)


@_check("drafter")
def lossless_with_draft_min(subject: Subject) -> None:
    """Statistical, with q and --draft-min 2 --draft-p-min 0.4: dropping short drafts keeps the output's law.

    As lossless_with_its_draft_probabilities, with DraftControls(draft_min=2, draft_p_min=Q_LAW_P_MIN): a sampled draft's
    length depends on its tokens, so dropping it for being short must not (the runner keeps q-drafts whatever their
    length; docs/acceptance.md)."""
    _q_law(subject, DraftControls(draft_min=2, draft_p_min=Q_LAW_P_MIN), Q_LAW_CONTROL_GENERATIONS)


def _q_law(subject: Subject, controls: DraftControls, generations: int) -> None:
    from outrider.spec.drafter import Target

    drafter = subject.new()
    traits = subject.drafter_traits(drafter)
    if not traits.may_give_draft_probs:
        raise CheckSkipped("gives_draft_probs is False: without q the output is plain sampling's token for token, "
                           "which seeded_sampling_equals_plain_sampling checks")
    if traits.reads_the_target or NEEDS_DRAFT_MODEL in traits.needs:
        # it drafts from the target's hidden states, or with a draft model made for the tiny target: the tiny
        # model it drafts for, whose law costs a forward per prefix (13 with top-k 3)
        target, law = subject.fixtures.target(_arch(subject)), None
    else:
        base = subject.fixtures.target("llama")
        toy = CopyingToyModel(base.model.config.vocab_size, seed=11)
        target = Target(model=toy, tokenizer=base.tokenizer, gguf=base.gguf, backend=base.backend)
        law = toy.law(PROMPT, Q_LAW_TOKENS, Q_LAW_PARAMS)
    drafter.setup(target)
    sampled_law_holds(target, drafter, law, controls, generations, capabilities=subject.capabilities)


def sampled_law_holds(target: Any, drafter: Any, law: dict[tuple[int, ...], float] | None = None,
                      controls: DraftControls = DraftControls(), generations: int = Q_LAW_GENERATIONS,
                      prompt: list[int] = PROMPT, capabilities: dict[str, Any] | None = None) -> tuple[int, int]:
    """Assert that speculation with `drafter` (set up on `target`; `capabilities`: its registered ones, if any)
    and the sampled acceptor emits its first Q_LAW_TOKENS tokens after `prompt` with the law `law` (exact_law
    under Q_LAW_PARAMS; None: computed from the target model's own forwards, one per prefix), by chi-square
    over `generations` seeded generations; returns (drafted, accepted) over them.

    Its power: a bias of total variation distance `detectable_tv(generations, Q_LAW_DF, P_THRESHOLD)` in the
    first two tokens' law is detected with probability 0.95 whatever its shape (0.167 at 400 generations, 0.075
    at 2000; over all three tokens 0.197 and 0.088): smaller biases may pass. Only generations in which
    something was drafted can be biased, so a drafter that drafts fewer tokens than that distance times
    `generations` (67 of 400, 150 of 2000) could not be caught even if every draft were wrong: it fails."""
    if law is None:
        law = exact_law(lambda context: model_next_logits(target.model, context), prompt, Q_LAW_TOKENS, Q_LAW_PARAMS)
    SampledAcceptor = builtin_plugin("acceptor", "sampled")
    runner = Runner(target, drafter, SampledAcceptor(), DrafterTraits.of(drafter, capabilities, draft_max=3),
                    controls=controls, context=64)
    counts: dict[tuple[int, ...], int] = {}
    drafted = accepted = 0
    for s in range(generations):
        out = tuple(runner.generate(list(prompt), Q_LAW_TOKENS + 1, replace(Q_LAW_PARAMS, seed=1000 + s)))
        counts[out[:Q_LAW_TOKENS]] = counts.get(out[:Q_LAW_TOKENS], 0) + 1
        drafted, accepted = drafted + runner.stats.drafted, accepted + runner.stats.accepted
    rate = f"{accepted / drafted:.2f}" if drafted else "n/a (nothing drafted)"
    detectable = detectable_tv(generations, Q_LAW_DF, P_THRESHOLD)
    least = math.ceil(detectable * generations)
    assert drafted >= least, (
        f"the drafter drafted {drafted} tokens in {generations} seeded generations (draft_min {controls.draft_min}, "
        f"draft_p_min {controls.draft_p_min}); at most {drafted} generations could be biased, under the total "
        f"variation distance {detectable:.3f} this check detects, so it proves nothing: a drafter under test must "
        f"draft at least {least} tokens here (on the tiny target its q rows should often give a token >= "
        f"{controls.draft_p_min or 0})")
    for n in (Q_LAW_TOKENS - 1, Q_LAW_TOKENS):
        want: dict[tuple[int, ...], float] = {}
        for seq, mass in law.items():
            want[seq[:n]] = want.get(seq[:n], 0.0) + mass
        got: dict[tuple[int, ...], int] = {}
        for seq, c in counts.items():
            got[seq[:n]] = got.get(seq[:n], 0) + c
        cells = sorted(set(want) | set(got))
        observed = np.array([got.get(c, 0) for c in cells])
        expected = np.array([want.get(c, 0.0) for c in cells])
        stat, df, pval, forbidden = chi2_test(observed, expected)
        detail = (f"with the sampled acceptor, over {generations} seeded generations on a seeded tiny target "
                  f"(temperature {Q_LAW_PARAMS.temperature}, top_k {Q_LAW_PARAMS.top_k}, draft_max 3, draft_min "
                  f"{controls.draft_min}, draft_p_min {controls.draft_p_min}) the first {n} tokens are not "
                  f"distributed as plain sampling from the target: chi2={stat:.1f} df={df} p={pval:.2g} "
                  f"(threshold {P_THRESHOLD}), TV distance {tv_distance(observed, expected):.3f}, acceptance rate "
                  f"{rate}. A drafter that gives q must draw each draft x from the q row it returns (x ~ q, q warped "
                  "with the run's params); a q for tokens picked another way (argmax, lookup) breaks losslessness: "
                  "give probs=None for those. Whether a position is drafted may depend on its q row, never on the "
                  "token drawn from it (outrider.api.draft_loop)")
        assert forbidden == 0, f"{detail}; {forbidden} outputs the target cannot produce were emitted"
        assert pval > P_THRESHOLD, detail
    return drafted, accepted


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ------------------------------------------------------------------------------------------------ acceptors


class AdversarialDrafter:
    """Random ids, out-of-range ids, more tokens than asked; with `probs`, garbage-shaped probability rows too."""

    needs = frozenset()

    def __init__(self, vocab_size: int, seed: int = 0, probs: bool = False):
        self.vocab_size, self.random, self.gives_draft_probs = vocab_size, random.Random(seed), probs

    def setup(self, target) -> None:
        pass

    def begin(self, prompt, params, controls) -> SamplingParams:
        return params  # its state: only the sampling settings its garbage q rows are warped with

    def rollback(self, params: SamplingParams, length: int) -> None:
        pass

    def propose(self, params: SamplingParams, tokens: list[int], k: int) -> Draft:
        choices = lambda: [self.random.randrange(self.vocab_size), -1, self.vocab_size + 5, tokens[-1]]  # noqa: E731
        ids = [self.random.choice(choices()) for _ in range(k + 3)]
        if not self.gives_draft_probs:
            return Draft(ids)
        gen = torch.Generator().manual_seed(self.random.randrange(2**31))
        q = warp(torch.randn(len(ids), self.vocab_size, generator=gen) * 3, params)
        return Draft(ids, q)


def _acceptor_caps(subject: Subject, acceptor: Any) -> tuple[bool, bool, bool]:
    return (bool(subject.capability("lossless", acceptor, True)),
            bool(subject.capability("needs_draft_probs", acceptor, False)),
            bool(subject.capability("greedy_only", acceptor, False)))


def _result_shape_problem(res: Any, drafts: list[int], vocab: int) -> str | None:
    k = len(drafts)
    if not hasattr(res, "tokens") or not hasattr(res, "accepted"):
        return f"returned {type(res).__name__}, not an AcceptResult"
    tokens, accepted = list(res.tokens), res.accepted
    if not (isinstance(accepted, int) and 1 <= len(tokens) == accepted + 1 <= k + 1):
        return f"emitted {len(tokens)} tokens with accepted={accepted!r} for k={k}; need 1 <= emitted = accepted + 1 <= k + 1"
    if tokens[:accepted] != list(drafts[:accepted]):
        return f"the first accepted={accepted} emitted tokens {tokens[:accepted]} are not the drafts {drafts[:accepted]}"
    bad = [t for t in tokens if type(t) is not int or not 0 <= t < vocab]
    if bad:
        return f"emitted {bad}: not Python ints in [0, {vocab})"
    return None


def _random_rounds(seed: int, n: int, vocab: int, params: SamplingParams, with_q: bool):
    """(logits [k+1, V], drafts with some out-of-range ids, q or None, position) for random rounds."""
    g = np.random.default_rng(seed)
    tg = torch.Generator().manual_seed(seed)
    for r in range(n):
        k = int(g.integers(0, 6))
        logits = torch.randn(k + 1, vocab, generator=tg) * 2
        drafts = [int(v) for v in g.integers(-1, vocab + 1, size=k)]
        q = warp(torch.randn(k, vocab, generator=tg), params) if with_q else None
        yield logits, drafts, q, 3 * r + 1


@_check("acceptor")
def greedy_is_the_argmax_chain(subject: Subject) -> None:
    """At temperature 0: drafts kept while they equal the target's argmax, then the argmax (bonus if all kept)."""
    acceptor = subject.new()
    lossless, needs_q, _ = _acceptor_caps(subject, acceptor)
    g = np.random.default_rng(1)
    tg = torch.Generator().manual_seed(1)
    vocab = 7
    for r in range(120):
        k = int(g.integers(0, 6))
        logits = torch.randn(k + 1, vocab, generator=tg) * 2
        top = [int(t) for t in logits.argmax(-1)]  # the oracle: the argmax chain
        # a lossy acceptor may keep a probable non-argmax draft, so it only gets drafts that are the chain
        mismatch = int(g.integers(0, k + 1)) if lossless else k
        drafts = top[:k]
        if mismatch < k:
            drafts[mismatch] = (top[mismatch] + 1 + int(g.integers(0, vocab - 1))) % vocab
        with_q = needs_q or r % 2 == 1
        q = warp(torch.randn(k, vocab, generator=tg), SamplingParams(1.0)) if with_q else None
        res = acceptor.accept(VerifyRound(logits, drafts, q, GREEDY, PositionRandom(r), 10))
        want = top[:mismatch] + [top[mismatch]]
        assert (list(res.tokens), res.accepted) == (want, mismatch), \
            f"temperature 0, target argmax chain {top}, drafts {drafts}{' with q' if with_q else ''}: emitted " \
            f"{list(res.tokens)} (accepted {res.accepted}); the argmax chain gives {want} (accepted {mismatch})"


@_check("acceptor")
def emitted_is_accepted_plus_one(subject: Subject) -> None:
    """1 <= emitted = accepted + 1 <= k + 1, kept tokens are the drafts, ids in range; lossless: p(token) > 0."""
    acceptor = subject.new()
    lossless, needs_q, _ = _acceptor_caps(subject, acceptor)
    vocab = 7
    for params in (GREEDY, SamplingParams(0.8), SamplingParams(0.7, top_k=3, top_p=0.8)):
        for with_q in ((True,) if needs_q else (False, True)):
            rng = PositionRandom(11)
            for logits, drafts, q, pos in _random_rounds(5, 80, vocab, params, with_q):
                res = acceptor.accept(VerifyRound(logits, drafts, q, params, rng, pos))
                where = f"temperature {params.temperature}, drafts {drafts}{' with q' if with_q else ''}"
                problem = _result_shape_problem(res, drafts, vocab)
                assert problem is None, f"{where}: {problem}"
                if lossless and not params.greedy and not subject.capability("greedy_only", acceptor, False):
                    p = warp(logits, params)
                    zero = [(i, t) for i, t in enumerate(res.tokens) if not p[i, t] > 0]
                    assert not zero, f"{where}: emitted tokens the target's warped distribution forbids: {zero}"


@_check("acceptor")
def lossless_in_distribution(subject: Subject) -> None:
    """Statistical: the emitted tokens are distributed as plain sampling from the target (chi-square, toy tables)."""
    acceptor = subject.new()
    lossless, needs_q, greedy_only = _acceptor_caps(subject, acceptor)
    if not lossless:
        raise CheckSkipped("lossless is False: the acceptor does not claim to preserve the target's distribution")
    if greedy_only:
        raise CheckSkipped("greedy_only is True: lossless at temperature 0 only, which greedy_is_the_argmax_chain checks")
    toy = ToyModel(seed=3)
    # top-k and top-p leave three tokens in play: a wrong residual moves a lot of mass between them
    params = SamplingParams(0.7, top_k=3, top_p=0.8)
    want_first, want_joint = toy.expected_distributions(params)
    modes = (("q", 6000),) if needs_q else (("q", 6000), ("argmax", 5000))
    for mode, n in modes:
        first, joint, rate = toy.simulate(subject.new(), params, mode, n, seed=101)
        for label, counts, want in (("first token", first, want_first), ("first two tokens", joint, want_joint)):
            stat, df, pval, forbidden = chi2_test(counts, want)
            drafter = "a sampling drafter (q given)" if mode == "q" else "a deterministic drafter (no q)"
            detail = (f"with {drafter}, over {n} seeded generations the distribution of the {label} differs from "
                      f"plain sampling from the target: chi2={stat:.1f} df={df} p={pval:.2g} (threshold "
                      f"{P_THRESHOLD}), TV distance {tv_distance(counts, want):.3f}, acceptance rate {rate:.2f}")
            assert forbidden == 0, f"{detail}; {forbidden} tokens the target forbids were emitted"
            assert pval > P_THRESHOLD, detail


@_check("acceptor")
def seeded_determinism(subject: Subject) -> None:
    """The same seed gives the same result, on a fresh instance as on a reused one."""
    reused = subject.new()
    _, needs_q, _ = _acceptor_caps(subject, reused)
    vocab = 7
    params = SamplingParams(0.9, top_k=5)
    for with_q in ((True,) if needs_q else (False, True)):
        rounds = list(_random_rounds(8, 60, vocab, params, with_q))
        runs = []
        for acceptor in (reused, reused, subject.new()):
            rng = PositionRandom(123)
            runs.append([(list(r.tokens), r.accepted) for r in (acceptor.accept(VerifyRound(*rd[:3], params, rng, rd[3]))
                                                                for rd in rounds)])
        for i, (a, b, c) in enumerate(zip(*runs)):
            assert a == b == c, f"round {i} (seed 123, drafts {rounds[i][1]}{' with q' if with_q else ''}) gave " \
                                f"{a}, then {b}, then on a fresh instance {c}"


@_check("acceptor")
def adversarial_drafter_cannot_change_the_output(subject: Subject) -> None:
    """A drafter proposing random, out-of-range and too many ids neither crashes the runner nor changes the output."""
    fx = subject.fixtures
    acceptor = subject.new()
    lossless, needs_q, greedy_only = _acceptor_caps(subject, acceptor)
    target = fx.target("llama")
    vocab = target.model.config.vocab_size
    for params in (GREEDY, SAMPLED):
        adversary = AdversarialDrafter(vocab, seed=3, probs=needs_q)
        got, _ = _run(target, adversary, subject.new(), params, DrafterTraits.of(adversary, draft_max=4))
        where = f"temperature {params.temperature}, seed {params.seed}"
        assert len(got) == E2E_TOKENS and all(type(t) is int and 0 <= t < vocab for t in got), \
            f"{where}: the output {got} is not {E2E_TOKENS} ids in [0, {vocab})"
        if not lossless:
            continue  # a lossy acceptor may be moved by its drafter; surviving it is all that is asked
        if params.greedy:
            want = fx.plain_greedy("llama", PROMPT, E2E_TOKENS)
        elif needs_q or greedy_only:
            continue  # with q the same seed only preserves the distribution (lossless_in_distribution checks it)
        else:
            # the PositionRandom convention: with a deterministic drafter, token i is drawn with rng.uniform(i)
            want = fx.plain_sampled("llama", PROMPT, E2E_TOKENS, params)
        assert got == want, f"{where}: with the adversarial drafter the output {got} differs from plain decoding " \
                            f"{want} (first difference at token {_first_difference(got, want)})"


# ------------------------------------------------------------------------------------------------ backends


def _tolerance(backend: Any, arch: str, reference: torch.Tensor) -> float:
    return logit_tolerance(getattr(backend, "dtype", torch.float32), arch, reference)


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    diff = float((got - want).abs().max()) if got.numel() else 0.0
    assert diff <= atol, f"{what}: max abs difference {diff:.3g} > tolerance {atol:.3g}"


def _models(subject: Subject):
    if "backend" not in subject.memo:
        subject.memo["backend"] = subject.new()
    backend = subject.memo["backend"]
    for arch in ARCHITECTURES:
        if arch not in subject.memo:
            subject.memo[arch] = backend.load_model(GGUFFile(subject.fixtures.model_path(arch)))
        model = subject.memo[arch]
        yield arch, backend, model, getattr(model, "device", torch.device("cpu"))


def _ids(n: int, vocab: int, seed: int, device) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).to(device)


@_check("backend")
def k_token_forward_equals_k_single_forwards(subject: Subject) -> None:
    """A forward over k tokens gives the logits of k one-token forwards (the verify pass is exact)."""
    for arch, backend, model, device in _models(subject):
        vocab = model.config.vocab_size
        for k in (1, 4, 7):
            # a prefix of 5 puts the block across the tiny gemma3's 8-token sliding-window boundary
            prefix, block = _ids(5, vocab, k, device), _ids(k, vocab, 100 + k, device)
            cache_a, cache_b = model.new_cache(64), model.new_cache(64)
            model.forward(prefix, 0, cache_a)
            model.forward(prefix, 0, cache_b)
            batched = model.forward(block, 5, cache_a)
            single = torch.cat([model.forward(block[i:i + 1], 5 + i, cache_b) for i in range(k)])
            assert tuple(batched.shape) == (k, vocab), f"{arch}: logits of a {k}-token forward have shape " \
                                                       f"{tuple(batched.shape)}, not ({k}, {vocab})"
            _close(batched, single, _tolerance(backend, arch, single), f"{arch}, k={k}: {k}-token forward vs {k} single forwards")


@_check("backend")
def truncate_then_replay_equals_a_fresh_run(subject: Subject) -> None:
    """After cache.truncate(n), forwarding other tokens at n gives what a fresh cache gives."""
    for arch, backend, model, device in _models(subject):
        vocab = model.config.vocab_size
        prefix, rejected, replacement = (_ids(n, vocab, 3 + n, device) for n in (6, 7, 5))
        cache = model.new_cache(64)
        model.forward(prefix, 0, cache)
        model.forward(rejected, 6, cache)
        assert cache.length == 13, f"{arch}: cache.length is {cache.length} after 13 tokens"
        cache.truncate(6)
        assert cache.length == 6, f"{arch}: cache.length is {cache.length} after truncate(6)"
        replayed = model.forward(replacement, 6, cache)
        fresh = model.forward(torch.cat([prefix, replacement]), 0, model.new_cache(64))[6:]
        _close(replayed, fresh, _tolerance(backend, arch, fresh), f"{arch}: truncate-then-replay vs a fresh run")


@_check("backend")
def hidden_states_have_the_declared_shape(subject: Subject) -> None:
    """forward(..., hidden=True) returns (logits [T, V], hidden [T, config.hidden_size]); the logits are unchanged."""
    for arch, backend, model, device in _models(subject):
        tokens = _ids(6, model.config.vocab_size, 9, device)
        out = model.forward(tokens, 0, model.new_cache(16), hidden=True)
        assert isinstance(out, tuple) and len(out) == 2, f"{arch}: forward(hidden=True) must return (logits, hidden)"
        logits, hidden = out
        want = (6, model.config.hidden_size)
        assert tuple(hidden.shape) == want, f"{arch}: hidden states have shape {tuple(hidden.shape)}, declared {want}"
        plain = model.forward(tokens, 0, model.new_cache(16))
        _close(logits, plain, _tolerance(backend, arch, plain), f"{arch}: logits with hidden=True vs without")


@_check("backend")
def last_only_gives_the_last_row(subject: Subject) -> None:
    """forward(..., last_only=True) returns the last row of the full logits (what a prefill asks for)."""
    for arch, backend, model, device in _models(subject):
        n = PREFILL_CHUNK + 16  # a prompt longer than a prefill chunk: the last row is in the second chunk
        tokens = _ids(n, model.config.vocab_size, 11, device)
        last = model.forward(tokens, 0, model.new_cache(n), last_only=True)
        full = model.forward(tokens, 0, model.new_cache(n))
        assert tuple(last.shape) == (1, model.config.vocab_size), \
            f"{arch}: forward(last_only=True) has shape {tuple(last.shape)}, not (1, {model.config.vocab_size})"
        _close(last, full[-1:], _tolerance(backend, arch, full), f"{arch}: last_only row vs the full forward's last row")


@_check("backend")
def matches_the_cpu_reference(subject: Subject) -> None:
    """A backend's logits match the float32 CPU reference's within its dtype's tolerance (`outrider.testing.
    tolerance`: float32 noise, or for 16-bit dtypes twice what transformers' own bfloat16 model is off by).

    The reference is the built-in cpu backend with dense float32 weights: torch's float32 arithmetic on the
    dequantized weights, within 2e-5 of a float64 oracle on every fixture. Its compact form is not the
    reference: its kernels may quantize activations to int8 (llama.cpp's design), which moves these logits
    as far as bfloat16 does. An accelerator, and a CPU backend in another dtype, is compared; the built-in
    cpu backend in float32 is skipped (dense: the reference itself; compact: int8 activations, whose
    cost docs/numerics.md measures)."""
    CPUBackend = builtin_plugin("backend", "cpu")

    backend = subject.new()
    device = torch.device(getattr(backend, "device", "cpu"))
    reference_backend = CPUBackend(weights="dense")
    if type(backend) is CPUBackend and backend.dtype == reference_backend.dtype:
        raise CheckSkipped("the float32 CPU backend is the reference (dense) or computes with int8 activations (compact)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckSkipped("no CUDA device on this machine")
    for arch in ARCHITECTURES:
        gguf = GGUFFile(subject.fixtures.model_path(arch))
        model, reference = backend.load_model(gguf), reference_backend.load_model(gguf)
        tokens = _ids(12, reference.config.vocab_size, 4, "cpu")
        want = reference.forward(tokens, 0, reference.new_cache(16))
        got = model.forward(tokens.to(getattr(model, "device", device)), 0, model.new_cache(16))
        _close(got, want, _tolerance(backend, arch, want), f"{arch}: {device} vs the float32 CPU reference")
