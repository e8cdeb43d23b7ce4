"""The tiny Gemma 4 vocabulary and chat template: plain data, shared by the tiny gemma4 written here
(`tiny_models.write_tiny_gemma4`, no transformers) and the test-only checkpoints converted by llama.cpp's
converter (tests/oracles/gemma4_fixtures.py), so both spell the same tokenizer.

A tiny Gemma-style BPE vocabulary (byte fallback, "▁" for spaces, a few merges) and a Gemma-4-style chat
template, so that a converter writes `tokenizer.ggml.model = gemma4` and the template as for the real files.
"""

from __future__ import annotations

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|channel>", "<channel|>"]
_PIECES = list("abcdefghijklmnopqrstuvwxyzTHIW.,!?'0123456789") + ["\n", "▁"]
_MERGES = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("i", "n"), ("▁", "a"), ("e", "r"), ("o", "n"), ("▁", "s"),
           ("a", "n"), ("r", "e"), ("\n", "\n"), ("▁", "▁"), ("▁", "w"), ("o", "r"), ("▁w", "or"), ("l", "d"),
           ("▁wor", "ld"), ("i", "s"), ("▁", "i"), ("▁i", "s")]

# Gemma 4's turn markup (`<|turn>role ... <turn|>`), text only.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\n' + message['content'] | trim + '<turn|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)


def vocabulary() -> tuple[list[str], list[tuple[str, str]]]:
    """(tokens, merges): the specials, the 256 byte pieces, the single characters, then each merge's result."""
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + _PIECES
    for left, right in _MERGES:
        if left + right not in tokens:
            tokens.append(left + right)
    return tokens, _MERGES
