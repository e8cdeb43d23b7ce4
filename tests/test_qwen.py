"""Qwen2 (`qwen2`) and Qwen3 (`qwen3`) against transformers, on files written by llama.cpp's converter.

Oracles: transformers' Qwen2ForCausalLM / Qwen3ForCausalLM and their tokenizer, loading the same random
checkpoint the GGUF was converted from (by llama.cpp's own `convert_hf_to_gguf.py`); for the cache, the same
model run without the cache trick. The slow tests run the real Qwen2.5-Coder 0.5B against transformers'
GGUF loader and tokenizer.
"""

from __future__ import annotations

import pytest
import torch
from oracles.llama_cpp import ReferenceUnavailable
from oracles.model_checks import converted_variant, native_stack_and_loop, replayed_and_fresh, verify_and_single_steps
from oracles.qwen_fixtures import VARIANTS, cached_fixture

from outrider.errors import ModelFileError
from outrider.io.chat import apply_chat_template
from outrider.io.gguf import GGUFFile
from outrider.io.tokenizer import Tokenizer
from outrider.models import load_model
from outrider.native import activations as native_activations

transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4  # fp32 both sides; the tiny models' logits are of magnitude ~5
BATCH_ATOL = 1e-4  # dense weights: batched vs single-token forwards reorder float sums

TEXTS = ["the world is", "Hello, World!", "  two  spaces", "line\n\nbreaks\n\n\nthree", "é日本語 emoji 🙂",
         "<|im_start|>user\nhi<|im_end|>", "tabs\tand\r\ncrlf", "", " ", "\n", "123 4567.89 1000000",
         "Whitespace   at end   ", "it's I'M we'Ve", "<|fim_prefix|>def f(<|fim_suffix|>)<|fim_middle|>",
         "def quicksort(values):\n    return values\n"]


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    return converted_variant(cached_fixture, request.param)


