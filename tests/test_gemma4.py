"""Gemma 4 (`gemma4`): every text variant against transformers, on files written by llama.cpp's converter.

Oracles: transformers' Gemma4ForCausalLM and its tokenizer, loading the same random checkpoint the GGUF was
converted from (by llama.cpp's own `convert_hf_to_gguf.py`, run as a subprocess); for the cache, the same
model run without the cache trick (single-token forwards, a fresh cache).
"""

from __future__ import annotations

import pytest
import torch
from oracles.gemma4_fixtures import VARIANTS, cached_fixture
from oracles.model_checks import converted_variant, replayed_and_fresh, verify_and_single_steps

from outrider.errors import ModelFileError
from outrider.io.chat import apply_chat_template
from outrider.io.gguf import GGUFFile
from outrider.io.tokenizer import Tokenizer
from outrider.models import load_model

transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4  # fp32 both sides; the tiny models' logits are of magnitude ~5 (softcapped at 30)
BATCH_ATOL = 1e-4  # dense weights: batched vs single-token forwards reorder float sums (seen: 1.4e-5)
WINDOW = 8  # the fixtures' sliding window

TEXTS = ["the world is", "Hello, World!", "  two  spaces", "line\n\nbreaks\n\n\nthree", "é日本語 emoji 🙂",
         "<|turn>user\nhi<turn|>", "<|channel>thought<channel|> done", "tabs\tand\r\ncrlf", "", " ", "\n",
         "123 4567.89", "Whitespace   at end   ", "the the the thethe", "<bos>starts", "unknown <mask> word"]


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    return converted_variant(cached_fixture, request.param)


def _ids(n: int, seed: int, vocab: int = 332) -> torch.Tensor:
    return torch.randint(9, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("weights", ["dense", "compact"])
def test_logits_and_hidden_match_transformers(variant, weights):
    name, _, path, hf = variant
    model = load_model(GGUFFile(path), weights=weights)
    ids = _ids(3 * WINDOW, 1)  # past the window: sliding layers mask, shared layers read across it
    logits, hidden = model.forward(ids, 0, model.new_cache(64), hidden=True)
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True)
        theirs_hidden = hf.model(ids[None]).last_hidden_state[0]
    torch.testing.assert_close(logits, out.logits[0], atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(hidden, theirs_hidden, atol=LOGIT_ATOL, rtol=1e-4)
    assert int(logits[-1].argmax()) == int(out.logits[0, -1].argmax())


def test_greedy_continuation_matches_transformers(variant):
    _, _, path, hf = variant
    model = load_model(GGUFFile(path))
    prompt = _ids(5, 2)
    with torch.no_grad():
        theirs = hf.generate(prompt[None], max_new_tokens=32, do_sample=False, min_new_tokens=32,
                             pad_token_id=0)[0, len(prompt):].tolist()
    cache = model.new_cache(64)
    logits = model.forward(prompt, 0, cache, last_only=True)
    ours = []
    for _ in range(32):
        ours.append(int(logits[-1].argmax()))
        logits = model.forward(torch.tensor(ours[-1:]), cache.length, cache)
    assert ours == theirs


def test_kv_sharing_map_is_the_one_transformers_uses(variant):
    name, _, path, hf = variant
    model = load_model(GGUFFile(path))
    cfg = hf.config
    modes = cfg.kv_sharing_modes
    stores = {cfg.layer_types[i]: i for i, m in enumerate(modes) if m == "store"}
    want = tuple(stores[cfg.layer_types[i]] if m == "reuse" else i for i, m in enumerate(modes))
    assert model.kv_source_layer == want
    if name == "e2b":
        assert want[4:] == (2, 3)  # the test would not see sharing otherwise
        assert len(model.new_cache(16).keys) == 4


@pytest.mark.parametrize("weights", ["dense", "compact"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_k_token_forward_equals_k_single_forwards(variant, weights, k):
    """Across the sliding window (prefix 5 + k crosses 8) and through the KV-sharing layers; bit for bit with
    compact weights, what keeps greedy speculation equal to plain decoding."""
    _, _, path, _ = variant
    model = load_model(GGUFFile(path), weights=weights)
    batched, singles = verify_and_single_steps(model, _ids(5, k), _ids(k, 10 + k))
    if weights == "compact":
        assert torch.equal(batched, singles)
    else:
        torch.testing.assert_close(batched, singles, atol=BATCH_ATOL, rtol=0)


def test_truncate_then_replay_equals_a_fresh_run(variant):
    _, _, path, _ = variant
    model = load_model(GGUFFile(path), weights="compact")
    replayed, fresh = replayed_and_fresh(model, _ids(6, 3), _ids(7, 4), _ids(5, 5))
    torch.testing.assert_close(replayed, fresh, atol=BATCH_ATOL, rtol=0)


def test_tokenizer_ids_match_transformers(variant):
    _, hf_dir, path, _ = variant
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ours = Tokenizer.from_gguf(GGUFFile(path))
    for text in TEXTS:
        assert ours.encode(text, add_bos=False) == hf_tok(text, add_special_tokens=False)["input_ids"], text
    # llama.cpp always starts a gemma4 prompt with BOS
    assert ours.encode("the world")[0] == ours.bos_id == 2
    plain = [t for t in TEXTS if "<" not in t]
    for text in plain:
        assert ours.decode(ours.encode(text, add_bos=False)) == hf_tok.decode(hf_tok(text)["input_ids"]), text


def test_chat_template_from_the_file_matches_transformers(variant):
    _, hf_dir, path, _ = variant
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    g = GGUFFile(path)
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "the world"},
                {"role": "user", "content": "is it?"}]
    text = apply_chat_template(g, Tokenizer.from_gguf(g), messages)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = Tokenizer.from_gguf(g).encode(text)
    assert ids == hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                             return_dict=False)


