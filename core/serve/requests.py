"""OpenAI request bodies -> what one generation needs, or an `APIError` naming the bad field.

Settings a request leaves out take the server's (`outrider serve --temp 0.7 ...`), except `max_tokens`: left out
it is the rest of the context, as OpenAI and vLLM answer, unless the server was started with an explicit
--max-tokens (llama-server's `-n`). llama-server's `min_p`, `repeat_penalty`, `repeat_last_n` and the
presence and frequency penalties (OpenAI's too) are implemented (`outrider.spec.sampling`,
`outrider.spec.penalties`). Fields OpenAI or llama-server define but Outrider does not implement (n > 1,
logprobs, logit_bias, tools, llama-server's other samplers) are refused rather than ignored unless set to the
value that turns them off, and so is a field neither defines, so a client never gets something other than what
it asked for without knowing. A temperature below `outrider.spec.sampling.GREEDY_BELOW` is greedy
(SamplingParams).
"""

from __future__ import annotations

import json
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
                 "store", "service_tier", "n_predict", "cache_prompt", "min_p", "repeat_penalty", "repeat_last_n"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "logprobs", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                               "functions", "tool_choice", "function_call", "parallel_tool_calls",
                               "response_format"}
# llama-server's sampling and slot fields that Outrider does not implement (its web UI sends most of them on
# every request): each with the values that turn it off, which are accepted, since then the answer is the one
# asked for. A field that only tunes another (`dry_base` under `dry_multiplier`) maps to (): accepted, because
# whatever it says changes nothing while the field it tunes is off, and that one is refused when on.
LLAMA_SERVER_FIELDS: dict[str, tuple] = {
    "typical_p": (1, 1.0), "top_n_sigma": (-1, -1.0), "min_keep": (0, 1), "penalize_nl": (False,),
    "dry_multiplier": (0, 0.0), "dry_base": (), "dry_allowed_length": (), "dry_penalty_last_n": (),
    "dry_sequence_breakers": (), "xtc_probability": (0, 0.0), "xtc_threshold": (),
    "dynatemp_range": (0, 0.0), "dynatemp_exponent": (), "mirostat": (0,), "mirostat_tau": (), "mirostat_eta": (),
    # llama.cpp's default order puts temperature last, Outrider's (Hugging Face's) first: refused in any order
    "samplers": (None,),
    "grammar": ("",), "json_schema": ({},), "ignore_eos": (False,), "n_probs": (0,), "post_sampling_probs": (False,),
    "n_keep": (0, -1), "n_indent": (0,), "t_max_predict_ms": (0,), "id_slot": (-1, 0), "lora": ([],),
    "timings_per_token": (False,), "return_tokens": (False,), "return_progress": (False,),
    "response_fields": ([],), "reasoning_format": ("none",), "chat_template_kwargs": ({},),
    "backend_sampling": (False,),
}
# Why a llama-server field is refused, said in its 400: none of these samplers is one of Outrider's warpers
# (temperature, top-k, top-p, min-p) or penalties (repeat, presence, frequency), and the rest ask for what a
# server of one sequence with text answers does not do.
NOT_IMPLEMENTED_BECAUSE = {
    "typical_p": "locally typical sampling is not one of Outrider's samplers",
    "top_n_sigma": "top-n-sigma is not one of Outrider's samplers",
    "min_keep": "Outrider's filters keep at least the most probable token, no more",
    "penalize_nl": "a newline is penalised like any other token, as llama.cpp now does",
    "dry_multiplier": "the DRY repetition penalty is not one of Outrider's penalties",
    "xtc_probability": "XTC sampling is not one of Outrider's samplers",
    "dynatemp_range": "dynamic temperature is not one of Outrider's samplers",
    "mirostat": "mirostat sampling is not one of Outrider's samplers",
    "samplers": "llama.cpp's order applies temperature last; Outrider's is fixed: temperature, top-k, top-p, min-p",
    "grammar": "constrained decoding is not implemented",
    "json_schema": "constrained decoding is not implemented",
    "ignore_eos": "a generation always ends at an end-of-generation token",
    "n_probs": "token probabilities are not returned",
    "post_sampling_probs": "token probabilities are not returned",
    "n_keep": "context shifting is not implemented",
    "lora": "LoRA adapters are not implemented",
}


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
    max_tokens: int | None  # None: the rest of the context
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    special_in_messages: bool = False  # --allow-special-in-messages: a control token's text in a message is that token


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
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]" if math.isfinite(high) \
            else f"{'>' if low_open else '>='} {low:g}"
        raise _bad(name, f"'{name}' must be in {bounds}, got {value!r}")
    return value


def _is_one_of(value: Any, allowed: tuple) -> bool:
    """`value` is one of `allowed`, type included (True is not 1, 1.0 is not 1)."""
    return any(value is a or (type(value) is type(a) and value == a) for a in allowed)


def _unsupported(body: dict, name: str, allowed: tuple) -> None:
    value = body.get(name)
    if not _is_one_of(value, allowed):
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


