"""The `mtp` drafter: multi-token-prediction (NextN) heads in llama.cpp's layout, run beside the target.

Where the head comes from, first found wins: `--draft-model` (a sidecar GGUF holding only the MTP blocks,
named as in the target), the target's own file (`{arch}.nextn_predict_layers` > 0), or the sidecar that
`outrider distill` wrote into the cache for this target (`mtp_sidecar_path`).

One MTP block k (`blk.{n_trunk + k}`) is a decoder block of the trunk's own kind plus the nextn tensors;
the row at position p takes the token x_p and the target's final-normed hidden state h_{p-1}:

    x = eh_proj([rms(E[x_p], enorm), rms(h_{p-1}, hnorm)]);  x = block(x, p);  h' = rms(x, shared_head_norm)
    logits = shared_head_head(h')   (fallbacks: output_norm, the target's output head, token_embd)

h' is fed back as the next row's hidden (post-norm chaining, as qwen35/deepseek2). The target hidden comes
through `observe`; the block's KV cache is filled for every certain row (catch-up, done at the start of
the next `propose`, in the same forward that computes the first draft) and cut back after each round to the
rows made from the target's hidden states. One head is reused with positions incrementing; several heads are
chained DeepSeek-style, draft i from head min(i, n_heads - 1) fed the hidden of draft i - 1.

The heads' weights are the drafter's, shared by every sequence; a sequence's `MTPState` holds what is its own:
the target hidden rows observed so far and one KV cache per head. Those buffers span the context, so `end`
hands them to a small free list that the next `begin` takes from.

Outrider's own extension: `blk.{b}.nextn.draft_vocab` (I32, [V_draft]) maps the rows of a reduced
`shared_head_head` to target ids (FR-Spec), so a 262k-token vocabulary costs the head only V_draft rows;
tokens outside it get draft probability 0, which the acceptors handle losslessly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from outrider.catalog import outrider_home, resolve_model
from outrider.errors import ConfigError
from outrider.hookspecs import hookimpl
from outrider.io.gguf import GGUFFile
from outrider.models.layers import PREFILL_CHUNK, trunk_layers
from outrider.plugins.drafters.mtp.head import MTPHead
from outrider.plugins.drafters.mtp.learn import HeadLearner, LearnSettings
from outrider.spec.drafter import (
    NEEDS_MTP_HEAD,
    NEEDS_TARGET_HIDDEN,
    Draft,
    DraftControls,
    DrafterBase,
    DraftKind,
    DraftState,
    DraftStepClock,
    Target,
)
from outrider.spec.sampling import SamplingParams

MTP_KIND = DraftKind("mtp", 0.6)


@dataclass
class MTPState(DraftState):
    observed: int = 0  # target hidden rows held for positions [0, observed)
    hidden: torch.Tensor | None = None  # [max_len, H]; only rows [0, observed) are ever read
    caches: list = field(default_factory=list)  # one KV cache per head, its rows this sequence's


def mtp_sidecar_path(target_path: str | Path) -> Path:
    """Where `outrider distill` writes, and the drafter looks for, the trained head of the target file."""
    return outrider_home() / "mtp" / (Path(target_path).stem + ".mtp.gguf")


def head_count(g: GGUFFile) -> int:
    return int(g.arch_key("nextn_predict_layers", 0) or 0)


def find_head_file(target: Target, model: str) -> GGUFFile:
    if model:
        g = GGUFFile(resolve_model(model))
    elif head_count(target.gguf):
        return target.gguf
    else:
        path = mtp_sidecar_path(target.gguf.path)
        if not path.is_file():
            raise ConfigError(f"{target.gguf.path.name} has no MTP (nextn) blocks and no trained head is cached at "
                              f"{path}; train one with `outrider distill {target.gguf.path}` or pass "
                              "--draft-model SIDECAR.gguf")
        g = GGUFFile(path)
    if g.architecture != target.gguf.architecture or not head_count(g):
        raise ConfigError(f"{g.path} is not an MTP head for a {target.gguf.architecture} target (architecture "
                          f"'{g.architecture}', nextn_predict_layers {head_count(g)}); pass a sidecar written "
                          "for this model (`outrider distill`)")
    for key in ("embedding_length", "attention.head_count", "attention.head_count_kv"):
        if g.arch_key(key) != target.gguf.arch_key(key):
            raise ConfigError(f"{g.path}: {key} is {g.arch_key(key)}, the target's {target.gguf.arch_key(key)}; "
                              "the sidecar was written for another model: run `outrider distill` for this one")
    return g


class MTPDrafter(DrafterBase):
    needs = frozenset({NEEDS_TARGET_HIDDEN, NEEDS_MTP_HEAD})
    gives_draft_probs = True  # at temperature > 0 with sample = true: drafts are sampled from q
    State = MTPState
    # buffers of ended sequences kept for the next `begin`: enough for a server's slots to reuse theirs, few
    # enough that what an idle drafter holds stays small
    FREE_BUFFERS = 4

    def __init__(self, model: str = "", sample: bool = True, context: int = 4096, learn: bool = False,
                 learn_share: float | None = None, learn_rows: int = 128, learn_refresh: int = 4,
                 learn_lr: float = 1e-4, learn_anchor: float = LearnSettings.anchor):
        self.model_name, self.sample, self.context = model, sample, context
        self.gives_draft_probs = sample
        self.learn = LearnSettings(learn_share, learn_rows, lr=learn_lr, refresh=learn_refresh,
                                   anchor=learn_anchor) if learn else None
        share_ok = learn_share is None or 0 <= learn_share <= 1
        if learn and not (share_ok and learn_rows >= 2 and learn_refresh >= 1 and learn_lr > 0
                          and 0 <= learn_anchor <= 1):
            raise ConfigError("drafter.learn needs 0 <= learn_share <= 1, learn_rows >= 2, learn_refresh >= 1, "
                              "learn_lr > 0 and 0 <= learn_anchor <= 1")

    def setup(self, target: Target) -> None:
        super().setup(target)
        if not callable(getattr(target.model, "block", None)):  # an MTP block is a decoder block of the trunk's kind
            raise ConfigError(f"drafter 'mtp' runs nextn blocks of llama and gemma3 targets; a "
                              f"{target.gguf.architecture} target has none: for Gemma 4 use --drafter "
                              "gemma-assistant with its assistant file")
        g = find_head_file(target, self.model_name)
        self.max_len = min(self.context, target.model.config.context_length)
        first = trunk_layers(g)
        self.heads = [MTPHead(g, first + k, target, self.max_len) for k in range(head_count(g))]
        self.learner = None
        if self.learn is not None:
            if g is target.gguf or len(self.heads) != 1:
                raise ConfigError("drafter.learn trains a head `outrider distill` wrote (one block, in a sidecar); "
                                  f"{g.path.name} is not one: drop -o drafter.learn")
            self.learner = HeadLearner(target.model, target.gguf, g, self.learn)
        self.vocab = target.model.config.vocab_size
        self.device = target.model.device
        self.step_clock = DraftStepClock()
        self._free: list[tuple[torch.Tensor, list]] = []  # (hidden, caches) of ended sequences
        self._learning: MTPState | None = None  # the sequence in-generation learning follows
        self._last_finished: MTPState | None = None  # the rows `idle` learns from

    def _buffers(self) -> tuple[torch.Tensor, list]:
        if self._free:
            hidden, caches = self._free.pop()
            for cache in caches:
                cache.truncate(0)
            return hidden, caches
        config = self.target.model.config
        hidden = torch.empty(self.max_len, config.hidden_size, dtype=self.target.model.dtype, device=self.device)
        return hidden, [head.new_cache() for head in self.heads]

    def _release(self, state: MTPState) -> None:
        if state.hidden is not None and len(self._free) < self.FREE_BUFFERS:
            self._free.append((state.hidden, state.caches))
        state.hidden, state.caches, state.observed = None, [], 0  # a late call on it fails, not another's rows

    def begin(self, prompt: list[int], params: SamplingParams, controls: DraftControls) -> MTPState:
        state = super().begin(prompt, params, controls)
        state.hidden, state.caches = self._buffers()
        if self.learner is not None:
            # Learning in a generation follows one sequence, the latest begun: the learner keeps one request's
            # window and time share. Learning while several run at once is not wanted (a server learns only
            # when no slot runs, in `idle`); the others still draft, with whichever head is current.
            self._learning = state
            self.learner.begin()
        return state

    def end(self, state: MTPState) -> None:
        if state is self._learning:
            self._learning = None
        if self.learner is None:
            self._release(state)
            return
        # kept for `idle` until another sequence ends: its rows are what the host's idle time learns from
        previous, self._last_finished = self._last_finished, state
        if previous is not None and previous is not state:
            self._release(previous)

    def observe(self, state: MTPState, hidden: torch.Tensor, start: int, cache) -> None:
        if start > state.observed:  # rows before these were never shown: keep only the contiguous ones
            return
        end = min(start + hidden.shape[0], self.max_len)
        state.hidden[start:end] = hidden[: end - start]
        state.observed = end

    def rollback(self, state: MTPState, length: int) -> None:
        state.observed = min(state.observed, length)
        if self.learner is not None and state is self._learning:
            self.learner.rollback(length)
        for cache in state.caches:
            cache.truncate(min(cache.length, length))

    def _ready(self, state: MTPState, tokens: list[int]) -> bool:
        # every row before the last token's has its target hidden state: the last token is the draft's seed
        return 0 < len(tokens) < self.max_len and state.observed >= len(tokens) - 1

    def draft_kind(self, state: MTPState, tokens: list[int]) -> DraftKind | None:
        return MTP_KIND if self._ready(state, tokens) else None

    def _rows(self, state: MTPState, cache, tokens: list[int], end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, target hidden h_{p-1}) of the catch-up rows p = cache.length .. end-1."""
        start = cache.length
        ids = torch.tensor(tokens[start:end], device=self.device)
        h = state.hidden[max(start - 1, 0):end - 1]
        if start == 0:  # position 0 has no row before it: a zero hidden (what distill trains with too)
            h = torch.cat([torch.zeros_like(state.hidden[:1]), h])
        return ids, h

    def _catch_up(self, state: MTPState, head: MTPHead, cache, tokens: list[int], end: int
                  ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Fill `head`'s `cache` with the target-made rows up to position end-1; the last row's logits and
        post-norm hidden [1, H], and the seconds of the last forward that count as a draft step (it made the
        logits a draft starts from; the rest of it, and every forward before it, kept up with the target)."""
        assert cache.length < end, "propose cuts the head's cache below t0's row: the last forward remakes it"
        while cache.length < end:
            stop = min(end, cache.length + PREFILL_CHUNK)
            ids, h = self._rows(state, cache, tokens, stop)
            t = time.perf_counter()
            logits, hidden = head.forward(ids, h, cache.length, cache)
            took = time.perf_counter() - t
            step_s = took - self.step_clock.charge(took, len(ids))
        return logits, hidden[-1:], step_s

    def propose(self, state: MTPState, tokens: list[int], k: int) -> Draft:
        k = min(k, self.max_len - len(tokens))
        if k <= 0 or not self._ready(state, tokens):
            return Draft()
        n = len(tokens) - 1  # t0's position: its row (t0, h_{n-1}) is made from the target and seeds the draft
        start = time.perf_counter()
        if self.learner is not None and state is self._learning and self.learner.due(state.observed):
            rebuilt = self.learner.step(tokens, state.hidden, state.observed)
            if rebuilt is not None:  # drafts from here on come from the trained head
                swapped_at = time.perf_counter()
                self._swap(rebuilt)
                self.learner.clock.charge(time.perf_counter() - swapped_at)
        caches = state.caches
        for cache in caches:
            cache.truncate(min(cache.length, n))
        seeds = [self._catch_up(state, head, cache, tokens, n + 1) for head, cache in zip(self.heads, caches)]
        # all but head 0's draft step is upkeep, not billed per drafted token: learning, the catch-up of rows accepted
        # since the last MTP round (in a chain, lookup's too) beyond that step, and the other heads' catch-up
        logits, hidden, first_step_s = seeds[0]
        upkeep_s = time.perf_counter() - start - first_step_s
        chain = [hidden]  # chain[m]: the hidden that made draft m + 1

        def next_logits(drafted: list[int]) -> torch.Tensor:
            nonlocal logits
            i = len(drafted)
            depth = min(i, len(self.heads) - 1)
            head, cache = self.heads[depth], caches[depth]
            if i > 0:  # rows n+1..n+i of this head: draft m at n+m with chain[m-1], those it lacks
                first = cache.length
                ids = torch.tensor(drafted[first - n - 1:i], device=self.device)
                t = time.perf_counter()
                logits, h = head.forward(ids, torch.cat(chain[first - n - 1:i]), first, cache)
                if len(ids) == 1:
                    self.step_clock.teach(time.perf_counter() - t)
                chain.append(h[-1:])
            return head.full_logits(logits, self.vocab).float().cpu()

        draft = self.draft_from_logits(state, k, next_logits, tokens, self.sample)
        draft.upkeep_s = upkeep_s
        for cache in caches:  # drafted rows are not the target's: only rows up to t0's stay
            cache.truncate(n + 1)
        return draft

    def _swap(self, rebuilt) -> None:
        """Draft with the rebuilt head from here on. Every sequence keeps its KV cache: those rows were made by
        the weights of a few steps before, which changes only how well the head drafts, never the output (the
        acceptor reads q as the drafting head gave it); refilling the cache would cost a forward of every row."""
        self.heads = [MTPHead(rebuilt, trunk_layers(rebuilt), self.target, self.max_len)]

    def idle(self, tokens: list[int]) -> bool:
        """One unit of learning on the last finished request's rows (`tokens`, and the target's hidden states this
        drafter observed, whether or not it drafted: a chain's other member may have drafted every round), while
        the host has nothing else to do (the server's worker, between requests); whether there is more."""
        if self.learner is None:
            return False
        last = self._last_finished
        if last is None:  # asked before any request ended: no rows, but the learner learns the host has idle time
            hidden, observed = torch.empty(0, self.target.model.config.hidden_size), 0
        else:
            hidden, observed = last.hidden, last.observed
        more, rebuilt = self.learner.idle(tokens, hidden, observed)
        if rebuilt is not None:
            self._swap(rebuilt)
        return more


@hookimpl
def register_drafters(register):
    register("mtp", MTPDrafter, aliases=("nextn",), options={
        "model": (str, "an MTP sidecar GGUF (also --draft-model); default: the target's own nextn blocks, "
                           "else the head `outrider distill` cached for it"),
        "sample": (bool, "at temperature > 0, sample drafts from the head's q (the acceptor uses the full-q "
                               "rule); false: argmax drafts"),
        "context": (int, "the MTP blocks' KV cache length"),
        "learn": (bool, "keep training a distilled head on the rows the target verifies (saved over its sidecar "
                        "on exit); the output law is unchanged"),
        "learn_share": (float, "with learn: at most this share of the time spent in requests goes to training "
                               "(default: 0.2 until the server first has idle time to train in, then 0 while "
                               "that time keeps up, 0.2 again when it does not)"),
        "learn_rows": (int, "with learn: the newest verified rows one training step reads"),
        "learn_refresh": (int, "with learn: training steps between rebuilding the drafting head"),
        "learn_lr": (float, "with learn: AdamW's learning rate"),
        "learn_anchor": (float, "with learn: after each step the weights move this share of the way back to the "
                                "distilled head's, so it keeps what it knew of code in general (0: no pull)"),
    })
