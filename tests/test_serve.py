"""`outrider serve` on a loopback port with the real SmolLM2, driven by the official `openai` client.

The model is assembled once for the module and served by uvicorn in a thread. Oracles: the CLI's output
for the same seed and settings (a separate assembly), each request's answer when it runs alone, the
server's own responses' `timings` for its /metrics counters (parsed with prometheus_client's parser).
Token budgets are small: every generation here is a few dozen tokens at most.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from outrider.assembly import assemble  # noqa: E402
from outrider.cli import main  # noqa: E402
from outrider.config import resolve_config  # noqa: E402
from outrider.serve import create_app  # noqa: E402

CONTEXT = 512
QUEUE_SIZE = 2
ECHO_PROMPT = ("Copy this text exactly: The meeting is on Monday at 10 am in room 204. Please bring your laptop.\n"
               "Copy: The meeting is on Monday")


class Server:
    def __init__(self, model_path):
        config = resolve_config({"model": str(model_path), "context": CONTEXT, "max_tokens": 8})
        self.app = create_app(assemble(config), config, queue_size=QUEUE_SIZE)
        self.model_id = self.app.state.model_id
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=300)

    def stop(self):
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        with urllib.request.urlopen(self.base + "/metrics") as response:
            text = response.read().decode()
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def wait_idle(self, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m[("outrider:num_requests_running", ())] == 0 and m[("outrider:num_requests_waiting", ())] == 0:
                return m
            assert time.monotonic() < deadline, "the server did not become idle"
            time.sleep(0.05)

    def post(self, path: str, body: bytes, method="POST") -> tuple[int, dict, dict]:
        request = urllib.request.Request(self.base + path, data=body, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request) as response:
                return response.status, dict(response.headers), json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), json.loads(error.read())


@pytest.fixture(scope="module")
def server(smollm2_path):
    s = Server(smollm2_path)
    yield s
    s.stop()


def complete(server, stream=False, **kwargs):
    """(text, finish_reason, timings, usage) of one completion, streamed or not."""
    kwargs.setdefault("model", server.model_id)
    if not stream:
        r = server.client.completions.create(**kwargs)
        extra = r.model_extra
        return r.choices[0].text, r.choices[0].finish_reason, extra["timings"], r.usage
    pieces, finish, timings, usage, chunks = [], None, None, None, 0
    for chunk in server.client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.choices:
            chunks += 1
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
            timings = (chunk.model_extra or {}).get("timings", timings)
        if chunk.usage:
            usage = chunk.usage
    assert chunks > 2  # really streamed: more than a role/first chunk and a final one
    return "".join(pieces), finish, timings, usage


def chat(server, stream=False, **kwargs):
    kwargs.setdefault("model", server.model_id)
    if not stream:
        r = server.client.chat.completions.create(**kwargs)
        assert r.choices[0].message.role == "assistant"
        return r.choices[0].message.content, r.choices[0].finish_reason, r.model_extra["timings"], r.usage
    pieces, finish, timings = [], None, None
    for chunk in server.client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        pieces.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
        timings = (chunk.model_extra or {}).get("timings", timings)
    return "".join(pieces), finish, timings, None


def cli_text(model_path, *args) -> str:
    from click.testing import CliRunner

    result = CliRunner().invoke(main, ["generate", "--model", str(model_path), "--json", *map(str, args)])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])["text"]


# -- answers ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_echo(server, smollm2_path):
    """The greedy completion of ECHO_PROMPT, non-streamed and streamed, and the CLI's."""
    settings = dict(prompt=ECHO_PROMPT, max_tokens=16, temperature=0)
    whole, streamed = complete(server, **settings), complete(server, stream=True, **settings)
    cli = cli_text(smollm2_path, "-n", 16, "-t", 0, ECHO_PROMPT)
    return whole, streamed, cli


def test_completion_streamed_equals_whole_equals_cli(greedy_echo):
    (text, finish, timings, usage), (s_text, s_finish, s_timings, s_usage), cli = greedy_echo
    assert text and text == s_text == cli
    assert finish == s_finish == "length"
    assert usage.completion_tokens == s_usage.completion_tokens == timings["predicted_n"] == 16
    assert usage.prompt_tokens == timings["prompt_n"] and usage.total_tokens == usage.prompt_tokens + 16
    assert timings["draft_n"] > 0 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    # draft_n may differ: --draft-max auto chooses from verify times measured so far (same text either way)
    assert (timings["prompt_n"], timings["predicted_n"]) == (s_timings["prompt_n"], s_timings["predicted_n"])


def test_chat_sampled_streamed_equals_whole_equals_cli(server, smollm2_path):
    # the server was started at temperature 0; this request's 0.8 must switch to the sampled acceptor
    message = "Name three colours."
    settings = dict(messages=[{"role": "user", "content": message}], max_tokens=12, temperature=0.8, top_p=0.9,
                    seed=7, extra_body={"top_k": 40})
    text, finish, timings, usage = chat(server, **settings)
    s_text, s_finish, s_timings, _ = chat(server, stream=True, **settings)
    cli = cli_text(smollm2_path, "--chat", "-n", 12, "-t", 0.8, "--top-p", 0.9, "--top-k", 40, "--seed", 7, message)
    assert text and text == s_text == cli
    assert usage.completion_tokens == timings["predicted_n"] == s_timings["predicted_n"]
    other = chat(server, **{**settings, "seed": 8})[0]
    assert other != text  # the seed is the request's, not the server's


