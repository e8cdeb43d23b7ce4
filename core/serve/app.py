"""The HTTP side: Starlette routes, OpenAI's response and stream formats, errors as OpenAI's JSON.

Starlette + uvicorn, not FastAPI: the routes are eight and the request bodies are validated by
`requests.py` into Outrider's own types, so FastAPI's pydantic layer would only add a second schema to
keep in step. uvicorn is the ASGI server Starlette is developed against.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from outrider import __version__
from outrider.assembly import SAMPLING_SETTINGS, Assembly
from outrider.config import Config
from outrider.errors import OutriderError
from outrider.io.chat import chat_template_for
from outrider.io.tokenizer import TokenType
from outrider.serve.engine import (GenerationEngine, Job, Outcome, QueueFull, ShuttingDown, Stalled,
                                  acceptors_by_greediness, log)
from outrider.serve.metrics import ServerMetrics
from outrider.serve.requests import (APIError, ServerDefaults, chat_request, completion_request, detokenize_request,
                                     tokenize_request)
from outrider.spec.runner import GenerationStats

DEFAULT_QUEUE_SIZE = 16
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a whole 32k-token prompt is ~130 kB of JSON; an image is refused anyway
DEFAULT_MAX_CONNECTIONS = 64  # waiting clients (the queue, 16), streams, idle keep-alives and probes together
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
MAX_JSON_DEPTH = 64  # OpenAI bodies nest ~10 deep (a tool's JSON schema); deeper is a mistake or an attack


def _top_field(where: str) -> str | None:
    """The request field a path such as `messages[2].content` is under."""
    return where.split(".")[0].split("[")[0] or None


def checked_body(value: Any, where: str = "", depth: int = 0) -> None:
    """Raise a 400 naming the field for what JSON allows but a request cannot carry: nesting deeper than
    MAX_JSON_DEPTH, and strings that are not Unicode (a lone UTF-16 surrogate such as "\\ud800"). Numbers,
    booleans and nulls cannot be wrong at a depth that is allowed, so a prompt of token ids costs no path."""
    if depth > MAX_JSON_DEPTH:
        field = _top_field(where)
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels (in '{field}')", param=field)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"'{where or 'body'}' holds a string that is not valid Unicode (a lone surrogate "
                                "such as \\ud800); send UTF-8 text", param=_top_field(where)) from None
        return
    checked = lambda item: isinstance(item, (str, dict, list)) or depth + 1 > MAX_JSON_DEPTH
    if isinstance(value, dict):
        for key, item in value.items():
            checked_body(key, where or "body", depth + 1)
            if checked(item):
                checked_body(item, f"{where}.{key}" if where else str(key), depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if checked(item):
                checked_body(item, f"{where}[{i}]", depth + 1)


def llama_timings(stats: GenerationStats) -> dict[str, Any]:
    """llama-server's `timings` object (draft_n and draft_n_accepted always present, 0 without drafts),
    plus Outrider's per-position acceptance."""
    prompt_ms, predicted_ms = stats.prefill_s * 1e3, stats.decode_s * 1e3
    return {
        "prompt_n": stats.prompt_tokens,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / stats.prompt_tokens if stats.prompt_tokens else 0.0,
        "prompt_per_second": stats.prompt_tokens / prompt_ms * 1e3 if prompt_ms else 0.0,
        "predicted_n": stats.generated_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / stats.generated_tokens if stats.generated_tokens else 0.0,
        "predicted_per_second": stats.generated_tokens / predicted_ms * 1e3 if predicted_ms else 0.0,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        "draft_rounds": stats.rounds,  # verify rounds, with or without drafts
        "draft_n_accepted_per_pos": list(stats.accepted_at),
    }


def usage(outcome: Outcome) -> dict[str, int]:
    stats = outcome.stats
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": stats.prompt_tokens + outcome.completion_tokens}


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class _ClientGone(Exception):
    pass


class _Formatter:
    """OpenAI's shapes for one request: completion (`text_completion`) or chat (`chat.completion`)."""

    def __init__(self, chat: bool, model_id: str):
        self.chat, self.model_id = chat, model_id
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, choices: list, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id,
                "system_fingerprint": None, "choices": choices}

    def whole(self, text: str, outcome: Outcome) -> dict[str, Any]:
        choice = {"index": 0, "finish_reason": outcome.finish_reason, "logprobs": None}
        if outcome.stop_reason:
            choice["stop_reason"] = outcome.stop_reason
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        body = self._envelope([choice], chunk=False)
        body.update(usage=usage(outcome), timings=llama_timings(outcome.stats))
        return body

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, outcome: Outcome) -> dict:
        body = self._envelope([], chunk=True)
        body["usage"] = usage(outcome)
        return body


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def _as_api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, Stalled):
        return APIError(503, f"the server is stalled: {exc.reason}; it is failing requests until that generation "
                             "returns", type="server_error", code="stalled", headers={"Retry-After": "30"})
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), type="server_error", code="shutting_down")
    if isinstance(exc, OutriderError):
        return APIError(400, str(exc))
    # what failed is the server's business: the log has the traceback, the client an id to quote
    incident = uuid.uuid4().hex[:12]
    log.error("internal error %s", incident, exc_info=exc)
    return APIError(500, f"the server failed on this request (incident {incident}, in its log)", type="server_error")


