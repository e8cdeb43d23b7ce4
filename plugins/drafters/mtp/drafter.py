"""The `mtp` drafter: multi-token-prediction (NextN) heads in llama.cpp's layout, run beside the target.

Where the head comes from, first found wins: `--draft-model` (a sidecar GGUF holding only the MTP blocks,
named as in the target), the target's own file (`{arch}.nextn_predict_layers` > 0), or the sidecar that
`outrider distill` wrote into the cache for this target (`mtp_sidecar_path`).

One MTP block k (`blk.{n_trunk + k}`) is a decoder block of the trunk's own kind plus the nextn tensors;
the row at position p takes the token x_p and the target's final-normed hidden state h_{p-1}:

    x = eh_proj([rms(E[x_p], enorm), rms(h_{p-1}, hnorm)]);  x = block(x, p);  h' = rms(x, shared_head_norm)
    logits = shared_head_head(h')   (fallbacks: output_norm, the target's output head, token_embd)

h' is fed back as the next row's hidden (post-norm chaining, as qwen35/deepseek2). The target hidden comes
through `observe`; the block's own KV cache is filled for every certain row (catch-up, done at the start of
the next `propose`, in the same forward that computes the first draft) and cut back after each round to the
rows made from the target's hidden states. One head is reused with positions incrementing; several heads are
chained DeepSeek-style, draft i from head min(i, n_heads - 1) fed the hidden of draft i - 1.

Outrider's own extension: `blk.{b}.nextn.draft_vocab` (I32, [V_draft]) maps the rows of a reduced
`shared_head_head` to target ids (FR-Spec), so a 262k-token vocabulary costs the head only V_draft rows;
tokens outside it get draft probability 0, which the acceptors handle losslessly.
"""

from __future__ import annotations

import time
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
    DraftStepClock,
    Target,
)
from outrider.spec.sampling import SamplingParams

