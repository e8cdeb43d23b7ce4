"""Continuous batching against the assembled runner, in one worker thread; a bounded queue in front.

Requests come from the event loop as `Job`s. The worker keeps up to `slots` generations running (llama-server's
`-np`): each loop it admits waiting jobs into free slots in arrival order, reads one chunk of the prompt of a slot
still prefilling (so no running stream waits more than a chunk for a newcomer's prompt), then steps every running
slot together (`Runner.step`: each drafts, one ragged target forward verifies them all) and sends each slot's text
back, one event per round (a round's tokens become certain together); a finished slot sends `done` with its stats
and frees its place at once. A step that a request waits on (a prompt still being read, or a client's next request
expected just after a slot freed) is a plain step (`Runner.step(waited_on=True)`). A job whose client has gone is
skipped if it is still waiting, and stopped after the round in progress if it is running; timeouts are per slot; the
stall watchdog fails every slot held by a step that makes no progress. Per-request sampling settings go to
`Runner.admit`; with `--acceptor auto` the acceptor (greedy at temperature 0, sampled above) is chosen per request
from two built at start-up, so nothing is re-assembled. The drafter's deferred work (`drafter.learn`) runs only
while no slot is running.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from outrider.assembly import Assembly, check_pair
from outrider.errors import OutriderError
from outrider.models.layers import PREFILL_CHUNK
from outrider.registry import Registry, default_registry
from outrider.serve.metrics import ServerMetrics
from outrider.serve.requests import GenerationRequest
from outrider.serve.stop_text import StopText
from outrider.spec import runner
from outrider.spec.runner import GenerationStats
from outrider.spec.sampling import SamplingParams

log = logging.getLogger("outrider.serve")
T = TypeVar("T")


def on_a_passing_thread(work: Callable[[], T]) -> T:
    """`work()` run on a thread that ends with it: its result, or what it raised. For loading the model a server
    generates with: torch's OpenMP pool belongs to the thread that first runs a parallel op, and an idle pool left
    on another thread (the main thread, after loading) slows every parallel region of the generation thread's own,
    as libgomp's workers then outnumber the cores and stop spinning between regions (docs/bench/serving.md). A
    thread's pool ends with the thread, so the generation thread's is then the process's only one."""
    with ThreadPoolExecutor(1, thread_name_prefix="outrider-load") as pool:  # leaving it joins the thread
        return pool.submit(work).result()


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


@dataclass
class Slot:
    """A running job: its sequence in the runner, and what its text has become so far."""

    job: Job
    seq: Any
    decoder: Any
    text: StopText
    deadline: float | None
    delivered: int = 0  # tokens sent, through the one that completed a stop string
    finish: str | None = None  # why it ends, once it does: stop, length, abort, timeout, error
    error: Exception | None = None  # what the client is told, with finish "error"
    started: float = field(default_factory=time.perf_counter)


PREFILL_ROWS = 4 * PREFILL_CHUNK  # a newcomer's prompt read per loop between the running slots' steps
RETURN_GAP_S = 0.025  # a client's next request after its last answer's end, until the server has seen some
RETURN_WINDOW_S = 0.25  # the longest wait after a slot frees that is still taken for a client coming back


class ReturnGap:
    """How soon after a slot frees the next request comes: a client's next turn is sent as its answer ends, one
    network hop later, while a step that drafts as deep as one user would takes many times that, and holds the
    newcomer up for all of it (the gaps measured: docs/bench/serving.md, "a step a request waits on"). A request
    within `RETURN_WINDOW_S` of a freed slot counts as coming back; the window in which one is expected is twice
    their decayed mean gap."""

    def __init__(self) -> None:
        self.mean_s = RETURN_GAP_S
        self.freed_at: float | None = None  # when a slot last freed with others still running, until a request

    def freed(self) -> None:
        self.freed_at = time.perf_counter()

    def arrived(self) -> None:
        """From the event loop's thread: a request was queued."""
        freed, self.freed_at = self.freed_at, None
        if freed is not None and (gap := time.perf_counter() - freed) < RETURN_WINDOW_S:
            self.mean_s += 0.2 * (gap - self.mean_s)

    def expected(self) -> bool:
        """Whether a request is expected now: a slot freed within twice the mean gap and none came since."""
        freed = self.freed_at
        return freed is not None and time.perf_counter() - freed < min(RETURN_WINDOW_S, 2 * self.mean_s)


