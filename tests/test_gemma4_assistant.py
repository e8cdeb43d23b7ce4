"""The Gemma 4 assistant read from a GGUF written by llama.cpp's converter computes what transformers'
`Gemma4AssistantForCausalLM` computes, driven the same way (same target hidden, same shared KV, same
constant position): logits and the k chained argmax drafts, k = 1..4, for the dense tied head and the
E2B/E4B centroid-masked head. Oracle: transformers, on the checkpoint the GGUF was converted from.

Sliding layers: llama.cpp masks keys with pos - key_pos >= sliding_window; transformers' bidirectional window
(|distance| <= window, flipped) would see two more. The oracle is given exactly the keys llama.cpp lets
through, and a separate test pins the window edge.
"""

from __future__ import annotations

import pytest
import torch

from outrider.errors import ModelFileError
from outrider.io.gguf import GGUFFile
from outrider.plugins.drafters.gemma_assistant.model import Gemma4Assistant

pytest.importorskip("transformers")

from oracles.gemma4_assistant import TransformersAssistant, cached_assistant, load_transformers_assistant  # noqa: E402
from oracles.llama_cpp import ReferenceUnavailable  # noqa: E402

VOCAB, BACKBONE, WINDOW = 320, 48, 8
TOP_K = 2  # centroids kept by the fixture's masked head (GGUF files do not record it: an option)


@pytest.fixture(scope="module", params=["dense", "centroids"])
def pair(request):
    try:
        hf_dir, path = cached_assistant(None, request.param, seed=3, vocab_size=VOCAB, backbone=BACKBONE,
                                        sliding_window=WINDOW, centroid_top_k=TOP_K)
    except ReferenceUnavailable as exc:
        pytest.skip(str(exc))
    return request.param, load_transformers_assistant(hf_dir), path


def _target_state(seed: int, length: int):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(VOCAB, BACKBONE, generator=gen)
    kv = {"swa": (torch.randn(2, length, 16, generator=gen), torch.randn(2, length, 16, generator=gen)),
          "full": (torch.randn(1, length, 32, generator=gen), torch.randn(1, length, 32, generator=gen))}
    hidden = torch.randn(BACKBONE, generator=gen) * 3
    return table, kv, hidden


def _ours(model: Gemma4Assistant, table, kv, hidden, token: int, pos: int, k: int):
    rows, ids, h = [], [], hidden[None]
    for _ in range(k):
        logits, h = model.forward(model.input_rows(table[[token]], h), pos, kv)
        token = int(logits[0].argmax())
        rows.append(logits[0])
        ids.append(token)
    return torch.stack(rows), ids


@pytest.mark.parametrize("pos", [3, 21])  # inside the sliding window, and past it
def test_logits_and_k_drafts_equal_transformers(pair, pos):
    head, hf, path = pair
    model = Gemma4Assistant(GGUFFile(path), centroid_top_k=TOP_K)
    assert model.centroids_on == (head == "centroids")
    table, kv, hidden = _target_state(pos, pos)
    first = max(0, pos - WINDOW + 1)  # the keys llama.cpp lets a sliding layer see from position pos
    shared = {"sliding_attention": (kv["swa"][0][:, first:], kv["swa"][1][:, first:]), "full_attention": kv["full"]}
    embed = lambda ids: table[ids] * BACKBONE ** 0.5
    oracle = TransformersAssistant(hf)
    for k in (1, 2, 3, 4):
        want_rows, want_ids = oracle.draft(embed, 17, hidden, pos, shared, k)
        got_rows, got_ids = _ours(model, table, kv, hidden, 17, pos, k)
        assert got_ids == want_ids, f"k={k}: drafted {got_ids}, transformers {want_ids}"
        torch.testing.assert_close(got_rows, want_rows, atol=2e-4, rtol=2e-4)
    assert len(set(want_ids)) > 1 or head == "centroids"  # the chain is not stuck on one token