def served_model_id(config: Config) -> str:
    return str(config["model"])


def key_check(api_keys: list[str] | None):
    """A check of a request's `Authorization: Bearer KEY` against `api_keys` (None or empty: every request
    passes), comparing the SHA-256 of the given key with every key's in constant time: digests of one length,
    so the answer's timing tells nothing about a key, its length included."""
    if any(not key.strip() for key in api_keys or []):
        raise OutriderError("an API key is empty: give every key some text, or none for a server without keys")
    keys = [hashlib.sha256(key.strip().encode()).digest() for key in api_keys or []]

    def check(request: Request) -> None:
        if not keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given_digest = hashlib.sha256(given.strip().encode(errors="replace")).digest()
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(key, given_digest)
        if scheme.lower() != "bearer" or not matched:
            raise APIError(401, "a valid API key is required: send Authorization: Bearer <key>",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check


def default_stall_timeout(context: int) -> float:
    """Long enough for a cold prefill of a whole context on a slow machine (10 tokens/s), at least 2 minutes."""
    return max(120.0, context / 10.0)


@dataclass
class ServerState:
    """What every handler reads, kept on `app.state.server`: the assembled runner's engine (with its
    metrics and queue), the request defaults, and the key check."""

    assembly: Assembly
    engine: GenerationEngine
    defaults: ServerDefaults
    authorized: Callable[[Request], None]
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_id(self) -> str:
        return self.defaults.model_id

    @property
    def metrics(self) -> ServerMetrics:
        return self.engine.metrics


def _server(request: Request) -> ServerState:
    return request.app.state.server


async def read_json(request: Request) -> Any:
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        # a web page may POST text/plain to 127.0.0.1 without asking first (no CORS preflight); JSON it may not
        raise APIError(415, f"send the body as JSON with Content-Type: application/json, not "
                            f"{media_type or 'no Content-Type'}", code="unsupported_media_type")
    limit = _server(request).max_body_bytes
    too_large = APIError(413, f"the request body is over {limit} bytes; send less, or start the server with a "
                              "larger --max-body-bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():  # a client gone mid-body raises ClientDisconnect: answered 499 below
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc}); send a JSON object with "
                            "Content-Type: application/json") from None
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    checked_body(body)
    return body


def enqueue(server: ServerState, generation) -> Job:
    job = Job(generation, asyncio.get_running_loop())
    try:
        server.engine.submit(job)
    except (Stalled, ShuttingDown) as exc:
        raise _as_api_error(exc) from None
    except QueueFull:
        wait = server.engine.retry_after_s()
        raise APIError(503, f"the server is busy ({server.engine.waiting} requests waiting, the queue holds "
                            f"{server.engine.queue_size}); retry in {wait} s", type="server_error", code="queue_full",
                       headers={"Retry-After": str(wait)}) from None
    return job


async def stream(job: Job, fmt: _Formatter, include_usage: bool):
    """The SSE events of one streamed generation, as the worker sends its text."""
    try:
        if fmt.chat:
            yield _sse(fmt.chunk("", role=True))
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield _sse(fmt.chunk(value))
            elif kind == "done":
                final = fmt.chunk(None if fmt.chat else "", finish_reason=value.finish_reason)
                if value.stop_reason:
                    final["choices"][0]["stop_reason"] = value.stop_reason
                final["timings"] = llama_timings(value.stats)
                yield _sse(final)
                if include_usage:
                    yield _sse(fmt.usage_chunk(value))
                yield _sse("[DONE]")
                return
            else:  # the response has started: the error goes in the stream, as OpenAI does
                yield _sse(_as_api_error(value).body())
                return
    finally:
        job.cancelled.set()  # a disconnect cancels this generator; the worker stops after this round


async def collect(job: Job, request: Request) -> tuple[str, Outcome]:
    """The whole text of a non-streamed generation; _ClientGone when the client hangs up meanwhile."""
    parts, checked = [], time.monotonic()
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                kind, value = None, None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:  # whether or not text keeps coming
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise _ClientGone
            if kind is None:
                continue
            if kind == "text":
                parts.append(value)
            elif kind == "done":
                return "".join(parts), value
            else:
                raise _as_api_error(value)
    finally:
        job.cancelled.set()