def test_unhonoured_metadata_is_refused_in_one_line(variant):
    name, _, path, _ = variant
    cases = [("gemma4.rope.scaling.type", "yarn", "gemma4.rope.scaling.type"),
             ("gemma4.attention.scale", 0.5, "gemma4.attention.scale"),
             ("gemma4.rope.dimension_count_swa", 8, "partial rotary"),
             ("gemma4.vocab_size", 7, "vocab_size")]
    if name == "moe":
        cases.append(("gemma4.expert_used_count", 0, "expert_used_count"))
    for key, value, fragment in cases:
        g = GGUFFile(path)
        g.metadata[key] = value
        with pytest.raises(ModelFileError) as e:
            load_model(g)
        assert "\n" not in str(e.value) and fragment in str(e.value), str(e.value)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_native_layer_stack_equals_the_python_loop(variant, k):
    """Compact weights run every layer in one native call (the experts excepted); it makes the calls the
    Python loop makes, so logits and cache agree bit for bit, across the window and the shared layers."""
    name, _, path, _ = variant
    model = load_model(GGUFFile(path), weights="compact")
    assert model.kernels is not None
    native = model.native_stack
    assert (native is None) == (name == "moe")
    prompt, block = _ids(13, 20 + k), _ids(k, 30 + k)
    caches, logits = [], []
    for stack in (native, None):
        model.native_stack = stack
        cache = model.new_cache(64)
        first = model.forward(prompt, 0, cache, last_only=True)
        logits.append(torch.cat([first, model.forward(block, len(prompt), cache)]))
        caches.append(cache)
    assert torch.equal(logits[0], logits[1])
    for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
        assert torch.equal(a, b)


def _layer_pattern(name: str) -> str:
    return ".".join("#" if part.isdigit() else part for part in name.split("."))


def test_handwritten_tiny_gemma4_uses_the_converters_keys_and_names(tmp_path):
    """The contract suite's tiny gemma4 is written without the converter; every key and tensor name it
    uses must be one the converter writes (the e2b and dense fixtures between them cover it)."""
    from outrider.testing.tiny_models import write_tiny_gemma4

    try:
        converted = [GGUFFile(cached_fixture(v)[1]) for v in ("dense", "e2b")]
    except ReferenceUnavailable as e:
        pytest.skip(str(e))
    tiny = GGUFFile(write_tiny_gemma4(tmp_path / "tiny.gguf"))
    keys = {k for g in converted for k in g.metadata if not k.startswith("general.")}
    names = {_layer_pattern(n) for g in converted for n in g.tensors}
    assert {k for k in tiny.metadata if not k.startswith("general.")} <= keys
    assert {_layer_pattern(n) for n in tiny.tensors} <= names
    model = load_model(tiny, weights="compact")
    assert model.kv_source_layer == (0, 1, 2, 3, 2, 3)
    assert model.native_stack is not None
