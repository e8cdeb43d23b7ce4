"""`KVCache.read` gives a layer's keys and values [kv_heads, positions, head_dim] whatever the layout: a
drafter reading the target's cache (gemma-assistant) sees, from the native kernels' blocked keys, what a
dense model's plain cache holds for the same tokens (an independent writer: torch, not the kernels)."""

from __future__ import annotations

import torch

from outrider.io.gguf import GGUFFile
from outrider.plugins.backends.cpu import CPUBackend
from outrider.testing.tiny_models import write_tiny_gemma4


def test_blocked_keys_read_back_as_the_dense_cache_holds_them(tmp_path):
    g = GGUFFile(write_tiny_gemma4(tmp_path / "gemma4.gguf", seed=0))
    compact = CPUBackend(weights="compact", activations="float32").load_model(g)  # exact: this is about layout
    dense = CPUBackend(weights="dense").load_model(g)
    tokens = torch.randint(0, compact.config.vocab_size, (70,), generator=torch.Generator().manual_seed(0))
    end = 67  # crosses the 64-position key block, and stops inside the second one
    caches = []
    for model in (compact, dense):
        cache = model.new_cache(128)
        model.forward(tokens, 0, cache)
        caches.append(cache)
    assert caches[0].keys_transposed and not caches[1].keys_transposed
    for layer in range(compact.config.n_kv_layers):
        (k_native, v_native), (k_dense, v_dense) = caches[0].read(layer, end), caches[1].read(layer, end)
        assert k_native.shape == k_dense.shape and v_native.shape == v_dense.shape
        assert torch.allclose(k_native.float(), k_dense.float(), atol=1e-4), f"layer {layer}: keys differ"
        assert torch.allclose(v_native.float(), v_dense.float(), atol=1e-4), f"layer {layer}: values differ"