def _ids(n: int, seed: int, vocab: int = 390) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("weights", ["dense", "compact"])
def test_logits_and_hidden_match_transformers(variant, weights):
    name, _, path, hf = variant
    with native_activations("float32"):
        model = load_model(GGUFFile(path), weights=weights)
        assert model.architecture == name and (model.attention.kernels is not None) == (weights == "compact")
        ids = _ids(20, 1)
        logits, hidden = model.forward(ids, 0, model.new_cache(64), hidden=True)
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
        theirs_hidden = hf.model(ids[None]).last_hidden_state[0]
    torch.testing.assert_close(logits, theirs, atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(hidden, theirs_hidden, atol=LOGIT_ATOL, rtol=1e-4)


def test_greedy_continuation_matches_transformers(variant):
    _, _, path, hf = variant
    model = load_model(GGUFFile(path))
    prompt = _ids(5, 2)
    with torch.no_grad():
        theirs = hf.generate(prompt[None], max_new_tokens=24, do_sample=False, min_new_tokens=24,
                             pad_token_id=0)[0, len(prompt):].tolist()
    cache = model.new_cache(64)
    logits = model.forward(prompt, 0, cache, last_only=True)
    ours = []
    for _ in range(24):
        ours.append(int(logits[-1].argmax()))
        logits = model.forward(torch.tensor(ours[-1:]), cache.length, cache)
    assert ours == theirs


@pytest.mark.parametrize("weights", ["dense", "compact-float32", "compact-int8"])
@pytest.mark.parametrize("k", [1, 4, 9])
def test_k_token_forward_equals_k_single_forwards(variant, weights, k):
    """Bit for bit with compact weights, whatever the activations: what keeps greedy speculation equal to
    plain decoding."""
    _, _, path, _ = variant
    form, _, mode = weights.partition("-")
    with native_activations(mode or "float32"):
        model = load_model(GGUFFile(path), weights=form)
        batched, singles = verify_and_single_steps(model, _ids(5, k), _ids(k, 10 + k))
    if form == "compact":
        assert torch.equal(batched, singles)
    else:
        torch.testing.assert_close(batched, singles, atol=BATCH_ATOL, rtol=0)


def test_truncate_then_replay_equals_a_fresh_run(variant):
    _, _, path, _ = variant
    model = load_model(GGUFFile(path), weights="compact")
    replayed, fresh = replayed_and_fresh(model, _ids(6, 3), _ids(7, 4), _ids(5, 5))
    torch.testing.assert_close(replayed, fresh, atol=BATCH_ATOL, rtol=0)


@pytest.mark.parametrize("k", [1, 4])
def test_native_layer_stack_equals_the_python_loop(variant, k):
    """The native stack adds the q/k/v bias (qwen2) and norms q and k (qwen3) as the Python loop does, so
    logits and cache agree bit for bit."""
    _, _, path, _ = variant
    model = load_model(GGUFFile(path), weights="compact")
    (native_logits, native_cache), (loop_logits, loop_cache) = native_stack_and_loop(model, _ids(13, 20 + k),
                                                                                     _ids(k, 30 + k))
    assert torch.equal(native_logits, loop_logits)
    assert all(torch.equal(a, b) for a, b in zip(native_cache, loop_cache))


def test_tokenizer_ids_match_transformers(variant):
    _, hf_dir, path, _ = variant
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ours = Tokenizer.from_gguf(GGUFFile(path))
    for text in TEXTS:
        assert ours.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"], text
    for text in (t for t in TEXTS if "<|" not in t):  # control tokens are not printed (llama.cpp's choice)
        assert ours.decode(ours.encode(text)) == hf_tok.decode(hf_tok(text)["input_ids"]) == text, text
    assert ours.eog_ids >= {hf_tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}


def test_chat_template_from_the_file_matches_transformers(variant):
    _, hf_dir, path, _ = variant
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    g = GGUFFile(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "the world"}, {"role": "user", "content": "is it?"}]
    text = apply_chat_template(g, Tokenizer.from_gguf(g), messages)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_other_qwen_form_is_refused_in_one_line(variant):
    """A qwen3 file labelled qwen2 (no biases) and a qwen2 file labelled qwen3 (biases, no q/k norms), and a
    file with experts: one line naming what to fix."""
    name, _, path, _ = variant
    other = "qwen3" if name == "qwen2" else "qwen2"
    g = GGUFFile(path)
    g.metadata = {k.replace(f"{name}.", f"{other}.", 1): v for k, v in g.metadata.items()}
    g.metadata["general.architecture"] = other
    with pytest.raises(ModelFileError) as e:
        load_model(g)
    assert "\n" not in str(e.value) and "general.architecture" in str(e.value), str(e.value)
    g = GGUFFile(path)
    g.tensors["blk.0.ffn_gate_exps.weight"] = g.tensors["blk.0.ffn_gate.weight"]
    with pytest.raises(ModelFileError, match="experts"):
        load_model(g)
    for variant in (f"{name}moe", f"{name}vl"):
        g = GGUFFile(path)
        g.metadata["general.architecture"] = variant
        with pytest.raises(ModelFileError) as e:
            load_model(g)
        message = str(e.value)
        assert "\n" not in message and str(path) in message, message
        assert f"dense {name}" in message or f"text-only {name}" in message, message


# ------------------------------------------------------------------------- a tiny pair: the sampled acceptor's law

# The draft model is the target cut to its first layers (same embedding, head and first layers; written by the same
# converter): q near p without equalling it. Layers kept so that about a quarter to a half of the drafts are
# accepted (measured: qwen2 with 2 of 3 layers 0.24, qwen3 with 1 of 3 0.42), so rejections and recoveries happen.
DRAFT_LAYERS = {"qwen2": 2, "qwen3": 1}


@pytest.mark.parametrize("name, p_min, generations", [("qwen2", 0.0, 400), ("qwen3", 0.0, 400),
                                                       ("qwen3", 0.5, 2000)])