class GenerationEngine:
    def __init__(self, assembly: Assembly, acceptors: dict[bool, Any], metrics: ServerMetrics, queue_size: int,
                 stall_timeout: float | None = None, request_timeout: float | None = None, slots: int = 1):
        self.runner, self.tokenizer = assembly.runner, assembly.tokenizer
        self.acceptors, self.metrics, self.queue_size = acceptors, metrics, queue_size
        self.stall_timeout, self.request_timeout = stall_timeout, request_timeout
        self.n_slots = slots
        self.stalled: str | None = None  # why the worker is held, while it is
        self._progress_at = time.monotonic()  # the last time the slots in progress moved on
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0  # submitted, not yet taken by the worker
        self.busy = 0  # slots holding a job; counted with `waiting` under the lock, so no gap
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._slots: list[Slot] = []  # in admission order
        self._ending = False  # stop()'s end-of-work mark was taken from the queue
        self.return_gap = ReturnGap()
        self._mean_service_s = 1.0  # a generation's time, averaged; for Retry-After
        # asked for between requests (a learning drafter trains then); False after a unit fails, so a broken
        # learner costs one logged error, not one per request
        self._idle_work = callable(getattr(self.runner, "idle", None))
        labels = metrics.model_name
        metrics.waiting.labels(labels).set_function(lambda: self.waiting)
        metrics.running.labels(labels).set_function(lambda: self.busy)
        self._batch_size = metrics.batch_size.labels(labels)
        self._step_rows = metrics.iteration_tokens.labels(labels)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="outrider-generation", daemon=True)
        self._thread.start()
        # at exit, even one that skips the server's shutdown (a second Ctrl-C): the worker's unit ends before the
        # drafter's own exit handlers (a learner's save, registered earlier, runs later) read what it trains
        atexit.register(_stop_at_exit, weakref.ref(self))
        if self.stall_timeout:
            threading.Thread(target=self._watch, name="outrider-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """Every so often: slots with no progress for stall_timeout seconds are failed for their clients, named
        in the log with what holds the worker, and every waiting request is answered 503; the server stays
        stalled (health 503, new requests 503) until the worker comes back."""
        period = max(0.05, min(1.0, self.stall_timeout / 4))
        while not self._stopping:
            time.sleep(period)
            held, thread = list(self._slots), self._thread
            if not held or self.stalled or time.monotonic() - self._progress_at < self.stall_timeout:
                continue
            self._declare_stall(held[0].job, holder(thread.ident if thread else None))

    def _declare_stall(self, job: Job, where: str) -> None:
        """Fail every running slot (`job`'s among them) and everything queued behind them. Under the lock that
        `submit` holds from its check to its put, so a request is either drained here or refused there; never
        queued behind a held worker."""
        with self._lock:
            held = [slot.job for slot in self._slots]
            if job not in held or self.stalled:  # it returned meanwhile: nothing is held
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
        for each in held:
            each.cancelled.set()  # if the step ever comes back, they stop after it
        for each in (*held, *drained):
            each.send("error", Stalled(reason))

    def stop(self) -> None:
        """Stop the generations in progress after their round, refuse what waits, end the thread."""
        with self._lock:  # a submit either refuses, or puts its job before the worker's end-of-work mark
            self._stopping = True
        for slot in list(self._slots):
            slot.job.cancelled.set()
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
            if self.waiting + self.busy > self.queue_size + self.n_slots - 1:
                self.metrics.requests_rejected.labels(self.metrics.model_name).inc()
                raise QueueFull
            self.waiting += 1
            self._jobs.put(job)
        self.return_gap.arrived()

    def retry_after_s(self) -> int:
        """A guess at when a place frees up: a generation's mean time over the slots, at least a second."""
        return max(1, round(self._mean_service_s / self.n_slots))

    def _next_job(self, wait: bool) -> Job | None:
        """The next waiting job, or None. With `wait` (no slot is running), the drafter's deferred work while none
        waits (`drafter.learn` trains between requests), a unit at a time, so a request that comes waits for one
        unit at most, then a blocking wait; the end-of-work mark ends the worker."""
        while wait and self._idle_work and not self._stopping:
            try:
                job = self._jobs.get_nowait()
                break
            except queue.Empty:
                pass
            try:
                if not self.runner.idle():
                    job = self._jobs.get()
                    break
            except Exception:  # noqa: BLE001 - idle work is a bonus; serving goes on without it
                log.exception("the drafter's idle work failed; it is not asked again")
                self._idle_work = False
        else:
            try:
                job = self._jobs.get() if wait else self._jobs.get_nowait()
            except queue.Empty:
                return None
        if job is None:
            self._ending = True
        return job

    def _work(self) -> None:
        while not (self._ending and not self._slots):
            while not self._ending and len(self._slots) < self.n_slots:
                job = self._next_job(wait=not self._slots)
                if job is None:
                    break
                with self._lock:
                    self.waiting -= 1
                self._admit(job)
            if not self._slots:
                continue
            prefilling = next((slot for slot in self._slots if slot.seq.prefilling), None)
            if prefilling is not None:
                self._step_rows.observe(min(PREFILL_ROWS, len(prefilling.seq.prompt) - prefilling.seq.prefilled))
                self._guarded([prefilling], lambda: [self.runner.prefill(prefilling.seq, PREFILL_ROWS)])
            running = [slot for slot in self._slots if not slot.seq.prefilling and not slot.seq.done
                       and slot.finish is None]
            if running:
                self._batch_size.observe(len(running))
                self._guarded(running, lambda: self._step(running))
            self._retire()

    def _admit(self, job: Job) -> None:
        """Take `job` into a free slot (its prompt is read in later loops), or answer it now."""
        request, metrics = job.request, self.metrics
        if self._stopping:
            job.send("error", ShuttingDown())
            return
        if job.cancelled.is_set():
            metrics.request_success.labels(metrics.model_name, "abort").inc()
            return
        metrics.queue_time.labels(metrics.model_name).observe(time.perf_counter() - job.arrival)
        try:
            seq = self.runner.admit(request.prompt_ids, request.max_tokens, request.params, self.tokenizer.eog_ids,
                                    acceptor=self.acceptors[request.params.greedy])
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the server
            metrics.request_success.labels(metrics.model_name, "error").inc()
            job.send("error", exc)
            return
        deadline = time.monotonic() + self.request_timeout if self.request_timeout else None
        slot = Slot(job, seq, self.tokenizer.stream_decoder(), StopText(request.stop), deadline)
        with self._lock:  # with `busy`, so a stall is never declared on a slot that has returned
            self._slots.append(slot)
            self.busy = len(self._slots)
        self._progress_at = time.monotonic()

    def _guarded(self, slots: list[Slot], work) -> None:
        """Run `work` (a prefill chunk, or a step of `slots`), delivering each slot's round; a failure inside is
        every one of those slots' error (the client's answer logs it: app._as_api_error, an incident id)."""
        try:
            rounds = work()
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the server
            for slot in slots:
                slot.finish, slot.error = "error", exc
                self.metrics.request_success.labels(self.metrics.model_name, "error").inc()
            return
        self._progress_at = now = time.monotonic()
        for slot, round_ in zip(slots, rounds):
            if round_ is not None:
                self._deliver(slot, round_, now)

    def _step(self, running: list[Slot]) -> list:
        waited_on = any(slot.seq.prefilling for slot in self._slots) or self.return_gap.expected()
        rounds = self.runner.step([slot.seq for slot in running], waited_on=waited_on)
        self._step_rows.observe(sum(r.drafted + 1 for r in rounds))
        return rounds

    def _deliver(self, slot: Slot, round_: Any, now: float) -> None:
        job, metrics, eog = slot.job, self.metrics, self.tokenizer.eog_ids
        if round_.index == 0:
            metrics.ttft.labels(metrics.model_name).observe(time.perf_counter() - job.arrival)
        pieces = []
        for token in round_.tokens:  # a round's tokens became certain together; a stop string may end it
            slot.delivered += 1
            if token not in eog:
                slot.text.feed(slot.decoder.push(token))
                pieces.append(slot.text.take())
                if slot.text.stopped:
                    break
        piece = "".join(pieces)
        if piece:
            job.send("text", piece)
        if slot.text.stopped:
            slot.finish = "stop"
        elif job.cancelled.is_set():
            slot.finish = "abort"
        elif slot.deadline is not None and now > slot.deadline:
            slot.finish = "timeout"  # --request-timeout: the text so far, and why it ends there

    def _retire(self) -> None:
        """Send `done` for every slot whose generation ended, and free its place."""
        for slot in list(self._slots):
            if slot.finish is None and slot.job.cancelled.is_set():
                slot.finish = "abort"  # a client gone while its prompt is read
            if slot.finish is None and not slot.seq.done:
                continue
            self.runner.finish(slot.seq)
            with self._lock:
                self._slots.remove(slot)
                self.busy = len(self._slots)
                if self._slots:
                    self.return_gap.freed()
                recovered = self.stalled if not self._slots else None
                if recovered:
                    self.stalled = None
            if recovered:
                log.warning("recovered: the stalled generation came back")
            self._mean_service_s += 0.2 * (time.perf_counter() - slot.started - self._mean_service_s)
            # after the place is free, so a client that goes on at once finds it free
            if slot.finish == "error":
                slot.job.send("error", slot.error)
            else:
                slot.job.send("done", self._outcome(slot))

    def _outcome(self, slot: Slot) -> Outcome:
        stats, metrics, finish = slot.seq.stats, self.metrics, slot.finish
        if finish is None or finish == "timeout":
            slot.text.feed(slot.decoder.flush())
            piece = slot.text.take(final=True)
            if piece:
                slot.job.send("text", piece)
        if finish is None:
            finish = "length" if stats.stop_reason == "length" and not slot.text.stopped else "stop"
        metrics.record_generation(stats, finish)
        metrics.e2e_latency.labels(metrics.model_name).observe(time.perf_counter() - slot.job.arrival)
        if finish == "timeout":  # OpenAI clients know stop and length only: cut short is "length", as vLLM says
            return Outcome("length", stats, slot.delivered, stop_reason="timeout")
        return Outcome(finish, stats, slot.delivered)


def _stop_at_exit(engine: weakref.ref) -> None:
    if (alive := engine()) is not None:
        alive.stop()
