"""The server's slots: several requests generate at once (continuous batching), each as it would alone.

Oracles: the same request sent to a server with one slot (and `outrider generate`'s own tokens), hand-counted
slot sizes and memory, and the runner's own record of which calls it was asked for, in order."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")

from click.testing import CliRunner  # noqa: E402
from live_server import LiveServer  # noqa: E402

from outrider.assembly import assemble  # noqa: E402
from outrider.cli import main  # noqa: E402
from outrider.config import resolve_config  # noqa: E402
from outrider.errors import ConfigError  # noqa: E402
from outrider.serve import create_app  # noqa: E402
from outrider.serve import engine as engine_module  # noqa: E402
from outrider.serve.slots import DEFAULT_SLOTS, kv_bytes_per_token, plan_slots  # noqa: E402
from outrider.testing.tiny_models import write_tiny_gemma4, write_tiny_llama  # noqa: E402

CONTEXT = 1024


class SlotServer:
    """A server on a tiny model with `slots` slots of `context` tokens each, as `outrider serve -np` sets it up."""

    def __init__(self, model_path, slots: int, context: int = CONTEXT, drafter: str = "lookup"):
        config = resolve_config({"model": str(model_path), "context": context, "max_tokens": 24, "drafter": drafter,
                                 "draft_max": 4})
        assembly = assemble(config)
        assembly.runner.set_slots(slots, context)
        self.runner = assembly.runner
        self.app = create_app(assembly, config, queue_size=16, slots=slots)
        self.live = LiveServer(self.app)
        self.base = self.live.base

    def post(self, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(self.base + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path: str):
        with urllib.request.urlopen(self.base + path, timeout=30) as response:
            return response.read().decode()

    def stop(self):
        self.live.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("slots") / "tiny.gguf", context=4 * CONTEXT)


PROMPTS = ["the the the the the", "abc abc abc abc", "hello there", "one two one two one two", "x", "the cat sat on",
           "1 2 3 1 2 3 1 2", "zz zz zz"]


def _bodies(temperature: float) -> list[dict]:
    return [{"prompt": p, "max_tokens": 24, "temperature": temperature, "seed": 100 + i}
            for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_requests_in_four_slots_get_what_each_gets_alone(tiny, temperature):
    """Eight requests sent at once to four slots (greedy, and seeded sampling): each one's text is the text a
    one-slot server gives it; the slots ran together (the batch-size histogram saw steps of more than one)."""
    one = SlotServer(tiny, 1)
    try:
        alone = [one.post(body) for body in _bodies(temperature)]
    finally:
        one.stop()
    four = SlotServer(tiny, 4)
    try:
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(four.post, _bodies(temperature)))
        metrics = four.get("/metrics")
    finally:
        four.stop()
    for i, ((status_a, a), (status_b, b)) in enumerate(zip(alone, together)):
        assert status_a == status_b == 200, (a, b)
        assert b["choices"][0]["text"] == a["choices"][0]["text"], f"request {i} ({PROMPTS[i]!r})"
        assert b["usage"] == a["usage"], f"request {i}"
    batched = [line for line in metrics.splitlines() if line.startswith("outrider:batch_size_bucket")]
    one_only = next(float(line.split()[-1]) for line in batched if 'le="1.0"' in line)
    total = next(float(line.split()[-1]) for line in batched if 'le="+Inf"' in line)
    assert total > one_only, "no step ran more than one slot"


def test_props_report_the_slots_and_each_ones_context(tiny):
    server = SlotServer(tiny, 3, context=512)
    try:
        props = json.loads(server.get("/props"))
        assert props["total_slots"] == 3 and props["default_generation_settings"]["n_ctx"] == 512
        status, answer = server.post({"prompt": "a " * 600, "max_tokens": 2})
        assert status == 400 and "512" in answer["error"]["message"], answer
    finally:
        server.stop()


class CallLog:
    """The runner's prefill, step and finish calls, in order, as (kind, prompt length or sequences stepped,
    waited_on, time)."""

    def __init__(self, runner):
        self.calls, self._lock = [], threading.Lock()
        prefill, step, finish = runner.prefill, runner.step, runner.finish

        def recorded_prefill(seq, rows=None):
            self._add("prefill", len(seq.prompt))
            return prefill(seq, rows)

        def recorded_step(seqs, waited_on=False):
            self._add("step", len(seqs), waited_on)
            return step(seqs, waited_on=waited_on)

        def recorded_finish(seq):
            self._add("finish", len(seq.prompt))
            return finish(seq)

        runner.prefill, runner.step, runner.finish = recorded_prefill, recorded_step, recorded_finish

    def _add(self, kind: str, n: int, waited_on: bool | None = None) -> None:
        with self._lock:
            self.calls.append((kind, n, waited_on, time.perf_counter()))

    def wait_for_a_step(self) -> None:
        deadline = time.monotonic() + 30
        while not any(c[0] == "step" for c in self.calls):
            assert time.monotonic() < deadline, "no step within 30 s"
            time.sleep(0.005)


def calls_while_one_streams(tiny, tokens: int, body: dict) -> list[tuple]:
    """A two-slot server's runner calls (CallLog) while a request for `tokens` streams and `body` is sent once it
    has stepped; both answered 200."""
    server = SlotServer(tiny, 2)
    log = CallLog(server.runner)
    try:
        with ThreadPoolExecutor(2) as pool:
            streaming = pool.submit(server.post, {"prompt": "the cat", "max_tokens": tokens})
            log.wait_for_a_step()
            assert server.post(body)[0] == 200
            assert streaming.result()[0] == 200
    finally:
        server.stop()
    return log.calls


def test_a_newcomers_prompt_is_read_in_chunks_between_the_running_slots_steps(tiny):
    """While one slot streams, a long prompt (three chunks) arrives: the runner is asked for a step of the running
    slot between each chunk of it, so the stream never waits for the whole prompt; those steps are waited on."""
    calls = calls_while_one_streams(tiny, 200, {"prompt": "ab " * 300, "max_tokens": 4})
    long_prompt = max(c[1] for c in calls if c[0] == "prefill")
    chunks = [i for i, c in enumerate(calls) if c[0] == "prefill" and c[1] == long_prompt]
    assert len(chunks) >= 3, calls
    for a, b in zip(chunks, chunks[1:]):
        between = [c for c in calls[a + 1:b] if c[0] == "step"]
        assert between, f"no step between two prompt chunks: {calls}"
        # the newcomer's next chunk waits for these steps: they draft nothing where timings choose (Runner.step)
        assert all(c[2] for c in between), calls
    before = [c for c in calls[:chunks[0]] if c[0] == "step"]
    assert before and not any(c[2] for c in before), "a step nobody waited on was hurried"


def test_the_steps_just_after_a_slot_frees_wait_for_its_clients_next_request_and_then_not(tiny):
    """A short request ends while a long one streams: the survivor's next step is hurried (its client's next
    request is expected within ReturnGap's window), and once no request has come for the window, steps are not."""
    calls = calls_while_one_streams(tiny, 1000, {"prompt": "ab ab", "max_tokens": 3})
    freed = next(i for i, c in enumerate(calls) if c[0] == "finish")
    after = [c for c in calls[freed + 1:] if c[0] == "step"]
    window = min(engine_module.RETURN_WINDOW_S, 2 * engine_module.RETURN_GAP_S)
    assert after and after[0][1] == 1 and after[0][2], calls[freed:freed + 3]
    late = [waited_on for _, _, waited_on, at in after if at - calls[freed][3] > window]
    assert late and not any(late), "steps long after the slot freed were still hurried"


