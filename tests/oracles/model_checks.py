"""What the architecture tests compare, written once: a verify pass against single steps, a replay after a
rollback against a fresh run, and the native layer stack against the Python loop. Each returns the two
sides; the test says how close they must be (bit for bit with compact weights)."""

from __future__ import annotations

from typing import Callable

import torch

from outrider.models.stack import LayerStack


def converted_variant(cached_fixture: Callable[[str], tuple], name: str):
    """(name, transformers folder, converted GGUF, the transformers model in float32) for a tiny checkpoint
    built by `cached_fixture(name)`; the test is skipped where the converter or its checkpoint is unavailable."""
    import pytest
    import transformers

    from oracles.llama_cpp import ReferenceUnavailable

    try:
        hf_dir, path = cached_fixture(name)
    except ReferenceUnavailable as e:
        pytest.skip(str(e))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return name, hf_dir, path, hf


def verify_and_single_steps(model, prefix: torch.Tensor, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of `block` in one forward after `prefix`, the same from one forward per token)."""
    cache = model.new_cache(len(prefix) + len(block) + 64)
    model.forward(prefix, 0, cache)
    batched = model.forward(block, len(prefix), cache)
    cache.truncate(len(prefix))
    singles = torch.cat([model.forward(block[i:i + 1], len(prefix) + i, cache) for i in range(len(block))])
    return batched, singles


def replayed_and_fresh(model, prefix: torch.Tensor, rejected: torch.Tensor,
                       replacement: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of `replacement` after `rejected` was run and rolled back, the same from a fresh cache)."""
    cache = model.new_cache(len(prefix) + 64)
    model.forward(prefix, 0, cache)
    model.forward(rejected, len(prefix), cache)
    cache.truncate(len(prefix))
    replayed = model.forward(replacement, len(prefix), cache)
    fresh = model.forward(torch.cat([prefix, replacement]), 0, model.new_cache(len(prefix) + 64))[len(prefix):]
    return replayed, fresh


def native_stack_and_loop(model, prompt: torch.Tensor, block: torch.Tensor) -> tuple[list, list]:
    """([logits, cache tensors] of the model's native `LayerStack`, the same of the Python loop over its
    layers): a prompt (the panel kernels' order) and then a block after it."""
    native = model.stack
    assert native.native is not None
    loop = LayerStack(native.layers, native.attention, native.eps, native.act, native=False)
    out = []
    try:
        for stack in (native, loop):
            model.stack = stack
            cache = model.new_cache(len(prompt) + len(block) + 51)
            first = model.forward(prompt, 0, cache, last_only=True)
            out.append([torch.cat([first, model.forward(block, len(prompt), cache)]), cache.keys + cache.values])
    finally:
        model.stack = native
    return out[0], out[1]