def test_stop_string_cuts_both_the_whole_and_the_streamed_text(server, greedy_echo):
    full = greedy_echo[0][0]
    stop = full[len(full) // 2:][:4]  # a piece of the second half: generation must stop just before it
    expected = full[: full.index(stop)]
    settings = dict(prompt=ECHO_PROMPT, max_tokens=16, temperature=0, stop=["never appears", stop])
    text, finish, _, usage = complete(server, **settings)
    s_text, s_finish, _, _ = complete(server, stream=True, **settings)
    assert text == s_text == expected
    assert finish == s_finish == "stop"
    assert usage.completion_tokens < 16


def test_concurrent_clients_get_their_own_answers(server):
    prompts = ["The cat sat on", "My favourite food is", "In 1492, Columbus"]
    requests = [dict(prompt=p, max_tokens=6, temperature=0.9, seed=i) for i, p in enumerate(prompts)]
    alone = [complete(server, **r)[0] for r in requests]
    with ThreadPoolExecutor(len(requests)) as pool:  # queue size 2 + the one generating: nobody is refused
        together = list(pool.map(lambda r: complete(server, **r)[0], requests))
    assert together == alone
    assert len(set(alone)) == len(alone)


# -- the queue and disconnects ------------------------------------------------------------------------


LONG = dict(prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", max_tokens=400, temperature=0)


def test_a_disconnect_stops_the_generation_and_frees_the_server(server):
    before = server.wait_idle()
    stream = server.client.completions.create(model=server.model_id, stream=True, **LONG)
    next(iter(stream))
    stream.close()
    after = server.wait_idle(timeout=60)  # 400 tokens would take far longer at this machine's speed
    assert after[("outrider:request_success_total", (("finished_reason", "abort"),))] == \
        before.get(("outrider:request_success_total", (("finished_reason", "abort"),)), 0) + 1
    generated = after[("outrider:generation_tokens_total", ())] - before[("outrider:generation_tokens_total", ())]
    assert 1 <= generated < 100
    assert complete(server, prompt="Hello", max_tokens=2)[1] == "length"  # and the next request is served


def test_a_full_queue_answers_503_with_retry_after(server):
    server.wait_idle()
    streams = [server.client.completions.create(model=server.model_id, stream=True, **LONG)
               for _ in range(QUEUE_SIZE + 1)]  # one generating, QUEUE_SIZE waiting
    try:
        with pytest.raises(openai.APIStatusError) as refused:
            server.client.completions.create(model=server.model_id, prompt="hi", max_tokens=2)
        assert refused.value.status_code == 503
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert refused.value.body["code"] == "queue_full"
    finally:
        for stream in reversed(streams):
            stream.close()
    server.wait_idle()


# -- bad requests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/completions", b"{not json", 400, None, None),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature", None),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "5"}', 400, "max_tokens", None),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens", None),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000}', 400, "max_tokens", None),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 0}', 400, "top_p", None),
    ("/v1/completions", b'{"prompt": "hi", "seed": -1}', 400, "seed", None),
    ("/v1/completions", b'{"prompt": "hi", "stop": 5}', 400, "stop", None),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400, "stream", None),
    ("/v1/completions", b'{"prompt": "hi", "n": 2}', 400, "n", None),
    ("/v1/completions", b'{"prompt": 7}', 400, "prompt", None),
    ("/v1/completions", b'{"prompt": "hi", "model": "gpt-4"}', 404, "model", "model_not_found"),
    ("/v1/completions", ('{"prompt": "%s"}' % ("hello " * 600)).encode(), 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages", None),
    ("/v1/chat/completions", ('{"messages": [{"role": "user", "content": "%s"}]}' % ("hello " * 600)).encode(),
     400, "messages", "context_length_exceeded"),
])
def test_a_bad_request_gets_openai_error_json(server, path, body, status, param, code):
    got, _, answer = server.post(path, body)
    assert got == status, answer
    error = answer["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code


def test_wrong_method_and_path_get_error_json_and_the_client_raises(server):
    assert server.post("/v1/completions", None, method="GET")[0] == 405
    assert server.post("/v1/nothing", b"{}")[0] == 404
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=-3)


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list()] == [server.model_id]
    with urllib.request.urlopen(server.base + "/health") as response:
        assert json.loads(response.read())["status"] == "ok"


# -- metrics ------------------------------------------------------------------------------------------


def test_metrics_counters_equal_the_sum_of_the_responses_timings(server):
    before = server.wait_idle()
    results = [complete(server, prompt=ECHO_PROMPT, max_tokens=10, temperature=0),
               complete(server, stream=True, prompt=ECHO_PROMPT + " at 10", max_tokens=10, temperature=0),
               chat(server, messages=[{"role": "user", "content": ECHO_PROMPT}], max_tokens=10, temperature=0)]
    after = server.wait_idle()
    timings = [r[2] for r in results]

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    accepted = sum(t["draft_n_accepted"] for t in timings)
    assert accepted > 0  # the echo prompt makes lookup's drafts land
    assert delta("outrider:spec_decode_num_accepted_tokens_total") == accepted
    assert delta("outrider:spec_decode_num_draft_tokens_total") == sum(t["draft_n"] for t in timings)
    assert delta("outrider:generation_tokens_total") == sum(t["predicted_n"] for t in timings)
    assert delta("outrider:prompt_tokens_total") == sum(t["prompt_n"] for t in timings)
    deepest = max(len(t["draft_n_accepted_per_pos"]) for t in timings)
    per_pos = [sum(t["draft_n_accepted_per_pos"][j] for t in timings if j < len(t["draft_n_accepted_per_pos"]))
               for j in range(deepest)]
    for j, count in enumerate(per_pos):
        assert delta("outrider:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(j)),)) == count
    assert delta("outrider:e2e_request_latency_seconds_count") == 3
    assert delta("outrider:time_to_first_token_seconds_count") == 3
