"""How many tokens to draft each round.

`FixedDraftLength(n)` always asks for n. `AdaptiveDraftLength` (`--draft-max auto`) picks the k in
0..cap that maximises expected emitted tokens per second, from what it has measured in this run:

- the verify cost curve: seconds for a target forward over n = k + 1 tokens (a running average per n;
  an n not yet seen is interpolated linearly from the ones that were, or extrapolated with a small
  slope, which is optimistic so that longer drafts get tried);
- the drafter's cost per drafted token (a running average);
- the per-position conditional acceptance a_j = P(draft j accepted | draft j-1 accepted), as running
  averages over the rounds that reached position j; a position no round has reached yet is assumed to
  do as well as the deepest one measured, so a drafter that is always right gets to draft further.

Expected tokens for k drafts: 1 + sum_{i<=k} prod_{j<=i} a_j (the recovered/bonus token included).
A cost is only measured for the lengths that get chosen, so one slow round could price longer drafts out
for good; every `explore_every`-th round that drafts therefore asks for 2k + 1 tokens instead of k, and
the costs (and acceptance) further out are measured again.
Rounds that draft nothing let the acceptance estimates drift back towards the prior, so a drafter
that was poor in one stretch of text is tried again later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

AUTO_DRAFT_CAP = 16


class FixedDraftLength:
    def __init__(self, n: int):
        self.n = n

    def choose(self) -> int:
        return self.n

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        pass


@dataclass
class AdaptiveDraftLength:
    cap: int = AUTO_DRAFT_CAP
    prior_acceptance: float = 0.6
    smoothing: float = 0.3  # weight of the newest observation in every running average
    recovery: float = 0.03  # per idle round, how far acceptance estimates move back to the prior
    initial_slope: float = 0.03  # assumed extra verify cost per extra token before any is measured
    explore_every: int = 8
    rounds: int = 0
    verify_s: dict[int, float] = field(default_factory=dict)
    draft_s_per_token: float | None = None
    acceptance: list[float] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)  # rounds that drafted position j + 1

    def __post_init__(self) -> None:
        self.acceptance = [self.prior_acceptance] * self.cap
        self.reached = [0] * self.cap

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def verify_cost(self, n: int) -> float:
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

    def expected_tokens(self, k: int) -> float:
        total, survive, deepest = 1.0, 1.0, None
        for j in range(k):
            if self.reached[j]:
                deepest = self.acceptance[j]
            survive *= self.acceptance[j] if self.reached[j] or deepest is None else deepest
            total += survive
        return total

    def choose(self) -> int:
        draft_cost = self.draft_s_per_token or 0.0
        best_k, best_rate = 0, 0.0
        for k in range(self.cap + 1):
            rate = self.expected_tokens(k) / (self.verify_cost(k + 1) + k * draft_cost)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if 0 < best_k < self.cap and self.rounds % self.explore_every == self.explore_every - 1:
            return min(2 * best_k + 1, self.cap)
        return best_k

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self.rounds += 1
        n = drafted + 1
        self.verify_s[n] = self._average(self.verify_s.get(n), verify_s)
        if drafted == 0:
            self.acceptance = [a + self.recovery * (self.prior_acceptance - a) for a in self.acceptance]
            return
        self.draft_s_per_token = self._average(self.draft_s_per_token, draft_s / drafted)
        for j in range(min(drafted, accepted + 1)):
            self.reached[j] += 1
            hit = 1.0 if j < accepted else 0.0
            self.acceptance[j] = self._average(self.acceptance[j], hit)
