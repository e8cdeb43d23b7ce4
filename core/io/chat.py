"""Chat prompts: a list of messages rendered into the text a model was trained on.

The template is the file's `tokenizer.chat_template` (Jinja), rendered the way Hugging Face transformers renders
it, so prompts match the model card. Files without one (Gemma GGUFs often lack it) fall back to a built-in
template chosen by architecture.

The rendered text may begin with the BOS token's text (Gemma's does); `Tokenizer.encode` with its default
`add_bos=None` then does not add a second one.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from outrider.errors import ModelFileError, OutriderError
from outrider.io.tokenizer import TokenType

if TYPE_CHECKING:
    from outrider.io.gguf import GGUFFile
    from outrider.io.tokenizer import Tokenizer

# Gemma's official template for text-only conversations: the system message, if any, opens the first user
# turn; the assistant's role is called "model".
_GEMMA_TEMPLATE = r"""{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

BUILTIN_TEMPLATES = {"gemma": _GEMMA_TEMPLATE, "gemma2": _GEMMA_TEMPLATE, "gemma3": _GEMMA_TEMPLATE}


def chat_template_for(metadata: dict[str, Any]) -> str:
    """The file's chat template, else the built-in one for its architecture."""
    template = metadata.get("tokenizer.chat_template")
    if template:
        return str(template)
    architecture = str(metadata.get("general.architecture", ""))
    if architecture in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[architecture]
    raise ModelFileError("this model has no chat template; run without --chat")


def apply_chat_template(gguf_file_or_metadata: GGUFFile | dict[str, Any], tokenizer: Tokenizer,
                        messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Render `messages` ([{"role": "user", "content": "hi"}, ...]) into prompt text.

    add_generation_prompt: end with the opening of an assistant turn, so the model answers next.
    """
    metadata = getattr(gguf_file_or_metadata, "metadata", gguf_file_or_metadata)
    template = _compile(chat_template_for(metadata))
    try:
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=_token_text(tokenizer, tokenizer.bos_id),
            eos_token=_token_text(tokenizer, tokenizer.eos_id),
        )
    except jinja2.TemplateError as error:  # raise_exception(...) in the template, or a bad message shape
        raise OutriderError(f"the chat template rejected the conversation: {error}") from None


def prompt_ids(gguf_file_or_metadata: GGUFFile | dict[str, Any], tokenizer: Tokenizer,
               prompt: str | list[dict], chat: bool = True, special_in_messages: bool = True) -> list[int]:
    """The token ids the model reads for `prompt`: with `chat`, the messages (a string is one user message)
    rendered by the chat template, then encoded as they are (the template writes any BOS itself); without,
    the text encoded with the tokenizer's own BOS. The one place the CLI, the server, bench and distill
    turn a prompt into ids. A model without a chat template raises ModelFileError.

    special_in_messages: a control token's spelling written inside a message (`<|im_start|>`) is that token,
    as when the whole rendered text is encoded; when False it is plain text, and only what the template
    itself writes becomes control tokens (the server's default: a client must not forge another role)."""
    if not chat:
        if not isinstance(prompt, str):
            raise OutriderError("a list of messages needs the chat template; run with --chat")
        return tokenizer.encode(prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    spellings = [] if special_in_messages else _special_spellings_in(tokenizer, messages)
    if not spellings:  # the whole text at once, as llama-server encodes it
        return tokenizer.encode(apply_chat_template(gguf_file_or_metadata, tokenizer, messages), add_bos=False)
    ids = []
    for text, from_message in _rendered_parts(gguf_file_or_metadata, tokenizer, messages, spellings):
        ids += tokenizer.encode(text, add_bos=False, add_eos=False, parse_special=not from_message)
    return ids + ([tokenizer.eos_id] if tokenizer.add_eos and tokenizer.eos_id is not None else [])


def _special_spellings_in(tokenizer: Tokenizer, messages: list[dict]) -> list[str]:
    """The special tokens' spellings (`<|im_start|>`) that some message's text contains, longest first (a longer
    one wins where one spelling starts another). Found by the tokenizer's own matching, one pass per message."""
    found = set()
    for message in messages:
        if isinstance(message.get("content"), str):
            ids = tokenizer.encode(message["content"], add_bos=False, add_eos=False, parse_special=True)
            found.update(tokenizer.tokens[i] for i in ids
                         if tokenizer.token_type(i) in (TokenType.CONTROL, TokenType.UNKNOWN))
    return sorted(found, key=len, reverse=True)


def _rendered_parts(gguf_file_or_metadata: GGUFFile | dict[str, Any], tokenizer: Tokenizer,
                    messages: list[dict], spellings: list[str]) -> list[tuple[str, bool]]:
    """The rendered prompt as (text, came from a message) parts. Each message's text is rendered as a marker and
    put back afterwards, so it is encoded whole; a template that changes a message's text (trims it, splits a
    reasoning part off) cannot be rendered that way, and then only `spellings` (special tokens' text, longest
    first) inside messages are marked, so they alone are plain text."""
    rendered = apply_chat_template(gguf_file_or_metadata, tokenizer, messages)
    # no message can contain the nonce by chance or by design; letters, digits and ':' come through tojson,
    # trim and HTML escaping unchanged
    nonce = uuid.uuid4().hex
    marker = lambda i: f"{nonce}:{i}:{nonce}"
    marker_pattern = re.compile(f"{nonce}:(\\d+):{nonce}")
    contents = [m.get("content") for m in messages]
    marked = [dict(m, content=marker(i)) if isinstance(m.get("content"), str) else m for i, m in enumerate(messages)]
    parts = _split(apply_chat_template(gguf_file_or_metadata, tokenizer, marked), marker_pattern,
                   lambda i: contents[i])
    if "".join(text for text, _ in parts) == rendered:
        return parts
    escaped_spellings = re.compile("|".join(map(re.escape, spellings)))
    escaped = [dict(m, content=escaped_spellings.sub(lambda match: marker(spellings.index(match.group())),
                                                     m["content"]))
               if isinstance(m.get("content"), str) else m for m in messages]
    parts = _split(apply_chat_template(gguf_file_or_metadata, tokenizer, escaped), marker_pattern,
                   lambda i: spellings[i])
    if "".join(text for text, _ in parts) != rendered:
        raise OutriderError(f"the chat template rewrites message text, so {spellings[0]!r} in a message cannot be "
                            "kept as text; leave it out, or start the server with --allow-special-in-messages")
    return parts


def _split(text: str, marker_pattern: re.Pattern, original: Callable[[int], str]) -> list[tuple[str, bool]]:
    """`text` cut at its markers: (template text, False) and (the marked text put back, True), empty parts left out."""
    parts, at = [], 0
    for match in marker_pattern.finditer(text):
        parts += [(text[at:match.start()], False), (original(int(match.group(1))), True)]
        at = match.end()
    parts.append((text[at:], False))
    return [(part, from_message) for part, from_message in parts if part]


def template_or_raw_ids(gguf_file_or_metadata: GGUFFile | dict[str, Any], tokenizer: Tokenizer,
                        text: str) -> tuple[list[int], bool]:
    """`text` as a user turn of the chat template, or raw (the tokenizer's BOS first) where the model has
    no template; and whether the template was applied (what bench and distill feed every model)."""
    try:
        return prompt_ids(gguf_file_or_metadata, tokenizer, text), True
    except ModelFileError:
        return prompt_ids(gguf_file_or_metadata, tokenizer, text, chat=False), False


def _token_text(tokenizer: Tokenizer, token_id: int | None) -> str:
    return tokenizer.tokens[token_id] if token_id is not None else ""


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Like transformers: Jinja's own tojson escapes HTML characters, which templates do not expect.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # Templates come from downloaded files, so they run sandboxed. trim_blocks/lstrip_blocks and the helpers
    # below are what transformers provides; templates are written against that environment.
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return environment.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ModelFileError(f"the model's chat template does not parse ({error}); run without --chat") from None
