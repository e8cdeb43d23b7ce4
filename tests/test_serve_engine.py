"""The server's generation engine driven directly, without HTTP: a stub runner whose first round blocks on an
Event, the watchdog on a clock the test moves, and the engine's lock hooked so that a submit can be held at
the point where it has begun but not yet queued, while the watchdog declares a stall. Every interleaving is
set by the test, none by timing; each request must be answered (refused, or sent an error) within a timeout."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")

from outrider.serve import engine as engine_module  # noqa: E402
from outrider.serve.engine import GenerationEngine, Job, ShuttingDown, Stalled  # noqa: E402
from outrider.serve.metrics import ServerMetrics  # noqa: E402
from outrider.serve.requests import GenerationRequest  # noqa: E402
from outrider.spec.runner import GenerationStats  # noqa: E402
from outrider.spec.sampling import SamplingParams  # noqa: E402

ANSWER_TIMEOUT_S = 10.0  # far above any answer's time; a stranded request waits for ever


class StubSequence:
    """What the engine reads of a runner's sequence."""

    def __init__(self, prompt):
        self.prompt, self.prefilled = prompt, 0
        self.prefilling, self.done, self.stats = True, False, GenerationStats()


class StubRunner:
    """A runner of the engine's calls whose generations read their prompt in one piece and end there (no tokens);
    `generation` is what that piece does."""

    def __init__(self):
        self.acceptor, self.finished = None, []

    def admit(self, prompt_ids, max_tokens, params, eog, acceptor=None):
        return StubSequence(prompt_ids)

    def prefill(self, seq, rows=None):
        self.generation()
        seq.prefilling, seq.done = False, True
        return SimpleNamespace(index=0, tokens=[], drafted=0, accepted=0)

    def step(self, seqs):
        raise AssertionError("no sequence of a stub runner is ever stepped")

    def finish(self, seq):
        self.finished.append(seq)


class BlockingRunner(StubRunner):
    """A runner whose generation holds the worker until `release` is set; no tokens, no stats."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def generation(self):
        self.entered.set()
        self.release.wait()


class ManualClock:
    """`time` for the engine module: monotonic is the test's to move; every watchdog tick is counted."""

    perf_counter = staticmethod(time.perf_counter)

    def __init__(self):
        self.now, self.ticks = 0.0, 0
        self.ticked = threading.Condition()

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        with self.ticked:
            self.ticks += 1
            self.ticked.notify_all()
        time.sleep(seconds)

    def wait_for_ticks(self, count: int) -> None:
        with self.ticked:
            assert self.ticked.wait_for(lambda: self.ticks >= count, ANSWER_TIMEOUT_S), "the watchdog did not run"


class HookedLock:
    """The engine's lock, with a hook run once, in the thread that arms it, before its next acquire."""

    def __init__(self):
        self._lock = threading.Lock()
        self.before_acquire, self.armed_in = None, None

    def __enter__(self):
        if self.armed_in is threading.current_thread():
            self.armed_in = None
            self.before_acquire()
        self._lock.acquire()

    def __exit__(self, *exc):
        self._lock.release()


class RecordingJob(Job):
    """A job whose events go to a thread-safe queue instead of an event loop."""

    def send(self, kind, value):
        self.received.put((kind, value))


def new_job() -> RecordingJob:
    request = GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=4, params=SamplingParams(temperature=0.0))
    job = RecordingJob(request, loop=None)
    job.received = queue.Queue()
    return job


def answer(engine: GenerationEngine, job: RecordingJob) -> tuple[str, object]:
    """What the client of `job` is told: its submit refused, or the first event the worker or watchdog sent."""
    try:
        engine.submit(job)
    except (Stalled, ShuttingDown) as refused:
        return "refused", refused
    return awaited(job)


def awaited(job: RecordingJob) -> tuple[str, object]:
    try:
        return job.received.get(timeout=ANSWER_TIMEOUT_S)
    except queue.Empty:
        pytest.fail(f"a request was left waiting for over {ANSWER_TIMEOUT_S:g} s")


