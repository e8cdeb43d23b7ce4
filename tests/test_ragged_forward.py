"""The ragged forward: several sequences' rows (each its own row count, start and KV cache) in one call.

Oracle: each sequence's own `forward` over the same rows on its own cache (a verify pass: every row kept). With
compact weights (the CPU kernels) the two are bit for bit the same (`torch.equal`), logits, hidden states and
the caches they wrote, on every architecture that batches, and Gemma 4 is refused by name; with dense weights
(torch's float32 products, whose blocking follows the row count) they agree to rounding. distill's batched
writer takes the same call with one row per sequence.
"""

from __future__ import annotations

import pytest
import torch

from outrider.errors import OutriderError
from outrider.io.gguf import GGUFFile
from outrider.models import load_model
from outrider.native import activations as native_activations
from outrider.testing.tiny_models import write_tiny_gemma3, write_tiny_gemma4, write_tiny_llama

BATCH_ATOL = 1e-3  # dense weights: torch's products reorder float sums with the row count

WRITERS = {
    "llama": lambda path: write_tiny_llama(path),
    "qwen2": lambda path: write_tiny_llama(path, arch="qwen2"),
    "qwen3": lambda path: write_tiny_llama(path, arch="qwen3", head_dim=32),
    # a window of 8: the sequences' rows cross it at different positions
    "gemma3": lambda path: write_tiny_gemma3(path, window=8),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ragged")
    return {arch: write(folder / f"{arch}.gguf") for arch, write in WRITERS.items()}


def _ids(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=gen)


def _prefilled(model, prompts):
    caches = []
    for prompt in prompts:
        caches.append(model.new_cache(64))
        model.forward(prompt, 0, caches[-1], last_only=True)
    return caches


def _cache_rows(cache, end: int) -> list[torch.Tensor]:
    """What a cache holds of positions [0, end), every layer: keys (transposed blocks) and values."""
    rows = []
    for keys, values in zip(cache.keys, cache.values):
        rows.append(values[:, :end].clone())
        rows.append(keys.flatten(1, 3).clone() if keys.dim() == 4 else keys[:, :end].clone())
    return rows


@pytest.mark.torch_threads(2)  # attention's work items and the linears' columns are split across threads
@pytest.mark.parametrize("weights", ["compact", "compact-float32", "dense"])
@pytest.mark.parametrize("arch", list(WRITERS))
def test_a_ragged_forward_is_each_sequence_s_own_forward(paths, arch, weights):
    """Three sequences (prompts of 3, 11 and 6 tokens) through three rounds of 1, 5 and 2 / 4, 0 and 3 / 1, 1
    and 1 rows (an empty one too): each round's rows, in one call, against each sequence alone. Compact weights
    with the build's activations and with float32 ones (the kernels' two paths)."""
    with native_activations("float32" if weights == "compact-float32" else "auto"):
        _ragged_against_alone(paths, arch, weights.split("-")[0])


def _ragged_against_alone(paths, arch, weights):
    model = load_model(GGUFFile(paths[arch]), weights=weights)
    if weights == "compact":
        assert model.stack.native is not None, "the compact model should run the native stack"
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    prompts = [_ids(n, vocab, gen) for n in (3, 11, 6)]
    together, alone = _prefilled(model, prompts), _prefilled(model, prompts)
    starts = [len(p) for p in prompts]
    for counts in ((1, 5, 2), (4, 0, 3), (1, 1, 1)):
        rows = [_ids(n, vocab, gen) for n in counts]
        logits, hidden = model.forward_sequences(torch.cat(rows), list(counts), list(starts), together, hidden=True)
        assert logits.shape == (sum(counts), vocab) and hidden.shape == (sum(counts), model.config.hidden_size)
        at = 0
        for b, n in enumerate(counts):
            if n:
                want_logits, want_hidden = model.forward(rows[b], starts[b], alone[b], hidden=True)
                got_logits, got_hidden = logits[at:at + n], hidden[at:at + n]
                where = f"{arch} {weights}, sequence {b} ({n} rows at {starts[b]})"
                if weights == "compact":
                    assert torch.equal(got_logits, want_logits), \
                        f"{where}: logits differ by {float((got_logits - want_logits).abs().max()):.3g}"
                    assert torch.equal(got_hidden, want_hidden), f"{where}: hidden states differ"
                else:
                    torch.testing.assert_close(got_logits, want_logits, atol=BATCH_ATOL, rtol=0)
            assert together[b].length == alone[b].length == starts[b] + n
            at += n
            starts[b] += n
    if weights == "compact":
        for b, cache in enumerate(together):
            for got, want in zip(_cache_rows(cache, starts[b]), _cache_rows(alone[b], starts[b])):
                assert torch.equal(got, want), f"{arch}: sequence {b}'s cache differs from its own forward's"


def test_a_ragged_forward_of_one_sequence_is_its_forward(paths):
    model = load_model(GGUFFile(paths["llama"]), weights="compact")
    gen = torch.Generator().manual_seed(3)
    prompt, rows = _ids(7, model.config.vocab_size, gen), _ids(4, model.config.vocab_size, gen)
    one, alone = _prefilled(model, [prompt]), _prefilled(model, [prompt])
    got = model.forward_sequences(rows, [4], [7], one)
    assert torch.equal(got, model.forward(rows, 7, alone[0]))


def test_counts_that_do_not_describe_the_tokens_are_refused(paths):
    model = load_model(GGUFFile(paths["llama"]), weights="compact")
    caches = _prefilled(model, [torch.tensor([1, 2]), torch.tensor([3])])
    with pytest.raises(ValueError, match="do not describe one batch"):
        model.forward_sequences(torch.tensor([5, 6, 7]), [1, 1], [2, 1], caches)


def test_gemma4_is_refused_by_name(tmp_path):
    model = load_model(GGUFFile(write_tiny_gemma4(tmp_path / "gemma4.gguf")), weights="compact")
    caches = _prefilled(model, [torch.tensor([1, 2]), torch.tensor([3])])
    with pytest.raises(OutriderError, match="Gemma 4 runs one sequence at a time") as refused:
        model.forward_sequences(torch.tensor([5, 6]), [1, 1], [2, 1], caches)
    assert "\n" not in str(refused.value) and "-np 1" in str(refused.value)