def test_sampled_acceptor_keeps_the_law_with_a_tiny_qwen_draft_model(name, p_min, generations):
    """The contract suite's statistical check (chi-square against the exact law of the target's first tokens,
    computed from its own forwards) with `draft-model -o drafter.sample true` drafting for a tiny qwen target, with
    and without --draft-p-min; rounds with 0 < accepted < drafted must occur, or the check proves nothing."""
    from outrider.plugins.drafters.draft_model import DraftModelDrafter
    from outrider.spec.drafter import DraftControls
    from outrider.testing.checks import sampled_law_holds
    from outrider.testing.fixtures import cpu_target

    try:
        _, target_path = cached_fixture(name)
        _, draft_path = cached_fixture(name, n_layers=DRAFT_LAYERS[name])
    except ReferenceUnavailable as e:
        pytest.skip(str(e))
    target = cpu_target(target_path)
    drafter = DraftModelDrafter(model=str(draft_path), sample=True, p_min=0.0)  # the control alone decides
    drafter.setup(target)
    drafted, accepted = sampled_law_holds(target, drafter, None, DraftControls(draft_p_min=p_min), generations)
    assert 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)


# ----------------------------------------------------------------------------------- the real Qwen2.5-Coder

REAL_PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "<|im_start|>user\nWrite a haiku about rain.<|im_end|>\n<|im_start|>assistant\n",
]
REAL_LOGIT_ATOL = 2e-3  # as the llama and gemma3 real-model tests: fp32 both sides, logits of magnitude 20-40
CORPUS = [
    "Hello world! It's a beautiful day, isn't it? I'VE been here since 1999.",
    "def parse(line: str) -> dict[str, int]:\n\treturn {k: int(v) for k, v in (p.split('=') for p in line.split(';'))}\n",
    "    if (x >= 10 && y != 0) { return x / y; }\r\n\r\n",
    "Größe, naïve café — «quotes» and “curly” ones… 東京は日本の首都です。 Москва — столица России. مرحبا بالعالم",
    "1234567890 3.14159 1e-10 0x1F 1,000,000",
    "emoji: 🦙🚀😶‍🌫️ ✅ and tabs\t\t\tand    runs      of spaces   \n\n\n\n  \n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n<|fim_middle|>return a + b<|fim_pad|><|repo_name|>x<|file_sep|>",
    "```python\nimport numpy as np\nprint(np.arange(10)[::-1])\n```",
]


@pytest.fixture(scope="module")
def real_qwen(qwen05_path, transformers_gguf):
    hf_tokenizer, hf_model = transformers_gguf.tokenizer(qwen05_path), transformers_gguf.model(qwen05_path)
    return qwen05_path, hf_model, hf_tokenizer


@pytest.mark.slow
def test_real_qwen_tokenizer_matches_transformers_on_a_mixed_corpus(real_qwen):
    path, _, hf_tokenizer = real_qwen
    ours = Tokenizer.from_gguf(GGUFFile(path))
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"], text
        if "<|" not in text:
            assert ours.decode(ids) == text
    assert ours.eog_ids >= {151645, 151643}  # <|im_end|>, <|endoftext|>


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["dense", "compact"])
def test_real_qwen_logits_match_transformers(real_qwen, weights):
    path, hf_model, hf_tokenizer = real_qwen
    with native_activations("float32"):
        model = load_model(GGUFFile(path), weights=weights)
        for prompt in REAL_PROMPTS:
            ids = hf_tokenizer.encode(prompt)
            ours = model.forward(torch.tensor(ids), 0, model.new_cache(256))[-1]
            with torch.no_grad():
                theirs = hf_model(torch.tensor([ids])).logits[0, -1]
            assert int(ours.argmax()) == int(theirs.argmax()), prompt
            torch.testing.assert_close(ours, theirs, atol=REAL_LOGIT_ATOL, rtol=0)


