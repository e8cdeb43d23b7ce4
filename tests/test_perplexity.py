"""`outrider perplexity`: llama-perplexity's method (chunks of n_ctx, BOS first, the second half scored), checked on
models whose perplexity is known by hand, and on a real model against transformers."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from outrider.cli import main
from outrider.errors import ConfigError
from outrider.perplexity import perplexity
from outrider.testing.tiny_models import write_tiny_llama


class FakeTokenizer:
    """Encodes text as one token per character (a..z -> 1..26); BOS is 0."""

    def __init__(self, add_bos=True):
        self.add_bos, self.bos_id = add_bos, 0

    def encode(self, text, add_bos=None, parse_special=True, add_eos=None):
        assert parse_special is False and add_eos is False
        ids = [ord(c) - ord("a") + 1 for c in text]
        return [self.bos_id, *ids] if add_bos else ids


class SuccessorModel:
    """Puts logit `bonus` on (token + 1) mod V after every token, 0 elsewhere; records what it was given."""

    def __init__(self, vocab=27, bonus=2.0, context=4096):
        self.vocab, self.bonus, self.calls = vocab, bonus, []
        self.config, self.device = SimpleNamespace(context_length=context), torch.device("cpu")

    def new_cache(self, n):
        return SimpleNamespace(max_len=n)

    def forward(self, ids, start, cache, last_only=False):
        self.calls.append((ids.tolist(), start, last_only))
        logits = torch.zeros(ids.numel(), self.vocab)
        logits[torch.arange(ids.numel()), (ids + 1) % self.vocab] = self.bonus
        return logits[-1:] if last_only else logits


def test_a_uniform_model_has_the_vocabulary_size_as_perplexity():
    model = SuccessorModel(bonus=0.0)
    result = perplexity(model, FakeTokenizer(), "abcdefghij" * 10, n_ctx=16)
    assert result.perplexity == pytest.approx(27.0, rel=1e-12)
    assert result.uncertainty == 0.0
    assert result.chunks == 101 // 16 and result.tokens_scored == result.chunks * (16 // 2 - 1)


def test_the_second_half_of_each_chunk_is_scored_with_bos_first():
    text = "abcabd" * 20  # successor right at a->b, b->c; wrong at c->a, b->d, d->a
    tokens = [0] + [ord(c) - 96 for c in text]
    n_ctx, bonus = 12, 2.0
    model = SuccessorModel(bonus=bonus)
    result = perplexity(model, FakeTokenizer(), text, n_ctx=n_ctx, max_chunks=3)
    hit, miss = bonus - math.log(math.exp(bonus) + 26), -math.log(math.exp(bonus) + 26)
    nll, count = 0.0, 0
    for c in range(3):  # llama-perplexity: positions n_ctx/2 .. n_ctx-2 predict the next token of the chunk
        chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
        for pos in range(n_ctx // 2, n_ctx - 1):
            nll -= hit if chunk[pos + 1] == (chunk[pos] + 1) % 27 else miss
            count += 1
    assert result.tokens_scored == count == 3 * 5
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-12)
    # every chunk starts from position 0 with BOS in place of its first token; its first half is a prompt pass
    prompts = [call for call in model.calls if call[2]]
    assert [(ids[0], start, len(ids)) for ids, start, _ in prompts] == [(0, 0, 6)] * 3
    assert [ids[1:] for ids, _, _ in prompts] == [tokens[c * n_ctx + 1:c * n_ctx + 6] for c in range(3)]
    assert len(result.running) == 3 and result.running[-1] == result.perplexity


def test_a_text_too_short_or_a_bad_context_is_a_one_line_error():
    with pytest.raises(ConfigError, match="at least 32"):
        perplexity(SuccessorModel(), FakeTokenizer(), "abc" * 10, n_ctx=16)
    with pytest.raises(ConfigError, match="even context"):
        perplexity(SuccessorModel(), FakeTokenizer(), "abc" * 10, n_ctx=15)
    with pytest.raises(ConfigError, match="beyond the model's context"):
        perplexity(SuccessorModel(context=64), FakeTokenizer(), "abc" * 100, n_ctx=128)


def test_the_command_prints_llama_perplexity_lines_and_json(tmp_path):
    model = write_tiny_llama(tmp_path / "llama.gguf")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    runner = CliRunner()
    result = runner.invoke(main, ["perplexity", str(model), str(text), "-c", "64", "--chunks", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("[1]") and "[2]" in lines[0]
    assert lines[-1].startswith("Final estimate: PPL = ")
    result = runner.invoke(main, ["perplexity", str(model), str(text), "-c", "64", "--chunks", "2", "--json"])
    report = json.loads(result.output)
    assert report["chunks"] == 2 and report["tokens_scored"] == 2 * 31 and report["perplexity"] > 1
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    result = runner.invoke(main, ["perplexity", str(model), str(short), "-c", "64"])
    assert result.exit_code == 1 and result.output.startswith("error: ") and "smaller --ctx-size" in result.output
    result = runner.invoke(main, ["perplexity", str(model), str(tmp_path / "missing.txt")])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and "cannot read" in result.output


@pytest.mark.slow
def test_real_model_perplexity_matches_transformers(smollm2_path, transformers_gguf):
    """transformers computes the same chunks' log-likelihood from the dequantized GGUF: the oracle."""
    from outrider.io.gguf import GGUFFile
    from outrider.io.tokenizer import Tokenizer
    from outrider.native import activations as native_activations
    from outrider.plugins.backends.cpu import CPUBackend

    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[:12000]
    n_ctx, chunks = 256, 3
    hf = transformers_gguf.model(smollm2_path)
    gguf_file = GGUFFile(smollm2_path)
    tokenizer = Tokenizer.from_gguf(gguf_file)
    tokens = tokenizer.encode(text, add_bos=tokenizer.add_bos, parse_special=False, add_eos=False)
    nll, count = 0.0, 0
    with torch.no_grad():
        for c in range(chunks):
            chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
            if tokenizer.add_bos:
                chunk[0] = tokenizer.bos_id
            logp = torch.log_softmax(hf(torch.tensor([chunk])).logits[0].double(), -1)
            for pos in range(n_ctx // 2, n_ctx - 1):
                nll -= logp[pos, chunk[pos + 1]].item()
                count += 1
    expected = math.exp(nll / count)
    model = CPUBackend().load_model(gguf_file)
    with native_activations("float32"):
        ours = perplexity(model, tokenizer, text, n_ctx=n_ctx, max_chunks=chunks)
    assert ours.tokens_scored == count
    assert ours.perplexity == pytest.approx(expected, rel=2e-3)
