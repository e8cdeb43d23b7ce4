"""OpenAI request bodies -> what one generation needs, or an `APIError` naming the bad field.

Settings a request leaves out take the server's (`outrider serve -t 0.7 ...`); fields OpenAI defines but
Outrider does not implement (n > 1, logprobs, logit_bias, penalties, tools) are refused rather than ignored,
and so is a field neither OpenAI nor llama-server defines, so a client never gets something other than
what it asked for without knowing. A temperature below `outrider.spec.sampling.GREEDY_BELOW` is greedy (SamplingParams).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from outrider.errors import OutriderError
from outrider.io.chat import prompt_ids as chat_prompt_ids
from outrider.spec.sampling import SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
# Fields a request may carry. Implemented, or refused below with their own message when set to what is not
# implemented; `user`, `metadata`, `store` and `service_tier` change nothing a server computes.
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stream",
                 "stream_options", "frequency_penalty", "presence_penalty", "logit_bias", "user", "metadata",
                 "store", "service_tier"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "logprobs", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                               "functions", "tool_choice", "function_call", "parallel_tool_calls",
                               "response_format"}


class APIError(Exception):
    """An error answered as OpenAI's JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServerDefaults:
    """What a request gets for the settings it leaves out: the server's resolved config."""

    model_id: str
    context: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def _number(body: dict, name: str, default, low: float, high: float, *, integer: bool = False,
            low_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    is_kind = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not is_kind or not math.isfinite(value):
        raise _bad(name, f"'{name}' must be {kind}, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
        raise _bad(name, f"'{name}' must be in {bounds}, got {value!r}")
    return value


def _unsupported(body: dict, name: str, allowed: tuple) -> None:
    value = body.get(name)
    if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
        raise _bad(name, f"'{name}' = {value!r} is not supported by this server; leave it out")


def _check_model(body: dict, defaults: ServerDefaults) -> None:
    model = body.get("model")
    if model is None:
        return  # like llama-server: a request without a model gets the one being served
    if not isinstance(model, str):
        raise _bad("model", f"'model' must be a string, got {model!r}")
    if model != defaults.model_id:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{defaults.model_id}' "
                            "(GET /v1/models)", param="model", code="model_not_found")


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", f"'stop' must be a string or a list of strings, got {stop!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    return [s for s in stops if s]


def _common(body: Any, defaults: ServerDefaults, prompt_ids: list[int], max_tokens_names: tuple[str, ...]):
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = _number(body, name, None, 1, defaults.context, integer=True)
            break
    else:
        max_tokens = defaults.max_tokens
    try:
        params = SamplingParams(
            temperature=float(_number(body, "temperature", defaults.temperature, 0, 2)),
            top_p=float(_number(body, "top_p", defaults.top_p, 0, 1, low_open=True)),
            top_k=_number(body, "top_k", defaults.top_k, 0, math.inf, integer=True),
            seed=_number(body, "seed", defaults.seed, 0, 2**63 - 1, integer=True))
    except OutriderError as exc:  # the checks above should catch everything; this keeps a 400 a 400
        raise _bad("temperature", str(exc)) from None
    _number(body, "n", 1, 1, 1, integer=True)
    for name in ("frequency_penalty", "presence_penalty"):
        _unsupported(body, name, (None, 0, 0.0))
    _unsupported(body, "logit_bias", (None, {}))
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream", f"'stream' must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise _bad("stream_options", "'stream_options' must be an object like {\"include_usage\": true}")
    if len(prompt_ids) >= defaults.context:
        raise APIError(400, f"This model's maximum context length is {defaults.context} tokens, but the prompt is "
                            f"{len(prompt_ids)} tokens; shorten the prompt or start the server with a larger "
                            "--context", param="messages" if "messages" in body else "prompt",
                       code="context_length_exceeded")
    return GenerationRequest(prompt_ids, max_tokens, params, _stop_strings(body), stream,
                             bool(options.get("include_usage", False)))


def _object(body: Any, fields: set[str]) -> dict:
    if not isinstance(body, dict):
        raise _bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise _bad(unknown[0], f"unknown field '{unknown[0]}'; this endpoint takes {', '.join(sorted(fields))}")
    return body


def completion_request(body: Any, defaults: ServerDefaults, tokenizer) -> GenerationRequest:
    """POST /v1/completions: `prompt` is a string or a list of token ids (a batch of one is accepted)."""
    body = _object(body, COMPLETION_FIELDS)
    _check_model(body, defaults)
    _unsupported(body, "echo", (None, False))
    _unsupported(body, "logprobs", (None,))
    _unsupported(body, "suffix", (None, ""))
    _unsupported(body, "best_of", (None, 1))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        prompt_ids = tokenizer.encode(prompt)  # the completions endpoint's raw text, BOS first
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tokenizer.vocab_size for t in prompt)):
        prompt_ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise _bad("prompt", "batched prompts are not supported; send one prompt per request")
    else:
        raise _bad("prompt", "'prompt' must be a string or a non-empty list of token ids in "
                             f"[0, {tokenizer.vocab_size}), got {str(prompt)[:80]!r}")
    if not prompt_ids:
        raise _bad("prompt", "the prompt is empty and the model adds no BOS token; give a non-empty prompt")
    return _common(body, defaults, prompt_ids, ("max_tokens",))


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise _bad("messages", f"messages[{index}].content: only text parts are supported")
        return "".join(p["text"] for p in content)
    raise _bad("messages", f"messages[{index}].content must be a string or a list of text parts")


def chat_request(body: Any, defaults: ServerDefaults, tokenizer, gguf) -> GenerationRequest:
    """POST /v1/chat/completions: `messages` rendered with the model's chat template."""
    body = _object(body, CHAT_FIELDS)
    _check_model(body, defaults)
    _unsupported(body, "logprobs", (None, False))
    _unsupported(body, "top_logprobs", (None,))  # only with logprobs, which is refused above
    for name in ("tools", "functions"):
        _unsupported(body, name, (None, []))
    for name in ("tool_choice", "function_call"):
        _unsupported(body, name, (None, "none"))
    _unsupported(body, "parallel_tool_calls", (None, True, False))
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise _bad("response_format", "only response_format {\"type\": \"text\"} is supported")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", f"'messages' must be a non-empty list of {{role, content}} objects, got {messages!r}")
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise _bad("messages", f"messages[{i}] must be an object with a role in {sorted(CHAT_ROLES)}")
        role = "system" if message["role"] == "developer" else message["role"]
        rendered.append({"role": role, "content": _message_text(message.get("content"), i)})
    try:
        ids = chat_prompt_ids(gguf, tokenizer, rendered)
    except OutriderError as exc:
        raise _bad("messages", str(exc)) from None
    return _common(body, defaults, ids, ("max_completion_tokens", "max_tokens"))
