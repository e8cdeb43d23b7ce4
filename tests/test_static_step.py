"""The fixed-shape decode/verify step the CUDA backend captures as CUDA graphs (`outrider.models.static_step`),
run eagerly on the CPU: its logic (positions as a tensor, attention over the whole cache with a mask,
padding to a bucket) against the architecture's own eager forward, which is the oracle here (that one is
checked against transformers elsewhere). The models hold the GPU's compact weights (int4/int8 through torch's
CPU kernels) so the whole GPU model path runs; float32 and float64 attention keep the comparison tight.
"""

from __future__ import annotations

import pytest
import torch

from outrider.io.gguf import GGUFFile
from outrider.models import ARCHITECTURES
from outrider.models.static_step import ROW_BUCKETS, STATIC_ARCHITECTURES, StaticKVCache, StaticStepModel, bucket_for
from outrider.models.torch_quant import Int4Linear, Int8Linear

ARCHS = list(STATIC_ARCHITECTURES)


@pytest.fixture(scope="module")
def models(outrider_contract_fixtures):
    out = {}
    for arch in ARCHS:
        g = GGUFFile(outrider_contract_fixtures.model_path(arch))
        out[arch] = ARCHITECTURES[arch](g, dtype=torch.float32, device="cpu", native=False,
                                        attention_dtype=torch.float64, linear_form="quantized")
    return out


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max()))


def test_buckets_cover_every_verify_shape():
    assert [bucket_for(t) for t in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert bucket_for(17) is None and max(ROW_BUCKETS) == 16


def test_the_gpu_forms_are_what_the_models_hold(models):
    layer = models["llama"].layers[0]
    assert all(isinstance(w, (Int4Linear, Int8Linear)) for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("t", [1, 3, 7, 16])
def test_a_padded_step_gives_the_eager_forwards_logits(models, arch, t):
    """Prefix 5 (eager, into the static cache), then t tokens through the padded step, against the eager
    forward of the same tokens; the prefix puts the block across the tiny gemma3's 8-token window."""
    model = models[arch]
    static = StaticStepModel(model, graphs=False)
    vocab = model.config.vocab_size
    prefix, block = _ids(5, vocab, t), _ids(t, vocab, 50 + t)
    cache = static.new_cache(64)
    assert isinstance(cache, StaticKVCache)
    static.forward(prefix, 0, cache)
    logits, hidden = static.forward(block, 5, cache, hidden=True)
    assert cache.length == 5 + t
    eager_cache = model.new_cache(64)
    model.forward(prefix, 0, eager_cache)
    want_logits, want_hidden = model.forward(block, 5, eager_cache, hidden=True)
    _close(logits, want_logits)
    _close(hidden, want_hidden)


@pytest.mark.parametrize("arch", ARCHS)
def test_padding_does_not_change_the_real_rows(models, arch):
    """The same 3 tokens in buckets of 3, 4 and 16 rows: identical real rows (padding is invisible)."""
    model = models[arch]
    vocab = model.config.vocab_size
    prefix, block = _ids(9, vocab, 1), _ids(3, vocab, 2)
    results = []
    for buckets in ((3,), (4,), (16,)):
        static = StaticStepModel(model, buckets=buckets, graphs=False)
        cache = static.new_cache(32)
        static.forward(prefix, 0, cache, last_only=True)
        results.append(static.forward(block, 9, cache))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("arch", ARCHS)
def test_steps_to_the_end_of_the_cache_stay_inside_it(models, arch):
    """A step whose padding reaches past max_len writes the slack slots, not out of bounds."""
    model = models[arch]
    static = StaticStepModel(model, graphs=False)
    vocab = model.config.vocab_size
    tokens = _ids(20, vocab, 3)
    cache = static.new_cache(20)
    static.forward(tokens[:17], 0, cache)
    got = static.forward(tokens[17:], 17, cache)  # 3 rows padded to 4: the 4th row lands at position 20
    want = model.forward(tokens, 0, model.new_cache(20))[17:]
    _close(got, want)


@pytest.mark.parametrize("arch", ARCHS)
def test_truncate_then_replay_through_the_step(models, arch):
    model = models[arch]
    static = StaticStepModel(model, graphs=False)
    vocab = model.config.vocab_size
    prefix, rejected, replacement = _ids(6, vocab, 4), _ids(7, vocab, 5), _ids(5, vocab, 6)
    cache = static.new_cache(64)
    static.forward(prefix, 0, cache)
    static.forward(rejected, 6, cache)
    cache.truncate(6)
    got = static.forward(replacement, 6, cache)
    want = model.forward(torch.cat([prefix, replacement]), 0, model.new_cache(64))[6:]
    _close(got, want)


def test_greedy_decoding_through_steps_matches_eager_greedy(models):
    """Twelve greedy tokens one step at a time, then the same as verify-sized blocks, both equal to eager."""
    model = models["gemma3"]
    static = StaticStepModel(model, graphs=False)
    prompt = _ids(4, model.config.vocab_size, 8)

    def greedy(m, n):
        cache = m.new_cache(64)
        logits = m.forward(prompt, 0, cache, last_only=True)
        out = [int(logits[-1].argmax())]
        while len(out) < n:
            logits = m.forward(torch.tensor(out[-1:]), len(prompt) + len(out) - 1, cache)
            out.append(int(logits[-1].argmax()))
        return out

    plain = greedy(model, 12)
    assert greedy(static, 12) == plain
    # the whole continuation as one verify block: each row's argmax is the next plain token
    cache = static.new_cache(64)
    static.forward(prompt, 0, cache, last_only=True)
    block = static.forward(torch.tensor(plain[:11]), len(prompt), cache)
    assert block.argmax(dim=-1).tolist() == plain[1:12]