def stub_engine(runner, **options) -> GenerationEngine:
    """An engine (not started) on `runner`, with a tokenizer that decodes nothing and no end-of-generation ids."""
    decoder = SimpleNamespace(push=lambda token: "", flush=lambda: "")
    tokenizer = SimpleNamespace(stream_decoder=lambda: decoder, eog_ids=frozenset())
    return GenerationEngine(SimpleNamespace(runner=runner, tokenizer=tokenizer), {True: None, False: None},
                            ServerMetrics("stub"), queue_size=8, **options)


@pytest.fixture
def stuck_engine(monkeypatch):
    """A started engine with a watchdog (stall_timeout 0.2 s on the test's clock) and its hooked lock."""
    clock = ManualClock()
    monkeypatch.setattr(engine_module, "time", clock)
    runner = BlockingRunner()
    engine = stub_engine(runner, stall_timeout=0.2)
    engine._lock = lock = HookedLock()
    engine.start()
    yield engine, runner, clock, lock
    runner.release.set()
    engine.stop()


def is_stalled_error(event) -> bool:
    kind, value = event
    return kind in ("error", "refused") and isinstance(value, Stalled)


def test_every_request_queued_before_during_or_after_a_stall_is_answered_stalled(stuck_engine):
    engine, runner, clock, lock = stuck_engine
    stuck = new_job()
    engine.submit(stuck)
    assert runner.entered.wait(ANSWER_TIMEOUT_S)
    queued_before = new_job()
    engine.submit(queued_before)

    def declare_stall():
        # the racing submit has begun; the watchdog sees a generation with no progress past stall_timeout,
        # and the test waits for a whole tick after the clock moved (two counted sleeps)
        ticks = clock.ticks
        clock.now += 1.0
        clock.wait_for_ticks(ticks + 2)
        assert engine.stalled

    lock.before_acquire, lock.armed_in = declare_stall, threading.current_thread()
    racing = answer(engine, new_job())
    assert engine.stalled and "held in" in engine.stalled, engine.stalled
    after = answer(engine, new_job())
    answers = {"stuck": awaited(stuck), "queued before": awaited(queued_before), "racing": racing, "after": after}
    for name, event in answers.items():
        assert is_stalled_error(event), (name, event)
    assert engine.waiting == 0

    runner.release.set()  # the generation comes back: the server takes requests again
    assert awaited(stuck)[0] == "done"  # sent once the worker is free
    kind, outcome = answer(engine, new_job())
    assert kind == "done" and engine.stalled is None and engine.waiting == 0, (kind, outcome)


def test_a_stall_is_not_declared_on_a_generation_that_has_returned(stuck_engine):
    engine, runner, clock, lock = stuck_engine
    stuck = new_job()
    engine.submit(stuck)
    assert runner.entered.wait(ANSWER_TIMEOUT_S)
    runner.release.set()
    assert awaited(stuck)[0] == "done"
    engine._declare_stall(stuck, "nowhere")  # what a watchdog that read the job just before it returned does
    assert engine.stalled is None
    assert answer(engine, new_job())[0] == "done"


def test_a_request_submitted_while_the_server_stops_is_answered(stuck_engine):
    engine, runner, clock, lock = stuck_engine
    runner.release.set()
    stopper = threading.Thread(target=engine.stop)

    def stop_begins():
        stopper.start()
        # stop() has marked the end of work, or waits for this submit's lock to do so
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while not engine._stopping and stopper.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)

    lock.before_acquire, lock.armed_in = stop_begins, threading.current_thread()
    kind, value = answer(engine, new_job())
    stopper.join(ANSWER_TIMEOUT_S)
    assert kind in ("error", "refused") and isinstance(value, ShuttingDown), (kind, value)


