"""Small seeded toy distributions for the acceptor tests: a target and a drafter given as logit tables
indexed by (position, previous token), and a simulator of speculative rounds on them.

The expected distribution of the emitted tokens is computed analytically from the warped target tables
(plain sampling: first token ~ p(pos 1 | prefix), second ~ p(pos 2 | first)), never by an acceptor.
"""

from __future__ import annotations

import numpy as np
import torch

from outrider.spec.acceptance import VerifyRound
from outrider.spec.random_streams import PositionRandom
from outrider.spec.sampling import SamplingParams, warp

V = 6  # toy vocabulary
K = 2  # drafted tokens per round
N_POS = 4  # table rows for positions 1..4 (a generation of two tokens needs at most position 4)
PREFIX = 0  # the token before position 1
DRAFTER_MODES = ("q", "argmax", "argmax-soft-q")


class ToyModel:
    """Target logits T[pos-1, prev, :] and draft logits D[pos-1, prev, :] (drafter close to, not equal to, T)."""

    def __init__(self, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        self.target = torch.randn(N_POS, V, V, generator=g) * 0.9
        self.draft = 0.7 * self.target + torch.randn(N_POS, V, V, generator=g) * 0.7

    def expected_distributions(self, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
        """Plain sampling from the target: (P(first token), P(first, second))."""
        p = warp(self.target, params).double().numpy()
        first = p[0, PREFIX]
        return first, first[:, None] * p[1]

    def simulate(self, acceptor, params: SamplingParams, drafter: str, n_seq: int, seed: int, k: int = K):
        """n_seq independent generations of (at least) two tokens; returns (first counts, joint counts, rate).

        drafter: "q" (x ~ q, q given to the acceptor), "argmax" (x = argmax q, no q given), "argmax-soft-q"
        (x = argmax q but the soft q given: the classic bug, which a correct acceptor cannot undo).
        """
        if drafter not in DRAFTER_MODES:
            raise ValueError(f"drafter must be one of {DRAFTER_MODES}, got {drafter!r}")
        q_tab = warp(self.draft, params)
        cum = torch.cumsum(q_tab.double(), dim=-1).numpy()
        top = q_tab.argmax(dim=-1).numpy()
        gen = np.random.default_rng(seed)
        draft_u = gen.random((n_seq, 2, k))
        first = np.zeros(V, dtype=np.int64)
        joint = np.zeros((V, V), dtype=np.int64)
        drafted = accepted = 0
        for s in range(n_seq):
            rng = PositionRandom(seed * 1_000_003 + s)
            out: list[int] = []
            pos, prev, rnd = 1, PREFIX, 0
            while len(out) < 2:
                drafts: list[int] = []
                ctx = prev
                for j in range(k):
                    if drafter == "q":
                        c = cum[pos - 1 + j, ctx]
                        x = min(int(np.searchsorted(c, draft_u[s, rnd, j] * c[-1], side="right")), V - 1)
                    else:
                        x = int(top[pos - 1 + j, ctx])
                    drafts.append(x)
                    ctx = x
                rows = [self.target[pos - 1, prev]] + [self.target[pos + j, drafts[j]] for j in range(k)]
                q = None
                if drafter != "argmax":
                    ctxs = [prev] + drafts[:-1]
                    q = torch.stack([q_tab[pos - 1 + j, ctxs[j]] for j in range(k)])
                res = acceptor.accept(VerifyRound(torch.stack(rows), drafts, q, params, rng, pos))
                drafted += k
                accepted += res.accepted
                out.extend(res.tokens)
                pos += len(res.tokens)
                prev = out[-1]
                rnd += 1
            first[out[0]] += 1
            joint[out[0], out[1]] += 1
        return first, joint, accepted / drafted


class CopyingToyCache:
    """The toy target's "KV cache": the tokens it has seen, truncated like a real one."""

    def __init__(self, max_len: int) -> None:
        self.max_len, self.tokens = max_len, []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        del self.tokens[n:]


class CopyingToyConfig:
    def __init__(self, vocab_size: int, hidden_size: int = 8, context_length: int = 256) -> None:
        self.vocab_size, self.hidden_size, self.n_layers, self.context_length = vocab_size, hidden_size, 1, context_length


class CopyingToyModel:
    """A target model whose next-token logits are a seeded table indexed by the last token, plus `boost` on
    the token that followed the last token's previous occurrence (a copying head). Drafters that look at
    the context (lookup, bigram, suffix) are then often right, so a wrong q moves a lot of mass, and the law
    of any continuation is exact and cheap: `next_logits(context)`, computed without the runner.
    It offers the model API the runner uses (forward, new_cache, config, device) on the CPU."""

    device = torch.device("cpu")

    def __init__(self, vocab_size: int, seed: int = 0, boost: float = 3.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab_size, vocab_size, generator=g) * 0.5
        self.boost = boost
        self.config = CopyingToyConfig(vocab_size)

    def next_logits(self, context: list[int]) -> torch.Tensor:
        last = context[-1]
        logits = self.table[last].clone()
        for j in range(len(context) - 2, -1, -1):
            if context[j] == last:
                logits[context[j + 1]] += self.boost
                break
        return logits

    def new_cache(self, max_len: int) -> CopyingToyCache:
        return CopyingToyCache(max_len)

    def forward(self, tokens: torch.Tensor, start: int, cache: CopyingToyCache, hidden: bool = False,
                last_only: bool = False):
        if start != cache.length:
            raise ValueError(f"forward at {start} but the cache holds {cache.length} tokens")
        cache.tokens.extend(int(t) for t in tokens)
        rows = range(start, cache.length)
        if last_only:
            rows = rows[-1:]
        logits = torch.stack([self.next_logits(cache.tokens[: i + 1]) for i in rows])
        if hidden:
            return logits, torch.zeros(len(rows), self.config.hidden_size)
        return logits

    def law(self, prompt: list[int], n: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
        """The exact probability of every n-token continuation of `prompt` under plain sampling with `params`."""
        return exact_law(self.next_logits, prompt, n, params)


def exact_law(next_logits, prompt: list[int], n: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """The exact probability of every n-token continuation of `prompt` under plain sampling with `params`,
    given `next_logits(context)`: one call per prefix, so only for small supports (top-k)."""
    law = {(): 1.0}
    for _ in range(n):
        grown = {}
        for seq, mass in law.items():
            p = warp(next_logits(list(prompt) + list(seq)), params).double()
            for t in torch.nonzero(p > 0).flatten().tolist():
                grown[seq + (t,)] = mass * float(p[t])
        law = grown
    return law


def model_next_logits(model, context: list[int]) -> torch.Tensor:
    """A real model's next-token logits after `context`, from a fresh cache (no runner involved)."""
    cache = model.new_cache(len(context) + 1)
    tokens = torch.tensor(context, device=getattr(model, "device", torch.device("cpu")))
    return model.forward(tokens, 0, cache, last_only=True)[-1].float().cpu()
