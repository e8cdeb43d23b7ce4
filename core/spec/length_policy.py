"""How many tokens to draft each round.

`FixedDraftLength(n)` always asks for n. `AdaptiveDraftLength` (`--draft-max auto`) picks the k in
0..cap that maximises expected emitted tokens per second, from what it has measured in this run:

- the verify cost curve: seconds for a target forward over n = k + 1 tokens (a running average per n;
  an n not yet seen is interpolated linearly from the ones that were, or extrapolated with a small
  slope, which is optimistic so that longer drafts get tried). A forward over more rows never costs
  less, so no n > 1 is priced above what a longer verify has cost in this generation: one slow round would
  otherwise price its length out for good, since a length not chosen is not measured again;
- the drafter's cost per drafted token (a running average per kind of draft: in a chain a lookup draft is
  nearly free and an MTP draft costs head forwards; a kind not yet timed takes the average over all kinds).
  What a drafter spends keeping up with the target rather than drafting (what a catch-up of rows accepted
  in other rounds took beyond the draft step it also made, an MTP head's learning, reported as `upkeep_s`)
  does not grow with k and is not billed per token;
- the per-position conditional acceptance a_j = P(draft j accepted | draft j-1 accepted), as running
  averages over the rounds that reached position j; a position no round has reached yet is assumed to
  do as well as the deepest one measured, so a drafter that is always right gets to draft further.
  A position's first observations weigh as a mean from that assumed value (1/2, 1/3, ... until the
  running average's weight is larger).
  These are kept per kind of draft (`DraftKind`, which the drafter names before it drafts: for the lookup
  drafter, the length of the matched n-gram), each starting from its kind's prior, so that a weak 2-gram
  match is not priced like a 4-gram one. A round the drafter has nothing for is plain decoding and
  teaches nothing about acceptance.

Expected tokens for k drafts: 1 + sum_{i<=k} prod_{j<=i} a_j (the recovered/bonus token included), where a
draft that stops short (a confidence stop, a lookup continuation that ran out) counts as missed where it
stopped. Its expected cost sums over where the drafter stops: asked for k and stopped after d < k tokens, it
cost d + 1 draft steps and a verify of d + 1 rows, so the drafter's own per-position continuation rates are
kept beside the acceptance (a drafter that stops often is cheap to ask for many).
A cost is only measured for the lengths that get chosen, so one slow round could price longer drafts out
for good; every `explore_every`-th round that drafts therefore asks for 2k + 1 tokens instead of k, and
the costs (and acceptance) further out are measured again.
A policy at k = 0 measures nothing about drafting, so one noisy early round (a slow draft, a rejected first
token) could decide a whole generation, and a kind of draft that was poor in one stretch of text would never
be tried in the next. It therefore drafts one token from 0 (an exploring round) whenever what exploring rounds
have lost against plain decoding (a won round counts as a negative loss), plus what the next one could lose,
stays within `explore_budget` of the run's time, plus `explore_allowance` rejected exploring rounds: trying again
never costs more than that, and it measures the draft's cost, the two-token verify and the first position's
acceptance anew. The allowance is for a run's start, where a share of little time buys no second look: a streak
of misses early in a first generation (every `outrider generate` is one) would otherwise leave a drafter that pays
at 0 for most of it, since one rejected look spends the share for many rounds.

A runner keeps one policy across generations (`begin_generation`). Acceptance starts again from each kind's
prior, since the next text is another text. Costs carry over, being the machine's, but only until this
generation measures them: its first measurement replaces the carried value, since a cost measured while
another process shared the cores would otherwise linger (a length priced out is not measured again); a
slow first draft (a cold start) is then measured again by exploring, whose budget is a share of all the time
run, earlier generations included. A kind priced at 0 by a draft cost carried from an earlier generation
would be measured again only by exploring, whose budget a slow stretch may have spent: when a kind's first
choice in a generation is 0 on such a cost, it drafts one token anyway (at most one look per kind per
generation). A generation that is untimed (below), or timed after untimed ones, starts its exploring account
afresh: the two count in different units, and an untimed generation's lengths follow its own seeded history.

Measured timings differ from run to run. Where the draft lengths change the output (a drafter that gives q:
the Leviathan rule emits another token at a drafted position than at an undrafted one; a lossy acceptor)
and the run should reproduce (a seed, or temperature 0), the runner makes the policy `timed=False`: a
fixed cost model (a verify of n tokens costs 1 + initial_slope (n - 1) one-token verifies, a drafted token
its kind's `cost` where the drafter knows it, else `untimed_draft_cost` of one), so the lengths depend on the
seeded acceptance history alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from typing import Iterator

from outrider.spec.drafter import DEFAULT_KIND, DraftKind

AUTO_DRAFT_CAP = 16


class FixedDraftLength:
    def __init__(self, n: int):
        self.n = n

    def choose(self, kind: DraftKind = DEFAULT_KIND) -> int:
        return self.n

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float,
               kind: DraftKind | None = DEFAULT_KIND, upkeep_s: float = 0.0, asked: int | None = None,
               learn_verify: bool = True) -> None:
        pass


@dataclass
class KindAcceptance:
    """One kind of draft's running per-position acceptance, and how many rounds reached each position; and
    how often the drafter goes on drafting at each position it is asked for (a confidence stop ends a draft
    before the target sees it, whatever the target would have accepted)."""

    prior: float
    cap: int
    acceptance: list[float] = field(init=False)
    reached: list[int] = field(init=False)  # rounds that drafted position j + 1
    continued: list[float] = field(init=False)  # P(drafts position j + 1 | asked for it and drafted up to j)
    asked: list[int] = field(init=False)  # rounds that asked for position j + 1 with everything before it drafted

    def __post_init__(self) -> None:
        self.acceptance = [self.prior] * self.cap
        self.reached = [0] * self.cap
        self.continued = [1.0] * self.cap
        self.asked = [0] * self.cap


@dataclass
class AdaptiveDraftLength:
    cap: int = AUTO_DRAFT_CAP
    smoothing: float = 0.3  # weight of the newest observation in every running average
    initial_slope: float = 0.03  # assumed extra verify cost per extra token before any is measured
    explore_every: int = 8
    explore_budget: float = 0.01  # share of the run's time that exploring rounds from k = 0 may lose
    explore_allowance: float = 3.0  # rejected exploring rounds (at the asking kind's price) beyond that share
    timed: bool = True  # False: the fixed cost model above, for runs whose output the lengths change
    untimed_draft_cost: float = 0.1  # a drafted token's cost in one-token verifies, when not timed
    rounds: int = 0
    verify_s: dict[int, float] = field(default_factory=dict)
    draft_s_per_token: float | None = None  # over every kind: for a kind not yet timed
    draft_s_per_token_by_kind: dict[DraftKind, float] = field(default_factory=dict)
    kinds: dict[DraftKind, KindAcceptance] = field(default_factory=dict)
    run_s: float = 0.0  # every round's time, upkeep included (untimed: the cost model's)
    explore_loss_s: float = 0.0  # what exploring rounds from 0 took beyond plain decoding's price of their tokens
    exploring: bool = False  # the length just chosen is an exploring round's
    measured: set = field(default_factory=set)  # the costs this generation has measured (the others carried)
    looked: set = field(default_factory=set)  # the kinds this generation has chosen a length for

    def begin_generation(self, timed: bool = True) -> None:
        if not timed or not self.timed:
            self.run_s = self.explore_loss_s = 0.0
        self.rounds, self.kinds, self.timed, self.exploring = 0, {}, timed, False
        self.measured, self.looked = set(), set()

    def estimates(self, kind: DraftKind = DEFAULT_KIND) -> KindAcceptance:
        if kind not in self.kinds:
            self.kinds[kind] = KindAcceptance(kind.prior, self.cap)
        return self.kinds[kind]

    def measured_costs(self) -> tuple[dict[int, float], float | None, dict[DraftKind, float]]:
        """The costs this generation measured: verify seconds by rows, draft seconds a token (over all kinds, None
        where unmeasured) and by kind."""
        return ({n: s for n, s in self.verify_s.items() if ("verify", n) in self.measured},
                self.draft_s_per_token if "draft" in self.measured else None,
                {k: s for k, s in self.draft_s_per_token_by_kind.items() if ("draft", k) in self.measured})

    def _average(self, old: float | None, new: float, key: object) -> float:
        """The running average of the cost `key`; its first measurement in a generation replaces what an earlier
        generation left (or a caller set), if anything."""
        if key not in self.measured:
            self.measured.add(key)
            return new
        return old + self.smoothing * (new - old)

    def verify_cost(self, n: int) -> float:
        if not self.timed:
            return 1.0 + self.initial_slope * (n - 1)
        estimate = self._verify_estimate(n)
        if n == 1:  # plain decoding's price stays as measured
            return estimate
        # a cost carried from another generation caps nothing
        longer = [s for m, s in self.verify_s.items() if m > n and ("verify", m) in self.measured]
        return min([estimate, *longer])

    def _verify_estimate(self, n: int) -> float:
        if n in self.verify_s:
            return self.verify_s[n]
        known = sorted(self.verify_s)
        if not known:
            return 1.0 + self.initial_slope * (n - 1)
        below = [m for m in known if m < n]
        above = [m for m in known if m > n]
        if below and above:
            lo, hi = below[-1], above[0]
            w = (n - lo) / (hi - lo)
            return self.verify_s[lo] * (1 - w) + self.verify_s[hi] * w
        anchor = below[-1] if below else above[0]
        base = self.verify_s[known[0]]
        return max(self.verify_s[anchor] + self.initial_slope * base * (n - anchor), 1e-9)

    def _weight(self, observations: int) -> float:
        # a position's first observations count as a mean from its assumed value (worth one), then as the
        # running average: a handful of rounds decides, one round does not
        return max(self.smoothing, 1.0 / (observations + 1))

    @staticmethod
    def _survival(rates: list[float], observed: list[int]) -> Iterator[float]:
        """prod_{j<=i} rates_j for i = 1, 2, ...; a position never observed takes the deepest observed one's
        rate (its own assumed value where none deeper is)."""
        survive, deepest = 1.0, None
        for rate, seen in zip(rates, observed):
            if seen:
                deepest = rate
            survive *= rate if seen or deepest is None else deepest
            yield survive

    def _expected_by_length(self, kind: DraftKind) -> Iterator[float]:
        """expected_tokens(k) for k = 1, 2, ..., cap, in one pass."""
        est = self.estimates(kind)
        total = 1.0
        for survive in self._survival(est.acceptance, est.reached):
            total += survive
            yield total

    def expected_tokens(self, k: int, kind: DraftKind = DEFAULT_KIND) -> float:
        return 1.0 if k == 0 else next(islice(self._expected_by_length(kind), k - 1, None))

    def choose(self, kind: DraftKind = DEFAULT_KIND) -> int:
        self.exploring = False
        best_k = self.best_length(kind)
        first_choice = kind not in self.looked
        self.looked.add(kind)
        if 0 < best_k < self.cap and self.rounds % self.explore_every == self.explore_every - 1:
            return min(2 * best_k + 1, self.cap)
        if best_k == 0 and ((first_choice and self._priced_on_carried_costs(kind))
                            or self._may_explore_from_zero(kind)):
            self.exploring = True
            return 1
        return best_k

    def _priced_on_carried_costs(self, kind: DraftKind) -> bool:
        return self.timed and kind in self.draft_s_per_token_by_kind and ("draft", kind) not in self.measured

    def _draft_cost(self, kind: DraftKind) -> float:
        if not self.timed:
            return self.untimed_draft_cost if kind.cost is None else kind.cost
        if kind in self.draft_s_per_token_by_kind:
            return self.draft_s_per_token_by_kind[kind]
        if kind.cost is not None:  # not timed yet, but the drafter knows its price in verifies
            return kind.cost * self.verify_cost(1)
        return self.draft_s_per_token or 0.0

    def best_length(self, kind: DraftKind = DEFAULT_KIND) -> int:
        """The k in 0..cap with the most expected tokens per second, exploring aside. Asked for k, a drafter
        that stops after d < k tokens costs d + 1 draft steps (the last one showed the stop) and a verify of
        d + 1 rows, not k: the expected cost sums over where it stops."""
        draft_cost = self._draft_cost(kind)
        best_k, best_rate = 0, 1.0 / self.verify_cost(1)
        stopped_cost, beyond = 0.0, 1.0  # expected cost of the rounds that stop before position k; P(D >= k - 1)
        est = self.estimates(kind)
        drafted_beyond = self._survival(est.continued, est.asked)  # P(drafts >= k tokens, asked for more)
        for k, (expected, beyond_k) in enumerate(zip(self._expected_by_length(kind), drafted_beyond), start=1):
            stopped_cost += (beyond - beyond_k) * (self.verify_cost(k) + k * draft_cost)  # stopped at position k
            cost = stopped_cost + beyond_k * (self.verify_cost(k + 1) + k * draft_cost)
            rate = expected / cost
            if rate > best_rate:
                best_k, best_rate = k, rate
            beyond = beyond_k
        return best_k

    def _may_explore_from_zero(self, kind: DraftKind) -> bool:
        # no spacing between exploring rounds: the budget spaces them where they lose, and where they win
        # (the policy priced out what pays) the sooner the better
        worst = self._draft_cost(kind) + self.verify_cost(2) - self.verify_cost(1)  # the draft rejected
        return self.explore_loss_s + worst <= self.explore_budget * self.run_s + self.explore_allowance * worst

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float,
               kind: DraftKind | None = DEFAULT_KIND, upkeep_s: float = 0.0, asked: int | None = None,
               learn_verify: bool = True) -> None:
        """After a round; `kind` None: the drafter had nothing to offer. `draft_s` excludes `upkeep_s`.
        `learn_verify` False: `verify_s` is this sequence's share of a forward that verified several (a batch's
        costs are `BatchPricing`'s), so it teaches nothing about what a verify of this length alone costs.
        `asked`: the length asked for (default: `drafted`). A draft shorter than asked (the drafter's confidence
        stop, a lookup continuation that ran out) yields what a rejection there yields, and its drafter worked
        on the position it stopped at: that position counts as missed, and the draft's time is spread over
        it too, so a drafter that mostly stops before its first token is priced as what it is."""
        self.rounds += 1
        n = drafted + 1
        stopped = int(asked is not None and drafted < asked)
        worked = drafted + stopped  # positions the drafter spent time on
        if self.timed:
            round_s = draft_s + upkeep_s + verify_s
        else:  # the cost model's, so that when to explore follows the seeded history alone
            round_s = self.verify_cost(n) + worked * self._draft_cost(kind or DEFAULT_KIND)
        if self.exploring:  # priced before this round's timings move the plain verify's
            self.explore_loss_s += round_s - (accepted + 1) * self.verify_cost(1)
            self.exploring = False
        self.run_s += round_s
        if self.timed and learn_verify:
            self.verify_s[n] = self._average(self.verify_s.get(n), verify_s, ("verify", n))
        if kind is None:
            return
        est = self.estimates(kind)
        self._count_continuations(est, drafted, drafted if asked is None else asked)
        if worked == 0:
            return
        if self.timed:
            self.draft_s_per_token = self._average(self.draft_s_per_token, draft_s / worked, "draft")
            by_kind = self.draft_s_per_token_by_kind
            by_kind[kind] = self._average(by_kind.get(kind), draft_s / worked, ("draft", kind))
        for j in range(min(worked, accepted + 1)):
            if not est.reached[j] and j:
                # reached for the first time: it was priced as the deepest measured position, so that is what
                # its first observation moves; from the prior, a drafter right everywhere would need many
                # rounds at each deeper position, reached only on exploring rounds, before drafting there paid
                est.acceptance[j] = est.acceptance[j - 1]
            est.reached[j] += 1
            hit = 1.0 if j < accepted else 0.0
            est.acceptance[j] += self._weight(est.reached[j]) * (hit - est.acceptance[j])

    def _count_continuations(self, est: KindAcceptance, drafted: int, asked: int) -> None:
        for j in range(min(drafted + 1, asked, self.cap)):  # positions asked for with all before them drafted
            est.asked[j] += 1
            went_on = 1.0 if j < drafted else 0.0
            est.continued[j] += self._weight(est.asked[j]) * (went_on - est.continued[j])


class PolicyMemory:
    """What finished generations measured, for the policies of the next ones to start from: a server's requests
    each get a policy of their own, yet the machine's costs are the same for all. A new policy starts from the
    latest measurement of each cost, carried (its own first measurement replaces it, as a policy carried from one
    generation to the next does). Acceptance is not carried: the next request is another text (a story after a code
    edit), and a story's acceptance as a code edit's prior kept the edit from drafting for most of its tokens."""

    def __init__(self) -> None:
        self.verify_s: dict[int, float] = {}
        self.draft_s_per_token: float | None = None
        self.draft_s_per_token_by_kind: dict[DraftKind, float] = {}

    def new_policy(self) -> AdaptiveDraftLength:
        return AdaptiveDraftLength(verify_s=dict(self.verify_s), draft_s_per_token=self.draft_s_per_token,
                                   draft_s_per_token_by_kind=dict(self.draft_s_per_token_by_kind))

    def remember(self, policy: AdaptiveDraftLength) -> None:
        """A timed generation's measured costs, once it is done."""
        if not policy.timed:
            return
        verify_s, per_token, by_kind = policy.measured_costs()
        self.verify_s.update(verify_s)
        self.draft_s_per_token_by_kind.update(by_kind)
        if per_token is not None:
            self.draft_s_per_token = per_token


