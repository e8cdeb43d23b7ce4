"""One generation at a time against the assembled runner, in a worker thread; a bounded queue in front.

Requests come from the event loop as `Job`s; the worker runs them in arrival order and sends each one's
text back, one event per verify round (the tokens a round emits become certain together), then a `done`
event with the stats. A job whose client has gone is skipped if it is still waiting, and stopped after
the round in progress if it is running. Per-request sampling settings go straight to `Runner.rounds`;
with `--acceptor auto` the acceptor (greedy at temperature 0, sampled above) is chosen per request from
two built at start-up, so nothing is re-assembled.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from outrider.assembly import Assembly, check_pair
from outrider.errors import OutriderError
from outrider.registry import Registry, default_registry
from outrider.serve.metrics import ServerMetrics
from outrider.serve.requests import GenerationRequest
from outrider.serve.stop_text import StopText
from outrider.spec import runner
from outrider.spec.runner import GenerationStats
from outrider.spec.sampling import SamplingParams

log = logging.getLogger("outrider.serve")


class QueueFull(Exception):
    """Every place in the queue is taken."""


class ShuttingDown(Exception):
    """The server stopped taking work while this request waited."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down; retry on another server")


class Stalled(Exception):
    """The worker is held by a generation that makes no progress; `reason` says where."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def holder(thread_id: int | None) -> str:
    """What the worker thread is in: the function the runner called last (a plugin's `propose`, `accept`,
    the backend's `forward`), as module:qualname, or the innermost frame when the runner is not on the stack."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    innermost, inner = frame, None
    while frame is not None and frame.f_globals.get("__name__") != runner.__name__:  # innermost out
        inner, frame = frame, frame.f_back
    # what the first runner frame called (itself, when it is innermost); without one, the innermost frame
    callee = (inner or frame) if frame is not None else innermost
    if callee is None:
        return "unknown"
    return f"{callee.f_globals.get('__name__', '?')}:{getattr(callee.f_code, 'co_qualname', callee.f_code.co_name)}"


@dataclass
class Outcome:
    finish_reason: str  # OpenAI's: stop (end of generation or a stop string), length; abort (the client went away)
    stats: GenerationStats
    completion_tokens: int  # through the token that completed a stop string (vLLM's count), not past it
    stop_reason: str | None = None  # what ended it beyond finish_reason: "timeout" (--request-timeout)


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def send(self, kind: str, value: Any) -> None:
        """From the worker thread: ("text", str), ("done", Outcome) or ("error", Exception)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop has closed (shutdown): nobody is listening any more
            pass


def acceptors_by_greediness(assembly: Assembly, acceptor_setting: str,
                            registry: Registry | None = None) -> dict[bool, Any]:
    """{temperature is 0: acceptor}. A named acceptor serves every request; `auto` gets greedy and sampled."""
    chosen = assembly.runner.acceptor
    if acceptor_setting != "auto":
        return {True: chosen, False: chosen}
    chosen_name = assembly.plugins["acceptor"].name
    other_name = "sampled" if chosen_name == "greedy" else "greedy"
    spec = (registry or default_registry()).get("acceptor", other_name)
    other = spec.factory(**spec.resolve_options({}))
    check_pair(assembly.plugins["drafter"], spec, assembly.runner.traits,
               SamplingParams(temperature=0.0 if other_name == "greedy" else 1.0))
    return {chosen_name == "greedy": chosen, other_name == "greedy": other}


class GenerationEngine:
    def __init__(self, assembly: Assembly, acceptors: dict[bool, Any], metrics: ServerMetrics, queue_size: int,
                 stall_timeout: float | None = None, request_timeout: float | None = None):
        self.runner, self.tokenizer = assembly.runner, assembly.tokenizer
        self.acceptors, self.metrics, self.queue_size = acceptors, metrics, queue_size
        self.stall_timeout, self.request_timeout = stall_timeout, request_timeout
        self.stalled: str | None = None  # why the worker is held, while it is
        self._progress_at = time.monotonic()  # the last time the generation in progress moved on
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0  # submitted, not yet taken by the worker
        self.busy = 0  # 1 while the worker holds a job; counted with `waiting` under the lock, so no gap
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._current: Job | None = None
        self._mean_service_s = 1.0  # a generation's time, averaged; for Retry-After
        # asked for between requests (a learning drafter trains then); False after a unit fails, so a broken
        # learner costs one logged error, not one per request
        self._idle_work = callable(getattr(self.runner, "idle", None))
        labels = metrics.model_name
        metrics.waiting.labels(labels).set_function(lambda: self.waiting)
        self._running = metrics.running.labels(labels)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="outrider-generation", daemon=True)
        self._thread.start()
        # at exit, even one that skips the server's shutdown (a second Ctrl-C): the worker's unit ends before the
        # drafter's own exit handlers (a learner's save, registered earlier, runs later) read what it trains
        atexit.register(_stop_at_exit, weakref.ref(self))
        if self.stall_timeout:
            threading.Thread(target=self._watch, name="outrider-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """Every so often: a generation with no progress for stall_timeout seconds is failed for its client,
        named in the log with what holds it, and every waiting request is answered 503; the server stays
        stalled (health 503, new requests 503) until the worker comes back."""
        period = max(0.05, min(1.0, self.stall_timeout / 4))
        while not self._stopping:
            time.sleep(period)
            job, thread = self._current, self._thread
            if job is None or self.stalled or time.monotonic() - self._progress_at < self.stall_timeout:
                continue
            self._declare_stall(job, holder(thread.ident if thread else None))

    def _declare_stall(self, job: Job, where: str) -> None:
        """Fail `job` and everything queued behind it. Under the lock that `submit` holds from its check to its
        put, so a request is either drained here or refused there; never queued behind a held worker."""
        with self._lock:
            if self._current is not job or self.stalled:  # it returned meanwhile: nothing is held
                return
            self.stalled = reason = (f"a generation made no progress for {self.stall_timeout:g} s; the worker is "
                                     f"held in {where}")
            drained = []
            while True:
                try:
                    waiting = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if waiting is None:  # stop()'s: the worker must still find it
                    self._jobs.put(None)
                    break
                drained.append(waiting)
            self.waiting -= len(drained)
        log.error("stalled: %s", reason)
        job.cancelled.set()  # if it ever comes back, it stops after that round
        for each in (job, *drained):
            each.send("error", Stalled(reason))

    def stop(self) -> None:
        """Stop the generation in progress after its round, refuse what waits, end the thread."""
        with self._lock:  # a submit either refuses, or puts its job before the worker's end-of-work mark
            self._stopping = True
        current = self._current
        if current is not None:
            current.cancelled.set()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, job: Job) -> None:
        # checked and queued under one lock: a stall declared or a stop begun in between would strand the job
        with self._lock:
            if self._stopping:  # no worker will take it
                raise ShuttingDown
            if self.stalled:
                raise Stalled(self.stalled)
            if self.waiting + self.busy > self.queue_size:
                self.metrics.requests_rejected.labels(self.metrics.model_name).inc()
                raise QueueFull
            self.waiting += 1
            self._jobs.put(job)

    def retry_after_s(self) -> int:
        """A guess at when a place frees up: the mean time of a generation so far, at least a second."""
        return max(1, round(self._mean_service_s))

    def _next_job(self) -> Job | None:
        """The next job; while none waits, the drafter's deferred work (`drafter.learn` trains between
        requests), a unit at a time, so a request that comes waits for one unit at most."""
        while self._idle_work and not self._stopping:
            try:
                return self._jobs.get_nowait()
            except queue.Empty:
                pass
            try:
                if not self.runner.idle():
                    break
            except Exception:  # noqa: BLE001 - idle work is a bonus; serving goes on without it
                log.exception("the drafter's idle work failed; it is not asked again")
                self._idle_work = False
        return self._jobs.get()

    def _work(self) -> None:
        while (job := self._next_job()) is not None:
            with self._lock:
                self.waiting -= 1
                self.busy = 1
            event = self._take(job)
            with self._lock:  # with `_current`, so a stall is never declared on a generation that has returned
                self.busy = 0
                self._current = None
                recovered, self.stalled = self.stalled, None
            if recovered:
                log.warning("recovered: the stalled generation came back")
            if event is not None:  # after the place is free, so a client that goes on at once finds it free
                job.send(*event)

    def _take(self, job: Job) -> tuple[str, Any] | None:
        if self._stopping:
            return "error", ShuttingDown()
        if job.cancelled.is_set():
            self.metrics.request_success.labels(self.metrics.model_name, "abort").inc()
            return None
        self._progress_at = time.monotonic()
        self._current = job
        self._running.set(1)
        started = time.perf_counter()
        try:
            return "done", self._generate(job)
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the server
            # the client's answer logs it (app._as_api_error: an incident id with the traceback)
            self.metrics.request_success.labels(self.metrics.model_name, "error").inc()
            return "error", exc
        finally:
            self._running.set(0)
            self._mean_service_s += 0.2 * (time.perf_counter() - started - self._mean_service_s)

    def _generate(self, job: Job) -> Outcome:
        request, runner, tokenizer, metrics = job.request, self.runner, self.tokenizer, self.metrics
        labels = metrics.model_name
        metrics.queue_time.labels(labels).observe(time.perf_counter() - job.arrival)
        runner.acceptor = self.acceptors[request.params.greedy]  # one generation at a time: safe to swap
        decoder, text = tokenizer.stream_decoder(), StopText(request.stop)
        eog = tokenizer.eog_ids
        finish = None
        rounds = runner.rounds(request.prompt_ids, request.max_tokens, request.params, eog)
        deadline = time.monotonic() + self.request_timeout if self.request_timeout else None
        delivered = 0
        try:
            for round_ in rounds:
                self._progress_at = now = time.monotonic()
                if round_.index == 0:
                    metrics.ttft.labels(labels).observe(time.perf_counter() - job.arrival)
                pieces = []
                for token in round_.tokens:  # a round's tokens became certain together; a stop string may end it
                    delivered += 1
                    if token not in eog:
                        text.feed(decoder.push(token))
                        pieces.append(text.take())
                        if text.stopped:
                            break
                piece = "".join(pieces)
                if piece:
                    job.send("text", piece)
                if text.stopped:
                    finish = "stop"
                    break
                if job.cancelled.is_set():
                    finish = "abort"
                    break
                if deadline is not None and now > deadline:
                    finish = "timeout"  # --request-timeout: the text so far, and why it ends there
                    break
        finally:
            rounds.close()
        stats = runner.stats
        if finish is None or finish == "timeout":
            text.feed(decoder.flush())
            piece = text.take(final=True)
            if piece:
                job.send("text", piece)
        if finish is None:
            finish = "length" if stats.stop_reason == "length" and not text.stopped else "stop"
        metrics.record_generation(stats, finish)
        metrics.e2e_latency.labels(labels).observe(time.perf_counter() - job.arrival)
        if finish == "timeout":  # OpenAI clients know stop and length only: cut short is "length", as vLLM says
            return Outcome("length", stats, delivered, stop_reason="timeout")
        return Outcome(finish, stats, delivered)


def _stop_at_exit(engine: weakref.ref) -> None:
    if (alive := engine()) is not None:
        alive.stop()