def test_slots_are_planned_as_llama_server_plans_them_and_what_does_not_fit_is_said(tiny):
    from outrider.io.gguf import GGUFFile
    from outrider.models import load_model

    model = load_model(GGUFFile(tiny))
    per_token = kv_bytes_per_token(model)
    plenty = 10 ** 12
    assert plan_slots(model, "cpu", 4096, False, None, plenty).slots == DEFAULT_SLOTS
    assert plan_slots(model, "cpu", 4096, False, None, plenty).context == 4096  # no -c: each keeps the default
    plan = plan_slots(model, "cpu", 4096, True, 4, plenty)
    assert (plan.slots, plan.context) == (4, 1024)  # -c given: the total, split as llama-server splits it
    for bad, words in ((0, "at least one slot"), (-2, "at least one slot")):
        with pytest.raises(ConfigError, match=words):
            plan_slots(model, "cpu", 4096, True, bad, plenty)
    small = int(per_token * 4096 * 2.5 / 0.9)  # two and a half default slots' worth
    shrunk = plan_slots(model, "cpu", 4096, False, None, small)
    assert shrunk.slots == 2 and "serving 2" in shrunk.note
    with pytest.raises(ConfigError) as refused:
        plan_slots(model, "cpu", 4096, False, 4, small)
    message = str(refused.value)
    assert "\n" not in message and "2 such slots fit" in message and "-np 2" in message, message
    with pytest.raises(ConfigError, match="leaves 16 tokens a slot"):
        plan_slots(model, "cpu", 64, True, 4, plenty)
    with pytest.raises(ConfigError, match="the cuda backend serves one sequence at a time"):
        plan_slots(model, "cuda", 4096, False, 2, plenty)
    assert plan_slots(model, "cuda", 4096, False, None, plenty).slots == 1


def test_gemma4_serves_one_slot_and_refuses_more_by_name(tmp_path):
    from outrider.io.gguf import GGUFFile
    from outrider.models import load_model

    model = load_model(GGUFFile(write_tiny_gemma4(tmp_path / "g4.gguf")))
    assert plan_slots(model, "cpu", 4096, False, None, 10 ** 12).slots == 1
    with pytest.raises(ConfigError, match="gemma4 model runs one sequence at a time; serve it with -np 1"):
        plan_slots(model, "cpu", 4096, False, 2, 10 ** 12)


def test_serve_np_0_is_a_one_line_error(tiny):
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny), "-np", "0"])
    assert result.exit_code == 1 and result.output.startswith("error: ") and "-np 0" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_server_loads_on_a_thread_that_ends_with_the_load():
    """What the load returns comes back, what it raises is raised again, and the thread it ran on is gone (with it
    the OpenMP pool its parallel ops made, which would otherwise sit beside the generation thread's)."""
    import torch

    from outrider.serve.engine import on_a_passing_thread

    where = {}

    def load():
        where["thread"] = threading.current_thread()
        return torch.ones(1 << 20).add(1).sum().item()

    assert on_a_passing_thread(load) == 2 * (1 << 20)
    assert where["thread"] is not threading.current_thread() and not where["thread"].is_alive()

    def broken():
        raise ValueError("no such model: pass a catalog name or a path")

    with pytest.raises(ValueError, match="no such model"):
        on_a_passing_thread(broken)