MTP_KIND = DraftKind("mtp", 0.6)


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
        self.observed = 0  # as `begin` sets it: a host may ask for idle work before any request
        self.hidden = torch.zeros(self.max_len, target.model.config.hidden_size, dtype=target.model.dtype,
                                  device=target.model.device)
        self.device = target.model.device
        self.step_clock = DraftStepClock()

    def begin(self, prompt: list[int], params: SamplingParams, controls: DraftControls) -> None:
        super().begin(prompt, params, controls)
        self.observed = 0  # target hidden rows held for positions [0, observed)
        for head in self.heads:
            head.cache.truncate(0)
        if self.learner is not None:
            self.learner.begin()

    def observe(self, hidden: torch.Tensor, start: int, cache) -> None:
        if start > self.observed:  # rows before these were never shown: keep only the contiguous ones
            return
        end = min(start + hidden.shape[0], self.max_len)
        self.hidden[start:end] = hidden[: end - start]
        self.observed = end

    def rollback(self, length: int) -> None:
        self.observed = min(self.observed, length)
        if self.learner is not None:
            self.learner.rollback(length)
        for head in self.heads:
            head.cache.truncate(min(head.cache.length, length))

    def _ready(self, tokens: list[int]) -> bool:
        # every row before the last token's has its target hidden state: the last token is the draft's seed
        return 0 < len(tokens) < self.max_len and self.observed >= len(tokens) - 1

    def draft_kind(self, tokens: list[int]) -> DraftKind | None:
        return MTP_KIND if self._ready(tokens) else None

    def _rows(self, head: MTPHead, tokens: list[int], end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, target hidden h_{p-1}) of the catch-up rows p = head.cache.length .. end-1."""
        start = head.cache.length
        ids = torch.tensor(tokens[start:end], device=self.device)
        h = self.hidden[max(start - 1, 0):end - 1]
        if start == 0:  # position 0 has no row before it: a zero hidden (what distill trains with too)
            h = torch.cat([torch.zeros_like(self.hidden[:1]), h])
        return ids, h

    def _catch_up(self, head: MTPHead, tokens: list[int], end: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Fill `head`'s cache with the target-made rows up to position end-1; the last row's logits and
        post-norm hidden [1, H], and the seconds of the last forward that count as a draft step (it made the
        logits a draft starts from; the rest of it, and every forward before it, kept up with the target)."""
        assert head.cache.length < end, "propose cuts the head's cache below t0's row: the last forward remakes it"
        while head.cache.length < end:
            stop = min(end, head.cache.length + PREFILL_CHUNK)
            ids, h = self._rows(head, tokens, stop)
            t = time.perf_counter()
            logits, hidden = head.forward(ids, h, head.cache.length)
            took = time.perf_counter() - t
            step_s = took - self.step_clock.charge(took, len(ids))
        return logits, hidden[-1:], step_s

    def propose(self, tokens: list[int], k: int) -> Draft:
        k = min(k, self.max_len - len(tokens))
        if k <= 0 or not self._ready(tokens):
            return Draft()
        n = len(tokens) - 1  # t0's position: its row (t0, h_{n-1}) is made from the target and seeds the draft
        start = time.perf_counter()
        if self.learner is not None and self.learner.due(self.observed):
            rebuilt = self.learner.step(tokens, self.hidden, self.observed)
            if rebuilt is not None:  # drafts from here on come from the trained head
                swapped_at = time.perf_counter()
                self._swap(rebuilt)
                self.learner.clock.charge(time.perf_counter() - swapped_at)
        for head in self.heads:
            head.cache.truncate(min(head.cache.length, n))
        seeds = [self._catch_up(head, tokens, n + 1) for head in self.heads]
        # all but head 0's draft step is upkeep, not billed per drafted token: learning, the catch-up of rows accepted
        # since the last MTP round (in a chain, lookup's too) beyond that step, and the other heads' catch-up
        logits, hidden, first_step_s = seeds[0]
        upkeep_s = time.perf_counter() - start - first_step_s
        chain = [hidden]  # chain[m]: the hidden that made draft m + 1

        def next_logits(drafted: list[int]) -> torch.Tensor:
            nonlocal logits
            i = len(drafted)
            head = self.heads[min(i, len(self.heads) - 1)]
            if i > 0:  # rows n+1..n+i of this head: draft m at n+m with chain[m-1], those it lacks
                first = head.cache.length
                ids = torch.tensor(drafted[first - n - 1:i], device=self.device)
                t = time.perf_counter()
                logits, h = head.forward(ids, torch.cat(chain[first - n - 1:i]), first)
                if len(ids) == 1:
                    self.step_clock.teach(time.perf_counter() - t)
                chain.append(h[-1:])
            return head.full_logits(logits, self.vocab).float().cpu()

        draft = self.draft_from_logits(k, next_logits, tokens, self.sample)
        draft.upkeep_s = upkeep_s
        for head in self.heads:  # drafted rows are not the target's: only rows up to t0's stay
            head.cache.truncate(n + 1)
        return draft

    def _swap(self, rebuilt) -> None:
        """Draft with the rebuilt head from here on. It takes over the old head's KV cache: those rows were made
        by the weights of a few steps before, which changes only how well the head drafts, never the output (the
        acceptor reads q as the drafting head gave it); refilling the cache would cost a forward of every row."""
        old = self.heads[0]
        self.heads = [MTPHead(rebuilt, trunk_layers(rebuilt), self.target, self.max_len, cache=old.cache)]

    def idle(self, tokens: list[int]) -> bool:
        """One unit of learning on the last request's rows (`tokens`, and the target's hidden states this drafter
        observed, whether or not it drafted: a chain's other member may have drafted every round), while the host
        has nothing else to do (the server's worker, between requests); whether there is more."""
        if self.learner is None:
            return False
        more, rebuilt = self.learner.idle(tokens, self.hidden, self.observed)
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