async def generate(request: Request, chat: bool) -> Response:
    server = _server(request)
    server.authorized(request)
    body = await read_json(request)
    assembly = server.assembly
    # off the event loop, as /tokenize: a long prompt takes a while to render and encode, and streams are
    # being served meanwhile
    if chat:
        generation = await asyncio.to_thread(chat_request, body, server.defaults, assembly.tokenizer, assembly.gguf)
    else:
        generation = await asyncio.to_thread(completion_request, body, server.defaults, assembly.tokenizer)
    job = enqueue(server, generation)
    fmt = _Formatter(chat, server.model_id)
    if generation.stream:
        return StreamingResponse(stream(job, fmt, generation.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(job.cancelled.set))
    try:
        text, outcome = await collect(job, request)
    except _ClientGone:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"
    return JSONResponse(fmt.whole(text, outcome))


async def completions(request: Request) -> Response:
    return await generate(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await generate(request, chat=True)


async def models(request: Request) -> Response:
    server = _server(request)
    server.authorized(request)
    plugins = {kind: spec.name for kind, spec in server.assembly.plugins.items()}
    return JSONResponse({"object": "list", "data": [
        {"id": server.model_id, "object": "model", "created": server.started, "owned_by": "outrider",
         "meta": {"context": server.defaults.context, "plugins": plugins}}]})


def _control_spelling(tokenizer, token_id: int) -> str | None:
    """A control token's text as llama-server writes it out (`<|im_start|>`); None for any other token."""
    return tokenizer.tokens[token_id] if tokenizer.token_type(token_id) == TokenType.CONTROL else None


def _piece(tokenizer, token_id: int) -> str | list[int]:
    """llama-server's piece of a token: its text, a control token's spelling, or the token's bytes as a list of
    numbers where they are not whole UTF-8 characters (part of an emoji)."""
    spelling = _control_spelling(tokenizer, token_id)
    if spelling is not None:
        return spelling
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _detokenize(tokenizer, ids: list[int]) -> str:
    """The text of `ids` as llama-server gives it: control tokens written out (generation's text drops them),
    everything else as generation decodes it."""
    decoder, parts = tokenizer.stream_decoder(), []
    for token_id in ids:
        spelling = _control_spelling(tokenizer, token_id)
        parts.append(decoder.push(token_id) if spelling is None else spelling)
    return "".join(parts) + decoder.flush()


async def tokenize(request: Request) -> Response:
    server = _server(request)
    server.authorized(request)
    asked = tokenize_request(await read_json(request))
    tokenizer = server.assembly.tokenizer
    # off the event loop: a 4 MiB body takes a while to tokenize, and streams are being served meanwhile
    special = None if asked.add_special else False  # BOS and EOS as the file asks, or none
    ids = await asyncio.to_thread(tokenizer.encode, asked.content, add_bos=special, add_eos=special,
                                  parse_special=asked.parse_special)
    if asked.with_pieces:
        return JSONResponse({"tokens": [{"id": i, "piece": _piece(tokenizer, i)} for i in ids]})
    return JSONResponse({"tokens": ids})


async def detokenize(request: Request) -> Response:
    server = _server(request)
    server.authorized(request)
    tokenizer = server.assembly.tokenizer
    ids = detokenize_request(await read_json(request), tokenizer.vocab_size)
    return JSONResponse({"content": await asyncio.to_thread(_detokenize, tokenizer, ids)})


async def props(request: Request) -> Response:
    """llama-server's GET /props: what its web UI and clients read to learn the context and the defaults."""
    server = _server(request)
    server.authorized(request)
    defaults, assembly = server.defaults, server.assembly
    tokenizer = assembly.tokenizer
    try:
        template = chat_template_for(assembly.gguf.metadata)
    except OutriderError:  # a model without one serves /v1/completions only
        template = ""
    special = lambda i: tokenizer.tokens[i] if i is not None else ""
    drafter = assembly.plugins.get("drafter")
    speculative = drafter is not None and drafter.name != "none"
    n_predict = -1 if defaults.max_tokens is None else defaults.max_tokens  # -1: llama-server's "the rest"
    params = {"n_predict": n_predict, "max_tokens": n_predict, "temperature": defaults.temperature,
              "top_k": defaults.top_k, "top_p": defaults.top_p, "min_p": defaults.min_p, "typical_p": 1.0,
              "repeat_penalty": defaults.repeat_penalty, "presence_penalty": defaults.presence_penalty,
              "frequency_penalty": defaults.frequency_penalty, "repeat_last_n": defaults.repeat_last_n, "mirostat": 0,
              # no `samplers`: a request that sends it is refused (llama.cpp's order is not Outrider's), so a client
              # that echoes these settings back must not find it here
              "seed": -1 if defaults.seed is None else defaults.seed, "stop": [], "stream": False}
    return JSONResponse({
        "default_generation_settings": {"id": 0, "n_ctx": defaults.context, "speculative": speculative,
                                        "params": params},
        "total_slots": server.engine.n_slots,  # generations at once (-np); n_ctx is each one's context
        "model_alias": server.model_id,
        "model_path": str(assembly.gguf.path),
        "modalities": {"vision": False, "audio": False},
        "chat_template": template,
        "bos_token": special(tokenizer.bos_id),
        "eos_token": special(tokenizer.eos_id),
        "build_info": f"outrider {__version__}",
    })


async def health(request: Request) -> Response:
    engine = _server(request).engine
    reason = engine.stalled  # read once: the worker may come back meanwhile
    if reason:  # a supervisor restarts the process on this
        return JSONResponse({"status": "stalled", "reason": reason, "waiting": engine.waiting},
                            status_code=503)
    return JSONResponse({"status": "ok", "waiting": engine.waiting})


async def metrics_page(request: Request) -> Response:
    metrics = _server(request).metrics
    return Response(metrics.exposition(), headers={"Content-Type": metrics.content_type})


async def api_error(request: Request, exc: APIError) -> Response:
    return _error_response(exc)


async def http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                    type=kind, headers=dict(exc.headers or {})))