class IdleWorkRunner(StubRunner):
    """A runner with deferred work (as `drafter.learn` has): `idle` records each unit and holds it until the test
    lets it go; `work_left` units remain; a generation adds `after_request` more. `fail` makes a unit raise."""

    def __init__(self, work_left: int, after_request: int = 0, fail: bool = False):
        super().__init__()
        self.work_left, self.after_request, self.fail = work_left, after_request, fail
        self.units, self.generations = [], 0
        self.unit_started, self.go = threading.Semaphore(0), threading.Semaphore(0)

    def generation(self):
        self.generations += 1
        self.units.append("generation")
        self.work_left += self.after_request

    def idle(self) -> bool:
        self.unit_started.release()
        assert self.go.acquire(timeout=ANSWER_TIMEOUT_S), "the test never let the unit go"
        if self.fail:
            raise RuntimeError("idle work broke")
        self.units.append("unit")
        self.work_left -= 1
        return self.work_left > 0


def idle_engine(runner) -> GenerationEngine:
    engine = stub_engine(runner)
    engine.start()
    return engine


def let_units_go(runner, count: int) -> None:
    for _ in range(count):
        assert runner.unit_started.acquire(timeout=ANSWER_TIMEOUT_S), "the worker asked for no idle work"
        runner.go.release()


def test_the_worker_does_the_drafters_idle_work_between_requests_a_unit_at_a_time():
    """While no request waits the worker asks the runner for idle work until it says none is left; a request
    that comes while a unit runs waits for that unit only; after it the idle work goes on."""
    runner = IdleWorkRunner(work_left=3, after_request=2)
    engine = idle_engine(runner)
    try:
        let_units_go(runner, 3)  # the work there was, then none: the worker waits for requests
        assert awaited_done(engine, runner) == ["unit", "unit", "unit", "generation"]
        assert runner.unit_started.acquire(timeout=ANSWER_TIMEOUT_S)  # the request's own idle work begins
        job = new_job()
        engine.submit(job)  # while that unit runs
        runner.go.release()
        assert awaited(job)[0] == "done"
        assert runner.units[-2:] == ["unit", "generation"], runner.units  # one unit, then the request
        let_units_go(runner, 3)  # what is left of both requests' work (2 + 2 - 1)
        time_limit = time.monotonic() + ANSWER_TIMEOUT_S
        while runner.units.count("unit") < 7 and time.monotonic() < time_limit:
            time.sleep(0.01)
        assert runner.units.count("unit") == 7 and runner.work_left == 0, runner.units
        assert not runner.unit_started.acquire(timeout=0.2)  # none left: the worker waits for a request
    finally:
        runner.go.release(10)
        engine.stop()


def awaited_done(engine, runner) -> list[str]:
    job = new_job()
    engine.submit(job)
    assert awaited(job)[0] == "done"
    return list(runner.units)


def test_idle_work_that_fails_is_logged_and_not_asked_for_again(caplog):
    runner = IdleWorkRunner(work_left=5, fail=True)
    engine = idle_engine(runner)
    try:
        let_units_go(runner, 1)
        for _ in range(2):
            assert awaited_done(engine, runner)[-1] == "generation"  # requests are served as ever
        assert not runner.unit_started.acquire(timeout=0.2) and "idle work failed" in caplog.text
    finally:
        runner.go.release(10)
        engine.stop()


def test_a_request_is_expected_just_after_a_slot_frees_for_twice_the_gap_clients_come_back_in(monkeypatch):
    """Hand-timed: before any request came back, one is expected for twice RETURN_GAP_S after a slot frees; a
    request that comes moves the mean gap a fifth of the way to its gap and ends the expectation; one that comes
    later than RETURN_WINDOW_S (not a client coming back) moves nothing."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    gap = engine_module.ReturnGap()
    assert not gap.expected()  # no slot has freed
    gap.freed()
    clock.now += 2 * engine_module.RETURN_GAP_S - 0.001
    assert gap.expected()
    clock.now += 0.002
    assert not gap.expected()
    gap.freed()
    clock.now += 0.010
    gap.arrived()
    assert gap.mean_s == pytest.approx(engine_module.RETURN_GAP_S + 0.2 * (0.010 - engine_module.RETURN_GAP_S))
    assert not gap.expected()  # it came
    mean = gap.mean_s
    gap.freed()
    clock.now += engine_module.RETURN_WINDOW_S + 1.0
    gap.arrived()
    assert gap.mean_s == mean
