"""`-o drafter.learn true`: the mtp drafter keeps training a distilled head on the text it drafts for.

Every row the target verified is a training example distill would have made, at no extra target forward: the token
x_p, the target's hidden h_{p-1} (the head's inputs) and the target's hidden h_p, from which the target's output
rows over the draft vocabulary give the target's logits of x_{p+1}. So the learner needs nothing but the rows the
drafter already observes. A step trains on the `rows` certain rows that end where a quarter of them are new since
the last step (bounded memory: the head's parameters, AdamW's two moments, the anchor's copy of the distilled
weights and one window of the request's rows).

When it trains: in the host's idle time (`idle`: the server's worker calls it while no request waits), over the
last request's newest rows that no step has reached (whichever member of a chain drafted them); and during
requests with at most `share` of the time spent in them (bounded time a round). The default share is 0.2 until
the host first offers idle time, then 0 while the idle work keeps up (0.2 again for a request that began before the
idle work on the last one was done): a server learns between requests and drafts at the frozen head's speed, a
one-shot generation learns as it goes.

Every `refresh` steps in a request, and when the idle work is done, the drafting head is rebuilt in memory from
the trained parameters (the tensors the sidecar would hold); a draft is always made, and its q reported, by one
fixed head, so the acceptors' law is untouched: what changes between rounds is only which proposal distribution a
round uses.

What the head learns stays near what distill taught it: after every step the weights move `anchor` of the way
back to the distilled head's (L2-SP's pull toward the starting weights, applied as a decay), so the latest requests
do not wear away what it knew of code in general.

The learned head replaces the sidecar it came from when the process exits (the distilled one is kept once,
beside it, as `*.distilled.gguf`), so the next run starts where this one stopped. It is held and saved in Q8_0 (F16
where it came in F16): a learned change is finer than distill's Q4_0 steps, so a Q4_0 head's file about doubles.
"""

from __future__ import annotations

import atexit
import shutil
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from outrider.io.gguf import GGUFFile, TensorsInMemory
from outrider.plugins.drafters.mtp.head import TrainableHead, target_logits
from outrider.plugins.drafters.mtp.sidecar import head_in_memory, matrices_of, write_sidecar


@dataclass(frozen=True)
class LearnSettings:
    # at most this share of the time spent in requests goes to training (1: no limit; 0: idle time only);
    # None: 0.2 until the host offers idle time, then 0
    share: float | None = None
    rows: int = 128  # a step trains on the newest certain rows, this many, when a quarter of them are new
    lr: float = 1e-4
    refresh: int = 4  # steps between rebuilding the drafting head
    feature_weight: float = 0.1
    # after each step the trained weights move this share of the way back to the distilled head's: what the
    # head knew of code in general is not traded away for the latest requests (0: no pull)
    anchor: float = 0.03


class TimeShare:
    """Side work (training) kept to `share` of the seconds spent in requests, each from its `begin` to its
    latest round: time between requests banks nothing. A share of 1 or more sets no limit, 0 allows none. What
    is banked is each request's allowance at the share it ran under, so a share raised again (a busy server)
    does not lend itself the requests that ran at 0."""

    def __init__(self, share: float):
        self.share, self.spent, self.allowed = share, 0.0, 0.0
        self.request_start: float | None = None
        self.last_round = 0.0

    def begin(self, share: float | None = None) -> None:
        """A request begins, under `share` from now on (None: the share as it stands)."""
        if self.request_start is not None:  # the last request, from its begin to its last round, at its share
            self.allowed += min(self.share, 1.0) * (self.last_round - self.request_start)
        if share is not None:
            self.share = share
        self.request_start = self.last_round = time.perf_counter()

    def allows(self) -> bool:
        """Whether the side work may run now (this call marks the latest round)."""
        self.last_round = time.perf_counter()
        now = self.last_round - self.request_start if self.request_start is not None else 0.0
        return self.share >= 1 or (self.share > 0 and self.spent <= self.allowed + self.share * now)

    def charge(self, seconds: float) -> None:
        self.spent += seconds