@pytest.mark.slow
def test_real_quantized_token_tables_are_held_in_their_codes(qwen05_path):
    """The 0.5B's Q5_0 table (its rows of 896 fit no K-quant): held as codes, its rows the `gguf` package's,
    and with int8 activations too, where the other weights keep only their lane tiles."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from outrider.native import activations as native_activations

    reference = next(t for t in GGUFReader(qwen05_path).tensors if t.name == "token_embd.weight")
    assert reference.tensor_type == GGMLQuantizationType.Q5_0
    ids = torch.arange(0, int(reference.shape[1]), 101)
    rows = torch.from_numpy(dequantize(reference.data[ids.numpy()], reference.tensor_type)).float()
    with native_activations("int8"):
        model = load_model(GGUFFile(qwen05_path), weights="compact")
        table = model.embed.row_source
        assert model.embed.table is None and table.codes.numel() > 0 and not table.lanes
        assert torch.equal(model.embed(ids), rows)


# ------------------------------------------------------------------------ the real pair: 1.5B with its 0.5B

PAIR_PROMPT = ("<|im_start|>user\nRename x to count and return the code:\ndef f(items):\n    x = 0\n"
               "    for item in items:\n        if item is not None:\n            x += 1\n    return x<|im_end|>\n"
               "<|im_start|>assistant\n")


@pytest.mark.slow
def test_real_pair_speculation_equals_plain_greedy(qwen15_path, qwen05_path):
    """Greedy output with the 0.5B drafting (alone, and behind lookup in a chain; fixed and auto lengths) is
    plain greedy decoding's, token for token; and with fixed lengths the 0.5B's drafts are mostly accepted (a
    draft model fed the wrong tokens or positions would still be lossless, but accepted far less)."""
    from outrider.plugins.acceptors.greedy import GreedyAcceptor
    from outrider.plugins.drafters.draft_model import DraftModelDrafter
    from outrider.plugins.drafters.lookup import LookupDrafter
    from outrider.plugins.drafters.none import NoDrafter
    from outrider.spec.chain import DrafterChain
    from outrider.spec.drafter_traits import DrafterTraits
    from outrider.spec.runner import Runner
    from outrider.spec.sampling import SamplingParams
    from outrider.testing.fixtures import cpu_target

    target = cpu_target(qwen15_path)
    prompt = target.tokenizer.encode(PAIR_PROMPT)

    def set_up(drafter):
        drafter.setup(target)
        return drafter

    # each drafter is set up once and then runs one generation after another, as a server's does (a set-up
    # 0.5B also spares this test a load per run)
    def generate(drafter, draft_max):
        runner = Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=draft_max), context=512)
        return list(runner.generate(prompt, 40, SamplingParams())), runner.stats

    expected, _ = generate(set_up(NoDrafter()), 0)
    draft = set_up(DraftModelDrafter(model=str(qwen05_path)))
    chain = DrafterChain([set_up(LookupDrafter()), draft], ["lookup", "draft-model"])  # its members set up
    for drafter, draft_max in [(draft, 4), (draft, "auto"), (chain, "auto")]:
        out, stats = generate(drafter, draft_max)
        assert out == expected, (draft_max, target.tokenizer.decode(out), target.tokenizer.decode(expected))
        assert stats.drafted > 0
        if draft_max == 4:  # fixed lengths at T = 0: the same rounds every run (auto's follow measured timings)
            assert stats.accepted >= 0.6 * stats.drafted, (stats.drafted, stats.accepted)  # measured: 29 of 40
    # a 0.5B step reads 392 MB of weights (485 MB less its token embedding: its head is a tensor of its own), a
    # 1.5B step 980 MB (1,111 less 131): 0.40 of a target step, priced so before any draft is timed
    assert abs(draft.kind.cost - 392 / 980) < 0.01, draft.kind

    # T > 0, sampled acceptor. Without q (the default) the draft only decides how many of the target's own draws
    # are kept: the output is plain sampling's, token for token, for the same seed. With q (drafter.sample) the
    # law is checked on the tiny pair above; here the real pair's sampled drafts are mostly kept on the echo.
    from outrider.plugins.acceptors.sampled import SampledAcceptor
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=7)

    def sample(drafter, draft_max):
        runner = Runner(target, drafter, SampledAcceptor(), DrafterTraits.of(drafter, draft_max=draft_max), context=512)
        return list(runner.generate(prompt, 40, params)), runner.stats

    expected, _ = sample(set_up(NoDrafter()), 0)
    out, stats = sample(draft, 4)
    assert out == expected and stats.drafted > 0, (target.tokenizer.decode(out), target.tokenizer.decode(expected))
    out, stats = sample(set_up(DraftModelDrafter(model=str(qwen05_path), sample=True)), 4)
    assert len(out) == 40 and stats.accepted >= 0.6 * stats.drafted > 0, (stats.drafted, stats.accepted)  # 31 of 31