def test_dense_head_option_ignores_the_centroids(pair):
    head, hf, path = pair
    if head != "centroids":
        pytest.skip("the file has no centroid head")
    model = Gemma4Assistant(GGUFFile(path), head="dense")
    table, kv, hidden = _target_state(5, 12)
    logits, _ = model.forward(model.input_rows(table[[9]], hidden[None]), 12, kv)
    last = hf.model(inputs_embeds=hf.pre_projection(model.input_rows(table[[9]], hidden[None])[None]),
                    position_ids=torch.tensor([[12]]), use_cache=False,
                    shared_kv_states={"sliding_attention": (kv["swa"][0][None, :, 5:], kv["swa"][1][None, :, 5:]),
                                      "full_attention": (kv["full"][0][None], kv["full"][1][None])}).last_hidden_state
    torch.testing.assert_close(logits, hf.lm_head(last)[0], atol=2e-4, rtol=2e-4)


def test_sliding_layers_see_exactly_the_window(pair):
    _, _, path = pair
    model = Gemma4Assistant(GGUFFile(path))
    pos = 20
    table, kv, hidden = _target_state(7, pos)
    run = lambda kv: model.forward(model.input_rows(table[[4]], hidden[None]), pos, kv)[0]
    base = run(kv)

    def poked(at: int):
        keys = kv["swa"][0].clone()
        keys[:, at] += 5.0
        return run({"swa": (keys, kv["swa"][1]), "full": kv["full"]})

    torch.testing.assert_close(poked(pos - WINDOW), base, atol=0, rtol=0)  # just outside: unseen
    assert not torch.allclose(poked(pos - WINDOW + 1), base)  # oldest key inside the window


def test_a_file_that_is_not_an_assistant_is_refused(tmp_path):
    from outrider.testing.tiny_models import write_tiny_gemma3

    path = write_tiny_gemma3(tmp_path / "g3.gguf")
    with pytest.raises(ModelFileError, match="not a Gemma 4 assistant"):
        Gemma4Assistant(GGUFFile(path))


def _keys_and_tensors(path):
    """({key: (value types, value)} outside general.*, {tensor: (shape, type)}) as gguf's reader sees them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    keys = {f.name: (tuple(gguf.GGUFValueType(t).name for t in f.types), f.contents())
            for f in reader.fields.values() if not f.name.startswith(("general.", "GGUF."))}
    tensors = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name) for t in reader.tensors}
    return keys, tensors


def test_written_tiny_assistant_has_the_converters_keys_and_tensors(tmp_path):
    """The contract suite's tiny assistant (`write_tiny_gemma4_assistant`, no transformers, no converter) against
    one llama.cpp's converter writes from transformers' checkpoint for the same target (matched by the oracle's
    `matching_config`): the same keys with the same value types, the same tensors with the same shapes and
    types, the same structural values, and the same assistant configuration as our loader reads it."""
    import dataclasses

    from outrider.plugins.drafters.gemma_assistant.model import Gemma4AssistantConfig
    from outrider.testing.tiny_models import write_tiny_gemma4, write_tiny_gemma4_assistant

    target = write_tiny_gemma4(tmp_path / "tiny-gemma4.gguf")
    try:
        _, converted = cached_assistant(target, "dense")
    except ReferenceUnavailable as exc:
        pytest.skip(str(exc))
    written = write_tiny_gemma4_assistant(tmp_path / "tiny-gemma4-assistant.gguf", target)
    want_keys, want_tensors = _keys_and_tensors(converted)
    got_keys, got_tensors = _keys_and_tensors(written)
    assert GGUFFile(written).architecture == GGUFFile(converted).architecture == "gemma4-assistant"
    assert {k: types for k, (types, _) in got_keys.items()} == {k: types for k, (types, _) in want_keys.items()}
    assert got_tensors == want_tensors
    # every hyperparameter but the context length (the oracle's checkpoint says 512, the target 256); the
    # tokenizer is the assistant's own in the converted file (filler pieces of the target's vocabulary size)
    structural = lambda keys: {k: v for k, (_, v) in keys.items()
                               if not k.startswith("tokenizer.") and not k.endswith(".context_length")}
    assert structural(got_keys) == structural(want_keys)
    torch.testing.assert_close(GGUFFile(written).load("rope_freqs.weight"),
                               GGUFFile(converted).load("rope_freqs.weight"), atol=0, rtol=0)
    config = lambda path: dataclasses.replace(Gemma4AssistantConfig.from_gguf(GGUFFile(path)), context_length=0)
    assert config(written) == config(converted)