class HeadLearner:
    DEFAULT_SHARE = 0.2  # of the time in requests, until the host offers idle time
    IDLE_WINDOWS = 4  # idle time trains on at most this many windows' worth of a request's newest rows

    def __init__(self, model, g, sidecar: GGUFFile, settings: LearnSettings):
        self.model, self.g, self.settings, self.source = model, g, settings, Path(sidecar.path)
        self.head = TrainableHead.from_sidecar(model, g, sidecar)
        # what a request teaches moves a weight far less than a Q4_0 step (its block's largest weight / 8): rounded
        # to Q4_0, the learned head drafted as the distilled one did (docs/bench/mtp.md). So a head learns, drafts
        # and is saved in Q8_0 whatever form it came in, but for an F16 one, which stays F16.
        self.matrices = "F16" if matrices_of(sidecar, self.head.cfg.n_layers) == "F16" else "Q8_0"
        # the target's output rows over the draft vocabulary (a distilled head's own rows are these; another's
        # need not be): they turn a verified hidden state into the target's logits there
        self.target_rows = model.output.rows(self.head.vocab_ids).float()
        self.optimizer = self.head.optimizer(settings.lr)
        self.trained = self.head.trained_parameters()
        self.anchor = self._anchor_weights() if settings.anchor > 0 else None
        self.clock = TimeShare(self.DEFAULT_SHARE if settings.share is None else settings.share)
        self.steps, self.built_at, self.trained_to, self.refreshes, self.unsaved = 0, 0, 0, 0, False
        self.idle_offered = False  # the host has called `idle` (a server, between requests)
        self.caught_up = True  # the idle work on the last request's rows was done before the next began
        self.staged = self.source.with_suffix(".learning.gguf")
        atexit.register(_save_at_exit, weakref.ref(self))  # a learner dropped before exit is not kept alive

    @property
    def stride(self) -> int:
        return max(1, self.settings.rows // 4)

    def begin(self) -> None:
        share = None
        if self.settings.share is None and self.idle_offered:
            # the rows of a request learn in the idle time after it; where that time was cut short (a busy
            # server), requests train themselves at the default share until the idle work keeps up again
            share = 0.0 if self.caught_up else self.DEFAULT_SHARE
        self.trained_to, self.caught_up = 0, False
        self.clock.begin(share)

    def rollback(self, length: int) -> None:
        self.trained_to = min(self.trained_to, length)

    def due(self, certain: int) -> bool:
        """Whether to train this round: the clock allows it and a quarter of the window is new."""
        return self.clock.allows() and certain - self.trained_to >= self.stride  # allows() marks the round

    def step(self, tokens: list[int], hidden: torch.Tensor, certain: int) -> TensorsInMemory | None:
        """One training step in a request, on the rows up to `certain`; the rebuilt head when a refresh is due."""
        t0 = time.perf_counter()
        self._train(tokens, hidden, certain)
        rebuilt = self._rebuild() if self.steps - self.built_at >= self.settings.refresh else None
        self.clock.charge(time.perf_counter() - t0)
        return rebuilt

    def idle(self, tokens: list[int], hidden: torch.Tensor, certain: int) -> tuple[bool, TensorsInMemory | None]:
        """One unit of idle work on the last request's newest rows (at most IDLE_WINDOWS x `rows` of [0, certain)):
        a step on rows no step has reached (windows ending a quarter of `rows` apart, as a request's steps do),
        then, as the last unit, the rebuild of the drafting head (nothing drafts in between); (whether work is
        left, the rebuilt head or None)."""
        self.idle_offered = True
        certain = min(certain, len(tokens))
        rebuilt, more = None, True
        # a long prompt's rows beyond the newest IDLE_WINDOWS windows wait for no one: the idle time a request
        # asks stays bounded, and a system prompt that every request repeats is not trained on each time
        self.trained_to = max(self.trained_to, certain - self.IDLE_WINDOWS * self.settings.rows)
        if certain > self.trained_to and certain >= 2:
            self._train(tokens, hidden, min(self.trained_to + self.stride, certain))
        else:
            rebuilt = self._rebuild() if self.steps > self.built_at else None
            more, self.caught_up = False, True
        return more, rebuilt

    def _anchor_weights(self) -> list[torch.Tensor]:
        """What the anchor pulls toward: the trained parameters of the head distill wrote (kept beside the sidecar
        once a learned head replaced it), else of the head this run starts from."""
        distilled = self.source.with_suffix(".distilled.gguf")
        origin = self.head
        if distilled.is_file():
            origin = TrainableHead.from_sidecar(self.model, self.g, GGUFFile(distilled))
            if not torch.equal(origin.vocab_ids, self.head.vocab_ids):
                origin = self.head  # not this head's origin (a head distilled again since)
        return [p.detach().clone() for p in origin.trained_parameters()]

    def _train(self, tokens: list[int], hidden: torch.Tensor, certain: int) -> None:
        """One step on rows [certain - rows, certain) (tokens[p], hidden[p - 1] -> the target's distribution from
        hidden[p], and hidden[p])."""
        start = max(certain - self.settings.rows, 0)
        h = hidden[start:certain].float()
        h_prev = torch.cat([hidden[start - 1:start].float() if start else torch.zeros_like(h[:1]), h[:-1]])
        want = torch.softmax(target_logits(h, self.target_rows, self.model.logit_softcap), -1)
        self.head.train_step(self.optimizer, lambda: self.head.loss(torch.tensor(tokens[start:certain]), h_prev, h,
                                                                    want, feature_weight=self.settings.feature_weight))
        if self.anchor is not None:
            with torch.no_grad():
                for weight, origin in zip(self.trained, self.anchor):
                    weight.lerp_(origin, self.settings.anchor)
        self.steps, self.trained_to, self.unsaved = self.steps + 1, certain, True

    def _rebuild(self) -> TensorsInMemory:
        """The drafting head, rebuilt from the trained parameters (counted)."""
        self.built_at, self.refreshes = self.steps, self.refreshes + 1
        return self.drafting_tensors()

    def drafting_tensors(self) -> TensorsInMemory:
        """The trained parameters as `save` would write them (in `matrices`), held in memory."""
        return head_in_memory(self.head, self.g, self.head.vocab_ids, f"{self.source.name} (learning, in memory)",
                              self.matrices)

    def save(self) -> None:
        """The learned head over the sidecar it came from (the distilled one kept once beside it)."""
        if not self.unsaved or not self.source.parent.is_dir():  # nothing new, or its folder is gone
            return
        write_sidecar(self.staged, self.head, self.g, self.head.vocab_ids, self.matrices)
        keep = self.source.with_suffix(".distilled.gguf")
        if not keep.exists():
            shutil.copy2(self.source, keep)
        self.staged.replace(self.source)
        self.unsaved = False


def _save_at_exit(learner: weakref.ref) -> None:
    if (alive := learner()) is not None:
        alive.save()
