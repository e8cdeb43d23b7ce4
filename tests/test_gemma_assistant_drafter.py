"""The `gemma-assistant` drafter with a real (tiny) Gemma 4 target, both converted by llama.cpp's converter.

- Each round's drafts equal transformers' assistant driven from an independently computed target state: a fresh
  target forward over the certain tokens gives the hidden state of the row before t0 and the K/V of the last
  sliding and last global layer (through the target's KV-sharing map), at t0's position.
- Greedy speculation with it is token for token plain greedy decoding, on every tiny Gemma 4 variant.
- With the sampled acceptor and the assistant's q, the second and third generated tokens follow the target's
  exact law (chi-square against the law computed from the target's own distributions).
- Mismatched pairs are refused in one line naming both files.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from oracles import gemma4_fixtures  # noqa: E402
from oracles.gemma4_assistant import TransformersAssistant, cached_assistant, load_transformers_assistant  # noqa: E402
from oracles.llama_cpp import ReferenceUnavailable  # noqa: E402

from outrider.errors import ConfigError  # noqa: E402
from outrider.io.gguf import GGUFFile  # noqa: E402
from outrider.io.tokenizer import Tokenizer  # noqa: E402
from outrider.plugins.acceptors.greedy import GreedyAcceptor  # noqa: E402
from outrider.plugins.acceptors.sampled import SampledAcceptor  # noqa: E402
from outrider.plugins.backends.cpu import CPUBackend  # noqa: E402
from outrider.plugins.drafters.gemma_assistant.drafter import GemmaAssistantDrafter, target_kv_layers  # noqa: E402
from outrider.spec.drafter import DraftControls, Target  # noqa: E402
from outrider.spec.drafter_traits import DrafterTraits  # noqa: E402
from outrider.spec.runner import Runner  # noqa: E402
from outrider.spec.sampling import SamplingParams, warp  # noqa: E402
from outrider.testing.fixtures import plain_greedy  # noqa: E402
from outrider.testing.stats import chi2_test  # noqa: E402

PROMPT = [12, 40, 41, 42, 43, 12, 40, 41, 42, 43, 12, 40]
TOP_K = 2  # the fixture assistants' centroid_intermediate_top_k


def _target(variant: str) -> Target:
    try:
        _, path = gemma4_fixtures.cached_fixture(variant)
    except ReferenceUnavailable as exc:
        pytest.skip(str(exc))
    g = GGUFFile(path)
    backend = CPUBackend()
    return Target(model=backend.load_model(g), tokenizer=Tokenizer.from_gguf(g), gguf=g, backend=backend)


@pytest.fixture(scope="module")
def targets():
    return {}


def target(targets, variant):
    if variant not in targets:
        targets[variant] = _target(variant)
    return targets[variant]


def _drafter(t: Target, head: str, **options):
    _, path = cached_assistant(t.gguf.path, head)
    drafter = GemmaAssistantDrafter(model=str(path), head=head, centroid_top_k=TOP_K, **options)
    drafter.setup(t)
    return drafter


class Recording:
    """Wraps the drafter and keeps (tokens, k, drafted) for every round the runner asks for."""

    def __init__(self, inner):
        self.inner, self.rounds = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, state, tokens, k):
        draft = self.inner.propose(state, tokens, k)
        self.rounds.append((list(tokens), k, list(draft.tokens)))
        return draft


@pytest.mark.parametrize("head", ["dense", "centroids"])
def test_each_rounds_drafts_equal_transformers_from_the_targets_own_state(targets, head):
    t = target(targets, "dense")
    drafter = Recording(_drafter(t, head))
    runner = Runner(t, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=3), context=256)
    list(runner.generate(PROMPT, 16, SamplingParams()))
    hf_dir, _ = cached_assistant(t.gguf.path, head)
    oracle = TransformersAssistant(load_transformers_assistant(hf_dir))
    model, layers = t.model, target_kv_layers(t.model)
    window = model.config.sliding_window
    embed = lambda ids: model.embed(ids.reshape(-1)).reshape(*ids.shape, -1) * model.embed_scale
    checked = 0
    for tokens, k, drafted in drafter.rounds:
        pos = len(tokens) - 1
        cache = model.new_cache(pos)
        _, hidden = model.forward(torch.tensor(tokens[:-1]), 0, cache, hidden=True)
        first = max(0, pos - window + 1)
        swa_keys, swa_values = cache.read(layers["swa"], pos)
        kv = {"sliding_attention": (swa_keys[:, first:], swa_values[:, first:]),
              "full_attention": cache.read(layers["full"], pos)}
        _, want = oracle.draft(embed, tokens[-1], hidden[-1], pos, kv, k)
        assert drafted == want, f"round at position {pos}: drafted {drafted}, transformers {want}"
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("variant", ["dense", "e2b", "moe"])
def test_greedy_speculation_is_plain_greedy_decoding(targets, variant):
    t = target(targets, variant)
    want = plain_greedy(t.model, PROMPT, 24)
    for draft_max in (1, 4):
        drafter = _drafter(t, "dense")
        runner = Runner(t, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=draft_max), context=256)
        got = list(runner.generate(PROMPT, 24, SamplingParams()))
        assert got == want, f"draft_max {draft_max}: {got} != plain {want}"
        assert runner.stats.drafted > 0


def _exact_laws(model, prompt: list[int], params: SamplingParams, depth: int = 3) -> list[np.ndarray]:
    """The target's exact marginal law of each of the first `depth` generated tokens (enumerating the warped
    support of the earlier ones)."""
    def law(seq):
        logits = model.forward(torch.tensor(seq), 0, model.new_cache(len(seq)))[-1]
        return warp(logits.float().cpu(), params).double().numpy()

    laws, frontier = [], [(list(prompt), 1.0)]
    for _ in range(depth):
        marginal, nxt = None, []
        for seq, weight in frontier:
            p = law(seq)
            marginal = weight * p if marginal is None else marginal + weight * p
            nxt += [(seq + [int(x)], weight * p[x]) for x in np.nonzero(p)[0]]
        laws.append(marginal)
        frontier = nxt
    return laws


@pytest.mark.slow  # 1500 generations: over a minute on a busy 2-core machine
def test_sampled_acceptor_with_the_assistants_q_is_lossless(targets):
    t = target(targets, "dense")
    params = SamplingParams(temperature=1.5, top_k=4)
    laws = _exact_laws(t.model, PROMPT[:6], params)
    drafter = _drafter(t, "dense")
    runner = Runner(t, drafter, SampledAcceptor(), DrafterTraits.of(drafter, draft_max=2), context=64)
    n, vocab = 1500, t.model.config.vocab_size
    counts = [np.zeros(vocab) for _ in laws]
    accepted = drafted = 0
    for seed in range(n):
        out = list(runner.generate(PROMPT[:6], 3, SamplingParams(temperature=1.5, top_k=4, seed=seed)))
        for i, token in enumerate(out):
            counts[i][token] += 1
        accepted, drafted = accepted + runner.stats.accepted, drafted + runner.stats.drafted
    assert drafted > n // 2 and 0 < accepted < drafted  # accepted and rejected drafts both occurred
    for i in (1, 2):  # the first token is the prefill's own sample; these go through the drafts
        stat, df, p, forbidden = chi2_test(counts[i], laws[i])
        assert forbidden == 0, f"token {i + 1}: {forbidden} draws outside the target's support"
        assert p > 1e-4, f"token {i + 1}: chi-square {stat:.1f} on {df} df, p = {p:.2e}"


def test_p_min_stops_a_round_at_an_unlikely_draft(targets):
    t = target(targets, "dense")
    drafter = Recording(_drafter(t, "dense"))
    runner = Runner(t, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=4), context=256, controls=DraftControls(draft_p_min=0.999))
    list(runner.generate(PROMPT, 12, SamplingParams()))
    assert all(not drafted for _, _, drafted in drafter.rounds)  # random weights: never that sure


def test_mismatched_pairs_are_refused_naming_both_files(targets, tmp_path):
    dense, e2b = target(targets, "dense"), target(targets, "e2b")
    _, assistant = cached_assistant(dense.gguf.path, "dense")
    with pytest.raises(ConfigError) as err:  # E2B's last global layer has other kv heads than the 31B-style one
        GemmaAssistantDrafter(model=str(assistant)).setup(e2b)
    assert str(e2b.gguf.path) in str(err.value) and str(assistant) in str(err.value)
    from outrider.testing.fixtures import ContractFixtures

    llama = ContractFixtures(tmp_path).target("llama")
    with pytest.raises(ConfigError, match="only for a gemma4 target"):
        GemmaAssistantDrafter(model=str(assistant)).setup(llama)
    with pytest.raises(ConfigError, match="not a Gemma 4 assistant") as err:
        GemmaAssistantDrafter(model=str(dense.gguf.path)).setup(dense)
    assert str(err.value).count(str(dense.gguf.path)) >= 2


@pytest.mark.parametrize("overrides, message", [({"backbone": 48}, "48-wide target"),
                                                ({"vocab_size": 320}, "fewer than the target's")])
def test_an_assistant_for_another_size_is_refused_naming_both_files(targets, overrides, message):
    dense = target(targets, "dense")
    _, assistant = cached_assistant(dense.gguf.path, "dense", **overrides)
    with pytest.raises(ConfigError, match=message) as err:
        GemmaAssistantDrafter(model=str(assistant)).setup(dense)
    assert str(dense.gguf.path) in str(err.value) and str(assistant) in str(err.value)