@dataclass
class DecayedRatio:
    """A ratio of two sums in which every observation weighs `decay` times less with each newer one: what recent
    observations say, weighted by their size (a 300-row read counts for more than a 2-row one)."""

    decay: float
    numerator: float = 0.0
    denominator: float = 0.0
    count: int = 0

    def add(self, numerator: float, denominator: float) -> None:
        self.numerator = self.decay * self.numerator + numerator
        self.denominator = self.decay * self.denominator + denominator
        self.count += 1

    @property
    def value(self) -> float | None:
        return self.numerator / self.denominator if self.denominator else None


@dataclass
class RowCosts:
    """What a target forward over R rows costs (seconds), whatever sequences they belong to: running averages per
    R, linear between measured ones, and beyond them a small slope from the nearest (optimistic, so that a longer
    batch gets tried). A forward over more rows never costs less: no R is priced above a longer one measured."""

    smoothing: float = 0.3
    initial_slope: float = 0.03  # extra cost per extra row, as a share of the cheapest measured forward
    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, rows: int, took: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = took if old is None else old + self.smoothing * (took - old)

    def cost(self, rows: int) -> float | None:
        known = sorted(self.seconds)
        if not known:
            return None
        if rows in self.seconds:
            estimate = self.seconds[rows]
        else:
            below, above = [m for m in known if m < rows], [m for m in known if m > rows]
            if below and above:
                lo, hi = below[-1], above[0]
                w = (rows - lo) / (hi - lo)
                estimate = self.seconds[lo] * (1 - w) + self.seconds[hi] * w
            else:
                anchor = below[-1] if below else above[0]
                estimate = max(self.seconds[anchor] + self.initial_slope * self.seconds[known[0]] * (rows - anchor),
                               1e-9)
        return min([estimate, *(s for m, s in self.seconds.items() if m > rows)])