async def server_error(request: Request, exc: Exception) -> Response:
    return _error_response(_as_api_error(exc))


async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
    # it hung up while its body was being read: nothing to answer, nothing to log but the count
    server = _server(request)
    server.metrics.request_success.labels(server.model_id, "abort").inc()
    return Response(status_code=499)


@contextlib.asynccontextmanager
async def lifespan(app: Starlette):
    engine = app.state.server.engine
    engine.start()
    try:
        yield
    finally:
        await asyncio.to_thread(engine.stop)


ROUTES = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),  # llama-server's own routes, as it answers them
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/props", props, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics_page, methods=["GET"]),
]
EXCEPTION_HANDLERS = {APIError: api_error, HTTPException: http_error, ClientDisconnect: client_gone,
                      Exception: server_error}


def create_app(assembly: Assembly, config: Config, queue_size: int = DEFAULT_QUEUE_SIZE,
               api_keys: list[str] | None = None, stall_timeout: float | None = None,
               request_timeout: float | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               special_in_messages: bool = False, slots: int = 1) -> Starlette:
    """An ASGI app over an assembled runner; `config` gives the defaults for what requests leave out. With
    `api_keys`, every /v1 route and /tokenize, /detokenize, /props require one of them as a bearer token;
    /health and /metrics stay open. A request that leaves `max_tokens` out gets the rest of the context unless
    `config`'s max_tokens was set (a flag, the environment, a file) rather than left at its default.
    `stall_timeout` (None: default_stall_timeout; 0: off) fails a generation that makes no progress for that
    long; `request_timeout` ends one that runs longer, with its text so far (finish_reason "length",
    stop_reason "timeout"). A request body over `max_body_bytes` is answered 413 before it is read whole.
    A control token's text inside a chat message is plain text unless `special_in_messages`. `slots`: generations
    run at once (continuous batching), each in the runner's context (`Runner.set_slots`, done by the caller)."""
    model_id = served_model_id(config)
    # the setting's default (128) suits a command line; a server's client that names no limit expects the rest
    # of the context (OpenAI, vLLM), an operator who set one gets it (llama-server's -n)
    max_tokens = None if config.sources.get("max_tokens", "default") == "default" else config["max_tokens"]
    defaults = ServerDefaults(model_id=model_id, context=assembly.runner.context, max_tokens=max_tokens,
                              special_in_messages=special_in_messages,
                              **{name: config[name] for name in SAMPLING_SETTINGS})
    metrics = ServerMetrics(model_id)
    if stall_timeout is None:
        stall_timeout = default_stall_timeout(assembly.runner.context)
    engine = GenerationEngine(assembly, acceptors_by_greediness(assembly, config["acceptor"]), metrics, queue_size,
                              stall_timeout=stall_timeout or None, request_timeout=request_timeout or None,
                              slots=slots)
    app = Starlette(routes=ROUTES, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.state.server = ServerState(assembly, engine, defaults, key_check(api_keys), max_body_bytes)
    return app


def uvicorn_config(app: Starlette, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info",
                   max_connections: int = DEFAULT_MAX_CONNECTIONS):
    """How the app is served: past `max_connections` open connections uvicorn answers 503 at once, so idle or
    slow clients cannot take every socket and thread."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                          limit_concurrency=max_connections)


def run_server(app: Starlette, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info",
               max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
    import uvicorn

    uvicorn.Server(uvicorn_config(app, host, port, log_level, max_connections)).run()