def _max_tokens(body: dict, defaults: ServerDefaults, prompt_ids: list[int], names: tuple[str, ...]) -> int:
    rest = defaults.context - len(prompt_ids)
    given = [name for name in names if body.get(name) is not None]
    asked = _number(body, given[0], None, 1, defaults.context, integer=True) if given else None
    n_predict = body.get("n_predict")  # llama-server's name; -1 is its "until the context is full"
    if n_predict is not None:
        if n_predict != -1 or isinstance(n_predict, bool):
            n_predict = _number(body, "n_predict", None, 1, defaults.context, integer=True)
        n_predict = rest if n_predict == -1 else n_predict
        if asked is not None and min(asked, rest) != min(n_predict, rest):
            raise _bad("n_predict", f"'n_predict' and '{given[0]}' disagree; send one of them")
        asked = n_predict
    if asked is None:
        asked = rest if defaults.max_tokens is None else defaults.max_tokens
    return min(asked, rest)


def _common(body: Any, defaults: ServerDefaults, prompt_ids: list[int], max_tokens_names: tuple[str, ...]):
    try:
        params = SamplingParams(
            temperature=float(_number(body, "temperature", defaults.temperature, 0, 2)),
            top_p=float(_number(body, "top_p", defaults.top_p, 0, 1, low_open=True)),
            top_k=_number(body, "top_k", defaults.top_k, 0, math.inf, integer=True),
            seed=_number(body, "seed", defaults.seed, 0, 2**63 - 1, integer=True),
            min_p=float(_number(body, "min_p", defaults.min_p, 0, 1)),
            repeat_penalty=float(_number(body, "repeat_penalty", defaults.repeat_penalty, 0, math.inf,
                                         low_open=True)),
            # OpenAI's range; llama-server takes any number, but past 2 a penalty is a ban
            presence_penalty=float(_number(body, "presence_penalty", defaults.presence_penalty, -2, 2)),
            frequency_penalty=float(_number(body, "frequency_penalty", defaults.frequency_penalty, -2, 2)),
            repeat_last_n=_number(body, "repeat_last_n", defaults.repeat_last_n, -1, math.inf, integer=True))
    except OutriderError as exc:  # the checks above should catch everything; this keeps a 400 a 400
        raise _bad("temperature", str(exc)) from None
    _number(body, "n", 1, 1, 1, integer=True)
    _unsupported(body, "logit_bias", (None, {}))
    _flag(body, "cache_prompt", True)  # one sequence is served: its cache is always the prompt's
    stream = _flag(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise _bad("stream_options", "'stream_options' must be an object like {\"include_usage\": true}")
    if len(prompt_ids) >= defaults.context:
        raise APIError(400, f"This model's maximum context length is {defaults.context} tokens, but the prompt is "
                            f"{len(prompt_ids)} tokens; shorten the prompt or start the server with a larger "
                            "--context", param="messages" if "messages" in body else "prompt",
                       code="context_length_exceeded")
    max_tokens = _max_tokens(body, defaults, prompt_ids, max_tokens_names)
    return GenerationRequest(prompt_ids, max_tokens, params, _stop_strings(body), stream,
                             bool(options.get("include_usage", False)))


def _object(body: Any, fields: set[str], llama_fields: dict[str, tuple] = LLAMA_SERVER_FIELDS) -> dict:
    if not isinstance(body, dict):
        raise _bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    for name in sorted(set(body) & set(llama_fields)):
        off, value = llama_fields[name], body[name]
        if off and not _is_one_of(value, off + (None,)):
            hint = f"leave it out or send {json.dumps(off[0])} (off)" if off[0] is not None else "leave it out"
            because = f" ({NOT_IMPLEMENTED_BECAUSE[name]})" if name in NOT_IMPLEMENTED_BECAUSE else ""
            raise _bad(name, f"'{name}' = {json.dumps(value)[:80]} is a llama-server field Outrider does not "
                             f"implement{because}; {hint}")
    unknown = sorted(set(body) - fields - set(llama_fields))
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
        ids = chat_prompt_ids(gguf, tokenizer, rendered, special_in_messages=defaults.special_in_messages)
    except OutriderError as exc:
        raise _bad("messages", str(exc)) from None
    return _common(body, defaults, ids, ("max_completion_tokens", "max_tokens"))


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"'{name}' must be true or false, got {json.dumps(value)[:80]}")
    return value


@dataclass(frozen=True)
class TokenizeRequest:
    content: str
    add_special: bool  # BOS (and EOS) as the model's file asks
    parse_special: bool  # control tokens written in the text are those tokens
    with_pieces: bool


def tokenize_request(body: Any) -> TokenizeRequest:
    """POST /tokenize, llama-server's fields and defaults."""
    body = _object(body, {"content", "add_special", "parse_special", "with_pieces"}, {})
    content = body.get("content")
    if not isinstance(content, str):
        raise _bad("content", f"'content' must be a string, got {json.dumps(content)[:80]}")
    return TokenizeRequest(content, _flag(body, "add_special", False), _flag(body, "parse_special", True),
                           _flag(body, "with_pieces", False))


def detokenize_request(body: Any, vocab_size: int) -> list[int]:
    """POST /detokenize: {"tokens": [ids]}, each in the vocabulary."""
    body = _object(body, {"tokens"}, {})
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                                               for t in tokens):
        raise _bad("tokens", f"'tokens' must be a list of token ids in [0, {vocab_size}), got "
                             f"{json.dumps(tokens)[:80]}")
    return tokens