class BatchPricing:
    """Draft lengths for a step of several sequences, priced for the batch: the verify is ONE forward over every
    sequence's t0 and drafts, so a drafted token costs what it adds to that forward over the batch's rows (little,
    where the weights' reading dominates), not what a lone sequence's verify of that length would cost. Each
    sequence brings its own acceptance per position (its `AdaptiveDraftLength`); the lengths are the ones with the
    most expected tokens per second over all of them: a sequence whose drafts do not pay gets none, and a batch
    where drafting does not pay drafts nothing (speculation is never slower than the same load without it, up to
    what the estimates miss).

    What drafting costs depends on how the drafter batches. One that drafts every sequence in lockstep
    (`propose_many`: one draft forward a position for all of them) pays per position of the deepest draft, whatever
    the number of sequences at that position: the batch pays each depth once (`draft_position_s`, learned from
    its proposals), and a token at a depth already paid for costs only its verify row, so several sequences share
    a depth that none would pay for alone. Any other drafter pays per drafted token (each sequence's own cost).

    A drafter that must read rows of a sequence before it drafts it (a draft model's first draft reads the prompt;
    after rounds without drafts it reads the tokens accepted since) pays that once, when the sequence starts
    drafting again, and the whole batch waits for it: a draft model's prompt read costs several of the batch's
    steps. A sequence enters drafting only where that read is won back within half the tokens it has left (at most
    what generations have typically run to); once it drafts, the read is paid and prices nothing more.
    `catch_up_row_s` is learned from what the drafter reports as upkeep per row read.

    What the estimates miss (acceptance carried from other texts, a cost that moved) the batch's own record catches:
    per batch size, the tokens a second its steps gave where they drafted and where they did not. Where drafting
    steps have given less than plain ones, a batch of that size drafts nothing, and tries again (its drafting record
    cleared) only after `RETRY_STEPS` plain steps: a wrong estimate costs a few steps, not the load's rate.
    """

    ENTRY_PAYBACK = 0.5  # of a sequence's tokens left, the share that must win its read back: the read is paid
    # now, the gains are estimates
    CATCH_UP_DECAY = 0.9  # of the rows and seconds summed for `catch_up_row_s`: recent reads weigh most
    RECORD_DECAY = 0.95  # of the tokens and seconds summed per (batch size, drafted or not)
    MIN_STEPS = 8  # steps of each kind before the record overrules the estimates
    RETRY_STEPS = 256  # plain steps at a batch size before drafting there is tried again

    def __init__(self) -> None:
        self.rows = RowCosts()
        self.draft_position_s: float | None = None  # a lockstep drafter's seconds per depth of a step's drafts
        self._catch_up = DecayedRatio(self.CATCH_UP_DECAY)  # catch-up seconds over the rows they read
        self._record: dict[tuple[int, bool], DecayedRatio] = {}  # (batch, drafted): tokens over seconds
        self._plain_since: dict[int, int] = {}  # plain steps per batch size since drafting was ruled out there

    def observe_step(self, batch: int, drafted: bool, tokens: int, took: float) -> None:
        """A step of `batch` sequences, with drafts or without, emitted `tokens` in `took` seconds (drafting, its
        catch-ups and the verify)."""
        self._record.setdefault((batch, drafted), DecayedRatio(self.RECORD_DECAY)).add(tokens, took)
        if not drafted and batch in self._plain_since:
            self._plain_since[batch] += 1

    def drafting_pays(self, batch: int) -> bool:
        """Whether a batch of this size may draft now. Not where its drafting steps have given fewer tokens a second
        than its plain ones (each seen `MIN_STEPS` times), until `RETRY_STEPS` plain steps have run since that was
        found; then it may again, on a fresh drafting record."""
        since = self._plain_since.get(batch)
        if since is not None:
            if since < self.RETRY_STEPS:
                return False
            del self._plain_since[batch], self._record[batch, True]
            return True
        drafting, plain = self._record.get((batch, True)), self._record.get((batch, False))
        if drafting is None or plain is None or min(drafting.count, plain.count) < self.MIN_STEPS:
            return True
        if drafting.value < plain.value:
            self._plain_since[batch] = 0
            return False
        return True

    def observe(self, rows: int, took: float) -> None:
        self.rows.observe(rows, took)

    def observe_draft(self, depth: int, took: float) -> None:
        """A lockstep drafter drafted to `depth` positions (the deepest sequence's) in `took` seconds."""
        if depth > 0:
            per = took / depth
            old = self.draft_position_s
            self.draft_position_s = per if old is None else old + self.rows.smoothing * (per - old)

    def observe_catch_up(self, rows: int, took: float) -> None:
        """A drafter read `rows` rows it had not seen (prompts, tokens accepted while it did not draft) in `took`
        seconds of upkeep."""
        if rows > 0:
            self._catch_up.add(took, rows)

    @property
    def catch_up_row_s(self) -> float | None:
        return self._catch_up.value

    def _entry_costs(self, n: int, catch_up: list[tuple[int, int]] | None) -> list[float]:
        """Per plan, seconds each token it emits drafting must bear of its catch-up read: the read spread over the
        first `ENTRY_PAYBACK` of the `horizon` tokens it has left. 0 where nothing is to be read, or no read has
        been timed yet (optimistic, so that one gets timed)."""
        per_row = self.catch_up_row_s
        if catch_up is None or per_row is None:
            return [0.0] * n
        return [per_row * rows / max(horizon * self.ENTRY_PAYBACK, 1) for rows, horizon in catch_up]

    def choose(self, plans: list[tuple[AdaptiveDraftLength, DraftKind, int]], other_rows: int = 0,
               lockstep: bool = False, other_depth: int = 0,
               catch_up: list[tuple[int, int]] | None = None) -> list[int] | None:
        """For each (policy, kind, most tokens it may draft): its length, beside `other_rows` rows of the step's
        other sequences (their t0 and drafts, whose lengths are not this pricing's; `other_depth` their deepest
        draft, which a lockstep drafter pays for anyway); None until a forward of about the batch's rows has
        been timed. `catch_up`, per plan: (rows the drafter must read before it drafts that sequence, tokens the
        sequence has left to draft in)."""
        base = len(plans) + other_rows
        if self.rows.cost(base) is None:
            return None
        expected = [[1.0, *islice(p._expected_by_length(kind), limit)] if limit > 0 else [1.0]
                    for p, kind, limit in plans]
        row_cost = [self.rows.cost(base + n) for n in range(sum(len(c) - 1 for c in expected) + 1)]
        entry = self._entry_costs(len(plans), catch_up)
        if not lockstep:
            return self._grown(expected, row_cost, [p._draft_cost(kind) for p, kind, _ in plans], entry)
        position = self.draft_position_s
        if position is None:  # not timed yet: what the sequences' own policies think a drafted token costs
            position = sum(p._draft_cost(kind) for p, kind, _ in plans) / len(plans)
        # every token adds one row, so at a given depth the best tokens are the likeliest to be accepted
        gains = [(curve[i] - curve[i - 1], i, j) for j, curve in enumerate(expected) for i in range(1, len(curve))]
        gains.sort(key=lambda g: (-g[0], g[1]))
        best, best_rate = [0] * len(plans), len(plans) / row_cost[0]
        for depth in range(1, max(len(c) for c in expected)):
            fixed = position * max(0, depth - other_depth)
            ks, tokens, added, entering = [0] * len(plans), float(len(plans)), 0, 0.0
            current = tokens / (row_cost[0] + fixed)
            for gain, i, j in gains:  # a sequence's positions come in order: its gains fall with depth
                if i > depth or i != ks[j] + 1:
                    continue
                enters = entry[j] * (expected[j][1] if i == 1 else gain)  # its tokens' share of its read
                rate = (tokens + gain) / (row_cost[added + 1] + fixed + entering + enters)
                if rate <= current:
                    continue  # a smaller gain elsewhere may still pay, where it has less to read first
                ks[j], tokens, added, current = i, tokens + gain, added + 1, rate
                entering += enters
            if current > best_rate:
                best, best_rate = ks, current
        return best

    @staticmethod
    def _grown(expected: list[list[float]], row_cost: list[float], draft_cost: list[float],
               entry: list[float]) -> list[int]:
        """Lengths grown a token at a time, each to the sequence whose next token gives the batch the highest
        rate, while that rate rises (each token costs its row and its sequence's own draft cost, and the tokens of
        a sequence that has a read to catch up bear their share of it)."""
        ks = [0] * len(expected)
        tokens, drafting = float(len(expected)), 0.0
        current = tokens / row_cost[0]

        def cost(j: int, k: int) -> float:
            curve = expected[j]
            return draft_cost[j] + entry[j] * (curve[1] if k == 0 else curve[k + 1] - curve[k])

        while True:
            best, best_rate = None, current
            added = sum(ks)
            for j, (k, curve) in enumerate(zip(ks, expected)):
                if k + 1 < len(curve):
                    r = (tokens + curve[k + 1] - curve[k]) / (row_cost[added + 1] + drafting + cost(j, k))
                    if r > best_rate:
                        best, best_rate = j, r
            if best is None:
                return ks
            tokens += expected[best][ks[best] + 1] - expected[best][ks[best]]
            drafting += cost(best, ks[best])
            ks[best] += 1
            current = best_rate
